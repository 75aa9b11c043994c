"""The job's checkpoints in one room: saving (complete, rotated), resuming, and falling back when one does not load.

What the Trainer does when it saves (transformers 5.24): ``_save_checkpoint`` writes the sharded
model and optimizer (accelerate's ``save_fsdp_model``/``save_fsdp_optimizer``, DCP), the scheduler,
the rng state and ``trainer_state.json``, then rotates by mtime down to ``save_total_limit``, *before*
anything says the save is whole: a save that dies afterwards could leave fewer than ``keep_last``
usable checkpoints. So the Trainer's rotation is off, and :class:`CompleteCheckpoints` (``on_save``)
fsyncs, waits for every rank, has rank 0 add config and tokenizer, write the ``COMPLETE`` marker
(how long the save took, every file with its size) and rotate: only verified checkpoints count, the
newest ``keep_last`` stay, torn or damaged ones go only while a verified one remains, and the one a
fallback resumed from never goes. Which directories count is torch-free discovery, shared with the
login side (slurmft/checkpoints.py).

What the Trainer does when it resumes (``Trainer.train(resume_from_checkpoint=...)``): it reads
``trainer_state.json``, prepares the model and a new optimizer with accelerate, then loads the
sharded model and optimizer into them (accelerate 1.15 ``load_fsdp_model``/``load_fsdp_optimizer``:
``dcp.load`` straight into the live DTensor shards), the scheduler, and, inside the epoch loop just
before the first step, this rank's ``rng_state_<rank>.pth``. Why that is not enough: the size check
of discovery cannot see a shard with the right length and wrong bytes, so every requeue fails on the
same checkpoint; and a failure raises only on the ranks that hit it (DCP shares a read error among
ranks, but a rank's own rng file or an unreadable scheduler does not), so the other ranks walk into
the first all-gather and wait there for the collective time-out.

What we do:

- :func:`resume_candidates`: rank 0 lists the verified checkpoints, newest first, and removes torn
  saves; every rank learns the list.
- :func:`guard_loading` wraps the Trainer's four loading methods: each ends with an all-gather of
  "my error or None" (:func:`slurmft.job.distributed.gather_errors`), so a failure on any rank raises
  :class:`CheckpointLoadFailed` on every rank at the same point, before the first optimizer step;
  :func:`check_trainer_state` does the same for ``trainer_state.json``, which ``train`` reads outside
  those methods.
- :func:`train_newest_loadable` tries the verified checkpoints newest first. After a failure it
  drops that Trainer (its optimizer, scheduler and accelerate state) and builds a fresh one on the
  same sharded model for the next older checkpoint. No rank ever trains a half-loaded model: a
  resuming job's shards start uninitialised (it does not read the base weights, slurmft/job/loading.py)
  and the failed load may have written part of the bad checkpoint into them (DCP copies in place),
  but the retry's DCP load is strict (``DefaultLoadPlanner``, no partial load), so every parameter
  and persistent buffer is overwritten by the older checkpoint before any step, and the optimizer
  state is new; when no checkpoint loads, the job stops with a :class:`CheckpointError` naming each
  one and why, rather than training from step 0 or from a partial load.
- Once the fallback loaded (its first step begins), rank 0 sets the checkpoints that failed aside
  (``unloadable-checkpoint-<step>/``, :func:`slurmft.checkpoints.set_aside`, :class:`SetAsideFailed`)
  and the saver never rotates away the one it resumed from (:meth:`CompleteCheckpoints.protect`).
  Setting aside matters beyond tidiness: left in place, the bad checkpoint would count towards
  ``keep_last`` (rotation would delete the good one), a warning signal at its step would skip the
  save ("already complete"), and every later requeue would fail on it again. Rotation then deletes
  the set-aside directory like a damaged one: both the save's rotation and the resume's clean-up go
  through the one :func:`slurmft.checkpoints.prune`.

Why not validate by loading before ``train``: the optimizer does not exist until ``train`` prepares
it, and loading model and optimizer once more just to check them doubles the resume read (at 70B,
~830 GB). A fresh Trainer costs a second pass over the (cached) dataset preparation, and only on
the rare failure path.

:class:`CheckpointManager` is the door train.py uses: it owns the callbacks and the state they share
(the checkpoint to protect, the failures to set aside). Adapter-only saves (LoRA) and asynchronous
saves (the marker, the stop and rotation waiting for a save in flight: :class:`CompleteCheckpoints`) belong here.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from transformers import TrainerCallback

from slurmft import checkpoints
from slurmft.checkpoints import COMPLETE_MARKER, damaged, make_durable, mark_complete, prune
from slurmft.errors import CheckpointError, JobSetupError
from slurmft.job import preemption, versions
from slurmft.job.distributed import DistContext, any_rank, barrier, gather_errors
from slurmft.rundir import SAVE_EVENT, RunPaths

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- saving
@dataclass
class Save:
    """One checkpoint being saved: when it started, how long training waited for it so far, its write."""

    step: int
    directory: Path
    started: float
    blocked_s: float = 0.0
    future: Future | None = None  # the background write (asynchronous saves); None: written already
    written: tuple[Path, ...] = ()  # the DCP directories the background write fills


class BackgroundWriter:
    """The Trainer's DCP writes of one checkpoint, staged to CPU memory at once and written by one thread.

    Why not ``dcp.async_save`` per write: accelerate writes a checkpoint as two DCP saves (model and
    optimizer, two directories the loaders expect) and ``async_save`` runs each in a new thread; two
    threads issuing the saves' collectives on one group may interleave them differently on each rank.
    One long-lived worker thread writes them in order (torch's own thread executor does the same
    ``dcp.save`` of the staged copy), on a gloo group of its own created once with the collective
    time-out, so the writes' collectives never meet training's. Thread, not process mode, measured
    (bench/async_modes.py, 2 gloo ranks, 144 MiB per rank, a loaded 2-core machine): training was blocked
    alike (0.086 s against 0.087 s per save: staging and planning), but a thread's write was durable sooner
    (0.97 s against 1.58 s) and slowed the training steps no more (0.91x against 1.21x), and the process
    mode's first save took 23 s to become durable (its process starts and joins a process group of its own)
    and needs the staged copy in shared memory. The write is file I/O that releases the GIL. Process mode
    would pay where the write's Python work competes for the GIL with a training loop that needs it
    (many small tensors on a GPU node): measure there before switching.

    The stager is created once and reused: torch's ``StateDictStager`` keeps one CPU buffer per source
    storage and copies into it on the next save (no re-allocation; the price is one CPU copy of model
    and optimizer state per rank, pinned on GPU nodes). Its non-blocking copy asserts without an
    accelerator, so staging is a plain copy, finished before training's next step changes a weight.
    Measured before (torch 2.13, 2 gloo ranks, ``dcp.async_save``): 0.05 s blocked per save against 0.63 s
    for a synchronous save of 144 MB per rank; this class in the real job: bench/async_save.py (README).
    """

    def __init__(self, ctx: DistContext) -> None:
        from datetime import timedelta

        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import StagingOptions

        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=ctx.collective_timeout_s))
        self.stager = versions.reusable_stager(StagingOptions(ctx.on_gpu, False, False, False))
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurmft-checkpoint")
        self.deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurmft-checkpoint-delete")
        self.closing = threading.Event()
        self._writes: list[tuple[Any, Any, Any, Any]] = []

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """While the Trainer saves: each ``dcp.save`` (accelerate's model and optimizer, the adapters) stages
        its state dict here and queues the write, with the writer and planner it was called with."""
        import torch.distributed.checkpoint as dcp

        real = dcp.save

        def staged_save(state_dict: Any, *, checkpoint_id: Any = None, storage_writer: Any = None,
                        planner: Any = None, **_: Any) -> None:
            self._writes.append((self.stager.stage(state_dict), checkpoint_id, storage_writer, planner))

        dcp.save = staged_save
        try:
            yield
        finally:
            dcp.save = real

    def submit(self, then: Callable[[], None]) -> tuple[Future, tuple[Path, ...]]:
        """Write what :meth:`deferring` staged, then run ``then``, in the background; the future fails if any
        rank's write failed (DCP shares a write error among the ranks)."""
        from torch.distributed.checkpoint.state_dict_saver import save

        writes, self._writes = self._writes, []

        def write_all() -> None:
            for state, checkpoint_id, writer, planner in writes:
                save(state, checkpoint_id=checkpoint_id, storage_writer=writer, planner=planner,
                     process_group=self.group)
            then()

        dirs = tuple(Path(str(getattr(w, "path", None) or c)) for _, c, w, _ in writes)
        return self.thread.submit(write_all), dirs

    def delete_later(self, path: Path) -> None:
        """Remove a pruned checkpoint (already renamed out of the way) in a thread of its own: a deletion of
        gigabytes never holds training, nor a write (a write queued behind it would hold the next save and the
        stop's), nor the stop: :meth:`close` drops what is left of it (the next attempt's prune removes the rest,
        slurmft.checkpoints.prune)."""
        self.deleter.submit(_remove_unless, path, self.closing)

    def close(self, abandon_deletions: bool = False) -> None:
        """The writes finish. Deletions finish too at the end of training; after the warning signal they stop at
        their next file instead (never waited for: the stop writes its requeue marker and the rank exits)."""
        if abandon_deletions:
            self.closing.set()
        self.deleter.shutdown(wait=not abandon_deletions, cancel_futures=abandon_deletions)
        self.thread.shutdown(wait=True)
        self.stager.close()


def _remove_unless(path: Path, stop: threading.Event) -> None:
    """``rmtree(path)``, file by file, until ``stop`` is set."""
    import os

    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            if stop.is_set():
                return
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, name))
    with contextlib.suppress(OSError):
        os.rmdir(path)


