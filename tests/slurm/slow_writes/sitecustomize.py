"""A slow file system for the asynchronous-save tests (tests/slurm/test_async_saves.py), in the job's own processes.

Python imports ``sitecustomize`` at start-up from the first ``PYTHONPATH`` entry that has one; the tests put this
directory first and export ``SLURMFT_SLOW_WRITES_S``. Every ``os.fsync`` made by the checkpoint writer's
background thread (``BackgroundWriter``: its threads are named ``slurmft-checkpoint``) then takes that many seconds
longer, so an asynchronous save stays in flight long enough for a signal or a kill to land during it.
``SLURMFT_SLOW_DELETES_S`` does the same to every file a checkpoint thread deletes (the rotation's deletions), in the
job's first attempt only (``SLURM_RESTART_COUNT`` 0), so that a stop which waited for them would be seen. Nothing
else is slowed: training, the synchronous saves and every other process of the job run as they would.
"""

from __future__ import annotations

import os
import threading
import time

_DELAY_S = float(os.environ.get("SLURMFT_SLOW_WRITES_S") or 0)
_DELETE_S = float(os.environ.get("SLURMFT_SLOW_DELETES_S") or 0) if os.environ.get(
    "SLURM_RESTART_COUNT", "0") == "0" else 0.0


def _in_a_checkpoint_thread() -> bool:
    return threading.current_thread().name.startswith("slurmft-checkpoint")


if _DELAY_S > 0:
    _fsync = os.fsync

    def _slow_fsync(fd: int) -> None:
        if _in_a_checkpoint_thread():
            time.sleep(_DELAY_S)
        _fsync(fd)

    os.fsync = _slow_fsync

if _DELETE_S > 0:
    _unlink = os.unlink

    def _slow_unlink(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - os.unlink's signature
        if _in_a_checkpoint_thread():
            time.sleep(_DELETE_S)
        return _unlink(path, *args, **kwargs)

    os.unlink = os.remove = _slow_unlink
