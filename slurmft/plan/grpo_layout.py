"""``grpo.rollouts: server``: the train job's allocation split into training nodes and a vLLM server node.

TRL's server mode runs ``trl vllm-serve`` on GPUs of its own and the trainer asks it for completions over HTTP and
pushes the trained weights to it over NCCL (``vllm_mode="server"``). TRL's own Slurm recipe writes the split by
hand, and expands the rank variables in the batch shell, so every node starts with the same rank; verl and
OpenRLHF start Ray inside the job for it. Here the split is decided in Python and the template only places it:
the first ``resources.nodes - grpo.server.nodes`` nodes train (one ``srun`` step, ``--relative=0``: every rank reads
its rank and the step's world size inside its own task, from Slurm, as in every train job), the last node serves
(a second step, ``--relative=<its index>``), and the server's address and ports come from the allocation in the
batch shell (``python -m slurmft.job.rendezvous exports --vllm-server-node=N``), like MASTER_ADDR.

Pure: reads the config, returns unquoted ``srun`` options and the server's arguments; slurmft/plan/render.py
quotes and wraps them (in the run's image too).
"""

from __future__ import annotations

from dataclasses import dataclass

from slurmft.config import RunConfig
from slurmft.config_grpo import Rollouts
from slurmft.grpoopts import VLLM_SYNC_TIMEOUT_ENV, VLLM_TIMEOUT_ENV
from slurmft.precision import resolve as resolve_precision


@dataclass(frozen=True)
class ServerLayout:
    """Which nodes of the allocation train and which one serves, and the server's shape."""

    train_nodes: int  # nodes 0 .. train_nodes-1 train
    server_node: int  # the index of the server's node in the allocation (its last)
    ranks_per_node: int
    cpus_per_node: int  # the server task takes the node's CPUs (ranks_per_node x cpus_per_task)
    tensor_parallel_size: int
    dtype: str  # the training's compute dtype: the weights the trainer pushes are in it

    @property
    def train_world_size(self) -> int:
        """Training ranks: the training nodes' GPUs; the server node's GPUs are vLLM's."""
        return self.train_nodes * self.ranks_per_node

    def train_options(self) -> list[str]:
        """``srun`` options that keep the train step on the first ``train_nodes`` nodes."""
        return [f"--nodes={self.train_nodes}", f"--ntasks={self.train_world_size}", "--relative=0"]

    def server_options(self, gpus: bool) -> list[str]:
        """``srun`` options of the server step: one task on the last node with its CPUs (and all its GPUs). No
        ``--label``: it would number the server's lines ``0:``, as training rank 0's, and ``slurmft logs --rank 0``
        would mix them; unlabelled, they show in the whole log only."""
        options = ["--unbuffered", "--nodes=1", "--ntasks=1", f"--relative={self.server_node}",
                   f"--cpus-per-task={self.cpus_per_node}"]
        return [*options, "--gpu-bind=none"] if gpus else options


def server_layout(cfg: RunConfig) -> ServerLayout | None:
    """The split of a ``rollouts: server`` run (None for every other run)."""
    if cfg.grpo is None or cfg.grpo.rollouts != Rollouts.SERVER:
        return None
    res = cfg.resources
    return ServerLayout(
        train_nodes=cfg.train_nodes,
        server_node=cfg.train_nodes,
        ranks_per_node=res.ranks_per_node,
        cpus_per_node=res.ranks_per_node * res.cpus_per_task,
        tensor_parallel_size=cfg.grpo.server.tensor_parallel(res.gpus_per_node),
        dtype=resolve_precision(cfg.train.precision, res.gpus_per_node > 0).compute_dtype,
    )


def server_arguments(cfg: RunConfig, layout: ServerLayout) -> list[str]:
    """TRL's ``vllm-serve`` arguments for the run's model (the port comes from the allocation: slurmft/job/vllm_server.py
    adds it)."""
    assert cfg.grpo is not None
    args = ["--model", cfg.model.name_or_path]
    if cfg.model.revision:
        args += ["--revision", cfg.model.revision]
    return [*args, "--tensor_parallel_size", str(layout.tensor_parallel_size), "--gpu_memory_utilization",
            f"{cfg.grpo.server.gpu_memory_utilization:g}", "--dtype", layout.dtype,
            "--max_model_len", str(cfg.data.max_seq_length)]


def server_env(cfg: RunConfig) -> dict[str, str]:
    """The train step's time-outs for the server: TRL's wait for it, and slurmft's limit on one weight sync."""
    assert cfg.grpo is not None
    server = cfg.grpo.server
    return {VLLM_TIMEOUT_ENV: str(server.timeout_s), VLLM_SYNC_TIMEOUT_ENV: str(server.sync_timeout_s)}
