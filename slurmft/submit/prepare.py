"""``slurmft prepare``, and the prepare job of ``submit`` and ``resume``: the data made once, before the train job.

``submit`` chains prepare -> train (``afterok``, ``--kill-on-invalid-dep=yes``: a failed prepare job gets
the train job cancelled by Slurm, not left pending in ``DependencyNeverSatisfied``) -> consolidate. A run
directory whose ``prepared/`` already matches the config (``slurmft prepare run.yaml --here`` before the
submit, or a resume after a finished prepare job) gets no prepare job: the train job reads what is there.
``resume`` refuses a ``prepared/`` that no longer matches (a source edited since) with the fix, which is this
command: ``slurmft prepare RUN_DIR`` (a job, or ``--here``), then ``slurmft resume RUN_DIR``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft import prepared
from slurmft.config import Executor, RunConfig, read_run_config
from slurmft.errors import RunDirError, SubmissionError
from slurmft.rundir import (
    RunPaths,
    acquire_lock,
    check_owner,
    process_record,
    read_manifest,
    record_job,
    release_lock,
    write_manifest,
)
from slurmft.slurm_states import is_live

Say = Callable[[str], None]
#: Seconds to wait for another command holding the run's lock.
LOCK_WAIT_S = 60.0


def needed(paths: RunPaths, cfg: RunConfig) -> bool:
    """Whether this attempt needs a prepare job: ``prepare.enabled`` and no complete ``prepared/``. One that
    does not match ``cfg`` is refused (:func:`slurmft.prepared.check`): the fix is ``slurmft prepare``."""
    return cfg.prepare.enabled and prepared.check(paths, cfg) is None


def needed_for_new_run(paths: RunPaths, cfg: RunConfig, say: Say) -> bool:
    """:func:`needed` for a new run: a ``prepared/`` left by ``slurmft prepare run.yaml --here`` that does not
    match is prepared again by the prepare job (no training has read it), and said so."""
    try:
        return needed(paths, cfg)
    except RunDirError as exc:
        say(f"note: {exc.problems[0] if exc.problems else exc}; the prepare job prepares the data again")
        return True


def record_fields(run_attempt: int | None) -> dict[str, Any]:
    return {"run_attempt": run_attempt} if run_attempt is not None else {}


def submit_job(cfg: RunConfig, profile: Any, paths: RunPaths, manifest: dict[str, Any], config_path: str = "",
               template_dir: str | None = None, *, run_attempt: int | None = None) -> str:
    """sbatch one prepare job (CPUs only); record it in the manifest; return its id."""
    from submitit.core.utils import FailedJobError

    from slurmft.job.entrypoint import run_prepare
    from slurmft.plan.render import PREPARE_TEMPLATE, build_prepare_context, python_for, render, time_minutes
    from slurmft.submit.dispatch import make_slurm_executor

    def text(command: str) -> str:
        return render(PREPARE_TEMPLATE, build_prepare_context(cfg, profile, paths, command, config_path), template_dir)

    try:
        ex = make_slurm_executor(paths, 1, time_minutes(cfg.prepare.resources.time), text, None, python_for(cfg))
        job = ex.submit(run_prepare, str(paths.root))
    except (FailedJobError, OSError, RuntimeError) as exc:
        raise SubmissionError(f"sbatch refused the prepare job ({str(exc).strip()})") from None
    record_job(manifest, "prepare", job.job_id, **record_fields(run_attempt), script=str(paths.script("prepare")),
               log=str(paths.log_file("prepare", job.job_id)))
    write_manifest(paths, manifest)
    return str(job.job_id)


def run_local_job(cfg: RunConfig, paths: RunPaths, manifest: dict[str, Any], say: Say, *,
                  run_attempt: int | None = None) -> str:
    """Run the preparation here as a local job (one process through submitit), recorded; returns its id."""
    from submitit import LocalExecutor
    from submitit.core.utils import JobPaths

    from slurmft.job.entrypoint import run_prepare
    from slurmft.plan.render import python_for, time_minutes
    from slurmft.submit.dispatch import _wait_local

    ex = LocalExecutor(folder=paths.submitit, python=python_for(cfg))
    ex.update_parameters(tasks_per_node=1, nodes=1, timeout_min=time_minutes(cfg.prepare.resources.time))
    job = ex.submit(run_prepare, str(paths.root))
    record_job(manifest, "prepare", job.job_id, **process_record(int(job.job_id)), **record_fields(run_attempt),
               logs=[str(JobPaths(paths.submitit, job.job_id, 0).stdout)])
    write_manifest(paths, manifest)
    say(f"prepare job {job.job_id} started here")
    _wait_local(job, "prepare", paths, manifest, say)
    return str(job.job_id)


def check_not_live(paths: RunPaths) -> None:
    """Refuse to replace ``prepared/`` under a job that reads or writes it (a live train or prepare job)."""
    from slurmft.watch.status import run_state

    state = run_state(paths)
    live = [f"{r['kind']} job {r['job_id']}" for r in state.rows
            if r["kind"] in ("train", "prepare") and is_live(r["state"])]
    if live:
        raise RunDirError(f"{paths.root} has {', '.join(live)} queued or running, which would read the data while "
                          f"it is replaced; wait for it, or `slurmft cancel {paths.root}` first")


def prepare_here(paths: RunPaths, say: Say) -> dict[str, Any]:
    """Prepare a run directory's data in this process (needs the training stack), recorded in its manifest."""
    from slurmft.job.prepare import prepare_run

    acquire_lock(paths, "prepare", say, wait_s=LOCK_WAIT_S)
    try:
        check_not_live(paths)
        manifest = read_manifest(paths)
        entry = record_job(manifest, "prepare", f"here-{os.getpid()}-{int(time.time())}", here=True,
                           **process_record(os.getpid()))
        write_manifest(paths, manifest)
    finally:
        release_lock(paths)
    t0 = time.time()
    try:
        record = prepare_run(str(paths.root))
        entry["state"] = "COMPLETED"
    except BaseException:
        entry["state"] = "FAILED"
        raise
    finally:
        entry["elapsed_s"] = round(time.time() - t0, 1)
        _update_entry(paths, entry)
    return record


