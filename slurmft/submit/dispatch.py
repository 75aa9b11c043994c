"""Dispatch through submitit: a Slurm executor that renders our templates, and the local executor.

``submit_run`` validates everything first, then writes the run directory, sends the prepare job
(``prepare.enabled``; slurmft/submit/prepare.py), the train job after it, chains the consolidation job with
``--dependency=afterok:<train>``, and writes the manifest last.
A failure before the train job is accepted removes the run directory it created.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft import prepared, slurm
from slurmft.config import Executor, RunConfig
from slurmft.config_loading import dump_config
from slurmft.config_values import time_minutes
from slurmft.errors import Cancelled, ConfigError, RunDirError, SubmissionError
from slurmft.plan.elastic import allocation
from slurmft.plan.render import (
    CONSOLIDATE_TEMPLATE,
    MODEL_JOB_TEMPLATES,
    PREPARE_TEMPLATE,
    TRAIN_TEMPLATE,
    build_consolidate_context,
    build_model_job_context,
    build_prepare_context,
    build_train_context,
    model_job_enabled,
    python_for,
    rank_python_for,
    render,
    render_scripts,
    step_python_for,
)
from slurmft.profiles import ClusterProfile
from slurmft.rundir import (
    RunPaths,
    acquire_lock,
    atomic_write,
    new_manifest,
    process_record,
    read_manifest,
    record_job,
    release_lock,
    start_attempt,
    write_manifest,
)
from slurmft.submit.console import JOB_NAMES, wait_local
from slurmft.watch.progress import allocation_words

Say = Callable[[str], None]


def quiet(_: str) -> None:
    pass


#: What every job slurmft submits after another one carries: Slurm cancels it once its dependency can never be
#: satisfied (the job before it failed or was cancelled) instead of leaving it pending in DependencyNeverSatisfied
#: forever (issue 47; the train job after a failed prepare job, the consolidation after a failed train job or after
#: that cancelled train job). A requeue is not a failure: an ``afterok`` dependency is judged once the job has
#: completed, and a requeued job is pending again, not completed (DESIGN §3; Slurm 22.05 and 24.11 both take it).
KILL_ON_INVALID_DEP = "--kill-on-invalid-dep=yes"


def make_slurm_executor(
    paths: RunPaths, ntasks: int, timeout_min: int, make_text: Callable[[str], str], dependency: str | None,
    python: str,
) -> Any:
    """A submitit SlurmExecutor whose sbatch file is our rendered template, started after ``dependency`` succeeds
    (:data:`KILL_ON_INVALID_DEP`: cancelled if it cannot). ``python`` starts submitit's per-task command: the
    ranks' interpreter (``render.rank_python_for``)."""
    from submitit import SlurmExecutor

    class TemplatedSlurmExecutor(SlurmExecutor):
        """submitit keeps pickles, job ids and sacct state; we own the script text."""

        def _submit_command(self, command: str) -> Any:
            with slurm.refusal_said_once():
                return super()._submit_command(command)

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return make_text(command)

        def _make_submission_command(self, submission_file_path: Path) -> list[str]:
            dep = [f"--dependency=afterok:{dependency}", KILL_ON_INVALID_DEP] if dependency else []
            return ["sbatch", *dep, str(submission_file_path)]

        def _num_tasks(self) -> int:  # the training step's tasks (a GRPO server's step is not submitit's)
            return ntasks

    ex = TemplatedSlurmExecutor(folder=paths.submitit, python=python)
    ex.parameters["time"] = timeout_min  # submitit's own time-out bookkeeping
    return ex


@dataclass
class SubmitResult:
    """What a submit produced."""

    run_dir: Path
    executor: str
    jobs: dict[str, str] = field(default_factory=dict)
    scripts: dict[str, Path] = field(default_factory=dict)


def check_submittable(cfg: RunConfig) -> None:
    """Settings that a config may hold (for `estimate`) but a submitted run may not."""
    if not cfg.fsdp.enabled:
        raise ConfigError(
            "fsdp.enabled: false is only for `slurmft estimate` comparisons; the trainer always shards with "
            "FSDP2 (set fsdp.enabled=true)"
        )


