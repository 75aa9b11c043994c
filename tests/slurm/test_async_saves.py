"""Asynchronous periodic saves (``checkpoint.async``, the default) on the real two-node cluster, with a write slow
enough to be caught in flight (tests/slurm/slow_writes: every fsync of the background writer takes longer).

- The warning signal while checkpoint-20 is being written in the background: that save is waited for and
  marked, the stop saves its own step synchronously, the job is requeued and the final model is bitwise equal to
  the shared uninterrupted ``reference`` run (tests/slurm/conftest.py). The rotation after the stop's save deletes
  checkpoint-10 slowly (every file a second and a half): the requeue marker is written without waiting for it
  (issue 45: the stop waited for the deletion, inside the warning's lead time), and the next attempt removes
  what was left.
- A rank killed while checkpoint-20 is being written: no COMPLETE for step 20, the job fails, and
  ``slurmft resume`` continues from checkpoint-10, bitwise equal to the same reference.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.slurm.conftest import IN_ALLOCATION
from tests.slurm.jobs import restarts, saves, signal_rank_steps

pytestmark = pytest.mark.slurm

# The config of the shared `reference` run (tests/slurm/conftest.py REFERENCE_*): the models must be equal.
TRAIN = {"max_steps": 40}
CHECKPOINT = {"every_steps": 10, "keep_last": 2}
SLOW_WRITES = Path(__file__).parent / "slow_writes"
FSYNC_DELAY_S = 0.4  # per fsync of the background writer: rank 0 makes ~15 per save, so ~6 s in flight
DELETE_DELAY_S = 1.5  # per file a checkpoint thread deletes, first attempt only: a checkpoint holds ~16 files


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs submitted by this test (they inherit this environment) write their asynchronous saves slowly."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SLOW_WRITES), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SLURMFT_SLOW_WRITES_S", str(FSYNC_DELAY_S))


def _start(slurmft, tmp_path: Path, tiny_model: Path, chat_data: Path) -> tuple[Path, dict]:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, train=TRAIN, checkpoint=CHECKPOINT,
                                prepare=IN_ALLOCATION)  # saves and requeues: no data preparation in them
    return tmp_path / "run", slurmft.submit(path)


def _in_flight(slurmft, run: Path, step: int) -> Path:
    """Wait until checkpoint-<step> is being written in the background: its directory exists, training has gone
    past it (a later step is logged) and it has no COMPLETE yet."""
    ckpt = run / "checkpoints" / f"checkpoint-{step}"
    slurmft.wait_for(f"step {step + 1} logged", lambda: any(m["step"] > step for m in slurmft.metrics(run)),
                     timeout=300, poll=0.05)
    assert ckpt.is_dir() and not (ckpt / "COMPLETE").exists(), f"{ckpt.name} was not in flight after step {step + 1}"
    return ckpt


def test_warning_signal_during_an_async_write_finishes_it_then_saves_and_requeues(
        slurm_cluster, reference: Path, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft,
        slow_writes: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMFT_SLOW_DELETES_S", str(DELETE_DELAY_S))
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data)
    job = jobs["train"]
    ckpt = _in_flight(slurmft, run, 20)
    signal_rank_steps(job)
    assert not (ckpt / "COMPLETE").exists(), "the write was done before the signal was sent"
    slurmft.wait_for("restart 1", lambda: restarts(job) >= 1, timeout=120)

    marker = json.loads((run / "requeue" / f"{job}-0").read_text())
    stopped = marker["step"]
    assert marker["saved"] and stopped > 20  # the stop came at a later step boundary, while step 20 was written
    assert slurmft.complete(run, 20) and slurmft.complete(run, stopped)
    by_step = {s["step"]: s for s in saves(run) if s["restart"] == 0}
    assert by_step[20]["mode"] == "async" and by_step[stopped]["mode"] == "sync"
    done_20 = json.loads((ckpt / "COMPLETE").read_text())["t"]
    done_stop = json.loads((run / "checkpoints" / f"checkpoint-{stopped}" / "COMPLETE").read_text())["t"]
    assert done_20 <= done_stop  # the save in flight was marked before the stop's own save
    # training went on while step 20 was written; its blocked_s counts the stop's wait for it as well
    assert any(m["step"] > 20 and m["time"] < done_20 for m in slurmft.metrics(run) if m["restart"] == 0)
    assert by_step[20]["blocked_s"] < by_step[20]["durable_s"]
    # the stop's rotation deleted checkpoint-10 (20 and the stop's checkpoint stay), as many files as a checkpoint
    # holds at 1.5 s each: the marker came right after the save, not after the deletion
    files = [f for f in (run / "checkpoints" / f"checkpoint-{stopped}").rglob("*") if f.is_file()]
    assert len(files) >= 12 and marker["t"] - done_stop < 6 * DELETE_DELAY_S, (len(files), marker["t"] - done_stop)

    slurm_cluster.wait_state(job, "COMPLETED", timeout=300)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    slurmft.assert_same_model(run / "model", reference)
    steps = slurmft.metrics(run)
    assert sorted(m["step"] for m in steps) == list(range(1, TRAIN["max_steps"] + 1))
    assert min(m["step"] for m in steps if m["restart"] == 1) == stopped + 1
    assert not list((run / "checkpoints").glob(".deleting-*"))  # the next attempt removed what the stop left
    code, out, _ = slurmft.cli(["status", str(run)])
    assert code == 0 and "saves:" in out, out


def test_rank_killed_during_an_async_write_leaves_no_complete_and_resume_takes_the_previous(
        slurm_cluster, reference: Path, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft,
        slow_writes: None) -> None:
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data)
    ckpt = _in_flight(slurmft, run, 20)
    os.kill(slurmft.rank_pid(jobs["train"], 1), signal.SIGKILL)
    slurm_cluster.wait_state(jobs["train"], "FAILED", timeout=120)
    assert ckpt.is_dir() and not (ckpt / "COMPLETE").exists()  # the torn save is never marked
    assert slurmft.complete(run, 10)

    code, out, _ = slurmft.cli(["status", str(run)])
    assert code == 0 and "checkpoint-10" in out
    new = slurmft.resume(run)
    slurm_cluster.wait_state(new["train"], "COMPLETED", timeout=300)
    slurm_cluster.wait_state(new["consolidate"], "COMPLETED", timeout=240)
    slurmft.assert_same_model(run / "model", reference)
    resumed = [m["step"] for m in slurmft.metrics(run) if m["job_id"] == new["train"]]
    assert min(resumed) == 11 and max(resumed) == TRAIN["max_steps"]  # from checkpoint-10, not the torn 20
    log = (run / "logs" / f"train-{new['train']}.out").read_text(errors="replace")
    assert "resuming from checkpoint-10" in log
