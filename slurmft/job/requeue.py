"""Preemption, last step: run by the batch script after ``srun`` returned (never by the ranks).

Requeuing from inside Python while the step is still exiting cancels it (docs/design-notes.md), so the
ranks only leave a marker (``<run>/requeue/<job>-<restart>``: the step, whether they saved) and this
module, in the batch shell, decides. After a SIGTERM the decision depends on *why* it came, which
only Slurm knows; ``scontrol show job`` from the batch shell says it (checked on the two-node
cluster, docs/preemption.md):

=====================================  ==========================================  =====================
ending                                 ``scontrol show job`` after srun returned   what we do
=====================================  ==========================================  =====================
time limit                             ``Reason=TimeLimit``                        requeue
``scontrol requeue`` / preemption      ``Restarts`` one more than                  nothing: Slurm
(PreemptMode=REQUEUE)                  ``SLURM_RESTART_COUNT``                     requeues by itself
``scancel``                            ``Reason=None``, ``Restarts`` unchanged     never requeue
=====================================  ==========================================  =====================

The warning signal alone (no SIGTERM to this shell) means the time limit or a preemption is near:
requeue. Every requeue counts against ``preemption.max_requeues``; the same job id keeps the
``afterok`` consolidation job valid. The exit status becomes the job's: the srun status, or 3 when
the run stopped for a requeue that is no longer allowed (so the consolidation job does not run on a
half-trained model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from slurmft import slurm
from slurmft.config_loading import read_run_config
from slurmft.rundir import RunPaths, atomic_write

EXIT_REQUEUE_REFUSED = 3
REQUEUE_TRIES = 3


class Ending(str, Enum):
    """Why the ranks stopped, as the batch shell can tell."""

    WARNING = "warning"  # the warning signal (--signal=USR2@lead): the time limit or a preemption is near
    TIME_LIMIT = "time_limit"  # SIGTERM at the time limit
    SLURM_REQUEUE = "slurm_requeue"  # SIGTERM from `scontrol requeue` or preemption with PreemptMode=REQUEUE
    CANCELLED = "cancelled"  # SIGTERM from `scancel` (or a preemption that cancels)
    UNKNOWN_TERM = "unknown_term"  # SIGTERM, and `scontrol show job` could not say why


class Action(str, Enum):
    """What the batch script does next."""

    REQUEUE = "requeue"
    EXIT = "exit"


@dataclass(frozen=True)
class JobView:
    """The three fields of ``scontrol show job`` that tell why a SIGTERM came."""

    state: str
    reason: str
    restarts: int

    @classmethod
    def parse(cls, text: str) -> JobView | None:
        """From ``scontrol show job <id>`` output; None when a field is missing."""
        fields = slurm.parse_show(text)
        if not all(fields.get(k) for k in ("JobState", "Reason", "Restarts")) or not fields["Restarts"].isdigit():
            return None
        return cls(fields["JobState"], fields["Reason"], int(fields["Restarts"]))


@dataclass(frozen=True)
class Decision:
    """The decision and the words for the log."""

    action: Action
    code: int
    ending: Ending | None = None
    message: str = ""


def why_stopped(batch_signal: str, restart: int, view: JobView | None) -> Ending:
    """Why the ranks stopped: the warning signal unless this shell got SIGTERM; then ask Slurm's view."""
    if batch_signal != "TERM":
        return Ending.WARNING
    if view is None:
        return Ending.UNKNOWN_TERM
    if view.restarts > restart:  # Slurm already counted a restart of its own
        return Ending.SLURM_REQUEUE
    if view.reason == "TimeLimit":
        return Ending.TIME_LIMIT
    return Ending.CANCELLED


