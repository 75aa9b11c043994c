"""Real two-rank FSDP2 fine-tunes on CPU (gloo): training, sharding, checkpoints, metrics, preemption, resume.

One uninterrupted reference run of examples/tiny/run.yaml (36 steps, asynchronous periodic saves: the
default) is shared by the module. Its save at step 20 fails on rank 1 alone in the background (its shard's
file name is taken by a directory, made once checkpoint-10 is complete): no COMPLETE for it, both ranks
log it, training goes on with the same losses, and the saves at 30 and 36 succeed. The preempted run gets
the warning signal on ONE rank only (Slurm signals every rank, but not at the same instant: only the ranks'
agreement at the step boundary keeps them in step) while its asynchronous save of step 10 is being
written, then is relaunched, and its losses after the resume must equal the reference's exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from .helpers import launch, launch_like_srun, read_metrics, read_saves, write_run

pytestmark = pytest.mark.train

MAX_STEPS = 36  # examples/tiny/run.yaml
EVERY = 10
SEQ = ["data.max_seq_length=64"]  # the example's 256-token rows made 4x shorter: what these tests check is per step
METRIC_FIELDS = {"step", "loss", "learning_rate", "grad_norm", "tokens_per_s", "peak_rss_mib", "peak_gpu_mem_mib"}


FAILING = 2 * EVERY  # the reference run's save that fails on rank 1


@pytest.fixture(scope="module")
def reference_run(tiny_model: Path, job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = write_run(tmp_path_factory.mktemp("ref") / "run", tiny_model, SEQ)
    job = launch(run, job_env)
    done = f"checkpoint-{EVERY} complete"  # logged after its rotation (which removes directories without a marker)
    deadline = time.time() + 240
    while time.time() < deadline and job.running() and done not in job.log_path.read_text():
        time.sleep(0.05)
    assert done in job.log_path.read_text() and max(m["step"] for m in read_metrics(run)) < FAILING, \
        job.log_path.read_text()[-4000:]
    (run / "checkpoints" / f"checkpoint-{FAILING}" / "optimizer_0" / "__1_0.distcp").mkdir(parents=True)
    rc, out = job.wait(timeout=300)
    assert rc == 0, out[-6000:]
    assert len(re.findall(r"slurmft rank \d: completed at step 36", out)) == 2, out[-3000:]
    (run / "job.log").write_text(out)
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
    assert [json.loads((root / n / "COMPLETE").read_text())["asynchronous"] for n in ckpts] == [True, False]


def test_periodic_saves_are_asynchronous_and_recorded(reference_run: Path) -> None:
    """Every complete save has a metrics.jsonl line; the periodic ones were written in the background."""
    saves = read_saves(reference_run)
    assert [(r["step"], r["mode"]) for r in saves] == [(10, "async"), (30, "async"), (36, "sync")], saves
    for r in saves:
        assert r["bytes"] > 0 and r["durable_s"] > 0 and r["blocked_s"] > 0, r
    for r in saves[:2]:
        assert r["blocked_s"] < r["durable_s"], r  # training went on while the write did
    out = (reference_run / "job.log").read_text()
    assert "checkpoint-10 complete" in out and "in the background, training waited" in out


def test_a_failed_asynchronous_save_leaves_no_marker_and_training_goes_on(reference_run: Path) -> None:
    """Rank 1's background write of checkpoint-20 failed: both ranks say so, no COMPLETE, training went on to the
    end (the losses after it are the resumed run's reference, below), and rotation removed the torn directory."""
    out = (reference_run / "job.log").read_text()
    failed = re.findall(rf"\[slurmft rank(\d) [^\]]+\] asynchronous save of checkpoint-{FAILING} failed \(1 in a row; "
                        r"no COMPLETE.*rank 1: .*IsADirectoryError", out)
    assert sorted(failed) == ["0", "1"], out[-4000:]
    assert not (reference_run / "checkpoints" / f"checkpoint-{FAILING}" / "COMPLETE").exists()
    assert FAILING not in [r["step"] for r in read_saves(reference_run)]
    assert [m["step"] for m in read_metrics(reference_run)] == list(range(1, MAX_STEPS + 1))


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
    """Launched as srun would (job 4242, restart 0); USR2 to rank 1 alone (not the rank that logs) while the
    asynchronous save of step 10 is in flight (its directory exists, its marker does not yet)."""
    run = write_run(tmp_path_factory.mktemp("pre") / "run", tiny_model, SEQ)
    job = launch_like_srun(run, job_env, job_id="4242", restart=0)
    first = run / "checkpoints" / f"checkpoint-{EVERY}"
    deadline = time.time() + 240
    while time.time() < deadline and job.running() and not (first / "optimizer_0").is_dir():
        time.sleep(0.02)
    assert job.running() and not (first / "COMPLETE").exists(), job.log_path.read_text()[-4000:]
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
    assert EVERY <= step < MAX_STEPS
    if step == EVERY:  # agreed right after the asynchronous save of step 10: that save, waited for, is the last
        assert "checkpoint-10 was just saved (no second save)" in out, out[-3000:]
    else:  # agreed at a later step end: the save of step 10 was waited for, then this step saved synchronously
        assert [(r["step"], r["mode"]) for r in read_saves(run)] == [(EVERY, "async"), (step, "sync")], out[-3000:]
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
