"""slurmft/trackers.py: the W&B run id of a run, the variables the job sets (the user's own win), the
``tracker.json`` record and how ``status`` and the report say it."""

from __future__ import annotations

import json
from pathlib import Path

from runfixture import preempted_run, slurm_rows

from slurmft.rundir import RunPaths
from slurmft.trackers import (
    default_wandb_id,
    read_tracker,
    record_attempt,
    recorded_wandb_id,
    sync_command,
    tracker_lines,
    wandb_environment,
)
from slurmft.watch.progress import overview, overview_lines
from slurmft.watch.report import render, summary


def test_the_id_is_the_run_directory_s_and_a_new_run_at_the_same_path_gets_another(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path / "run")
    first, again = default_wandb_id(paths, 1_796_000_000.9), default_wandb_id(paths, 1_796_000_500.0)
    assert first == f"{paths.run_id}-1796000000" and again != first  # deleted and submitted again: a new W&B run
    assert default_wandb_id(paths, None) == paths.run_id  # no manifest (a run started by hand)


def test_the_environment_gets_what_the_user_left_unset(tmp_path: Path) -> None:
    env = wandb_environment({}, "abc-1", "it", tmp_path)
    assert env == {"WANDB_RUN_ID": "abc-1", "WANDB_RESUME": "allow", "WANDB_NAME": "it", "WANDB_DIR": str(tmp_path)}
    mine = {"WANDB_RUN_ID": "my-run", "WANDB_RESUME": "must", "WANDB_NAME": "mine", "WANDB_DIR": "/scratch/wandb"}
    assert wandb_environment(mine, "abc-1", "it", tmp_path) == {}
    assert wandb_environment({"WANDB_RUN_ID": ""}, "abc-1", "it", tmp_path)["WANDB_RUN_ID"] == "abc-1"


def test_record_status_and_report_name_the_one_run(tmp_path: Path) -> None:
    run = preempted_run(tmp_path)
    paths = RunPaths.of(run)
    assert read_tracker(paths) is None and recorded_wandb_id(paths) is None
    ov = overview(paths, json.loads(paths.manifest.read_text()), slurm_rows())
    assert ov["tracker"] is None and not [line for line in overview_lines(ov) if "W&B" in line]

    wandb_dir = run / "wandb"
    for restart, stamp in ((0, "20261202_040751"), (1, "20261202_040922")):
        record_attempt(paths, {"id": "r1-17", "project": "huggingface", "entity": None, "name": "watch", "url": None},
                       {"job_id": "100", "restart": restart, "offline": True, "first_step": 1 + 12 * restart,
                        "dir": str(wandb_dir / f"offline-run-{stamp}-r1-17")})
    record = read_tracker(paths)
    assert recorded_wandb_id(paths) == "r1-17"
    assert [(a["restart"], a["id"]) for a in record["wandb"]["attempts"]] == [(0, "r1-17"), (1, "r1-17")]
    assert sync_command(record) == f"wandb sync {wandb_dir}/offline-run-*-r1-17"

    ov = overview(paths, json.loads(paths.manifest.read_text()), slurm_rows())
    assert ov["tracker"] == record
    lines = overview_lines(ov)
    assert "W&B: run r1-17 in huggingface (2 attempt(s), 2 offline)" in lines
    assert f"  upload the offline attempts into that one run: wandb sync {wandb_dir}/offline-run-*-r1-17" in lines
    text = render(summary(paths, slurm_rows()), None)  # the report's text (its plot is another test's)
    assert "W&B: run r1-17 in huggingface" in text and f"`wandb sync {wandb_dir}/offline-run-*-r1-17`" in text


def test_an_online_run_shows_its_url(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    url = "https://wandb.ai/team/proj/runs/r1-17"
    record = record_attempt(paths, {"id": "r1-17", "project": "proj", "entity": "team", "name": "x", "url": url},
                            {"job_id": "5", "restart": 0, "offline": False, "dir": "/x/run-1-r1-17", "first_step": 1})
    assert tracker_lines(record) == [f"W&B: run r1-17 in team/proj, {url} (1 attempt(s))"]
    assert sync_command(record) is None
