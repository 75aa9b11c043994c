"""The process group of one train job: device, a rendezvous that fails fast, and agreement among the ranks.

Why our own rendezvous store: with ``env://`` a wrong MASTER_ADDR or a rank that never starts does
not fail, it waits for the collective time-out (30 min by default, docs/design-notes.md). Rank 0 therefore
opens the TCP store itself and waits at most ``SLURMFT_RENDEZVOUS_TIMEOUT`` seconds (default 180)
for every rank; the others give up after the same time, each with an error that names the address.
Collectives afterwards get the long ``SLURMFT_COLLECTIVE_TIMEOUT`` (default 1800 s: a save of a
large model or a first-time dataset preparation on rank 0 can take that long). Under torchrun the
agent already ran the rendezvous and owns the store, so we use it.

Why :func:`agree`: a setup error on one rank while the others walk into a collective is a hang. Every
setup phase ends with an all-gather of "my error or None" (:func:`gather_errors`, which the checkpoint
loads share, slurmft/job/checkpointing/fallback.py); if any rank failed, all raise the same
:class:`~slurmft.errors.JobSetupError` and exit non-zero together. :func:`any_rank` is the boolean
agreement (one all-reduce), e.g. on the preemption flag at a step boundary.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from slurmft.errors import JobSetupError
from slurmft.job.rendezvous import JobEnv, interface_for

log = logging.getLogger("slurmft.job")

T = TypeVar("T")

DEFAULT_RENDEZVOUS_TIMEOUT_S = 180
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the initialised process group."""

    env: JobEnv
    device: torch.device
    backend: str
    collective_timeout_s: int

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that reads weights and writes shared files."""
        return self.env.rank == 0

    @property
    def on_gpu(self) -> bool:
        """True when this rank trains on a CUDA device."""
        return self.device.type == "cuda"


def collective_timeout_s() -> int:
    """The collectives' time-out after the rendezvous: ``SLURMFT_COLLECTIVE_TIMEOUT``, else the default."""
    return _timeout_from_env("SLURMFT_COLLECTIVE_TIMEOUT", DEFAULT_COLLECTIVE_TIMEOUT_S)


def _timeout_from_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return max(1, int(float(raw)))
    except ValueError:
        raise JobSetupError(f"{name}={raw!r} is not a number of seconds") from None


def _rendezvous_store(env: JobEnv, timeout_s: int) -> dist.Store | None:
    """Our own TCP store with a short time-out (None under torchrun, whose agent owns one)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    try:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=True,
        )
    except Exception as exc:  # DistStoreError, RuntimeError (address in use), socket errors
        who = "rank 0 waited for the other ranks" if env.rank == 0 else f"rank {env.rank} tried to reach rank 0"
        raise JobSetupError(
            f"rendezvous failed: {who} at {env.master_addr}:{env.master_port} for up to {timeout_s}s "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Check that MASTER_ADDR is "
            "the first node's address reachable from every node (set cluster.master_addr to override), that the "
            "port is free, and that every rank started (see the other ranks' logs)."
        ) from None
    # The store outlives the rendezvous: later key waits (gloo connection set-up, barriers) may be long.
    store.set_timeout(timedelta(seconds=collective_timeout_s()))
    return store


def _cpu_threads(env: JobEnv) -> int:
    for var in ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, (os.cpu_count() or 1) // max(1, env.local_world_size))


def _gloo_interface(env: JobEnv) -> None:
    """GLOO_SOCKET_IFNAME, unless the profile or cluster.env set it: the interface that reaches MASTER_ADDR.

    gloo carries the object collectives and barriers (also beside NCCL). Left alone it binds to the
    address its host name resolves to, which on some nodes is 127.0.1.1 or a container bridge, and the
    other nodes then cannot connect. Interface names differ between sites and images (eth0, ens5,
    ens32, ib0), so no shipped profile can name one; this one works wherever the rendezvous does.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_for(env.master_addr, env.master_port)
    if name is None:
        log.warning("no network interface found towards MASTER_ADDR %s: gloo binds to its default (the host name's "
                    "address); set GLOO_SOCKET_IFNAME in cluster.env if ranks cannot connect", env.master_addr)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    if env.rank == 0:
        log.info("GLOO_SOCKET_IFNAME=%s (the interface that reaches MASTER_ADDR %s)", name, env.master_addr)


