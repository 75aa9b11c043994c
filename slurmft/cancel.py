"""Cancel every live job of a run."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from slurmft.errors import SubmissionError
from slurmft.rundir import RunPaths, read_manifest
from slurmft.status import live_jobs


def cancel_run(run_dir: Path) -> list[str]:
    """scancel (or, for local runs, SIGTERM) every live job; returns the ids cancelled."""
    manifest = read_manifest(RunPaths.of(run_dir))
    live = live_jobs(manifest, include_completing=False)  # a completing job is already ending
    if not live:
        return []
    if manifest.get("executor") == "local":
        for job_id in live:
            os.kill(int(job_id), signal.SIGTERM)
        return live
    out = subprocess.run(["scancel", *live], capture_output=True, text=True)
    if out.returncode != 0:
        raise SubmissionError(f"scancel {' '.join(live)} failed: {out.stderr.strip()}")
    return live
