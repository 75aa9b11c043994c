"""slurmft.rundir.RunPaths: every name inside a run directory, written once and read back the same way."""

from __future__ import annotations

from pathlib import Path

from slurmft.rundir import RunPaths
from slurmft.watch.runs import SKIP


def test_requeue_marker_name_round_trips(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    marker = paths.requeue_marker("4242", 3)
    assert marker.parent == paths.requeue_marker_dir
    assert RunPaths.requeue_marker_key(marker.name) == ("4242", 3)
    assert RunPaths.requeue_marker_key("local-123-0") == ("local-123", 0)  # a job id may hold a dash
    for bad in (".4242-3.tmp", "4242", "4242-x", "-3"):
        assert RunPaths.requeue_marker_key(bad) is None, bad


def test_runs_skips_every_folder_slurmft_makes(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    made = {paths.scripts, paths.logs, paths.submitit, paths.checkpoints, paths.model, paths.adapter,
            paths.requeue_marker_dir,
            paths.fsdp_report, paths.tensorboard, paths.wandb}
    assert {p.parent for p in made} == {paths.root}
    assert {p.name for p in made} == paths.folders <= SKIP
    assert {paths.report.parent, paths.loss_plot.parent, paths.tracker.parent} == {paths.root}
