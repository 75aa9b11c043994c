"""slurmft.job.rendezvous (torch-free): ranks, world, port, address and gloo interface from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slurmft.job.rendezvous import JobEnv, interface_for, master_address, port_for_job

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
    assert all(20000 <= p < 32768 for p in [*ports, *(port_for_job(str(j)) for j in (0, 1, 19999, 20000, 10**9))])
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


def test_a_test_cluster_never_listens_on_the_jobs_rendezvous_ports(tmp_path: Path) -> None:
    """A test cluster whose daemons sat on 20017-20021 made Slurm jobs 17-21 of another cluster on the same host fail
    with EADDRINUSE at rendezvous (port_for_job): cluster.sh refuses such ports, for each suite's own offset."""
    from slurmft.job.rendezvous import PORT_BASE, PORT_SPAN

    def env(port: int, suite: str = "bookworm") -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(REPO / "tests" / "slurm" / "cluster.sh"), "env"], capture_output=True,
                              text=True, env={**os.environ, "SLURMFT_CLUSTER_PORT": str(port),
                                              "SLURMFT_CLUSTER_SUITE": suite,
                                              "SLURMFT_CLUSTER_DIR": str(tmp_path / "cluster")})

    assert {port_for_job(str(j)) for j in (0, 17, PORT_SPAN - 1)} <= set(range(PORT_BASE, PORT_BASE + PORT_SPAN))
    # a cluster's daemons take its port and the 7 above it (n3-n5 on +5..+7)
    for port, suite in ((PORT_BASE + 17, "bookworm"), (PORT_BASE - 7, "bookworm"), (PORT_BASE - 10, "trixie"),
                        (PORT_BASE + PORT_SPAN - 1, "bookworm")):
        out = env(port, suite)
        assert out.returncode == 2 and f"rendezvous ports {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}" in out.stderr, (port, suite)
    for port, suite in ((16817, "bookworm"), (16817, "trixie"), (PORT_BASE - 8, "bookworm"), (PORT_BASE - 18, "trixie"),
                        (PORT_BASE + PORT_SPAN, "trixie")):
        out = env(port, suite)
        assert out.returncode == 0 and f"SLURMFT_CLUSTER_PORT={port}" in out.stdout, (port, suite, out.stderr)


def test_a_free_port_is_one_the_kernel_never_hands_out_and_nothing_listens_on(monkeypatch) -> None:  # noqa: ANN001
    """The local executor's and the tests' rendezvous port: outside the ephemeral range, so no outgoing connection
    can take it between the pick and rank 0's bind (CI's EADDRINUSE), and below the Slurm jobs' ports."""
    import socket

    from slurmft.job import rendezvous

    ephemeral = rendezvous._ephemeral_ports()
    with socket.socket() as taken:  # a port someone listens on is never given out
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(rendezvous, "FREE_PORTS", range(busy, busy + 1))
        monkeypatch.setattr(rendezvous, "_ephemeral_ports", lambda: range(0))
        port = rendezvous.free_port(attempts=5)
        assert port != busy  # the window's one port was in use: the kernel's pick instead
    monkeypatch.undo()
    ports = {rendezvous.free_port() for _ in range(20)}
    assert all(p in rendezvous.FREE_PORTS and p not in ephemeral and p < rendezvous.PORT_BASE for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))  # free indeed


def test_an_array_task_is_named_as_sbatch_and_the_manifest_name_it() -> None:
    """A sweep's train task: its metrics, markers and requeue name it <array>_<task> (the point's manifest does);
    the rendezvous port still comes from its own number (two tasks on one node differ)."""
    from slurmft import slurm
    from slurmft.job.rendezvous import JobEnv, port_for_job

    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "33",
           "SLURM_ARRAY_JOB_ID": "27", "SLURM_ARRAY_TASK_ID": "1", "SLURMFT_MASTER_ADDR": "10.0.0.1"}
    job = JobEnv.from_environ(env)
    assert (job.job_id, job.master_port) == ("27_1", port_for_job("33"))
    assert slurm.own_job_id(env) == "27_1"
    plain = {k: v for k, v in env.items() if not k.startswith("SLURM_ARRAY")}
    assert JobEnv.from_environ(plain).job_id == slurm.own_job_id(plain) == "33"
