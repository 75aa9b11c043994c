"""A save counts once it is whole: the COMPLETE marker, rotation, and the wait for a save still being written.

What the Trainer does when it saves (transformers 5.24): ``_save_checkpoint`` writes the sharded model and
optimizer (accelerate's ``save_fsdp_model``/``save_fsdp_optimizer``, DCP), the scheduler, the rng state and
``trainer_state.json``, then rotates by mtime down to ``save_total_limit``, *before* anything says the save is
whole: a save that dies afterwards could leave fewer than ``keep_last`` usable checkpoints.

What we do: the Trainer's rotation is off, and :class:`CompleteCheckpoints` (``on_save``) fsyncs, waits for every
rank, has rank 0 add config and tokenizer, write the ``COMPLETE`` marker (how long the save took, every file with
its size) and rotate: only verified checkpoints count, the newest ``keep_last`` stay, torn or damaged ones go only
while a verified one remains, and the one a fallback resumed from never goes (fallback.py). Which directories count is torch-free discovery, shared with the login side (slurmft/checkpoints.py);
both the save's rotation and the resume's clean-up go through its one :func:`slurmft.checkpoints.prune`. A save
written in the background (writing.py) is marked only once every rank's write succeeded,
and the final save is always synchronous.

Measured: each save's blocked and durable seconds and its bytes go to metrics.jsonl (``slurmft status``, ``slurmft report``
and bench/async_save.py read them); making the files durable and writing config and tokenizer in the background thread was most of
what training still waited for at an asynchronous save's marker.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from transformers import TrainerCallback

from slurmft.checkpoints import COMPLETE_MARKER, damaged, make_durable, mark_complete, prune, step_dir
from slurmft.errors import CheckpointError
from slurmft.job import preemption
from slurmft.job.checkpointing.failures import per_message, reason
from slurmft.job.checkpointing.writing import BackgroundWriter, Save
from slurmft.job.distributed import DistContext, any_rank, barrier, gather_errors
from slurmft.rundir import SAVE_EVENT

log = logging.getLogger(__name__)


class CompleteCheckpoints(TrainerCallback):
    """After every save: each rank makes its files durable, all ranks barrier, rank 0 adds config + tokenizer,
    writes COMPLETE, rotates, and records the save in metrics.jsonl.

    Rotation is ours (the Trainer's ``save_total_limit`` is off): the Trainer rotates by mtime *before*
    the marker exists, so a save that dies afterwards could leave fewer than ``keep_last`` usable
    checkpoints. Here only verified checkpoints count, the newest ``keep_last`` stay, and torn or
    damaged ones go only while a verified one remains, and a checkpoint that a fallback resumed from
    (:meth:`protect`, :func:`train_newest_loadable`) never goes. COMPLETE records how long the save took and
    every file with its size; rank 0 warns when a save took more than half of ``lead_time_s`` (the
    warning signal would leave too little time to save).

    Asynchronous saves (``checkpoint.async``): a periodic save is staged at the step boundary and written
    by :class:`BackgroundWriter`; at most one is in flight. Its marker comes once every rank's write
    finished without error (each rank's future, agreed by an all-gather) and DCP's ``.metadata`` exists:
    at the first step end where every rank's write is done, or when the next save, the end of training
    or a stop must wait for it. A failed write leaves no COMPLETE, is logged on every rank and training
    goes on; ``max_failed_saves`` failures in a row stop the run. The final save (``max_steps``, the
    warning signal) is synchronous; when the stop came right after an asynchronous save of the same step,
    that save is waited for instead (and redone synchronously if it failed).
    """

    def __init__(self, ctx: DistContext, model_config: Any, generation_config: Any, tokenizer: Any,
                 keep_last: int, info: dict[str, Any], lead_time_s: float | None = None,
                 asynchronous: bool = False, max_failed_saves: int = 3, metrics: Path | None = None) -> None:
        self.ctx = ctx
        self.model_config = model_config
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.keep_last = keep_last
        self.info = info
        self.lead_time_s = lead_time_s
        self.metrics = metrics
        self.max_failed_saves = max_failed_saves
        self.writer = BackgroundWriter(ctx) if asynchronous else None
        self.current: Save | None = None  # being saved by the Trainer now
        self.pending: Save | None = None  # written in the background, not marked yet
        self.failed_in_a_row = 0
        self.last_save_s: float | None = None
        self.protected: tuple[Path, ...] = ()
        self._trainer: Any = None
        self._model: Any = None

    def protect(self, checkpoint: Path) -> None:
        """Rotation never deletes ``checkpoint`` (this attempt fell back to it: the one known to load)."""
        self.protected = (*self.protected, checkpoint)

    def watch(self, trainer: Any) -> None:
        """Every save of ``trainer`` goes through here: the previous one finishes first, then this one is
        written synchronously or staged for the background (periodic saves, ``checkpoint.async``)."""
        original = trainer._save_checkpoint

        def save_checkpoint(model: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
            final = trainer.control.should_training_stop  # max_steps or a stop: synchronous, and first
            # one save in flight: the previous one is marked (or failed) first; a failure never stops the final
            # save from being attempted (max_failed_saves is checked after it)
            self.finish_pending(final=final)
            self._trainer, self._model = trainer, model
            started = time.time()
            save = Save(step=trainer.state.global_step, started=started,
                        directory=step_dir(Path(trainer.args.output_dir), trainer.state.global_step))
            if self.writer is None or final:
                result = original(model, trial, *args, **kwargs)
            else:
                with self.writer.deferring():
                    result = original(model, trial, *args, **kwargs)
                save.future, save.written = self.writer.submit(lambda: self._finish_files(save.directory))
            save.blocked_s = time.time() - started
            self.current = save
            return result

        trainer._save_checkpoint = save_checkpoint

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed Trainer keeps the save and logging cadence of the checkpoint's trainer_state.json (transformers
        # 5.24 only warns that they differ from its arguments): the run's config decides, so a resume may change
        # checkpoint.every_steps and train.logging_steps (issue 47; found by tests/test_resume_local.py, whose resumed
        # run saved every 6 steps though it asked for 4).
        state.compute_steps(args, state.max_steps)

    def on_save(self, args, state, control, **kwargs):
        save, self.current = self.current, None
        if save is None:  # not through watch(): a save of its own step, written synchronously
            save = Save(step=state.global_step, directory=step_dir(Path(args.output_dir), state.global_step),
                        started=time.time())
        if save.future is None:
            self._complete(save)
        else:
            self.pending = save

    def on_step_end(self, args, state, control, **kwargs):
        """Mark the save in flight at the first step end where every rank's write is done (one all-reduce)."""
        if self.pending is not None and not any_rank(self.ctx, not self.pending.future.done()):
            self.finish_pending()

    def on_train_end(self, args, state, control, **kwargs):
        """Training ended (``max_steps`` or a stop): the save in flight is waited for and marked; a stop right
        after a failed asynchronous save of this step saves again, synchronously."""
        if not self.finish_pending(final=True) and self._trainer is not None and not (
                step_dir(Path(args.output_dir), state.global_step) / COMPLETE_MARKER).is_file():
            log.warning("saving checkpoint-%d again, synchronously, before stopping", state.global_step)
            self._trainer.control.should_training_stop = True
            self._trainer._save_checkpoint(self._model, None)
            self.on_save(args, state, control)

    def finish_pending(self, final: bool = False) -> bool:
        """Wait for the save in flight and mark it when every rank's write succeeded; False when it failed.

        Raises :class:`CheckpointError` on every rank after ``max_failed_saves`` failures in a row, unless
        ``final``: the final save (``max_steps``, a stop) is attempted first, synchronously, and a synchronous
        save that succeeds ends the streak (it would raise by itself otherwise). True when nothing was in flight.
        """
        save, self.pending = self.pending, None
        if save is None or save.future is None:
            return True
        waited = time.time()
        error = None
        try:
            save.future.result()
            missing = [d.name for d in save.written if not (d / ".metadata").is_file()]
            if missing and self.ctx.is_main:  # DCP writes .metadata on rank 0 after every rank's write
                error = f"no .metadata in {', '.join(missing)}"
        except (Exception, CheckpointException) as exc:  # DCP's error derives from BaseException
            error = reason(exc)
        failed = gather_errors(self.ctx, error)
        save.blocked_s += time.time() - waited
        if not failed:
            self.failed_in_a_row = 0
            self._complete(save)
            return True
        self.failed_in_a_row += 1
        why = "; ".join(per_message(failed, self.ctx.world_size))
        log.warning("asynchronous save of %s failed (%d in a row; no COMPLETE, training goes on, the next save "
                    "retries): %s", save.directory.name, self.failed_in_a_row, why)
        if self.failed_in_a_row >= self.max_failed_saves and final:
            log.warning("%d asynchronous saves in a row failed (checkpoint.max_failed_saves=%d): the final save is "
                        "made synchronously first", self.failed_in_a_row, self.max_failed_saves)
        elif self.failed_in_a_row >= self.max_failed_saves:
            raise CheckpointError(
                f"{self.failed_in_a_row} asynchronous saves in a row failed (checkpoint.max_failed_saves="
                f"{self.max_failed_saves}); the run stops rather than train on without checkpoints. Fix the "
                "cause below, then `slurmft resume` continues from the newest complete checkpoint",
                problems=[f"{save.directory.name}: {why}",
                          "a resume may change how saves are written, not what trains: `slurmft resume RUN_DIR "
                          "checkpoint.async=false` (every save synchronous), checkpoint.every_steps=N (fewer saves), "
                          "checkpoint.max_failed_saves=N"])
        return False

    def _finish_files(self, ckpt: Path) -> None:
        """This rank's files durable; rank 0 adds config and tokenizer and makes the shared files and the
        directory entries durable (after its DCP saves: every rank's shards exist by then). In the background
        for an asynchronous save (measured: most of what training waited for at the marker otherwise)."""
        make_durable(ckpt, self.ctx.rank)  # this rank's shards and rng state
        if self.ctx.is_main:
            config = copy.deepcopy(self.model_config)
            config.use_cache = True  # turned off for training only
            config.save_pretrained(ckpt)
            if self.generation_config is not None:
                self.generation_config.save_pretrained(ckpt)
            self.tokenizer.save_pretrained(ckpt)
            make_durable(ckpt, 0)  # the shared files (rank 0's shards again: nothing left to flush) and entries

    def _complete(self, save: Save) -> None:
        """The save's files are written on every rank: make them durable, mark, rotate, record."""
        t0 = time.time()
        ckpt = save.directory
        if save.future is None:  # synchronous: the files are made durable now (in the write's thread otherwise)
            barrier()  # every rank's DCP shards exist (rank 0 fsyncs the directories)
            self._finish_files(ckpt)
            self.failed_in_a_row = 0  # a save that succeeded: the storage works again
        barrier()  # every rank's files are durable
        if self.ctx.is_main:
            seconds = time.time() - save.started
            position = {"sequences_consumed": save.step * self.info["global_batch"]} if "global_batch" in self.info else {}
            record = mark_complete(ckpt, step=save.step, world_size=self.ctx.world_size, save_s=round(seconds, 3),
                                   asynchronous=save.future is not None, **self.info, **position)
            self.last_save_s = seconds
            for path, why in damaged(ckpt.parent):
                log.warning("removing damaged %s: %s", path.name, why)
            prune(ckpt.parent, self.keep_last, self.protected,
                  delete=self.writer.delete_later if self.writer is not None else None)
            blocked = save.blocked_s + time.time() - t0
            how = f"in the background, training waited {blocked:.2f}s" if save.future is not None else "synchronously"
            log.info("checkpoint-%d complete (%.1fs, %s)", save.step, seconds, how)
            if self.metrics is not None:
                line = {"event": SAVE_EVENT, "step": save.step, "time": round(time.time(), 3),
                        "mode": "async" if save.future is not None else "sync", "blocked_s": round(blocked, 3),
                        "durable_s": round(seconds, 3), "bytes": record["bytes"],
                        **{k: self.info[k] for k in ("job_id", "restart") if k in self.info}}
                with open(self.metrics, "a") as f:
                    f.write(json.dumps(line) + "\n")
            if self.lead_time_s and seconds > self.lead_time_s / 2:
                log.warning("saving checkpoint-%d took %.1fs, more than half of preemption.lead_time_s (%gs): a "
                            "warning signal may not leave enough time to save; raise preemption.lead_time_s",
                            save.step, seconds, self.lead_time_s)
        barrier()

    def close(self) -> None:
        """Leaving (also on an error): the background write ends before the process group goes."""
        if self.writer is not None:
            if self.pending is not None and self.pending.future is not None:
                with contextlib.suppress(BaseException):
                    self.pending.future.result()
            self.pending = None
            self.writer.close(abandon_deletions=preemption.requested())
            self.writer = None
