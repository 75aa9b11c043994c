"""Light, torch-free pieces of the job side: rendezvous from the environment, the requeue decision,
checkpoint discovery."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slurmft import checkpoints
from slurmft.job.rendezvous import JobEnv, master_address, port_for_job
from slurmft.job.requeue import EXIT_REQUEUE_REFUSED, decide


def test_slurm_environment_gives_rank_and_world() -> None:
    env = JobEnv.from_environ({
        "SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_JOB_ID": "12345",
        "SLURM_RESTART_COUNT": "2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "23456",
    })
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (9, 16, 1, 8, 1)
    assert (env.num_nodes, env.job_id, env.restart_count, env.launcher) == (2, "12345", 2, "slurm")
    assert (env.master_addr, env.master_port) == ("10.0.0.7", 23456)


def test_submitit_local_environment() -> None:
    env = JobEnv.from_environ({"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2",
                               "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_JOB_ID": "777",
                               "MASTER_PORT": "29999"})
    assert (env.rank, env.world_size, env.master_addr, env.master_port, env.launcher) == (
        1, 2, "127.0.0.1", 29999, "local")


def test_port_is_derived_from_the_job_id_and_in_range() -> None:
    assert port_for_job("12345") == port_for_job("12345") != port_for_job("12346")
    assert all(20000 <= port_for_job(str(j)) < 40000 for j in (0, 1, 19999, 20000, 10**9))


def test_master_address_override_wins() -> None:
    assert master_address({"SLURMFT_MASTER_ADDR": "ib0-node1", "SLURM_JOB_ID": "5"}) == ("ib0-node1", 20005)


def _run_dir(tmp_path: Path, max_requeues: int) -> Path:
    (tmp_path / "requeue").mkdir()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"preemption": {"max_requeues": max_requeues}}))
    return tmp_path


@pytest.mark.parametrize(
    ("marker", "exit_code", "restart", "max_requeues", "expected"),
    [
        (False, 0, 0, 5, ("exit", 0)),  # finished normally
        (False, 1, 0, 5, ("exit", 1)),  # failed: the failure stands
        (True, 0, 0, 5, ("requeue", 0)),  # saved after the warning signal: requeue
        (True, 0, 5, 5, ("exit", EXIT_REQUEUE_REFUSED)),  # out of requeues: fail, consolidation must not run
        (True, 137, 0, 5, ("exit", 137)),  # a rank died after the marker: never requeue a broken run
    ],
)
def test_requeue_decision(tmp_path: Path, marker: bool, exit_code: int, restart: int, max_requeues: int,
                          expected: tuple[str, int]) -> None:
    run = _run_dir(tmp_path, max_requeues)
    if marker:
        (run / "requeue" / f"42-{restart}").write_text("{}")
    assert decide(run, exit_code, "42", restart) == expected


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    checkpoints.mark_complete(tmp_path / "checkpoint-5", restart=0)
    checkpoints.mark_complete(tmp_path / "checkpoint-10", restart=1)
    assert checkpoints.latest_complete(tmp_path) == tmp_path / "checkpoint-10"  # 15 is a torn save
    assert [(s, ok) for s, _, ok in checkpoints.list_checkpoints(tmp_path)] == [(5, True), (10, True), (15, False)]
    assert checkpoints.latest_complete(tmp_path / "missing") is None


def test_prune_keeps_the_newest_complete_and_hides_before_deleting(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "shard").write_text("x")
    for step in (2, 4, 6):
        checkpoints.mark_complete(tmp_path / f"checkpoint-{step}")
    (tmp_path / ".deleting-checkpoint-0").mkdir()  # left over by a rank 0 killed mid-delete
    removed = checkpoints.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["checkpoint-2", "checkpoint-8"]  # too old; torn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert checkpoints.prune(tmp_path) == []  # without keep_last every complete checkpoint stays
