"""Real two-rank FSDP2 fine-tunes on CPU (gloo): training, sharding, checkpoints, metrics, preemption, resume.

One uninterrupted reference run of examples/tiny/run.yaml (36 steps) is shared by the module; the
preempted run gets the warning signal mid-way on ONE rank only (Slurm signals every rank, but not at
the same instant: only the ranks' agreement at the step boundary keeps them in step), then is
relaunched, and its losses after the resume must equal the reference's exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from .helpers import launch, launch_like_srun, read_metrics, write_run

pytestmark = pytest.mark.train

MAX_STEPS = 36  # examples/tiny/run.yaml
EVERY = 10
METRIC_FIELDS = {"step", "loss", "learning_rate", "grad_norm", "tokens_per_s", "peak_rss_mib", "peak_gpu_mem_mib"}


@pytest.fixture(scope="module")
def reference_run(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = write_run(tmp_path_factory.mktemp("ref") / "run", tiny_model)
    rc, out = launch(run, job_env).wait(timeout=300)
    assert rc == 0, out[-6000:]
    assert len(re.findall(r"slurmft rank \d: completed at step 36", out)) == 2, out[-3000:]
    return run


def test_training_runs_and_loss_decreases(reference_run: Path) -> None:
    metrics = read_metrics(reference_run)
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    early = sum(m["loss"] for m in metrics[:5]) / 5
    late = sum(m["loss"] for m in metrics[-5:]) / 5
    assert late < 0.6 * early, (early, late)


def test_fsdp_is_really_active_on_cpu(reference_run: Path) -> None:
    reports = [json.loads((reference_run / "fsdp_report" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rep in reports:
        assert rep["distributed_type"] == "DistributedType.FSDP"
        assert rep["param_types"] == ["DTensor"], rep
        assert rep["num_dtensors"] == rep["num_tensors"] > 0
        assert rep["placements"] == ["(Shard(dim=0),)"]
        assert 0.45 <= rep["local_fraction"] <= 0.55, rep  # each rank holds ~1/world_size
        assert rep["fsdp_modules"] >= 4 + 2  # decoder layers + embeddings/head + root
    assert sum(r["local_bytes"] for r in reports) == reports[0]["full_bytes"]


def test_checkpoints_are_sharded_and_complete(reference_run: Path, tiny_model: Path) -> None:
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    root = reference_run / "checkpoints"
    ckpts = sorted(p.name for p in root.glob("checkpoint-*"))
    assert ckpts == ["checkpoint-30", "checkpoint-36"]  # keep_last 2, final save at max_steps
    with safe_open(str(tiny_model / "model.safetensors"), framework="pt") as f:
        hf_names = set(f.keys())
    for name in ckpts:
        ckpt = root / name
        assert (ckpt / "COMPLETE").is_file()
        for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
            assert (ckpt / sub / ".metadata").is_file()
            assert sorted(p.name for p in (ckpt / sub).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        for file in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
            assert (ckpt / file).is_file(), file
        keys = set(FileSystemReader(str(ckpt / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata)
        assert keys == {f"model.{k}" for k in hf_names}  # the layout consolidation reads
        assert json.loads((ckpt / "config.json").read_text())["use_cache"] is True


def test_metrics_have_the_fields(reference_run: Path) -> None:
    metrics = read_metrics(reference_run)
    for m in metrics:
        assert set(m) >= METRIC_FIELDS, m
        assert m["tokens_per_s"] > 0 and m["peak_rss_mib"] > 0 and m["grad_norm"] > 0
        assert m["peak_gpu_mem_mib"] is None  # CPU run
    assert metrics[0]["learning_rate"] < metrics[3]["learning_rate"]  # warm-up
    assert metrics[-1]["learning_rate"] < metrics[len(metrics) // 2]["learning_rate"]  # cosine decay


@pytest.fixture(scope="module")
def preempted_run(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """Launched as srun would (job 4242, restart 0); USR2 mid-run to rank 1 alone (not the rank that logs)."""
    run = write_run(tmp_path_factory.mktemp("pre") / "run", tiny_model)
    job = launch_like_srun(run, job_env, job_id="4242", restart=0)
    deadline = time.time() + 240
    while time.time() < deadline and job.running():
        steps = [m["step"] for m in read_metrics(run)]
        if steps and steps[-1] >= EVERY + 2:
            break
        time.sleep(0.1)
    assert job.running(), job.log_path.read_text()[-4000:]
    pids = job.ranks()
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGUSR2)  # rank 1 only: rank 0 stops because the ranks agree on the flag
    rc, out = job.wait(timeout=180)
    return run, rc, out


def test_preemption_stops_every_rank_at_one_step(preempted_run) -> None:
    """Only rank 1 got the signal; both ranks stop, at the same step (the all_reduce in PreemptionStop)."""
    run, rc, out = preempted_run
    assert rc == 0, out[-6000:]
    stops = re.findall(r"slurmft rank (\d): preempted at step (\d+)", out)
    assert sorted(r for r, _ in stops) == ["0", "1"], out[-3000:]
    steps = {int(s) for _, s in stops}
    assert len(steps) == 1, stops
    step = steps.pop()
    assert EVERY + 2 <= step < MAX_STEPS
    root = run / "checkpoints"
    assert (root / f"checkpoint-{step}" / "COMPLETE").is_file()
    assert (root / f"checkpoint-{step}" / "pytorch_model_fsdp_0" / ".metadata").is_file()
    markers = list((run / "requeue").iterdir())
    assert [m.name for m in markers] == ["4242-0"]  # <job id>-<SLURM_RESTART_COUNT>, for the batch script
    assert json.loads(markers[0].read_text())["step"] == step
    assert max(m["step"] for m in read_metrics(run)) == step


def test_resume_continues_bitwise_like_an_uninterrupted_run(preempted_run, reference_run: Path,
                                                            job_env: dict[str, str]) -> None:
    run, rc, _ = preempted_run
    assert rc == 0
    stopped = max(m["step"] for m in read_metrics(run))
    rc, out = launch_like_srun(run, job_env, job_id="4242", restart=1).wait(timeout=240)  # the requeued job
    assert rc == 0, out[-6000:]
    assert f"resuming from checkpoint-{stopped}" in out
    assert len(re.findall(r"slurmft rank \d: completed at step 36", out)) == 2
    resumed = [m for m in read_metrics(run) if m["step"] > stopped]
    assert [m["step"] for m in resumed] == list(range(stopped + 1, MAX_STEPS + 1))
    assert {m["restart"] for m in resumed} == {1}
    reference = {m["step"]: m for m in read_metrics(reference_run)}
    for m in resumed:
        ref = reference[m["step"]]
        assert (m["loss"], m["grad_norm"], m["learning_rate"]) == (ref["loss"], ref["grad_norm"], ref["learning_rate"])
    assert (run / "checkpoints" / "checkpoint-36" / "COMPLETE").is_file()


def test_rendezvous_fails_fast_when_a_rank_is_missing(tiny_model: Path, job_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", tiny_model)
    env = {**job_env, "SLURMFT_RENDEZVOUS_TIMEOUT": "5"}
    t0 = time.time()
    rc, out = launch_like_srun(run, env, ranks=[1]).wait(timeout=90)  # rank 0 never starts
    assert rc == 2, out[-3000:]
    assert time.time() - t0 < 60
    assert re.search(r"slurmft rank 1: setup error: rendezvous failed: rank 1 tried to reach rank 0 at "
                     r"127\.0\.0\.1:\d+ for up to 5s", out), out[-3000:]
