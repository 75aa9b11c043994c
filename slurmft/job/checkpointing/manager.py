"""The door train.py uses to the job's checkpoints: :class:`CheckpointManager`.

torchtitan keeps its checkpointer apart from its trainer: one manager, guarded public save and load, private
hooks. Ours wraps the HF Trainer's own save and resume rather than replacing them, so its parts are hooks into the
Trainer (callbacks, wrapped methods), and they share state: the checkpoint a fallback resumed from (rotation must
keep it), the failures to set aside at the first step. The manager owns the callbacks and that state, and gives
the job four calls in the order it needs them: :meth:`~CheckpointManager.resume_candidates` before the model
(whether the base weights are read), :meth:`~CheckpointManager.callbacks` once model and tokenizer exist,
:meth:`~CheckpointManager.attach` on every Trainer built, :meth:`~CheckpointManager.train` to train from the newest
checkpoint that loads. The parts are this package's other files (its ``__init__`` lists them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from slurmft.job.checkpointing.adapter_state import own_adapter_checkpoints
from slurmft.job.checkpointing.candidates import resume_candidates
from slurmft.job.checkpointing.complete import CompleteCheckpoints
from slurmft.job.checkpointing.fallback import SetAsideFailed, guard_loading, train_newest_loadable
from slurmft.job.checkpointing.writing import skip_unchecked_crc32
from slurmft.job.distributed import DistContext
from slurmft.rundir import RunPaths


class CheckpointManager:
    """The checkpoints of one attempt: the save callbacks, the guarded loads, resuming with fallback.

    Made before the model (:meth:`resume_candidates` decides whether the base weights are read);
    :meth:`callbacks` once the model and tokenizer exist; :meth:`attach` on every Trainer built
    (a fallback builds a fresh one); :meth:`train` to train from the newest checkpoint that loads.
    """

    def __init__(self, ctx: DistContext, paths: RunPaths) -> None:
        self.ctx = ctx
        self.paths = paths
        skip_unchecked_crc32()
        self.saver: CompleteCheckpoints | None = None
        self.set_aside: SetAsideFailed | None = None

    def resume_candidates(self) -> list[Path]:
        """The verified checkpoints, newest first, on every rank (see :func:`resume_candidates`)."""
        return resume_candidates(self.paths, self.ctx)

    def callbacks(self, model_config: Any, generation_config: Any, tokenizer: Any, keep_last: int,
                  info: dict[str, Any], marker_info: dict[str, Any], lead_time_s: float | None = None,
                  asynchronous: bool = False, max_failed_saves: int = 3) -> list[TrainerCallback]:
        """The saver and the set-aside, in their order; both must come before PreemptionStop.

        Every rank at once (an asynchronous saver creates its process group here)."""
        self.saver = CompleteCheckpoints(self.ctx, model_config, generation_config, tokenizer, keep_last, marker_info,
                                         lead_time_s=lead_time_s, asynchronous=asynchronous,
                                         max_failed_saves=max_failed_saves, metrics=self.paths.metrics)
        self.set_aside = SetAsideFailed(self.ctx, info)
        return [self.saver, self.set_aside]

    def attach(self, trainer: Any) -> None:
        """A new Trainer: its saves are timed, its checkpoint loads end with an agreement of every rank."""
        assert self.saver is not None, "callbacks() first"
        own_adapter_checkpoints()
        self.saver.watch(trainer)
        guard_loading(trainer, self.ctx)

    def train(self, trainer: Any, rebuild: Callable[[], Any], candidates: list[Path],
              check: Callable[[Path], None] | None = None) -> tuple[Any, Path | None]:
        """``trainer.train`` from the newest of ``candidates`` that loads (see :func:`train_newest_loadable`)."""
        assert self.saver is not None and self.set_aside is not None, "callbacks() first"
        try:
            return train_newest_loadable(trainer, rebuild, candidates, self.ctx, self.set_aside, self.saver.protect,
                                         check)
        finally:
            self.saver.close()  # the background write ends before the process group goes
