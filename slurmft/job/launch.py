"""What ``srun`` starts on every rank: flag-only signal handlers first, then submitit's job processing.

``python -u -m slurmft.job.launch --signal USR2 FOLDER`` replaces ``python -m submitit.core._submit FOLDER``.
The handlers are installed by the first statements below, before anything heavy is imported, and
submitit is stopped from replacing them: its ``_handle_signals`` would point SIGTERM at a "bypass"
handler (the rank ignores the time limit, preemption and scancel) and the warning signal at a handler
that calls ``scontrol requeue`` from inside the step and exits — past ``preemption.max_requeues`` and
cancelling the step it runs in (docs/preemption.md).
"""

from __future__ import annotations

import os
import sys

from slurmft.job import preemption  # signal + time only


def _signal_name(argv: list[str]) -> str:
    """``--signal NAME`` from argv without argparse (nothing may run before the handlers)."""
    for i, arg in enumerate(argv):
        if arg == "--signal" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--signal="):
            return arg.split("=", 1)[1]
    return "USR2"


preemption.install(_signal_name(sys.argv[1:]))


def _keep_our_handlers(self: object, paths: object, submission: object) -> None:
    """Stands in for submitit's ``JobEnvironment._handle_signals``: ours stay installed."""


def main(argv: list[str] | None = None) -> int:
    """Parse ``[--signal NAME] FOLDER`` and run submitit's ``process_job`` with our handlers kept."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m slurmft.job.launch")
    ap.add_argument("--signal", default="USR2", help="Slurm's warning signal (preemption.signal)")
    ap.add_argument("folder", help="submitit folder holding the pickled job")
    args = ap.parse_args(argv)
    preemption.install(args.signal)  # idempotent; covers a call of main() from elsewhere
    from submitit.core import job_environment, submission

    job_environment.JobEnvironment._handle_signals = _keep_our_handlers  # type: ignore[method-assign]
    submission.process_job(args.folder)  # raises (traceback, exit 1) when the job failed
    # The result is written and the process group is gone. Leave now: interpreter teardown with torch
    # loaded takes seconds, and after SIGTERM Slurm SIGKILLs the batch shell KillWait seconds later (5 s
    # on the test cluster, 30 s by default); the requeue decision must run in that window.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
