"""Resuming from the newest checkpoint that loads on every rank: the load guards, and the fallback to older ones.

What the Trainer does when it resumes (``Trainer.train(resume_from_checkpoint=...)``): it reads
``trainer_state.json``, prepares the model and a new optimizer with accelerate, then loads the sharded model and
optimizer into them (accelerate 1.15 ``load_fsdp_model``/``load_fsdp_optimizer``: ``dcp.load`` straight into the
live DTensor shards), the scheduler, and, inside the epoch loop just before the first step, this rank's
``rng_state_<rank>.pth``. Why that is not enough: the size check of discovery cannot see a shard with the right
length and wrong bytes, so every requeue fails on the same checkpoint; and a failure raises only on the ranks that
hit it (DCP shares a read error among ranks, but a rank's own rng file or an unreadable scheduler does not), so the
other ranks walk into the first all-gather and wait there for the collective time-out.

What we do (the candidates, newest first, come from candidates.py):

- :func:`guard_loading` wraps the Trainer's four loading methods: each ends with an all-gather of "my error or
  None" (:func:`slurmft.job.distributed.gather_errors`), so a failure on any rank raises
  :class:`CheckpointLoadFailed` on every rank at the same point, before the first optimizer step;
  :func:`check_trainer_state` does the same for ``trainer_state.json``, which ``train`` reads outside those methods.
- :func:`train_newest_loadable` tries the verified checkpoints newest first. After a failure it drops that Trainer
  (its optimizer, scheduler and accelerate state) and builds a fresh one on the same sharded model for the next
  older checkpoint. No rank ever trains a half-loaded model: a resuming job's shards start uninitialised (it does
  not read the base weights, slurmft/job/loading.py) and the failed load may have written part of the bad
  checkpoint into them (DCP copies in place), but the retry's DCP load is strict (``DefaultLoadPlanner``, no
  partial load), so every parameter and persistent buffer is overwritten by the older checkpoint before any step,
  and the optimizer state is new; when no checkpoint loads, the job stops with a :class:`CheckpointError` naming
  each one and why, rather than training from step 0 or from a partial load.
- Once the fallback loaded (its first step begins), rank 0 sets the checkpoints that failed aside
  (``unloadable-checkpoint-<step>/``, :func:`slurmft.checkpoints.set_aside`, :class:`SetAsideFailed`) and the
  saver never rotates away the one it resumed from (``CompleteCheckpoints.protect``, complete.py). Setting aside
  matters beyond tidiness: left in place, the bad checkpoint would count towards ``keep_last`` (rotation would
  delete the good one), a warning signal at its step would skip the save ("already complete"), and every later
  requeue would fail on it again. Rotation then deletes the set-aside directory like a damaged one.

Why not validate by loading before ``train``: the optimizer does not exist until ``train`` prepares it, and loading
model and optimizer once more just to check them doubles the resume read (at 70B, ~830 GB). A fresh Trainer costs a
second pass over the (cached) dataset preparation, and only on the rare failure path.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from transformers import TrainerCallback

from slurmft import checkpoints
from slurmft.errors import CheckpointError
from slurmft.job.checkpointing.failures import per_message, reason
from slurmft.job.distributed import DistContext, barrier, gather_errors

log = logging.getLogger(__name__)


# The Trainer's methods that read a checkpoint when resuming, and what each one reads.
LOADERS = {
    "_load_from_checkpoint": "the model (pytorch_model_fsdp_0/)",
    "_load_optimizer_and_scheduler": "the optimizer and scheduler (optimizer_0/, scheduler.pt; GRPO: grpo_rollouts_<rank>.pt)",
    "_load_scaler": "the gradient scaler (scaler.pt)",
    "_load_rng_state": "the random generator state (rng_state_<rank>.pth)",
}


class CheckpointLoadFailed(Exception):
    """Raised on every rank, at the same point, when loading ``checkpoint`` failed on any rank."""

    def __init__(self, checkpoint: Path, problems: list[str]) -> None:
        super().__init__(f"loading {checkpoint.name} failed: {'; '.join(problems)}")
        self.checkpoint = checkpoint
        self.problems = problems


def _agree_loaded(ctx: DistContext, checkpoint: Path, what: str, error: str | None) -> None:
    """All-gather each rank's error; if any rank failed, every rank raises the same CheckpointLoadFailed."""
    failed = gather_errors(ctx, error)
    if not failed:
        return
    raise CheckpointLoadFailed(checkpoint, [f"{what}: {line}" for line in per_message(failed, ctx.world_size)])