def prepare_config_here(cfg: RunConfig) -> dict[str, Any]:
    """``slurmft prepare run.yaml --here``: the data of a run not submitted yet, into its ``output_dir``'s
    ``prepared/`` (nothing else is written there; ``submit`` then reuses it)."""
    from slurmft.job.prepare import prepare_run

    paths = RunPaths.of(cfg.output_dir)
    if paths.manifest.exists():
        raise RunDirError(f"{paths.root} is a run directory already: use `slurmft prepare {paths.root}`")
    if paths.root.exists() and any(p.name != paths.prepared.name for p in paths.root.iterdir()):
        raise RunDirError(f"output_dir {paths.root} is not empty and is not a slurmft run directory; choose an "
                          "empty or new one")
    return prepare_run(str(paths.root), cfg=cfg)


def _update_entry(paths: RunPaths, entry: dict[str, Any]) -> None:
    acquire_lock(paths, "prepare", wait_s=LOCK_WAIT_S)
    try:
        manifest = read_manifest(paths)
        for job in manifest["jobs"]:
            if job["job_id"] == entry["job_id"]:
                job.update(entry)
        write_manifest(paths, manifest)
    finally:
        release_lock(paths)


def submit(paths: RunPaths, template_dir: str | None, say: Say, force: bool = False) -> str:
    """``slurmft prepare RUN_DIR``: one prepare job (no train job chained); its id."""
    from slurmft.profiles import load_profile
    from slurmft.submit.dispatch import check_executor

    manifest = read_manifest(paths)
    check_owner(paths, manifest, "prepare", force)
    cfg = read_run_config(paths.config)
    cfg.executor = Executor(manifest.get("executor", "slurm"))  # where the run was started is where it prepares
    check_executor(cfg.resolved_executor)
    profile = load_profile(cfg.cluster.profile)
    acquire_lock(paths, "prepare", say, wait_s=LOCK_WAIT_S)
    try:
        check_not_live(paths)
        manifest = read_manifest(paths)
        if manifest.get("executor") == "local":
            return run_local_job(cfg, paths, manifest, say)
        from slurmft.plan.render import (
            PREPARE_TEMPLATE,
            build_prepare_context,
            python_for,
            render,
            submitit_command,
        )
        from slurmft.rundir import atomic_write

        command = submitit_command(python_for(cfg), paths.submitit)
        text = render(PREPARE_TEMPLATE, build_prepare_context(cfg, profile, paths, command, str(paths.config)),
                      template_dir)
        atomic_write(paths.script("prepare"), text, executable=True)
        return submit_job(cfg, profile, paths, manifest, str(paths.config), template_dir)
    finally:
        release_lock(paths)


def run_dir_of(target: Path) -> RunPaths | None:
    """RunPaths when ``target`` is a run directory (it has a manifest), else None (a run.yaml)."""
    paths = RunPaths.of(target)
    return paths if target.is_dir() and paths.manifest.is_file() else None
