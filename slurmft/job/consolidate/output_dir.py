"""The output directory: written beside ``out`` and put in its place only once complete, under a lock.

A consolidation writes into a hidden sibling (``.model.partial-*``) and renames it into place only once
every file is written and checked; an existing model is moved aside (``.model.old-*``) only once the new
one is there, and removed after. So a failure (full disk, bad key, kill) never leaves a half-written
``model/`` behind, and a model that was there stays until its replacement is whole. What a killed run left
beside ``out`` is removed by the next one (a partial directory), or put back (an old model whose
replacement never arrived).

Before anything is written, the planned bytes must fit on the filesystem with a margin; one consolidation
at a time may write an output, held by slurmft/locks.py's lock file (``.model.consolidate.lock``), because
flock is node-local or missing on some Lustre and NFS mounts and two consolidations on two nodes would both
get it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from slurmft import locks
from slurmft.checkpoints import fsync_dir
from slurmft.errors import CheckpointError, LockError
from slurmft.rundir import RunPaths, umask
from slurmft.units import decimal_bytes

log = logging.getLogger(__name__)

# Room left on the filesystem beyond the model itself (config, tokenizer, filesystem slack).
DISK_MARGIN_BYTES = 64 * 2**20


@contextlib.contextmanager
def new_directory(out: Path, needed: int) -> Iterator[Path]:
    """A hidden sibling of ``out`` to fill, put at ``out`` when the block ends without error (removed if it
    fails: a full disk, a bad key or a kill never leaves a half-written output), under ``out``'s lock, after
    the leftovers of an interrupted run are removed and ``needed`` bytes are known to fit."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):  # one consolidation per output at a time
        _clean_leftovers(out)
        check_disk_space(out.parent, needed)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=_partial_prefix(out)))
        tmp.chmod(0o777 & ~umask())  # mkdtemp makes it 0700; the model is for the team and the serving account
        try:
            yield tmp
            fsync_dir(tmp)
            replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def _old_prefix(out: Path) -> str:
    return f".{out.name}.old-"


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """Hold the consolidation lock of ``out``: an exclusive-create lock file with owner, host and heartbeat
    (slurmft/locks.py), because flock is node-local or missing on some Lustre and NFS mounts and two
    consolidations on two nodes would both get it."""
    lock_path = RunPaths.consolidate_lock(out)
    try:
        locks.acquire(lock_path, f"consolidate into {out}", log.info)
    except LockError as exc:
        raise CheckpointError(f"another consolidation is writing {out} right now: {exc}") from None
    try:
        yield
    finally:
        locks.release(lock_path)


def _clean_leftovers(out: Path) -> None:
    """Remove what a killed consolidation left next to ``out`` (it would only fill the disk)."""
    for child in out.parent.iterdir():
        if child.name.startswith(_partial_prefix(out)) and child.is_dir():
            log.info("removing %s, left by an interrupted consolidation", child)
            shutil.rmtree(child, ignore_errors=True)
        elif child.name.startswith(_old_prefix(out)) and child.is_dir():
            if out.exists():
                log.info("removing %s, the previous model left by an interrupted replace", child)
                shutil.rmtree(child, ignore_errors=True)
            else:  # killed between the two renames: the old model is the only complete one
                os.rename(child, out)


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished ``tmp`` at ``out``; an existing ``out`` is only removed once ``tmp`` is there."""
    old = None
    if out.exists():
        old = out.parent / f"{_old_prefix(out)}{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_disk_space(parent: Path, needed: int) -> None:
    """Fail before writing anything if the model cannot fit."""
    free = shutil.disk_usage(parent).free
    if needed + DISK_MARGIN_BYTES > free:
        raise CheckpointError(
            f"not enough disk space for the consolidated model: needs {decimal_bytes(needed)}, "
            f"{decimal_bytes(free)} free at {parent}",
            ["free space there, or write elsewhere with --out DIR"],
        )
