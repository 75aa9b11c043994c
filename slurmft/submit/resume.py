"""``slurmft resume``: continue a run that died, from its newest complete checkpoint.

Slurm's own requeue (the warning signal, ``scontrol requeue``) keeps the job id, so the ``afterok``
consolidation job stays valid. Every other ending leaves the train job FAILED, CANCELLED, TIMEOUT,
NODE_FAIL or OUT_OF_MEMORY, and Slurm cancels its consolidation job (``--kill-on-invalid-dep=yes``; one
still queued, of a run submitted before that, is cancelled here): a new job id is needed, and a new
consolidation chained to it. With ``prepare.enabled`` the train job reads
``RUN_DIR/prepared/``: a failed prepare job is submitted again and the rest chained to it; a prepared set
that no longer matches the config (a source edited since) is refused with the fix (``slurmft prepare``). A resume is a submit of an existing run
directory: the resolved ``config.yaml`` (overrides only where they cannot change the training math),
the same templates, a new submitit pickle, and the trainer's automatic resume from the newest
``COMPLETE`` checkpoint. What happened is kept as a new *attempt* in the manifest, with its allocation.

A resume may move the run to another allocation (``resources.nodes``, ``resources.tasks_per_node``,
``resources.gpus_per_node``): the global batch is kept and accumulation recomputed
(:mod:`slurmft.plan.elastic`), so the data position and the schedule carry over; DCP reshards the model
and optimizer at load.

The decisions are pure functions (:func:`slurmft.submit.phase.classify`, :func:`ended_how`, :func:`check_overrides`), the
effects live in :func:`resume_run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft import prepared
from slurmft.checkpoints import latest_complete, read_marker, step_of
from slurmft.config import Executor, RunConfig
from slurmft.config_loading import apply_overrides, dump_config, parse_override, read_run_config, read_yaml
from slurmft.errors import ConfigError, RunDirError, SubmissionError
from slurmft.job.requeue import EXIT_REQUEUE_REFUSED  # torch-free: the batch shell runs it
from slurmft.plan.elastic import ALLOCATION_KEYS, BATCH_KEYS, BatchShape, allocation, reshape
from slurmft.prepared import needed as prepare_needed
from slurmft.rundir import (
    RunPaths,
    acquire_lock,
    atomic_write,
    check_owner,
    planned_max_steps,
    read_manifest,
    release_lock,
    start_attempt,
    sweep_locked,
    write_manifest,
)
from slurmft.slurm import scancel
from slurmft.slurm_states import State, parse, words
from slurmft.submit.phase import Phase, classify, model_ready
from slurmft.watch.status import KINDS, RunState, run_state

# Keys a resume may change: where and how the job runs, how often it saves and logs, never what it computes (the
# batch keys only when the global batch stays: slurmft/plan/elastic.py). The checkpoint keys change when and how a
# save is written, not the training (a resumed run is bitwise the uninterrupted one whatever they are: saves touch
# no RNG and no state; tests/test_resume_local.py); the async-failure message tells the user to change them.
ALLOWED_PREFIXES = ("cluster.", "preemption.", "consolidate.", "prepare.resources.", "serve.", "eval.")
ALLOWED_KEYS = ("checkpoint.keep_last", "checkpoint.every_steps", "checkpoint.async", "checkpoint.max_failed_saves",
                "train.logging_steps", "resources.cpus_per_task", "resources.mem", "resources.exclusive",
                *ALLOCATION_KEYS, *BATCH_KEYS)
#: Refused keys that do not change what the training computes, each with the reason that holds for it (every other
#: refused key would change the training math).
REFUSED_WHY = {
    "name": "it names the run's jobs and tracker runs, which stay as submitted",
    "output_dir": "the run directory is the run; it does not move",
    "executor": "a run continues where it was started",
    "train.report_to": "the trackers' packages are checked in the job's Python only at submit",
}


def check_overrides(overrides: list[str]) -> None:
    """Refuse overrides that could change the training math, or the run's identity (every refused key named,
    each with the reason that holds for it)."""
    refused = []
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if not (key.startswith(ALLOWED_PREFIXES) or key in ALLOWED_KEYS):
            refused.append(key)
    if not refused:
        return
    allowed = ", ".join([p + "*" for p in ALLOWED_PREFIXES] + list(ALLOWED_KEYS))
    hints = [f"allowed on resume: {allowed}",
             "to train differently, submit a new run (a new output_dir) instead"]
    if any(key.startswith("lora.") for key in refused):
        hints.insert(0, "lora: the checkpoint holds adapters of the shape they were trained with (r, alpha, "
                        "targets); a resume on another allocation reshards them, it cannot change them")
    if any(key.startswith("model.") for key in refused):
        hints.insert(0, "model: the checkpoint holds this model's weights; another model cannot continue them")
    math = [key for key in refused if key not in REFUSED_WHY]
    reasons = ([f"{', '.join(math)}: it would change what the resumed training computes"] if math else []) + [
        f"{key}: {REFUSED_WHY[key]}" for key in refused if key in REFUSED_WHY]
    raise ConfigError(f"resume cannot change {'; '.join(reasons)}", hints)


def ended_how(state: str, exit_code: str = "") -> str:
    """Why a train job ended, in words, from its Slurm state and exit code (``N:S``): the one table of
    :mod:`slurmft.slurm_states`, plus what resume knows (the exit code, who cancels, max_steps)."""
    code, _, sig = (exit_code or "").partition(":")
    known = parse(state)
    if known == State.FAILED:
        if code == str(EXIT_REQUEUE_REFUSED):  # sacct's ExitCode is "N:S"
            return ("saved after a warning signal, but the requeue budget (preemption.max_requeues) was used up "
                    f"(exit {EXIT_REQUEUE_REFUSED})")
        detail = f"exit code {code}" if code and code != "0" else (f"signal {sig}" if sig and sig != "0" else "")
        return f"{words(state)} ({detail})" if detail else words(state)
    extra = {State.CANCELLED: " (scancel)", State.PREEMPTED: " (not requeued)",
             State.COMPLETED: " before max_steps"}.get(known, "") if known else ""
    return words(state) + extra


def _shape(cfg: RunConfig) -> BatchShape:
    """The batch shape ``cfg`` trains with: its training ranks (a GRPO vLLM server's node holds none)."""
    return BatchShape(cfg.train_world_size, cfg.train.per_device_batch_size, cfg.train.gradient_accumulation_steps)


def _world_size(paths: RunPaths, previous: RunConfig, overrides: list[str]) -> int:
    """The training ranks ``overrides`` ask for, read before the batch is refitted to them: the whole config with
    the new allocation and the old batch need not be valid (a GRPO generation batch of 1 rank x 2 x 1 cannot hold a
    group of 4 completions, while the refitted 1 x 2 x 2 does), so only its ``resources`` are checked here."""
    data = apply_overrides(read_yaml(paths.config), overrides)
    resources = type(previous.resources).model_validate(data.get("resources") or {})
    return previous.model_copy(update={"resources": resources}).train_world_size


def saved_shape(previous: RunConfig, ckpt: Path | None) -> BatchShape:
    """The batch shape ``ckpt`` was trained with: its marker's record (world size, per-device batch,
    accumulation), each missing field (a marker older than that record) from the run's config as it was."""
    record = read_marker(ckpt) if ckpt is not None else {}
    shape = _shape(previous)
    values = [record.get(k) for k in ("world_size", "per_device_batch_size", "gradient_accumulation_steps")]
    return BatchShape(*(v if isinstance(v, int) and v > 0 else d for v, d in zip(values, (
        shape.world_size, shape.per_device_batch_size, shape.gradient_accumulation_steps), strict=True)))


def resume_config(paths: RunPaths, overrides: list[str], executor: str, ckpt: Path | None = None,
                  say: Any = lambda _: None) -> RunConfig:
    """The run's resolved config with ``overrides`` (already checked by :func:`check_overrides`) applied; on
    another number of ranks than ``ckpt`` was saved by, the batch recomputed to keep its global batch
    (:func:`slurmft.plan.elastic.reshape`; a ConfigError when it cannot)."""
    if not paths.config.is_file():
        raise RunDirError(f"{paths.root} has a manifest but no {paths.config.name}: it cannot be resumed")
    previous = read_run_config(paths.config)
    saved = saved_shape(previous, ckpt)
    batch_named = any(".".join(parse_override(text)[0]) in BATCH_KEYS for text in overrides)
    requested = _shape(read_run_config(paths.config, overrides)) if batch_named else None
    shape = reshape(saved, _world_size(paths, previous, overrides), requested)
    cfg = read_run_config(paths.config, [*overrides, f"train.per_device_batch_size={shape.per_device_batch_size}",
                                         f"train.gradient_accumulation_steps={shape.gradient_accumulation_steps}"])
    if shape.world_size != saved.world_size:
        say(f"{ckpt.name if ckpt else 'the run'} was trained on {saved.world_size} ranks, this attempt runs on "
            f"{shape.world_size}: global batch of {shape.global_batch} sequences per step kept ({saved.words()} "
            f"-> {shape.words()}); the model and optimizer are resharded at load")
    cfg.executor = Executor(executor)  # where the run was started is where it continues
    return cfg


@dataclass
class ResumeResult:
    """What ``resume`` did (or why it had nothing to do)."""

    phase: Phase
    run_dir: Path
    executor: str
    jobs: dict[str, str] = field(default_factory=dict)
    resumed_from: Path | None = None
    step: int | None = None
    cancelled: list[str] = field(default_factory=list)
    previous: dict[str, Any] | None = None


def _previous_end(state: RunState) -> dict[str, Any] | None:
    rows = [r for r in state.rows if r["kind"] == "train"]
    if not rows:
        return None
    last = rows[-1]
    return {"job_id": last["job_id"], "state": last["state"], "exit_code": last.get("exit_code", ""),
            "ended": ended_how(last["state"], last.get("exit_code", ""))}


def check_hub_commits(paths: RunPaths, say: Any) -> None:
    """A hub data set pushed again since its preparation is refused with the fix (the train job would read
    the old commit's sequences while the config names the data set); one the hub cannot be asked about is said."""
    record = prepared.read_record(paths) or {}
    changes, unchecked = prepared.hub_changes(record)
    if changes:
        raise prepared.refusal(paths, changes)
    for source in unchecked:
        say(f"note: could not ask the hub whether {source} has a new commit; the prepared data is used as it is")


#: Seconds a resume waits for another command that holds the run's lock (a concurrent resume's sbatch calls).
LOCK_WAIT_S = 120.0


def resume_run(
    run_dir: str | Path, overrides: list[str] | None = None, template_dir: str | None = None,
    say: Any = lambda _: None, force: bool = False,
) -> ResumeResult:
    """Continue a run that is not live and not trained to ``max_steps``: cancel its stale consolidation,
    submit a new train job (it resumes from the newest complete checkpoint) and a consolidation chained
    to it, and record the attempt. A finished run is reported, not resubmitted.

    Everything is decided under the run's lock, from the manifest and Slurm's answer read there: two
    resumes at once submit one train job (the second waits, then finds it live), and no write drops
    another command's job entries. A sweep's point is resumed under its sweep's lock too (rundir.sweep_locked):
    ``resume SWEEP_DIR`` and ``resume POINT_DIR`` take turns. Another user's run is refused unless ``force``; a job we cannot see
    (another user's, hidden by Slurm; a process on another host) is never taken for ended, forced or not."""
    paths = RunPaths.of(run_dir)
    overrides = list(overrides or [])
    check_overrides(overrides)
    check_owner(paths, read_manifest(paths), "resume", force)  # before waiting for a lock that is not ours
    with sweep_locked(paths.root, "resume", say, wait_s=LOCK_WAIT_S):  # a sweep's point: its sweep's lock first
        acquire_lock(paths, "resume", say, wait_s=LOCK_WAIT_S)
        try:
            return _resume_locked(paths, overrides, template_dir, say, force)
        finally:
            release_lock(paths)


def _resume_locked(paths: RunPaths, overrides: list[str], template_dir: str | None, say: Any,
                   force: bool) -> ResumeResult:
    from slurmft.plan.render import render_scripts
    from slurmft.profiles import load_profile
    from slurmft.submit.dispatch import SubmitResult, check_executor, check_submittable, dispatch_attempt

    state = run_state(paths)  # under the lock: the manifest as the last writer left it
    check_owner(paths, state.manifest, "resume", force)
    executor = state.manifest.get("executor", "slurm")
    for job in state.adopted:
        say(f"found {job['kind']} job {job['job_id']} tagged with this run but missing from the manifest; adopted it")
    # live, hidden or unjudgeable (squeue silent) jobs refuse the resume; a consolidation queued or running too
    # (it would export the model while the new train job trains); waiting jobs that never start do not count
    state.check_quiet(KINDS, "nothing to resume")
    latest = latest_complete(paths.checkpoints)
    notes: list[str] = []  # said once nothing refuses the resume
    cfg = resume_config(paths, overrides, executor, latest, notes.append)
    step = step_of(latest) if latest else None
    max_steps = planned_max_steps(paths, cfg.train.max_steps, cfg.train.epochs)
    adapter_only = cfg.lora is not None and not cfg.consolidate.merge  # consolidation writes adapter/ only
    live = [r["job_id"] for r in state.may_run(("prepare", "train"))]  # none: check_quiet refused those
    phase = classify(live, step, max_steps, model_ready(paths, latest, adapter_only))
    result = ResumeResult(phase, paths.root, executor, resumed_from=latest, step=step)
    if phase == Phase.FINISHED:
        return result
    if phase == Phase.TRAINED:
        raise RunDirError(f"training already reached train.max_steps ({max_steps}, {latest}) but there is "
                          f"no consolidated model: run `slurmft consolidate {paths.root}`")
    check_submittable(cfg)
    need_prepare = prepare_needed(paths, cfg)  # prepared/ changed since: refused here, nothing submitted
    if not need_prepare and cfg.prepare.enabled:
        check_hub_commits(paths, say)
    profile = load_profile(cfg.cluster.profile)
    config_path = str(paths.config)
    scripts = render_scripts(cfg, profile, paths, config_path, template_dir)
    check_executor(cfg.resolved_executor)

    # jobs still queued that will never start (their prepare or train job failed): a run submitted before every
    # dependent job got --kill-on-invalid-dep, or one Slurm has not cancelled yet
    stale = [r for r in state.rows if r["kind"] in ("train", "consolidate", "serve", "eval") and state.never_runs(r)
             and r.get("dependency")] if executor != "local" else []
    if stale:
        ids = [r["job_id"] for r in stale]
        try:
            scancel(ids)
        except SubmissionError as exc:
            raise SubmissionError(f"{exc}; the stale job(s) stay queued and nothing was submitted") from None
        result.cancelled = ids
        for kind, what, after in (("serve", "stale serve check", "a consolidation that will never run"),
                                  ("eval", "stale evaluation", "a consolidation that will never run"),
                                  ("consolidate", "stale consolidation", "a train job that will never succeed"),
                                  ("train", "train", "a prepare job that did not succeed")):
            of_kind = [r["job_id"] for r in stale if r["kind"] == kind]
            if of_kind:
                say(f"cancelled {what} job(s) {', '.join(of_kind)} (they waited on {after})")
    manifest = state.manifest
    if overrides:
        atomic_write(paths.config, dump_config(cfg))
    for kind, text in scripts.items():
        atomic_write(paths.script(kind), text, executable=True)
    result.previous = _previous_end(state)
    attempt = start_attempt(
        manifest, "resume", resumed_from=str(latest) if latest else None, resumed_from_step=step,
        previous=result.previous, overrides=overrides, cancelled=result.cancelled, **allocation(cfg))
    write_manifest(paths, manifest)
    if latest:
        say(f"resuming {paths.root} from {latest.name} (step {step})")
    elif result.previous is None:  # its first train job: `slurmft prepare run.yaml` made the run directory, or a
        # local sweep stopped before this point
        ready = ": its data is prepared" if cfg.prepare.enabled and not need_prepare else ""
        say(f"starting {paths.root}'s training (no train job before{ready})")
    else:
        say(f"resuming {paths.root}: no complete checkpoint, training starts again at step 0")
    for note in notes:
        say(note)
    submitted = SubmitResult(paths.root, executor)
    try:
        dispatch_attempt(cfg, profile, paths, config_path, template_dir, manifest, attempt, submitted, say,
                         need_prepare=need_prepare)
    finally:
        result.jobs = dict(submitted.jobs)
        write_manifest(paths, manifest)
    return result
