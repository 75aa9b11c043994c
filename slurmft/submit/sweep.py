"""Submitting a sweep: every point a complete run directory, one prepare job, the train jobs as one Slurm array,
the consolidations as a second array, task i after train task i, and the jobs after consolidation likewise.

Each point's directory is written exactly as ``submit_run`` writes a run alone (its config.yaml, its rendered
scripts, its manifest), so ``status``, ``logs``, ``resume``, ``consolidate`` and ``cancel`` work on it as on any
run. What is shared:

* **one prepare job** (``prepare.enabled``) for the whole sweep: it prepares each distinct prepared set
  (points group by :func:`slurmft.prepared.settings`; a swept seed or data key makes several) into the first
  point of its group, and the others' ``prepared`` is a link to it;
* **the train array** (``--array=0-(N-1)%P``, ``templates/array.sbatch.j2``): task i execs point i's own
  ``scripts/train.sbatch`` in the batch shell Slurm started, its output in point i's log. The point's script is
  the one a run alone would have, so its rendezvous port (from the task's own SLURM_JOB_ID), its run directory,
  its requeue (``scontrol requeue <array>_<task>``: that task only; :func:`slurmft.slurm.own_job_id`) are a run
  alone's;
* **the consolidation array**, ``--dependency=aftercorr:<train array>``: task i starts once train task i succeeded;
* **the serve-check and evaluation arrays** (``serve:``/``eval:`` sections), each ``aftercorr:<consolidation
  array>``: task i runs point i's own serve/eval script once consolidation task i succeeded.

submitit pairs a job with its pickled callable by job id; an array task's id is ``<array>_<task>``, so the
callable of task i is written into point i's submitit folder under that id once sbatch answered (the job's
submitit processing waits for it). The local executor runs the points one after another with the same layout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft import prepared, slurm
from slurmft.config import Executor, RunConfig
from slurmft.config_values import time_minutes
from slurmft.errors import Cancelled, ConfigError, RunDirError, SubmissionError
from slurmft.plan.elastic import allocation
from slurmft.plan.render import (
    PREPARE_TEMPLATE,
    build_prepare_context,
    model_job_enabled,
    one_prepare_job,
    rank_python_for,
    render,
    render_scripts,
    render_sweep_arrays,
)
from slurmft.profiles import ClusterProfile
from slurmft.rundir import (
    SWEEP_VERSION,
    RunPaths,
    SweepPaths,
    acquire_lock,
    atomic_write,
    new_manifest,
    read_sweep_record,
    record_job,
    release_lock,
    start_attempt,
    sweep_locked,
    write_manifest,
    write_sweep_record,
)
from slurmft.submit.arrays import sbatch_array, write_pickles_or_cancel
from slurmft.submit.dispatch import (
    MODEL_JOBS,
    Say,
    SubmitResult,
    _write_run_dir,
    check_executor,
    check_run_dir_free,
    check_submittable,
    dispatch_attempt,
    make_slurm_executor,
    quiet,
)
from slurmft.sweep import Sweep, select_of, select_warnings


@dataclass
class SweepResult:
    """What a sweep submit produced: its jobs (arrays by their id) and each point's run."""

    root: Path
    executor: str
    jobs: dict[str, str] = field(default_factory=dict)
    points: dict[str, SubmitResult] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def prepare_groups(configs: list[RunConfig]) -> list[list[int]]:
    """Point indices grouped by the prepared set they read (:func:`slurmft.prepared.settings`), in point order; the
    first of each group prepares it. No groups without ``prepare.enabled`` (each train job prepares its own)."""
    groups: dict[str, list[int]] = {}
    for i, cfg in enumerate(configs):
        if cfg.prepare.enabled:
            groups.setdefault(json.dumps(prepared.settings(cfg), sort_keys=True, default=str), []).append(i)
    return list(groups.values())


