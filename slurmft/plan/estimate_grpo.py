"""GRPO's share of ``slurmft estimate``: the memory the rollouts take, by ``grpo.rollouts``.

The training forward, the policy's state and the reference copy (``beta > 0``) are counted by
slurmft/plan/estimate.py like any run's. What GRPO adds is the generation, and where it runs:

* ``transformers``: each rank generates its share of the generation batch (``train.per_device_batch_size x
  steps_per_generation`` completions, TRL's ``generate`` call over the rank's whole share at once) with the
  FSDP2-sharded policy: a KV cache of ``2 x layers x kv_heads x head_dim`` values per token in the compute dtype,
  ``data.max_seq_length`` tokens (prompt + completion) per completion, plus one step's logits in fp32. It never
  coexists with the training backward (generation comes first, its cache is freed), so a rank's peak is the larger
  of the two phases.
* ``colocate``: a vLLM engine in every training process holds ``grpo.vllm_gpu_memory_utilization`` of the GPU
  (TRL's default 0.3; its weights, its KV cache and its own work space) for the whole run (TRL's sleep mode is off
  by default), beside the training's peak. Its weights (the model in the compute dtype, tensor parallel 1) must
  leave room for at least one sequence of KV cache, or vLLM refuses to start.
* ``server``: the training GPUs generate nothing; the server node's GPUs each hold ``grpo.server.
  gpu_memory_utilization`` of the GPU for vLLM: the model split over ``tensor_parallel_size`` GPUs plus a KV cache
  that must hold one whole sequence; the sequences it holds at once are reported beside the generation batch. vLLM
  splits the attention heads over the tensor-parallel GPUs, so the heads must divide by it.

vLLM's memory is its own budget (a share of the device's total, as vLLM reserves it), not counted with the
training's fragmentation allowance.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from slurmft.plan.modelshape import ModelShape, numel
from slurmft.plan.settings import COMPUTE_BYTES, Settings
from slurmft.units import decimal_gb

if TYPE_CHECKING:
    from slurmft.config import RunConfig

LOGITS_BYTES = 4  # the sampling step's logits, upcast to fp32


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """Bytes of K and V for one token over every layer, on one of ``tensor_parallel`` GPUs (a KV head is never
    split: with fewer KV heads than GPUs each GPU keeps one)."""
    heads = max(1, math.ceil(shape.kv_heads / tensor_parallel))
    return 2 * shape.layers * heads * shape.head_dim * dtype_bytes


def generation_bytes(shape: ModelShape, k: Settings) -> int:
    """``rollouts: transformers``: a rank's KV cache for its whole share of the generation batch, and one step's
    logits (0 for the other rollouts and for SFT/DPO)."""
    if k.grpo_rollouts != "transformers":
        return 0
    n = k.generation_sequences
    return n * k.seq_len * kv_bytes_per_token(shape, COMPUTE_BYTES[k.precision]) + n * shape.vocab * LOGITS_BYTES


def colocated_vllm_bytes(k: Settings) -> int:
    """``rollouts: colocate``: the share of each training GPU the vLLM engine holds (0 otherwise)."""
    return int(k.vllm_share * k.capacity) if k.grpo_rollouts == "colocate" else 0


def _vllm_budget(shape: ModelShape, budget: int, dtype_bytes: int, tensor_parallel: int, seq_len: int) -> dict[str, Any]:
    """vLLM's budget on one GPU split into its weights and its KV cache, and how many whole sequences it holds."""
    weights = math.ceil(sum(numel(s) for s in shape.all_tensors()) * dtype_bytes / tensor_parallel)
    per_sequence = seq_len * kv_bytes_per_token(shape, dtype_bytes, tensor_parallel)
    kv = budget - weights
    return {"budget": budget, "weights": weights, "kv_cache": max(kv, 0), "kv_per_sequence": per_sequence,
            "sequences_in_kv": max(kv, 0) // per_sequence, "fits": kv >= per_sequence}


def grpo_facts(cfg: RunConfig, shape: ModelShape, k: Settings) -> dict[str, Any] | None:
    """The ``grpo`` entry of the estimate (None without a grpo section): the rollouts' memory, and ``problems`` when
    vLLM cannot start, each with its fix."""
    if cfg.grpo is None:
        return None
    g, c = cfg.grpo, COMPUTE_BYTES[k.precision]
    batch = cfg.train_world_size * k.generation_sequences
    out: dict[str, Any] = {"rollouts": k.grpo_rollouts, "generation_batch": batch,
                           "generation_sequences_per_rank": k.generation_sequences,
                           "generation_bytes_per_rank": generation_bytes(shape, k), "vllm_colocate": None,
                           "server": None, "problems": []}
    if k.grpo_rollouts == "colocate":
        plan = _vllm_budget(shape, colocated_vllm_bytes(k), c, 1, k.seq_len)
        out["vllm_colocate"] = {**plan, "gpu_memory_utilization": k.vllm_share}
        if not plan["fits"]:
            out["problems"].append(
                f"grpo.vllm_gpu_memory_utilization: vLLM's share of each training GPU ({k.vllm_share:g} x "
                f"{decimal_gb(k.capacity)} = {decimal_gb(plan['budget'])}) does not hold its copy of the model "
                f"({decimal_gb(plan['weights'])}) and one sequence's KV cache ({decimal_gb(plan['kv_per_sequence'])}); "
                "raise it (the training keeps the rest), or set grpo.rollouts=server (vLLM on a node of its own)")
    elif k.grpo_rollouts == "server":
        s = g.server
        tp = s.tensor_parallel(cfg.resources.gpus_per_node)
        plan = _vllm_budget(shape, int(s.gpu_memory_utilization * k.capacity), c, tp, k.seq_len)
        out["server"] = {**plan, "tensor_parallel_size": tp, "gpu_memory_utilization": s.gpu_memory_utilization,
                         "nodes": s.nodes}
        if shape.heads % tp:
            divisors = [d for d in range(1, cfg.resources.gpus_per_node + 1) if shape.heads % d == 0]
            out["problems"].append(
                f"grpo.server.tensor_parallel_size: vLLM splits the model's {shape.heads} attention heads over the "
                f"tensor-parallel GPUs, and {tp} does not divide them; set it to one of {', '.join(map(str, divisors))}")
        if not plan["fits"]:
            out["problems"].append(
                f"grpo.server: vLLM's share of each server GPU ({s.gpu_memory_utilization:g} x "
                f"{decimal_gb(k.capacity)} = {decimal_gb(plan['budget'])}) does not hold its part of the model "
                f"({decimal_gb(plan['weights'])} on each of {tp} GPUs) and one sequence's KV cache "
                f"({decimal_gb(plan['kv_per_sequence'])}); raise grpo.server.tensor_parallel_size or "
                "grpo.server.gpu_memory_utilization, or lower data.max_seq_length")
    return out


def grpo_assumption(k: Settings) -> str:
    """The estimate's line on what it counted of a GRPO run."""
    where = {
        "transformers": "the generation (transformers' generate, one call over the rank's "
                        f"{k.generation_sequences} completions) as its KV cache in the compute dtype plus one "
                        "step's fp32 logits, never at the same time as the training backward (a rank's peak is the "
                        "larger phase)",
        "colocate": f"vLLM colocated: grpo.vllm_gpu_memory_utilization ({k.vllm_share:g}) of each GPU for its "
                    "weights (tensor parallel 1) and KV cache, held beside the training's peak for the whole run",
        "server": "vLLM on the server node: its GPUs' grpo.server.gpu_memory_utilization for the model split over "
                  "tensor_parallel_size GPUs and its KV cache (at least one whole sequence); the training GPUs "
                  "generate nothing",
    }[k.grpo_rollouts]
    if k.grpo_reference:
        reference = ", the reference for the KL term (beta > 0) as one more sharded copy in the compute dtype"
    elif k.grpo_kl:
        reference = ", no reference copy: the KL term's reference is the base with the LoRA adapters disabled"
    else:
        reference = ", no reference model (beta 0)"
    # FSDP over the nodes: the reference's and the old policy's forwards are in the inter-node bytes (communication.py),
    # the rollouts' traffic is not
    rollouts = {"transformers": "the generation's all-gathers, one forward of the sharded policy per generated token",
                "colocate": "vLLM's weight sync, an all-gather of every parameter after each optimizer step",
                "server": "vLLM's weight sync, an all-gather of every parameter after each optimizer step and the "
                          "model sent to the server node"}[k.grpo_rollouts]
    traffic = (f"; inter-node bytes leave out {rollouts} (docs/grpo.md)" if k.fsdp and k.nodes > 1 and not k.hsdp
               else "")
    return ("GRPO: each rank's training forward counted as train.per_device_batch_size sequences of "
            f"data.max_seq_length ({k.seq_len}) tokens (prompt + completion: set it to your longest prompt plus "
            "grpo.max_completion_length)"
            + reference + f"; {where}" + traffic)
