"""Cancel every live job of a run."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from slurmft import cancels
from slurmft.rundir import (
    COMMAND_LOCK_WAIT_S,
    RunPaths,
    acquire_lock,
    check_owner,
    current_user,
    job_submitter,
    read_manifest,
    release_lock,
    run_owner,
)
from slurmft.slurm import scancel, scancel_answer
from slurmft.watch.status import run_state, unseen_means_hidden


@dataclass
class CancelResult:
    """What ``cancel`` did: the ids it cancelled, and the jobs it could not judge or reach (with why)."""

    cancelled: list[str] = field(default_factory=list)
    not_touched: list[str] = field(default_factory=list)


def cancel_run(run_dir: Path, force: bool = False, say=lambda _: None) -> CancelResult:  # noqa: ANN001
    """scancel (or, for processes started on this host, SIGTERM) every live job, tagged jobs the manifest
    missed included, under the run's lock. Live is :meth:`slurmft.watch.status.RunState.live` less COMPLETING
    (already ending): a SUSPENDED job is cancelled as it is (Slurm 22.05 ends it CANCELLED, no ``scontrol resume``
    needed). Another user's run is refused unless ``force``. A job another user submitted (a teammate's ``resume
    --force``), live or hidden from us by Slurm, gets its own ``scancel``: Slurm cancels it where we may (an
    operator, a coordinator), and where it refuses, ``not_touched`` names who submitted it. A process recorded on
    another host is never signalled (its pid means another process here): said in ``not_touched`` too."""
    paths = RunPaths.of(run_dir)
    manifest = read_manifest(paths)
    check_owner(paths, manifest, "cancel", force)
    # A local run's own process holds the lock while it trains (hours); cancel only signals it.
    locked = manifest.get("executor") != "local"
    if locked:
        acquire_lock(paths, "cancel", say, wait_s=COMMAND_LOCK_WAIT_S)
    try:
        state = run_state(paths)
        owner, me = run_owner(paths, state.manifest), current_user()
        entries = {j["job_id"]: j for j in state.manifest["jobs"]}
        pids = {jid: int(j["pid"]) for jid, j in entries.items() if "pid" in j}
        result = CancelResult(not_touched=[f"{r['kind']} job {r['job_id']}: {r['words']}" for r in state.unseen()
                                           if r["job_id"] in pids])
        live = state.live(include_completing=False)
        here = [j for j in live if j in pids]
        cancels.record(paths, here, say)  # before the signal: the run's process reads it when it sees the job end
        for job_id in here:
            with contextlib.suppress(ProcessLookupError):  # live means alive on this host (process_here): it ended
                os.kill(pids[job_id], signal.SIGTERM)
        unseen = {r["job_id"] for r in state.unseen()}
        theirs = [r for r in state.rows if r["job_id"] not in pids and (r["job_id"] in live or r["job_id"] in unseen)
                  and unseen_means_hidden(job_submitter(entries.get(r["job_id"], {}), owner), me)]
        ours = [j for j in live if j not in pids and j not in {r["job_id"] for r in theirs}]
        if ours:
            scancel(ours)
        result.cancelled = [j for j in live if j in pids or j in ours]
        for row in theirs:  # one call each: Slurm refuses another user's job unless we may cancel it
            who = job_submitter(entries.get(row["job_id"], {}), owner).name
            answer = scancel_answer([row["job_id"]])
            if answer.ok:
                result.cancelled.append(row["job_id"])
            else:
                result.not_touched.append(
                    f"{row['kind']} job {row['job_id']} is {who}'s (submitted by {who}); Slurm refused to cancel it "
                    f"for you ({answer.problem}): ask {who} to run `slurmft cancel {paths.root}`, or an administrator")
        cancels.record(paths, [j for j in result.cancelled if j not in here], say)
        return result
    finally:
        if locked:
            release_lock(paths)


def cancel_sweep(root: Path, force: bool = False, say=lambda _: None) -> CancelResult:  # noqa: ANN001
    """Every live job of every point of a sweep in one ``scancel`` (the shared prepare job, the array tasks, the jobs
    of resumed points); a local sweep's points one by one (:func:`cancel_run` signals their processes). Each point's
    owner is checked first, as for a run alone."""
    from slurmft.rundir import SweepPaths, read_sweep_record

    points = [RunPaths.of(p["dir"]) for p in read_sweep_record(SweepPaths(root))["points"]]
    manifests = {paths: read_manifest(paths) for paths in points}
    for paths, manifest in manifests.items():
        check_owner(paths, manifest, "cancel", force)
    result = CancelResult()
    live: list[str] = []
    of_point: dict[RunPaths, list[str]] = {}
    for paths, manifest in manifests.items():
        if manifest.get("executor") == "local":
            one = cancel_run(paths.root, force, say)
            result.cancelled += one.cancelled
            result.not_touched += one.not_touched
            continue
        state = run_state(paths, adopt=False)
        result.not_touched += [f"{paths.root.name}: {r['kind']} job {r['job_id']}: {r['words']}" for r in state.unseen()]
        of_point[paths] = state.live(include_completing=False)  # a shared prepare job: in each point that read it
        live += [j for j in of_point[paths] if j not in live]
    if live:
        scancel(live)
        result.cancelled += live
    for paths, ids in of_point.items():
        cancels.record(paths, ids, say)
    return result
