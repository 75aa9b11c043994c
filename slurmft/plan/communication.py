"""What the ranks send each other, and how long a save takes: ``slurmft estimate``'s arithmetic of FSDP2's
collectives and of the checkpoint's write.

Integers (and seconds) from the model's shapes (``slurmft/plan/modelshape.py``) and the run's settings
(``slurmft/plan/settings.py``), no torch. The memory arithmetic (``slurmft/plan/estimate.py``) counts the largest
reduce-scatter unit in a GPU's memory and puts the inter-node bytes beside each layout; ``docs/estimate.md``
writes the formulas out.

Assumptions:

* FSDP2's reduce-scatter input buffer: while a unit's gradients are reduced, FSDP2 copies them
  (unsharded, each tensor padded on dim 0 to a multiple of ``world_size``) into one flat buffer in
  ``fsdp.reduce_dtype``. The units are the ones slurmft wraps: each decoder layer, the input embeddings
  (untied), the final norm with the LM head (with the embeddings when tied); with LoRA only the adapters
  (and the ``modules_to_save`` copies) have gradients.
* Gradient accumulation: the job reduce-scatters after every micro-batch (accelerate's ``sync_each_batch``,
  slurmft/job/train.py), one reduction per micro-batch instead of per optimizer step.
* Inter-node bytes: NCCL's ring algorithms, each ring entering and leaving every node once; FSDP over all
  ranks all-gathers and reduce-scatters across nodes, HSDP only all-reduces the gradients across them; one
  node, or no FSDP, sends nothing across (DDP across nodes is not modelled).
* Save time: every node writes its ranks' shards in parallel at the profile's ``checkpoint_write_gb_per_s``, all of
  them together at most at ``checkpoint_write_gb_per_s_total`` (the filesystem's aggregate) when the profile sets it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from slurmft.plan.modelshape import shard_numel
from slurmft.plan.settings import COMPUTE_BYTES

if TYPE_CHECKING:  # annotations only
    from slurmft.plan.modelshape import LoraTensors, ModelShape
    from slurmft.plan.settings import Settings


def lora_reduce_scatter_units(adapters: LoraTensors, world_size: int) -> dict[str, int]:
    """Elements of FSDP2's reduce-scatter input with LoRA: only trainable parameters have gradients."""

    def padded(tensors: Any) -> int:
        return sum(world_size * shard_numel(t, world_size) for t in tensors)

    units = {"decoder_layer": max((padded(layer) for layer in adapters.layers), default=0)}
    if adapters.root:
        units["modules_to_save"] = padded(adapters.root)
    return units


def reduce_scatter_units(shape: ModelShape, world_size: int) -> dict[str, int]:
    """Elements of FSDP2's reduce-scatter input for each kind of unit slurmft wraps (parallelize.shard).

    Units: each decoder layer; the input embeddings (untied); the final norm with the LM head (with
    the embeddings when tied). FSDP2 pads every tensor's dim 0 to a multiple of ``world_size`` in the
    flat buffer (``foreach_reduce``), so the padded sizes are counted.
    """

    def padded(tensors: list[tuple[int, ...]]) -> int:
        return sum(world_size * shard_numel(t, world_size) for t in tensors)

    embed, norm = (shape.vocab, shape.hidden), (shape.hidden,)
    units = {"decoder_layer": padded(shape.layer_tensors())}
    if shape.tied:
        units["norm_and_tied_embeddings"] = padded([norm, embed])
    else:
        units["embeddings"] = padded([embed])
        units["norm_and_lm_head"] = padded([norm, embed])
    return units


def gradient_reductions_per_step(accumulation: int) -> int:
    """How often per optimizer step the gradients are reduced (reduce-scatter, plus HSDP's all-reduce).

    Every micro-batch: the job sets accelerate's ``sync_each_batch`` so gradients stay sharded between
    micro-batches (no full unsharded gradients held under ``no_sync``), at the price of one reduction per
    micro-batch. (Deferring only HSDP's cross-node all-reduce to the last micro-batch is not done yet.)
    """
    return accumulation


def inter_node_bytes(n_params: int, k: Settings, trained: int | None = None) -> int:
    """Bytes each node sends over the inter-node network per optimizer step, for the layout in ``k``.

    NCCL's ring algorithms, each ring entering and leaving every node once:

    * FSDP over all ``W = nodes x ranks_per_node`` ranks: an all-gather or reduce-scatter of ``S``
      bytes moves ``(W-1)/W x S`` over each node's outgoing inter-node link. Every micro-batch
      all-gathers the parameters in the compute dtype (twice with ``fsdp.reshard_after_forward``:
      forward and backward); each gradient reduction reduce-scatters them in ``fsdp.reduce_dtype``.
    * HSDP: all-gathers and reduce-scatters stay inside the node; each gradient reduction all-reduces
      every shard across the ``N`` nodes (one ring per local rank over N ranks): ``2(N-1)/N x S`` per node.
    * One node, or no FSDP inside one node: nothing crosses (DDP across nodes is not modelled).

    ``trained``: the parameters that have gradients (LoRA: the adapters; None: all ``n_params``). The base is
    still all-gathered; only trainable gradients are reduced. A reference forward (DPO's, unless
    ``dpo.reference: precomputed``; GRPO's with ``beta > 0``) gathers once more per micro-batch (a full fine-tune's
    reference copy has exactly the policy's parameters; LoRA's is the policy with the adapters disabled), and so does
    GRPO's old-policy forward where TRL makes one (:attr:`Settings.extra_forwards`).
    """
    if k.nodes == 1 or not k.fsdp:
        return 0
    compute, reduce = COMPUTE_BYTES[k.precision], k.reduce_bytes
    reductions = gradient_reductions_per_step(k.accumulation)
    grads = n_params if trained is None else trained
    if k.hsdp:
        return math.ceil(reductions * 2 * (k.nodes - 1) / k.nodes * grads * reduce)
    gathers = k.accumulation * ((2 if k.reshard_after_forward else 1) + k.extra_forwards)
    w = k.world_size
    gathered = n_params if trained is None else n_params + trained  # the adapters are gathered with the base
    return math.ceil((w - 1) / w * (gathered * gathers * compute + grads * reductions * reduce))


def checkpoint_write(nodes: int, gb_per_s_per_node: float, gb_per_s_total: float | None) -> dict[str, Any]:
    """How fast a sharded save writes (GB/s, 10^9 bytes): every node in parallel, capped by the filesystem's
    aggregate when known; with the facts it came from, for the words that explain the projected save."""
    parallel = nodes * gb_per_s_per_node
    return {"nodes": nodes, "per_node": gb_per_s_per_node, "total": gb_per_s_total,
            "gb_per_s": parallel if gb_per_s_total is None else min(parallel, gb_per_s_total)}


def projected_save(checkpoint_bytes: int, write: dict[str, Any]) -> float:
    """Seconds to write one sharded checkpoint at ``write`` (:func:`checkpoint_write`)."""
    return checkpoint_bytes / (write["gb_per_s"] * 1e9)