def skip_unchecked_crc32() -> None:
    """Saves write no CRC-32 per tensor: nothing ever reads it, and it costs most of a save's CPU time.

    DCP writes each tensor with ``torch.save``, whose zip writer computes a CRC-32 of every record by default
    (``torch.utils.serialization.config.save.compute_crc32``); neither ``torch.load`` nor DCP's reader checks
    it (a flipped byte in a shard loads silently: tests/job/test_checkpointing_cpu.py), so it protects
    nothing. What does protect stays: the COMPLETE marker with every file's size (a torn or truncated save is
    never resumed from) and the fsyncs. Measured, one process, 512 MiB in 32 tensors: ``dcp.save`` takes
    about twice as long with the CRC as without (bench/dcp_crc.py, README). Process-wide and set once: nothing
    else the job writes with ``torch.save`` has a CRC that anyone reads.
    """
    import torch.utils.serialization.config as serialization

    serialization.save.compute_crc32 = False


def _by_message(failed: list[tuple[int, str]]) -> dict[str, list[int]]:
    """Each rank's error once, with the ranks that had it (DCP gives every rank the same error)."""
    out: dict[str, list[int]] = {}
    for rank, msg in failed:
        out.setdefault(msg, []).append(rank)
    return out


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
                        directory=Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}")
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
            save = Save(step=state.global_step, directory=Path(args.output_dir) / f"checkpoint-{state.global_step}",
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
                Path(args.output_dir) / f"checkpoint-{state.global_step}" / COMPLETE_MARKER).is_file():
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
        why = "; ".join(msg if len(ranks) == self.ctx.world_size else f"{msg} (on rank {', '.join(map(str, ranks))})"
                        for msg, ranks in _by_message(failed).items())
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


