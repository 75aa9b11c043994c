"""`slurmft cancel` of a local run (executor: local, 2 CPU processes with real FSDP2): the train job's processes end,
the `submit` that runs the run stops and says who cancelled it, and `status` says so too. submitit's job processing
points SIGTERM at a handler that ignores it, so cancel said "cancelled: JOB" and the ranks trained on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import cli

from slurmft.rundir import RunPaths, read_manifest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny" / "run.yaml"

pytestmark = pytest.mark.train


def _processes_of(run: Path) -> list[int]:
    """Processes whose command line names the run directory (the job controller and the ranks it forked)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def test_cancel_stops_a_local_run_and_status_says_who_cancelled_it(micro_model: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    # prepare.enabled=false: the train job is what cancel has to stop (a prepare job ends on SIGTERM the same way:
    # slurmft/job/entrypoint.py _begin); preparing first would only cost this test ~10 CPU-s
    submit = subprocess.Popen([sys.executable, "-m", "slurmft.cli", "submit", str(EXAMPLE), f"output_dir={run}",
                               f"model.name_or_path={micro_model}", "train.max_steps=5000", "data.max_seq_length=64",
                               "checkpoint.every_steps=1000", "prepare.enabled=false"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
            assert submit.poll() is None, submit.stderr.read() if submit.stderr else ""
            assert time.monotonic() < deadline, "no training step in 240 s"
            time.sleep(0.2)
        code, out, err = cli(["cancel", str(run)], capsys)  # the ranks are training: past submitit's handlers
        train = next(j for j in read_manifest(RunPaths.of(run))["jobs"] if j["kind"] == "train")
        assert code == 0 and out.strip() == f"cancelled: {train['job_id']}", err
        _, err = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:  # a cancel that did not stop it: leave nothing training
            os.killpg(submit.pid, signal.SIGKILL)
            submit.wait()
    assert submit.returncode == 2 and f"train job {train['job_id']} cancelled by `slurmft cancel` (" in err, err
    assert f"`slurmft resume {run}` continues" in err and "failed" not in err
    deadline = time.monotonic() + 30  # no rank left training (they were SIGTERMed through the controller)
    while left := _processes_of(run):
        if time.monotonic() > deadline:
            os.killpg(submit.pid, signal.SIGKILL)  # the group outlives its leader while one of them lives
            pytest.fail(f"processes {left} still alive 30 s after cancel")
        time.sleep(0.1)
    code, out, err = cli(["status", str(run), "--json"], capsys)
    assert code == 0, err
    row = json.loads(out)["jobs"][-1]
    assert row["state"] == "CANCELLED" and row["words"].startswith("cancelled by `slurmft cancel` ("), row
    assert f"`slurmft resume {run}`" in row["words"]
