"""Gradient accumulation on real two-rank FSDP2 (gloo, CPU): gradients stay sharded between micro-batches.

Two runs of the tiny example with the same global batch (2 ranks x 4 sequences per optimizer step):
``per_device_batch_size=1`` with ``gradient_accumulation_steps=4``, and ``per_device_batch_size=4``
without accumulation. The accumulating run's ``fsdp_report`` records the gradients after every
micro-batch of its first optimizer step: each must be a DTensor holding only this rank's shard, with
no full gradient held back inside FSDP2 (the Trainer's default ``no_sync`` keeps one per parameter,
issue 11), and as many bytes as ``slurmft estimate`` counts. Both runs must then train the same
model: losses and final weights equal within fp32 tolerance.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .helpers import launch, read_metrics, write_run

pytestmark = pytest.mark.train

STEPS = 2


def _run(tmp: Path, tiny_model: Path, batch: int, accumulation: int) -> Path:
    return write_run(tmp / "run", tiny_model, [f"train.max_steps={STEPS}", f"checkpoint.every_steps={STEPS}",
                                               f"train.per_device_batch_size={batch}",
                                               f"train.gradient_accumulation_steps={accumulation}"])


@pytest.fixture(scope="module")
def runs(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """accumulation -> finished run directory; the two jobs run side by side (2 cores, 4 ranks)."""
    planned = {acc: _run(tmp_path_factory.mktemp(f"acc{acc}"), tiny_model, 4 // acc, acc) for acc in (4, 1)}
    jobs = {acc: launch(run, job_env) for acc, run in planned.items()}
    for job in jobs.values():
        rc, out = job.wait(timeout=240)
        assert rc == 0, out[-6000:]
        assert len(re.findall(rf"slurmft rank \d: completed at step {STEPS}", out)) == 2, out[-3000:]
    return planned


def _reports(run: Path) -> list[dict]:
    return [json.loads((run / "fsdp_report" / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_every_micro_batch_leaves_only_sharded_gradients(runs: dict[int, Path]) -> None:
    for rep in _reports(runs[4]):
        micro = rep["micro_batches"]
        assert len(micro) == 4, micro
        for i, m in enumerate(micro):
            where = f"rank {rep['rank']} micro-batch {i + 1}/4: {m}"
            assert m["params_without_grad"] == 0, where
            assert m["grad_types"] == ["DTensor"], where
            assert m["sharded_grad_bytes"] == rep["local_bytes"], where  # fp32: one shard's bytes, no more
            assert m["unsharded_grad_bytes"] == 0, where  # nothing kept back for a later reduce-scatter


def test_gradient_bytes_equal_the_estimate(runs: dict[int, Path]) -> None:
    from slurmft.job.train import read_config
    from slurmft.plan import estimate as E
    from slurmft.profiles import load_profile
    from slurmft.rundir import RunPaths

    cfg = read_config(RunPaths.of(runs[4]))
    assert cfg.train.gradient_accumulation_steps == 4
    result = E.estimate(cfg, load_profile(cfg.cluster.profile))
    held = max(m["sharded_grad_bytes"] + (m["unsharded_grad_bytes"] or 0)
               for rep in _reports(runs[4]) for m in rep["micro_batches"])
    assert held == result["per_gpu"]["gradients"]


def test_accumulation_trains_like_one_big_batch(runs: dict[int, Path], tiny_model: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader, load

    acc, big = (read_metrics(runs[a]) for a in (4, 1))
    assert [m["step"] for m in acc] == [m["step"] for m in big] == list(range(1, STEPS + 1))
    for a, b in zip(acc, big, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)
    weights = []
    for run in (runs[4], runs[1]):
        path = run / "checkpoints" / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0"
        meta = FileSystemReader(str(path)).read_metadata()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
                 if hasattr(m, "size")}
        load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
        weights.append(state)
    assert weights[0].keys() == weights[1].keys() and weights[0]
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=1e-5, atol=1e-6, msg=key)
    start = load_file(str(tiny_model / "model.safetensors"))
    moved = [k for k in weights[0] if (weights[0][k] - start[k.removeprefix("model.")]).abs().max() > 1e-4]
    assert len(moved) > len(weights[0]) // 2  # the comparison is between trained weights, not two copies of the start