def choose_gpu(visible: int, local_rank: int, rank: int, environ: Mapping[str, str]) -> int:
    """Index of this rank's CUDA device among the ``visible`` ones.

    One rule: the train script runs ``srun --gpu-bind=none``, so every rank sees all of its node's GPUs
    and takes ``cuda:LOCAL_RANK``. A site that binds one GPU per task anyway (``--gpus-per-task=1``,
    ``SLURM_GPU_BIND``, a cgroup per task) leaves exactly one visible: that one, ``cuda:0``. Anything
    else is a JobSetupError naming the rank, ``CUDA_VISIBLE_DEVICES`` and ``SLURM_LOCALID``.
    """
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise JobSetupError(
        f"rank {rank} has LOCAL_RANK {local_rank} but sees {visible} GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}, "
        f"SLURM_LOCALID={environ.get('SLURM_LOCALID', '<unset>')}): each rank must see either all of its node's "
        "GPUs (srun --gpu-bind=none, as the rendered train script does) or exactly one. Run one task per GPU "
        "(resources.tasks_per_node = resources.gpus_per_node), and check that cluster.setup or the site's srun "
        "defaults (SLURM_GPU_BIND, --gpus-per-task) do not restrict CUDA_VISIBLE_DEVICES to fewer"
    )


#: Backends when CUDA exists: NCCL for GPU tensors, gloo for CPU ones (object collectives, barriers).
GPU_BACKEND = "cuda:nccl,cpu:gloo"


def init(env: JobEnv) -> DistContext:
    """Join the process group: this rank's GPU (:func:`choose_gpu`) + NCCL (gloo for CPU tensors), else gloo.

    The GPU is chosen before the rendezvous but a bad choice is raised only after it, through
    :func:`agree` (over gloo: no device needed), so every rank stops with the same error. Raising
    before the rendezvous would leave rank 0 waiting, to report a misleading rendezvous time-out.
    """
    env.export()
    _gloo_interface(env)
    rdzv_s = _timeout_from_env("SLURMFT_RENDEZVOUS_TIMEOUT", DEFAULT_RENDEZVOUS_TIMEOUT_S)
    coll_s = collective_timeout_s()
    device_error: str | None = None
    if torch.cuda.is_available():
        backend = GPU_BACKEND
        try:
            device = torch.device("cuda", choose_gpu(torch.cuda.device_count(), env.local_rank, env.rank, os.environ))
            torch.cuda.set_device(device)
        except JobSetupError as exc:
            device, device_error = torch.device("cpu"), exc.render()
    else:
        device = torch.device("cpu")
        backend = "gloo"
        threads = _cpu_threads(env)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # accelerate would otherwise pick its own
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        store = _rendezvous_store(env, rdzv_s)
        kwargs = {"store": store} if store is not None else {}
        try:
            dist.init_process_group(
                backend=backend,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=coll_s),
                **kwargs,
            )
        except JobSetupError:
            raise
        except Exception as exc:
            raise JobSetupError(
                f"rendezvous failed on rank {env.rank} ({env.master_addr}:{env.master_port}, {backend}): {exc}"
            ) from None
    ctx = DistContext(env=env, device=device, backend=backend, collective_timeout_s=coll_s)
    try:
        agree(ctx, device_error, "choosing the GPU")
    except JobSetupError:
        shutdown()
        raise
    return ctx


def gather_errors(ctx: DistContext, error: str | None) -> list[tuple[int, str]]:
    """Every rank's error or None (one all-gather): the ``(rank, message)`` of each rank that failed, on every rank."""
    errors: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(errors, error)
    return [(rank, msg) for rank, msg in enumerate(errors) if msg]


def agree(ctx: DistContext, error: str | None, phase: str) -> None:
    """All ranks learn whether any rank failed ``phase``; if one did, every rank raises JobSetupError."""
    failed = gather_errors(ctx, error)
    if not failed:
        return
    messages = list(dict.fromkeys(msg for _, msg in failed))  # same problem on several ranks: say it once
    ranks = ", ".join(str(rank) for rank, _ in failed)
    if len(messages) == 1:
        raise JobSetupError(messages[0] if len(failed) == ctx.world_size else f"{messages[0]} (rank {ranks})")
    raise JobSetupError(f"{phase} failed on rank(s) {ranks}", problems=messages)


def any_rank(ctx: DistContext, local: bool) -> bool:
    """True on every rank when ``local`` is true on any rank (all_reduce MAX): a collective."""
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _attempt(fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """(result, None), or (None, the rendered JobSetupError)."""
    try:
        return fn(), None
    except JobSetupError as exc:
        return None, exc.render()


def guarded(ctx: DistContext, phase: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank, then :func:`agree`; a JobSetupError anywhere stops every rank."""
    result, error = _attempt(fn)
    agree(ctx, error, phase)
    return result  # type: ignore[return-value]


def main_first(ctx: DistContext, phase: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 first (downloads, dataset caches), then on the other ranks; agree after each."""
    result, error = _attempt(fn) if ctx.is_main else (None, None)
    agree(ctx, error, phase)
    if not ctx.is_main:
        result, error = _attempt(fn)
    agree(ctx, error, phase)
    return result  # type: ignore[return-value]


def from_main(ctx: DistContext, phase: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 alone (what only it sees: the weight files), then give its result to every rank; a
    JobSetupError there stops every rank."""
    result, error = _attempt(fn) if ctx.is_main else (None, None)
    agree(ctx, error, phase)
    box = [result]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def barrier() -> None:
    """Barrier over the default group (no-op when not distributed)."""
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group, if joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
