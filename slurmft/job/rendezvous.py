"""Who am I in the job: rank, world size and rendezvous address from Slurm, submitit-local or torchrun.

Light on purpose (no torch): the batch script calls ``python -m slurmft.job.rendezvous exports``
once to compute MASTER_ADDR/MASTER_PORT, and every rank calls :func:`JobEnv.from_environ`.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass

from slurmft import slurm

# A Slurm job's rendezvous port: 20000-32767, below Linux's ephemeral range (32768-60999 by default), so no
# outgoing connection on the first node can hold it when rank 0 binds it (an ephemeral port may be in use).
PORT_BASE = 20000
PORT_SPAN = 12768


def port_for_job(job_id: str, offset: int = 0) -> int:
    """A rendezvous port derived from the job id, so two jobs sharing a node do not collide (``offset``: another
    port of the same job, as far from this one as the span allows)."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return PORT_BASE + (int(digits) + offset) % PORT_SPAN


def vllm_server_address(job_id: str, nodelist: str, server_node: int) -> tuple[str, int, int]:
    """``rollouts: server``: (the server node's NodeAddr, its HTTP port, the weight-sync group's port).

    The server is node ``server_node`` of the allocation (its last); its HTTP port is the job's rendezvous port, free
    there because the training ranks bind theirs on the first node. TRL's weight-sync group is opened by training
    rank 0 on the first node, beside MASTER_PORT, so it takes the port half the span away.
    """
    host = node_addr(slurm.hostnames(nodelist)[server_node])
    return host, port_for_job(job_id), port_for_job(job_id, PORT_SPAN // 2)


#: Where :func:`free_port` looks: below the rendezvous ports of Slurm jobs (PORT_BASE) and, on Linux, below the
#: ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default) that the kernel hands out on its own.
FREE_PORTS = range(10000, PORT_BASE)


def _ephemeral_ports() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default
    return range(low, high + 1)


def free_port(attempts: int = 200) -> int:
    """A TCP port nothing listens on now, for a rendezvous on this machine (the local executor, tests).

    Not the kernel's pick (``bind(("", 0))``): that is an ephemeral port, which the kernel may give any other
    process's outgoing connection before the rank binds it, seconds later (seen in CI: rank 0's store failed with
    EADDRINUSE and rank 1 waited out its time-out). A random port of :data:`FREE_PORTS` outside the ephemeral
    range can only be taken by a process that binds it by number, and the bind here checks that none has.
    """
    import random

    ephemeral = _ephemeral_ports()
    candidates = [p for p in FREE_PORTS if p not in ephemeral]
    for _ in range(attempts if candidates else 0):
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every port of the window in use (or none outside the ephemeral range)
        s.bind(("", 0))
        return int(s.getsockname()[1])


def first_host(nodelist: str) -> str:
    """First host name of a Slurm node list (``scontrol show hostnames``)."""
    return slurm.hostnames(nodelist)[0]


def node_addr(node: str) -> str:
    """The NodeAddr Slurm itself uses to reach ``node`` (node names need not resolve); ``node`` itself
    when scontrol does not say."""
    return slurm.node_addr(node) or node


def master_address(environ: dict[str, str] | None = None) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT for this allocation: override, else the first node's NodeAddr."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("SUBMITIT_LOCAL_JOB_ID") or str(os.getpid())
    port = int(env.get("SLURMFT_MASTER_PORT") or port_for_job(job_id))
    if env.get("SLURMFT_MASTER_ADDR"):
        return env["SLURMFT_MASTER_ADDR"], port
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1", port
    return node_addr(first_host(nodelist)), port


def interface_for(addr: str, port: int = PORT_BASE) -> str | None:
    """Name of this host's network interface that carries traffic to ``addr`` (None if unknown).

    The kernel picks the source address of a UDP socket "connected" to ``addr`` (no packet is sent);
    the interface holding that address is the one gloo should bind to: MASTER_ADDR is reachable from
    every node (the rendezvous needs it), so each node's interface towards it is reachable by the others.
    """
    try:
        import psutil  # an accelerate dependency: present wherever the job runs

        family = socket.getaddrinfo(addr, port, proto=socket.IPPROTO_UDP)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            source = s.getsockname()[0]
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == source for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)):
                return name
    except (ImportError, OSError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class JobEnv:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    job_id: str
    restart_count: int
    master_addr: str
    master_port: int
    launcher: str

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> JobEnv:
        """Read Slurm (srun), submitit's local executor, or torchrun variables, in that order."""
        env = dict(os.environ if environ is None else environ)
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            ntasks = int(env["SLURM_NTASKS"])
            # the step's nodes first: a GRPO server layout's train step runs on all of the job's nodes but one
            nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
                         or 1)
            local_ws = int(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or max(1, ntasks // nnodes))
            job = slurm.own_job_id(env) or "0"
            addr = env.get("MASTER_ADDR")
            port = int(env.get("MASTER_PORT") or port_for_job(env.get("SLURM_JOB_ID", "0")))
            if not addr:
                addr, port = master_address(env)
            return cls(
                rank=int(env["SLURM_PROCID"]), world_size=ntasks, local_rank=int(env.get("SLURM_LOCALID", 0)),
                local_world_size=local_ws, node_rank=int(env.get("SLURM_NODEID", 0)), num_nodes=nnodes,
                job_id=job, restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
                master_addr=addr, master_port=port, launcher="slurm",
            )
        if "SUBMITIT_LOCAL_GLOBALID" in env:
            n = int(env["SUBMITIT_LOCAL_NTASKS"])
            job = env.get("SUBMITIT_LOCAL_JOB_ID", "0")
            return cls(
                rank=int(env["SUBMITIT_LOCAL_GLOBALID"]), world_size=n,
                local_rank=int(env.get("SUBMITIT_LOCAL_LOCALID", 0)), local_world_size=n, node_rank=0,
                num_nodes=1, job_id=job, restart_count=0, master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT") or port_for_job(job)), launcher="local",
            )
        ws = int(env.get("WORLD_SIZE", 1))
        return cls(
            rank=int(env.get("RANK", 0)), world_size=ws, local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", ws)), node_rank=int(env.get("GROUP_RANK", 0)),
            num_nodes=max(1, ws // int(env.get("LOCAL_WORLD_SIZE", ws) or 1)), job_id=env.get("TORCHELASTIC_RUN_ID", "0"),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)),
            launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env else "single",
        )

    def export(self) -> None:
        """Set the variables torch.distributed and accelerate read (env:// rendezvous)."""
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size), NODE_RANK=str(self.node_rank),
            MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port),
        )


