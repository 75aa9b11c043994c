"""slurmft.slurm against the real cluster: with the user's SQUEUE_*/SACCT_*/SCANCEL_*/SLURM_TIME_FORMAT
set to odd values, what the adapter parses and does is unchanged, while the same commands run with that
environment print (or cancel) something else. The parsers on recorded output: tests/test_slurm.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from slurmft import slurm
from slurmft.job.requeue import JobView

pytestmark = pytest.mark.slurm

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
