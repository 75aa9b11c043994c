"""Parallelism, applied in one place: the meta-device model becomes this rank's FSDP2 shards before any weight arrives.

What accelerate does (1.15, ``fsdp2_prepare_model``): it takes a model that transformers already
built and loaded, wraps it by its auto-wrap policy and applies activation checkpointing through the
Trainer's options, after the weights exist. Why that is not enough: every rank first holds a full
model (or rank 0 does, and broadcasts it), and the wrapping, the mesh and the mixed-precision policy
are decided far from the loader that has to fill the shards (slurmft/job/loading.py says why we load
ourselves).

What we do, as torchtitan's ``parallelize`` does, in :func:`parallelize_model`:

1. :func:`build_meta`: every rank builds the model on the ``meta`` device from ``config.json``
   (parameters only: buffers such as rotary ``inv_freq`` are computed for real, since ``to_empty``
   would leave them as garbage and they are not in the checkpoint);
2. transform the model before sharding: LoRA adapters (slurmft/job/adapters.py) wrap their target
   modules on the meta model before this room sees it, so that their parameters are sharded with the
   layers they belong to (a PEFT wrapper becomes the FSDP root; the layers are found inside it);
3. :func:`shard`: activation checkpointing (preserving the RNG state, so that a recomputed layer draws the
   dropout masks its forward drew) and ``fully_shard`` per decoder layer
   (:func:`wrap_class_names`), to the embeddings and to the head (as accelerate groups them), then the
   root, on the job's one device mesh (:func:`fsdp_mesh`: 1-D, or HSDP's ``(replicate, shard)`` with
   ``fsdp.replicate_across_nodes``, laid out by :func:`mesh_layout`), with FSDP2's mixed-precision
   policy (parameters gathered in the compute dtype, gradients reduce-scattered in
   ``fsdp.reduce_dtype``);
4. :func:`materialize`: ``to_empty`` allocates only the local shards, uninitialised until
   slurmft/job/weights.py (or a checkpoint) fills them.

accelerate's ``_prepare_fsdp2`` then sees an ``FSDPModule`` and leaves the sharding alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from slurmft.config import RunConfig
from slurmft.errors import JobSetupError
from slurmft.job.distributed import DistContext, guarded
from slurmft.job.rendezvous import JobEnv

log = logging.getLogger(__name__)

HSDP_DIM_NAMES = ("replicate", "shard")


def build_meta(config: Any, cfg: RunConfig, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.model.trust_remote_code
        )
    model.tie_weights()  # not done under init_empty_weights; a no-op unless the config ties embeddings
    model.config.use_cache = False
    return model


def wrap_class_names(model: torch.nn.Module, cfg: RunConfig) -> set[str]:
    if cfg.fsdp.wrap_class:
        names = {cfg.fsdp.wrap_class}
    else:
        names = set(getattr(model, "_no_split_modules", None) or [])
    present = {type(m).__name__ for m in model.modules()}
    if not names or not names & present:
        raise JobSetupError(
            f"fsdp.wrap_class: no decoder layer class {sorted(names) or ''} found in {type(model).__name__}; "
            f"set fsdp.wrap_class to one of its layer classes (e.g. {sorted(n for n in present if 'Layer' in n)[:3]})"
        )
    return names & present


def mesh_layout(replicate_across_nodes: bool, env: JobEnv) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """(mesh shape, dim names) of the FSDP2 mesh: ``(world_size,)``, or ``(nodes, ranks per node)`` for HSDP.

    torch's ``init_device_mesh`` lays global ranks out row-major, so row ``i`` of the 2-D mesh is
    ranks ``i*S .. i*S+S-1``: node ``i`` only when every node runs the same number of ranks ``S`` and
    Slurm numbered them node by node (its default block distribution; torchrun does the same). Both
    are checked here (on every rank, from its own environment), so a layout where a "node" row would
    span two machines is refused instead of silently sending the all-gathers over the network.
    One node: HSDP with one replica is plain FSDP, so the 1-D mesh is used (a ``resources.nodes=1``
    smoke test of an HSDP config runs unchanged).
    """
    if not replicate_across_nodes or env.num_nodes == 1:
        return (env.world_size,), None
    nodes, per_node = env.num_nodes, env.local_world_size
    if nodes * per_node != env.world_size:
        raise JobSetupError(
            f"fsdp.replicate_across_nodes: the job has {env.world_size} ranks on {nodes} nodes ({per_node} on this "
            f"node), not the same number on every node, so the nodes cannot hold equal replicas; give every node "
            f"the same number of ranks (resources.tasks_per_node) or set fsdp.replicate_across_nodes=false"
        )
    if env.rank != env.node_rank * per_node + env.local_rank:
        raise JobSetupError(
            f"fsdp.replicate_across_nodes: rank {env.rank} is local rank {env.local_rank} on node {env.node_rank}, "
            f"but HSDP needs ranks numbered node by node (rank = node x {per_node} + local rank: Slurm's default "
            "block distribution); remove a cyclic --distribution / SLURM_DISTRIBUTION, or set "
            "fsdp.replicate_across_nodes=false"
        )
    return (nodes, per_node), HSDP_DIM_NAMES


def fsdp_mesh(cfg: RunConfig, ctx: DistContext) -> Any:
    """The one FSDP2 device mesh of the job (1-D, or HSDP's 2-D ``(replicate, shard)``; see :func:`mesh_layout`)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = guarded(ctx, "building the device mesh",
                           lambda: mesh_layout(cfg.fsdp.replicate_across_nodes, ctx.env))
    if names is None:
        if cfg.fsdp.replicate_across_nodes and ctx.is_main:
            log.info("fsdp.replicate_across_nodes on 1 node: one replica, i.e. plain FSDP over %d ranks", ctx.world_size)
        return init_device_mesh(ctx.device.type, shape)
    if ctx.is_main:
        log.info("HSDP: parameters sharded over the %d ranks of each node, replicated on %d nodes (mesh %s %s)",
                 shape[1], shape[0], shape, names)
    return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)