def _agreed(load: Callable[..., Any], what: str, ctx: DistContext) -> Callable[..., Any]:
    @functools.wraps(load)
    def load_and_agree(checkpoint: str | None, *args: Any, **kwargs: Any) -> Any:
        if checkpoint is None:
            return load(checkpoint, *args, **kwargs)
        result, error = None, None
        try:
            result = load(checkpoint, *args, **kwargs)
        except (Exception, CheckpointException) as exc:  # DCP's error derives from BaseException
            error = reason(exc)
        _agree_loaded(ctx, Path(checkpoint), what, error)
        return result

    return load_and_agree


def guard_loading(trainer: Any, ctx: DistContext) -> None:
    """Make each of the Trainer's checkpoint loads end with an agreement of every rank (see the module)."""
    for name, what in LOADERS.items():
        setattr(trainer, name, _agreed(getattr(trainer, name), what, ctx))


def check_trainer_state(checkpoint: Path, ctx: DistContext) -> None:
    """Every rank parses ``trainer_state.json`` (``train`` reads it before any guarded load) and agrees.

    Its ``global_step`` must be the directory's step: another step means files of two saves.
    """
    from transformers import TrainerState

    error = None
    try:
        state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
        if state.global_step != checkpoints.step_of(checkpoint):
            error = f"it records global_step {state.global_step}, not {checkpoints.step_of(checkpoint)}"
    except Exception as exc:
        error = reason(exc)
    _agree_loaded(ctx, checkpoint, "the trainer state (trainer_state.json)", error)


class SetAsideFailed(TrainerCallback):
    """At the first step after a fallback (everything loaded): rank 0 sets the checkpoints that failed aside.

    Must come before :class:`~slurmft.job.callbacks.PreemptionStop` (which may stop at that step).
    """

    def __init__(self, ctx: DistContext, info: dict[str, Any]) -> None:
        self.ctx = ctx
        self.info = info
        self.failed: list[CheckpointLoadFailed] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.failed:
            return control
        if self.ctx.is_main:
            for failure in self.failed:
                aside = checkpoints.set_aside(failure.checkpoint, failure.problems, **self.info)
                log.warning("set %s aside as %s (it failed to load; rotation removes it)",
                            failure.checkpoint.name, aside.name)
        self.failed = []
        barrier()  # no rank looks for checkpoints while rank 0 renames
        return control


def train_newest_loadable(trainer: Any, rebuild: Callable[[], Any], candidates: list[Path], ctx: DistContext,
                          set_aside: SetAsideFailed, protect: Callable[[Path], None],
                          check: Callable[[Path], None] | None = None) -> tuple[Any, Path | None]:
    """``trainer.train`` resuming from the newest of ``candidates`` (newest first) that loads on every rank.

    On a :class:`CheckpointLoadFailed` the Trainer is dropped and ``rebuild()`` makes a fresh one for
    the next older candidate; ``protect(path)`` tells the saver which checkpoint a fallback resumed
    from (rotation keeps it) and ``check(path)`` runs before each try (e.g. the precision check).
    Returns the Trainer that trained and the checkpoint it resumed from (None: fresh start, only
    when there were no candidates). Raises :class:`CheckpointError` when none loads;
    ``StopBeforeFirstStep`` passes through.
    """
    if not candidates:
        trainer.train(resume_from_checkpoint=None)
        return trainer, None
    failures: list[CheckpointLoadFailed] = []
    for checkpoint in candidates:
        if check is not None:
            check(checkpoint)
        if failures:
            trainer.accelerator.free_memory()
            del trainer
            gc.collect()  # the failed attempt's optimizer state goes before the new one is allocated
            trainer = rebuild()
            protect(checkpoint)
            if ctx.is_main:
                log.warning("falling back to %s", checkpoint.name)
        try:
            check_trainer_state(checkpoint, ctx)
            set_aside.failed = list(failures)  # set aside at the first step, once this one loaded
            trainer.train(resume_from_checkpoint=str(checkpoint))
        except CheckpointLoadFailed as failure:
            if ctx.is_main:
                log.warning("could not load %s: %s", checkpoint.name, "; ".join(failure.problems))
            failures.append(failure)
            continue
        return trainer, checkpoint
    set_aside.failed = []  # nothing loaded: every checkpoint stays where it is, for a person to look at
    raise CheckpointError(
        f"no checkpoint in {candidates[0].parent} could be loaded (tried newest first); the job stops rather than "
        "train from step 0. Repair them, or move them out of that directory to start this run over",
        problems=[f"{f.checkpoint.name}: {'; '.join(f.problems)}" for f in failures],
    )
