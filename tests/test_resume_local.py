"""`slurmft resume` of a local run (executor: local, 2 CPU processes with real FSDP2): the whole process
group of `slurmft submit` is killed mid-run, then `slurmft resume` continues here from the newest complete
checkpoint and ends with a model bitwise equal to an uninterrupted local run of the same config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmft.cli import main
from slurmft.rundir import RunPaths, pid_alive, read_manifest
from slurmft.watch.run_totals import read_summaries
from tests.conftest import LOCAL_ARGS
from tests.export_check import assert_same_model

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny" / "run.yaml"

pytestmark = pytest.mark.train


def test_killed_local_run_resumes_to_the_same_model(tiny_model: Path, local_tiny_run: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    args = [f"model.name_or_path={tiny_model}", *LOCAL_ARGS]  # those of the uninterrupted `local_tiny_run`
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "slurmft.cli", "submit", str(EXAMPLE), f"output_dir={killed}",
                             *args], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (killed / "checkpoints" / "checkpoint-6" / "COMPLETE").is_file():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "no complete checkpoint-6 in 240 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # submit, the local job controller and both ranks: no goodbye
        proc.wait()
    assert (killed / ".submit.lock").exists()  # the dead submit still "holds" the run directory
    # SIGKILL is sent, not yet done: a process tearing down its memory still answers kill(pid, 0) for a moment
    pids = [int(j["pid"]) for j in read_manifest(RunPaths.of(killed))["jobs"] if "pid" in j]
    deadline = time.monotonic() + 30
    while any(pid_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} still alive 30 s after SIGKILL"
        time.sleep(0.1)
    assert not (killed / "checkpoints" / "checkpoint-18" / "COMPLETE").exists()

    main(["status", str(killed), "--json"])
    rows = json.loads(capsys.readouterr().out)["jobs"]
    assert rows[-1]["state"] == "KILLED" and "slurmft resume" in rows[-1]["words"]

    # how often and how saves are written, and how often steps are logged, may change on resume (issue 47: they
    # change nothing the training computes; the async-failure message tells the user to change them): saves every 4
    # steps, synchronous, a log line every 4 steps and at the last step (18 is no multiple of 4: was not logged, so
    # status said 'step 16/18' of the finished run and a sweep could not rank it)
    overrides = ["checkpoint.every_steps=4", "checkpoint.async=false", "checkpoint.max_failed_saves=5",
                 "train.logging_steps=4"]
    main(["resume", str(killed), *overrides])
    captured = capsys.readouterr()
    assert "cleared a stale lock" in captured.err
    assert "resuming" in captured.err and "consolidation job" in captured.out
    manifest = read_manifest(RunPaths.of(killed))
    resumed = manifest["attempts"][1]
    assert resumed["how"] == "resume" and resumed["resumed_from_step"] >= 6
    assert resumed["previous"]["state"] == "KILLED"
    # the resumed train job reads the data prepared before the kill: nothing is prepared again
    assert [(j["kind"], j.get("state")) for j in manifest["jobs"]] == [
        ("prepare", "COMPLETED"), ("train", None), ("train", "COMPLETED"), ("consolidate", "COMPLETED")]
    steps = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    second = [m["step"] for m in steps if m["job_id"] == resumed["train_job"] and "event" not in m]
    assert second == [s for s in range(resumed["resumed_from_step"] + 1, 19) if s % 4 == 0 or s == 18], second
    saves = [m for m in steps if m.get("event") == "save" and m["job_id"] == resumed["train_job"]]
    assert {m["step"] for m in saves} >= {16, 18} and all(m["mode"] == "sync" for m in saves), saves
    assert resumed["overrides"] == overrides

    assert_same_model(killed / "model", local_tiny_run / "model")

    # The run's end-of-training figures cover both attempts (transformers' own cover the resumed call alone): its
    # train_loss is the uninterrupted run's (same steps, same losses), which we compute here from that run's per-step
    # losses; the killed attempt recorded no end, so its seconds are missing from train_runtime, and the log says so
    per_step = {m["step"]: m["loss"] for m in steps_of(local_tiny_run)}
    assert sorted(per_step) == list(range(1, 19))  # logged every step: each record is one step's loss
    whole = sum(per_step.values()) / 18
    [uninterrupted] = read_summaries(RunPaths.of(local_tiny_run).train_summary)
    assert uninterrupted["train_loss"] == pytest.approx(whole, rel=1e-9)  # one attempt: transformers' own figure
    assert uninterrupted["run"]["train_loss"] == pytest.approx(whole, rel=1e-9)
    [end] = read_summaries(RunPaths.of(killed).train_summary)
    assert (end["job_id"], end["from_step"], end["step"]) == (resumed["train_job"], resumed["resumed_from_step"], 18)
    own = [per_step[s] for s in range(resumed["resumed_from_step"] + 1, 19)]
    assert end["train_loss"] == pytest.approx(sum(own) / len(own), rel=1e-6)  # the resumed attempt's alone
    assert end["run"]["train_loss"] == pytest.approx(whole, rel=1e-6) and end["run"]["train_loss_steps"] == 18
    assert end["run"]["train_attempts"] == 2 and end["run"]["train_runtime"] == end["train_runtime"]
    log = (killed / "submitit" / f"{resumed['train_job']}_0_log.err").read_text()  # rank 0's, local executor
    assert "train_runtime leaves out job " in log and "killed before its end" in log
    report = (killed / "report.md").read_text()  # written by the consolidation job
    assert f"| train loss, whole run | {end['run']['train_loss']:.4f} over 18 of 18 steps " in report
    assert "> whole-run figures: train_runtime leaves out job " in report
    assert f"train_loss={end['run']['train_loss']:.4g} train_loss_steps=18 " in log
    assert f"last_attempt/train_loss={end['train_loss']:.4g} " in log


def steps_of(run: Path) -> list[dict]:
    """The logged steps of a run's metrics.jsonl (save lines apart)."""
    return [m for line in (run / "metrics.jsonl").read_text().splitlines() if "event" not in (m := json.loads(line))]