def new_record(sweep: Sweep, config_path: str) -> dict[str, Any]:
    """``sweep.json`` before any job: the points, their overrides and directories, how they are ranked and why that
    ranking may compare unlike measures (``select_warnings``: what validate and submit said; status and report say
    it again beside the ranking)."""
    assert sweep.cfg.sweep is not None
    select = select_of(sweep.cfg)
    return {"version": SWEEP_VERSION, "name": sweep.cfg.name, "executor": sweep.cfg.resolved_executor.value,
            "config": config_path, "select": select,
            "select_warnings": select_warnings(select["metric"], sweep.configs, sweep.cfg.sweep.select.mode),
            "points": [{"index": p.index, "name": p.name, "dir": c.output_dir, "overrides": p.overrides}
                       for p, c in zip(sweep.points, sweep.configs, strict=True)],
            "jobs": []}


def submit_sweep(sweep: Sweep, profile: ClusterProfile, config_path: str = "", template_dir: str | None = None,
                 say: Say = quiet) -> SweepResult:
    """Write the sweep directory and every point's run directory, then send (Slurm) or run (local) the jobs."""
    paths = sweep.paths
    root = RunPaths.of(paths.root)
    for cfg in sweep.configs:
        check_submittable(cfg)
    if paths.record.is_file():
        raise RunDirError(f"output_dir {paths.root} already holds a sweep; follow it with `slurmft status {paths.root}`, "
                          f"continue its points that died with `slurmft resume {paths.root}`, or use another output_dir")
    check_run_dir_free(root)
    scripts = [render_scripts(cfg, profile, RunPaths.of(cfg.output_dir), config_path, template_dir)
               for cfg in sweep.configs]  # every render error before any write
    check_one_allocation(sweep, scripts)
    executor = sweep.cfg.resolved_executor
    check_executor(executor)
    arrays = render_sweep_arrays(sweep, profile, config_path, template_dir) if executor == Executor.SLURM else {}
    created = not paths.root.exists()
    paths.root.mkdir(parents=True, exist_ok=True)
    acquire_lock(root, "submit", say)
    result = SweepResult(paths.root, executor.value)
    record = new_record(sweep, config_path)
    try:
        _write_points(sweep, scripts, arrays, record)
        groups = prepare_groups(sweep.configs)
        _link_prepared(sweep, groups)
        if executor == Executor.SLURM:
            _submit_arrays(sweep, profile, config_path, template_dir, groups, record, result, say)
        else:
            _run_points_here(sweep, profile, config_path, template_dir, groups, record, result, say)
    except BaseException as exc:
        if not result.jobs and created and not isinstance(exc, Cancelled):  # cancelled: it ran a job, `resume` goes on
            import shutil

            shutil.rmtree(paths.root, ignore_errors=True)
        raise
    finally:
        release_lock(root)
    return result


#: The directives that name a job rather than allocate it: they may differ between points.
_OWN_DIRECTIVES = tuple(f"#SBATCH --{name}" for name in ("job-name", "comment", "output", "error"))


def check_one_allocation(sweep: Sweep, scripts: list[dict[str, str]]) -> None:
    """Every point's train and consolidation scripts ask Slurm for what the first point's do: an array has one
    allocation (slurmft.sweep.FIXED refuses the keys known to change it; this catches any other)."""
    def allocation_lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("#SBATCH") and not line.startswith(_OWN_DIRECTIVES)]

    problems = []
    for kind in ("train", "consolidate", *MODEL_JOBS):
        first = allocation_lines(scripts[0].get(kind, ""))
        for point, texts in zip(sweep.points[1:], scripts[1:], strict=True):
            differ = sorted(set(allocation_lines(texts.get(kind, ""))) ^ set(first))
            if differ:
                problems.append(f"point {point.name} ({point.label()}): its {kind} job would ask Slurm for another "
                                f"allocation than point {sweep.points[0].name}'s ({'; '.join(differ)})")
    if problems:
        raise ConfigError("sweep: the tasks of one Slurm array share one allocation; make these points two sweeps",
                          problems)


def _write_points(sweep: Sweep, scripts: list[dict[str, str]], arrays: dict[str, str], record: dict[str, Any]) -> None:
    root = RunPaths.of(sweep.paths.root)
    for sub in (root.logs, root.scripts, root.submitit) if arrays else ():  # the Slurm arrays' own files
        sub.mkdir(parents=True, exist_ok=True)
    for kind, text in arrays.items():
        atomic_write(root.script(kind), text, executable=True)
    for cfg, texts in zip(sweep.configs, scripts, strict=True):
        point = RunPaths.of(cfg.output_dir)
        point.root.mkdir()
        _write_run_dir(point, cfg, texts)
        write_manifest(point, new_manifest(cfg.name, cfg.resolved_executor.value, point.run_id, cfg.objective))
    write_sweep_record(sweep.paths, record)


