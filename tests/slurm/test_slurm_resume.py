"""`slurmft resume` and `slurmft consolidate` on the real two-node cluster: a killed rank, a `scancel`, the
requeue budget used up and a failed consolidation each end a run; the command continues it from the
newest complete checkpoint, and the consolidated model is bitwise equal to an uninterrupted run of the
same config (one reference run per session, tests/slurm/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from slurmft.rundir import RunPaths, read_manifest, write_manifest
from tests.conftest import REPO_ROOT, need_model_job_python
from tests.export_check import assert_export_matches_checkpoint
from tests.slurm.conftest import IN_ALLOCATION

TINY_TASK = REPO_ROOT / "examples" / "tiny" / "tasks" / "tiny_choice.yaml"

pytestmark = pytest.mark.slurm

# The config of the shared `reference` run (tests/slurm/conftest.py REFERENCE_*): the models must be equal.
TRAIN = {"max_steps": 40}
CHECKPOINT = {"every_steps": 10, "keep_last": 2}


def _start(slurmft, tmp_path: Path, tiny_model: Path, chat_data: Path, **sections: dict) -> tuple[Path, dict]:
    # how a run that died continues: no data preparation in it
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, **{"train": TRAIN, "checkpoint": CHECKPOINT,
                                                                    "prepare": IN_ALLOCATION, **sections})
    return tmp_path / "run", slurmft.submit(path)


def _resume(slurmft, run: Path, *overrides: str) -> dict[str, str]:
    return slurmft.resume(run, *overrides)


def _cancelled_by_slurm(slurm_cluster, job_id: str) -> None:
    """The consolidation of a train job that ended without success: Slurm cancels it (--kill-on-invalid-dep=yes,
    issue 47), it does not wait forever in DependencyNeverSatisfied."""
    slurm_cluster.wait_state(job_id, "CANCELLED", timeout=60)
    assert slurm_cluster.squeue_reason(job_id) == "DependencyNeverSatisfied"


def test_killed_rank_then_resume(slurm_cluster, reference: Path, tiny_model: Path, chat_data: Path,
                                 tmp_path: Path, slurmft) -> None:
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data)
    slurmft.wait_for("checkpoint-10", lambda: slurmft.complete(run, 10))
    code, _, err = slurmft.cli(["resume", str(run)])  # a live run is refused, naming the job
    assert code == 2 and f"train job(s) {jobs['train']} still queued or running" in err
    pid = slurmft.wait_for("rank 1's process", lambda: slurmft.rank_pid(jobs["train"], 1), timeout=30)
    os.kill(pid, signal.SIGKILL)  # an OOM kill, a segfault: the rank is gone without a word
    slurm_cluster.wait_state(jobs["train"], "FAILED", timeout=120)
    _cancelled_by_slurm(slurm_cluster, jobs["consolidate"])
    killed_at = max(m["step"] for m in slurmft.metrics(run))
    assert killed_at < TRAIN["max_steps"]

    new = _resume(slurmft, run)
    slurm_cluster.wait_state(new["train"], "COMPLETED", timeout=300)
    slurm_cluster.wait_state(new["consolidate"], "COMPLETED", timeout=240)
    slurmft.assert_same_model(run / "model", reference)
    assert assert_export_matches_checkpoint(run, tiny_model)["checkpoint"].name == "checkpoint-40"

    steps = [m["step"] for m in slurmft.metrics(run) if m["job_id"] == new["train"]]
    assert min(steps) == 11 and max(steps) == TRAIN["max_steps"]  # resumed from checkpoint-10
    # the new consolidation ran exactly once; the stale one never ran
    assert [p.name for p in (run / "logs").glob("consolidate-*.out")] == [f"consolidate-{new['consolidate']}.out"]
    manifest = read_manifest(RunPaths.of(run))
    attempt = manifest["attempts"][1]
    assert attempt["how"] == "resume" and attempt["resumed_from_step"] == 10
    assert attempt["previous"]["job_id"] == jobs["train"] and attempt["previous"]["state"] == "FAILED"
    assert attempt["cancelled"] == []  # Slurm had cancelled the consolidation already: nothing stale
    code, out, _ = slurmft.cli(["status", str(run)])
    assert code == 0
    attempts = [line for line in out.splitlines() if line.startswith(("  1. job", "  2. job"))]
    assert attempts[0].startswith(f"  1. job {jobs['train']} restart 0 (submit") and "failed, resumed by hand" in attempts[0]
    assert attempts[1].startswith(f"  2. job {new['train']} restart 0 (resume, from step 10): steps 11-40")
    assert attempts[1].endswith("completed")
    assert f"model: {run / 'model'}" in out
    assert (run / "report.md").is_file() and (run / "loss.png").is_file()  # written by the consolidation job
    rows = slurmft.status_json(run)
    assert rows["train"]["job_id"] == new["train"] and rows["train"]["state"] == "COMPLETED"
    # finished now: resume says so, with the model, and submits nothing
    code, out, _ = slurmft.cli(["resume", str(run)])
    assert code == 0 and "is finished" in out and f"model: {run / 'model'}" in out
    assert len(read_manifest(RunPaths.of(run))["jobs"]) == 4


def _served(tmp_path: Path) -> dict[str, dict]:
    """The serve and eval sections (docs/serve-eval.md): vLLM's CPU build and lm-eval in CI's venvs, small."""
    small = {"gpus": 0, "cpus_per_task": 1, "mem": "8G", "time": "00:10:00"}
    return {"serve": {"python": need_model_job_python("serve"), "prompts": 2, "max_new_tokens": 8, "resources": small},
            "eval": {"python": need_model_job_python("eval"), "tasks": [str(TINY_TASK)], "limit": 8, "backend": "hf",
                     "resources": small}}


def test_scancel_then_resume(slurm_cluster, reference: Path, tiny_model: Path, chat_data: Path,
                             tmp_path: Path, slurmft) -> None:
    """... a run preempted once (the warning signal: saved and requeued under the same job id, the jobs chained after
    it still waiting), then cancelled, with the jobs after consolidation: the cancel takes them along (Slurm
    cancels them with the consolidation they wait on), the resume chains new ones, and they run once the new
    consolidation succeeds."""
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data, **_served(tmp_path))
    assert set(jobs) == {"train", "consolidate", "serve", "eval"}
    recorded = {j["kind"]: j for j in read_manifest(RunPaths.of(run))["jobs"]}
    assert recorded["serve"]["dependency"] == recorded["eval"]["dependency"] == f"afterok:{jobs['consolidate']}"
    slurmft.wait_for("step 4", lambda: any(m["step"] >= 4 for m in slurmft.metrics(run)))
    subprocess.run(["scancel", "--signal=USR2", jobs["train"]], check=True)  # what --signal=USR2@lead sends
    first = run / "requeue" / f"{jobs['train']}-0"  # written at the save, "ended" added once the batch shell decides
    preempted = slurmft.wait_for("the requeue decision", lambda: first.is_file() and "ended" in (
        marker := json.loads(first.read_text())) and marker, timeout=120)
    assert preempted["saved"] and preempted["ended"] == "warning" and preempted["decision"] == "requeue"
    slurmft.wait_for("step 12 after the requeue", lambda: any(m["step"] >= 12 and m["restart"] == 1
                                                              for m in slurmft.metrics(run)))
    for kind in ("consolidate", "serve", "eval"):  # the requeue kept them waiting on the same job ids
        assert slurm_cluster.squeue_state(jobs[kind]) == "PENDING", kind
    subprocess.run(["scancel", jobs["train"]], check=True)  # SIGTERM to every rank and the batch shell
    cancelled_at = time.time()
    slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=120)
    _cancelled_by_slurm(slurm_cluster, jobs["consolidate"])
    for kind in ("serve", "eval"):  # they waited on that consolidation: Slurm cancels them too
        _cancelled_by_slurm(slurm_cluster, jobs[kind])
    # the ranks saved at the next step boundary, within KillWait (5 s here), and the job stayed cancelled
    marker = json.loads((run / "requeue" / f"{jobs['train']}-1").read_text())
    saved = marker["step"]
    assert marker["saved"] and marker["signal"] == "SIGTERM" and marker["ended"] == "cancelled"
    assert saved > 12 and saved > preempted["step"] and slurmft.complete(run, saved) and saved == max(m["step"] for m in slurmft.metrics(run))
    assert json.loads((run / "checkpoints" / f"checkpoint-{saved}" / "COMPLETE").read_text())["t"] - cancelled_at < 5
    log = (run / "logs" / f"train-{jobs['train']}.out").read_text(errors="replace")
    before, _, after = log.partition(f"job={jobs['train']} restart=1 ")  # one log: both allocations of the job id
    assert "requeueing job" in before and "cancelled (scancel) and is not requeued" in after
    assert "requeueing job" not in after
    assert slurm_cluster.squeue_state(jobs["train"]) == "CANCELLED"  # not requeued (a requeue would be PENDING)
    rows = slurmft.status_json(run)
    assert f"slurmft resume {run}" in rows["train"]["words"]
    assert f"slurmft resume {run}" in rows["consolidate"]["words"]

    # a world size that cannot keep the global batch (2 ranks x 2 sequences) is refused in words, nothing submitted
    before = (run / "manifest.json").read_text(), (run / "config.yaml").read_text()
    code, _, err = slurmft.cli(["resume", str(run), "resources.gpus_per_node=3"])
    assert code == 2 and "6 ranks cannot keep the global batch of 4 sequences" in err
    assert ((run / "manifest.json").read_text(), (run / "config.yaml").read_text()) == before

    new = _resume(slurmft, run, "cluster.time=00:14:00")  # an allowed override: where/how, not what
    assert "#SBATCH --time=00:14:00" in (run / "scripts" / "train.sbatch").read_text()
    slurm_cluster.wait_state(new["train"], "COMPLETED", timeout=300)
    slurm_cluster.wait_state(new["consolidate"], "COMPLETED", timeout=240)
    slurmft.assert_same_model(run / "model", reference)
    attempt = read_manifest(RunPaths.of(run))["attempts"][1]
    assert attempt["previous"]["state"] == "CANCELLED" and attempt["overrides"] == ["cluster.time=00:14:00"]
    assert attempt["resumed_from_step"] == saved  # from the step scancel stopped at, not checkpoint-10
    assert min(m["step"] for m in slurmft.metrics(run) if m["job_id"] == new["train"]) == saved + 1
    # the jobs after consolidation, re-chained by the resume, ran after the new consolidation. lm-eval scored the model
    # and the base. vLLM refused the model, as a deployer would have met it: vLLM's CPU build has no attention kernel
    # for the micro model's head size (16; the tiny example's 32 serves: tests/test_serve_eval_local.py). The check
    # says so in vLLM's own words, the job fails, `status` says why, and the model stays.
    assert attempt["serve_job"] == new["serve"] and attempt["eval_job"] == new["eval"]
    slurm_cluster.wait_state(new["eval"], "COMPLETED", timeout=400)
    scores = json.loads((run / "eval" / "summary.json").read_text())["tasks"]["tiny_choice"]
    assert all(cell["base"] is not None and cell["finetuned"] is not None for cell in scores.values())
    slurm_cluster.wait_state(new["serve"], "FAILED", timeout=400)
    served = json.loads((run / "serve" / "result.json").read_text())
    assert not served["ok"] and served["problems"][0].startswith("vLLM refused the model (model): ")
    assert any("Unsupported CPU attention configuration: head_dim=16" in p for p in served["problems"]), served
    slurmft.assert_same_model(run / "model", reference)  # the model stays as consolidated
    code, out, _ = slurmft.cli(["status", str(run)])
    assert f"serve {new['serve']}: failed" in out and f"slurmft serve {run}" in out, out
    assert "serve check FAILED: vLLM refused the model" in out and "head_dim=16" in out, out
    assert "tiny_choice acc,none" in out


def test_budget_used_up_then_resume_then_failed_consolidation_redone(
        slurm_cluster, reference: Path, tiny_model: Path, chat_data: Path, tmp_path: Path, slurmft) -> None:
    run, jobs = _start(slurmft, tmp_path, tiny_model, chat_data, preemption={"max_requeues": 0, "lead_time_s": 30})
    slurmft.wait_for("step 4", lambda: any(m["step"] >= 4 for m in slurmft.metrics(run)))
    subprocess.run(["scancel", "--signal=USR2", jobs["train"]], check=True)  # the warning signal
    slurm_cluster.wait_state(jobs["train"], "FAILED", timeout=120)
    log = (run / "logs" / f"train-{jobs['train']}.out").read_text(errors="replace")
    assert "preemption.max_requeues" in log
    saved = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("checkpoint-*") if slurmft.complete(run, int(p.name.split("-")[1])))
    assert 4 <= saved < TRAIN["max_steps"]
    _cancelled_by_slurm(slurm_cluster, jobs["consolidate"])

    (run / "model").write_text("in the way")  # the consolidation's output location is unusable
    new = _resume(slurmft, run)
    attempt = read_manifest(RunPaths.of(run))["attempts"][1]
    assert "requeue budget" in attempt["previous"]["ended"] and attempt["resumed_from_step"] == saved
    slurm_cluster.wait_state(new["train"], "COMPLETED", timeout=300)
    slurm_cluster.wait_state(new["consolidate"], "FAILED", timeout=240)
    rows = slurmft.status_json(run)
    assert f"slurmft consolidate {run}" in rows["consolidate"]["words"]

    (run / "model").unlink()  # fixed: now `slurmft consolidate` produces the model
    code, out, err = slurmft.cli(["consolidate", str(run)])
    assert code == 0, err
    job = out.split("consolidate job: ")[1].split()[0]
    assert f"follow with: slurmft logs {run} --job consolidate -f" in out
    slurm_cluster.wait_state(job, "COMPLETED", timeout=240)
    slurmft.assert_same_model(run / "model", reference)
    assert any(j["job_id"] == job and j["kind"] == "consolidate" for j in read_manifest(RunPaths.of(run))["jobs"])

    # --here: in this process, into another directory, same bytes
    code, out, err = slurmft.cli(["consolidate", str(run), "--here", "--out", str(tmp_path / "here")])
    assert code == 0, err
    slurmft.assert_same_model(tmp_path / "here", reference)
    here = [j for j in read_manifest(RunPaths.of(run))["jobs"] if j.get("here")]
    assert len(here) == 1 and here[0]["state"] == "COMPLETED"


def test_job_the_manifest_missed_is_shown_and_cancelled(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                        tmp_path: Path, slurmft) -> None:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, train={"max_steps": 400},
                                checkpoint={"every_steps": 200},
                                prepare=IN_ALLOCATION)  # a job the manifest missed: no data preparation in it
    jobs = slurmft.submit(path)
    run = RunPaths.of(tmp_path / "run")
    # a submit killed after sbatch accepted the consolidation job, before the manifest recorded it
    manifest = read_manifest(run)
    manifest["jobs"] = [j for j in manifest["jobs"] if j["kind"] == "train"]
    write_manifest(run, manifest)
    code, out, err = slurmft.cli(["status", str(run.root), "--json"])
    assert code == 0, err
    rows = {r["job_id"]: r for r in json.loads(out)["jobs"]}
    assert rows[jobs["consolidate"]]["adopted"] is True and rows[jobs["consolidate"]]["kind"] == "consolidate"
    assert any(j["job_id"] == jobs["consolidate"] for j in read_manifest(run)["jobs"])  # recorded now
    code, out, _ = slurmft.cli(["cancel", str(run.root)])
    assert code == 0 and jobs["train"] in out and jobs["consolidate"] in out
    slurm_cluster.wait_state(jobs["consolidate"], "CANCELLED", timeout=60)
    slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=60)
