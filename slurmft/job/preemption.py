"""Preemption, step 1: signal handlers that only set a flag.

Installed as the first instruction of every rank's process by :mod:`slurmft.job.launch` (before
torch, before submitit's job processing), for the warning signal (``--signal=USR2@lead``) *and*
SIGTERM (what Slurm sends at the time limit, on ``scontrol requeue``/preemption and on ``scancel``,
``KillWait``/``GraceTime`` seconds before SIGKILL). A signal at any moment therefore only raises the
flag; the ranks agree on it at a step boundary (slurmft/job/callbacks.py) and save collectively.
"""

from __future__ import annotations

import os
import signal
import time

_state: dict[str, object] = {"flag": False, "signum": 0, "at": 0.0, "signals": []}


def _handler(signum: int, frame: object) -> None:
    if not _state["flag"]:
        _state.update(flag=True, signum=signum, at=time.time())
    _state["signals"].append(signum)  # type: ignore[union-attr]


def signals_for(signal_name: str = "USR2", term: bool = True) -> list[signal.Signals]:
    """The signals that only set the flag: the warning signal and (``term``) SIGTERM."""
    warning = getattr(signal, f"SIG{signal_name.upper().removeprefix('SIG')}")
    return [warning] if warning == signal.SIGTERM or not term else [warning, signal.SIGTERM]


def install(signal_name: str = "USR2", term: bool = True) -> None:
    """Point the warning signal and (``term``) SIGTERM at the flag-only handler (idempotent).

    ``term=False`` is for runs outside Slurm (the local executor), where SIGTERM is how
    ``slurmft cancel`` stops the processes and no batch script decides what comes next.
    """
    for sig in signals_for(signal_name, term):
        signal.signal(sig, _handler)


def end_local_job_on_term() -> None:
    """A job the local executor started ends on SIGTERM: it is how ``slurmft cancel`` stops a local run's jobs (it
    signals the job's process; submitit's local controller passes the signal to its tasks). submitit's job
    processing points SIGTERM at a handler that ignores it (docs/design-notes.md: under Slurm, SIGKILL follows after
    KillWait; here nothing does), so ``cancel`` said "cancelled" and the local train job trained on. A Slurm job
    keeps what it has."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "local":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def installed(signal_name: str = "USR2", term: bool = True) -> bool:
    """True while every signal of :func:`signals_for` still points at our handler."""
    return all(signal.getsignal(sig) is _handler for sig in signals_for(signal_name, term))


def requested() -> bool:
    """True once the warning signal or SIGTERM arrived on this rank."""
    return bool(_state["flag"])


def received() -> str:
    """Name of the first signal that raised the flag (``""`` when none)."""
    signum = int(_state["signum"])  # type: ignore[arg-type]
    return signal.Signals(signum).name if signum else ""


def received_at() -> float:
    """Unix time the flag was raised (0.0 when not)."""
    return float(_state["at"])  # type: ignore[arg-type]
