"""Cancel every live job of a run."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from slurmft.rundir import RunPaths
from slurmft.slurm import scancel
from slurmft.watch.status import run_state


def cancel_run(run_dir: Path) -> list[str]:
    """scancel (or, for processes here, SIGTERM) every live job, tagged jobs the manifest missed included;
    returns the ids cancelled. Live is :data:`slurmft.slurm_states.LIVE` less COMPLETING (already ending):
    a SUSPENDED job is cancelled as it is (Slurm 22.05 ends it CANCELLED, no ``scontrol resume`` needed)."""
    state = run_state(RunPaths.of(run_dir))
    live = state.live(include_completing=False)
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
