"""A Slurm job array whose tasks run submitit pickles: a sweep's train and consolidation arrays, a prepare array
(``prepare.tasks``: :func:`submit_array`; the local executor runs its tasks one after another: :func:`run_local_array`).

submitit pairs a job with its pickled callable by job id, and an array task's id is ``<array>_<task>``
(:func:`slurmft.slurm.own_job_id`); submitit's executor cannot submit an array of our own script, so the array is
sent with ``sbatch`` and each task's pickle is written once its id is known (submitit's job processing waits for it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft import slurm
from slurmft.config import RunConfig
from slurmft.config_values import time_minutes
from slurmft.errors import SubmissionError
from slurmft.rundir import RunPaths, atomic_write, process_record, record_job, write_manifest


def sbatch_array(script: Path, dependency: str | None, what: str) -> str:
    """``sbatch`` an array script (after ``dependency``); its id, or a SubmissionError naming ``what``."""
    answer = slurm.sbatch_array(str(script), dependency)
    job = answer.stdout.strip().split(";")[0] if answer.ok else ""
    if not job.isdigit():
        raise SubmissionError(f"sbatch refused the {what} ({answer.problem or answer.stdout.strip()})")
    return job


def write_task_pickle(folder: Path, job_id: str, function: Callable[..., Any], args: tuple[Any, ...],
                      timeout_min: int) -> None:
    """The callable task ``job_id`` (``<array>_<task>``) runs, in the submitit ``folder`` its script names."""
    from submitit.core.utils import DelayedSubmission, JobPaths

    delayed = DelayedSubmission(function, *args)
    delayed.set_timeout(timeout_min, 3)
    target = JobPaths(folder, job_id).submitted_pickle
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    delayed.dump(tmp)
    os.replace(tmp, target)


def write_pickles_or_cancel(array: str, calls: list[tuple[Path, Callable[..., Any], tuple[Any, ...]]],
                            timeout_min: int, jobs: list[str]) -> None:
    """Task i's callable (``calls[i]``: its submitit folder, function and arguments) under the id submitit looks
    for, ``<array>_<i>``; when they cannot be written, ``jobs`` (the ones sent so far) are cancelled: their tasks
    would wait for pickles that never come, then fail."""
    try:
        for i, (folder, function, args) in enumerate(calls):
            write_task_pickle(folder, f"{array}_{i}", function, args, timeout_min)
    except OSError as exc:
        cancelled = slurm.try_scancel(jobs)
        raise SubmissionError(f"cannot write the array {array}'s pickles ({exc}); "
                              + (f"cancelled {', '.join(jobs)}" if cancelled else f"could NOT cancel: scancel "
                                 f"{' '.join(jobs)}")) from None


def submit_array(cfg: RunConfig, profile: Any, paths: RunPaths, manifest: dict[str, Any], config_path: str,
                 template_dir: str | None, fields: dict[str, Any]) -> str:
    """sbatch the prepare array (``prepare.tasks`` > 1: slurmft/job/prepare_array.py), write each task's pickle,
    record it in the manifest (one prepare job: the array's id, which the train job's ``afterok`` waits on whole);
    its id."""
    from slurmft.job.entrypoint import run_prepare_task
    from slurmft.plan.render import (
        PREPARE_TEMPLATE,
        build_prepare_context,
        rank_python_for,
        render,
        submitit_command,
    )

    tasks = cfg.prepare.tasks
    command = submitit_command(rank_python_for(cfg, profile), paths.submitit)
    script = paths.script("prepare")
    atomic_write(script, render(PREPARE_TEMPLATE, build_prepare_context(cfg, profile, paths, command, config_path),
                                template_dir), executable=True)
    array = sbatch_array(script, None, "prepare array")
    write_pickles_or_cancel(array, [(paths.submitit, run_prepare_task, (str(paths.root), k, tasks, array))
                                    for k in range(tasks)], time_minutes(cfg.prepare.resources.time), [array])
    record_job(manifest, "prepare", array, **fields, tasks=tasks, script=str(script),
               logs=[str(paths.log_file("prepare", f"{array}_{k}")) for k in range(tasks)])
    write_manifest(paths, manifest)
    return array


def run_local_array(cfg: RunConfig, paths: RunPaths, manifest: dict[str, Any], say: Callable[[str], None],
                    fields: dict[str, Any], wait: Callable[..., None]) -> str:
    """The prepare array's tasks here, one after another (each a local job, recorded, ``wait`` ed for as dispatch
    waits for a local job), the last one packing; the last task's id."""
    from submitit import LocalExecutor
    from submitit.core.utils import JobPaths

    from slurmft.job.entrypoint import run_prepare_task
    from slurmft.plan.render import python_for

    tasks, group = cfg.prepare.tasks, f"local-{os.getpid()}"
    ex = LocalExecutor(folder=paths.submitit, python=python_for(cfg))
    ex.update_parameters(tasks_per_node=1, nodes=1, timeout_min=time_minutes(cfg.prepare.resources.time))
    job_id = ""
    for k in range(tasks):
        job = ex.submit(run_prepare_task, str(paths.root), k, tasks, group)
        job_id = str(job.job_id)
        record_job(manifest, "prepare", job_id, **process_record(int(job_id)), **fields, task=k, tasks=tasks,
                   logs=[str(JobPaths(paths.submitit, job_id, 0).stdout)])
        write_manifest(paths, manifest)
        what = f"prepare task {k + 1} of {tasks} (job {job_id})"
        say(f"{what} started here")
        wait(job, "prepare", paths, manifest, say, what)
    return job_id
