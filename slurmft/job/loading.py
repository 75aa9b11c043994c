"""Model, tokenizer and weights: loading straight into FSDP2 shards, every rank reading its own slice.

What accelerate does (1.15, ``fsdp2_prepare_model`` with ``cpu_ram_efficient_loading``): it needs
a model that transformers already loaded in full on rank 0 (anonymous memory: 1x the model, 2x
when mixed precision upcasts a bf16 checkpoint to fp32), moves it to ``meta``, shards it, then
*broadcasts* every full parameter to every rank, each of which cuts its shard out
(``distribute_tensor``). Every rank therefore holds one full parameter at a time, and the model
reaches accelerate through the Trainer while some ranks hold meta tensors.

What transformers 5.24 does natively (``from_pretrained(..., distributed_config=DistributedConfig(
fsdp_size=N))``): it shards the model at load and every rank reads its own slice, like step 4 below,
and measures the same (``bench/load_memory.py``, bf16 file, 2 ranks: 1.06x the shard, half the file
per rank). We keep our own loader because the native one would lose what this one carries: the
precision modes (its mixed precision is one switch, bf16 parameters and fp32 reduction, with no
``bf16-true``, ``fp16-mixed`` or ``fsdp.reduce_dtype``), ``fsdp.wrap_class`` and
``reshard_after_forward``, checkpoint-wrapped layers, a checkpoint that does not match its config
failing on every rank (natively a missing tensor is initialised at random, with a warning), the
same error on every rank when a read fails, and loading when only rank 0 sees the files. It also
leaves a same-dtype shard as a lazy view into the memory-mapped file whose storage is the whole tensor.

What we do, before the Trainer sees the model (:func:`build_sharded_model`, the recipe):

1. every rank builds the model on the ``meta`` device from ``config.json`` (slurmft/job/inputs.py
   found and checked it), with the precision and attention chosen here;
2. rank 0 checks every parameter name, shape and dtype against the safetensors headers (a mismatch
   is a :class:`JobSetupError` on every rank, before any collective that could hang:
   slurmft/job/weights.py);
3. activation checkpointing and ``fully_shard`` are applied per decoder layer, to the embeddings
   and to the head, then the root; ``to_empty`` allocates only the local shards
   (slurmft/job/parallelize.py, where a transform before sharding, such as adapters, goes);
4. every rank reads only the part of each tensor its DTensor holds, in the file's dtype, and casts
   it into its shard; when some rank cannot see the files, rank 0 reads and scatters the parts
   (slurmft/job/weights.py, with the measured memory and time). A resuming job skips this step: the
   checkpoint's strict load overwrites every shard (slurmft/job/checkpointing/fallback.py).

accelerate's ``_prepare_fsdp2`` sees an ``FSDPModule`` and leaves the sharding alone; its optimizer,
checkpointing and state-dict code work on it unchanged.

Precision (``train.precision``, reconciled with ``model.dtype`` by the config; the table is
slurmft/precision.py): the sharded parameters are allocated in the mode's parameter dtype (float32
for ``bf16-mixed``/``fp32``, bfloat16 for ``bf16-true``), so the gradients FSDP2 shards and the AdamW
state (``zeros_like`` the parameter) follow it, and DCP checkpoints store it. The FSDP2
mixed-precision policy gathers parameters in the compute dtype and reduce-scatters gradients in
``fsdp.reduce_dtype``: 16 bytes/parameter of training state for ``bf16-mixed``, 8 for ``bf16-true``,
as ``slurmft estimate`` counts.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slurmft import attention
from slurmft.attention import Support
from slurmft.checkpoints import strip_wrappers
from slurmft.config import RunConfig
from slurmft.errors import JobSetupError
from slurmft.job import adapters
from slurmft.job.adapters import AdapterSummary
from slurmft.job.distributed import DistContext, guarded
from slurmft.job.dtypes import DTYPES
from slurmft.job.parallelize import build_meta, parallelize_model, wrap_class_names
from slurmft.job.weights import check_weights, load_weights
from slurmft.precision import Precision
from slurmft.precision import reduce_dtype as configured_reduce_dtype
from slurmft.precision import resolve as resolve_precision

log = logging.getLogger("slurmft.job")


# ----------------------------------------------------------------------------- choices: precision, attention
def choose_precision(cfg: RunConfig, on_gpu: bool) -> Precision:
    """train.precision on this device (auto: bf16-mixed on GPU, fp32 on CPU); refused where bf16 is not."""
    mode = resolve_precision(cfg.train.precision, on_gpu)
    uses_bf16 = "bfloat16" in (mode.param_dtype, mode.compute_dtype)
    if uses_bf16 and on_gpu and not torch.cuda.is_bf16_supported():
        raise JobSetupError(
            f"train.precision={mode.name} needs bfloat16, which {torch.cuda.get_device_name()} does not support; "
            "use train.precision=fp16-mixed or fp32 (or GPUs with compute capability >= 8.0)"
        )
    return mode


def mixed_precision_dtypes(cfg: RunConfig, mode: Precision) -> tuple[torch.dtype, torch.dtype | None, torch.dtype]:
    """(sharded parameter dtype, FSDP2 param_dtype or None when it is the same, FSDP2 reduce_dtype)."""
    param = DTYPES[mode.param_dtype]
    compute = DTYPES[mode.compute_dtype]
    return param, (compute if compute != param else None), DTYPES[configured_reduce_dtype(mode, cfg.fsdp.reduce_dtype)]


def _import_flash_attn() -> Any:
    """Import flash-attn (its CUDA extension loads here: an ABI mismatch with torch fails here)."""
    return importlib.import_module("flash_attn")


def flash_attention_problem(on_gpu: bool) -> str | None:
    """Why flash-attention 2 cannot run here, by transformers' own availability check; None when it can."""
    if not on_gpu:
        return "no CUDA device"
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn is not installed"
        return ("flash-attn is installed but transformers rejects it (is_flash_attn_2_available() is false: "
                "it needs the flash-attn 2 distribution, version >= 2.3.3)")
    try:
        _import_flash_attn()
    except Exception as exc:  # an ABI mismatch with torch is the usual one
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"flash-attn is installed but does not import ({type(exc).__name__}: {first})"
    return None


