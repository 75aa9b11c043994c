"""The sharded loader gives every rank exactly its slice of the checkpoint (two CPU ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import launch

pytestmark = pytest.mark.train


def _odd_tied_model(path: Path, dtype: str = "float32") -> Path:
    """Row counts not divisible by 2 (vocab 1001, intermediate 171) and tied embeddings: uneven shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=171, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    torch.manual_seed(1)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)
    return path


def _tensor_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118


def test_loaded_shards_equal_the_checkpoint(tiny_model: Path, job_env: dict[str, str], tmp_path: Path) -> None:
    """Sliced reads (every rank sees the files) and the scatter fallback (only rank 0 does), fp32 and bf16 files."""
    odd, odd_bf16 = _odd_tied_model(tmp_path / "odd"), _odd_tied_model(tmp_path / "oddbf16", "bfloat16")
    runs = [(tiny_model, "sliced"), (odd, "sliced"), (odd, "scatter"), (odd_bf16, "sliced"), (odd_bf16, "scatter")]
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).with_name("load_check.py")
    rc, log = launch(out, job_env, target=[str(script), str(out), *(f"{d}:{how}" for d, how in runs)]).wait(timeout=240)
    assert rc == 0, log[-4000:]
    for model_dir, how in runs:
        results = [json.loads((out / f"{model_dir.name}.{how}.rank{r}.json").read_text()) for r in (0, 1)]
        main = results[0]
        assert main["unchecked_keys"] == [] and main["params_not_in_file"] == [], main  # every key, both ways
        assert main["checked"] in (main["file_keys"], main["file_keys"] - main["tied"]), main
        assert main["mismatched"] == [], main  # bit for bit (a bf16 file: its exact float32 upcast)
        assert main["max_abs_logit_diff"] < 1e-4, main
        for res in results:
            assert res["load_method"] == how
            assert res["bad_rotary"] == []
            assert 0.45 <= res["local_fraction"] <= 0.55
        read = [res["bytes_read"] for res in results]
        if how == "sliced":  # each rank read its own rows, nobody more: together exactly the file's tensors once
            assert sum(read) == _tensor_bytes(model_dir) and all(0.4 <= r / sum(read) <= 0.6 for r in read), read
        else:
            assert read == [_tensor_bytes(model_dir), 0], read
    assert json.loads((out / "odd.sliced.rank0.json").read_text())["tied"] is True


def test_a_read_failure_on_rank_0_ends_every_rank_promptly(tiny_model: Path, job_env: dict[str, str],
                                                          tmp_path: Path) -> None:
    """Rank 0's read of one tensor fails mid-load (EIO): both ranks raise its error, in seconds, both ways."""
    key = "model.layers.2.mlp.down_proj.weight"  # half-way through the load
    out = tmp_path / "out"
    out.mkdir()
    env = {**job_env, "SLURMFT_COLLECTIVE_TIMEOUT": "600"}  # a rank left waiting would outlast the test
    script = Path(__file__).with_name("load_fault.py")
    rc, log = launch(out, env, target=[str(script), str(out), str(tiny_model), key]).wait(timeout=120)
    assert rc == 0, log[-4000:]
    for how in ("sliced", "scatter"):
        results = [json.loads((out / f"{how}.rank{r}.json").read_text()) for r in (0, 1)]
        errors = {res["error"] for res in results}
        assert len(errors) == 1, results  # the same error on every rank
        error = errors.pop()
        assert "rank 0 could not read" in error and key in error and str(tiny_model / "model.safetensors") in error
        assert "Input/output error" in error
        assert all(res["seconds"] < 30 for res in results), results


def test_each_rank_holds_its_slice_on_1d_and_hsdp_meshes(job_env: dict[str, str], tmp_path: Path) -> None:
    """4 ranks: Shard(0) over 4 (a rank with no rows) and (Replicate, Shard(0)) on 2 x 2, sliced and scattered;
    a plain module and a tiny Mixtral (fused experts read from per-expert tensors: tests/job/mesh_check.py)."""
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).with_name("mesh_check.py")
    rc, log = launch(out, job_env, nproc=4, target=[str(script), str(out)]).wait(timeout=180)
    assert rc == 0, log[-4000:]
    for rank in range(4):
        assert json.loads((out / f"rank{rank}.json").read_text())["problems"] == [], rank


def test_a_moe_checkpoint_missing_an_expert_is_named_before_anything_is_read(tmp_path: Path) -> None:
    """The header check goes through transformers' conversion: a fused expert tensor is built from its
    per-expert checkpoint tensors, so a missing expert is named by its checkpoint key, with the others."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from slurmft.errors import JobSetupError
    from slurmft.job.weights import check_weights

    config = AutoConfig.for_model("mixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                  num_local_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = check_weights(model, tmp_path)  # the checkpoint as save_pretrained wrote it: every tensor planned
    fused = next(e for e in plan.entries if e.name == "model.layers.0.mlp.experts.gate_up_proj")
    assert len(fused.keys) == 8 and fused.keys[5] == "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    assert next(e for e in plan.entries if e.name == "model.layers.0.mlp.gate.weight").keys == [
        "model.layers.0.block_sparse_moe.gate.weight"]

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.2.w1.weight"], tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(JobSetupError) as err:
        check_weights(model, tmp_path)
    assert err.value.problems == [
        "model.layers.0.block_sparse_moe.experts.2.w1.weight: missing from the checkpoint (it is part of "
        "model.layers.0.mlp.experts.gate_up_proj)",
        "model.norm.weight: missing from the checkpoint",
    ]
