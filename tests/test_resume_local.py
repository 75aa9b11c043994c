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
    assert "resuming" in captured.err and "consolidate job" in captured.out
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