# ----------------------------------------------------------------------------- resuming
def resume_candidates(paths: RunPaths, ctx: DistContext) -> list[Path]:
    """Rank 0 lists the verified checkpoints, newest first, and removes torn saves; every rank learns the list.

    A fresh start only when the run has no complete checkpoint at all: when every one is damaged
    (or was set aside after a failed load), every rank raises a CheckpointError naming them.
    """
    import torch.distributed as dist

    choice: list[list[str] | str] = [[]]
    if ctx.is_main:
        bad = [f"{path.name}: {why}" for path, why in checkpoints.damaged(paths.checkpoints)]
        bad += [f"{path.name}: failed to load before (see its {checkpoints.LOAD_FAILED_NOTE})"
                for path in checkpoints.unloadable(paths.checkpoints)]
        for line in bad:
            log.warning("skipping damaged checkpoint %s", line)
        for path in checkpoints.prune(paths.checkpoints):  # torn and damaged ones; every verified one stays
            log.warning("removed unusable checkpoint %s (a save that did not finish, or damaged)", path.name)
        good = [str(path) for path in reversed(checkpoints.verified(paths.checkpoints))]
        choice = [good if good or not bad else "\n".join(bad)]
    dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], str):
        raise CheckpointError(f"every checkpoint in {paths.checkpoints} is damaged; the job stops rather than train "
                              "from step 0. Repair them, or move them out of that directory to start this run over",
                              problems=choice[0].splitlines())
    return [Path(c) for c in choice[0]]


