"""Job state for a run directory: squeue for live jobs, sacct for finished ones, said in words."""

from __future__ import annotations

import os
import shutil
import subprocess
from enum import Enum
from typing import Any


class State(str, Enum):
    """The job states slurmft reasons about (Slurm's names)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    REQUEUED = "REQUEUED"
    COMPLETING = "COMPLETING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    UNKNOWN = "UNKNOWN"


LIVE = {State.PENDING, State.RUNNING, State.REQUEUED, State.COMPLETING}

REASON_WORDS = {
    "Dependency": "waiting for the train job to finish successfully",
    "DependencyNeverSatisfied": "will never start: the train job did not succeed "
    "(cancel it with `slurmft cancel RUN_DIR`, fix the cause, submit again)",
    "BeginTime": "requeued; waiting for its earliest start time",
    "Priority": "waiting in the queue (priority)",
    "Resources": "waiting for free nodes",
    "JobHeldAdmin": "held by an administrator",
    "JobHeldUser": "held (scontrol release to continue)",
    "None": "",
}


def _run(cmd: list[str]) -> str:
    """stdout of a Slurm query, or "" when it is missing, fails or hangs (a busy controller)."""
    if not shutil.which(cmd[0]):
        return ""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (subprocess.TimeoutExpired, OSError):
        return ""
    return out.stdout if out.returncode == 0 else ""


def squeue_info(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """State and reason of queued/running jobs."""
    if not job_ids:
        return {}
    text = _run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%M"])
    info = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            info[parts[0]] = {"state": parts[1], "reason": parts[2], "elapsed": parts[3]}
    return info


def sacct_info(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """Final state, elapsed time and exit code from accounting (allocation lines only)."""
    if not job_ids:
        return {}
    text = _run(["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), "-o", "JobID,State,Elapsed,ExitCode"])
    info = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            info[parts[0]] = {"state": parts[1].split()[0], "elapsed": parts[2], "exit_code": parts[3]}
    return info


def restart_count(job_id: str) -> int | None:
    """Slurm's restart count of a job still known to the controller."""
    text = _run(["scontrol", "show", "job", job_id])
    for token in text.split():
        if token.startswith("Restarts="):
            return int(token.split("=", 1)[1])
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # exited in between
        return False


def job_rows(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per job of the run (newest attempt of each kind last), with state and words."""
    jobs = manifest.get("jobs", [])
    rows: list[dict[str, Any]] = []
    if manifest.get("executor") == "local":
        for job in jobs:
            state = job.get("state") or (State.RUNNING.value if _pid_alive(int(job["pid"])) else State.UNKNOWN.value)
            rows.append({**_base(job), "state": state, "reason": "", "elapsed": str(job.get("elapsed_s", "")),
                         "restarts": 0, "words": describe(state, "")})
        return rows
    ids = [j["job_id"] for j in jobs]
    queued, acct = squeue_info(ids), sacct_info(ids)
    for job in jobs:
        jid = job["job_id"]
        q, a = queued.get(jid), acct.get(jid)
        if q:
            state, reason, elapsed = q["state"], q["reason"], q["elapsed"]
        elif a:
            state, reason, elapsed = a["state"], "", a["elapsed"]
        else:
            state, reason, elapsed = State.UNKNOWN.value, "", ""
        rows.append({**_base(job), "state": state, "reason": reason, "elapsed": elapsed,
                     "exit_code": (a or {}).get("exit_code", ""), "restarts": restart_count(jid) or 0,
                     "words": describe(state, reason)})
    return rows


def _base(job: dict[str, Any]) -> dict[str, Any]:
    return {"kind": job["kind"], "job_id": job["job_id"], "attempt": job.get("attempt", 1)}


def describe(state: str, reason: str) -> str:
    """The state in words a user can act on."""
    if reason in REASON_WORDS and REASON_WORDS[reason]:
        return REASON_WORDS[reason]
    return {
        "PENDING": "waiting in the queue",
        "RUNNING": "running",
        "COMPLETED": "finished successfully",
        "FAILED": "failed (see `slurmft logs`)",
        "CANCELLED": "cancelled",
        "TIMEOUT": "hit its time limit",
        "PREEMPTED": "preempted",
        "NODE_FAIL": "a node failed",
        "OUT_OF_MEMORY": "ran out of memory",
        "REQUEUED": "requeued; will start again under the same job id",
        "UNKNOWN": "Slurm does not know this job (neither squeue nor sacct: another cluster or SLURM_CONF? "
        "accounting off and the job older than MinJobAge?)",
    }.get(state, state.lower())


def live_jobs(manifest: dict[str, Any], include_completing: bool = True) -> list[str]:
    """Job ids of the run that are still queued or running (or, optionally, still completing)."""
    states = {s.value for s in LIVE} - (set() if include_completing else {State.COMPLETING.value})
    return [r["job_id"] for r in job_rows(manifest) if r["state"] in states]