def check_prepares(cfg: RunConfig) -> None:
    """``slurmft prepare run.yaml`` (a prepare job alone) is for a run whose train job reads ``prepared/``."""
    if not cfg.prepare.enabled:
        raise ConfigError("prepare.enabled is false, so the train job would prepare the data itself and never read "
                          "a prepare job's result", ["set prepare.enabled: true (the default)",
                                                     "or add --here to only see the counts, in this process"])


def run_dir_refusal(cfg: RunConfig) -> str | None:
    """Why ``submit`` would refuse ``cfg.output_dir`` (:func:`check_run_dir_free`), for ``validate`` to say before
    the user's ``submit`` meets it; None when it is free."""
    try:
        check_run_dir_free(RunPaths.of(cfg.output_dir))
    except RunDirError as exc:
        return str(exc)
    return None


def free_sibling(root: Path) -> Path:
    """The first ``ROOT-2``, ``ROOT-3``, ... that does not exist: a new output_dir the refusal can name as it is (it
    said ``output_dir=runs/NAME-2``, a placeholder to fill in)."""
    k = 2
    while (candidate := root.with_name(f"{root.name}-{k}")).exists():
        k += 1
    return candidate


def check_run_dir_free(paths: RunPaths) -> None:
    """Refuse a run directory that already holds a run (live or finished) or foreign files."""
    if not paths.root.exists():
        return
    if not paths.root.is_dir():
        raise RunDirError(f"output_dir {str(paths.root)!r} exists and is not a directory")
    if paths.manifest.exists():
        from slurmft.watch.status import run_state

        live = run_state(paths).live()
        if live:
            raise RunDirError(
                f"output_dir {paths.root} already holds a live run (jobs {', '.join(live)}); refusing to overwrite "
                f"it. Use another output_dir (e.g. output_dir={free_sibling(paths.root)}) or `slurmft cancel` it first."
            )
        if not any(j["kind"] == "train" for j in read_manifest(paths).get("jobs", [])):
            raise RunDirError(
                f"output_dir {paths.root} holds a run whose data `slurmft prepare` prepared (no train job yet); start "
                f"its training with: slurmft resume {paths.root}"
            )
        from slurmft.submit.phase import ended_run_words

        raise RunDirError(f"output_dir {paths.root} already holds {ended_run_words(paths)}; refusing to overwrite it. "
                          f"For a new run use another output_dir (e.g. output_dir={free_sibling(paths.root)}).")
    if paths.lock.exists():
        raise RunDirError(f"another `slurmft submit` is writing {paths.root} right now ({paths.lock} exists)")
    # prepared/ (and a staging dir a killed preparation left): `slurmft prepare run.yaml --here`
    if any(p != paths.prepared and not p.name.startswith(".prepared.") for p in paths.root.iterdir()):
        raise RunDirError(
            f"output_dir {paths.root} is not empty and is not a slurmft run directory; choose an empty or new one"
        )


def _lock_new_run_dir(paths: RunPaths, say: Say) -> bool:
    """Create the run dir and take the lock; returns whether we created the root."""
    created = not paths.root.exists()
    paths.root.mkdir(parents=True, exist_ok=True)
    try:
        acquire_lock(paths, "submit", say)
    except RunDirError:
        if created:
            paths.root.rmdir()
        raise
    if paths.manifest.exists():  # re-read under the lock: another submit finished in between
        release_lock(paths)
        raise RunDirError(f"output_dir {paths.root} was just written by another `slurmft submit`; refusing to "
                          "overwrite it (use another output_dir)")
    return created


def _write_run_dir(paths: RunPaths, cfg: RunConfig, scripts: dict[str, str]) -> None:
    """The run dir's layout, the resolved config and the rendered scripts."""
    for sub in (paths.logs, paths.scripts, paths.submitit, paths.checkpoints, paths.requeue_marker_dir):
        sub.mkdir(parents=True, exist_ok=True)
    atomic_write(paths.config, dump_config(cfg))
    for kind, text in scripts.items():
        atomic_write(paths.script(kind), text, executable=True)


