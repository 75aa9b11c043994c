"""Cancel every live job of a run."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from slurmft.errors import SubmissionError
from slurmft.rundir import RunPaths
from slurmft.watch.status import run_state


def cancel_run(run_dir: Path) -> list[str]:
    """scancel (or, for processes here, SIGTERM) every live job, tagged jobs the manifest missed included;
    returns the ids cancelled."""
    state = run_state(RunPaths.of(run_dir))
    live = state.live(include_completing=False)  # a completing job is already ending
    if not live:
        return []
    pids = {j["job_id"]: int(j["pid"]) for j in state.manifest["jobs"] if "pid" in j}
    for job_id in [j for j in live if j in pids]:
        os.kill(pids[job_id], signal.SIGTERM)
    live_slurm = [j for j in live if j not in pids]
    if not live_slurm:
        return live
    scancel(live_slurm)
    return live


def scancel(job_ids: list[str]) -> None:
    """``scancel`` these jobs, or raise a SubmissionError saying why not (missing, hung, refused)."""
    try:
        out = subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SubmissionError(f"could not run scancel {' '.join(job_ids)}: {exc}") from None
    if out.returncode != 0:
        raise SubmissionError(f"scancel {' '.join(job_ids)} failed: {out.stderr.strip()}")
