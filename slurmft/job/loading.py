"""Model, tokenizer and weights: memory-efficient loading straight into FSDP2 shards.

What accelerate does (1.15, ``fsdp2_prepare_model`` with ``cpu_ram_efficient_loading``): it needs
a model that transformers already loaded in full on rank 0 (anonymous memory: 1x the model, 2x
when mixed precision upcasts a bf16 checkpoint to fp32), moves it to ``meta``, shards it, then
*broadcasts* every full parameter to every rank, each of which cuts its shard out
(``distribute_tensor``). Every rank therefore holds one full parameter at a time, and the model
reaches accelerate through the Trainer while some ranks hold meta tensors.

What we do instead, before the Trainer sees the model:

1. every rank builds the model on the ``meta`` device from ``config.json`` (parameters only:
   buffers such as rotary ``inv_freq`` are computed for real, since ``to_empty`` would leave them as
   garbage and they are not in the checkpoint);
2. rank 0 checks every parameter name and shape against the safetensors headers (a mismatch is a
   :class:`JobSetupError` on every rank, before any collective that could hang);
3. activation checkpointing and ``fully_shard`` are applied per decoder layer, to the embeddings
   and to the head (as accelerate groups them), then the root; ``to_empty`` allocates only the
   local shards;
4. rank 0 reads one tensor at a time from the (memory-mapped) safetensors files and *scatters* the
   row chunks: every other rank only ever receives its own 1/world_size slice of each tensor.

Peak anonymous memory is therefore about one shard plus one tensor on every rank (rank 0 adds the
page cache of the file it reads). accelerate's ``_prepare_fsdp2`` sees an ``FSDPModule`` and leaves
the sharding alone; its optimizer, checkpointing and state-dict code work on it unchanged.

Precision (``train.precision``, reconciled with ``model.dtype`` by the config; the table is
slurmft/precision.py): the sharded parameters are allocated in the mode's parameter dtype (float32
for ``bf16-mixed``/``fp32``, bfloat16 for ``bf16-true``), so the gradients FSDP2 shards and the AdamW
state (``zeros_like`` the parameter) follow it, and DCP checkpoints store it. The FSDP2
mixed-precision policy gathers parameters in the compute dtype and reduce-scatters gradients in
``fsdp.reduce_dtype``: 16 bytes/parameter of training state for ``bf16-mixed``, 8 for ``bf16-true``,
as ``slurmft estimate`` counts.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurmft.checkpoints import strip_wrappers
from slurmft.config import ModelConfig, RunConfig
from slurmft.errors import JobSetupError
from slurmft.job.distributed import DistContext, guarded
from slurmft.precision import Precision
from slurmft.precision import reduce_dtype as configured_reduce_dtype
from slurmft.precision import resolve as resolve_precision

log = logging.getLogger("slurmft.job")

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
CONFIG_FILES = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- locating files
def _local_path(value: str, field: str) -> Path | None:
    """The local directory ``value`` names, None for a hub id; JobSetupError for a missing local path."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise JobSetupError(f"{field}: {value!r} is a file; give the model directory (with config.json)")
        return path.resolve()
    if value.startswith(("/", "./", "../", "~")) or value.count("/") > 1:
        raise JobSetupError(
            f"{field}: local directory {value!r} does not exist (give an existing directory with config.json "
            "and *.safetensors, or a hub id like meta-llama/Llama-2-7b-hf)"
        )
    return None


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], field: str) -> Path:
    """Download (or find in the cache) the files of a hub repository matching ``patterns``."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # RepositoryNotFound, GatedRepo, LocalEntryNotFound (offline), HTTP errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise JobSetupError(
            f"{field}: could not get {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {first}). "
            "Check the id and revision; gated models need HF_TOKEN exported where you run 'slurmft submit'; "
            "offline nodes need the model in HF_HOME's cache or a local directory."
        ) from None


def resolve_model_dir(model: ModelConfig, with_weights: bool) -> Path:
    """Local directory holding config.json (and, when ``with_weights``, the safetensors files)."""
    local = _local_path(model.name_or_path, "model.name_or_path")
    if local is None:
        patterns = CONFIG_FILES + (WEIGHT_FILES if with_weights else [])
        local = _snapshot(model.name_or_path, model.revision, patterns, "model.name_or_path")
    if not (local / "config.json").is_file():
        raise JobSetupError(f"model.name_or_path: {local} has no config.json; it is not a Hugging Face model directory")
    return local


def resolve_tokenizer_dir(model: ModelConfig, model_dir: Path) -> Path:
    """Local directory of the tokenizer (``model.tokenizer`` or the model's own)."""
    if not model.tokenizer:
        return model_dir
    local = _local_path(model.tokenizer, "model.tokenizer")
    return local if local is not None else _snapshot(model.tokenizer, None, CONFIG_FILES, "model.tokenizer")


def weight_files(model_dir: Path) -> dict[str, str]:
    """Checkpoint key -> safetensors file name (from the index, or the single file)."""
    index = model_dir / SAFE_INDEX
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError) as exc:
            raise JobSetupError(f"model.name_or_path: {index} is not a valid safetensors index ({exc})") from None
    single = model_dir / SAFE_WEIGHTS
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), SAFE_WEIGHTS)
    others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    raise JobSetupError(
        f"model.name_or_path: {model_dir} has no {SAFE_WEIGHTS} or {SAFE_INDEX}"
        + (f" (found {', '.join(others)}: only safetensors weights are read; convert them with "
           "save_pretrained(..., safe_serialization=True))" if others else "")
    )