def _cleanup(paths: RunPaths, created: bool, keep: frozenset[Path] = frozenset()) -> None:
    if created:
        shutil.rmtree(paths.root, ignore_errors=True)
    else:  # the directory was empty before (but for ``keep``): make it so again
        for child in paths.root.iterdir():
            if child in keep:
                continue
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


def submit_run(
    cfg: RunConfig, profile: ClusterProfile, config_path: str = "", template_dir: str | None = None,
    say: Say = quiet, prepare_only: bool = False,
) -> SubmitResult:
    """Validate, write the run directory, dispatch train (+ consolidation) and write the manifest.

    ``prepare_only`` (``slurmft prepare run.yaml``): the same run directory, but only the prepare job is sent;
    ``slurmft resume`` starts the training once the counts are seen (no attempt is recorded before that)."""
    paths = RunPaths.of(cfg.output_dir)
    executor = cfg.resolved_executor
    check_submittable(cfg)
    if prepare_only:
        check_prepares(cfg)
    check_run_dir_free(paths)
    scripts = render_scripts(cfg, profile, paths, config_path, template_dir)  # render errors before any write
    check_executor(executor)
    kept = frozenset({paths.prepared} if paths.prepared.is_dir() else ())  # prepared before the submit
    need_prepare = prepare_only or prepared.needed_for_new_run(paths, cfg, say)  # prepare_only prepares anyway
    created = _lock_new_run_dir(paths, say)
    manifest = new_manifest(cfg.name, executor.value, paths.run_id, cfg.objective)
    result = SubmitResult(paths.root, executor.value, scripts={k: paths.script(k) for k in scripts})
    try:
        _write_run_dir(paths, cfg, scripts)
        if prepare_only:
            result.jobs["prepare"] = (
                submit_prepare(cfg, profile, paths, manifest, config_path, template_dir)
                if executor == Executor.SLURM else run_local_prepare(cfg, paths, manifest, say))
        else:
            attempt = start_attempt(manifest, "submit", **allocation(cfg))
            dispatch_attempt(cfg, profile, paths, config_path, template_dir, manifest, attempt, result, say,
                             need_prepare=need_prepare)
    except BaseException as exc:
        if not result.jobs and not isinstance(exc, Cancelled):  # a cancelled run ran a job: kept for `resume`
            _cleanup(paths, created, kept)
        raise
    finally:
        release_lock(paths)
    return result


def check_executor(executor: Executor) -> None:
    """Slurm needs sbatch here."""
    if executor == Executor.SLURM and not slurm.available("sbatch"):
        raise SubmissionError("executor is slurm but `sbatch` is not on PATH (set executor: local to run here)")


def dispatch_attempt(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, config_path: str, template_dir: str | None,
    manifest: dict[str, Any], attempt: dict[str, Any], result: SubmitResult, say: Say,
    need_prepare: bool | None = None,
) -> None:
    """Send one attempt's prepare job (when ``need_prepare``; None: :func:`slurmft.prepared.needed`), train
    job and consolidation, chained (Slurm), or run them here in that order (local)."""
    if need_prepare is None:
        need_prepare = prepared.needed(paths, cfg)
    if cfg.resolved_executor == Executor.SLURM:
        _submit_slurm(cfg, profile, paths, config_path, template_dir, manifest, attempt, result, say, need_prepare)
    else:
        _run_local(cfg, paths, manifest, attempt, result, say, need_prepare)


def _train_text(cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, config_path: str,
                template_dir: str | None) -> Callable[[str], str]:
    """The train script's renderer submitit calls with its command line."""

    def train_text(command: str) -> str:
        return render(TRAIN_TEMPLATE, build_train_context(cfg, profile, paths, command, config_path), template_dir)

    return train_text


def _consolidate_text(cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, config_path: str,
                      template_dir: str | None) -> Callable[[str], str]:
    """The consolidation script's renderer submitit calls with its command line."""

    def consolidate_text(command: str) -> str:
        ctx = build_consolidate_context(cfg, profile, paths, command, config_path)
        return render(CONSOLIDATE_TEMPLATE, ctx, template_dir)

    return consolidate_text