USAGE = "usage: python -m slurmft.job.rendezvous exports [--vllm-server-node=N]"


def _main(argv: list[str]) -> int:
    server = [a.removeprefix("--vllm-server-node=") for a in argv[1:] if a.startswith("--vllm-server-node=")]
    if argv[:1] != ["exports"] or len(argv) != 1 + len(server) or not all(s.isdigit() for s in server):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        addr, port = master_address()
        lines = [f"export MASTER_ADDR={shlex.quote(addr)} MASTER_PORT={port}"]
        if server:
            from slurmft.grpoopts import VLLM_GROUP_PORT_ENV, VLLM_HOST_ENV, VLLM_PORT_ENV

            host, http, group = vllm_server_address(os.environ.get("SLURM_JOB_ID", "0"),
                                                    os.environ.get("SLURM_JOB_NODELIST", ""), int(server[0]))
            lines.append(f"export {VLLM_HOST_ENV}={shlex.quote(host)} {VLLM_PORT_ENV}={http} "
                         f"{VLLM_GROUP_PORT_ENV}={group}")
    except (OSError, slurm.SlurmCallError, IndexError, ValueError) as exc:
        # The batch script stops on a non-zero status; say which lookup failed and with what.
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or "?"
        print(f"[slurmft] cannot find the rendezvous address for node list {nodelist!r}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
