"""Cancel every live job of a run."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from slurmft.rundir import (
    COMMAND_LOCK_WAIT_S,
    RunPaths,
    acquire_lock,
    check_owner,
    read_manifest,
    release_lock,
)
from slurmft.slurm import scancel
from slurmft.watch.status import run_state


@dataclass
class CancelResult:
    """What ``cancel`` did: the ids it cancelled, and the jobs it could not judge (with why)."""

    cancelled: list[str] = field(default_factory=list)
    not_touched: list[str] = field(default_factory=list)


def cancel_run(run_dir: Path, force: bool = False, say=lambda _: None) -> CancelResult:  # noqa: ANN001
    """scancel (or, for processes started on this host, SIGTERM) every live job, tagged jobs the manifest
    missed included, under the run's lock. Live is :data:`slurmft.slurm_states.LIVE` less COMPLETING (already
    ending): a SUSPENDED job is cancelled as it is (Slurm 22.05 ends it CANCELLED, no ``scontrol resume``
    needed). Another user's run is refused unless ``force``; a process recorded on another host is never
    signalled (its pid means another process here), and a job Slurm hides from us is left alone; both are
    said in ``not_touched``."""
    paths = RunPaths.of(run_dir)
    manifest = read_manifest(paths)
    check_owner(paths, manifest, "cancel", force)
    # A local run's own process holds the lock while it trains (hours); cancel only signals it.
    locked = manifest.get("executor") != "local"
    if locked:
        acquire_lock(paths, "cancel", say, wait_s=COMMAND_LOCK_WAIT_S)
    try:
        state = run_state(paths)
        result = CancelResult(not_touched=[f"{r['kind']} job {r['job_id']}: {r['words']}" for r in state.unseen()])
        live = state.live(include_completing=False)
        pids = {j["job_id"]: int(j["pid"]) for j in state.manifest["jobs"] if "pid" in j}
        for job_id in [j for j in live if j in pids]:
            os.kill(pids[job_id], signal.SIGTERM)  # live means alive on this host (process_here)
        live_slurm = [j for j in live if j not in pids]
        if live_slurm:
            scancel(live_slurm)
        result.cancelled = live
        return result
    finally:
        if locked:
            release_lock(paths)