def _link_prepared(sweep: Sweep, groups: list[list[int]]) -> None:
    """Each point after the first of its group reads the first one's ``prepared`` (a relative link: the sweep
    directory may move)."""
    for group in groups:
        leader = RunPaths.of(sweep.configs[group[0]].output_dir)
        for i in group[1:]:
            RunPaths.of(sweep.configs[i].output_dir).prepared.symlink_to(Path("..") / leader.root.name / "prepared")


def _leaders(sweep: Sweep, groups: list[list[int]]) -> list[str]:
    return [sweep.configs[g[0]].output_dir for g in groups]


# ------------------------------------------------------------------ Slurm: one prepare job, two arrays
def _pickles_or_cancel(sweep: Sweep, array: str, call: Callable[[RunConfig], tuple[Callable[..., Any], tuple]],
                       timeout_min: int, jobs: list[str]) -> None:
    """Point i's callable (``call(config)``) in its own submitit folder as task i's (arrays.write_pickles_or_cancel)."""
    calls = [(RunPaths.of(cfg.output_dir).submitit, *call(cfg)) for cfg in sweep.configs]
    write_pickles_or_cancel(array, calls, timeout_min, jobs)


def _submit_arrays(sweep: Sweep, profile: ClusterProfile, config_path: str, template_dir: str | None,
                   groups: list[list[int]], record: dict[str, Any], result: SweepResult, say: Say) -> None:
    from submitit.core.utils import FailedJobError

    from slurmft.job.entrypoint import run_prepare_each, run_train

    root = RunPaths.of(sweep.paths.root)
    first = sweep.configs[0]
    manifests = [new_manifest(c.name, Executor.SLURM.value, RunPaths.of(c.output_dir).run_id, c.objective)
                 for c in sweep.configs]
    attempts = [start_attempt(m, "submit", **allocation(c)) for m, c in zip(manifests, sweep.configs, strict=True)]
    prep = None
    if groups:
        def text(command: str) -> str:
            cfg = first.model_copy(update={"name": sweep.cfg.name, "prepare": one_prepare_job(first)})
            return render(PREPARE_TEMPLATE, build_prepare_context(cfg, profile, root, command, config_path), template_dir)

        try:
            ex = make_slurm_executor(root, 1, time_minutes(first.prepare.resources.time), text, None,
                                     rank_python_for(first, profile))
            prep = str(ex.submit(run_prepare_each, _leaders(sweep, groups)).job_id)
        except (FailedJobError, OSError, RuntimeError) as exc:
            raise slurm.refused("prepare job", exc) from None
        result.jobs["prepare"] = prep
        record["jobs"].append({"kind": "prepare", "job_id": prep, "prepares": _leaders(sweep, groups),
                               "log": str(root.log_file("prepare", prep))})
        write_sweep_record(sweep.paths, record)
        say(f"prepare job {prep} submitted: {len(groups)} prepared set(s) for {len(sweep.points)} point(s)")
    n = len(sweep.points)
    try:
        train = sbatch_array(root.script("train"), f"afterok:{prep}" if prep else None, "train array")
    except SubmissionError as exc:
        if prep:
            slurm.try_scancel([prep])
        raise SubmissionError(f"{exc}{f'; cancelled prepare job {prep}' if prep else ''}") from None
    _pickles_or_cancel(sweep, train, lambda c: (run_train, (c.output_dir, c.preemption.signal)),
                       time_minutes(first.cluster.time), [train, *([prep] if prep else [])])
    result.jobs["train"] = train
    record["jobs"].append({"kind": "train", "job_id": train, "tasks": n,
                           **({"dependency": f"afterok:{prep}"} if prep else {})})
    for i, (cfg, manifest, attempt) in enumerate(zip(sweep.configs, manifests, attempts, strict=True)):
        point = RunPaths.of(cfg.output_dir)
        if prep:
            attempt["prepare_job"] = prep
            record_job(manifest, "prepare", prep, run_attempt=attempt["attempt"], log=str(root.log_file("prepare", prep)))
        attempt["train_job"] = f"{train}_{i}"
        record_job(manifest, "train", f"{train}_{i}", run_attempt=attempt["attempt"], array=train,
                   script=str(point.script("train")), log=str(point.log_file("train", f"{train}_{i}")),
                   **({"dependency": f"afterok:{prep}"} if prep else {}))
        write_manifest(point, manifest)
    write_sweep_record(sweep.paths, record)
    say(f"train array {train} submitted: {n} task(s), {min(n, sweep.cfg.sweep.parallel or n) if sweep.cfg.sweep else n} "
        "at a time" + (f", after prepare job {prep} succeeds" if prep else ""))
    if not first.consolidate.enabled:
        return
    sent = [j for j in result.jobs.values() if j]
    cons = _submit_after(sweep, "consolidate", train, sent, manifests, attempts, record, say)
    assert cons is not None
    result.jobs["consolidate"] = cons
    for kind in (k for k in MODEL_JOBS if model_job_enabled(first, k)):
        job = _submit_after(sweep, kind, cons, [cons, *sent], manifests, attempts, record, say)
        if job is not None:  # else sbatch refused it: the points train and consolidate without it, as a run alone's
            result.jobs[kind] = job