def _submit_slurm(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, config_path: str, template_dir: str | None,
    manifest: dict[str, Any], attempt: dict[str, Any], result: SubmitResult, say: Say, need_prepare: bool = False,
) -> None:
    from submitit.core.utils import FailedJobError

    from slurmft.job.entrypoint import run_train

    train_text = _train_text(cfg, profile, paths, config_path, template_dir)
    first = None
    if need_prepare:
        first = submit_prepare(cfg, profile, paths, manifest, config_path, template_dir,
                                   run_attempt=attempt["attempt"])
        result.jobs["prepare"] = first
        attempt["prepare_job"] = first
        write_manifest(paths, manifest)
        tasks = f"{cfg.prepare.tasks} tasks x " if cfg.prepare.tasks > 1 else ""
        say(f"prepare {'array' if tasks else 'job'} {first} submitted ({tasks}{cfg.prepare.resources.cpus_per_task} "
            "CPU(s), no GPU)")
    elif cfg.prepare.enabled:
        say(f"the data is prepared already ({paths.prepared}): no prepare job")
    try:
        ex = make_slurm_executor(
            paths, cfg.train_world_size, time_minutes(cfg.cluster.time), train_text, first,
            rank_python_for(cfg, profile),
        )
        train = ex.submit(run_train, str(paths.root), cfg.preemption.signal)
    except (FailedJobError, OSError, RuntimeError) as exc:
        what = ""
        if first:
            cancelled = slurm.try_scancel([first])
            what = f"; cancelled prepare job {first}" if cancelled else f"; could NOT cancel prepare job {first}: run `scancel {first}`"
            if cancelled:  # nothing of this attempt runs: a submit removes the run directory it wrote
                result.jobs.pop("prepare", None)
        raise SubmissionError(f"sbatch refused the train job: {str(exc).strip()}{what}",
                              slurm.refusal_fixes(str(exc))) from None
    result.jobs["train"] = train.job_id
    attempt["train_job"] = train.job_id
    record_job(manifest, "train", train.job_id, run_attempt=attempt["attempt"], script=str(paths.script("train")),
               log=str(paths.log_file("train", train.job_id)), **({"dependency": f"afterok:{first}"} if first else {}))
    write_manifest(paths, manifest)
    say(f"train job {train.job_id} submitted{allocation_words(allocation(cfg))}"
        + (f", starts after prepare job {first} succeeds" if first else ""))
    if not cfg.consolidate.enabled:
        return
    try:
        cons = submit_consolidation(cfg, profile, paths, manifest, config_path, template_dir,
                                    dependency=train.job_id, run_attempt=attempt["attempt"])
    except SubmissionError as exc:
        cancelled = slurm.try_scancel([train.job_id, *([first] if first else [])])
        manifest["jobs"][-1]["cancelled_by_submit"] = cancelled
        write_manifest(paths, manifest)
        what = f"cancelled train job {train.job_id}" if cancelled else (
            f"could NOT cancel train job {train.job_id}: run `scancel {train.job_id}`")
        raise SubmissionError(f"{exc}; {what}") from None
    result.jobs["consolidate"] = cons
    attempt["consolidate_job"] = cons
    write_manifest(paths, manifest)
    say(f"consolidation job {cons} submitted (runs after {train.job_id} succeeds)")
    for kind in MODEL_JOBS:
        if not model_job_enabled(cfg, kind):
            continue
        try:
            job = submit_model_job(cfg, profile, paths, manifest, kind, config_path, template_dir, dependency=cons,
                                   run_attempt=attempt["attempt"])
        except SubmissionError as exc:  # the run trains and consolidates; `slurmft serve/eval RUN_DIR` later
            say(f"WARNING: {exc}; the run goes on without it (`slurmft {kind} {paths.root}` once it is fixed)")
            continue
        result.jobs[kind] = attempt[f"{kind}_job"] = job
        write_manifest(paths, manifest)
        say(f"{MODEL_JOBS[kind]} job {job} submitted (runs after {cons} succeeds)")