# ----------------------------------------------------------------------------- choices
def choose_dtype(model: ModelConfig, on_gpu: bool) -> torch.dtype:
    """Compute dtype: ``auto`` is bfloat16 on GPU, float32 on CPU."""
    if model.dtype == "auto":
        return torch.bfloat16 if on_gpu else torch.float32
    if model.dtype != "float32" and not on_gpu:
        log.warning("model.dtype=%s on CPU: supported but ~4x slower than float32 here", model.dtype)
    return DTYPES[model.dtype]


# --- precision (issue 10) -------------------------------------------------------------------
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
# --- end precision -------------------------------------------------------------------------


def choose_attention(requested: str, on_gpu: bool) -> tuple[str, str]:
    """(attn_implementation, why): flash_attention_2 when flash-attn imports on a GPU, else sdpa."""
    if requested not in ("auto", "flash_attention_2"):
        return requested, "set by model.attn_implementation"
    problem = None
    if not on_gpu:
        problem = "no CUDA device"
    elif importlib.util.find_spec("flash_attn") is None:
        problem = "flash-attn is not installed (pip install 'slurmft[flash]')"
    else:
        try:
            flash_attn = importlib.import_module("flash_attn")
        except Exception as exc:  # ABI mismatch with torch is the usual one
            problem = f"flash-attn is installed but does not import ({type(exc).__name__}: {exc})"
        else:
            version = getattr(flash_attn, "__version__", "?")
            return "flash_attention_2", f"flash-attn {version} imports and a CUDA device is present"
    if requested == "flash_attention_2":
        raise JobSetupError(f"model.attn_implementation=flash_attention_2 but {problem}; use auto or sdpa")
    return "sdpa", f"{problem}; falling back to PyTorch SDPA"


def load_model_config(model_dir: Path, model: ModelConfig, max_seq_length: int) -> Any:
    """The transformers config, checked against data.max_seq_length."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=model.trust_remote_code)
    except Exception as exc:
        raise JobSetupError(f"model.name_or_path: cannot read {model_dir / 'config.json'}: {exc}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    from slurmft.checks import seq_length_problem

    problem = seq_length_problem(max_seq_length, getattr(text, "max_position_embeddings", None))
    if problem:
        raise JobSetupError(problem)
    return config


def load_tokenizer(tokenizer_dir: Path, cfg: RunConfig) -> Any:
    """The tokenizer, with a chat template TRL can train on (else a JobSetupError that says the fix)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as exc:
        raise JobSetupError(f"model.tokenizer: cannot load a tokenizer from {tokenizer_dir}: {exc}") from None
    template_path = cfg.train.sft.get("chat_template_path")
    if template_path:
        path = Path(str(template_path)).expanduser()
        if path.suffix not in (".jinja", ".j2"):
            raise JobSetupError(
                "train.sft.chat_template_path: only a .jinja/.j2 template file is supported (cloning a template "
                "from another tokenizer adds tokens, which needs an embedding resize the sharded model cannot do)"
            )
        if not path.is_file():
            raise JobSetupError(f"train.sft.chat_template_path: {str(path)!r} does not exist")
        tokenizer.chat_template = path.read_text()
    if not tokenizer.chat_template:
        raise JobSetupError(
            f"the tokenizer at {tokenizer_dir} has no chat template, so conversations cannot be formatted. Use a "
            "tokenizer that has one (model.tokenizer, e.g. the model's -chat/-instruct sibling with the same "
            "vocabulary), or set train.sft.chat_template_path to a .jinja file (with {% generation %} markers "
            "around assistant replies for data.assistant_only_loss)"
        )
    if cfg.data.assistant_only_loss:
        from trl.chat_template_utils import get_training_chat_template

        try:
            get_training_chat_template(tokenizer)
        except ValueError:
            raise JobSetupError(
                f"data.assistant_only_loss needs {{% generation %}} markers around assistant replies in the chat "
                f"template, and the template of {tokenizer_dir} has none (nor does TRL know how to add them). Set "
                "data.assistant_only_loss: false (loss on every token) or point train.sft.chat_template_path at a "
                "template with the markers"
            ) from None
    return tokenizer