#: What each array after the train array is called in messages.
_AFTER = {"consolidate": "consolidation array", "serve": "serve-check array", "eval": "evaluation array"}


def _call_of(kind: str) -> Callable[[RunConfig], tuple[Callable[..., Any], tuple]]:
    from slurmft.job.entrypoint import run_consolidate, run_eval, run_serve

    if kind == "consolidate":
        return lambda c: (run_consolidate, (c.output_dir, None, None))
    return lambda c: (run_serve, (c.output_dir,)) if kind == "serve" else (run_eval, (c.output_dir,))


def _submit_after(sweep: Sweep, kind: str, after: str, sent: list[str], manifests: list[dict[str, Any]],
                  attempts: list[dict[str, Any]], record: dict[str, Any], say: Say) -> str | None:
    """One array after ``after`` (``--dependency=aftercorr:``: task i once task i of ``after`` succeeded; a task
    whose predecessor failed is cancelled, ``--kill-on-invalid-dep=yes``), recorded in sweep.json and in each point's
    manifest as the point's own ``<array>_<i>`` job. The consolidation array is needed: when it cannot be sent the
    jobs sent so far are cancelled. A serve or eval array is not: a refusal is said and the sweep goes on without it
    (``slurmft serve/eval POINT_DIR`` later), as a run alone does."""
    root = RunPaths.of(sweep.paths.root)
    what, first, optional = _AFTER[kind], sweep.configs[0], kind != "consolidate"
    section = first.model_job(kind) if optional else first.consolidate
    assert section is not None, kind
    try:
        job = sbatch_array(root.script(kind), f"aftercorr:{after}", what)
    except SubmissionError as exc:
        if optional:
            say(f"WARNING: {exc}; the sweep goes on without it (`slurmft {kind} POINT_DIR` once it is fixed)")
            return None
        cancelled = slurm.try_scancel(sent)
        raise SubmissionError(f"{exc}; {'cancelled' if cancelled else 'could NOT cancel (run scancel)'} "
                              f"{', '.join(sent)}") from None
    try:  # cancels this array (and, for the consolidation array, the jobs sent before it) when it cannot
        _pickles_or_cancel(sweep, job, _call_of(kind), time_minutes(section.resources.time),
                           [job] if optional else [job, *sent])
    except SubmissionError as exc:
        if not optional:
            raise
        say(f"WARNING: {exc}; the sweep goes on without it (`slurmft {kind} POINT_DIR` once it is fixed)")
        return None
    n = len(sweep.points)
    record["jobs"].append({"kind": kind, "job_id": job, "tasks": n, "dependency": f"aftercorr:{after}"})
    for i, (cfg, manifest, attempt) in enumerate(zip(sweep.configs, manifests, attempts, strict=True)):
        point = RunPaths.of(cfg.output_dir)
        attempt[f"{kind}_job"] = f"{job}_{i}"
        record_job(manifest, kind, f"{job}_{i}", run_attempt=attempt["attempt"], array=job,
                   dependency=f"afterok:{after}_{i}", script=str(point.script(kind)),
                   log=str(point.log_file(kind, f"{job}_{i}")))
        write_manifest(point, manifest)
    write_sweep_record(sweep.paths, record)
    say(f"{what} {job} submitted (task i after task i of {after} succeeds)")
    return job