def _consolidation_fields(
    dependency: str | None, run_attempt: int | None, checkpoint: str | None, out: str | None
) -> dict[str, Any]:
    """What the manifest records of a consolidation job beyond its id: what it waits on, for which attempt,
    and a checkpoint/output other than the defaults."""
    fields: dict[str, Any] = {"dependency": f"afterok:{dependency}"} if dependency else {}
    if run_attempt is not None:
        fields["run_attempt"] = run_attempt
    if checkpoint or out:
        fields.update(checkpoint=checkpoint, out=out)
    return fields


def submit_consolidation(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, manifest: dict[str, Any], config_path: str = "",
    template_dir: str | None = None, *, dependency: str | None = None, checkpoint: str | None = None,
    out: str | None = None, run_attempt: int | None = None,
) -> str:
    """sbatch one consolidation job (after ``dependency`` succeeds, if given); record it; return its id."""
    from submitit.core.utils import FailedJobError

    from slurmft.job.entrypoint import run_consolidate

    consolidate_text = _consolidate_text(cfg, profile, paths, config_path, template_dir)
    try:
        cex = make_slurm_executor(
            paths, 1, time_minutes(cfg.consolidate.resources.time), consolidate_text, dependency,
            rank_python_for(cfg, profile),
        )
        cons = cex.submit(run_consolidate, str(paths.root), checkpoint, out)
    except (FailedJobError, OSError, RuntimeError) as exc:
        raise slurm.refused("consolidation job", exc) from None
    record_job(manifest, "consolidate", cons.job_id, **_consolidation_fields(dependency, run_attempt, checkpoint, out),
               script=str(paths.script("consolidate")),
               log=str(paths.log_file("consolidate", cons.job_id)))
    write_manifest(paths, manifest)
    return str(cons.job_id)


#: The jobs after consolidation, in the order they are chained, and what they are called in messages.
MODEL_JOBS = {kind: JOB_NAMES[kind] for kind in ("serve", "eval")}


def _model_job_call(kind: str, overrides: list[str] | None) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The job's function and its arguments after the run directory: the (resolved) overrides, when there are any."""
    from slurmft.job.entrypoint import run_eval, run_serve

    return (run_serve if kind == "serve" else run_eval), ((list(overrides),) if overrides else ())


def _model_job_fields(dependency: str | None, run_attempt: int | None, overrides: list[str] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"dependency": f"afterok:{dependency}"} if dependency else {}
    if run_attempt is not None:
        fields["run_attempt"] = run_attempt
    if overrides:
        fields["overrides"] = list(overrides)
    return fields


def submit_model_job(
    cfg: RunConfig, profile: ClusterProfile, paths: RunPaths, manifest: dict[str, Any], kind: str,
    config_path: str = "", template_dir: str | None = None, *, dependency: str | None = None,
    run_attempt: int | None = None, overrides: list[str] | None = None,
) -> str:
    """sbatch one job after consolidation (``kind``: serve or eval; after ``dependency`` succeeds, if given);
    record it; return its id. ``cfg`` carries ``overrides`` already (the script is rendered from it); the job reads
    them again onto RUN_DIR/config.yaml."""
    from submitit.core.utils import FailedJobError

    section = cfg.model_job(kind)
    assert section is not None, kind

    def text(command: str) -> str:
        ctx = build_model_job_context(cfg, profile, paths, command, kind, config_path)
        return render(MODEL_JOB_TEMPLATES[kind], ctx, template_dir)

    function, args = _model_job_call(kind, overrides)
    try:
        ex = make_slurm_executor(paths, 1, time_minutes(section.resources.time), text, dependency,
                                 step_python_for(cfg, profile, kind))  # its own image's, when it has one
        job = ex.submit(function, str(paths.root), *args)
    except (FailedJobError, OSError, RuntimeError) as exc:
        raise slurm.refused(f"{MODEL_JOBS[kind]} job", exc) from None
    record_job(manifest, kind, job.job_id, **_model_job_fields(dependency, run_attempt, overrides),
               script=str(paths.script(kind)), log=str(paths.log_file(kind, job.job_id)))
    write_manifest(paths, manifest)
    return str(job.job_id)


