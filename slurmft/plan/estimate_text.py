"""The words of `slurmft estimate`: advice, assumptions, verdicts and the table, apart from the arithmetic.

Why a room of its own: ``estimate.py`` answers "what fits" in integers; what a user reads (the fixes
to try, what was counted, why it does not fit, the rich table) is text that changes for other
reasons. This module imports no arithmetic: ``estimate.py`` hands it the settings, the numbers it
counted with (:class:`Counted`) and, for the fixes, a ``fits`` function to ask, so a number printed
here is always the one the arithmetic used. The arrow points one way: estimate.py -> estimate_text.py.
Bytes are written with :func:`slurmft.units.decimal_gb` (``12.3 GB``), as in docs/estimate.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from slurmft.plan.estimate_grpo import grpo_assumption
from slurmft.plan.settings import LoraSettings, Settings
from slurmft.precision import PRECISIONS
from slurmft.precision import reduce_dtype as resolve_reduce_dtype
from slurmft.units import MiB, decimal_gb

if TYPE_CHECKING:  # rich is imported only to draw the table
    from rich.console import RenderableType




@dataclass(frozen=True)
class Counted:
    """The numbers the arithmetic counted with that the assumptions name (estimate.py fills it)."""

    model_type: str
    model_type_supported: bool
    family: str  # the words for the family whose arithmetic counted it (paramcount.FAMILY_WORDS)
    count_source: str  # "safetensors headers" or "config.json"
    state_bytes: dict[str, int]  # weights, gradients, optimizer bytes per parameter
    reductions_per_step: int
    cuda_context_bytes: int
    fragmentation: float
    runtime_bytes_per_rank: int  # the GPU or the CPU allowance, whichever this run's ranks are
    approximations: tuple[str, ...] = ()  # where the activation arithmetic approximates this architecture
    trainable: int = 0  # LoRA: the adapter (and modules_to_save) parameters
    lora_notes: tuple[str, ...] = ()  # LoRA: listed names that adapt nothing here


# ====================================================================== advice
def remedies(k: Settings, fits: Callable[[Settings], int | None],
             lora_words: Callable[[LoraSettings], str] | None = None) -> list[str]:
    """Single changes to the run config that would make the GPU memory fit, each with its estimate.

    ``fits(alt)`` is the arithmetic's answer for the changed settings: the per-GPU total when it fits,
    else None (estimate.py asks its ``_per_gpu``). ``lora_words(lora)``: what LoRA would train and save
    (estimate.py counts it), offered when a full fine-tune does not fit.
    """
    out: list[str] = []
    if not k.fsdp and (t := fits(replace(k, fsdp=True))):
        out.append(f"set fsdp.enabled=true (shards over {replace(k, fsdp=True).shards} ranks: {decimal_gb(t)} per GPU)")
    if k.fsdp and k.hsdp and k.nodes > 1 and (t := fits(replace(k, hsdp=False))):
        out.append(f"set fsdp.replicate_across_nodes=false (the training state does not fit one node; FSDP over all "
                   f"{k.world_size} ranks: {decimal_gb(t)} per GPU)")
    if k.dpo_reference and (t := fits(replace(k, dpo_precomputed=True))):
        out.append(f"set dpo.reference=precomputed (the reference's log-probabilities computed once before step 1, "
                   f"no copy of the model while training; {decimal_gb(t)} per GPU)")
    if k.lora is None and lora_words is not None and (t := fits(replace(k, lora=LoraSettings()))):
        out.append(f"add a lora: section (LoRA adapters on a frozen base, docs/lora.md; {lora_words(LoraSettings())}; "
                   f"{decimal_gb(t)} per GPU)")
    if k.precision != "bf16-true" and k.lora is None:  # LoRA: the base is in the compute dtype already
        true_bf16 = replace(k, precision="bf16-true",
                            reduce_dtype=resolve_reduce_dtype(PRECISIONS["bf16-true"], k.reduce_configured))
        if t := fits(true_bf16):
            out.append(
                "set train.precision=bf16-true (bf16 weights, gradients and AdamW state: 8 bytes/parameter; "
                f"{decimal_gb(t)} per GPU)"
            )
    if not k.checkpointing and (t := fits(replace(k, checkpointing=True))):
        out.append(f"set fsdp.activation_checkpointing=true ({decimal_gb(t)} per GPU)")
    if k.eager and (t := fits(replace(k, eager=False))):
        out.append(f"use model.attn_implementation=sdpa or flash_attention_2 ({decimal_gb(t)} per GPU)")
    if k.micro_batch > 1 and (t := fits(replace(k, micro_batch=1))):
        out.append(
            f"set train.per_device_batch_size=1 and raise train.gradient_accumulation_steps (fewer activations; "
            f"gradients stay sharded between micro-batches: {decimal_gb(t)} per GPU)"
        )
    if k.on_gpu:
        base = replace(k, fsdp=True, hsdp=False)  # more nodes only help when every rank holds a shard
        for nodes in range(k.nodes + 1, 513):
            if t := fits(replace(base, nodes=nodes)):
                extra = "" if k.fsdp else " with fsdp.enabled=true"
                extra += " and fsdp.replicate_across_nodes=false" if k.hsdp else ""
                out.append(f"use resources.nodes={nodes + k.server_nodes}{extra} ({decimal_gb(t)} per GPU)")
                break
        if not k.cpu_offload and (t := fits(replace(k, fsdp=True, cpu_offload=True))):
            out.append(f"set fsdp.cpu_offload=true (much slower; {decimal_gb(t)} per GPU)")
    if not out:  # no single change is enough: name the levers that are not at their best yet
        levers = [
            "fsdp.enabled=true" if not k.fsdp else "",
            "fsdp.activation_checkpointing=true" if not k.checkpointing else "",
            "model.attn_implementation=sdpa" if k.eager else "",
            "train.per_device_batch_size=1" if k.micro_batch > 1 else "",
            "train.precision=bf16-true" if k.precision != "bf16-true" and k.lora is None else "",
            "a lora: section" if k.lora is None else "a smaller lora.r or fewer lora.target_modules",
            "a smaller data.max_seq_length",
            "more resources.nodes" if k.on_gpu else "more resources.nodes or node RAM",
        ]
        out.append("no single change is enough; combine " + ", ".join(x for x in levers if x))
    return out


def hsdp_advice(result_layouts: dict[str, dict[str, Any]], k: Settings) -> str | None:
    """A recommendation to switch layout, or None: HSDP when the training state fits one node."""
    if not k.fsdp or k.nodes == 1:
        return None
    fsdp, hsdp = result_layouts["fsdp"], result_layouts["hsdp"]
    traffic = (f"inter-node traffic {decimal_gb(hsdp['inter_node_bytes_per_step'])} per node per step instead of "
               f"{decimal_gb(fsdp['inter_node_bytes_per_step'])}")
    if not k.hsdp and hsdp["fits"]:
        return (f"set fsdp.replicate_across_nodes=true (HSDP): the model's training state fits one node "
                f"({decimal_gb(hsdp['per_gpu_total'])} per GPU sharded over its {k.ranks_per_node} ranks), so parameter "
                f"all-gathers and gradient reduce-scatters stay inside the node and only one gradient all-reduce "
                f"crosses the network; {traffic}")
    return None


def assumptions(k: Settings, counted: Counted, capacity_note: str | None) -> list[str]:
    """What the estimate counted, one line per assumption (``result["assumptions"]``)."""
    per = counted.state_bytes
    lines = []
    if counted.count_source != "config.json":
        lines.append(f"parameters counted from the {counted.count_source} of the weights (exact)")
    elif not counted.model_type_supported:
        lines.append(f"model_type {counted.model_type!r} is not a family slurmft knows: parameters counted from "
                     "config.json as a Llama-style decoder (with the weights in a local directory or in HF_HOME's "
                     "cache the count is exact, from their safetensors headers)")
    else:
        lines.append(f"parameters counted from config.json as a {counted.family}")
    lines += list(counted.approximations)
    if k.grpo:
        lines.append(grpo_assumption(k))
    mode = PRECISIONS[k.precision]
    if k.lora is not None:
        lines.append(
            f"LoRA ({k.lora.words()}, as PEFT adds them; the output head never): the frozen base in "
            f"{mode.compute_dtype} ({mode.compute_bytes} bytes/parameter, no gradient, no optimizer state); "
            f"{counted.trainable:,} trainable parameters (adapters"
            + (", modules_to_save copies" if k.lora.modules_to_save else "")
            + ") in fp32 with AdamW: 4 weights + 4 gradients + 8 optimizer = 16 bytes each")
        lines += [f"lora: {note}; the job refuses a listed name that adapts nothing" for note in counted.lora_notes]
    else:
        lines.append(
            f"training state ({k.precision}, AdamW): {per['weights']} weights + {per['gradients']} gradients + "
            f"{per['optimizer']} optimizer = {sum(per.values())} bytes/parameter"
            + (" (FSDP2 keeps fp32 sharded weights and gradients; the compute dtype only while gathered)"
               if k.precision in ("bf16-mixed", "fp16-mixed") else "")
            + (" (bf16 weights, gradients, exp_avg and exp_avg_sq)" if k.precision == "bf16-true" else "")
        )
    if k.fsdp and k.hsdp and k.nodes > 1:
        lines.append(
            f"HSDP (fsdp.replicate_across_nodes): each tensor split on dim 0 (padded) over the {k.ranks_per_node} "
            f"ranks of a node and replicated on {k.nodes} nodes; the largest rank is shown"
        )
    elif k.fsdp:
        lines.append(
            f"FSDP full shard over {k.world_size} ranks: each tensor split on dim 0 (padded); the largest rank is shown"
            + ("; fsdp.replicate_across_nodes on one node is the same" if k.hsdp else "")
        )
        grads = "trainable (adapter) gradients" if k.lora is not None else "gradients"
        lines.append(
            f"FSDP reduce-scatter input: the largest wrapped unit's {grads}, unsharded and padded, in "
            f"{k.reduce_dtype} (fsdp.reduce_dtype)"
        )
        lines.append(
            f"FSDP working set: 2 layers' parameters (current + prefetched) + 1 layer's {grads} unsharded, "
            "root parameters (embeddings, final norm, LM head)"
            + (" + LM-head gradient" if k.lora is None else "") + " unsharded, in the compute dtype"
        )
        lines.append(
            f"gradient accumulation ({k.accumulation} micro-batch(es) per step) adds no memory: every micro-batch "
            "reduce-scatters into the sharded gradients (no full gradient is kept between micro-batches)"
        )
    else:
        lines.append(
            "fsdp.enabled=false: every GPU holds all weights, gradients and optimizer states (DDP-like), "
            "plus DDP gradient buckets (one more gradient copy)"
        )
    if k.cpu_offload and k.fsdp:
        lines.append("fsdp.cpu_offload: sharded weights, gradients and optimizer states live in CPU RAM")
    if k.fsdp and k.nodes > 1:
        # DPO's reference, or GRPO's KL term's (beta > 0), and GRPO's old policy: each forward gathers once more
        extra = (", +1 for the reference's forward" if k.reference_forwards else "") + (
            ", +1 for the old policy's log-probabilities (GRPO)" if k.grpo_old_policy else "")
        lines.append(
            "inter-node bytes per node per optimizer step, NCCL rings: FSDP (W-1)/W x (parameter all-gathers in the "
            f"compute dtype, x2 with reshard_after_forward{extra}, every micro-batch + the "
            "gradient reduce-scatter); HSDP "
            "2(N-1)/N x the gradient all-reduce; gradients reduced "
            f"{counted.reductions_per_step}x per step"
        )
    attn = (
        "eager attention: K/V repeated to all heads, fp32 softmax of heads x seq x seq per layer"
        if k.eager
        else "flash-attention/SDPA: no seq x seq matrix, only the log-sum-exp is kept" if k.on_gpu
        else "SDPA (flash-attention 2 needs a CUDA device): no seq x seq matrix, only the log-sum-exp is kept"
    )
    ckpt = (
        "activation checkpointing: each layer's input kept, one layer recomputed in backward"
        if k.checkpointing
        else "no activation checkpointing: every layer's activations kept until backward"
    )
    lines += [
        f"activations: seq {k.seq_len} x micro-batch {k.micro_batch}"
        + (" x 2 (DPO: chosen and rejected in one forward)" if k.dpo else "") + f"; {ckpt}; {attn}; "
        "logits, their fp32 upcast and fp32 gradient counted"
        + ("; LoRA: as for full fine-tuning (the backward runs through every layer; the adapters' rank-r "
           "intermediates are negligible)" if k.lora is not None else ""),
        (
            f"allowance: {counted.cuda_context_bytes // MiB} MiB CUDA context/workspaces/NCCL + "
            f"{counted.fragmentation:.0%} allocator fragmentation"
        )
        if k.on_gpu
        else (
            f"CPU run: each rank's share is node RAM / {k.ranks_per_node} ranks; allowance "
            f"{counted.runtime_bytes_per_rank // MiB} MiB runtime + {counted.fragmentation:.0%} fragmentation"
        ),
        "CPU RAM at load: fp32 full copies for every-rank / rank-0 loading; slurmft = its worst case (scatter "
        "fallback: safetensors memory-mapped on rank 0 + one tensor at a time; by default each rank reads its slice); "
        f"+ {counted.runtime_bytes_per_rank // MiB} MiB runtime per rank",
        ("CPU RAM while training: the runtime, shards that live in CPU RAM, and the asynchronous saves' staging copy "
         "(checkpoint.async: each rank's checkpoint share, kept from the first periodic save on"
         + (", pinned" if k.on_gpu else "") + "; checkpoint.async: false has none)") if k.async_saves else
        "CPU RAM while training: the runtime and shards that live in CPU RAM (checkpoint.async: false: no staging copy)",
        (f"checkpoint = parameters + 2 AdamW states in {PRECISIONS[k.precision].param_dtype} "
         f"({PRECISIONS[k.precision].param_bytes * 3} bytes/parameter); consolidated = parameters x consolidate.dtype "
         "(auto: the compute dtype)") if k.lora is None else
        ("checkpoint = trainable parameters + 2 AdamW states in fp32 (12 bytes per trainable parameter; the frozen "
         "base is not saved); consolidated: adapter/ = trainable parameters and model/ (consolidate.merge) = the base's "
         "parameters, both x consolidate.dtype (auto: the compute dtype)"),
    ]
    if capacity_note:
        lines.append(capacity_note)
    return lines


def lora_summary(lora: LoraSettings, counted: dict[str, Any] | None) -> str:
    """One line for ``validate``: the adapters asked for and, when the estimate could count them (``counted``:
    the result's ``lora`` entry), what trains and what a checkpoint holds."""
    line = f"LoRA: {lora.words()}"
    if lora.modules_to_save:
        line += f", full copies of {', '.join(lora.modules_to_save)}"
    if not counted:
        return line + " (no estimate: trainable parameters not counted)"
    line += (f" -> {', '.join(counted['resolved_target_modules']) or 'nothing'}: {counted['trainable_params']:,} "
             f"trainable parameters ({100 * counted['trainable_share']:.2f} %), base frozen in {counted['base_dtype']}; "
             f"checkpoint {decimal_gb(counted['trainable_params'] * 12)} "
             f"(full fine-tune: {decimal_gb(counted['full_finetune']['checkpoint_bytes'])})")
    for note in counted.get("unmatched") or []:
        line += f"\n  warning: lora: {note}; the job refuses it"
    return line


# ====================================================================== verdicts
def lead_time_needed(save_s: float) -> int:
    """The preemption.lead_time_s to ask for: twice the projected save, plus start-up of a step."""
    return int(save_s * 2) + 30


def stop_save_s(save_s: float, asynchronous: bool) -> float:
    """The longest a stop (warning signal, SIGTERM) saves for: one save, or, with ``checkpoint.async``, the rest of
    a periodic save still being written (up to a whole save) and then the stop's own synchronous save."""
    return save_s * 2 if asynchronous else save_s


def write_rule(write: dict[str, Any]) -> str:
    """The projected save's bandwidth in words: nodes x per node, and the filesystem's cap when it binds."""
    parallel = (f"{write['nodes']} node(s) x {write['per_node']:g} GB/s per node, cluster profile "
                "checkpoint_write_gb_per_s")
    if write["total"] is not None and write["total"] < write["nodes"] * write["per_node"]:
        return f"{write['total']:g} GB/s, the checkpoint filesystem's cap (checkpoint_write_gb_per_s_total), not {parallel}"
    return parallel


def lead_time_warning(result: dict[str, Any]) -> str | None:
    """A warning (with the numbers) when the warning signal would not leave time for the stop's save(s)."""
    save, lead = result["checkpoint_save_s"], result["lead_time_s"]
    asynchronous = bool(result.get("checkpoint_async"))
    stop = stop_save_s(save, asynchronous)
    if lead >= stop:
        return None
    what = (f"twice the projected checkpoint save time, {stop:.0f} s (checkpoint.async: a stop first finishes the "
            f"save in flight, then saves its own step; each save ~{save:.0f} s" if asynchronous else
            f"the projected checkpoint save time {save:.0f} s (")
    return (f"preemption.lead_time_s {lead} s is below {what}{'; ' if asynchronous else ''}"
            f"{decimal_gb(result['checkpoint_bytes'])} / ({write_rule(result['checkpoint_write'])})): a preemption or time limit would kill the save. Raise "
            f"preemption.lead_time_s to at least {lead_time_needed(save)} (twice the save, plus start-up of a step)")


def fit_problems(result: dict[str, Any]) -> list[str]:
    """Why the run does not fit, one human line per resource (empty when it fits)."""
    problems = []
    g = result["per_gpu"]
    setup = result.get("setup", {})
    on_gpu = setup.get("device", "gpu") == "gpu"
    if not g["fits"]:
        unit = f"per GPU ({setup.get('gpu_type')})" if on_gpu else "per CPU rank"
        parts = ", ".join(
            f"{k} {decimal_gb(g[k])}"
            for k in ("weights", "gradients", "optimizer", "comm_buffers", "reduce_scatter", "activations", "generation",
                      "vllm_colocate", "overhead")
            if g.get(k)
        )
        msg = f"GPU memory: needs {decimal_gb(g['total'])} {unit} but has {decimal_gb(g['capacity'])} ({parts})"
        if not on_gpu:
            msg = msg.replace("GPU memory", "CPU memory per rank")
        if not setup.get("fsdp", True):
            msg += "; fsdp.enabled=false keeps a full copy of weights, gradients and optimizer on every GPU"
        remedies = result.get("remedies") or []
        if remedies:
            msg += "; to fix: " + "; or ".join(remedies)
        problems.append(msg)
    c = result["cpu_ram_per_node"]
    if not c["fits"]:
        need = max(c["slurmft"], c.get("training", 0))
        staging = c.get("async_staging", 0)
        msg = (f"CPU RAM: node 0 needs {decimal_gb(need)} (loading {decimal_gb(c['slurmft'])}, training "
               f"{decimal_gb(c.get('training', 0))}"
               + (f", of which {decimal_gb(staging)} is the asynchronous saves' staging copy: each rank's model and "
                  "optimizer shards, in CPU memory for the whole job" if staging else "")
               + f") but a node has {decimal_gb(c['capacity'])}; ")
        fixes = ["use more nodes", "a profile with more node_memory_gb"]
        if staging and max(c["slurmft"], c["training"] - staging) <= c["capacity"]:
            fixes.insert(0, f"set checkpoint.async: false (no staging copy; each periodic save then holds training "
                            f"for the whole write, about {result.get('checkpoint_save_s', 0):.0f} s)")
        problems.append(msg + "to fix: " + ", or ".join(fixes))
    return problems


def verdict(result: dict[str, Any]) -> str:
    """One line: fits (with the share of capacity) or does not fit (with every problem)."""
    g = result["per_gpu"]
    pct = 100 * g["total"] / g["capacity"] if g["capacity"] else float("inf")
    if result["fits"]:
        tight = (
            " - tight: under 5% headroom, little room for a longer sequence or a larger micro-batch"
            if pct > 95
            else ""
        )
        return f"fits: {decimal_gb(g['total'])} of {decimal_gb(g['capacity'])} per rank ({pct:.0f}%){tight}"
    return "does not fit: " + " | ".join(result["problems"])


# ====================================================================== the table
def render_table(result: dict[str, Any]) -> RenderableType:
    """A rich renderable for humans: model, per-GPU memory, CPU RAM at load, disk, verdict."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s, g, c, m = result["setup"], result["per_gpu"], result["cpu_ram_per_node"], result["model"]
    head = Text.assemble(
        (f"{m['name_or_path']}", "bold"),
        f"  {result['parameters'] / 1e9:.2f}B parameters ({result['parameters']:,})  "
        f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, heads {m['num_attention_heads']}"
        f"/{m['num_key_value_heads']} kv, vocab {m['vocab_size']}\n",
        f"{s['nodes']} node(s) x {s['ranks_per_node']} ranks on {s['gpu_type'] or 'CPU'} "
        f"({'this machine' if s.get('this_machine') else s['profile']}), {s['precision']}, "
        + ((f"HSDP: sharded over {s['shards']} per node, {s['replicas']} replicas" if s["replicas"] > 1 else
            f"FSDP full shard over {s['shards']}") if s["fsdp"] else "no FSDP (full copy per rank)")
        + (", CPU offload" if s["cpu_offload"] else "")
        + f", activation checkpointing {'on' if s['activation_checkpointing'] else 'off'}, "
        f"{s['attention']} attention, seq {s['seq_len']} x micro-batch {s['micro_batch']}"
        + (" x 2 (DPO pairs)" if s.get("dpo") else ""),
    )
    lora = result.get("lora")
    if lora:
        full = lora["full_finetune"]
        head.append(
            f"\nLoRA r={lora['r']}, alpha={lora['alpha']:g} on {', '.join(lora['resolved_target_modules']) or 'nothing'}"
            + (f" + full copies of {', '.join(lora['modules_to_save'])}" if lora["modules_to_save"] else "")
            + f": {lora['trainable_params']:,} trainable parameters ({100 * lora['trainable_share']:.2f} %), the base "
            f"frozen in {lora['base_dtype']}; a full fine-tune here: {decimal_gb(full['per_gpu_total'])} per GPU"
            + ("" if full["fits"] else " (over capacity)") + f", checkpoint {decimal_gb(full['checkpoint_bytes'])}")

    t = Table(title="Per GPU" if s["device"] == "gpu" else "Per rank (CPU)", title_justify="left")
    t.add_column("component")
    t.add_column("bytes", justify="right")
    t.add_column("note", style="dim")
    rows = [
        ("weights", g["weights"], ("sharded" if s["fsdp"] else "full copy")
         + (f", frozen base {lora['base_dtype']} + adapters fp32" if lora
            else ", bf16" if s["precision"] == "bf16-true" else ", fp32")
         + (f", + {'GRPO KL' if result.get('grpo') else 'DPO'} reference {decimal_gb(g['reference_weights'])}"
            if g.get("reference_weights") else "")),
        ("gradients", g["gradients"], "adapters only, fp32" if lora else
         "bf16" if s["precision"] == "bf16-true" else "fp32"),
        ("optimizer (AdamW)", g["optimizer"], "adapters only, 2 fp32 states" if lora else
         "2 bf16 states" if s["precision"] == "bf16-true" else "2 fp32 states"),
        ("reduce-scatter buffer", g.get("reduce_scatter", 0),
         f"largest unit's gradients in {result['precision']['reduce_dtype']}" if s["fsdp"] else ""),
        ("gathered / comm buffers", g["comm_buffers"], "FSDP all-gather" if s["fsdp"] else "DDP buckets"),
        (
            "activations",
            g["activations"],
            f"without ckpt {decimal_gb(result['activations']['without_checkpointing'])}"
            if s["activation_checkpointing"]
            else f"with ckpt {decimal_gb(result['activations']['with_checkpointing'])}",
        ),
        ("overhead allowance", g["overhead"], "context + fragmentation"),
        *_grpo_rows(result),
    ]
    for name, val, note in rows:
        t.add_row(name, decimal_gb(val), note)
    style = "green" if g["fits"] else "red"
    t.add_row(
        Text("total", style="bold"),
        Text(decimal_gb(g["total"]), style=f"bold {style}"),
        f"capacity {decimal_gb(g['capacity'])}",
    )

    r = Table(title="CPU RAM per node at load (node 0)", title_justify="left")
    r.add_column("strategy")
    r.add_column("bytes", justify="right")
    r.add_column("vs node RAM", justify="right")
    for name, key in (
        ("every rank loads", "every_rank_loads"),
        ("rank 0 loads + broadcast", "rank0_broadcast"),
        ("slurmft (mmap + shard broadcast)", "slurmft"),
        ("while training" + (f" (async saves' staging copy {decimal_gb(c['async_staging'])})"
                             if c.get("async_staging") else ""), "training"),
    ):
        ok = c[key] <= c["capacity"]
        r.add_row(name, decimal_gb(c[key]), Text("ok" if ok else "too much", style="green" if ok else "red"))
    r.add_row("node capacity", decimal_gb(c["capacity"]), "")

    d = Table(title="Disk", title_justify="left")
    d.add_column("what")
    d.add_column("bytes", justify="right")
    d.add_row("sharded checkpoint (adapters + optimizer, no base), each" if lora else
              "sharded checkpoint (model + optimizer), each", decimal_gb(result["checkpoint_bytes"]))
    d.add_row(f"projected save time (preemption.lead_time_s {result['lead_time_s']} s)",
              f"{result['checkpoint_save_s']:.1f} s")
    d.add_row(f"  written at ({write_rule(result['checkpoint_write'])})",
              f"{result['checkpoint_write']['gb_per_s']:g} GB/s")
    plan = result.get("schedule")
    if plan and plan["periodic_saves"]:
        d.add_row(f"{plan['periodic_saves']} periodic saves over {plan['max_steps']} steps (prepared data: "
                  f"{plan['sequences_per_epoch']:,} {plan['rows']}{_tokens(plan)}, {plan['steps_per_epoch']} steps per "
                  "epoch), written",
                  decimal_gb(plan["periodic_saves"] * result["checkpoint_bytes"]))
    if lora:
        d.add_row(f"adapter/ ({result['consolidated_dtype']})", decimal_gb(lora["adapter_bytes"]))
        d.add_row(f"merged model/ ({result['consolidated_dtype']})" if lora["merge"] else
                  "merged model/: not written (consolidate.merge: false)",
                  decimal_gb(result["consolidated_bytes"]) if lora["merge"] else "-")
    else:
        d.add_row(f"consolidated model ({result['consolidated_dtype']})", decimal_gb(result["consolidated_bytes"]))

    lay = Table(title="Layouts across nodes (HSDP: fsdp.replicate_across_nodes)", title_justify="left")
    for col, justify in (("layout", "left"), ("shards x replicas", "right"), ("per GPU", "right"),
                         ("inter-node bytes/node/step", "right")):
        lay.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, label in (("fsdp", "FSDP"), ("hsdp", "HSDP")):
        row = result["layouts"][name]
        chosen = (name == "hsdp") == s["replicate_across_nodes"]
        lay.add_row(label + (" (this run)" if chosen else ""), f"{row['shards']} x {row['replicas']}",
                    Text(decimal_gb(row["per_gpu_total"]), style="green" if row["fits"] else "red"),
                    decimal_gb(row["inter_node_bytes_per_step"]))

    verdict = Text(result["verdict"], style="bold green" if result["fits"] else "bold red")
    parts = [head, t, *_server_table(result), r, d]
    if s["fsdp"] and s["nodes"] > 1:
        parts.append(lay)
    parts.append(verdict)
    if result.get("recommendation"):
        parts.append(Text("recommended: " + result["recommendation"], style="bold yellow"))
    notes = Text("\n".join(f"- {a}" for a in result["assumptions"]), style="dim")
    return Group(*parts, Text("assumptions:", style="dim"), notes)


def _tokens(plan: dict[str, Any]) -> str:
    """`` of 111,867 tokens`` when the prepared record counted them."""
    return f" of {plan['tokens_per_epoch']:,} tokens" if plan.get("tokens_per_epoch") else ""


def _grpo_rows(result: dict[str, Any]) -> list[tuple[str, int, str]]:
    """The Per GPU table's GRPO rows: the generation (transformers) or vLLM's share (colocate)."""
    g, grpo = result["per_gpu"], result.get("grpo")
    if not grpo:
        return []
    if grpo["rollouts"] == "transformers":
        return [("generation (GRPO)", g.get("generation", 0),
                 f"KV cache of {grpo['generation_sequences_per_rank']} completions + logits; the larger of it and "
                 "reduce-scatter + activations counts")]
    if grpo["rollouts"] == "colocate":
        v = grpo["vllm_colocate"]
        return [("vLLM colocated (GRPO)", g.get("vllm_colocate", 0),
                 f"{v['gpu_memory_utilization']:g} of the GPU: weights {decimal_gb(v['weights'])}, KV cache "
                 f"{decimal_gb(v['kv_cache'])} ({v['sequences_in_kv']} sequences)")]
    return []


def _server_table(result: dict[str, Any]) -> list[RenderableType]:
    """GRPO's vLLM server node, per GPU (rollouts: server)."""
    from rich.table import Table
    from rich.text import Text

    server = (result.get("grpo") or {}).get("server")
    if not server:
        return []
    t = Table(title=f"vLLM server node (GRPO), per GPU of {server['tensor_parallel_size']}", title_justify="left")
    t.add_column("component")
    t.add_column("bytes", justify="right")
    t.add_column("note", style="dim")
    t.add_row("model weights", decimal_gb(server["weights"]), f"split over {server['tensor_parallel_size']} GPUs")
    t.add_row("KV cache", decimal_gb(server["kv_cache"]),
              f"{server['sequences_in_kv']} sequences at once (generation batch {result['grpo']['generation_batch']})")
    t.add_row(Text("vLLM's share", style="bold"),
              Text(decimal_gb(server["budget"]), style="bold " + ("green" if server["fits"] else "red")),
              f"grpo.server.gpu_memory_utilization {server['gpu_memory_utilization']:g}")
    return [t]