# ------------------------------------------------------------------ local: the points one after another
def _run_points_here(sweep: Sweep, profile: ClusterProfile, config_path: str, template_dir: str | None,
                     groups: list[list[int]], record: dict[str, Any], result: SweepResult, say: Say) -> None:
    """Each point as ``submit_run`` runs a run alone here; a point that fails does not stop the others."""
    leaders = {g[0] for g in groups}
    for i, (p, cfg) in enumerate(zip(sweep.points, sweep.configs, strict=True)):
        point = RunPaths.of(cfg.output_dir)
        manifest = new_manifest(cfg.name, Executor.LOCAL.value, point.run_id, cfg.objective)
        attempt = start_attempt(manifest, "submit", **allocation(cfg))
        one = SubmitResult(point.root, Executor.LOCAL.value)
        result.points[p.name] = one
        say(f"point {i + 1}/{len(sweep.points)}: {p.name} ({p.label()})")
        cancelled: Cancelled | None = None
        try:
            dispatch_attempt(cfg, profile, point, config_path, template_dir, manifest, attempt, one, say,
                             need_prepare=i in leaders and prepared.needed(point, cfg))
        except Cancelled as exc:  # `slurmft cancel` of the sweep: the points after this one are not started
            cancelled = exc
        except (SubmissionError, RunDirError) as exc:
            result.failed[p.name] = str(exc)
            say(f"point {p.name} failed: {exc}")
        result.jobs.update({f"{p.name}:{k}": v for k, v in one.jobs.items()})
        record["points"][i]["jobs"] = dict(one.jobs)
        write_sweep_record(sweep.paths, record)
        if cancelled is not None:
            raise cancelled


# ------------------------------------------------------------------ resume: the points that died
@dataclass
class SweepResume:
    """What ``resume SWEEP_DIR`` did, point by point."""

    resumed: dict[str, Any] = field(default_factory=dict)  # name -> ResumeResult (a new train job and its chain)
    finished: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # name -> why it was not resumed

    def lines(self, root: Path) -> list[str]:
        """What ``resume SWEEP_DIR`` prints: each resumed point's jobs (``point NAME: KIND job: ID``), the others
        (then :func:`slurmft.cli_sweep.ending`: how to follow them, or a local sweep's ranking)."""
        out = [f"point {name}: {kind} job: {job_id}" for name, result in self.resumed.items()
               for kind, job_id in result.jobs.items()]
        out += [f"{what}: {', '.join(names)}" for what, names in (("finished", self.finished),
                                                                  ("still queued or running", self.live)) if names]
        if not self.resumed and not self.refused:
            out.append(f"{root}: no point to resume")
        return out


def resume_sweep(root: Path, overrides: list[str], template_dir: str | None = None, say: Say = quiet,
                 force: bool = False) -> SweepResume:
    """``slurmft resume`` of every point that is neither live nor finished, each as a run alone is resumed (its
    own train job from its newest complete checkpoint, a consolidation chained to it); the others are left alone.
    A point that cannot be resumed is said and does not stop the others. All under the sweep's lock
    (rundir.sweep_locked): a concurrent ``resume`` of the sweep or of one of its points waits for this one, then
    finds the points it resumed live."""
    from slurmft.submit.resume import LOCK_WAIT_S

    with sweep_locked(root, "resume", say, wait_s=LOCK_WAIT_S):
        return _resume_sweep_locked(root, overrides, template_dir, say, force)