# ----------------------------------------------------------------------------- the sharded model
def hf_name(name: str) -> str:
    """Checkpoint name of a (possibly wrapped) module parameter name."""
    return strip_wrappers(name)


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


def _build_meta(config: Any, cfg: RunConfig, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn, trust_remote_code=cfg.model.trust_remote_code
        )
    model.tie_weights()  # not done under init_empty_weights; a no-op unless the config ties embeddings
    model.config.use_cache = False
    return model


def _wrap_class_names(model: torch.nn.Module, cfg: RunConfig) -> set[str]:
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


def _check_weights(model: torch.nn.Module, model_dir: Path) -> list[tuple[str, str, str]]:
    """Rank 0: (model name, file, key) for every tensor to load; JobSetupError on a mismatch."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        path = model_dir / file
        if not path.is_file():
            raise JobSetupError(f"model.name_or_path: {path} is listed in the safetensors index but missing")
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shapes[key] = tuple(f.get_slice(key).get_shape())
    plan, problems = [], []
    wanted = [(n, p, True) for n, p in model.named_parameters()]
    wanted += [(n, b, False) for n, b in model.named_buffers() if hf_name(n) in files]  # persistent ones saved
    for name, tensor, required in wanted:
        key = hf_name(name)
        if key not in files:
            if required:
                problems.append(f"{key}: missing from the checkpoint")
            continue
        if shapes.get(key) != tuple(tensor.shape):
            problems.append(f"{key}: checkpoint shape {shapes.get(key)} != model shape {tuple(tensor.shape)}")
            continue
        plan.append((name, files[key], key))
    if problems:
        raise JobSetupError(
            f"model.name_or_path: the weights in {model_dir} do not match the architecture of its config.json",
            problems=problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else []),
        )
    unused = sorted(set(files) - {k for _, _, k in plan})
    if unused:
        log.warning("%d checkpoint tensor(s) not used by the model, e.g. %s", len(unused), unused[:3])
    return plan


def _shard(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext, wrap: set[str], compute: torch.dtype | None,
           reduce: torch.dtype) -> None:
    """Activation checkpointing, then FSDP2 units: each decoder layer, embeddings, head, root.

    ``compute``: the dtype parameters are gathered in (None: as stored); ``reduce``: the gradient reduce dtype.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": cfg.fsdp.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce),
        "offload_policy": CPUOffloadPolicy() if cfg.fsdp.cpu_offload else OffloadPolicy(),
    }
    layer_names = [n for n, m in model.named_modules() if type(m).__name__ in wrap]
    for name in layer_names:
        layer = model.get_submodule(name)
        if cfg.fsdp.activation_checkpointing:
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
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
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})


@torch.no_grad()
def _materialize(model: torch.nn.Module, ctx: DistContext, offload: bool) -> None:
    """Allocate the local shards; put back the buffers computed at construction."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if offload else ctx.device)
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        persistent = attr not in module._non_persistent_buffers_set
        module.register_buffer(attr, value.to(ctx.device), persistent=persistent)


def _named_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by checkpoint name (wrapper segments removed)."""
    targets = {hf_name(n): p for n, p in model.named_parameters()}
    targets.update((hf_name(n), b) for n, b in model.named_buffers())
    return targets


