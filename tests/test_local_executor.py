"""The local executor's train job forks its ranks from one process that has imported the stack
(slurmft/submit/local_executor.py, slurmft/job/forked_ranks.py): the ranks it forks train exactly what ranks
started one interpreter each (submitit's own LocalExecutor) train, and an exit status reaches the controller as a
started rank's would."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from slurmft.job.forked_ranks import ForkedTask, _exit_status
from tests.job.helpers import write_run

pytestmark = pytest.mark.train


def _train(executor_kind: str, run_dir: Path, micro_model: Path) -> tuple[list[dict[str, object]], list[str]]:
    """``run_train`` on a fresh run directory (2 ranks, 3 steps) through the given local executor."""
    from submitit import LocalExecutor

    from slurmft.job.entrypoint import run_train
    from slurmft.job.rendezvous import free_port
    from slurmft.submit.local_executor import ForkingLocalExecutor

    write_run(run_dir, micro_model, ["train.max_steps=3", "checkpoint.every_steps=3"])
    folder = run_dir / "submitit"
    ex = (ForkingLocalExecutor(folder, sys.executable, run_dir) if executor_kind == "forked"
          else LocalExecutor(folder=folder, python=sys.executable))
    ex.update_parameters(tasks_per_node=2, nodes=1, timeout_min=10)
    env = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SLURMFT_RUN_DIR=str(run_dir),
                      OMP_NUM_THREADS="1")
    try:
        job = ex.submit(run_train, str(run_dir), "USR2")
        results = job.results()  # raises with the ranks' tracebacks when one failed
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert [r["status"] for r in results] == ["completed", "completed"], results
    logs = [Path(p).read_text() for p in sorted(folder.glob("*_log.out"))]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], logs


def test_forked_ranks_train_what_started_ranks_train(micro_model: Path, tmp_path: Path) -> None:
    forked, forked_logs = _train("forked", tmp_path / "forked", micro_model)
    started, _ = _train("started", tmp_path / "started", micro_model)

    def trained(rows: list[dict[str, object]]) -> list[tuple[object, ...]]:
        return [(r["step"], r["loss"], r["grad_norm"], r["learning_rate"]) for r in rows if "loss" in r]

    assert len(trained(forked)) == 3
    assert trained(forked) == trained(started)  # bitwise: the same floats, not close ones
    assert len(forked_logs) == 2 and all("forked with the train job's libraries imported" in log
                                         for log in forked_logs), forked_logs


def _ended(task: ForkedTask, timeout: float = 30.0) -> int:
    """The forked child's exit status, polled as the controller polls it; the child killed if it outlives ``timeout``."""
    deadline = time.monotonic() + timeout
    while task.poll() is None:
        if time.monotonic() > deadline:
            os.kill(task.pid, signal.SIGKILL)
            os.waitpid(task.pid, 0)
            raise AssertionError(f"the forked child {task.pid} did not end in {timeout} s")
        time.sleep(0.01)
    return task.poll()


def test_a_forked_rank_s_exit_status_is_a_started_one_s() -> None:
    assert [_exit_status(SystemExit(c)) for c in (None, 0, 2, 144)] == [0, 0, 2, 144]  # 144: submitit's requeue
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest, whatever happens
        os._exit(144)
    assert _ended(ForkedTask(pid)) == 144
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:  # as _run_task does: the default action for SIGTERM, whatever handler this worker process has
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(0)
    os.read(ready_r, 1)  # the child's SIGTERM is the default one now
    os.close(ready_r)
    os.close(ready_w)
    task = ForkedTask(pid)
    task.send_signal(signal.SIGTERM)
    assert _ended(task) == -signal.SIGTERM  # as Popen says it: minus the signal's number
    task.send_signal(signal.SIGTERM)  # an ended rank is not signalled (its pid may be another process's now)
