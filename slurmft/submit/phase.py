"""Where a run stands, as far as continuing it goes: live, finished, trained without its model, or stopped short of
``train.max_steps``. One home for ``resume`` (what it does) and ``submit`` (what it says when refusing to overwrite
an ended run directory: only the command that applies). Pure functions of what the run directory says."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from slurmft.checkpoints import COMPLETE_MARKER, latest_complete, step_of
from slurmft.rundir import ADAPTER_CONFIG, MODEL_INDEX, RunPaths
from slurmft.watch.progress import max_steps_of


class Phase(str, Enum):
    """Where a run stands, as far as resuming goes."""

    LIVE = "live"  # a train job may still run: queued, starting, running, suspended, requeued, held
    FINISHED = "finished"  # trained to max_steps and consolidated
    TRAINED = "trained"  # trained to max_steps, no consolidated model
    RESUMABLE = "resumable"  # training stopped short of max_steps


def classify(live_train: list[str], trained_step: int | None, max_steps: int | None, model_ready: bool) -> Phase:
    """The run's phase from its live train jobs, the newest complete checkpoint's step and the model
    (``max_steps`` None: ``train.epochs`` not counted yet, so not finished)."""
    if live_train:
        return Phase.LIVE
    if trained_step is not None and max_steps is not None and trained_step >= max_steps:
        return Phase.FINISHED if model_ready else Phase.TRAINED
    return Phase.RESUMABLE


def model_ready(paths: RunPaths, final_checkpoint: Path | None, adapter_only: bool = False) -> bool:
    """A consolidated model exists and is not older than the final checkpoint (``adapter_only``: a LoRA run
    with ``consolidate.merge: false``, whose consolidation writes only ``adapter/``)."""
    index = paths.adapter / ADAPTER_CONFIG if adapter_only else paths.model / MODEL_INDEX
    if not index.is_file() or final_checkpoint is None:
        return False
    return index.stat().st_mtime >= (final_checkpoint / COMPLETE_MARKER).stat().st_mtime


def ended_run_words(paths: RunPaths) -> str:
    """What an ended run directory holds, with the one command that applies to it, for ``submit``'s refusal to
    overwrite it: a finished run (nothing to run; ``resume`` of it does nothing), one trained but not consolidated
    (``slurmft consolidate``), or one that stopped short of ``train.max_steps`` (``slurmft resume``)."""
    latest = latest_complete(paths.checkpoints)
    step = step_of(latest) if latest else None
    max_steps = max_steps_of(paths)
    ready = model_ready(paths, latest) or model_ready(paths, latest, adapter_only=True)
    phase = classify([], step, max_steps, ready)
    if phase == Phase.FINISHED:
        return f"a finished run (trained to step {step} and consolidated)"
    if phase == Phase.TRAINED:
        return (f"a finished run (trained to step {step}) without its model: `slurmft consolidate {paths.root}` "
                "exports it")
    at = f"at step {step} of {max_steps or '?'}" if step is not None else "before its first complete checkpoint"
    return (f"a run that stopped {at}: `slurmft resume {paths.root}` continues it from its newest complete "
            "checkpoint")
