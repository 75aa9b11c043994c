"""Every architecture docs/first-run.md names, through the whole job: a tiny model of each, built by transformers
itself (slurmft.tiny.build_arch: ``AutoConfig.for_model``, ``save_pretrained``), trained by two CPU ranks with
FSDP2 (4 steps, a checkpoint at step 2), resumed from checkpoint-2 into a copy of the run, and consolidated.

Per architecture (one pair of runs, shared by the checks): the parameters are DTensor shards on both ranks; the
resumed run's checkpoint-4 (model and optimizer) is bitwise the uninterrupted run's; the export loads with
``from_pretrained`` with no missing or unexpected keys, its state dict bitwise the checkpoint's (transformers'
own load-time conversion turns the per-expert tensors back into the fused ones: not our code checking our
code); its tensor names are exactly those ``save_pretrained`` wrote for the base model. MoE layouts: Mixtral
(renamed ``block_sparse_moe``, w1/w3 fused), Qwen3-MoE and DeepSeek-V3 (``qwen2_moe`` conversion; MLA and a
shared expert), gpt-oss (fused on disk already); tied embeddings: Gemma, Gemma-2, Gemma-3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from slurmft.tiny import ARCHITECTURES

from .helpers import launch, read_metrics, write_run

pytestmark = pytest.mark.train

STEPS, EVERY = 4, 2
RUN_ARGS = [f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=2",
            "data.max_seq_length=128", "train.per_device_batch_size=1", "fsdp.activation_checkpointing=false"]


@pytest.fixture(scope="session")
def arch_tokenizer() -> Any:
    from slurmft.tiny import SIZES, build_tokenizer

    return build_tokenizer(SIZES["tiny"].vocab_size)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch_runs(request: pytest.FixtureRequest, arch_tokenizer: Any, job_env: dict[str, str],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path, Path]:
    """(model type, base model dir, uninterrupted run, run resumed from checkpoint-2 and consolidated)."""
    from slurmft.job.consolidate import consolidate_run
    from slurmft.tiny import build_arch

    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    model = build_arch(root / "model", arch, arch_tokenizer)
    run = write_run(root / "run", model, RUN_ARGS)
    rc, out = launch(run, job_env).wait(timeout=300)
    assert rc == 0, out[-6000:]
    resumed = root / "resumed"
    shutil.copytree(run, resumed, ignore=shutil.ignore_patterns(f"checkpoint-{STEPS}", "model", "fsdp_report"))
    (resumed / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(run), str(resumed)))
    kept = [m for m in read_metrics(run) if m["step"] <= EVERY]
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    rc, out = launch(resumed, job_env).wait(timeout=300)
    assert rc == 0, out[-6000:]
    assert f"resuming from checkpoint-{EVERY}" in out
    consolidate_run(str(resumed))
    return arch, model, run, resumed


def _dcp(root: Path) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    out: dict[str, Any] = {}
    for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
        md = FileSystemReader(str(root / sub)).read_metadata()
        sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
              if hasattr(v, "size")}
        dcp.load(sd, checkpoint_id=str(root / sub), no_dist=True)
        out.update({f"{sub}/{k}": t for k, t in sd.items()})
    return out


def _keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    keys: set[str] = set()
    for name in files:
        with safe_open(str(directory / name), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def test_architecture_trains_sharded_resumes_bitwise_and_exports_what_save_pretrained_writes(
        arch_runs: tuple[str, Path, Path, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    arch, model_dir, run, resumed = arch_runs
    for rank in (0, 1):
        rep = json.loads((run / "fsdp_report" / f"rank{rank}.json").read_text())
        assert rep["param_types"] == ["DTensor"] and rep["num_dtensors"] == rep["num_tensors"] > 0, rep
        assert rep["local_bytes"] < rep["full_bytes"], rep
    steps = [m["step"] for m in read_metrics(resumed)]
    assert steps == list(range(1, STEPS + 1)), steps

    a = _dcp(run / "checkpoints" / f"checkpoint-{STEPS}")
    b = _dcp(resumed / "checkpoints" / f"checkpoint-{STEPS}")
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), f"{arch}: {key} differs after the resume"
    base = {k.split("/", 1)[1].removeprefix("model."): t for k, t in b.items() if k.startswith("pytorch_model")}

    exported, info = AutoModelForCausalLM.from_pretrained(resumed / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], (arch, info)
    state = exported.state_dict()
    assert set(state) - {"lm_head.weight"} <= set(base) or set(state) == set(base), (arch, set(state) ^ set(base))
    for name, tensor in base.items():
        assert torch.equal(state[name], tensor), f"{arch}: {name} in the export differs from checkpoint-{STEPS}"
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(initial[n], t) for n, t in base.items()), f"{arch}: the export is the base model"
    assert _keys(resumed / "model") == _keys(model_dir), arch
