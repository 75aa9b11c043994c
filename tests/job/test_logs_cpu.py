"""Clean logs on a real two-rank CPU run laid out like two nodes (each rank is its node's local rank 0).

transformers' PrinterCallback prints the per-step dict on every node's *local* rank 0, so on two
nodes each step appeared twice; slurmft replaces it with one readable line from global rank 0.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft.job.rendezvous import free_port

from .helpers import read_metrics, write_run

pytestmark = pytest.mark.train
STEPS = 4


def test_only_global_rank_0_logs_the_steps_one_line_each(tiny_model: Path, job_env: dict[str, str],
                                                        tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", tiny_model, [f"train.max_steps={STEPS}", f"checkpoint.every_steps={STEPS}"])
    port = free_port()
    procs, logs = [], []
    for rank in (0, 1):  # as srun starts them on two nodes, one task per node
        env = {**job_env, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
               "SLURM_NODEID": str(rank), "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "1",
               "SLURM_JOB_ID": "5151", "SLURM_RESTART_COUNT": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        logs.append(tmp_path / f"rank{rank}.log")
        with open(logs[-1], "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "slurmft.job.entrypoint", "train", str(run)],
                                          stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path)))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    rank0, rank1 = (f.read_text() for f in logs)
    assert codes == [0, 0], rank0[-3000:] + rank1[-3000:]
    assert [m["step"] for m in read_metrics(run)] == list(range(1, STEPS + 1))

    step_lines = re.findall(rf"^\[slurmft rank0 [\d:]+\] step (\d+)/{STEPS}  loss \d+\.\d{{4}}  lr ", rank0, re.M)
    assert step_lines == [str(s) for s in range(1, STEPS + 1)], rank0[-3000:]  # once per step, one line each
    assert "{'loss'" not in rank0  # not the Trainer's raw dict as well
    assert "loss" not in rank1, rank1[-3000:]  # the other node's local rank 0 prints no step
    assert "slurmft rank 1: completed at step 4" in rank1


def test_a_grpo_step_line_says_the_reward_beside_the_loss() -> None:
    # GRPO's loss is advantage-weighted, near 0 whatever the rewards: the line a user follows (`slurmft logs -f`)
    # must say the reward at the steps that generated (TRL logs it there only)
    from slurmft.job.callbacks import step_line

    logs = {"loss": 0.0, "learning_rate": 1e-5, "grad_norm": 5.1668, "reward": 0.1, "reward_std": 0.1069, "kl": 0.0,
            "epoch": 0.03}
    assert step_line(logs, 1, 8) == "step 1/8  loss 0.0000  lr 1.00e-05  grad_norm 5.167  reward 0.1000 ± 0.1069  epoch 0.03"
    no_rollout = {k: v for k, v in logs.items() if not k.startswith("reward")}
    assert "reward" not in step_line(no_rollout, 2, 8)


def test_the_final_summary_of_a_resumed_attempt_says_it_covers_that_attempt_only(
        caplog: pytest.LogCaptureFixture) -> None:
    """transformers' end-of-training summary (train_loss, train_runtime, ...) is over the steps this attempt ran: after
    a requeue at step 15 of 30 its train_loss was the mean of steps 16-30 alone, printed as if of the run."""
    from types import SimpleNamespace

    from slurmft.job.callbacks import StepLog

    summary = {"train_runtime": 6.19, "train_loss": 0.6051, "epoch": 1.875}
    for resumed_at, said in ((15, "(this attempt only: steps 16-30; every step is in metrics.jsonl)"), (0, None)):
        callback = StepLog(SimpleNamespace(is_main=True))
        callback.on_train_begin(None, SimpleNamespace(global_step=resumed_at), None)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slurmft.job"):
            callback.on_log(None, SimpleNamespace(global_step=30, max_steps=30), None, logs=summary)
        line = caplog.messages[-1]
        assert line.startswith("step 30/30  train_runtime=6.19 train_loss=0.6051")
        assert (said in line) if said else "this attempt" not in line, line
