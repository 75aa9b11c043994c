"""slurmft/job/tracking.py with real wandb, offline: three attempts of one run driven through the callback the
Trainer calls (no model: what is checked is what reaches W&B). A user's own WANDB_RUN_ID is kept, a fallback
to an older checkpoint sends no step twice, and a W&B service killed by SIGTERM (what Slurm's time limit,
``scontrol requeue`` and ``scancel`` do to every process of the step) stops the logging, not the training."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from slurmft.rundir import RunPaths
from slurmft.trackers import read_tracker
from tests.tracker_check import WANDB_HOME, wandb_offline_runs

WANDB_VARS = ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_NAME", "WANDB_DIR")


def _wandb_core_pids() -> list[int]:
    """This process's children named wandb-core (the W&B service)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1: stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name == "wandb-core" and int(rest[1]) == os.getpid():
            found.append(int(entry.name))
    return found


def test_three_attempts_one_run_each_step_once_and_a_dead_service(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from slurmft.job import tracking

    for key in WANDB_VARS:
        monkeypatch.setenv(key, "")  # unset for slurmft (an empty value counts as unset); restored afterwards
    for key in WANDB_HOME:
        monkeypatch.setenv(key, str(tmp_path / "wandb-home" / key))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_RUN_ID", "my-own-id")  # the user's
    paths = RunPaths.of(tmp_path / "run")
    paths.root.mkdir()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    killed: list[int] = []

    def attempt(restart: int, steps: range, kill_service: bool = False) -> tracking.OneWandbRun:
        assert tracking.use_one_wandb_run(paths, "it") == "my-own-id"
        callback = tracking.OneWandbRun(paths, {"job_id": "7", "restart": restart})
        state, control = TrainerState(), TrainerControl()
        state.global_step = steps.start - 1
        callback.on_train_begin(args, state, control)
        if kill_service:
            killed.extend(_wandb_core_pids())
            for pid in killed:
                os.kill(pid, signal.SIGTERM)
            time.sleep(1)
        for step in steps:  # MetricsLog appends the step first, then W&B gets it
            state.global_step = step
            with open(paths.metrics, "a") as f:
                f.write(json.dumps({"step": step, "loss": 1 / step, "restart": restart}) + "\n")
            callback.on_log(args, state, control, logs={"loss": 1 / step, "learning_rate": 1e-3, "epoch": step / 20})
        callback.on_log(args, state, control, logs={"train_runtime": 3.0, "train_loss": 0.5, "epoch": steps[-1] / 20})
        callback.on_train_end(args, state, control)
        time.sleep(1.1)  # the next offline directory's name starts with another second
        return callback

    first = attempt(0, range(1, 7))
    assert first.floor == 0 and not first.broken
    second = attempt(1, range(5, 10))  # a fallback to checkpoint-4: steps 5 and 6 are trained again
    assert second.floor == 6 and not second.broken
    third = attempt(2, range(10, 12), kill_service=True)
    assert killed and third.broken  # the calls failed, nothing was raised into the Trainer

    assert os.environ["WANDB_DIR"] == str(paths.root) and os.environ["WANDB_RESUME"] == "allow"
    assert os.environ["WANDB_NAME"] == "it"
    offline = wandb_offline_runs(paths.root)
    assert [o["dir"].name.endswith("-my-own-id") for o in offline] == [True] * 3
    # the killed service wrote neither the third attempt's run record nor its rows
    assert [(o["id"], o["resume"]) for o in offline] == [("my-own-id", True)] * 2 + [(None, None)]
    rows = [row for o in offline for row in o["rows"]]
    assert [r["_step"] for r in rows] == list(range(1, 10))  # 5 and 6 once; 10 and 11 never reached W&B
    assert [r["train/loss"] for r in rows] == [1 / s for s in range(1, 10)]
    assert [r["train/global_step"] for r in rows] == list(range(1, 10))
    assert rows[5]["train/epoch"] == 6 / 20  # the end-of-training log merged into its step's row
    record = read_tracker(paths)["wandb"]
    assert record["id"] == "my-own-id" and record["url"] is None and record["name"] == "it"
    assert [(a["restart"], a["first_step"], a["offline"], Path(a["dir"]).name) for a in record["attempts"]] == \
        [(r, first_step, True, o["dir"].name) for r, first_step, o in zip((0, 1, 2), (1, 7, 10), offline, strict=True)]
