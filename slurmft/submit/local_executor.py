"""The local executor of a run's train job: submitit's ``LocalExecutor`` whose controller forks the ranks from
one process that has imported the job's libraries (:mod:`slurmft.job.forked_ranks`, which says why and what
it measured), instead of starting an interpreter per rank."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

from submitit import LocalExecutor
from submitit.local.local import LocalJob

#: The controller: submitit's own (the time-out, the requeue loop, the logs), forking its tasks.
CONTROLLER = "slurmft.job.forked_ranks"


class ForkingLocalExecutor(LocalExecutor):
    """A ``LocalExecutor`` for ``run_train`` on the run directory ``run_dir``: the same parameters, folder layout,
    job ids and logs; the controller runs in ``python`` (the job's interpreter, not the submitting one, since it
    imports the job's stack) and forks the tasks."""

    def __init__(self, folder: str | Path, python: str, run_dir: str | Path) -> None:
        super().__init__(folder=folder, python=python)
        self.run_dir = str(run_dir)

    def _submit_command(self, command: str) -> LocalJob[Any]:
        ntasks = self.parameters.get("tasks_per_node", 1)
        gpus = range(self.parameters.get("gpus_per_node", 0))
        env = dict(os.environ)
        env.update(  # what submitit's Controller reads (submitit.local.local.start_controller sets the same)
            SUBMITIT_LOCAL_NTASKS=str(ntasks),
            SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="1" if self.parameters.get("stderr_to_stdout", False) else "",
            SUBMITIT_EXECUTOR="local",
            CUDA_VISIBLE_DEVICES=",".join(str(k) for k in gpus),
            SUBMITIT_LOCAL_WITH_SHELL="",
        )
        process = subprocess.Popen(
            [*shlex.split(self.python), "-u", "-m", CONTROLLER, str(self.folder), self.run_dir], env=env)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))
