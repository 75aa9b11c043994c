"""Consolidation of a real sharded (FSDP2 + DCP, 2 ranks over gloo) checkpoint into a HF model.

The checkpoints are written the way the trainer writes them (accelerate's ``save_fsdp_model`` with
SHARDED_STATE_DICT): meta-device model, ``fully_shard`` per decoder layer and at the root, weights
broadcast from rank 0, then ``dcp.save({"model": get_model_state_dict(model)})`` into
``checkpoint-<step>/pytorch_model_fsdp_0`` and rank 0 writes the COMPLETE marker. This file is also
the rank worker: ``python tests/test_consolidate.py --worker SPEC.json`` under RANK/WORLD_SIZE.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from slurmft.job.rendezvous import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
}  # fmt: skip
# What each complete checkpoint adds to every parameter (in place, in fp32, in this order), so the
# newest differs from both the base model and the older complete checkpoint.
OLDER, NEWER = 0.5, 0.25
WORDS = ["the", "a", "an", "user", "assistant", "hello", "world", "model", "data", "train", "run", "step"]


# ------------------------------------------------------------------ rank worker (runs as a script)
def _worker(spec_path: str) -> None:
    """One rank: shard each model with FSDP2, save its checkpoints with DCP, mark the complete ones."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from slurmft.checkpoints import mark_complete

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for job in spec:
        config = AutoConfig.from_pretrained(job["model"])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")  # rotary inv_freq is garbage now: non-persistent, never saved
        full = AutoModelForCausalLM.from_pretrained(job["model"]).state_dict() if rank == 0 else {}
        set_model_state_dict(
            model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        for ckpt in job["checkpoints"]:
            if ckpt["add"]:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(ckpt["add"])
            state: dict[str, Any] = {"model": get_model_state_dict(model)}
            state.update(ckpt.get("extra", {}))
            dcp.save(state, checkpoint_id=str(Path(ckpt["dir"]) / "pytorch_model_fsdp_0"))
            dist.barrier()
            if rank == 0 and ckpt["complete"]:
                mark_complete(Path(ckpt["dir"]), step=int(Path(ckpt["dir"]).name.split("-")[1]))
            dist.barrier()
    dist.destroy_process_group()


def _launch(spec: list[dict[str, Any]], tmp: Path, world_size: int = 2) -> None:
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(spec_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-3000:]}"


# ------------------------------------------------------------------ fixtures
def _tokenizer(chat_template: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = chat_template
    return fast


def _base_model(directory: Path, tie: bool, seed: int, **overrides: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}, tie_word_embeddings=tie))
    model.save_pretrained(directory)
    _tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(directory)
    return directory