def check_resume_precision(checkpoint: Path, precision: str) -> None:
    """A checkpoint resumes only in the precision it was saved in (its COMPLETE marker says which)."""
    saved = checkpoints.read_marker(checkpoint).get("precision")
    if saved and saved != precision:
        raise JobSetupError(
            f"train.precision: {checkpoint.name} was trained in {saved}, this run is set to {precision}; resume "
            f"with train.precision={saved}, or start a new run (new output_dir) to change the precision"
        )


def check_resume_method(checkpoint: Path, lora: bool, method: str = "sft") -> None:
    """A full fine-tuning checkpoint resumes only without a ``lora`` section, an adapter checkpoint only with one;
    an SFT checkpoint only without a ``dpo`` section, a DPO checkpoint only with one.

    Checked before the model is built: neither kind of checkpoint can fill the other's model (an
    adapter checkpoint has no base weights; a full one has no adapters). A DPO run resumed from an SFT checkpoint
    would load SFT's optimizer and step into a DPO run (and its reference would be the base, not that checkpoint).
    A marker written before DPO existed is an SFT checkpoint.
    """
    marker = checkpoints.read_marker(checkpoint)
    was = marker.get("method", "sft")
    if was != method:
        fix = ("start DPO from it in a new run: consolidate it (slurmft consolidate) and point model.name_or_path at "
               "the consolidated model" if was == "sft" else f"put the {was}: section back to resume it")
        raise JobSetupError(
            f"{method if method != 'sft' else was}: {checkpoint.name} is {'an' if was == 'sft' else 'a'} {was.upper()} "
            f"checkpoint and this run trains "
            f"{method.upper()}; {fix}, or use a new output_dir; nothing was changed in the run directory"
        )
    saved = marker.get("lora")
    if lora and saved is None:
        raise JobSetupError(
            f"lora: {checkpoint.name} is a full fine-tuning checkpoint (every weight, no adapters), and this run "
            "has a lora section. Remove the lora section to resume the full fine-tune, or train LoRA in a new run "
            "(new output_dir); nothing was changed in the run directory"
        )
    if not lora and saved is not None:
        raise JobSetupError(
            f"lora: {checkpoint.name} is a LoRA adapter checkpoint (r={saved.get('r')}, alpha={saved.get('alpha')}: "
            "adapters only, no base weights), and this run has no lora section. Put the lora section back to "
            "resume it, or start a full fine-tune in a new run (new output_dir); nothing was changed in the run "
            "directory"
        )