def run_local_model_job(
    cfg: RunConfig, paths: RunPaths, manifest: dict[str, Any], kind: str, say: Say, *, dependency: str | None = None,
    run_attempt: int | None = None, overrides: list[str] | None = None,
) -> str:
    """Run one job after consolidation here (a local process through submitit), recorded; returns its id. A failed
    check raises SubmissionError with the end of its log; the model stays."""
    from submitit import LocalExecutor
    from submitit.core.utils import JobPaths

    section = cfg.model_job(kind)
    assert section is not None, kind
    function, args = _model_job_call(kind, overrides)
    ex = LocalExecutor(folder=paths.submitit, python=python_for(cfg))
    ex.update_parameters(tasks_per_node=1, nodes=1, timeout_min=time_minutes(section.resources.time),
                         gpus_per_node=section.resources.gpus)
    job = ex.submit(function, str(paths.root), *args)
    record_job(manifest, kind, job.job_id, **process_record(int(job.job_id)),
               **_model_job_fields(dependency, run_attempt, overrides),
               logs=[str(JobPaths(paths.submitit, job.job_id, 0).stdout)])
    write_manifest(paths, manifest)
    say(f"{MODEL_JOBS[kind]} job {job.job_id} started here")
    wait_local(job, kind, paths, manifest, say)
    return str(job.job_id)


def _prepare_fields(run_attempt: int | None) -> dict[str, Any]:
    return {"run_attempt": run_attempt} if run_attempt is not None else {}


def submit_prepare(cfg: RunConfig, profile: Any, paths: RunPaths, manifest: dict[str, Any], config_path: str = "",
                   template_dir: str | None = None, *, run_attempt: int | None = None) -> str:
    """sbatch one prepare job (CPUs only); record it in the manifest; return its id."""
    from submitit.core.utils import FailedJobError

    from slurmft.job.entrypoint import run_prepare

    if cfg.prepare.tasks > 1:
        from slurmft.submit.arrays import submit_array

        return submit_array(cfg, profile, paths, manifest, config_path, template_dir, _prepare_fields(run_attempt))

    def text(command: str) -> str:
        return render(PREPARE_TEMPLATE, build_prepare_context(cfg, profile, paths, command, config_path), template_dir)

    try:
        ex = make_slurm_executor(paths, 1, time_minutes(cfg.prepare.resources.time), text, None,
                                 rank_python_for(cfg, profile))
        job = ex.submit(run_prepare, str(paths.root))
    except (FailedJobError, OSError, RuntimeError) as exc:
        raise slurm.refused("prepare job", exc) from None
    record_job(manifest, "prepare", job.job_id, **_prepare_fields(run_attempt), script=str(paths.script("prepare")),
               log=str(paths.log_file("prepare", job.job_id)))
    write_manifest(paths, manifest)
    return str(job.job_id)


def run_local_prepare(cfg: RunConfig, paths: RunPaths, manifest: dict[str, Any], say: Say, *,
                      run_attempt: int | None = None) -> str:
    """Run the preparation here as a local job (one process through submitit), recorded; returns its id."""
    from submitit import LocalExecutor
    from submitit.core.utils import JobPaths

    from slurmft.job.entrypoint import run_prepare

    if cfg.prepare.tasks > 1:
        from slurmft.submit.arrays import run_local_array

        return run_local_array(cfg, paths, manifest, say, _prepare_fields(run_attempt), wait_local)
    ex = LocalExecutor(folder=paths.submitit, python=python_for(cfg))
    ex.update_parameters(tasks_per_node=1, nodes=1, timeout_min=time_minutes(cfg.prepare.resources.time))
    job = ex.submit(run_prepare, str(paths.root))
    record_job(manifest, "prepare", job.job_id, **process_record(int(job.job_id)), **_prepare_fields(run_attempt),
               logs=[str(JobPaths(paths.submitit, job.job_id, 0).stdout)])
    write_manifest(paths, manifest)
    say(f"prepare job {job.job_id} started here")
    wait_local(job, "prepare", paths, manifest, say)
    return str(job.job_id)


