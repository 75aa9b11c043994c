"""Clean logs on a real two-rank CPU run laid out like two nodes (each rank is its node's local rank 0).

transformers' PrinterCallback prints the per-step dict on every node's *local* rank 0, so on two
nodes each step appeared twice; slurmft replaces it with one readable line from global rank 0.
"""

from __future__ import annotations

import json
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


def test_the_final_summary_gives_the_whole_run_and_labels_the_attempts_own(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """transformers' end-of-training summary (train_loss, train_runtime, ...) is over the steps this attempt ran: after
    a requeue at step 15 of 30 its train_loss was the mean of steps 16-30 alone, printed and sent to W&B as the run's.
    MetricsLog records it as the attempt's, puts the whole run's under the plain names, and the step log says which
    is which (the real resumed runs: tests/test_resume_local.py, tests/slurm/test_watching.py)."""
    from types import SimpleNamespace

    from slurmft.job.callbacks import MetricsLog, StepLog
    from slurmft.rundir import RunPaths

    paths = RunPaths.of(tmp_path)
    ctx = SimpleNamespace(is_main=True)
    lines = [{"step": s, "loss": 1.0 if s <= 15 else 0.5, "loss_steps": 1, "job_id": "9", "restart": int(s > 15)}
             for s in range(1, 31)]
    paths.metrics.write_text("".join(json.dumps(m) + "\n" for m in lines))
    paths.train_summary.write_text(json.dumps({"step": 15, "from_step": 0, "train_runtime": 12.0, "train_loss": 1.0,
                                               "train_samples_per_second": 4.0, "job_id": "9", "restart": 0}) + "\n")
    metrics, steps = MetricsLog(ctx, paths.metrics, {"job_id": "9", "restart": 1}, paths.train_summary), StepLog(ctx)
    for callback in (metrics, steps):
        callback.on_train_begin(None, SimpleNamespace(global_step=15, num_input_tokens_seen=0), None)
    logs = {"train_runtime": 6.0, "train_samples_per_second": 8.0, "train_steps_per_second": 2.5, "train_loss": 0.5,
            "epoch": 1.875}
    state = SimpleNamespace(global_step=30, max_steps=30)
    with caplog.at_level(logging.INFO, logger="slurmft.job"):
        for callback in (metrics, steps):  # their order in the Trainer
            callback.on_log(None, state, None, logs=logs)
    end = json.loads(paths.train_summary.read_text().splitlines()[-1])
    assert end["from_step"] == 15 and end["train_loss"] == 0.5 and end["train_runtime"] == 6.0  # the attempt's own
    assert end["run"] == {"train_loss": 0.75, "train_loss_steps": 30, "train_runtime": 18.0,
                          "train_steps_per_second": round(30 / 18, 3), "train_samples_per_second": round(96 / 18, 3),
                          "train_attempts": 2}
    assert logs["train_loss"] == 0.75 and logs["last_attempt/train_loss"] == 0.5  # what TensorBoard and W&B get
    line = caplog.messages[-1]
    assert line.startswith("step 30/30  train_loss=0.75 train_loss_steps=30 train_runtime=18 train_steps_per_second="
                           "1.667 train_samples_per_second=5.333 train_attempts=2 last_attempt/train_loss=0.5 "
                           "last_attempt/train_runtime=6 "), line
    assert line.endswith("(train_*: the whole run, 2 attempt(s), train_loss the step-weighted mean of the logged "
                         "losses; last_attempt/*: this attempt alone, steps 16-30)"), line
