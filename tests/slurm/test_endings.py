"""Every way a job ends, on the real two-node cluster (docs/preemption.md): `scontrol requeue` (what
preemption with PreemptMode=REQUEUE does), the warning signal at three seeded random moments (start-up,
during a save, mid-step), a damaged newest checkpoint, and the time limit. Each run's consolidated
model is bitwise equal to the shared uninterrupted `reference` run (tests/slurm/conftest.py), and
metrics.jsonl holds every step exactly once."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from slurmft import slurm
from slurmft.config_values import slurm_time_seconds
from slurmft.rundir import RunPaths, read_manifest
from tests.slurm.conftest import IN_ALLOCATION
from tests.slurm.jobs import restarts, signal_rank_steps
from tests.tracker_check import WANDB_HOME, wandb_offline_runs

pytestmark = pytest.mark.slurm

# The config of the shared `reference` run (tests/slurm/conftest.py REFERENCE_*).
TRAIN = {"max_steps": 40}
CHECKPOINT = {"every_steps": 10, "keep_last": 2}
KILL_WAIT_S = 5  # tests/slurm/cluster.sh: KillWait=5
CHAOS_SEED = 8


def _start(slurmft, tmp_path: Path, tiny_model: Path, chat_data: Path, **sections: dict) -> tuple[Path, dict]:
    # how a job ends, saves and resumes: no data preparation in it
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, **{"train": TRAIN, "checkpoint": CHECKPOINT,
                                                                    "prepare": IN_ALLOCATION, **sections})
    return tmp_path / "run", slurmft.submit(path)


def _marker(run: Path, job: str, restart: int) -> dict:
    return json.loads((run / "requeue" / f"{job}-{restart}").read_text())


def _each_step_once(slurmft, run: Path, max_steps: int) -> dict[int, list[int]]:
    """Steps by restart; every step 1..max_steps logged exactly once."""
    rows = slurmft.metrics(run)
    steps = [m["step"] for m in rows]
    assert sorted(steps) == list(range(1, max_steps + 1)), "a step was repeated or skipped"
    by_restart: dict[int, list[int]] = {}
    for m in rows:
        by_restart.setdefault(m["restart"], []).append(m["step"])
    return by_restart


def test_scontrol_requeue_saves_at_the_next_step_and_resumes_there(
        slurm_cluster, reference: Path, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft) -> None:
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data)
    job = jobs["train"]
    slurmft.wait_for("step 13", lambda: any(m["step"] >= 13 for m in slurmft.metrics(run)))
    subprocess.run(["scontrol", "requeue", job], check=True)  # SIGTERM now, SIGKILL after KillWait
    asked = time.time()
    marker = slurmft.wait_for("the ranks' stop marker", lambda: (run / "requeue" / f"{job}-0").is_file(), timeout=30)
    marker = _marker(run, job, 0)
    saved = marker["step"]
    assert marker["saved"] and marker["signal"] == "SIGTERM" and saved > 13  # not the periodic checkpoint-10
    complete = json.loads((run / "checkpoints" / f"checkpoint-{saved}" / "COMPLETE").read_text())
    assert complete["t"] - asked < KILL_WAIT_S, "the save did not finish within KillWait"
    slurm_cluster.wait_state(job, "COMPLETED", timeout=300)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    slurmft.assert_same_model(run / "model", reference)

    assert _marker(run, job, 0)["ended"] == "slurm_requeue"  # the batch script left the requeue to Slurm
    log = (run / "logs" / f"train-{job}.out").read_text(errors="replace")
    assert "Slurm requeues the job itself" in log and "requeueing job" not in log
    by_restart = _each_step_once(slurmft, run, TRAIN["max_steps"])
    assert sorted(by_restart) == [0, 1] and min(by_restart[1]) == saved + 1  # resumed from that very step
    code, out, _ = slurmft.cli(["status", str(run)])
    assert code == 0 and f"steps 1-{saved}" in out and "saved, then requeued by Slurm (scontrol requeue or preemption)" in out


def _caught(pid: int) -> int:
    """The signal mask a process catches (SigCgt of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    return 0


def _handlers_installed(slurmft, job: str) -> bool:
    """Both ranks run and catch SIGUSR2 (12) and SIGTERM (15)."""
    pids = slurmft.rank_pids(job)
    want = (1 << (12 - 1)) | (1 << (15 - 1))
    try:
        return len(pids) == 2 and all(_caught(pid) & want == want for pid in pids.values())
    except OSError:
        return False


def test_chaos_three_seeded_warning_signals(slurm_cluster, reference: Path, tiny_model: Path, chat_data: Path,
                                            tmp_path: Path, slurmft) -> None:
    rng = random.Random(CHAOS_SEED)
    startup_delay = round(rng.uniform(0.2, 4.0), 2)  # after both ranks caught the signals, before the first step
    mid_step = rng.randint(3, 7)  # mid-run: once this step is logged
    save_step = rng.choice([20, 30])  # while this checkpoint is being written
    with slurmft.capsys.disabled():  # shown in the test output, not only on failure
        print(f"\nchaos seed {CHAOS_SEED}: start-up +{startup_delay}s, after step {mid_step}, "
              f"during checkpoint-{save_step}")
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data)
    job = jobs["train"]

    # 1. start-up (restart 0): the ranks exist and caught the signals, no step yet
    slurmft.wait_for("both ranks' handlers", lambda: _handlers_installed(slurmft, job), timeout=120, poll=0.05)
    time.sleep(startup_delay)
    assert not slurmft.metrics(run), "the start-up moment came after the first step"
    signal_rank_steps(job)
    slurmft.wait_for("restart 1", lambda: restarts(job) >= 1, timeout=120)
    first = _marker(run, job, 0)
    assert first["saved"] is False and first["step"] == 0  # stopped before the first step: no save
    assert not list((run / "checkpoints").glob("checkpoint-*"))

    # 2. mid-run (restart 1): saves at the next step boundary
    slurmft.wait_for(f"step {mid_step}", lambda: any(m["step"] >= mid_step for m in slurmft.metrics(run)))
    signal_rank_steps(job)
    slurmft.wait_for("restart 2", lambda: restarts(job) >= 2, timeout=120)
    second = _marker(run, job, 1)
    assert second["saved"] and second["step"] >= mid_step and slurmft.complete(run, second["step"])

    # 3. during the save of checkpoint-<save_step> (restart 2; asynchronous, checkpoint.async's default): that save
    # completes, it is not dropped. A signal seen while it is staged (training waits for that part) stops right
    # after it with no second save, as a synchronous save would; one seen once the write went to the background
    # stops at the next step boundary, which waits for that write and then saves its own step synchronously
    ckpt = run / "checkpoints" / f"checkpoint-{save_step}"
    slurmft.wait_for(f"{ckpt.name} being written", lambda: ckpt.is_dir(), timeout=240, poll=0.005)
    during = not (ckpt / "COMPLETE").exists()
    signal_rank_steps(job)
    during = during and not (ckpt / "COMPLETE").exists()  # still unfinished once the signal was sent
    with slurmft.capsys.disabled():
        print(f"signal sent while {ckpt.name} had no COMPLETE: {during}")
    slurmft.wait_for("restart 3", lambda: restarts(job) >= 3, timeout=120)
    third = _marker(run, job, 2)
    assert third["saved"] and slurmft.complete(run, save_step)  # the save in flight was finished first
    assert third["step"] in (save_step, save_step + 1)

    slurm_cluster.wait_state(job, "COMPLETED", timeout=300)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    slurmft.assert_same_model(run / "model", reference)
    by_restart = _each_step_once(slurmft, run, TRAIN["max_steps"])
    assert 0 not in by_restart  # the start-up attempt logged no step
    assert min(by_restart[1]) == 1 and min(by_restart[2]) == second["step"] + 1
    assert min(by_restart[3]) == third["step"] + 1
    complete_files = json.loads((run / "checkpoints" / "checkpoint-40" / "COMPLETE").read_text())
    assert complete_files["bytes"] == sum(complete_files["files"].values()) > 0 and complete_files["save_s"] > 0
    code, out, _ = slurmft.cli(["status", str(run)])
    assert code == 0 and "stopped during start-up (no save), requeued" in out


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(
        slurm_cluster, reference: Path, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Also W&B, offline, under the user's own WANDB_RUN_ID (exported for submit and resume): the resumed job
    logs into that run and does not send again the steps the fallback trains a second time."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_RUN_ID": "my-own-wandb-run",
                       **{k: str(tmp_path / "wandb-home" / k) for k in WANDB_HOME}}.items():
        monkeypatch.setenv(key, value)
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data, train={"max_steps": 40, "report_to": ["wandb"]})
    slurmft.wait_for("checkpoint-20", lambda: slurmft.complete(run, 20))
    # and past it: a step is logged after its boundary, so the scancel below is seen at step 22 or later and
    # its save is newer than checkpoint-20 (on a loaded machine it could land at step 20's own boundary,
    # where no second save of step 20 is made: 'assert 20 > 20')
    slurmft.wait_for("step 21 logged", lambda: any(m.get("step", 0) > 20 for m in slurmft.metrics(run)))
    subprocess.run(["scancel", jobs["train"]], check=True)  # saves at the next step, stays cancelled
    slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=120)
    newest = _marker(run, jobs["train"], 0)["step"]
    assert newest > 20
    shard = run / "checkpoints" / f"checkpoint-{newest}" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # a torn write the marker cannot know about
        f.truncate(size // 2)

    code, out, _ = slurmft.cli(["status", str(run)])
    assert code == 0 and "checkpoint-20" in out  # the damaged one is not offered
    new = slurmft.resume(run)
    attempt = read_manifest(RunPaths.of(run))["attempts"][1]
    assert attempt["resumed_from_step"] == 20
    slurm_cluster.wait_state(new["train"], "COMPLETED", timeout=300)
    slurm_cluster.wait_state(new["consolidate"], "COMPLETED", timeout=240)
    slurmft.assert_same_model(run / "model", reference)
    log = (run / "logs" / f"train-{new['train']}.out").read_text(errors="replace")
    assert (f"skipping damaged checkpoint checkpoint-{newest}: pytorch_model_fsdp_0/__1_0.distcp is {size // 2} "
            f"bytes, COMPLETE says {size}") in log
    assert "resuming from checkpoint-20" in log
    assert min(m["step"] for m in slurmft.metrics(run) if m["job_id"] == new["train"]) == 21

    # scancel's SIGTERM also ended W&B's service in the first job: its rows stop at or before the step it
    # saved; the resumed job (steps 21..40) sends only the steps after that one, into the user's run
    offline = wandb_offline_runs(run)
    assert [(o["dir"].name.endswith("-my-own-wandb-run"), o["id"]) for o in offline] == [(True, "my-own-wandb-run")] * 2
    first, second = ([row["_step"] for row in o["rows"]] for o in offline)
    assert first == list(range(1, len(first) + 1)) and 10 < len(first) <= newest
    assert second == list(range(newest + 1, 41))
    record = json.loads((run / "tracker.json").read_text())["wandb"]
    assert record["id"] == "my-own-wandb-run"
    assert [(a["job_id"], a["first_step"]) for a in record["attempts"]] == [(jobs["train"], 1), (new["train"], newest + 1)]


def test_time_limit_saves_requeues_and_finishes(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                tmp_path: Path, slurmft) -> None:
    """The warning signal Slurm itself sends lead_time_s before the time limit (``--signal``): the ranks save at
    the next step boundary, the batch script requeues, the next allocation resumes from that step and finishes.

    The limit is brought within reach at a known moment, once training runs, whatever this machine's speed: the
    test lowers it as the doctor's probe does (``scontrol update TimeLimit=``, to 90-150 s from now, so slurmctld's
    next time-limit pass, every 30 s, sends the warning: it sends at most 30 s early). Once the ranks stopped it
    raises the limit again, so the second allocation finishes instead of meeting the same early warning (with a
    fixed short limit, a slow machine needed more allocations than max_requeues allowed)."""
    max_steps = 240  # the warning comes at most ~35 s after step 5: ~100 steps at ~3 steps/s (the micro model)
    lead = 120
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data, train={"max_steps": max_steps},
                       checkpoint={"every_steps": 120, "keep_last": 2}, cluster={"time": "00:10:00"},
                       data={"max_seq_length": 128},  # the rate above
                       preemption={"lead_time_s": lead, "max_requeues": 1})
    job = jobs["train"]
    slurmft.wait_for("step 5", lambda: any(m["step"] >= 5 for m in slurmft.metrics(run)), timeout=300)
    run_time = slurm_time_seconds(slurm.parse_show(slurm.show_job(job).stdout)["RunTime"])
    assert slurm.set_time_limit(job, -(-(run_time + 90) // 60)).ok  # the end 90-150 s away: within lead + 30 s
    slurmft.wait_for("the ranks' stop marker", lambda: (run / "requeue" / f"{job}-0").is_file(), timeout=120,
                     poll=0.05)
    assert slurm.set_time_limit(job, 10).ok
    slurm_cluster.wait_state(job, "COMPLETED", timeout=600)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    first = _marker(run, job, 0)
    assert first["saved"] and 5 <= first["step"] < max_steps and first["ended"] == "warning"
    by_restart = _each_step_once(slurmft, run, max_steps)
    assert sorted(by_restart) == [0, 1] and min(by_restart[1]) == first["step"] + 1
    log = (run / "logs" / f"train-{job}.out").read_text(errors="replace")
    assert "requeueing job" in log and "restart=1" in log and f"resuming from checkpoint-{first['step']}" in log
    assert (run / "model" / "model.safetensors.index.json").is_file()