def decide(marker: dict | None, exit_code: int, restart: int, max_requeues: int, batch_signal: str = "",
           view: JobView | None = None) -> Decision:
    """What to do after srun returned.

    ``marker`` is the ranks' requeue marker for this (job, restart) or None; ``batch_signal`` the last
    signal this batch shell trapped (``""``, ``"TERM"`` or the warning signal's name); ``view`` what
    ``scontrol show job`` says now (only needed after a SIGTERM).
    """
    if marker is None:
        return Decision(Action.EXIT, exit_code)  # finished, or failed: the srun status stands
    if exit_code != 0:
        return Decision(Action.EXIT, exit_code, message="a rank failed after the stop; the failure stands")
    step = marker.get("step")
    saved = f"saved at step {step}" if marker.get("saved", True) else f"stopped before its first step (step {step}, no save needed)"
    ending = why_stopped(batch_signal, restart, view)
    if ending == Ending.SLURM_REQUEUE:
        return Decision(Action.EXIT, 0, ending, f"{saved}; Slurm requeues the job itself (scontrol requeue or "
                                               "preemption), so this script does not")
    if ending == Ending.CANCELLED:
        return Decision(Action.EXIT, 0, ending, f"{saved}; the job was cancelled (scancel) and is not requeued; "
                                               "`slurmft resume RUN_DIR` continues from that step")
    if ending == Ending.UNKNOWN_TERM:
        return Decision(Action.EXIT, 0, ending, f"{saved}; SIGTERM came but `scontrol show job` could not say why, "
                                               "so the job is not requeued; `slurmft resume RUN_DIR` continues")
    if restart >= max_requeues:
        return Decision(Action.EXIT, EXIT_REQUEUE_REFUSED, ending,
                        f"{saved}, but the job was already requeued {restart} time(s) (preemption.max_requeues); "
                        "the job fails so the consolidation job does not run on a half-trained model")
    what = "the time limit" if ending == Ending.TIME_LIMIT else "the warning signal"
    return Decision(Action.REQUEUE, 0, ending, f"{saved} after {what}; requeueing (restart {restart} -> {restart + 1})")


def job_view(job_id: str) -> tuple[JobView | None, str]:
    """``scontrol show job`` now, parsed; with the error text when that failed."""
    answer = slurm.show_job(job_id, timeout=slurm.BATCH_TIMEOUT_S)
    view = JobView.parse(answer.stdout) if answer.ok else None
    return view, "" if view else (answer.problem or answer.stdout.strip()[:200] or "no JobState/Reason/Restarts")


def requeue(job_id: str, tries: int = REQUEUE_TRIES, pause_s: float = 2.0) -> str:
    """``scontrol requeue`` with a time-out, retried; returns "" on success, else the last error."""
    error = ""
    for attempt in range(1, tries + 1):
        answer = slurm.requeue(job_id, timeout=slurm.BATCH_TIMEOUT_S)
        if answer.ok:
            return ""
        error = answer.problem
        print(f"[slurmft] scontrol requeue {job_id} failed (try {attempt}/{tries}): {error}", flush=True)
        if attempt < tries:
            time.sleep(pause_s)
    return error


def _say(text: str) -> None:
    print(f"[slurmft] {time.strftime('%H:%M:%S')} {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m slurmft.job.requeue RUN_DIR --exit-code N [--batch-signal TERM]``."""
    ap = argparse.ArgumentParser(prog="python -m slurmft.job.requeue")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--exit-code", type=int, required=True)
    ap.add_argument("--batch-signal", default="", help="the last signal the batch shell trapped, if any")
    args = ap.parse_args(argv)
    paths = RunPaths.of(args.run_dir)
    job_id = slurm.own_job_id(os.environ)
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    marker_path = paths.requeue_marker(job_id, restart)
    marker = None
    if marker_path.is_file():
        try:
            marker = json.loads(marker_path.read_text() or "{}")
        except ValueError:
            marker = {}
    view, error = job_view(job_id) if args.batch_signal == "TERM" and marker is not None else (None, "")
    if error:
        _say(f"scontrol show job {job_id} failed: {error}")
    max_requeues = read_run_config(paths.config).preemption.max_requeues
    decision = decide(marker, args.exit_code, restart, max_requeues, args.batch_signal, view)
    if marker is not None:
        if view is not None:
            _say(f"after srun: JobState={view.state} Reason={view.reason} Restarts={view.restarts} "
                 f"(SLURM_RESTART_COUNT={restart}, this shell got {args.batch_signal or 'no signal'})")
        _say(decision.message.replace("RUN_DIR", str(args.run_dir)))
        if decision.ending is not None:
            atomic_write(marker_path, json.dumps({**marker, "ended": decision.ending.value,
                                                  "decision": decision.action.value}) + "\n")
    if decision.action == Action.EXIT:
        return decision.code
    _say(f"requeueing job {job_id} (restart {restart} -> {restart + 1})")
    error = requeue(job_id)
    if error:
        _say(f"scontrol requeue failed: {error}; the job fails. Continue with: slurmft resume {args.run_dir}")
        return EXIT_REQUEUE_REFUSED
    time.sleep(300)  # the requeue ends this batch shell; never fall through to 'exit' meanwhile
    return 0


if __name__ == "__main__":
    sys.exit(main())
