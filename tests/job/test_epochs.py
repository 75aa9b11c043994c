"""train.epochs in a real two-rank CPU job: the steps come from the packed data and are recorded (issue 12)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from .helpers import launch, write_run

pytestmark = pytest.mark.train


def test_epochs_are_counted_from_the_packed_data(tiny_model: Path, job_env: dict[str, str], tmp_path: Path) -> None:
    def edit(data: dict) -> None:
        data["train"].update(max_steps=None, epochs=0.1, sft={"adam_epsilon": "1e-8"})  # a YAML 1.1 string

    run = write_run(tmp_path / "run", tiny_model, overrides=["checkpoint.every_steps=100"], edit=edit)
    rc, out = launch(run, job_env).wait(timeout=300)
    assert rc == 0, out[-6000:]
    plan = json.loads((run / "plan.json").read_text())
    # 2 ranks x 2 sequences per micro-batch, no accumulation: ceil(n / 4) steps per epoch (slurmft/job/sampler.py)
    assert plan["steps_per_epoch"] == math.ceil(plan["sequences"] / 4) and plan["sequences"] > 20
    assert plan["max_steps"] == math.ceil(plan["steps_per_epoch"] / 10)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps[-1] == plan["max_steps"]
    assert len(re.findall(rf"completed at step {plan['max_steps']}", out)) == 2, out[-3000:]
    # the last step is saved although checkpoint.every_steps (100) is larger than the run
    assert (run / "checkpoints" / f"checkpoint-{plan['max_steps']}" / "COMPLETE").exists()
