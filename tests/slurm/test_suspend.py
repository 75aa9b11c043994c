"""A SUSPENDED train job (`scontrol suspend`, what PreemptMode=SUSPEND does) is alive, on the real cluster:
`slurmft resume` refuses it naming the job and submits nothing (the consolidation stays as it was),
`slurmft status` and `slurmft runs` say suspended, and `slurmft cancel` ends it (scancel works on a
suspended job on Slurm 22.05: no `scontrol resume` first). Before slurmft.slurm_states, resume took the
suspended run for dead, cancelled its consolidation and submitted a second train job into the same
checkpoints."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from slurmft import slurm
from slurmft.rundir import RunPaths, read_manifest
from tests.slurm.conftest import IN_ALLOCATION

pytestmark = pytest.mark.slurm


def test_suspended_train_job_is_refused_by_resume_shown_and_cancelled(
        slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft) -> None:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, train={"max_steps": 400},
                                checkpoint={"every_steps": 2},
                                prepare=IN_ALLOCATION)  # a suspended train job: no data preparation in it
    run = tmp_path / "run"
    jobs = slurmft.submit(path)
    try:
        slurmft.wait_for("checkpoint-2", lambda: slurmft.complete(run, 2), timeout=120)
        slurm_cluster.slurm("scontrol", "suspend", jobs["train"])
        slurm_cluster.wait_state(jobs["train"], "SUSPENDED", timeout=30)
        manifest_before = (run / "manifest.json").read_text()
        ours_before = {j for j, row in (slurm.squeue_jobs() or {}).items() if row["state"] != "CANCELLED"}

        code, _, err = slurmft.cli(["resume", str(run)])
        assert code == 2, err
        assert f"train job(s) {jobs['train']} still queued or running" in err and "nothing submitted" in err
        assert f"Job {jobs['train']}: suspended" in err and f"scontrol resume {jobs['train']}" in err
        assert (run / "manifest.json").read_text() == manifest_before  # no attempt, no job recorded
        assert {j for j, row in (slurm.squeue_jobs() or {}).items() if row["state"] != "CANCELLED"} == ours_before
        assert slurm_cluster.squeue_state(jobs["consolidate"]) == "PENDING"  # not cancelled
        assert slurm_cluster.squeue_reason(jobs["consolidate"]) == "Dependency"

        code, out, err = slurmft.cli(["status", str(run)])
        assert code == 0, err
        assert f"train {jobs['train']}: suspended" in out and f"`scontrol resume {jobs['train']}`" in out
        assert f"`slurmft cancel {run}`" in out
        code, out, err = slurmft.cli(["runs", str(tmp_path)])
        assert code == 0 and " suspended " in out, out

        code, out, err = slurmft.cli(["cancel", str(run)])
        assert code == 0 and jobs["train"] in out and jobs["consolidate"] in out, out + err
        slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=60)
        slurm_cluster.wait_state(jobs["consolidate"], "CANCELLED", timeout=60)
        assert [j["job_id"] for j in read_manifest(RunPaths.of(run))["jobs"]] == [jobs["train"], jobs["consolidate"]]
    finally:  # whatever failed above, leave no job of this run on the shared cluster
        ids = [j["job_id"] for j in read_manifest(RunPaths.of(run))["jobs"]]
        subprocess.run(["scancel", *ids], capture_output=True, check=False)
