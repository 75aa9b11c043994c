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

What we do, before the Trainer sees the model:

1. every rank builds the model on the ``meta`` device from ``config.json`` (parameters only:
   buffers such as rotary ``inv_freq`` are computed for real, since ``to_empty`` would leave them as
   garbage and they are not in the checkpoint);
2. rank 0 checks every parameter name, shape and dtype against the safetensors headers (a mismatch
   is a :class:`JobSetupError` on every rank, before any collective that could hang);
3. activation checkpointing and ``fully_shard`` are applied per decoder layer, to the embeddings
   and to the head (as accelerate groups them), then the root; ``to_empty`` allocates only the
   local shards;
4. every rank checks that it sees every weight file with the size rank 0 saw (one all-gather), then
   reads only the part of each tensor its DTensor holds from the memory-mapped files, in the file's
   dtype, and casts it into its shard. The part comes from the tensor's mesh and placements
   (``compute_local_shape_and_global_offset``, as DCP does), so a 1-D ``Shard(0)`` mesh and an HSDP
   ``(Replicate(), Shard(0))`` mesh are the same code, and uneven row counts give the last ranks
   fewer rows, as FSDP2 does. There is no collective per tensor: one agreement at the end turns a
   read failure on any rank into the same JobSetupError, naming the file, key and rank, everywhere.

When some rank cannot see the weight files (a hub id with a node-local HF_HOME: only rank 0
downloaded them, and a copy per node is not worth its download), rank 0 reads every tensor and
*scatters* each rank's part, in the file's dtype (half the bytes of fp32 for a bf16 checkpoint);
the receiver casts. Before each scatter rank 0 broadcasts whether it read the tensor, so its read
failure ends every rank at once instead of leaving them in the collective until the time-out.

Measured (``bench/load_memory.py --file-dtype bfloat16 --repeat 3``, a 171M-parameter Llama, 2 CPU
ranks): sliced reads peak at 1.06x the fp32 shard on every rank and each rank reads half the file,
in 0.50x the time of v0.1's loader, whose rank 0 read the whole file and peaked at 1.25x (scattering
in the file's dtype instead of fp32 brings that to 1.14x, 0.72x the time). accelerate's
``_prepare_fsdp2`` sees an ``FSDPModule`` and leaves the sharding alone; its optimizer,
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