def parallelize_model(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext, wrap: set[str],
                      compute: torch.dtype | None, reduce: torch.dtype, frozen: bool = False) -> None:
    """The meta model (adapters already added) becomes this rank's FSDP2 shards, in place: shard, materialize.

    ``wrap``: the decoder layer classes (:func:`wrap_class_names`); ``compute``: the dtype parameters
    are gathered in (None: as stored); ``reduce``: the gradient reduce dtype; ``frozen``: see :func:`shard`.
    """
    shard(model, cfg, ctx, wrap, compute, reduce, frozen)
    materialize(model, ctx, cfg.fsdp.cpu_offload)


def shard(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext, wrap: set[str], compute: torch.dtype | None,
          reduce: torch.dtype, frozen: bool = False) -> None:
    """Activation checkpointing, then FSDP2 units: each decoder layer, embeddings, head, root.

    ``compute``: the dtype parameters are gathered in (None: as stored); ``reduce``: the gradient reduce dtype.
    ``frozen``: a model that only runs forwards without gradients (DPO's reference): no backward follows, so
    nothing is checkpointed and every unit, the head included, reshards right after its forward (kept gathered,
    the head and final norm would stay whole on every rank between steps).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from slurmft.job.adapters import unwrap

    root, model = model, unwrap(model)  # a PEFT wrapper is the root; layers, embeddings and head are inside
    mesh = fsdp_mesh(cfg, ctx)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": cfg.fsdp.reshard_after_forward or frozen,
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce),
        "offload_policy": CPUOffloadPolicy() if cfg.fsdp.cpu_offload else OffloadPolicy(),
    }
    layer_names = [n for n, m in model.named_modules() if type(m).__name__ in wrap]
    for name in layer_names:
        layer = model.get_submodule(name)
        if cfg.fsdp.activation_checkpointing and not frozen:
            # the recompute replays the forward's RNG state: the same dropout masks (LoRA's, the model's own) in
            # backward as in forward, so the gradients are those of the loss (measured cost: docs/lora.md)
            layer = checkpoint_wrapper(layer, preserve_rng_state=True)
            model.set_submodule(name, layer)
        fully_shard(layer, **kwargs)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = embed is not None and head is not None and embed.weight is head.weight
    base = getattr(model, model.base_model_prefix, model)
    norm = next((m for _, m in base.named_children() if "Norm" in type(m).__name__), None)  # the final norm
    if embed is not None and not tied:
        fully_shard(embed, **kwargs)
    tail = [m for m in ((norm, embed, head) if tied else (norm, head)) if m is not None]
    if tail:  # used at the end of forward / start of backward: keep gathered in between
        fully_shard(tail, **{**kwargs, "reshard_after_forward": frozen})
    fully_shard(root, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})


@torch.no_grad()
def materialize(model: torch.nn.Module, ctx: DistContext, offload: bool) -> None:
    """Allocate the local shards; put back the buffers computed at construction."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if offload else ctx.device)
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        persistent = attr not in module._non_persistent_buffers_set
        module.register_buffer(attr, value.to(ctx.device), persistent=persistent)