def _resume_sweep_locked(root: Path, overrides: list[str], template_dir: str | None, say: Say,
                         force: bool) -> SweepResume:
    from slurmft.errors import SlurmftError
    from slurmft.submit.resume import Phase, resume_run
    from slurmft.watch.status import KINDS, run_state

    paths = SweepPaths(root)
    record = read_sweep_record(paths)
    out = SweepResume()
    try:
        for point in record["points"]:
            name = point["name"]
            if run_state(RunPaths.of(point["dir"]), adopt=False).may_run(KINDS):
                out.live.append(name)
                continue
            prepared_link = RunPaths.of(point["dir"]).prepared
            if prepared_link.is_symlink() and not prepared_link.exists():  # the sweep's prepare job never made it
                prepared_link.unlink()  # this point's resume prepares its own (a prepare job writes a directory here)
                say(f"point {name}: the prepared set it shared was never made; its resume prepares it again")
            try:
                result = resume_run(point["dir"], overrides, template_dir, say=say, force=force)
            except Cancelled:  # `slurmft cancel` of a local sweep this resume runs: no further point
                raise
            except SlurmftError as exc:
                out.refused[name] = exc.render()
                say(f"point {name}: not resumed: {exc.render()}")
                continue
            if result.phase == Phase.FINISHED:
                out.finished.append(name)
                continue
            out.resumed[name] = result
            point.setdefault("resumed", []).append(dict(result.jobs))
    finally:
        if out.resumed:
            record["jobs"].append({"kind": "resume", "points": {n: dict(r.jobs) for n, r in out.resumed.items()}})
            write_sweep_record(paths, record)
    return out


# ------------------------------------------------------------------ consolidate: the points without a model
@dataclass
class SweepConsolidation:
    """What ``consolidate SWEEP_DIR`` did, point by point."""

    jobs: dict[str, str] = field(default_factory=dict)  # name -> its consolidation job's id
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it was left alone
    failed: dict[str, str] = field(default_factory=dict)  # name -> why its consolidation could not be sent

    def lines(self) -> list[str]:
        """What ``consolidate SWEEP_DIR`` prints: ``point NAME: consolidate job: ID``, then the points left alone."""
        return ([f"point {name}: consolidate job: {job_id}" for name, job_id in self.jobs.items()]
                + [f"point {name}: {what}: {why}" for what, by_point in (("not consolidated", self.skipped),
                                                                         ("FAILED", self.failed))
                   for name, why in by_point.items()])


def consolidate_sweep(root: Path, template_dir: str | None = None, say: Say = quiet) -> SweepConsolidation:
    """``slurmft consolidate`` of every point that has a complete checkpoint, no model yet and no job that may still
    run: one consolidation job each, exactly ``slurmft consolidate POINT_DIR`` (its newest complete checkpoint into
    its ``model/``); a local sweep's run here one after another. One job per point rather than an array: the points
    that need it are any subset, and each job is then a run alone's, which ``status``/``logs`` of the point show.
    A point with its model is left alone (``consolidate POINT_DIR`` exports it again), as is a live one."""
    from slurmft.errors import CheckpointError, SlurmftError
    from slurmft.submit import consolidation
    from slurmft.watch.results import result_info
    from slurmft.watch.status import KINDS, run_state

    out = SweepConsolidation()
    with sweep_locked(root, "consolidate", say):
        points = read_sweep_record(SweepPaths(root))["points"]
        for i, point in enumerate(points):
            name, paths = point["name"], RunPaths.of(point["dir"])
            if (result := result_info(paths)) is not None:  # a LoRA point with consolidate.merge false: its adapter
                what = "adapter" if result == str(paths.adapter) else "model"
                out.skipped[name] = f"has its {what} ({result}; `slurmft consolidate {paths.root}` exports again)"
                continue
            try:
                if run_state(paths, adopt=False).may_run(KINDS):
                    out.skipped[name] = "a job of it is still queued or running (its chain consolidates it)"
                    continue
                request = consolidation.check_request(paths, None, None)
                out.jobs[name] = consolidation.submit(paths, request, template_dir, say)
            except CheckpointError as exc:
                out.skipped[name] = str(exc)
            except Cancelled as exc:  # `slurmft cancel` of the sweep while a local point consolidated: no further one
                rest = [p["name"] for p in points[i + 1:]]
                raise Cancelled(f"{exc}; {'not started: ' + ', '.join(rest) + '; ' if rest else ''}`slurmft "
                                f"consolidate {root}` consolidates the points without a model") from None
            except SlurmftError as exc:
                out.failed[name] = exc.render()
            else:
                say(f"point {name}: consolidation job {out.jobs[name]} ({request.checkpoint.name} -> {request.out})")
    return out