def _run_local(
    cfg: RunConfig, paths: RunPaths, manifest: dict[str, Any], attempt: dict[str, Any], result: SubmitResult,
    say: Say, need_prepare: bool = False,
) -> None:
    """Run the preparation (when needed), the train job (N processes, forked from one that has imported the
    stack: slurmft.submit.local_executor) and consolidation here, in that order, with submitit's local executor."""
    from submitit.core.utils import JobPaths

    from slurmft.job.entrypoint import run_train
    from slurmft.job.rendezvous import free_port
    from slurmft.submit.local_executor import ForkingLocalExecutor

    env_backup = dict(os.environ)
    os.environ.update(cfg.cluster.env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SLURMFT_RUN_DIR=str(paths.root))
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.resources.cpus_per_task))
    try:
        if need_prepare:
            result.jobs["prepare"] = attempt["prepare_job"] = run_local_prepare(
                cfg, paths, manifest, say, run_attempt=attempt["attempt"])
            write_manifest(paths, manifest)
        ex = ForkingLocalExecutor(paths.submitit, python_for(cfg), paths.root)
        ex.update_parameters(
            tasks_per_node=cfg.resources.ranks_per_node, nodes=1, timeout_min=time_minutes(cfg.cluster.time),
            gpus_per_node=cfg.resources.gpus_per_node,
        )
        train = ex.submit(run_train, str(paths.root), cfg.preemption.signal)
        result.jobs["train"] = train.job_id
        attempt["train_job"] = train.job_id
        logs = [str(JobPaths(paths.submitit, train.job_id, t).stdout) for t in range(cfg.resources.ranks_per_node)]
        record_job(manifest, "train", train.job_id, run_attempt=attempt["attempt"], **process_record(int(train.job_id)),
                   logs=logs)
        write_manifest(paths, manifest)
        say(f"train job {train.job_id} started here ({cfg.resources.ranks_per_node} processes); logs: {logs[0]}")
        wait_local(train, "train", paths, manifest, say)
        if not cfg.consolidate.enabled:
            return
        cons = run_local_consolidation(cfg, paths, manifest, say, dependency=train.job_id,
                                       run_attempt=attempt["attempt"])
        result.jobs["consolidate"] = cons
        attempt["consolidate_job"] = cons
        write_manifest(paths, manifest)
        failed: list[SubmissionError] = []
        for kind in MODEL_JOBS:  # each runs whatever the other's outcome, as the Slurm chain's both follow cons
            if model_job_enabled(cfg, kind):
                try:
                    result.jobs[kind] = attempt[f"{kind}_job"] = run_local_model_job(
                        cfg, paths, manifest, kind, say, dependency=cons, run_attempt=attempt["attempt"])
                except SubmissionError as exc:
                    failed.append(exc)
                write_manifest(paths, manifest)
        if failed:
            raise failed[0]
    finally:
        os.environ.clear()
        os.environ.update(env_backup)


def run_local_consolidation(
    cfg: RunConfig, paths: RunPaths, manifest: dict[str, Any], say: Say, *, dependency: str | None = None,
    checkpoint: str | None = None, out: str | None = None, run_attempt: int | None = None,
) -> str:
    """Run one consolidation here (a local process through submitit), recorded; returns its id."""
    from submitit import LocalExecutor
    from submitit.core.utils import JobPaths

    from slurmft.job.entrypoint import run_consolidate

    cex = LocalExecutor(folder=paths.submitit, python=python_for(cfg))
    cex.update_parameters(tasks_per_node=1, nodes=1, timeout_min=time_minutes(cfg.consolidate.resources.time))
    cons = cex.submit(run_consolidate, str(paths.root), checkpoint, out)
    record_job(manifest, "consolidate", cons.job_id, **process_record(int(cons.job_id)),
               **_consolidation_fields(dependency, run_attempt, checkpoint, out),
               logs=[str(JobPaths(paths.submitit, cons.job_id, 0).stdout)])
    write_manifest(paths, manifest)
    say(f"{JOB_NAMES['consolidate']} job {cons.job_id} started here")
    wait_local(cons, "consolidate", paths, manifest, say)
    return str(cons.job_id)
