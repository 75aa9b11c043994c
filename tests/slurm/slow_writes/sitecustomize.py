"""A slow file system for the asynchronous-save tests (tests/slurm/test_async_saves.py), in the job's own processes.

Python imports ``sitecustomize`` at start-up from the first ``PYTHONPATH`` entry that has one; the tests put this
directory first and export ``SLURMFT_SLOW_WRITES_S``. Every ``os.fsync`` made by the checkpoint writer's
background thread (``BackgroundWriter``: its threads are named ``slurmft-checkpoint``) then takes that many seconds
longer, so an asynchronous save stays in flight long enough for a signal or a kill to land during it. Nothing
else is slowed: training, the synchronous saves and every other process of the job run as they would.
"""

from __future__ import annotations

import os
import threading
import time

_DELAY_S = float(os.environ.get("SLURMFT_SLOW_WRITES_S") or 0)

if _DELAY_S > 0:
    _fsync = os.fsync

    def _slow_fsync(fd: int) -> None:
        if threading.current_thread().name.startswith("slurmft-checkpoint"):
            time.sleep(_DELAY_S)
        _fsync(fd)

    os.fsync = _slow_fsync
