"""slurmft.slurm against the real cluster: with the user's SQUEUE_*/SACCT_*/SCANCEL_*/SLURM_TIME_FORMAT
set to odd values, what the adapter parses and does is unchanged, while the same commands run with that
environment print (or cancel) something else. The parsers on recorded output: tests/test_slurm.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from slurmft import slurm
from slurmft.job.requeue import JobView
from slurmft.rundir import RunPaths, read_manifest
from tests.slurm.conftest import IN_ALLOCATION

pytestmark = [pytest.mark.slurm, pytest.mark.every_slurm]

ODD = {"SQUEUE_FORMAT": "%i", "SQUEUE_FORMAT2": "JobID:3", "SQUEUE_PARTITION": "nope", "SQUEUE_SORT": "-i",
       "SQUEUE_STATES": "PD", "SACCT_FORMAT": "jobid%3", "SLURM_TIME_FORMAT": "relative",
       "SCANCEL_STATE": "PENDING", "SCONTROL_ALL": "1"}
STABLE = ("job_id", "state", "reason", "restarts", "name", "comment")  # not elapsed: time passes


def test_the_users_slurm_environment_changes_nothing_we_parse(slurm_cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    job = slurm_cluster.sbatch("-o", "/dev/null", "-J", "odd|name", "--comment", "slurmft-run:x|y", "--wrap", "sleep 30")
    try:
        slurm_cluster.wait_state(job, "RUNNING", timeout=30)
        slurm_cluster.wait_state(job, "RUNNING", timeout=30, via="sacct")  # accounting lags a little
        queued = slurm.squeue_jobs()[job]
        acct = slurm.sacct_jobs([job])[job]
        view = JobView.parse(slurm.show_job(job).stdout)
        assert queued["name"] == "odd|name" and queued["comment"] == "slurmft-run:x|y" and queued["state"] == "RUNNING"
        assert view is not None and view.state == "RUNNING" and view.restarts == 0

        for key, value in ODD.items():
            monkeypatch.setenv(key, value)
        # the raw commands do change with this environment ...
        raw = subprocess.run(slurm.squeue_args(), capture_output=True, text=True, check=False)
        assert job not in slurm.parse_squeue(raw.stdout)  # SQUEUE_PARTITION hides it
        raw = subprocess.run(slurm.sacct_args([job]), capture_output=True, text=True, check=False)
        assert slurm.parse_sacct(raw.stdout)[job]["start"] != acct["start"]  # SLURM_TIME_FORMAT=relative
        # ... what the adapter parses does not
        again = slurm.squeue_jobs()[job]
        assert {k: again[k] for k in STABLE} == {k: queued[k] for k in STABLE}
        acct_again = slurm.sacct_jobs([job])[job]
        assert {k: acct_again[k] for k in ("state", "start", "exit_code")} == {
            k: acct[k] for k in ("state", "start", "exit_code")}
        assert JobView.parse(slurm.show_job(job).stdout) == view
        assert slurm.hostnames("n[1-2]") == ["n1", "n2"] and slurm.node_addr("n1")
        slurm.scancel([job])  # SCANCEL_STATE=PENDING would spare the running job
        slurm_cluster.wait_state(job, "CANCELLED", timeout=30)
        assert "SQUEUE_PARTITION" in os.environ  # ours is untouched
    finally:
        subprocess.run(["scancel", job], capture_output=True, check=False, env=slurm.child_env())


def _shown(slurmft, run: Path, live: bool = False) -> dict[str, dict]:
    """``status --json``'s rows (state, reason, exit code, start, end, words...): all of each row once the
    jobs ended; of a live run, all but the elapsed time."""
    rows = slurmft.status_json(run)
    return {kind: {k: v for k, v in row.items() if not (live and k == "elapsed")} for kind, row in rows.items()}


def _listed(slurmft, root: Path, live: bool = False) -> list[list[str]]:
    """``runs``' table without its age column: run, state, step, loss, score, dir; of a live run, run, state, dir."""
    code, out, err = slurmft.cli(["runs", str(root)])
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["run", "state", "step", "loss", "score", "age", "dir"], out
    return [[r[0], r[1], r[6]] if live else r[:5] + r[6:] for r in rows]


def test_the_users_slurm_environment_changes_nothing_in_status_runs_cancel_resume(
        slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands a user types, with ODD in their shell: each shows (or does) what it does without it.
    SCANCEL_STATE=PENDING would spare the running train job, SQUEUE_PARTITION=nope would make a live run
    look dead, SLURM_TIME_FORMAT=relative would turn sacct's Start into a clock time."""
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, train={"max_steps": 400},
                                checkpoint={"every_steps": 2},
                                prepare=IN_ALLOCATION)  # what Slurm's answers say: no data preparation in it
    run = tmp_path / "run"
    jobs = slurmft.submit(path)
    new: dict[str, str] = {}
    try:
        slurmft.wait_for("checkpoint-2", lambda: slurmft.complete(run, 2))
        plain = (_shown(slurmft, run, live=True), _listed(slurmft, tmp_path, live=True))
        assert plain[0]["train"]["state"] == "RUNNING" and plain[1][1][1] == "training"
        for key, value in ODD.items():
            monkeypatch.setenv(key, value)
        assert (_shown(slurmft, run, live=True), _listed(slurmft, tmp_path, live=True)) == plain

        code, out, err = slurmft.cli(["cancel", str(run)])
        assert code == 0 and jobs["train"] in out and jobs["consolidate"] in out, err
        slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=60)
        slurm_cluster.wait_state(jobs["consolidate"], "CANCELLED", timeout=60)
        slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=30, via="sacct")
        # squeue's State says COMPLETING for a moment after %T says CANCELLED (seen on 22.05)
        slurmft.wait_for("status to show the cancelled train job",
                         lambda: _shown(slurmft, run)["train"]["state"] == "CANCELLED", timeout=60)
        odd = (_shown(slurmft, run), _listed(slurmft, tmp_path))
        assert odd[0]["train"]["state"] == "CANCELLED" and f"slurmft resume {run}" in odd[0]["train"]["words"]
        assert odd[0]["train"]["start"].startswith("20") and odd[1][1][1] == "cancelled"  # a date, not relative
        with monkeypatch.context() as plain_env:
            for key in ODD:
                plain_env.delenv(key)
            assert (_shown(slurmft, run), _listed(slurmft, tmp_path)) == odd

        saved = max(m["step"] for m in slurmft.metrics(run) if slurmft.complete(run, m["step"]))
        new = slurmft.resume(run)
        attempt = read_manifest(RunPaths.of(run))["attempts"][1]
        assert attempt["previous"] == {**attempt["previous"], "job_id": jobs["train"], "state": "CANCELLED"}
        assert attempt["resumed_from_step"] == saved
        slurm_cluster.wait_state(new["train"], "RUNNING", timeout=120)
        shown = _shown(slurmft, run, live=True)
        assert (shown["train"]["job_id"], shown["train"]["state"]) == (new["train"], "RUNNING")
        assert shown["consolidate"]["job_id"] == new["consolidate"]
        code, out, err = slurmft.cli(["cancel", str(run)])
        assert code == 0 and new["train"] in out, err
        slurm_cluster.wait_state(new["train"], "CANCELLED", timeout=60)
    finally:
        subprocess.run(["scancel", *jobs.values(), *new.values()], capture_output=True, check=False,
                       env=slurm.child_env())
