"""`slurmft estimate`: will this run fit? GPU memory per rank and CPU RAM per node, before submitting.

Everything here is arithmetic on the model's ``config.json`` and the run config, in integers: the
login node never imports torch. This module holds the memory per GPU and CPU RAM per node and assembles
the result; the model's tensors and the LoRA adapters are counted in ``slurmft/plan/modelshape.py``, the
collectives (reduce-scatter units, bytes over the inter-node link) and the save time in
``slurmft/plan/communication.py``, each with its own assumptions. What a user reads (the fixes to try, the
assumptions, the verdict and the rich table) is ``slurmft/plan/estimate_text.py``, which :func:`estimate`
calls with the numbers it counted. The formulas and their assumptions are written out in
``docs/estimate.md``; the same assumptions travel in every result under ``assumptions`` so a reader of the
JSON knows what was counted.

Assumptions of the memory arithmetic (each is repeated where it is used):

* MoE activations: each token through ``num_experts_per_tok`` experts (balanced routing assumed).
* Training state per parameter, by ``train.precision`` (slurmft/precision.py): fp32 + AdamW = 4
  weights + 4 gradients + 8 optimizer (exp_avg, exp_avg_sq) = 16 bytes. bf16/fp16 mixed precision is
  split the way FSDP2 holds it (measured in tests/test_estimate.py): sharded parameters and gradients
  stay fp32 (4 + 4; cast to bf16 only while gathered), AdamW's two fp32 states 8 — the course notes'
  2 + 2 + 12 is the same 16 bytes, split differently. ``bf16-true`` = 2 + 2 + 4 = 8 bytes (bf16
  parameters, gradients and both AdamW states).
* FSDP2's reduce-scatter input buffer (its units: slurmft/plan/communication.py), in
  ``fsdp.reduce_dtype``: the largest wrapped unit (a decoder layer for real models) is counted.
* Gradient accumulation adds no memory: the job reduce-scatters after every micro-batch
  (accelerate's ``sync_each_batch``, slurmft/job/train.py), so only the sharded gradients persist
  between micro-batches. (The Trainer's default ``no_sync`` would keep a full, unsharded gradient of
  every parameter on every rank until the last micro-batch.) The price, one reduce-scatter per
  micro-batch instead of per optimizer step, is counted in slurmft/plan/communication.py.
* FSDP full shard: each tensor is split along dim 0 into ``world_size`` chunks of ``ceil(d0 / ws)``
  rows (FSDP2's padding: slurmft/plan/modelshape.py), so the largest rank is reported.
  ``fsdp.enabled=false`` means every GPU holds everything (DDP-like), plus DDP's gradient buckets (one
  more copy of the gradients).
* Gathered (unsharded) working set under FSDP2: two decoder layers' parameters (current + prefetched),
  one layer's unsharded gradients, the root module's parameters (embeddings, final norm, LM head; FSDP2
  does not reshard the root after forward) and the LM head's gradient, all in the compute dtype.
* Activations per decoder layer and token (compute dtype ``c`` bytes; HF's RMSNorm upcasts to fp32):
  two norms of ``(4 + 2c)·h``, q/k/v ``c·(q + 2·kv)``, attention output and o_proj input ``2c·q``,
  SwiGLU ``4c·I``; flash-attention/SDPA add the log-sum-exp ``4·heads``; eager attention keeps
  K/V repeated to all heads and adds the ``heads·s`` probability matrix (fp32 softmax + a copy in
  ``c``). With activation checkpointing only each layer's input ``c·h`` is kept, plus one layer
  recomputed during backward. Plus the final norm and the logits: ``(c + 8)·V`` per token (logits,
  the fp32 upcast kept for the loss, the fp32 logits gradient).
* Allowance: 1 GiB per GPU for the CUDA context, cuBLAS workspaces and NCCL buffers, plus 5 % of
  everything allocated for caching-allocator fragmentation.
* GPU capacity: the profile's ``gpu.memory_gb`` (10^9 bytes); for GPUs sold by a nominal size that is
  really GiB (A100-80GB = 81,920 MiB) the device's real total is used when the profile states the
  nominal number.
* CPU RAM at load (node 0, the worst node): every rank loads = each rank materialises the model in
  fp32 (``from_pretrained``'s default and the master-weight dtype: the seed article's ~2 TB for 70B on
  8 ranks); rank 0 loads and broadcasts = one fp32 copy on rank 0; slurmft = the worst case of its
  loader, the scatter fallback: the safetensors files memory-mapped on rank 0 (page cache counts
  against a job's cgroup) plus one tensor at a time, the other ranks holding only their shard. By
  default every rank reads only its own slice, so node 0 maps only its ranks' share: less than this. Each rank adds a runtime allowance (Python, torch,
  CUDA libraries: 2 GiB per GPU rank, 0.5 GiB per CPU rank).
* DPO (a ``dpo:`` section): chosen and rejected go through the model in one forward, so the activations are
  those of twice the micro-batch; with full fine-tuning the reference is one more copy of the model in the
  compute dtype, sharded like the policy (counted in ``weights``, also as ``reference_weights``), two of its
  layers gathered at a time; with LoRA, or ``dpo.reference: precomputed``, there is no copy. The copy is loaded
  after the policy, the same way (slurmft/job/dpo.py), so its load's transient CPU RAM (the mapped files, one
  tensor) is the policy's again, not added; where shards live in CPU RAM (CPU ranks, ``fsdp.cpu_offload``) the
  copy's shards are held beside the policy's while it loads (``reference_shards``).
* Checkpoint (sharded DCP): fp32 parameters + two AdamW states = 12 bytes/parameter. Consolidated
  model: parameters × ``consolidate.dtype``.
* Asynchronous saves (``checkpoint.async``, the default): each rank keeps a CPU copy of its share of the
  checkpoint (its model and optimizer shards, pinned on GPU nodes) from the first periodic save to the end of
  the job (slurmft/job/checkpointing/writing.py ``BackgroundWriter``): node 0 holds its ranks' shares, counted in the
  training figure as ``async_staging``. ``checkpoint.async: false`` has no copy; each periodic save then
  holds training for the whole write (``checkpoint_save_s``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from slurmft.epochs import steps_per_epoch
from slurmft.errors import ConfigError
from slurmft.methods import epoch_rows
from slurmft.modelinfo import locate_model_config, read_model_config, seq_length_problem
from slurmft.plan.communication import (
    checkpoint_write,
    gradient_reductions_per_step,
    inter_node_bytes,
    lora_reduce_scatter_units,
    projected_save,
    reduce_scatter_units,
)
from slurmft.plan.estimate_grpo import colocated_vllm_bytes, generation_bytes, grpo_facts
from slurmft.plan.estimate_text import Counted, assumptions, fit_problems, hsdp_advice, remedies, verdict
from slurmft.plan.modelshape import (
    SUPPORTED_MODEL_TYPES,
    ModelShape,
    lora_count,
    model_shape,
    numel,
    shard_numel,
)
from slurmft.plan.paramcount import FAMILY_WORDS, local_header_shapes
from slurmft.plan.settings import COMPUTE_BYTES, RUNTIME_BYTES_CPU_RANK, LoraSettings, Settings
from slurmft.precision import DTYPE_BYTES as PRECISION_DTYPE_BYTES
from slurmft.precision import PRECISIONS, consolidated_dtype
from slurmft.precision import reduce_dtype as resolve_reduce_dtype
from slurmft.precision import resolve as resolve_mode
from slurmft.prepared import counted as prepared_counts
from slurmft.profiles import on_this_machine, runs_on_gpu
from slurmft.units import GB, GiB, MiB, decimal_gb

if TYPE_CHECKING:  # the login side needs none of these at run time
    from slurmft.config import RunConfig
    from slurmft.profiles import ClusterProfile

#: Training-state bytes per parameter (the course-notes sizing rule), by precision.
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "fp32": {"weights": 4, "gradients": 4, "optimizer": 8},
    # FSDP2 mixed precision: fp32 sharded parameters and gradients, bf16/fp16 only while gathered.
    "bf16-mixed": {"weights": 4, "gradients": 4, "optimizer": 8},
    "fp16-mixed": {"weights": 4, "gradients": 4, "optimizer": 8},
    "bf16-true": PRECISIONS["bf16-true"].state_bytes(),
}
MASTER_BYTES = 4  # fp32: what from_pretrained materialises by default (the every-rank / rank-0 strategies)
CUDA_CONTEXT_BYTES = 1 * GiB
FRAGMENTATION = 0.05
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
}

#: GPUs whose marketing "GB" is really GiB-sized: normalised type -> (nominal GB, nvidia-smi total MiB).
KNOWN_GPUS: dict[str, tuple[float, int]] = {
    "A10040GB": (40, 40960),
    "A10080GB": (80, 81920),
    "H10080GB": (80, 81559),
    "H200141GB": (141, 143771),
}

# ====================================================================== the memory per GPU and per node
def training_state_bytes(n_params: int, precision: str = "fp32") -> dict[str, int]:
    """Weights, gradients and AdamW optimizer bytes for ``n_params`` unsharded parameters.

    The course-notes rule: 16 bytes/parameter before activations in fp32 (4 + 4 + 8) and in bf16 mixed
    precision, where FSDP2 keeps the fp32 sharded parameters and gradients (4 + 4) and AdamW its two
    fp32 states (8); the compute-dtype copies exist only while gathered (``comm_buffers``).
    """
    per = BYTES_PER_PARAM[precision]
    return {k: n_params * v for k, v in per.items()}


def activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    compute_bytes: int,
    checkpointing: bool,
    eager: bool,
) -> dict[str, int]:
    """Activation memory of one rank for one micro-batch, peak during backward (see docs/estimate.md)."""
    c = compute_bytes
    tokens = seq_len * micro_batch
    h, q, kv, inter = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    norm = (4 + 2 * c) * h  # fp32 upcast input + normalised copy in c + output (the next matmul's input)
    attn_kv = q if eager else kv  # eager repeats K/V to all heads before the matmuls
    attn = norm + c * (q + 2 * attn_kv) + 2 * c * q
    if shape.qk_norm:
        attn += (4 + c) * (q + kv)
    if eager:
        attn += shape.heads * seq_len * (4 + (c if c < 4 else 0))  # fp32 softmax + a copy in c
    else:
        attn += 4 * shape.heads  # flash/SDPA keep only the log-sum-exp
    if shape.experts:  # router logits (fp32) per token, then each of the k chosen experts' SwiGLU (+ shared)
        width = shape.expert_intermediate or inter
        mlp = (norm + 4 * shape.experts + shape.experts_per_token * (4 * c * width + c * h)
               + 4 * c * shape.shared_intermediate)
    else:
        mlp = norm + 4 * c * inter
    layer_full = tokens * (attn + mlp)
    layer_input = tokens * c * h
    mask = micro_batch * seq_len * seq_len * c if eager else 0
    # Final norm + the fp32 log-softmax kept for the loss (saved), and at the loss the logits in c plus
    # the fp32 upcast, or in backward the fp32 logits gradient plus its cast to c (transient).
    head_saved = tokens * ((4 + 2 * c) * h + 4 * shape.vocab)
    head_transient = tokens * (c + 4) * shape.vocab
    head = head_saved + head_transient
    # checkpointing: every layer's input kept + one layer recomputed at a time in backward
    layers = shape.layers * layer_input + layer_full if checkpointing else shape.layers * layer_full
    return {
        "per_layer_full": layer_full,
        "per_layer_checkpointed": layer_input,
        "decoder_layers": layers,
        "logits_and_loss": head,
        "logits_saved": head_saved,
        "attention_mask": mask,
        "total": layers + head + mask,
    }


def _per_gpu(shape: ModelShape, k: Settings) -> dict[str, Any]:
    """Memory of the largest rank (a GPU, or a CPU rank's share of RAM) for the given settings."""
    per = BYTES_PER_PARAM[k.precision]
    c = COMPUTE_BYTES[k.precision]
    tensors = shape.all_tensors()
    ws = k.shards
    local = sum(shard_numel(s, ws) for s in tensors)
    local_base = local
    if k.lora is None:
        state = {name: local * b for name, b in per.items()}
        units = reduce_scatter_units(shape, ws) if k.fsdp else {}
        weight_bytes = local * PRECISIONS[k.precision].param_bytes
    else:  # a frozen base in the compute dtype, no gradient or optimizer state; fp32 adapters with AdamW
        adapters = lora_count(shape, k.lora)
        trained = sum(shard_numel(s, ws) for s in adapters.all_tensors())
        state = {name: trained * b for name, b in LORA_BYTES_PER_PARAM.items()}
        state["weights"] += local * c
        units = lora_reduce_scatter_units(adapters, ws) if k.fsdp else {}
        local += trained
        weight_bytes = state["weights"]
    reduce_scatter = k.reduce_bytes * max(units.values()) if units else 0
    if k.fsdp and k.lora is None:
        layer = sum(numel(s) for s in shape.layer_tensors())
        root = sum(numel(s) for s in shape.root_tensors())
        comm = c * (3 * layer + root + shape.vocab * shape.hidden)
    elif k.fsdp:  # 2 layers gathered (base + adapters), the root, the adapters' unsharded gradients
        base_layers = [sum(numel(s) for s in t) for t in shape.layer_list]
        adapter_layers = [sum(numel(s) for s in t) for t in adapters.layers]
        layer = max(b + a for b, a in zip(base_layers, adapter_layers, strict=True))
        root = sum(numel(s) for s in shape.root_tensors()) + sum(numel(s) for s in adapters.root)
        comm = c * (2 * layer + root + max(adapter_layers) + sum(numel(s) for s in adapters.root))
    else:  # DDP's gradient buckets: one more copy of the gradients
        comm = state["gradients"]
    reference = 0
    if k.reference_copy:  # DPO's or GRPO's reference: the base once more, sharded, in the compute dtype; two layers
        reference = local_base * c
        state["weights"] += reference
        comm += c * 2 * max((sum(numel(s) for s in t) for t in shape.layer_list), default=0)
    if k.cpu_offload and k.fsdp:
        offloaded = sum(state.values())
        state = dict.fromkeys(state, 0)
    else:
        offloaded = 0
    act = activation_bytes(shape, k.seq_len, k.sequences, c, k.checkpointing, k.eager)
    generation, vllm = generation_bytes(shape, k), colocated_vllm_bytes(k)  # GRPO's rollouts (estimate_grpo.py)
    allocated = sum(state.values()) + comm + max(reduce_scatter + act["total"], generation)  # one phase at a time
    if k.on_gpu:
        overhead = CUDA_CONTEXT_BYTES + int(FRAGMENTATION * allocated)
    else:
        overhead = RUNTIME_BYTES_CPU_RANK + int(FRAGMENTATION * allocated)
    total = allocated + overhead + vllm  # vLLM's share is its own budget
    return {
        "weights": state["weights"],
        "gradients": state["gradients"],
        "optimizer": state["optimizer"],
        "comm_buffers": comm,
        "reduce_scatter": reduce_scatter,
        "activations": act["total"],
        "generation": generation,  # GRPO, transformers' generate: the larger of it and the backward counts
        "vllm_colocate": vllm,
        "overhead": overhead,
        "total": total,
        "capacity": k.capacity,
        "fits": total <= k.capacity,
        "headroom": k.capacity - total,
        "offloaded_to_cpu": offloaded,
        "sharded_state_elements": local,
        "sharded_weight_bytes": weight_bytes,
        "reference_weights": reference,  # included in weights
        "reduce_scatter_units": {name: n * k.reduce_bytes for name, n in units.items()},
        "_activations_detail": act,
    }


#: Training-state bytes per trainable LoRA parameter, whatever the precision: the job keeps adapters (and
#: ``modules_to_save`` copies) in fp32 with fp32 AdamW states (slurmft/job/adapters.py).
LORA_BYTES_PER_PARAM = {"weights": 4, "gradients": 4, "optimizer": 8}
LORA_CHECKPOINT_BYTES = 12  # fp32 parameter + two fp32 AdamW states per trainable parameter


def layouts(shape: ModelShape, n_params: int, k: Settings) -> dict[str, dict[str, Any]]:
    """Both FSDP layouts of the same run side by side: memory per GPU and bytes over the inter-node link."""
    out = {}
    trained = lora_count(shape, k.lora).count.trainable if k.lora is not None else None
    for name, hsdp in (("fsdp", False), ("hsdp", True)):
        alt = replace(k, hsdp=hsdp)
        plan = _per_gpu(shape, alt)
        out[name] = {"shards": alt.shards, "replicas": k.nodes if hsdp else 1, "per_gpu_total": plan["total"],
                     "fits": plan["fits"], "inter_node_bytes_per_step": inter_node_bytes(n_params, alt, trained)}
    return out


def _largest_tensor_numel(shape: ModelShape) -> int:
    return max(numel(s) for s in shape.layer_tensors() + shape.root_tensors())


def _total_if_fits(shape: ModelShape, k: Settings) -> int | None:
    """The per-GPU total for settings ``k`` when it fits, else None (what the fixes ask)."""
    plan = _per_gpu(shape, k)
    return plan["total"] if plan["fits"] else None


def _activations(shape: ModelShape, k: Settings, detail: dict[str, int]) -> dict[str, int]:
    """This run's activation terms plus the totals with checkpointing flipped and with each attention kind."""
    c = COMPUTE_BYTES[k.precision]
    other = activation_bytes(shape, k.seq_len, k.sequences, c, not k.checkpointing, k.eager)["total"]
    flash = activation_bytes(shape, k.seq_len, k.sequences, c, k.checkpointing, False)["total"]
    eager = activation_bytes(shape, k.seq_len, k.sequences, c, k.checkpointing, True)["total"]
    return {
        **detail,
        "with_checkpointing": detail["total"] if k.checkpointing else other,
        "without_checkpointing": other if k.checkpointing else detail["total"],
        "flash_or_sdpa": flash,
        "eager": eager,
    }


def async_staging_bytes(checkpoint_bytes: int, k: Settings) -> int:
    """CPU RAM of node 0 for the asynchronous saves' staging copy: every rank's share of the checkpoint (its shards
    of the model and optimizer state, split over ``k.shards`` ranks), 0 for synchronous saves."""
    return k.ranks_per_node * math.ceil(checkpoint_bytes / k.shards) if k.async_saves else 0


def _cpu_ram_per_node(
    shape: ModelShape, n_params: int, k: Settings, gpu: dict[str, Any], node_ram: int, staging: int = 0
) -> dict[str, Any]:
    """CPU RAM of node 0 (it hosts rank 0) at load, for each loading strategy, and while training (``staging``:
    :func:`async_staging_bytes`, held from the first periodic save on)."""
    rpn = k.ranks_per_node
    runtime = rpn * k.runtime_bytes_per_rank
    full_fp32 = n_params * MASTER_BYTES
    file_bytes = n_params * DTYPE_BYTES.get(str(shape.file_dtype).lower(), 2)
    # Shards that live in RAM (CPU ranks, or FSDP CPU offload): every rank of the node holds one.
    if not k.on_gpu:
        resident = rpn * (gpu["total"] - gpu["overhead"])
    elif k.cpu_offload:
        resident = rpn * gpu["offloaded_to_cpu"]
    else:
        resident = 0
    param_bytes = PRECISIONS[k.precision].param_bytes
    shard_bytes = gpu["sharded_weight_bytes"]
    in_ram = not k.on_gpu or k.cpu_offload
    # DPO's reference copy loads after the policy: the policy's shards stay while the copy's are filled
    reference_shards = rpn * gpu["reference_weights"] if in_ram else 0
    load_resident = rpn * shard_bytes + reference_shards if in_ram else 0
    ours = file_bytes + _largest_tensor_numel(shape) * param_bytes + runtime + load_resident
    training = runtime + resident + staging
    return {
        "every_rank_loads": rpn * full_fp32 + runtime + load_resident,
        "rank0_broadcast": full_fp32 + runtime + load_resident,
        "slurmft": ours,
        "training": training,
        "capacity": node_ram,
        "fits": max(ours, training) <= node_ram,
        "runtime_allowance": runtime,
        "async_staging": staging,  # included in the training figure
        "safetensors_bytes": file_bytes,
        "reference_shards": reference_shards,  # included in slurmft's load figure
    }


# ====================================================================== the run's settings
def resolve_precision(cfg: RunConfig, on_gpu: bool) -> str:
    """``train.precision`` (reconciled with ``model.dtype`` by the config) resolved: auto = bf16-mixed on
    GPUs, fp32 on CPU."""
    return resolve_mode(cfg.train.precision, on_gpu).name


def gpu_capacity_bytes(profile: ClusterProfile) -> tuple[int, str | None]:
    """Bytes of one GPU, and a note when the nominal size was replaced by the device's real total."""
    stated = int(profile.gpu.memory_gb * GB)
    key = re.sub(r"[^A-Z0-9]", "", profile.gpu.type.upper())
    known = KNOWN_GPUS.get(key)
    if known and abs(profile.gpu.memory_gb - known[0]) < 0.5:
        real = known[1] * MiB
        if real > stated:
            return real, (
                f"{profile.gpu.type}: the profile states {profile.gpu.memory_gb:g} GB, the nominal size; "
                f"the device reports {known[1]:,} MiB = {real / GB:.1f} GB, which is used as capacity"
            )
    return stated, None


def _knobs(cfg: RunConfig, profile: ClusterProfile) -> tuple[Settings, str | None]:
    """The settings the arithmetic reads, and the capacity note (a GPU's real size replaced its nominal one)."""
    on_gpu = runs_on_gpu(cfg, profile)
    precision = resolve_precision(cfg, on_gpu)
    rpn = cfg.resources.ranks_per_node
    if on_gpu:
        capacity, capacity_note = gpu_capacity_bytes(profile)
    else:
        capacity, capacity_note = int(profile.node_memory_gb * GB) // rpn, None
    grpo = cfg.grpo
    knobs = Settings(
        nodes=cfg.train_nodes,  # a GRPO server's node does not train
        ranks_per_node=rpn,
        fsdp=cfg.fsdp.enabled,
        cpu_offload=cfg.fsdp.cpu_offload,
        checkpointing=cfg.fsdp.activation_checkpointing,
        eager=cfg.model.attn_implementation == "eager",
        seq_len=cfg.data.max_seq_length,
        micro_batch=cfg.train.per_device_batch_size,
        precision=precision,
        on_gpu=on_gpu,
        capacity=capacity,
        reduce_dtype=resolve_reduce_dtype(PRECISIONS[precision], cfg.fsdp.reduce_dtype),
        reduce_configured=cfg.fsdp.reduce_dtype,
        hsdp=cfg.fsdp.replicate_across_nodes,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
        accumulation=cfg.train.gradient_accumulation_steps,
        lora=LoraSettings.of(cfg.lora),
        dpo=cfg.dpo is not None,
        dpo_precomputed=cfg.dpo is not None and cfg.dpo.precomputed,
        grpo=cfg.grpo is not None,
        grpo_kl=cfg.grpo is not None and cfg.grpo.beta > 0,
        grpo_old_policy=grpo.old_policy_forward(cfg.train.gradient_accumulation_steps) if grpo else False,
        grpo_rollouts=grpo.rollouts.value if grpo else "",
        generation_sequences=(cfg.train.per_device_batch_size * grpo.generations_per_step(
            cfg.train.gradient_accumulation_steps)) if grpo else 0,
        vllm_share=grpo.vllm_gpu_memory_utilization if grpo else 0.0,
        server_nodes=grpo.server_nodes if grpo else 0,
        async_saves=cfg.checkpoint.asynchronous,
    )
    return knobs, capacity_note


def _approximations(shape: ModelShape) -> tuple[str, ...]:
    """Plain words for where the activation arithmetic approximates the architecture."""
    out = []
    if shape.experts:
        out.append(f"MoE activations: each token goes through {shape.experts_per_token} of {shape.experts} experts "
                   f"(router logits in fp32{', plus the shared experts' if shape.shared_intermediate else ''}); "
                   "routing assumed balanced across tokens, so a skewed batch needs more on some ranks")
    if shape.family == "mla_moe":
        out.append("MLA attention's activations are counted as grouped-query attention of the same heads (approximate)")
    if shape.family == "gemma2" or shape.family == "gpt_oss":
        out.append(f"{shape.model_type}: sliding-window layers are counted as full attention (an upper bound)")
    return tuple(out)


def _counted(shape: ModelShape, k: Settings) -> Counted:
    """The numbers the assumptions name, from the one place they are defined (this module)."""
    return Counted(
        approximations=_approximations(shape),
        model_type=shape.model_type,
        model_type_supported=shape.model_type in SUPPORTED_MODEL_TYPES or shape.count_source != "config.json",
        family=FAMILY_WORDS.get(shape.family, shape.family),
        count_source=shape.count_source,
        state_bytes=BYTES_PER_PARAM[k.precision],
        reductions_per_step=gradient_reductions_per_step(k.accumulation),
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        fragmentation=FRAGMENTATION,
        runtime_bytes_per_rank=k.runtime_bytes_per_rank,
        trainable=lora_count(shape, k.lora).count.trainable if k.lora is not None else 0,
        lora_notes=lora_count(shape, k.lora).count.unmatched if k.lora is not None else (),
    )


# ====================================================================== the result
def _model_facts(cfg: RunConfig, source: str | None, shape: ModelShape) -> dict[str, Any]:
    return {
        "name_or_path": cfg.model.name_or_path,
        "config_source": source,
        "model_type": shape.model_type,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied,
        "num_local_experts": shape.experts,
        "family": shape.family,
        "parameters_from": shape.count_source,
    }


def _precision_facts(cfg: RunConfig, k: Settings) -> dict[str, Any]:
    mode = PRECISIONS[k.precision]
    return {
        "name": k.precision,
        "requested": cfg.train.precision,
        "param_dtype": mode.param_dtype,
        "compute_dtype": mode.compute_dtype,
        "reduce_dtype": k.reduce_dtype,
        "optimizer_state_dtype": mode.optim_dtype,
        "bytes_per_parameter": sum(mode.state_bytes().values()),
    }


def _setup_facts(k: Settings, profile: ClusterProfile, here: bool) -> dict[str, Any]:
    """``here``: a local run without a profile (:func:`slurmft.profiles.on_this_machine`): its ranks run on this
    machine, which is what is said, not the default profile's name (its RAM is this machine's already)."""
    return {
        "nodes": k.nodes,
        "ranks_per_node": k.ranks_per_node,
        "world_size": k.world_size,
        "device": "gpu" if k.on_gpu else "cpu",
        "gpu_type": profile.gpu.type if k.on_gpu else None,
        "profile": profile.name,
        "this_machine": here,
        "precision": k.precision,
        "fsdp": k.fsdp,
        "shards": k.shards,
        "replicate_across_nodes": k.hsdp and k.fsdp,
        "replicas": k.nodes if (k.hsdp and k.fsdp) else 1,
        "cpu_offload": k.cpu_offload,
        "activation_checkpointing": k.checkpointing,
        # flash-attention 2 needs a CUDA device: CPU ranks run SDPA (slurmft.job.loading.choose_attention)
        "attention": "eager" if k.eager else "flash/sdpa" if k.on_gpu else "sdpa",
        "seq_len": k.seq_len,
        "micro_batch": k.micro_batch,
        "gradient_accumulation_steps": k.accumulation,
        "dpo": k.dpo,  # chosen and rejected in one forward; a reference copy unless LoRA or precomputed
    }


def checkpoint_size(shape: ModelShape, k: Settings) -> int:
    """Bytes of one sharded checkpoint: every parameter with its AdamW states, or (LoRA) only the trainable
    ones in fp32 (12 bytes each), never the frozen base."""
    if k.lora is not None:
        return lora_count(shape, k.lora).count.trainable * LORA_CHECKPOINT_BYTES
    mode = PRECISIONS[k.precision]
    return sum(numel(s) for s in shape.all_tensors()) * (mode.param_bytes + 2 * PRECISION_DTYPE_BYTES[mode.optim_dtype])


def lora_words(shape: ModelShape, k: Settings, lora: LoraSettings) -> str:
    """What adding ``lora`` to the run ``k`` trains and saves, for the remedies."""
    trained = lora_count(shape, lora).count.trainable
    n_params = sum(numel(s) for s in shape.all_tensors())
    return (f"{lora.words()}: {trained / 1e6:,.1f}M trainable parameters, {100 * trained / n_params:.2f} % of the "
            f"model; checkpoint {decimal_gb(checkpoint_size(shape, replace(k, lora=lora)))} instead of "
            f"{decimal_gb(checkpoint_size(shape, replace(k, lora=None)))}")


def _lora_facts(cfg: RunConfig, shape: ModelShape, k: Settings, n_params: int, out_bytes: int) -> dict[str, Any] | None:
    """The ``lora`` entry of the result: the adapters, their share, and the full fine-tune it replaces."""
    if k.lora is None or cfg.lora is None:
        return None
    count = lora_count(shape, k.lora).count
    full = _per_gpu(shape, replace(k, lora=None))
    return {
        "r": cfg.lora.r,
        "alpha": cfg.lora.alpha,
        "scaling": cfg.lora.scaling,
        "dropout": cfg.lora.dropout,
        "target_modules": cfg.lora.target_modules,
        "resolved_target_modules": list(count.target_modules),
        "modules_to_save": list(cfg.lora.modules_to_save),
        "trainable_params": count.trainable,
        "total_params": n_params + count.trainable,
        "trainable_share": count.trainable / (n_params + count.trainable),
        "base_dtype": PRECISIONS[k.precision].compute_dtype,
        "bytes_per_trainable_param": sum(LORA_BYTES_PER_PARAM.values()),
        "adapter_bytes": count.trainable * out_bytes,
        "merge": cfg.consolidate.merge,
        "unmatched": list(count.unmatched),
        "full_finetune": {"per_gpu_total": full["total"], "fits": full["fits"],
                          "checkpoint_bytes": checkpoint_size(shape, replace(k, lora=None))},
    }


def estimate(
    cfg: RunConfig, profile: ClusterProfile, model_cfg: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Memory plan of a run: parameters, per-GPU memory, per-node CPU RAM at load, checkpoint sizes.

    Bytes are integers. ``per_gpu`` is the largest rank; ``cpu_ram_per_node`` is node 0 (it hosts rank
    0, which reads the weights). ``assumptions`` lists what was counted; ``problems`` (from
    ``estimate_text.fit_problems``) turns a result that does not fit into reasons with fixes.
    """
    source = None
    if model_cfg is None:
        source = str(locate_model_config(cfg.model.name_or_path, cfg.model.revision))
        model_cfg = read_model_config(cfg.model.name_or_path, cfg.model.revision)
    too_long = seq_length_problem(cfg.data.max_seq_length, model_cfg.get("max_position_embeddings"))
    if too_long:  # the job refuses it, so no plan for it either
        raise ConfigError(too_long)
    headers = local_header_shapes(cfg.model.name_or_path, cfg.model.revision) if source is not None else None
    shape = model_shape(model_cfg, headers)
    n_params = sum(numel(s) for s in shape.all_tensors())
    knobs, capacity_note = _knobs(cfg, profile)

    gpu = _per_gpu(shape, knobs)
    activations = _activations(shape, knobs, gpu.pop("_activations_detail"))
    checkpoint_bytes = checkpoint_size(shape, knobs)
    staging = async_staging_bytes(checkpoint_bytes, knobs)
    cpu = _cpu_ram_per_node(shape, n_params, knobs, gpu, int(profile.node_memory_gb * GB), staging)
    mode = PRECISIONS[knobs.precision]
    out_dtype = consolidated_dtype(cfg.consolidate.dtype, mode)
    both = layouts(shape, n_params, knobs)
    lora = _lora_facts(cfg, shape, knobs, n_params, DTYPE_BYTES[out_dtype])
    grpo = grpo_facts(cfg, shape, knobs)
    merged = lora is None or lora["merge"]  # a LoRA run without merge writes only the adapter

    write = checkpoint_write(knobs.nodes, profile.checkpoint_write_gb_per_s, profile.checkpoint_write_gb_per_s_total)
    result: dict[str, Any] = {
        "model": _model_facts(cfg, source, shape),
        "parameters": n_params,
        "precision": _precision_facts(cfg, knobs),
        "setup": _setup_facts(knobs, profile, on_this_machine(cfg)),
        "per_gpu": gpu,
        "activations": activations,
        "cpu_ram_per_node": cpu,
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_save_s": projected_save(checkpoint_bytes, write),
        "checkpoint_write": write,
        "lead_time_s": cfg.preemption.lead_time_s,
        "checkpoint_async": cfg.checkpoint.asynchronous,
        "schedule": schedule(cfg),
        "consolidated_bytes": n_params * DTYPE_BYTES[out_dtype] if merged else 0,
        "consolidated_dtype": out_dtype,
        "lora": lora,
        "grpo": grpo,
        "fits": bool(gpu["fits"] and cpu["fits"] and not (grpo and grpo["problems"])),
        # the words: what would make it fit (only when it does not), a better layout, what was counted
        "remedies": [] if gpu["fits"] else remedies(knobs, partial(_total_if_fits, shape),
                                                    partial(lora_words, shape, knobs)),
        "layouts": both,
        "inter_node_bytes_per_step": both["hsdp" if knobs.hsdp else "fsdp"]["inter_node_bytes_per_step"],
        "recommendation": hsdp_advice(both, knobs) if gpu["fits"] else None,
        "assumptions": assumptions(knobs, _counted(shape, knobs), capacity_note),
    }
    result["problems"] = fit_problems(result) + (grpo["problems"] if grpo else [])
    result["verdict"] = verdict(result)
    return result


def schedule(cfg: RunConfig) -> dict[str, Any] | None:
    """Steps per epoch, the run's steps and its periodic saves, exact from the prepared data's count
    (``slurmft prepare``: the same function the job uses); None before the data is prepared."""
    counts = prepared_counts(cfg)
    if counts is None:
        return None
    sequences = counts["sequences"]
    t = cfg.train  # the training ranks: a GRPO vLLM server's node holds none
    per_epoch = steps_per_epoch(sequences, cfg.train_world_size, t.per_device_batch_size, t.gradient_accumulation_steps)
    max_steps = math.ceil(t.epochs * per_epoch) if t.epochs is not None else t.max_steps
    return {"sequences_per_epoch": sequences, "rows": epoch_rows(cfg.method, cfg.data.packing),  # what they are
            "tokens_per_epoch": counts.get("tokens"), "steps_per_epoch": per_epoch,
            "max_steps": max_steps,
            "periodic_saves": max_steps // cfg.checkpoint.every_steps if max_steps else None}


def to_json(result: dict[str, Any]) -> str:
    """The result as indented JSON (bytes stay integers)."""
    return json.dumps(result, indent=2, sort_keys=False)
