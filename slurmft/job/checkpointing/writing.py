"""How a checkpoint's files are written: by the Trainer while training waits, or staged at the step and written in
the background; and the CRC-32 the writes leave out.

What the Trainer does (transformers 5.24 ``_save_checkpoint``): accelerate writes the sharded model and the
optimizer as two DCP saves (``save_fsdp_model``/``save_fsdp_optimizer``), then the scheduler, the rng state and
``trainer_state.json``, all while training stands still. Why that is not always enough: on a large model the write
is most of a save's time. torch's ``dcp.async_save`` stages the state to CPU and writes it in a thread, but a new
thread per call: accelerate's two saves would issue their collectives from two threads on one process group, in
an order that may differ between ranks.

What we do: :class:`BackgroundWriter` stages every DCP save of one checkpoint at the step boundary and writes them
in order from one thread, on a gloo group of its own; :class:`Save` is the record of one checkpoint being saved
(when it started, how long training waited, its write) that the marker waits on (complete.py
chooses, save by save, the Trainer's synchronous write or this one). :func:`skip_unchecked_crc32`
drops the per-tensor CRC-32 that no reader checks.

Measured (2 gloo ranks, 144 MB per rank): a synchronous save held training 0.63 s, torch's ``dcp.async_save``
0.05 s; this writer's thread 0.086 s on a loaded 2-core machine, no more than a process would (bench/async_modes.py;
in the real job: bench/async_save.py). ``dcp.save`` takes about twice as long with the CRC as without
(bench/dcp_crc.py). The details stand beside :class:`BackgroundWriter` and :func:`skip_unchecked_crc32`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.job import versions
from slurmft.job.distributed import DistContext


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