FLASH_FIX = "pip install 'slurmft[flash]' (a flash-attn built for this torch and CUDA)"


def architecture_support(config: Any) -> Support | None:
    """What the transformers class this config builds declares (``_supports_sdpa``, ``_supports_flash_attn``);
    None for custom code (then transformers itself decides when the model is built)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None
    return Support(str(getattr(config, "model_type", cls.__name__)), bool(getattr(cls, "_supports_sdpa", False)),
                   bool(getattr(cls, "_supports_flash_attn", False)))


def choose_attention(requested: str, on_gpu: bool, support: Support | None = None) -> tuple[str, str]:
    """(attn_implementation, why): flash_attention_2 when the architecture and this node allow it, else SDPA
    where the architecture supports it, else eager (slurmft/attention.py decides; this adds the node's side).

    ``auto`` falls back with the reason (the run works, slower). An explicit ``flash_attention_2`` is
    honoured or refused with a JobSetupError, never silently replaced: the user asked for it, and SDPA
    with packing can cost several times the GPU hours. An explicit choice the architecture refuses is
    the same error ``slurmft validate`` prints when the config is local.
    """
    refused = attention.refusal(requested, support)
    if refused:
        raise JobSetupError(refused)
    if requested not in ("auto", attention.FLASH):
        return requested, "set by model.attn_implementation"
    problem = flash_attention_problem(on_gpu) if support is None or support.flash else None
    if requested == attention.FLASH:
        if problem is None:
            return attention.FLASH, "transformers can use flash-attn 2 on this CUDA device"
        raise JobSetupError(
            f"model.attn_implementation=flash_attention_2 but {problem}; {FLASH_FIX}, or set "
            "model.attn_implementation=auto (falls back to PyTorch SDPA) or sdpa"
        )
    attn, why = attention.choose("auto", support, problem)
    if problem and problem != "no CUDA device" and attn != attention.FLASH:
        why += f"; for flash-attention: {FLASH_FIX}"
    return attn, why


def packing_attention_note(attn: str, padding_free: bool, row_tokens: int, on_gpu: bool) -> str | None:
    """The log line for packed (padding-free) batches without flash-attention, else None.

    TRL's padding-free collator (``data.packing`` with its default ``bfd`` strategy) puts a whole
    micro-batch into one row; flash-attention 2 keeps the sequences apart through their lengths, but
    SDPA/eager get a block-diagonal mask over the whole row from transformers, and SDPA cannot use
    its flash kernel with a mask: slow from 2048 tokens on.
    """
    if not (on_gpu and padding_free) or attn.startswith("flash_attention"):
        return None
    return (
        f"data.packing with {attn} attention: each micro-batch is one packed row of up to {row_tokens} tokens "
        "(train.per_device_batch_size x data.max_seq_length), attended through a block-diagonal mask over the "
        f"whole row, which is slow at 2048+ tokens. Fix: {FLASH_FIX}"
    )


def packed_documents_problem(model: Any, attn: str, padding_free: bool) -> str | None:
    """Why documents packed into one row would attend to each other on ``model`` (None: they are kept apart).

    TRL's padding-free collator passes no attention mask, only ``position_ids`` restarting at 0 at each document.
    flash-attention 2 turns those into varlen boundaries (transformers' flash integration); SDPA and eager get a
    block-diagonal mask only from a model that builds its mask with transformers' ``masking_utils``
    (``create_causal_mask``: ``find_packed_sequence_indices`` reads the restarts). A model whose code builds its
    own mask (custom code, an older port) would give every document a view of the ones before it in its row.
    """
    import inspect
    import sys

    if not padding_free or attn.startswith("flash_attention"):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the transformers model
    # fully_shard swaps the class for a subclass of its own (FSDP<Class>, defined in torch): the model's own class
    cls = next((c for c in type(base).__mro__ if not c.__module__.startswith("torch.")), type(base))
    module = sys.modules.get(cls.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        source = ""
    if "create_causal_mask" in source or "masking_utils" in source:
        return None
    return (f"data: plain-text documents are packed into rows and kept apart by position ids that restart at each "
            f"document, but {cls.__name__} ({cls.__module__}) does not build its attention mask with "
            f"transformers' masking_utils, which turns those restarts into a block-diagonal mask on {attn}: its "
            "documents would attend to each other. Set model.attn_implementation=flash_attention_2 (GPUs), or "
            "data.packing=false (each sequence alone in its row)")


@contextlib.contextmanager
def trl_loads_instead(trainer_module: str, model: Any) -> Iterator[None]:
    """While a TRL trainer's ``__init__`` runs: what it would load whole and unsharded from the model's files
    (``create_model_from_path`` in ``trl.trainer.<trainer_module>``, to run as the reference) is ``model`` instead:
    our sharded reference, or None where the trainer is to have none (DPO's precomputed log-probabilities)."""
    trainer = importlib.import_module(f"trl.trainer.{trainer_module}")
    original = trainer.create_model_from_path
    trainer.create_model_from_path = lambda *args, **kwargs: model
    try:
        yield
    finally:
        trainer.create_model_from_path = original


# ----------------------------------------------------------------------------- the sharded model
@dataclass
class ShardedModel:
    """The FSDP2 model and what was decided while building it."""

    model: torch.nn.Module
    dtype: torch.dtype  # of the sharded (master) parameters: the precision's parameter dtype
    compute_dtype: torch.dtype
    attn_implementation: str
    wrap_class: str
    num_params: int
    precision: str = "fp32"
    reduce_dtype: torch.dtype = torch.float32
    load_method: str = "sliced"  # "sliced": every rank read its slice; "scatter": rank 0 read and sent them; "checkpoint": resuming, none read
    bytes_read: int = 0  # weight bytes this rank read from the safetensors files
    lora: AdapterSummary | None = None  # LoRA adapters on a frozen base (slurmft/job/adapters.py)
    base_dtype: torch.dtype | None = None  # of the base parameters (LoRA: the compute dtype; else ``dtype``)


def build_sharded_model(cfg: RunConfig, config: Any, model_dir: Path | None, ctx: DistContext,
                        weights: bool = True, frozen: bool = False) -> ShardedModel:
    """Meta model on every rank -> checked against the files on rank 0 -> FSDP2 shards -> each rank's slice read.

    ``model_dir``: where this rank sees the model's files (None where it does not; rank 0 needs them). When
    a rank cannot read the weight files, rank 0 reads them all and scatters the slices instead.
    ``weights=False`` when the job resumes a full fine-tune: the checkpoint's strict load overwrites every
    parameter and persistent buffer, so reading the base weights would only be thrown away (70B: 140 GB
    read). A LoRA checkpoint holds only the adapters: the caller reads the base weights then too.
    The shards stay uninitialised until that load; the job never trains without one succeeding
    (slurmft/job/checkpointing/fallback.py). The names and shapes are still checked.
    ``frozen``: a model that is never trained (DPO's reference, slurmft/job/dpo.py): stored in the compute dtype,
    without adapters, ``requires_grad`` off (no gradients, and the optimizer never sees it).
    """
    if frozen:
        cfg = cfg.model_copy(update={"lora": None})
    mode = guarded(ctx, "choosing the precision", lambda: choose_precision(cfg, ctx.on_gpu))
    dtype, gather, reduce = mixed_precision_dtypes(cfg, mode)
    compute = gather or dtype
    support = architecture_support(config)
    attn, why = guarded(ctx, "choosing the attention", lambda: choose_attention(cfg.model.attn_implementation,
                                                                                 ctx.on_gpu, support))
    if ctx.is_main:  # a GPU run that fell back from flash-attention says so as a warning
        fell_back = ctx.on_gpu and attn != attention.FLASH and cfg.model.attn_implementation == "auto"
        log.log(logging.WARNING if fell_back else logging.INFO,
                "attention: %s (%s); precision %s: %s parameters, %s compute, %s reduce", attn, why, mode.name,
                *(str(d).removeprefix("torch.") for d in (dtype, compute, reduce)))
    # LoRA: the frozen base needs no master copy; it is stored in the compute dtype, the adapters in fp32
    base_dtype = compute if cfg.lora is not None or frozen else dtype
    model = guarded(ctx, "building the model", lambda: _build_meta_checked(config, cfg, base_dtype, attn))
    use_generation_config(model, model_dir)
    if frozen:
        model.requires_grad_(False)
        gather = None  # stored in the compute dtype already
    wrap = wrap_class_names(model, cfg)
    lora = None
    if cfg.lora is not None:
        model, lora = guarded(ctx, "adding the LoRA adapters", lambda: adapters.add_adapters(model, cfg.lora))
    base = adapters.unwrap(model)
    plan = guarded(ctx, "checking the checkpoint", lambda: check_weights(base, model_dir) if ctx.is_main else None)
    num_params = sum(p.numel() for p in model.parameters())
    parallelize_model(model, cfg, ctx, wrap, gather, reduce, frozen)
    method, read = load_weights(base, plan, model_dir, ctx) if weights else ("checkpoint", 0)
    if lora is not None:  # a resume overwrites them from the checkpoint; the base weights are read either way
        adapters.init_adapters(model, cfg.train.seed)
        adapters.copy_saved_modules(model)
    attn = getattr(model.config, "_attn_implementation", None) or attn  # what transformers really set up
    return ShardedModel(model=model, dtype=dtype, compute_dtype=compute, attn_implementation=attn, wrap_class=sorted(wrap)[0],
                        num_params=num_params, precision=mode.name, reduce_dtype=reduce, load_method=method,
                        bytes_read=read, lora=lora, base_dtype=base_dtype)


def use_generation_config(model: torch.nn.Module, model_dir: Path | None) -> None:
    """The model files' generation_config.json on the model, as ``from_pretrained`` sets it. A model built from its
    config gets a generation config derived from config.json, which knows one EOS id and no sampling defaults;
    instruct models list their end-of-turn tokens there (Llama-3: three ids). GRPO's generation ends at each of them
    (TRL reads ``model.generation_config``), and every checkpoint saves it, which consolidation exports: derived, the
    exported model would lose the base's."""
    from transformers import GenerationConfig

    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)


def read_base_weights(sharded: ShardedModel, model_dir: Path | None, ctx: DistContext) -> int:
    """The model files' weights read into the shards of a model built with ``weights=False`` (a resumed full
    fine-tune), where the starting model is needed once more before the checkpoint's load replaces them: DPO's
    precomputed reference values computed again (slurmft/job/dpo_reference_logps.py). Bytes this rank read."""
    base = adapters.unwrap(sharded.model)
    plan = guarded(ctx, "checking the checkpoint", lambda: check_weights(base, model_dir) if ctx.is_main else None)
    _, read = load_weights(base, plan, model_dir, ctx)
    return read


def _build_meta_checked(config: Any, cfg: RunConfig, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    try:
        model = build_meta(config, cfg, dtype, attn)
    except (ValueError, ImportError) as exc:  # unsupported architecture / attention implementation
        if not (attn == "flash_attention_2" and cfg.model.attn_implementation == "auto"):
            raise JobSetupError(f"model.name_or_path: cannot build the model from its config: {exc}") from None
        # e.g. an architecture without flash-attention support: auto means "the best that works"
        fallback, _ = attention.choose("auto", architecture_support(config), "transformers refused flash-attention 2")
        log.warning("attention: transformers refused flash_attention_2 for this model (%s); falling back to %s",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__, fallback)
        return _build_meta_checked(config, cfg, dtype, fallback)
    wrap_class_names(model, cfg)
    return model


def iter_param_shards(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, parameter) pairs, for reports."""
    for name, param in model.named_parameters():
        yield strip_wrappers(name), param
