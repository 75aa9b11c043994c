"""Light, torch-free pieces of the job side: rendezvous from the environment, the requeue decision,
checkpoint discovery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurmft import checkpoints
from slurmft.job.rendezvous import JobEnv, master_address, port_for_job
from slurmft.job.requeue import EXIT_REQUEUE_REFUSED, decide

REPO = Path(__file__).resolve().parent.parent


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
    # Jobs that share a node get different ports: a run of consecutive job ids never collides.
    ports = [port_for_job(str(j)) for j in range(1_000_000, 1_005_000)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 40000 for p in [*ports, *(port_for_job(str(j)) for j in (0, 1, 19999, 20000, 10**9))])
    assert port_for_job("12345_7") != port_for_job("12345_8")  # array tasks are jobs of their own


def test_port_is_the_same_in_every_process() -> None:
    """The batch script (rendezvous exports) and each rank compute the port apart: it must not depend
    on the process (e.g. on Python's per-process string hashing)."""
    code = "from slurmft.job.rendezvous import port_for_job; print(port_for_job('4242'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    seen = {subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONHASHSEED": seed}, capture_output=True,
                           text=True, check=True).stdout.strip() for seed in ("1", "2", "3")}
    assert len(seen) == 1


def test_ranks_and_batch_script_agree_on_the_port() -> None:
    """A rank without MASTER_PORT (an srun that did not get the export) derives what the batch script did."""
    batch_addr, batch_port = master_address({"SLURM_JOB_ID": "31337"})
    rank = JobEnv.from_environ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "31337",
                                "MASTER_ADDR": "10.1.2.3"})
    assert rank.master_port == batch_port and batch_addr == "127.0.0.1"  # no node list: one machine


def test_master_address_override_wins() -> None:
    addr, port = master_address({"SLURMFT_MASTER_ADDR": "ib0-node1", "SLURM_JOB_ID": "5"})
    assert addr == "ib0-node1"
    assert port == master_address({"SLURM_JOB_ID": "5"})[1]  # the address override leaves the job's port
    assert master_address({"SLURMFT_MASTER_ADDR": "ib0-node1", "SLURMFT_MASTER_PORT": "31000",
                           "SLURM_JOB_ID": "5"}) == ("ib0-node1", 31000)


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
