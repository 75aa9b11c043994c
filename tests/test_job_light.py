"""Light, torch-free pieces of the job side: rendezvous from the environment, the requeue decision,
checkpoint discovery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft import checkpoints
from slurmft.job.rendezvous import JobEnv, interface_for, master_address, port_for_job
from slurmft.job.requeue import EXIT_REQUEUE_REFUSED, Action, Ending, JobView, decide

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


def test_gloo_interface_is_the_one_that_reaches_the_address() -> None:
    """GLOO_SOCKET_IFNAME when no profile sets one: the interface holding the source address towards MASTER_ADDR."""
    import socket

    import psutil

    assert interface_for("127.0.0.1") == "lo"
    own = [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for name, address in own:  # rank 0's own node: MASTER_ADDR is one of its addresses
        assert interface_for(address) == name
    assert interface_for("no-such-host.invalid") is None


def test_master_address_override_wins() -> None:
    addr, port = master_address({"SLURMFT_MASTER_ADDR": "ib0-node1", "SLURM_JOB_ID": "5"})
    assert addr == "ib0-node1"
    assert port == master_address({"SLURM_JOB_ID": "5"})[1]  # the address override leaves the job's port
    assert master_address({"SLURMFT_MASTER_ADDR": "ib0-node1", "SLURMFT_MASTER_PORT": "31000",
                           "SLURM_JOB_ID": "5"}) == ("ib0-node1", 31000)


SAVED = {"step": 12, "saved": True}


@pytest.mark.parametrize(
    ("marker", "exit_code", "restart", "max_requeues", "expected"),
    [
        (None, 0, 0, 5, (Action.EXIT, 0)),  # finished normally
        (None, 1, 0, 5, (Action.EXIT, 1)),  # failed: the failure stands
        (SAVED, 0, 0, 5, (Action.REQUEUE, 0)),  # saved after the warning signal: requeue
        ({"step": 3, "saved": False}, 0, 0, 5, (Action.REQUEUE, 0)),  # stopped during start-up: requeue
        (SAVED, 0, 5, 5, (Action.EXIT, EXIT_REQUEUE_REFUSED)),  # out of requeues: fail, no consolidation
        (SAVED, 137, 0, 5, (Action.EXIT, 137)),  # a rank died after the marker: never requeue a broken run
    ],
)
def test_requeue_decision_after_the_warning_signal(marker: dict | None, exit_code: int, restart: int,
                                                   max_requeues: int, expected: tuple[Action, int]) -> None:
    decision = decide(marker, exit_code, restart, max_requeues)
    assert (decision.action, decision.code) == expected


# What `scontrol show job` printed from inside the batch script after srun returned, per ending
# (docs/design-notes.md, "How jobs really end"), trimmed to one line of the real output.
SHOW_JOB = "JobId=7 JobName=it-train UserId=root(0) Priority=1 JobState={state} Reason={reason} Dependency=(null) Requeue=1 Restarts={restarts} BatchFlag=1"


@pytest.mark.parametrize(
    ("state", "reason", "restarts", "restart", "ending", "action"),
    [
        ("COMPLETING", "TimeLimit", 0, 0, Ending.TIME_LIMIT, Action.REQUEUE),  # time limit: we requeue
        ("COMPLETING", "TimeLimit", 2, 2, Ending.TIME_LIMIT, Action.REQUEUE),
        ("COMPLETING", "None", 1, 0, Ending.SLURM_REQUEUE, Action.EXIT),  # scontrol requeue / preemption
        ("COMPLETING", "None", 3, 2, Ending.SLURM_REQUEUE, Action.EXIT),
        ("COMPLETING", "None", 0, 0, Ending.CANCELLED, Action.EXIT),  # scancel: never requeue
        ("COMPLETING", "None", 2, 2, Ending.CANCELLED, Action.EXIT),
        ("CANCELLED", "None", 0, 0, Ending.CANCELLED, Action.EXIT),
    ],
)
def test_requeue_decision_after_sigterm_asks_slurm_why(state: str, reason: str, restarts: int, restart: int,
                                                       ending: Ending, action: Action) -> None:
    view = JobView.parse(SHOW_JOB.format(state=state, reason=reason, restarts=restarts))
    assert view == JobView(state, reason, restarts)
    decision = decide(SAVED, 0, restart, 5, "TERM", view)
    assert (decision.ending, decision.action) == (ending, action)
    assert decision.code == 0 and "step 12" in decision.message
    assert decide(SAVED, 0, restart, 5, "", view).ending == Ending.WARNING  # no SIGTERM here: the warning signal


def test_requeue_decision_sigterm_without_slurm_view_does_not_requeue() -> None:
    assert JobView.parse("slurm_load_jobs error: Invalid job id specified") is None
    decision = decide(SAVED, 0, 0, 5, "TERM", None)
    assert (decision.action, decision.ending) == (Action.EXIT, Ending.UNKNOWN_TERM)
    assert "slurmft resume" in decision.message
    time_limit = JobView("COMPLETING", "TimeLimit", 5)
    assert decide(SAVED, 0, 5, 5, "TERM", time_limit).code == EXIT_REQUEUE_REFUSED  # the budget holds here too


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


def _saved(root: Path, step: int, shard: bytes = b"x" * 100) -> Path:
    ckpt = root / f"checkpoint-{step}"
    (ckpt / "pytorch_model_fsdp_0").mkdir(parents=True)
    (ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(shard)
    (ckpt / "trainer_state.json").write_text("{}")
    checkpoints.fsync_tree(ckpt)
    checkpoints.mark_complete(ckpt, step=step, save_s=0.5)
    return ckpt


def test_complete_lists_every_file_and_a_damaged_checkpoint_is_skipped_saying_why(tmp_path: Path) -> None:
    import json

    older, newer = _saved(tmp_path, 10), _saved(tmp_path, 20)
    marker = json.loads((newer / "COMPLETE").read_text())
    assert marker["files"] == {"pytorch_model_fsdp_0/__0_0.distcp": 100, "trainer_state.json": 2}
    assert marker["bytes"] == 102 and marker["save_s"] == 0.5 and marker["step"] == 20
    assert checkpoints.latest_complete(tmp_path) == newer
    with open(newer / "pytorch_model_fsdp_0" / "__0_0.distcp", "r+b") as f:
        f.truncate(40)
    assert checkpoints.latest_complete(tmp_path) == older
    assert checkpoints.damaged(tmp_path) == [
        (newer, "pytorch_model_fsdp_0/__0_0.distcp is 40 bytes, COMPLETE says 100")]
    (newer / "trainer_state.json").unlink()
    assert checkpoints.problem(newer) == "pytorch_model_fsdp_0/__0_0.distcp is 40 bytes, COMPLETE says 100"
    assert checkpoints.prune(tmp_path, keep_last=2) == [newer]  # a verified one remains: the damaged one goes
    assert checkpoints.latest_complete(tmp_path) == older


def test_a_torn_or_damaged_checkpoint_is_never_deleted_while_it_is_the_only_one(tmp_path: Path) -> None:
    only = _saved(tmp_path, 10)
    (only / "trainer_state.json").unlink()
    torn = tmp_path / "checkpoint-15"
    torn.mkdir()
    assert checkpoints.latest_complete(tmp_path) is None
    assert checkpoints.prune(tmp_path, keep_last=1) == [] and only.is_dir() and torn.is_dir()
    good = [_saved(tmp_path, s) for s in (20, 30, 40)]
    assert checkpoints.prune(tmp_path, keep_last=2) == [only, torn, good[0]]  # keep_last *verified* ones
    assert [p.name for p in checkpoints.verified(tmp_path)] == ["checkpoint-30", "checkpoint-40"]


def test_a_checkpoint_that_failed_to_load_is_set_aside_and_the_one_fallen_back_to_is_kept(tmp_path: Path) -> None:
    import json

    older, bad = _saved(tmp_path, 10), _saved(tmp_path, 20)
    aside = checkpoints.set_aside(bad, ["the model (pytorch_model_fsdp_0/): rank 1: UnpicklingError"], restart=1)
    assert aside.name == "unloadable-checkpoint-20" and not bad.exists()
    note = json.loads((aside / checkpoints.LOAD_FAILED_NOTE).read_text())
    assert note["problems"] == ["the model (pytorch_model_fsdp_0/): rank 1: UnpicklingError"] and note["restart"] == 1
    assert checkpoints.verified(tmp_path) == [older] and checkpoints.unloadable(tmp_path) == [aside]
    newer = [_saved(tmp_path, s) for s in (20, 30)]  # the fallback saved step 20 again: a fresh directory
    assert checkpoints.prune(tmp_path, keep_last=2, protect=(older,)) == [aside]  # keep_last 2 would take older
    assert checkpoints.verified(tmp_path) == [older, *newer]
    assert checkpoints.prune(tmp_path, keep_last=2) == [older]  # a later attempt protects nothing


def test_old_markers_without_a_file_list_are_still_trusted(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    (ckpt / "COMPLETE").write_text('{"t": 1, "step": 5}\n')
    assert checkpoints.latest_complete(tmp_path) == ckpt
    (ckpt / "COMPLETE").write_text("not json")
    assert "unreadable" in checkpoints.problem(ckpt)
