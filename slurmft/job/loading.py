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
from slurmft.job.rendezvous import JobEnv
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


def choose_attention(requested: str, on_gpu: bool) -> tuple[str, str]:
    """(attn_implementation, why): flash_attention_2 when transformers can use it on a GPU, else sdpa.

    ``auto`` falls back to SDPA with the reason (the run works, slower). An explicit
    ``flash_attention_2`` is honoured or refused with a JobSetupError, never silently replaced: the
    user asked for it, and SDPA with packing can cost several times the GPU hours.
    """
    if requested not in ("auto", "flash_attention_2"):
        return requested, "set by model.attn_implementation"
    problem = flash_attention_problem(on_gpu)
    if problem is None:
        return "flash_attention_2", "transformers can use flash-attn 2 on this CUDA device"
    if requested == "flash_attention_2":
        raise JobSetupError(
            f"model.attn_implementation=flash_attention_2 but {problem}; {FLASH_FIX}, or set "
            "model.attn_implementation=auto (falls back to PyTorch SDPA) or sdpa"
        )
    fix = "" if problem == "no CUDA device" else f"; for flash-attention: {FLASH_FIX}"
    return "sdpa", f"{problem}; falling back to PyTorch SDPA{fix}"


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


# --- HSDP (issue 11, item 10) ---------------------------------------------------------------
HSDP_DIM_NAMES = ("replicate", "shard")


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
# --- end HSDP ------------------------------------------------------------------------------


def _shard(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext, wrap: set[str], compute: torch.dtype | None,
           reduce: torch.dtype) -> None:
    """Activation checkpointing, then FSDP2 units: each decoder layer, embeddings, head, root.

    ``compute``: the dtype parameters are gathered in (None: as stored); ``reduce``: the gradient reduce dtype.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = fsdp_mesh(cfg, ctx)
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


def _row_chunks(target: Any, world: int) -> tuple[int, list[int]]:
    """(number of dim-0 chunks, the chunk each global rank holds) under a DTensor's mesh and placements.

    ``(Shard(0),)`` on a 1-D mesh: rank r holds chunk r. HSDP's ``(Replicate(), Shard(0))``: the chunk
    is the rank's coordinate on the shard dim, the same on every replica.
    """
    from torch.distributed.tensor import Replicate, Shard

    layout = target.device_mesh.mesh  # global ranks, shaped like the mesh
    sharded = [d for d, p in enumerate(target.placements) if isinstance(p, Shard) and p.dim == 0]
    known = all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in target.placements)
    if len(sharded) != 1 or not known or layout.numel() != world:
        raise RuntimeError(f"unexpected placements {target.placements} on mesh {tuple(layout.shape)}")
    chunk_of = [int((layout == r).nonzero()[0][sharded[0]]) for r in range(world)]
    return int(layout.shape[sharded[0]]), chunk_of


@torch.no_grad()
def _scatter_weights(model: torch.nn.Module, plan: list[tuple[str, str, str]], model_dir: Path | None,
                     ctx: DistContext) -> None:
    """Rank 0 reads each tensor once and scatters row chunks (Shard(0), per replica under HSDP); every other
    rank gets its own slice only."""
    from torch.distributed.tensor import DTensor

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
                count, chunk_of = _row_chunks(target, world)
                local = target.to_local()
                rows, rest = target.shape[0], tuple(target.shape[1:])
                chunk = math.ceil(rows / count)
                mine = max(0, min(chunk, rows - chunk_of[rank] * chunk))
                recv = torch.empty((chunk, *rest), dtype=local.dtype, device=comm)
                chunks = None
                if ctx.is_main:
                    full = read(file, key).to(device=comm, dtype=local.dtype)
                    if rows != chunk * count:
                        padded = full.new_zeros((chunk * count, *rest))
                        padded[:rows].copy_(full)
                        full = padded
                    pieces = list(full.contiguous().chunk(count))
                    chunks = [pieces[chunk_of[r]] for r in range(world)]
                    del full, pieces
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


def build_sharded_model(cfg: RunConfig, config: Any, model_dir: Path | None, ctx: DistContext) -> ShardedModel:
    """Meta model on every rank -> checked against the files on rank 0 -> FSDP2 shards -> weights scattered."""
    mode = guarded(ctx, "choosing the precision", lambda: choose_precision(cfg, ctx.on_gpu))
    dtype, gather, reduce = mixed_precision_dtypes(cfg, mode)
    compute = gather or dtype
    attn, why = guarded(ctx, "choosing the attention", lambda: choose_attention(cfg.model.attn_implementation,
                                                                                 ctx.on_gpu))
    if ctx.is_main:  # a GPU run that fell back from flash-attention says so as a warning
        fell_back = ctx.on_gpu and attn == "sdpa" and cfg.model.attn_implementation == "auto"
        log.log(logging.WARNING if fell_back else logging.INFO,
                "attention: %s (%s); precision %s: %s parameters, %s compute, %s reduce", attn, why, mode.name,
                *(str(d).removeprefix("torch.") for d in (dtype, compute, reduce)))
    model = guarded(ctx, "building the model", lambda: _build_meta_checked(config, cfg, dtype, attn))
    wrap = _wrap_class_names(model, cfg)
    plan = guarded(ctx, "checking the checkpoint", lambda: _check_weights(model, model_dir) if ctx.is_main else [])
    num_params = sum(p.numel() for p in model.parameters())
    _shard(model, cfg, ctx, wrap, gather, reduce)
    _materialize(model, ctx, cfg.fsdp.cpu_offload)
    _scatter_weights(model, plan, model_dir, ctx)
    attn = getattr(model.config, "_attn_implementation", None) or attn  # what transformers really set up
    return ShardedModel(model=model, dtype=dtype, compute_dtype=compute, attn_implementation=attn, wrap_class=sorted(wrap)[0],
                        num_params=num_params, precision=mode.name, reduce_dtype=reduce)


def _build_meta_checked(config: Any, cfg: RunConfig, dtype: torch.dtype, attn: str) -> torch.nn.Module:
    try:
        model = _build_meta(config, cfg, dtype, attn)
    except (ValueError, ImportError) as exc:  # unsupported architecture / attention implementation
        if not (attn == "flash_attention_2" and cfg.model.attn_implementation == "auto"):
            raise JobSetupError(f"model.name_or_path: cannot build the model from its config: {exc}") from None
        # e.g. an architecture without flash-attention support: auto means "the best that works"
        log.warning("attention: transformers refused flash_attention_2 for this model (%s); falling back to sdpa",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return _build_meta_checked(config, cfg, dtype, "sdpa")
    _wrap_class_names(model, cfg)
    return model


def iter_param_shards(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, parameter) pairs, for reports."""
    for name, param in model.named_parameters():
        yield hf_name(name), param