def check_resume_adapters(checkpoint: Path, adapters: dict[str, Any] | None) -> None:
    """The adapters this run built (``AdapterSummary.marker()``) are the ones ``checkpoint`` saved: same rank,
    alpha, scaling rule, targets and copied modules (a different shape would fail inside DCP; a different alpha or
    use_rslora would not). A marker written before use_rslora existed trained without it."""
    saved = checkpoints.read_marker(checkpoint).get("lora")
    if adapters is None or saved is None:
        return
    saved = {"use_rslora": False, **saved}
    keys = ("r", "alpha", "use_rslora", "target_modules", "modules_to_save")
    differ = [f"{k}: {saved.get(k)!r} in the checkpoint, {adapters.get(k)!r} now" for k in keys
              if saved.get(k) != adapters.get(k)]
    if differ:
        raise JobSetupError(
            f"lora: {checkpoint.name} was trained with other adapters; resume with the lora section it was saved "
            "with, or start a new run (new output_dir)", problems=differ)


def check_resume_base(checkpoint: Path, base: dict[str, Any] | None) -> None:
    """The base model read now (``inputs.base_identity``) is the one ``checkpoint`` was trained on (its marker's
    ``base``), for the runs that read the base on every attempt: LoRA (the frozen base under the adapters), DPO (the
    reference: a copy, or the values computed from it). A checkpoint from before markers recorded it is not checked.
    A hub id follows the checkpoint's commit (``inputs.follow_trained_base``), so this refuses a replaced local
    directory, a cache whose files changed, or a revision the user pinned to another commit."""
    from slurmft.job.inputs import base_differences

    trained = checkpoints.read_marker(checkpoint).get("base")
    if base is None or not isinstance(trained, dict):
        return
    differ = base_differences(trained, base)
    if differ:
        raise JobSetupError(
            f"model.name_or_path: the base model is not the one {checkpoint.name} was trained on "
            f"({trained.get('name_or_path')}{', revision ' + trained['revision'] if trained.get('revision') else ''}); "
            "resuming would continue on other weights. Put that base back (or point model.name_or_path and "
            "model.revision at it), or start a new run (new output_dir); nothing was changed in the run directory",
            problems=differ)


# ----------------------------------------------------------------------------- the adapters' part of a checkpoint
def _trainable_state(model: Any) -> dict[str, Any]:
    """The trainable parameters' sharded state dict (DTensors; torch's names, wrapper segments removed).

    Only adapter tensors (``checkpoints.is_adapter_name``): torch keeps a tied head (``lm_head.weight``, the
    frozen embedding under another name) even with ``ignore_frozen_params``, which would put the whole
    embedding into every adapter checkpoint.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {name: value for name, value in state.items() if checkpoints.is_adapter_name(name)}


def save_adapter_model(model: Any, directory: Path) -> int:
    """Write only the trainable parameters (adapters, ``modules_to_save`` copies) of every rank, with DCP.

    Every rank writes its own shard of every tensor (``dcp.save`` of the DTensors), so no part of an
    adapter depends on rank 0. Returns the number of tensors.
    """
    import torch.distributed.checkpoint as dcp

    state = _trainable_state(model)
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(directory)))
    return len(state)


def load_adapter_model(model: Any, directory: Path) -> None:
    """Read the trainable parameters back into this rank's shards; every one must be in the checkpoint
    (DCP's load plan fails on a missing key, on every rank), nothing of the frozen base is read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = _trainable_state(model)
    dcp.load({"model": state}, storage_reader=dcp.FileSystemReader(str(directory)))
    set_model_state_dict(model, state, options=StateDictOptions(ignore_frozen_params=True, strict=False))


def _is_adapter_model(model: Any) -> bool:
    return any(not p.requires_grad for p in model.parameters()) and any(p.requires_grad for p in model.parameters())


def own_adapter_checkpoints() -> None:
    """The Trainer saves and loads an adapter model's part of a checkpoint with :func:`save_adapter_model` /
    :func:`load_adapter_model`; a full model keeps accelerate's ``save_fsdp_model``/``load_fsdp_model``.

    Why not accelerate's ``adapter_only`` path (what transformers 5.24 asks for with a PEFT model): with
    accelerate 1.15 and our FSDP2-sharded, checkpoint-wrapped PeftModel it wrote a DCP checkpoint of no
    tensors at all (measured: ``.metadata`` of 381 bytes, ``__0_0.distcp`` empty), and its load is
    non-strict, so a resume would have silently kept the adapters' initial values (accelerate#4206 was
    a rank-0-only variant of the same loss). torch's own state-dict API with ``ignore_frozen_params``
    gives the trainable DTensors; the tests prove every rank's shard survives.
    """
    import transformers.trainer as trainer_module

    if getattr(trainer_module.save_fsdp_model, "slurmft_adapters", False):
        return
    save_full, load_full = trainer_module.save_fsdp_model, trainer_module.load_fsdp_model

    def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: str, *args: Any,
                        **kwargs: Any) -> Any:
        if not _is_adapter_model(model):
            return save_full(fsdp_plugin, accelerator, model, output_dir, *args, **kwargs)
        return save_adapter_model(model, Path(output_dir) / MODEL_DIR)

    def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: str, *args: Any,
                        **kwargs: Any) -> Any:
        if not _is_adapter_model(model):
            return load_full(fsdp_plugin, accelerator, model, input_dir, *args, **kwargs)
        return load_adapter_model(model, Path(input_dir) / MODEL_DIR)

    save_fsdp_model.slurmft_adapters = True  # type: ignore[attr-defined]
    trainer_module.save_fsdp_model, trainer_module.load_fsdp_model = save_fsdp_model, load_fsdp_model


