"""Preemption, step 1: a signal handler that only sets a flag.

Installed first thing in the entrypoint (before torch is imported) so a warning signal that lands
during start-up cannot kill a rank. The ranks agree on the flag at a step boundary (trainer side).
"""

from __future__ import annotations

import signal
import time

_state = {"flag": False, "signum": 0, "at": 0.0}


def _handler(signum: int, frame: object) -> None:
    _state.update(flag=True, signum=signum, at=time.time())


def install(signal_name: str = "USR2") -> None:
    """Install the flag-only handler for ``SIG<signal_name>``."""
    signal.signal(getattr(signal, f"SIG{signal_name}"), _handler)


def requested() -> bool:
    """True once the warning signal arrived on this rank."""
    return bool(_state["flag"])