import importlib
import importlib.util
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurmft.checkpoints import strip_wrappers
from slurmft.config import ModelConfig, RunConfig
from slurmft.errors import JobSetupError
from slurmft.job.distributed import DistContext, agree, guarded
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
SAFETENSORS_DTYPES = {  # dtype codes of safetensors headers the loader reads (and the scatter sends as they are)
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


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
    load_method: str = "sliced"  # "sliced": every rank read its slice; "scatter": rank 0 read and sent them; "checkpoint": resuming, none read
    bytes_read: int = 0  # weight bytes this rank read from the safetensors files


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


@dataclass(frozen=True)
class WeightEntry:
    """One tensor to load: the model's name for it, the file and key holding it, its dtype in the file."""

    name: str  # before activation checkpointing and FSDP wrapped the modules (hf_name of today's name)
    file: str
    key: str
    dtype: str  # safetensors dtype code ("BF16", "F32", ...)


@dataclass(frozen=True)
class WeightPlan:
    """What rank 0 checked against the safetensors headers, sent to every rank before the reads."""

    entries: list[WeightEntry]
    sizes: dict[str, int]  # file name -> size in bytes, as rank 0 saw it


def _check_weights(model: torch.nn.Module, model_dir: Path) -> WeightPlan:
    """Rank 0: every tensor to load, checked by name, shape and dtype against the headers (JobSetupError if not)."""
    from safetensors import safe_open

    files = weight_files(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for file in sorted(set(files.values())):
        path = model_dir / file
        if not path.is_file():
            raise JobSetupError(f"model.name_or_path: {path} is listed in the safetensors index but missing")
        sizes[file] = path.stat().st_size
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                header = f.get_slice(key)
                shapes[key], dtypes[key] = tuple(header.get_shape()), header.get_dtype()
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
        if dtypes[key] not in SAFETENSORS_DTYPES:
            problems.append(f"{key}: dtype {dtypes[key]} in the file, which the loader does not read "
                            f"(one of {', '.join(SAFETENSORS_DTYPES)})")
            continue
        plan.append(WeightEntry(name, files[key], key, dtypes[key]))
    if problems:
        raise JobSetupError(
            f"model.name_or_path: the weights in {model_dir} do not match the architecture of its config.json",
            problems=problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else []),
        )
    unused = sorted(set(files) - {e.key for e in plan})
    if unused:
        log.warning("%d checkpoint tensor(s) not used by the model, e.g. %s", len(unused), unused[:3])
    return WeightPlan(plan, {file: sizes[file] for file in sorted({e.file for e in plan})})


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


# ----------------------------------------------------------------------------- reading the weights
Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension of the full tensor


def _region(target: torch.Tensor) -> Region | None:
    """The part of the full tensor this rank holds (None: a plain tensor, every rank holds all of it).

    Derived from the DTensor's mesh and placements, so a 1-D mesh with ``Shard(0)`` and an HSDP mesh
    with ``(Replicate(), Shard(0))`` are the same code; rows that do not divide evenly give the last
    ranks fewer rows (possibly none), exactly as FSDP2's unpadded ``to_local()``.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(target, DTensor):
        return None
    if any(type(p) not in (Shard, Replicate) for p in target.placements):
        raise RuntimeError(f"unexpected placements {target.placements}: only Shard and Replicate are loaded")
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    local = target.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard shape {tuple(local.shape)} != the computed {tuple(shape)}")
    return tuple((o, o + n) for o, n in zip(offset, shape, strict=True))


def _local(target: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return target.to_local() if isinstance(target, DTensor) else target


class _Files:
    """The safetensors files of a plan, memory-mapped on first use and closed after their last tensor."""

    def __init__(self, model_dir: Path, plan: WeightPlan, rank: int) -> None:
        self.model_dir, self.rank = model_dir, rank
        self.last_use = {e.file: i for i, e in enumerate(plan.entries)}
        self.handles: dict[str, Any] = {}
        self.bytes_read = 0

    def read(self, entry: WeightEntry, region: Region | None) -> torch.Tensor:
        """``region`` of the tensor (all of it for None), in the file's dtype; JobSetupError naming file, key, rank."""
        from safetensors import safe_open

        path = self.model_dir / entry.file
        try:
            if entry.file not in self.handles:
                self.handles[entry.file] = safe_open(str(path), framework="pt").__enter__()
            handle = self.handles[entry.file]
            if region is None:
                tensor = handle.get_tensor(entry.key)
            else:
                tensor = handle.get_slice(entry.key)[tuple(slice(a, b) for a, b in region)]
        except Exception as exc:  # OSError, SafetensorError, a slice that does not fit: the file changed
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise JobSetupError(
                f"rank {self.rank} could not read {entry.key!r} from {path} ({type(exc).__name__}: {first}); the file "
                "changed or is damaged since rank 0 checked its header: download or copy the model again"
            ) from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def done(self, index: int) -> None:
        """Unmap the file of entry ``index`` when no later entry needs it."""
        file = next((f for f, last in self.last_use.items() if last == index), None)
        if file in self.handles:
            self.handles.pop(file).__exit__(None, None, None)

    def close(self) -> None:
        """Unmap every file still open."""
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()


def _unreadable(plan: WeightPlan, model_dir: Path | None) -> str | None:
    """None when this rank sees every file of the plan with the size rank 0 saw, else why not."""
    if model_dir is None:
        return "no model directory with weights on this rank"
    for file, size in plan.sizes.items():
        path = model_dir / file
        try:
            found = path.stat().st_size
        except OSError as exc:
            return f"{path}: {exc.strerror or type(exc).__name__}"
        if found != size:
            return f"{path} has {found} bytes, rank 0's has {size}"
        if not os.access(path, os.R_OK):
            return f"{path} is not readable"
    return None


def _every_rank_reads(plan: WeightPlan, model_dir: Path | None, ctx: DistContext) -> bool:
    """True when every rank can read every weight file itself (one all-gather); else rank 0 says who cannot."""
    problems: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(problems, _unreadable(plan, model_dir))
    blind = [(rank, why) for rank, why in enumerate(problems) if why]
    if blind and ctx.is_main:
        rank, why = blind[0]
        log.warning(
            "%d of %d ranks cannot read the weight files (rank %d: %s): rank 0 reads every tensor and scatters the "
            "slices instead, which is slower for large models. Keep the model directory (or HF_HOME) on a "
            "filesystem every node sees so that every rank reads its own slice.", len(blind), ctx.world_size, rank, why,
        )
    return not blind


@torch.no_grad()
def _read_own_slices(model: torch.nn.Module, plan: WeightPlan, model_dir: Path, ctx: DistContext) -> int:
    """Every rank reads its own rows from the memory-mapped files, in the file's dtype, and casts them locally.

    No collective: a failure raises here, on the rank that failed, and :func:`agree` afterwards tells the
    others. Returns the bytes this rank read.
    """
    targets = _named_targets(model)
    files = _Files(model_dir, plan, ctx.rank)
    try:
        for i, entry in enumerate(plan.entries):
            target = targets[entry.name]
            region = _region(target)
            if region is None or all(b > a for a, b in region):  # a rank may own no rows of a small tensor
                _local(target).copy_(files.read(entry, region))
            files.done(i)
    finally:
        files.close()
    return files.bytes_read


def _numel(region: Region) -> int:
    return math.prod(b - a for a, b in region)


def _flat_part(files: _Files, entry: WeightEntry, region: Region | None, width: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """One rank's part of a tensor as ``width`` elements for the scatter: a view of the mapped file where it
    fills the width (rows are contiguous), else a zero-padded copy."""
    if region is None or not _numel(region):
        return torch.zeros(width, dtype=dtype, device=device)
    part = files.read(entry, region).reshape(-1).to(device)
    if part.numel() == width:
        return part
    padded = torch.zeros(width, dtype=dtype, device=device)
    padded[: part.numel()].copy_(part)
    return padded


@torch.no_grad()
def _scatter_weights(model: torch.nn.Module, plan: WeightPlan, model_dir: Path | None, ctx: DistContext) -> int:
    """Rank 0 reads each tensor and sends every rank its own part, in the file's dtype; the receiver casts.

    For ranks that cannot read the files. Every rank's part follows from its own mesh coordinate (gathered
    to rank 0 once), so any Shard/Replicate mesh works. Before each scatter rank 0 broadcasts whether it
    read the tensor, so a read failure ends every rank with rank 0's error instead of leaving them in a
    collective until the time-out. Returns the bytes this rank read from the files (0 except on rank 0).
    """
    targets = _named_targets(model)
    mine = [_region(targets[e.name]) for e in plan.entries]
    everyone: list[list[Region | None]] | None = [[] for _ in range(ctx.world_size)] if ctx.is_main else None
    dist.gather_object(mine, everyone, dst=0)
    widths: list[list[int]] = [[]]  # per entry: the largest part any rank gets (the scatter's chunk size)
    if ctx.is_main:
        assert everyone is not None
        widths = [[max(_numel(row[i]) if row[i] is not None else 0 for row in everyone)
                   for i in range(len(plan.entries))]]
    dist.broadcast_object_list(widths, src=0)
    comm = ctx.device
    files = _Files(model_dir, plan, ctx.rank) if ctx.is_main and model_dir is not None else None
    status = torch.zeros(1, dtype=torch.int32, device=comm)
    try:
        for i, entry in enumerate(plan.entries):
            local, dtype, region = _local(targets[entry.name]), SAFETENSORS_DTYPES[entry.dtype], mine[i]
            width = widths[0][i]
            whole: torch.Tensor | None = None  # rank 0: a plain tensor, for every rank
            parts: list[torch.Tensor] | None = None  # rank 0: each rank's part, flat, padded to ``width``
            error = None
            if ctx.is_main:
                try:
                    if files is None:
                        raise JobSetupError("rank 0 has no model directory with weights")
                    if region is None:
                        whole = files.read(entry, None).to(comm)
                    else:
                        assert everyone is not None
                        parts = [_flat_part(files, entry, row[i], width, dtype, comm) for row in everyone]
                except Exception as exc:  # noqa: BLE001 - out of memory too: the other ranks would wait for this one
                    error, whole, parts = _failure(exc, ctx.rank), None, None
                status.fill_(1 if error else 0)
            dist.broadcast(status, src=0)  # did rank 0 read the tensor? (else every rank stops here)
            if int(status.item()):
                message = [error]
                dist.broadcast_object_list(message, src=0)
                raise JobSetupError(str(message[0]))
            if region is None:
                buffer = whole if whole is not None else torch.empty(local.shape, dtype=dtype, device=comm)
                dist.broadcast(buffer, src=0)
                local.copy_(buffer)
            else:
                buffer = torch.empty(width, dtype=dtype, device=comm)
                dist.scatter(buffer, scatter_list=parts, src=0)
                if local.numel():
                    local.copy_(buffer[: local.numel()].view(local.shape))
            del whole, parts, buffer
            if files is not None:
                files.done(i)
    finally:
        if files is not None:
            files.close()
    return files.bytes_read if files is not None else 0


def _failure(exc: Exception, rank: int) -> str:
    """The message every rank raises for a failure while loading; anything but a JobSetupError (a bug, out of
    memory) also leaves its traceback in this rank's log."""
    if isinstance(exc, JobSetupError):
        return exc.render()
    log.error("rank %d failed while loading the weights", rank, exc_info=exc)
    return f"rank {rank} failed while loading the weights: {type(exc).__name__}: {exc} (traceback in its log)"


def _load_weights(model: torch.nn.Module, plan: WeightPlan | None, model_dir: Path | None,
                  ctx: DistContext) -> tuple[str, int]:
    """Fill the local shards from the files rank 0 checked: ("sliced" or "scatter", bytes this rank read)."""
    shared = [plan]
    dist.broadcast_object_list(shared, src=0)
    checked: WeightPlan = shared[0]  # type: ignore[assignment]
    if _every_rank_reads(checked, model_dir, ctx):
        assert model_dir is not None
        read, error = 0, None
        try:
            read = _read_own_slices(model, checked, model_dir, ctx)
        except Exception as exc:  # noqa: BLE001 - out of memory too: the other ranks would wait for this one
            error = _failure(exc, ctx.rank)
        agree(ctx, error, "reading the weights")
        return "sliced", read
    return "scatter", _scatter_weights(model, checked, model_dir, ctx)


def build_sharded_model(cfg: RunConfig, config: Any, model_dir: Path | None, ctx: DistContext,
                        weights: bool = True) -> ShardedModel:
    """Meta model on every rank -> checked against the files on rank 0 -> FSDP2 shards -> each rank's slice read.

    ``model_dir``: where this rank sees the model's files (None where it does not; rank 0 needs them). When
    a rank cannot read the weight files, rank 0 reads them all and scatters the slices instead.
    ``weights=False`` when the job resumes: the checkpoint's strict load overwrites every parameter
    and persistent buffer, so reading the base weights would only be thrown away (70B: 140 GB read).
    The shards stay uninitialised until that load; the job never trains without one succeeding
    (slurmft/job/checkpointing.py). The names and shapes are still checked.
    """
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
    plan = guarded(ctx, "checking the checkpoint", lambda: _check_weights(model, model_dir) if ctx.is_main else None)
    num_params = sum(p.numel() for p in model.parameters())
    _shard(model, cfg, ctx, wrap, gather, reduce)
    _materialize(model, ctx, cfg.fsdp.cpu_offload)
    method, read = _load_weights(model, plan, model_dir, ctx) if weights else ("checkpoint", 0)
    attn = getattr(model.config, "_attn_implementation", None) or attn  # what transformers really set up
    return ShardedModel(model=model, dtype=dtype, compute_dtype=compute, attn_implementation=attn, wrap_class=sorted(wrap)[0],
                        num_params=num_params, precision=mode.name, reduce_dtype=reduce, load_method=method,
                        bytes_read=read)


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
