"""The local executor's train job: one process imports the job's libraries once, then forks its ranks.

submitit's local controller (``submitit.local._local``) starts each task as a new interpreter
(``python -u -m submitit.core._submit FOLDER``), so every rank of a local run pays the imports of torch,
transformers and TRL itself: ~7 of a tiny 2-rank run's ~12 CPU-seconds a rank. This controller is submitit's
own (:class:`submitit.local.local.Controller`: the time-out, the warning signal before it, the requeue loop on exit
status 144, the signals forwarded, the logs per task) with one change: it loads the train job's stack
(:func:`slurmft.job.entrypoint.load_the_stack`, as a rank does first) and then starts each task with ``os.fork``
instead of a new interpreter, so the ranks begin with the libraries already imported.

What a forked rank runs is what a started one runs: submitit's ``process_job`` (the pickled ``run_train``), with
the task's ``SUBMITIT_LOCAL_*`` variables, its stdout/stderr on the task's log files, the default action for the
signals the controller catches. The losses are the same, bitwise (tests/test_local_executor.py). Measured on a
quiet 2-core machine, a 2-rank 4-step tiny train: 25.1-25.3 CPU-s with each rank started, 18.2-18.5 with both
forked from a process that had loaded the stack; the tiny example through ``slurmft submit`` (8 steps, no
consolidation, prepare and the command included; 2 cores shared with other work, so noisier): 18.5-21.8 CPU-s
started, 15.4-19.7 forked. Nothing the ranks compute depends on how they began: torch's, numpy's and Python's
generators are seeded by the trainer (Python's ``random`` is also re-seeded by the interpreter in every forked
child), and nothing before the fork starts a thread pool.

Used for the train job only: a prepare, consolidation, serve or eval job is one process, which pays the imports
once either way. Slurm's ranks are started by srun, one interpreter each, as before.

``python -u -m slurmft.job.forked_ranks FOLDER RUN_DIR``: started by
:class:`slurmft.submit.local_executor.ForkingLocalExecutor` with the variables submitit's controller reads.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path

from submitit.core import utils
from submitit.core.submission import process_job
from submitit.local.local import Controller


class ForkedTask:
    """One forked rank, with the part of :class:`subprocess.Popen` the controller uses: ``poll`` and
    ``send_signal``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The rank's exit status once it has ended (minus the signal's number when a signal ended it), else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def _exit_status(exc: SystemExit) -> int:
    """What ``sys.exit(code)`` would have made the exit status of a started interpreter."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _run_task(folder: Path, rank: int, job_id: str, stdout: int, stderr: int) -> None:
    """In the forked child: become task ``rank`` (its variables, its log files, the default signal actions the
    controller changed) and run the pickled job as ``python -m submitit.core._submit`` would; never returns."""
    status = 1
    try:
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the controller's forwarder is not the rank's
        os.environ.update(SUBMITIT_LOCAL_LOCALID=str(rank), SUBMITIT_LOCAL_GLOBALID=str(rank),
                          SUBMITIT_LOCAL_JOB_ID=job_id)
        print(f"slurmft: rank {rank} forked with the train job's libraries imported (controller {job_id})", flush=True)
        process_job(folder)
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException:  # what the interpreter prints for an uncaught exception, then its exit status 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


class ForkingController(Controller):
    """submitit's local controller, its tasks forked from this process instead of started."""

    def start_tasks(self) -> None:
        self.folder.mkdir(exist_ok=True)
        paths = [utils.JobPaths(self.folder, self.pid, k) for k in range(self.ntasks)]
        self.stdouts = [p.stdout.open("a") for p in paths]
        self.stderrs = self.stdouts if self.stderr_to_stdout else [p.stderr.open("a") for p in paths]
        sys.stdout.flush()  # what this process printed is not printed again by every child
        sys.stderr.flush()
        for rank in range(self.ntasks):
            pid = os.fork()
            if pid == 0:
                _run_task(self.folder, rank, self.pid, self.stdouts[rank].fileno(), self.stderrs[rank].fileno())
            self.tasks.append(ForkedTask(pid))


def main(argv: list[str] | None = None) -> int:
    folder, run_dir = argv if argv is not None else sys.argv[1:]
    from slurmft.job.entrypoint import load_the_stack

    load_the_stack(run_dir, "train")
    ForkingController(Path(folder)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
