"""Preemption end to end on the real two-node cluster: the warning signal mid-run -> every rank saves
at one step boundary -> the batch script requeues (same job id) -> the job resumes from that
checkpoint -> the afterok consolidation job runs once, after the final success."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.export_check import assert_export_matches_checkpoint
from tests.slurm.jobs import metrics, rank_pid, wait_for

pytestmark = pytest.mark.slurm


def test_signal_save_requeue_resume_then_consolidate(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                     tmp_path: Path, slurmft) -> None:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, train={"max_steps": 40},
                        checkpoint={"every_steps": 20}, preemption={"lead_time_s": 30, "max_requeues": 2})
    jobs = slurmft.submit(path)
    run = tmp_path / "run"
    deadline = time.time() + 240
    while not any(m.get("step", 0) >= 4 for m in metrics(run)):  # training is under way
        assert time.time() < deadline, (run / "logs").iterdir()
        assert slurm_cluster.squeue_state(jobs["train"]) in ("PENDING", "RUNNING"), slurm_cluster.describe(jobs["train"])
        time.sleep(0.3)
    # Only rank 1 (on n2) gets the warning: the ranks must still agree (all-reduce of the flag) and stop
    # at one step boundary, or rank 0 trains on into a collective rank 1 never joins.
    os.kill(wait_for("rank 1's process", lambda: rank_pid(jobs["train"], 1), timeout=30), signal.SIGUSR2)

    slurm_cluster.wait_state(jobs["train"], "COMPLETED", timeout=300)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)

    log = (run / "logs" / f"train-{jobs['train']}.out").read_text()
    assert "requeueing job" in log and "restart=1" in log  # the same job id came back as restart 1
    stopped = sorted(p.name for p in (run / "requeue").iterdir())
    assert stopped == [f"{jobs['train']}-0"]  # one preemption save, by restart 0
    rows = metrics(run)
    first = [m["step"] for m in rows if m["restart"] == 0]
    second = [m["step"] for m in rows if m["restart"] == 1]
    assert first and second and max(first) < 40 and max(second) == 40
    resumed_from = min(second) - 1
    assert resumed_from == max(first)  # resumed exactly where the preemption save was taken
    marker = json.loads((run / "checkpoints" / "checkpoint-40" / "COMPLETE").read_text())
    assert marker["restart"] == 1
    # consolidation ran exactly once, after the final success, under its original job id
    cons_logs = list((run / "logs").glob("consolidate-*.out"))
    assert [p.name for p in cons_logs] == [f"consolidate-{jobs['consolidate']}.out"]
    assert (run / "model" / "model.safetensors.index.json").is_file()
    assert assert_export_matches_checkpoint(run, tiny_model)["checkpoint"].name == "checkpoint-40"
    rows = slurmft.status_json(run)
    assert rows["train"]["state"] == "COMPLETED" and rows["train"]["restarts"] >= 1