@torch.no_grad()
def _scatter_weights(model: torch.nn.Module, plan: list[tuple[str, str, str]], model_dir: Path | None,
                     ctx: DistContext) -> None:
    """Rank 0 reads each tensor once and scatters row chunks (Shard(0)); other ranks get their slice only."""
    from torch.distributed.tensor import DTensor, Shard

    names = [plan] if ctx.is_main else [None]
    dist.broadcast_object_list(names, src=0)
    order: list[tuple[str, str, str]] = names[0]  # type: ignore[assignment]
    targets = _named_targets(model)
    world, rank, comm = ctx.world_size, ctx.rank, ctx.device
    last_use = {file: i for i, (_, file, _) in enumerate(order)}
    handles: dict[str, Any] = {}  # open safetensors files (rank 0), closed once their last tensor is sent

    def read(file: str, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if file not in handles:
            handles[file] = safe_open(str(model_dir / file), framework="pt").__enter__()
        return handles[file].get_tensor(key)

    try:
        for i, (name, file, key) in enumerate(order):
            target = targets[name]
            if isinstance(target, DTensor):
                if tuple(target.placements) != (Shard(0),):
                    raise RuntimeError(f"{name}: unexpected placements {target.placements}")
                local = target.to_local()
                rows, rest = target.shape[0], tuple(target.shape[1:])
                chunk = math.ceil(rows / world)
                mine = max(0, min(chunk, rows - rank * chunk))
                recv = torch.empty((chunk, *rest), dtype=local.dtype, device=comm)
                chunks = None
                if ctx.is_main:
                    full = read(file, key).to(device=comm, dtype=local.dtype)
                    if rows != chunk * world:
                        padded = full.new_zeros((chunk * world, *rest))
                        padded[:rows].copy_(full)
                        full = padded
                    chunks = list(full.contiguous().chunk(world))
                    del full
                dist.scatter(recv, scatter_list=chunks, src=0)
                local.copy_(recv[:mine])
                del chunks, recv
            else:  # replicated tensor (a persistent buffer): every rank needs all of it
                buf = torch.empty_like(target, device=comm)
                if ctx.is_main:
                    buf.copy_(read(file, key))
                dist.broadcast(buf, src=0)
                target.copy_(buf)
            if last_use[file] == i and file in handles:  # unmap what is no longer needed
                handles.pop(file).__exit__(None, None, None)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def build_sharded_model(cfg: RunConfig, config: Any, model_dir: Path | None, ctx: DistContext,
                        weights: bool = True) -> ShardedModel:
    """Meta model on every rank -> checked against the files on rank 0 -> FSDP2 shards -> weights scattered.

    ``weights=False`` when the job resumes: the checkpoint's strict load overwrites every parameter
    and persistent buffer, so reading the base weights would only be thrown away (rank 0 reading
    the whole model: 140 GB at 70B). The shards stay uninitialised until that load; the job never
    trains without one succeeding (slurmft/job/fallback.py). The names and shapes are still checked.
    """
    mode = guarded(ctx, "choosing the precision", lambda: choose_precision(cfg, ctx.on_gpu))
    dtype, gather, reduce = mixed_precision_dtypes(cfg, mode)
    compute = gather or dtype
    attn, why = choose_attention(cfg.model.attn_implementation, ctx.on_gpu)
    if ctx.is_main:
        log.info("attention: %s (%s); precision %s: %s parameters, %s compute, %s reduce", attn, why, mode.name,
                 *(str(d).removeprefix("torch.") for d in (dtype, compute, reduce)))
    model = guarded(ctx, "building the model", lambda: _build_meta_checked(config, cfg, dtype, attn))
    wrap = _wrap_class_names(model, cfg)
    plan = guarded(ctx, "checking the checkpoint", lambda: _check_weights(model, model_dir) if ctx.is_main else [])
    num_params = sum(p.numel() for p in model.parameters())
    _shard(model, cfg, ctx, wrap, gather, reduce)
    _materialize(model, ctx, cfg.fsdp.cpu_offload)
    if weights:
        _scatter_weights(model, plan, model_dir, ctx)
    return ShardedModel(model=model, dtype=dtype, compute_dtype=compute, attn_implementation=attn, wrap_class=sorted(wrap)[0],
                        num_params=num_params, precision=mode.name, reduce_dtype=reduce)


def _build_meta_checked(config: Any, cfg: RunConfig, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    try:
        model = _build_meta(config, cfg, dtype, attn)
    except (ValueError, ImportError) as exc:  # unsupported architecture / attention implementation
        raise JobSetupError(f"model.name_or_path: cannot build the model from its config: {exc}") from None
    _wrap_class_names(model, cfg)
    return model


def iter_param_shards(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, parameter) pairs, for reports."""
    for name, param in model.named_parameters():
        yield hf_name(name), param