def _write_run(run: Path, model_dir: Path, data: Path, **consolidate: Any) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    config = {
        "name": run.name, "output_dir": str(run), "executor": "local", "resources": {"nodes": 1},
        "model": {"name_or_path": str(model_dir)}, "data": {"datasets": [{"path": str(data)}]},
        "train": {"max_steps": 10}, "checkpoint": {"every_steps": 5}, "consolidate": consolidate,
    }  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def _run_sharing(tmp: Path, source: Path, model_dir: Path, data: Path, **consolidate: Any) -> Path:
    """A second run dir over the same checkpoints, with other consolidate settings."""
    run = _write_run(tmp, model_dir, data, **consolidate)
    (run / "checkpoints").symlink_to(source / "checkpoints")
    return run


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two runs with real 2-rank sharded checkpoints, each "trained" away from its base model.

    ``untied``: checkpoint-3 complete (every parameter + OLDER), checkpoint-5 complete and the newest
    (+ OLDER + NEWER), checkpoint-10 torn (+ 1 more, no marker).
    ``tied``: checkpoint-2 complete (+ OLDER), checkpoint-5 complete (+ OLDER + NEWER) with a tokenizer
    the trainer saved into the checkpoint and a non-model entry next to the model.
    """
    tmp = tmp_path_factory.mktemp("consolidate")
    data = tmp / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    untied = _base_model(tmp / "base-untied", tie=False, seed=0)
    tied = _base_model(tmp / "base-tied", tie=True, seed=1)
    run_u = _write_run(tmp / "run-untied", untied, data, dtype="float32")
    run_t = _write_run(tmp / "run-tied", tied, data, dtype="float32")
    spec = [
        {"model": str(untied), "checkpoints": [
            {"dir": str(run_u / "checkpoints/checkpoint-3"), "complete": True, "add": OLDER},
            {"dir": str(run_u / "checkpoints/checkpoint-5"), "complete": True, "add": NEWER},
            {"dir": str(run_u / "checkpoints/checkpoint-10"), "complete": False, "add": 1.0},
        ]},
        {"model": str(tied), "checkpoints": [
            {"dir": str(run_t / "checkpoints/checkpoint-2"), "complete": True, "add": OLDER},
            {"dir": str(run_t / "checkpoints/checkpoint-5"), "complete": True, "add": NEWER,
             "extra": {"trainer_state": {"step": 5, "note": "not a tensor"}}},
        ]},
    ]  # fmt: skip
    _launch(spec, tmp)
    _tokenizer("CHECKPOINT {{ messages[0]['content'] }}").save_pretrained(run_t / "checkpoints/checkpoint-5")
    return {"tmp": tmp, "data": data, "untied": untied, "tied": tied, "run_untied": run_u, "run_tied": run_t}


def _load(directory: Path) -> tuple[Any, dict[str, list[str]]]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype="auto", output_loading_info=True)
    return model.eval(), info


def _assert_clean_load(info: dict[str, Any]) -> None:
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), f"{kind}: {info[kind]}"


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 42, 999, 3]])).logits


def _trained(base: dict[str, torch.Tensor], *adds: float) -> dict[str, torch.Tensor]:
    """The weights the worker saved: ``base`` plus each of ``adds`` in turn (same fp32 operations)."""
    out = {}
    for name, tensor in base.items():
        for add in adds:
            tensor = tensor + add
        out[name] = tensor
    return out


def _assert_newest(got: dict[str, torch.Tensor], base: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """``got`` holds the newest checkpoint (base + OLDER + NEWER) in ``dtype``; every tensor differs from
    the base and from the older complete checkpoint (base + OLDER)."""
    newest, older = _trained(base, OLDER, NEWER), _trained(base, OLDER)
    assert got.keys() == newest.keys()
    for name, tensor in newest.items():
        assert got[name].dtype == dtype, name
        assert torch.equal(got[name], tensor.to(dtype)), name
        assert not torch.equal(got[name], base[name].to(dtype)), f"{name} is the base model's"
        assert not torch.equal(got[name], older[name].to(dtype)), f"{name} is the older checkpoint's"


def _model_with(directory: Path, state: dict[str, torch.Tensor], dtype: torch.dtype) -> Any:
    """The base model architecture holding ``state`` (a reference for logits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    return model.eval()


def _no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


# ------------------------------------------------------------------ end to end
def test_float32_is_bitwise_and_uses_newest_complete_checkpoint(env: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    from slurmft.job.consolidate.job import consolidate_run
    from tests.export_check import assert_export_matches_checkpoint

    run = env["run_untied"]
    summary = consolidate_run(str(run))
    out = run / "model"
    # checkpoint-3 is older; checkpoint-10 has no COMPLETE marker
    assert summary["checkpoint"].endswith("checkpoint-5")
    assert summary["shards"] == ["model-00001-of-00001.safetensors"]  # always the sharded layout + index
    assert (Path(summary["output"]) / "model.safetensors.index.json").is_file()
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        summary["files"]
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert summary["peak_rss_bytes"] > 0 and summary["total_bytes"] > 0

    model, info = _load(out)
    _assert_clean_load(info)
    base, _ = _load(env["untied"])
    _assert_newest(model.state_dict(), base.state_dict(), torch.float32)
    reference = _model_with(env["untied"], _trained(base.state_dict(), OLDER, NEWER), torch.float32)
    assert torch.equal(_logits(model), _logits(reference))
    report = assert_export_matches_checkpoint(run, env["untied"])  # the shared end-to-end check agrees
    assert report["checkpoint"].name == "checkpoint-5" and report["differ_from_base"] == report["tensors"]

    tok = AutoTokenizer.from_pretrained(out)
    assert (
        tok("hello world model")["input_ids"]
        == AutoTokenizer.from_pretrained(env["untied"])("hello world model")["input_ids"]
    )
    _no_leftovers(run)


def test_bfloat16_multi_shard(env: dict[str, Path], tmp_path: Path) -> None:
    from safetensors import safe_open

    from slurmft.job.consolidate.job import consolidate_run

    run = _run_sharing(
        tmp_path / "run",
        env["run_untied"],
        env["untied"],
        env["data"],
        dtype="bfloat16",
        max_shard_size="200KB",
    )
    out = tmp_path / "exported"
    summary = consolidate_run(str(run), out=str(out))
    shards = summary["shards"]
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = {}
    for shard in shards:
        assert (out / shard).stat().st_size <= 200_000 + 4096 or shard in {
            index["weight_map"]["model.embed_tokens.weight"],
            index["weight_map"]["lm_head.weight"],
        }  # a tensor larger than max_shard_size gets a file of its own
        with safe_open(str(out / shard), framework="pt") as f:
            stored.update({k: shard for k in f.keys()})  # noqa: SIM118
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == sum((out / s).stat().st_size for s in shards) - sum(
        _header_size(out / s) for s in shards
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    model, info = _load(out)
    _assert_clean_load(info)
    base, _ = _load(env["untied"])
    _assert_newest(model.state_dict(), base.state_dict(), torch.bfloat16)
    reference = _model_with(env["untied"], _trained(base.state_dict(), OLDER, NEWER), torch.bfloat16)
    assert torch.equal(_logits(model), _logits(reference))
    from tests.export_check import assert_export_matches_checkpoint

    assert_export_matches_checkpoint(run, env["untied"], export_dir=out)  # cast rule: consolidate.dtype
    _no_leftovers(tmp_path)


def _header_size(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_tied_embeddings_and_tokenizer_from_checkpoint(env: dict[str, Path]) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from slurmft.job.consolidate.job import consolidate_run

    run = env["run_tied"]
    summary = consolidate_run(str(run))
    out = run / "model"
    with safe_open(str(out / "model-00001-of-00001.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # as save_pretrained
    assert summary["tensors"] == len(names)

    model, info = _load(out)
    _assert_clean_load(info)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    base, _ = _load(env["tied"])
    assert summary["checkpoint"].endswith("checkpoint-5")  # not the older checkpoint-2
    _assert_newest(model.state_dict(), base.state_dict(), torch.float32)
    reference = _model_with(env["tied"], _trained(base.state_dict(), OLDER, NEWER), torch.float32)
    assert torch.equal(_logits(model), _logits(reference))
    from tests.export_check import assert_export_matches_checkpoint

    assert_export_matches_checkpoint(run, env["tied"])
    # The trainer saved a tokenizer into the checkpoint: that one ships, not the base model's.
    assert AutoTokenizer.from_pretrained(out).chat_template.startswith("CHECKPOINT")


def test_no_read_exceeds_the_largest_tensor(
    env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded memory, measured on the real reads: every ``dcp.load`` consolidation makes asks the
    checkpoint for at most the largest tensor's bytes (the read budget), and each tensor is read once."""
    import math

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from slurmft.job.consolidate import read_dcp
    from slurmft.job.consolidate.job import consolidate_run

    reads: list[int] = []  # tensor bytes requested by each read_data call (= one dcp.load)

    class MeasuredReader(read_dcp.CachedMetadataReader):
        """The real reader; it also adds up what each load asks for (shape x dtype of every chunk)."""

        def read_data(self, plan: Any, planner: Any) -> Any:
            md = self.read_metadata().state_dict_metadata
            reads.append(sum(math.prod(item.lengths) * md[item.dest_index.fqn].properties.dtype.itemsize
                             for item in plan.items))
            return super().read_data(plan, planner)

    monkeypatch.setattr(read_dcp, "CachedMetadataReader", MeasuredReader)
    run = _run_sharing(tmp_path / "run", env["run_untied"], env["untied"], env["data"], max_shard_size="5GB")
    consolidate_run(str(run))

    md = FileSystemReader(str(run / "checkpoints/checkpoint-5/pytorch_model_fsdp_0")).read_metadata()
    sizes = [v.size.numel() * v.properties.dtype.itemsize for k, v in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)]
    assert sum(reads) == sum(sizes)  # every model tensor read, once
    assert max(reads) <= max(sizes), (max(reads), max(sizes))  # never more than the largest tensor at once
    assert len(reads) < len(sizes)  # small tensors (norms) share a read: the budget is used, not one per tensor
    assert sum(sizes) > 4 * max(sizes)  # the bound means something: the model is much larger than one read


# ------------------------------------------------------------------ refusals
def test_incomplete_checkpoint_is_refused(env: dict[str, Path], tmp_path: Path) -> None:
    from slurmft.errors import CheckpointError
    from slurmft.job.consolidate.job import consolidate_run

    with pytest.raises(CheckpointError) as exc:
        consolidate_run(str(env["run_untied"]), checkpoint="checkpoint-10", out=str(tmp_path / "m"))
    text = exc.value.render()
    assert "COMPLETE is missing" in text
    assert "checkpoint-3 (complete), checkpoint-5 (complete), checkpoint-10 (no COMPLETE marker)" in text
    assert not (tmp_path / "m").exists()


def test_missing_checkpoints_are_refused(env: dict[str, Path], tmp_path: Path) -> None:
    from slurmft.errors import CheckpointError
    from slurmft.job.consolidate.job import consolidate_run

    with pytest.raises(CheckpointError, match="does not exist"):
        consolidate_run(str(env["run_untied"]), checkpoint="checkpoint-99", out=str(tmp_path / "m"))

    empty = _write_run(tmp_path / "empty", env["untied"], env["data"])
    with pytest.raises(CheckpointError, match="no complete checkpoint") as exc:
        consolidate_run(str(empty))
    assert "no checkpoint-<step> directories" in exc.value.render()

    # COMPLETE but no DCP model (e.g. a FULL_STATE_DICT save): say what is missing, do not fall back.
    torn = _write_run(tmp_path / "torn", env["untied"], env["data"])
    (torn / "checkpoints/checkpoint-7").mkdir(parents=True)
    (torn / "checkpoints/checkpoint-7/COMPLETE").write_text("{}\n")
    with pytest.raises(CheckpointError, match="not a complete sharded checkpoint") as exc:
        consolidate_run(str(torn))
    assert "pytorch_model_fsdp_0/.metadata is missing" in exc.value.render()
    assert not (torn / "model").exists()


@pytest.mark.parametrize(
    "layers, problem",
    [
        (1, "match no parameter of the model: model.model.layers.1."),
        (3, "not in the checkpoint: model.layers.2."),
    ],
)
def test_architecture_mismatch_is_refused_before_writing(
    env: dict[str, Path], tmp_path: Path, layers: int, problem: str
) -> None:
    from transformers import LlamaConfig

    from slurmft.errors import CheckpointError
    from slurmft.job.consolidate.job import consolidate_run

    other = tmp_path / "other-model"
    LlamaConfig(**{**TINY, "num_hidden_layers": layers}, tie_word_embeddings=False).save_pretrained(other)
    run = _run_sharing(tmp_path / "run", env["run_untied"], other, env["data"])
    with pytest.raises(CheckpointError, match="does not match the model") as exc:
        consolidate_run(str(run))
    assert problem in exc.value.render()
    assert not (run / "model").exists()
    _no_leftovers(run)


def test_missing_tokenizer_is_refused_before_writing(env: dict[str, Path], tmp_path: Path) -> None:
    from transformers import LlamaConfig

    from slurmft.errors import CheckpointError
    from slurmft.job.consolidate.job import consolidate_run

    bare = tmp_path / "config-only"
    LlamaConfig(**TINY, tie_word_embeddings=False).save_pretrained(bare)
    run = _run_sharing(tmp_path / "run", env["run_untied"], bare, env["data"])
    with pytest.raises(CheckpointError, match="no tokenizer in .*config-only") as exc:
        consolidate_run(str(run))
    assert "model.tokenizer" in exc.value.render()
    assert not (run / "model").exists()
    _no_leftovers(run)


def test_failure_midway_keeps_the_old_model(
    env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slurmft.job.consolidate.job as consolidate

    run = _run_sharing(
        tmp_path / "run", env["run_untied"], env["untied"], env["data"], max_shard_size="200KB"
    )
    consolidate.consolidate_run(str(run))
    before = {p.name: p.read_bytes() for p in (run / "model").iterdir()}

    real, calls = consolidate.write_shard, []

    def fail_on_third(reader: Any, shard: Any, path: Path, budget: int, progress: Any = None) -> None:
        calls.append(path)
        if len(calls) == 3:
            path.write_bytes(b"half a shard")
            raise OSError(28, "No space left on device")
        real(reader, shard, path, budget, progress)

    monkeypatch.setattr(consolidate, "write_shard", fail_on_third)
    with pytest.raises(OSError, match="No space left"):
        consolidate.consolidate_run(str(run))
    assert calls[0].parent != run / "model"  # it wrote into a temporary sibling
    assert {p.name: p.read_bytes() for p in (run / "model").iterdir()} == before
    _no_leftovers(run)


def test_full_disk_is_refused_up_front(
    env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slurmft.errors import CheckpointError
    from slurmft.job.consolidate import output_dir
    from slurmft.job.consolidate.job import consolidate_run

    run = _run_sharing(tmp_path / "run", env["run_untied"], env["untied"], env["data"])
    monkeypatch.setattr(
        output_dir.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 10**6)
    )
    with pytest.raises(CheckpointError, match=r"needs \d.* MB, 1.00 MB free at " + str(run)):
        consolidate_run(str(run))
    assert not (run / "model").exists()
    _no_leftovers(run)


def test_leftovers_of_a_killed_consolidation_are_removed(env: dict[str, Path], tmp_path: Path) -> None:
    from slurmft.job.consolidate.job import consolidate_run

    run = _run_sharing(tmp_path / "run", env["run_untied"], env["untied"], env["data"])
    (run / ".model.partial-dead").mkdir()
    (run / ".model.partial-dead/model.safetensors").write_bytes(b"x" * 100)
    consolidate_run(str(run))
    assert (run / "model/model-00001-of-00001.safetensors").is_file()
    _no_leftovers(run)


def test_a_second_concurrent_consolidation_is_refused(env: dict[str, Path], tmp_path: Path) -> None:
    from slurmft import locks
    from slurmft.errors import CheckpointError
    from slurmft.job.consolidate.job import consolidate_run
    from slurmft.rundir import RunPaths

    run = _run_sharing(tmp_path / "run", env["run_untied"], env["untied"], env["data"])
    with locks.held(RunPaths.consolidate_lock(run / "model"), "consolidate"):  # as a running consolidation holds it
        with pytest.raises(CheckpointError, match="another consolidation is writing .* pid"):
            consolidate_run(str(run))
        assert not (run / "model").exists()
    consolidate_run(str(run))  # released: runs
    assert (run / "model" / "model.safetensors.index.json").is_file()


def test_cli(env: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slurmft.job.consolidate.__main__ import main

    out = tmp_path / "cli-model"
    assert main([str(env["run_untied"]), "--checkpoint", str(env["run_untied"] / "checkpoints/checkpoint-5"),
                 "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    summary = json.loads(text[text.index("\n{") + 1 :])  # progress lines, then the summary
    assert summary["output"] == str(out) and (out / "model-00001-of-00001.safetensors").is_file()
    assert main([str(env["run_untied"]), "--checkpoint", "checkpoint-10"]) == 2
    assert "refusing to consolidate" in capsys.readouterr().err


# ------------------------------------------------------------------ pure helpers
def test_parse_size_and_shard_plan() -> None:
    from slurmft.job.consolidate.plan import TensorPlan, plan_shards
    from slurmft.units import parse_size  # what consolidation splits max_shard_size with

    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2**31
    with pytest.raises(ValueError):
        parse_size("5 parsecs")
    tensors = [TensorPlan(f"t{i}", f"model.t{i}", (n,), torch.float32, torch.bfloat16) for i, n in
               enumerate([10, 10, 100, 10, 10])]  # fmt: skip
    shards = plan_shards(tensors, max_shard_bytes=45)  # 20, 20, 200, 20, 20 bytes
    assert [[t.name for t in s.tensors] for s in shards] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [s.filename for s in shards][-1] == "model-00003-of-00003.safetensors"
    assert [s.filename for s in plan_shards(tensors, 10**9)] == ["model-00001-of-00001.safetensors"]


def test_dcp_key_mapping() -> None:
    from slurmft.job.consolidate.plan import model_name_of_dcp_key

    assert model_name_of_dcp_key("model.model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert model_name_of_dcp_key("model.lm_head.weight") == "lm_head.weight"
    assert model_name_of_dcp_key("model.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert model_name_of_dcp_key("optimizer.state.0.exp_avg") is None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2])


def test_the_documented_python_entry_is_the_jobs_and_a_step_imports_without_the_job() -> None:
    """docs/consolidation.md's ``from slurmft.job.consolidate import consolidate_run`` (the path from before the
    package, issue 46) is the job's own function; importing one step's file (read_dcp) does not import the job."""
    code = ("import sys; import slurmft.job.consolidate.read_dcp; "
            "assert 'slurmft.job.consolidate.job' not in sys.modules, 'the face imported the job'; "
            "from slurmft.job.consolidate import consolidate_run; "
            "from slurmft.job.consolidate import job; assert consolidate_run is job.consolidate_run; "
            "import slurmft.job.consolidate as c\n"
            "try:\n    c.no_such_name\nexcept AttributeError as e:\n    print(e)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "has no attribute 'no_such_name'" in proc.stdout