#: accelerate's directory for the model part of a checkpoint; an adapter checkpoint uses the same name.
MODEL_DIR = "pytorch_model_fsdp_0"


# The Trainer's methods that read a checkpoint when resuming, and what each one reads.
LOADERS = {
    "_load_from_checkpoint": "the model (pytorch_model_fsdp_0/)",
    "_load_optimizer_and_scheduler": "the optimizer and scheduler (optimizer_0/, scheduler.pt)",
    "_load_scaler": "the gradient scaler (scaler.pt)",
    "_load_rng_state": "the random generator state (rng_state_<rank>.pth)",
}
_MAX_REASON = 300


class CheckpointLoadFailed(Exception):
    """Raised on every rank, at the same point, when loading ``checkpoint`` failed on any rank."""

    def __init__(self, checkpoint: Path, problems: list[str]) -> None:
        super().__init__(f"loading {checkpoint.name} failed: {'; '.join(problems)}")
        self.checkpoint = checkpoint
        self.problems = problems


def reason(exc: BaseException) -> str:
    """One line for a load error; a DCP error names the ranks whose read failed and their own errors."""
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {reason(inner)}" for rank, (inner, _) in sorted(exc.failures.items()))
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # torch.load of garbage: the useful line follows a long preamble
        text = text.split("WeightsUnpickler error:", 1)[1]
    text = next((line.strip() for line in text.splitlines() if line.strip()), "(no message)")
    if len(text) > _MAX_REASON // 2 and ". " in text:  # torch appends paragraphs of advice to the first sentence
        text = text.split(". ", 1)[0] + "."
    return f"{type(exc).__name__}: {text[:_MAX_REASON]}"


def _agree_loaded(ctx: DistContext, checkpoint: Path, what: str, error: str | None) -> None:
    """All-gather each rank's error; if any rank failed, every rank raises the same CheckpointLoadFailed."""
    failed = gather_errors(ctx, error)
    if not failed:
        return
    problems = []
    for msg in dict.fromkeys(msg for _, msg in failed):
        ranks = [rank for rank, m in failed if m == msg]
        where = "" if len(ranks) == ctx.world_size else f" (on rank {', '.join(map(str, ranks))})"
        problems.append(f"{what}: {msg}{where}")
    raise CheckpointLoadFailed(checkpoint, problems)


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
