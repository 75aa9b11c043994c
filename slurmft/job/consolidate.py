"""Consolidation: a sharded DCP checkpoint becomes a deployable Hugging Face model directory.

Why streaming: loading every key of a sharded checkpoint before saving needs the whole model in
RAM (~1x its size; ``dcp_to_torch_save`` ~3x plus a temporary copy on disk), which is what kills
consolidation jobs for large models. The DCP metadata already names every tensor with its shape and
dtype, so the safetensors headers — and the split into shard files — are planned before any data is
read; then one tensor (or a group of small ones no larger than the largest tensor) at a time is read
with ``dcp.load(..., no_dist=True)``, cast to the target dtype and appended to its shard file. Peak
memory is about the largest tensor (0.13x the model on a 170M-parameter Llama), not the model.

Why through transformers' conversion mapping: a model whose layout differs from its checkpoint's (fused
mixture-of-experts tensors, renamed modules: slurmft/job/conversion.py) must be exported in the layout
``save_pretrained`` writes, or vLLM, llama.cpp's converters and ``from_pretrained`` read it wrongly or
not at all. The export plan groups the model's tensors by transformers' reversed converters; a group
(one layer's ``gate_up_proj``) is read once, converted by ``revert_weight_conversion`` into its
per-expert tensors, and handed out until its last one is written: memory stays about one group, the
largest fused tensor plus its converted copy.

Why verification against a meta-device model: a checkpoint whose keys do not match the architecture
would otherwise produce a directory that ``from_pretrained`` loads with randomly initialised,
silently "missing" weights. Every check that can fail runs before the first byte is written; the
output is written into a hidden sibling directory and renamed into place only once complete, so a
failure (full disk, bad key, kill) never leaves a half-written ``model/`` behind.

Layout written, as ``save_pretrained`` writes a sharded model (tensor names included): ``model-0000N-of-0000M.safetensors``
shards split at ``max_shard_size`` plus ``model.safetensors.index.json`` (always, even for one
shard, so deployments can rely on one layout); ``config.json`` (``dtype`` = the saved dtype),
``generation_config.json`` and the tokenizer files.

LoRA runs (a ``lora`` entry in the checkpoint's COMPLETE marker): the checkpoint holds only the trainable
tensors (``lora_A``/``lora_B`` in float32, and the full ``modules_to_save`` copies), so it is matched
against PEFT's own model of it: the job's adapters (slurmft/job/adapters.py, the marker's resolved target
modules) added to a meta-device model, and ``get_peft_model_state_dict`` names each tensor. Two outputs:

- ``RUN_DIR/adapter/`` (``<out>-adapter`` with ``--out``): ``adapter_config.json`` and
  ``adapter_model.safetensors`` exactly as ``PeftModel.save_pretrained`` writes them, streamed from the
  checkpoint in the dtype they trained in (float32: the adapter is a few MB, and PEFT computes in fp32 on a
  half-precision base anyway), plus the tokenizer;
- unless ``consolidate.merge: false``, the merged model in ``RUN_DIR/model/``, the same export as above
  (plan, shards, index, config, atomic replace, disk check) but each tensor read from the *base* model's
  safetensors files (``model.name_or_path``), matched onto the model by the loader's own check
  (slurmft/job/weights.py, through transformers' conversion mapping: per-expert files, fused model
  tensors, save_pretrained names out), one tensor or conversion group at a time, with plain file reads
  (a memory-mapped file would keep every page read in RSS). Each adapted weight becomes
  ``W + scaling·(B @ A)`` (PEFT's scaling of each layer: alpha/r, or alpha/sqrt(r) with rsLoRA) computed
  in float32 in PEFT's order, so on a float32 model it is bitwise
  PEFT's ``merge_and_unload()``; ``modules_to_save`` tensors come from the checkpoint's trained copies.
  The base found must be the one the checkpoint's marker records (:func:`check_base`: file sizes and
  header-and-sample hashes), and every trained update must land in a written tensor (``plan_merge``,
  ``MergedSource.check_all_applied``), else the merge stops before ``model/`` is put in place.
  ``consolidate.dtype: auto`` is the base model's file dtype here (not the training precision): the
  merged model has the base model's size and every weight the adapters did not touch is its exact copy.
  Memory: about one base tensor in its file dtype, its float32 copy and its update.

Run by hand: ``python -m slurmft.job.consolidate RUN_DIR [--checkpoint DIR] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import struct
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from slurmft import locks
from slurmft.checkpoints import (
    COMPLETE_MARKER,
    fsync_dir,
    is_complete,
    latest_complete,
    list_checkpoints,
    named,
    peft_name,
    read_marker,
    strip_wrappers,
)
from slurmft.config import RunConfig
from slurmft.config_loading import read_run_config
from slurmft.errors import CheckpointError, LockError, SlurmftError
from slurmft.job.dtypes import DTYPES, SAFETENSORS_CODES, SAFETENSORS_DTYPES
from slurmft.rundir import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MODEL_INDEX, RunPaths, umask
from slurmft.units import decimal_bytes, parse_size, peak_rss_bytes

# accelerate's save_fsdp_model (SHARDED_STATE_DICT, FSDP2) writes the model of checkpoint-<step>/ to
# pytorch_model_fsdp_0/ with dcp.save({"model": get_model_state_dict(model)}): DCP keys are
# "model." + the Hugging Face parameter name.
MODEL_DCP_DIR = "pytorch_model_fsdp_0"
DCP_METADATA = ".metadata"
DCP_CONTAINER = "model"

SAFE_INDEX_NAME = MODEL_INDEX
ADAPTER_NAME = "default"  # PEFT's name of the one adapter the job trains (dropped from the saved names)
SHARD_NAME = "model-{index:05d}-of-{total:05d}.safetensors"

# Files that make up a tokenizer directory (copied verbatim, so the chat template the trainer used
# is the one that ships).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
)  # fmt: skip
TOKENIZER_DIRS = ("additional_chat_templates",)
TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")

# Room left on the filesystem beyond the model itself (config, tokenizer, filesystem slack).
DISK_MARGIN_BYTES = 64 * 2**20


def log(message: str) -> None:
    """One progress line; the consolidation job's stdout is its log file."""
    print(f"[slurmft.job.consolidate] {message}", flush=True)


# ------------------------------------------------------------------ which checkpoint
def describe_checkpoints(root: Path) -> str:
    """``checkpoint-5 (complete), checkpoint-10 (no COMPLETE marker)`` for error messages."""
    found = list_checkpoints(root)
    if not found:
        return f"no checkpoint-<step> directories in {root}"
    parts = []
    for _, path, complete in found:
        if not complete:
            parts.append(f"{path.name} (no {COMPLETE_MARKER} marker)")
        elif not (path / MODEL_DCP_DIR / DCP_METADATA).is_file():
            parts.append(f"{path.name} (complete, but no {MODEL_DCP_DIR}/{DCP_METADATA})")
        else:
            parts.append(f"{path.name} (complete)")
    return f"checkpoints in {root}: " + ", ".join(parts)


def resolve_checkpoint(paths: RunPaths, checkpoint: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint to consolidate: the given one, else the newest complete one; refuse torn saves."""
    root = paths.checkpoints
    if checkpoint is None:
        chosen = latest_complete(root)
        if chosen is None:
            raise CheckpointError(
                f"nothing to consolidate: no complete checkpoint (with a {COMPLETE_MARKER} marker) in {root}",
                [describe_checkpoints(root)],
            )
    else:
        chosen = named(root, checkpoint)
        if not chosen.is_dir():
            raise CheckpointError(f"checkpoint {str(chosen)!r} does not exist", [describe_checkpoints(root)])
        chosen = chosen.resolve()
    missing = []
    if not is_complete(chosen):
        missing.append(
            f"{chosen / COMPLETE_MARKER} is missing: the save did not finish on every rank (interrupted, "
            "or training is still writing it)"
        )
    if not (chosen / MODEL_DCP_DIR / DCP_METADATA).is_file():
        missing.append(
            f"{chosen / MODEL_DCP_DIR / DCP_METADATA} is missing: no sharded (DCP) model in this checkpoint"
        )
    if missing:
        raise CheckpointError(
            f"refusing to consolidate {chosen}: it is not a complete sharded checkpoint",
            [*missing, describe_checkpoints(root)],
        )
    return chosen


# ------------------------------------------------------------------ what to write
@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: where it comes from in the checkpoint and how it is stored."""

    name: str  # Hugging Face name in the output
    key: str  # DCP key in the checkpoint (of a converted tensor: the first of ``group``)
    shape: tuple[int, ...]
    source_dtype: torch.dtype
    dtype: torch.dtype
    group: tuple[tuple[str, str], ...] = ()  # converted: (DCP key, model name) of every tensor it is made from

    @property
    def nbytes(self) -> int:
        """Bytes in the output file."""
        return _numel(self.shape) * self.dtype.itemsize

    @property
    def source_nbytes(self) -> int:
        """Bytes held in memory while it is read."""
        return _numel(self.shape) * self.source_dtype.itemsize


@dataclass
class ShardPlan:
    """One safetensors file: its tensors in file order, and the header that describes them."""

    filename: str
    tensors: list[TensorPlan] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Tensor bytes in this file."""
        return sum(t.nbytes for t in self.tensors)

    def header(self) -> bytes:
        """The safetensors header (length prefix included), padded so the data starts 8-aligned."""
        entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in self.tensors:
            entries[t.name] = {
                "dtype": SAFETENSORS_CODES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        body = json.dumps(entries, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)
        return struct.pack("<Q", len(body)) + body

    @property
    def file_size(self) -> int:
        """Size of the finished file."""
        return len(self.header()) + self.nbytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class ModelLayout:
    """What ``from_pretrained`` will look for, read off a meta-device model (no memory)."""

    architecture: str
    expected: dict[str, tuple[int, ...]]  # name -> shape, tied duplicates removed
    aliases: dict[str, str]  # tied name -> the name it is stored under (lm_head -> embed_tokens)
    model: Any = None  # the meta-device model: transformers' conversion mapping is read off it


def model_layout(config: Any, trust_remote_code: bool = False) -> ModelLayout:
    """Expected names and shapes, with ``tie_word_embeddings`` aliases folded out as save_pretrained
    does (a tied tensor is stored once, under its first name)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, ImportError) as exc:
        raise CheckpointError(
            f"cannot build the model from its config to check the checkpoint against it: {exc}",
            ["if the model needs custom code, set model.trust_remote_code: true"],
        ) from None
    expected: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    # state_dict lists a tied tensor under every name; save_pretrained keeps the first.
    for name, tensor in model.state_dict(keep_vars=True).items():
        canonical = first_name.setdefault(id(tensor), name)
        if canonical == name:
            expected[name] = tuple(tensor.shape)
        else:
            aliases[name] = canonical
    return ModelLayout(type(model).__name__, expected, aliases, model)


def model_name_of_dcp_key(dcp_key: str) -> str | None:
    """The Hugging Face parameter name of a DCP key (``model.`` and wrapper segments removed), or None for non-model keys."""
    prefix = DCP_CONTAINER + "."
    if not dcp_key.startswith(prefix):
        return None
    return strip_wrappers(dcp_key[len(prefix) :])


def plan_tensors(
    metadata: Metadata, expected: dict[str, tuple[int, ...]], aliases: dict[str, str], dtype: torch.dtype
) -> list[TensorPlan]:
    """Map every checkpoint key onto an expected name; every mismatch is collected into one error."""
    found: dict[str, tuple[str, TensorStorageMetadata]] = {}  # canonical name -> (dcp key, metadata)
    unknown, ignored = [], 0
    for key, md in metadata.state_dict_metadata.items():
        name = model_name_of_dcp_key(key)
        if name is None or not isinstance(md, TensorStorageMetadata):
            ignored += 1  # non-tensor entries, anything saved outside the model container
            continue
        if name in expected:
            found[name] = (key, md)
        elif name in aliases:
            found.setdefault(aliases[name], (key, md))  # only used if the canonical name is absent
        else:
            unknown.append(key)
    problems = []
    if unknown:
        problems.append(
            f"{len(unknown)} checkpoint key(s) match no parameter of the model: "
            + ", ".join(sorted(unknown)[:8])
            + (" ..." if len(unknown) > 8 else "")
        )
    missing = [n for n in expected if n not in found]
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) of the model are not in the checkpoint: "
            + ", ".join(missing[:8])
            + (" ..." if len(missing) > 8 else "")
        )
    plans = []
    for name, shape in expected.items():
        if name not in found:
            continue
        key, md = found[name]
        if tuple(md.size) != shape:
            problems.append(f"{key}: shape {tuple(md.size)} in the checkpoint, {shape} in the model")
            continue
        source = md.properties.dtype
        target = dtype if source.is_floating_point else source  # never cast integer buffers
        if target not in SAFETENSORS_CODES:
            problems.append(f"{key}: dtype {target} cannot be stored in safetensors")
            continue
        plans.append(TensorPlan(name, key, shape, source, target))
    if problems:
        raise CheckpointError(
            "the checkpoint does not match the model's architecture (model.name_or_path config)", problems
        )
    if ignored:
        log(f"ignored {ignored} checkpoint entr{'y' if ignored == 1 else 'ies'} that are not model tensors")
    return plans


def plan_export(tensors: list[TensorPlan], model: Any) -> list[TensorPlan]:
    """The model's tensors (``plan_tensors``) -> the tensors ``save_pretrained`` writes, by transformers'
    reversed conversion mapping (slurmft/job/conversion.py): a fused expert tensor becomes one tensor per
    expert and projection, a renamed one gets its checkpoint name back. Names and shapes come from running
    the conversion on meta tensors; the outputs of one group stay together, in the group's order."""
    from slurmft.job.conversion import export_groups, export_tensors

    by_name = {t.name: t for t in tensors}
    out: list[TensorPlan] = []
    for names in export_groups(model, [t.name for t in tensors]):
        fake = {n: torch.empty(by_name[n].shape, dtype=by_name[n].source_dtype, device="meta") for n in names}
        produced = export_tensors(model, fake)
        first = by_name[names[0]]
        if len(names) == 1 and len(produced) == 1 and tuple(next(iter(produced.values())).shape) == first.shape:
            out.append(TensorPlan(next(iter(produced)), first.key, first.shape, first.source_dtype, first.dtype))
            continue
        group = tuple((by_name[n].key, n) for n in names)
        out += [TensorPlan(name, first.key, tuple(t.shape), first.source_dtype, first.dtype, group)
                for name, t in produced.items()]
    return out


def plan_shards(tensors: list[TensorPlan], max_shard_bytes: int) -> list[ShardPlan]:
    """Split tensors into files of at most ``max_shard_bytes`` (a larger tensor gets its own file), in
    order, named ``model-0000N-of-0000M.safetensors`` (always with an index, even for one file, so a
    deployment can rely on one layout)."""
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return [ShardPlan(SHARD_NAME.format(index=i, total=len(groups)), g) for i, g in enumerate(groups, 1)]


# ------------------------------------------------------------------ reading and writing
class _CachedMetadataReader(FileSystemReader):
    """A FileSystemReader that parses ``.metadata`` once instead of on every ``dcp.load``."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


def read_dcp_metadata(model_dir: Path) -> Metadata:
    """Parse a DCP checkpoint's ``.metadata``, as a CheckpointError if it is unreadable."""
    try:
        return FileSystemReader(str(model_dir)).read_metadata()
    except Exception as exc:  # a torn or foreign file: pickle, EOF and attribute errors alike
        raise CheckpointError(
            f"cannot read {model_dir / DCP_METADATA}: {exc.__class__.__name__}: {exc}"
        ) from None


def _read_groups(tensors: list[TensorPlan], budget: int) -> Iterator[list[TensorPlan]]:
    """Consecutive tensors read with one ``dcp.load``, at most ``budget`` bytes together (small norms
    and biases share a call; a large tensor is read alone)."""
    group: list[TensorPlan] = []
    size = 0
    for t in tensors:
        if group and size + t.source_nbytes > budget:
            yield group
            group, size = [], 0
        group.append(t)
        size += t.source_nbytes
    if group:
        yield group


class TensorSource:
    """Reads the planned tensors from the checkpoint: plain ones as they are, converted ones by converting
    their group once (one layer's fused experts -> its per-expert tensors) and handing out its outputs
    until the last one is written, so memory stays about one group (the largest tensor, twice)."""

    def __init__(self, reader: FileSystemReader, tensors: list[TensorPlan], model: Any) -> None:
        self.reader, self.model = reader, model
        self.remaining: dict[tuple[tuple[str, str], ...], int] = {}
        for t in tensors:
            if t.group:
                self.remaining[t.group] = self.remaining.get(t.group, 0) + 1
        self.converted: dict[tuple[tuple[str, str], ...], dict[str, torch.Tensor]] = {}

    def _load(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
        buffers = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(buffers, storage_reader=self.reader, no_dist=True)
        return buffers

    def _load_plain(self, batch: list[TensorPlan]) -> dict[str, torch.Tensor]:
        """The unconverted tensors of ``batch`` by key, with one ``dcp.load``."""
        return self._load({t.key: (t.shape, t.source_dtype) for t in batch})

    def _load_group(self, t: TensorPlan) -> dict[str, torch.Tensor]:
        """The model tensors a converted tensor is made from, by model name."""
        shapes = self.reader.read_metadata().state_dict_metadata
        loaded = self._load({key: (tuple(shapes[key].size), t.source_dtype)  # type: ignore[union-attr]
                             for key, _ in t.group})
        return {name: loaded.pop(key) for key, name in t.group}

    def read(self, batch: list[TensorPlan]) -> Iterator[tuple[TensorPlan, torch.Tensor]]:
        """Each tensor of ``batch`` (as stored in the checkpoint's dtype), in order."""
        plain = self._load_plain([t for t in batch if not t.group])
        for t in batch:
            if not t.group:
                yield t, plain.pop(t.key)
                continue
            if t.group not in self.converted:
                from slurmft.job.conversion import export_tensors

                self.converted[t.group] = export_tensors(self.model, self._load_group(t))
            yield t, self.converted[t.group].pop(t.name)
            self.remaining[t.group] -= 1
            if not self.remaining[t.group]:
                del self.converted[t.group]


def write_shard(
    source: TensorSource, shard: ShardPlan, path: Path, read_budget: int,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write one safetensors file: header first, then each tensor as it is read and cast.

    ``progress`` is called with the bytes written after each group of tensors.
    """
    with open(path, "wb") as f:
        f.write(shard.header())
        for group in _read_groups(shard.tensors, read_budget):
            for t, tensor in source.read(group):
                data = tensor.to(t.dtype).contiguous().reshape(-1)
                del tensor
                raw = data.view(torch.uint8).numpy()
                if raw.nbytes != t.nbytes:  # our bug, not the user's
                    raise RuntimeError(f"{t.name}: read {raw.nbytes} bytes, planned {t.nbytes}")
                f.write(raw)
                if progress is not None:
                    progress(raw.nbytes)
                del data, raw
        f.flush()
        os.fsync(f.fileno())


def verify_output(directory: Path, shards: list[ShardPlan], expected: dict[str, tuple[int, ...]]) -> None:
    """Re-read every written header: each expected tensor present once, with its shape; sizes exact."""
    from safetensors import safe_open

    seen: dict[str, tuple[int, ...]] = {}
    problems = []
    for shard in shards:
        path = directory / shard.filename
        if path.stat().st_size != shard.file_size:
            problems.append(f"{shard.filename}: {path.stat().st_size} bytes, expected {shard.file_size}")
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in seen:
                    problems.append(f"{name} is stored twice")
                seen[name] = tuple(f.get_slice(name).get_shape())
    for name, shape in expected.items():
        if name not in seen:
            problems.append(f"{name} is missing from the written files")
        elif seen[name] != shape:
            problems.append(f"{name}: written with shape {seen[name]}, the model expects {shape}")
    extra = sorted(set(seen) - set(expected))
    if extra:
        problems.append(f"unexpected tensors written: {', '.join(extra[:8])}")
    if problems:
        raise CheckpointError(f"verification of the consolidated model in {directory} failed", problems)


def write_index(directory: Path, shards: list[ShardPlan]) -> None:
    """``model.safetensors.index.json`` as save_pretrained writes it for sharded models."""
    weight_map = {t.name: s.filename for s in shards for t in s.tensors}
    index = {
        "metadata": {
            "total_parameters": sum(_numel(t.shape) for s in shards for t in s.tensors),
            "total_size": sum(s.nbytes for s in shards),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / SAFE_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


# ------------------------------------------------------------------ config and tokenizer
def _is_local_dir(value: str | None) -> bool:
    return bool(value) and Path(os.path.expanduser(value)).is_dir()


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_MARKERS)


def config_for_export(cfg: RunConfig, ckpt: Path) -> tuple[Any, str]:
    """The model config (the checkpoint's copy if the trainer wrote one) and where it came from."""
    from transformers import AutoConfig

    source = str(ckpt) if (ckpt / "config.json").is_file() else cfg.model.name_or_path
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.model.trust_remote_code}
    if cfg.model.revision and not _is_local_dir(source):
        kwargs["revision"] = cfg.model.revision
    try:
        return AutoConfig.from_pretrained(os.path.expanduser(source), **kwargs), source
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot read the model config from {source!r}: {exc}",
            ["model.name_or_path must be a local directory with config.json, or a hub id in the local "
             "Hugging Face cache (compute nodes often have no network)"],
        ) from None  # fmt: skip


def write_model_config(
    config: Any, directory: Path, dtype_name: str, architecture: str, sources: list[Path | str]
) -> None:
    """``config.json`` with the saved dtype, and ``generation_config.json`` (the first source's that
    has one, else derived from the config, as save_pretrained does)."""
    config.dtype = dtype_name
    if not getattr(config, "architectures", None):
        config.architectures = [architecture]
    config.save_pretrained(directory)
    generation_config(config, sources).save_pretrained(directory)


def generation_config(config: Any, sources: list[Path | str]) -> Any:
    """The first source's generation config (local directory or cached hub id), else the config's."""
    from transformers import GenerationConfig

    for source in sources:
        local = Path(os.path.expanduser(str(source)))
        if (local / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(local)
        if not local.exists():
            try:
                return GenerationConfig.from_pretrained(str(source))
            except (OSError, ValueError):
                continue
    return GenerationConfig.from_model_config(config)


def tokenizer_source(cfg: RunConfig, ckpt: Path) -> str:
    """Where the tokenizer comes from: the checkpoint if the trainer saved it there, else the config
    (a local directory there must hold one; a hub id is looked up when it is written)."""
    if _has_tokenizer(ckpt):
        return str(ckpt)
    source = cfg.model.tokenizer or cfg.model.name_or_path
    local = Path(os.path.expanduser(source))
    if local.is_dir() and not _has_tokenizer(local):
        raise CheckpointError(
            f"no tokenizer in {local} (none of {', '.join(TOKENIZER_MARKERS)}), and none saved in {ckpt}",
            ["set model.tokenizer to the tokenizer's directory or hub id"],
        )
    return source


def write_tokenizer(source: str, directory: Path, cfg: RunConfig) -> list[str]:
    """Copy a local tokenizer's files verbatim, or save a cached hub tokenizer; returns the files."""
    local = Path(os.path.expanduser(source))
    if local.is_dir():
        copied = []
        for name in TOKENIZER_FILES:
            if (local / name).is_file():
                shutil.copy2(local / name, directory / name)
                copied.append(name)
        for name in TOKENIZER_DIRS:
            if (local / name).is_dir():
                shutil.copytree(local / name, directory / name)
                copied.append(name + "/")
        return copied
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": cfg.model.trust_remote_code}
    if cfg.model.revision and source == cfg.model.name_or_path:
        kwargs["revision"] = cfg.model.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load the tokenizer {source!r}: {exc}",
            ["set model.tokenizer to a local directory, or make sure the hub cache on this node has it"],
        ) from None
    before = set(os.listdir(directory))
    tokenizer.save_pretrained(directory)
    return sorted(set(os.listdir(directory)) - before)


# ------------------------------------------------------------------ the output directory
def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def _old_prefix(out: Path) -> str:
    return f".{out.name}.old-"


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """Hold the consolidation lock of ``out``: an exclusive-create lock file with owner, host and heartbeat
    (slurmft/locks.py), because flock is node-local or missing on some Lustre and NFS mounts and two
    consolidations on two nodes would both get it."""
    lock_path = RunPaths.consolidate_lock(out)
    try:
        locks.acquire(lock_path, f"consolidate into {out}", log)
    except LockError as exc:
        raise CheckpointError(f"another consolidation is writing {out} right now: {exc}") from None
    try:
        yield
    finally:
        locks.release(lock_path)


def _clean_leftovers(out: Path) -> None:
    """Remove what a killed consolidation left next to ``out`` (it would only fill the disk)."""
    for child in out.parent.iterdir():
        if child.name.startswith(_partial_prefix(out)) and child.is_dir():
            log(f"removing {child}, left by an interrupted consolidation")
            shutil.rmtree(child, ignore_errors=True)
        elif child.name.startswith(_old_prefix(out)) and child.is_dir():
            if out.exists():
                log(f"removing {child}, the previous model left by an interrupted replace")
                shutil.rmtree(child, ignore_errors=True)
            else:  # killed between the two renames: the old model is the only complete one
                os.rename(child, out)


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished ``tmp`` at ``out``; an existing ``out`` is only removed once ``tmp`` is there."""
    old = None
    if out.exists():
        old = out.parent / f"{_old_prefix(out)}{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_disk_space(parent: Path, needed: int) -> None:
    """Fail before writing anything if the model cannot fit."""
    free = shutil.disk_usage(parent).free
    if needed + DISK_MARGIN_BYTES > free:
        raise CheckpointError(
            f"not enough disk space for the consolidated model: needs {decimal_bytes(needed)}, "
            f"{decimal_bytes(free)} free at {parent}",
            ["free space there, or write elsewhere with --out DIR"],
        )


# ------------------------------------------------------------------ LoRA checkpoints
@dataclass(frozen=True)
class LoraDelta:
    """How one base weight changes in the merge: ``W + scaling * (B @ A)`` (``B @ A`` transposed for an
    embedding and a ``fan_in_fan_out`` layer, as PEFT's ``get_delta_weight``)."""

    a: str  # DCP key of lora_A (lora_embedding_A)
    b: str  # DCP key of lora_B (lora_embedding_B)
    scaling: float  # PEFT's layer scaling: alpha / r (alpha / sqrt(r) with use_rslora)
    transpose: bool


@dataclass(frozen=True)
class LoraLayout:
    """A LoRA checkpoint read against PEFT's own model of it: the job's adapters added to a meta-device
    model (slurmft/job/adapters.py), so names and layer kinds are PEFT's, not a copy of its rules."""

    config: Any  # peft's LoraConfig as ``save_pretrained`` writes it (adapter_config.json)
    adapter: list[TensorPlan]  # name = PEFT's saved name (``get_peft_model_state_dict``), key = the DCP key
    deltas: dict[str, LoraDelta]  # model tensor name -> its update
    replaced: dict[str, str]  # model tensor name -> DCP key of its trained ``modules_to_save`` copy
    unmergeable: list[str]  # why the merge cannot be done (adapters on layers it does not handle)


def lora_of(ckpt: Path) -> dict[str, Any] | None:
    """The ``lora`` entry of a checkpoint's COMPLETE marker; None for a full fine-tuning checkpoint."""
    lora = read_marker(ckpt).get("lora")
    return lora if isinstance(lora, dict) else None


def lora_layout(config: Any, cfg: RunConfig, lora: dict[str, Any], metadata: Metadata, ckpt: Path) -> LoraLayout:
    """Every adapter tensor of the checkpoint matched onto PEFT's model of the marker's ``lora`` entry (the
    resolved target modules), with the name PEFT saves it under; a mismatch is one CheckpointError."""
    from peft.tuners.lora import Embedding as LoraEmbedding
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper, get_peft_model_state_dict
    from pydantic import ValidationError
    from transformers import AutoModelForCausalLM

    from slurmft.config import LoraConfig
    from slurmft.job.adapters import add_adapters

    # The run's own lora section, as the job used it (all-linear resolved by PEFT on this model), else the
    # marker's record of it; either way the rebuilt adapters must be the ones the marker describes.
    section = cfg.lora
    if section is None:
        try:
            section = LoraConfig(r=lora["r"], alpha=lora["alpha"], dropout=lora.get("dropout", 0.0),
                                 use_rslora=bool(lora.get("use_rslora", False)),
                                 target_modules=list(lora["target_modules"]),
                                 modules_to_save=list(lora.get("modules_to_save") or []))
        except (KeyError, TypeError, ValidationError) as exc:
            raise CheckpointError(f"the lora entry of {ckpt / COMPLETE_MARKER} is not readable: {exc}") from None
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    peft_model, summary = add_adapters(base, section)
    rebuilt = summary.marker()
    differ = [f"{k}: {lora.get(k)!r} in the checkpoint, {rebuilt[k]!r} rebuilt from the run's lora section"
              for k in rebuilt if k in lora and lora[k] != rebuilt[k]]
    if differ:
        raise CheckpointError(f"the run's lora section does not rebuild the adapters {ckpt.name} was trained with "
                              "(was config.yaml edited?)", differ)

    index: dict[str, str] = {}  # PeftModel state-dict name -> DCP key
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(DCP_CONTAINER + ".") and isinstance(md, TensorStorageMetadata):
            index[peft_name(key[len(DCP_CONTAINER) + 1 :])] = key
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    problems = []
    unknown, missing = sorted(set(index) - set(trainable)), sorted(set(trainable) - set(index))
    if unknown:
        problems.append(f"{len(unknown)} checkpoint tensor(s) are not adapters of this LoRA configuration: "
                        + ", ".join(index[n] for n in unknown[:8]) + (" ..." if len(unknown) > 8 else ""))
    if missing:
        problems.append(f"{len(missing)} adapter tensor(s) are not in the checkpoint: "
                        + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
    for name in sorted(set(index) & set(trainable)):
        size = tuple(metadata.state_dict_metadata[index[name]].size)  # type: ignore[union-attr]
        if size != tuple(trainable[name].shape):
            problems.append(f"{index[name]}: shape {size} in the checkpoint, {tuple(trainable[name].shape)} in the adapters")
    if problems:
        raise CheckpointError(
            f"the checkpoint does not match its LoRA adapters (the lora entry of its {COMPLETE_MARKER} marker on the "
            "architecture of model.name_or_path)", problems)

    # PEFT's own naming: what PeftModel.save_pretrained writes, tensor by tensor (its values are ours, unchanged).
    by_id = {id(p): n for n, p in trainable.items()}
    saved = get_peft_model_state_dict(peft_model, state_dict=dict(trainable), save_embedding_layers=False)
    if sorted(by_id.get(id(v), "?") for v in saved.values()) != sorted(trainable):  # our bug, not the user's
        raise RuntimeError(f"PEFT saves {len(saved)} tensors, the checkpoint has {len(trainable)} adapter tensors")
    adapter = []
    for saved_name, value in saved.items():
        key = index[by_id[id(value)]]
        md = metadata.state_dict_metadata[key]
        dtype = md.properties.dtype  # type: ignore[union-attr]
        adapter.append(TensorPlan(saved_name, key, tuple(md.size), dtype, dtype))  # type: ignore[union-attr]

    deltas: dict[str, LoraDelta] = {}
    replaced: dict[str, str] = {}
    other: dict[str, list[str]] = {}  # LoRA layer kind the merge does not handle -> module names
    for name, module in peft_model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            for p, _ in module.modules_to_save[ADAPTER_NAME].named_parameters():
                replaced[strip_wrappers(f"{name}.{p}")] = index[f"{name}.modules_to_save.{ADAPTER_NAME}.{p}"]
        elif isinstance(module, LoraLinear) and ADAPTER_NAME in module.lora_A:
            deltas[strip_wrappers(name) + ".weight"] = LoraDelta(
                index[f"{name}.lora_A.{ADAPTER_NAME}.weight"], index[f"{name}.lora_B.{ADAPTER_NAME}.weight"],
                float(module.scaling[ADAPTER_NAME]), bool(module.fan_in_fan_out))
        elif isinstance(module, LoraEmbedding) and ADAPTER_NAME in module.lora_embedding_A:
            deltas[strip_wrappers(name) + ".weight"] = LoraDelta(
                index[f"{name}.lora_embedding_A.{ADAPTER_NAME}"], index[f"{name}.lora_embedding_B.{ADAPTER_NAME}"],
                float(module.scaling[ADAPTER_NAME]), True)
        elif isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            other.setdefault(type(module).__name__, []).append(strip_wrappers(name))
    unmergeable = [f"{len(names)} LoRA {kind} layer(s), e.g. {', '.join(dict.fromkeys(names[:2]))}: the merge "
                   "handles LoRA on linear and embedding layers only (a ParamWrapper adapts a parameter, such as "
                   "fused mixture-of-experts tensors or a router); set consolidate.merge: false to write the "
                   "adapter only" for kind, names in other.items()]

    peft_config = copy.deepcopy(peft_model.peft_config[ADAPTER_NAME])
    peft_config.base_model_name_or_path = cfg.model.name_or_path
    peft_config.revision = cfg.model.revision
    peft_config.inference_mode = True  # as PeftModel.save_pretrained writes it
    return LoraLayout(peft_config, adapter, deltas, replaced, unmergeable)


def check_base(ckpt: Path, cfg: RunConfig, base_dir: Path) -> None:
    """The base model found now is the one the adapters were trained on (the marker's ``base``), else a
    CheckpointError naming both; a checkpoint from before the marker recorded it is merged with a warning."""
    from slurmft.job.inputs import base_differences, base_identity

    trained = read_marker(ckpt).get("base")
    if not isinstance(trained, dict):
        log(f"warning: {ckpt.name}'s {COMPLETE_MARKER} does not record its base model (written before slurmft did); "
            f"merging onto {base_dir} unchecked")
        return
    now = base_identity(cfg.model, base_dir)
    differ = base_differences(trained, now)
    if differ:
        def where(b: dict[str, Any]) -> str:
            return f"{b.get('name_or_path')} ({b.get('dir')}{', revision ' + b['revision'] if b.get('revision') else ''})"
        raise CheckpointError(
            f"the base model is not the one {ckpt.name} was trained on: trained on {where(trained)}, found "
            f"{where(now)}; merging would put the adapters onto another model. Point model.name_or_path (and "
            "model.revision) at the base it trained on, or set consolidate.merge: false to write the adapter only",
            differ)


def write_adapter(
    reader: FileSystemReader, lora: LoraLayout, directory: Path, tok_source: str, cfg: RunConfig,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` writes them,
    plus the tokenizer; the tensors are streamed from the checkpoint in the dtype they trained in. Returns
    the tokenizer files."""
    shard = ShardPlan(ADAPTER_WEIGHTS, lora.adapter)
    write_shard(TensorSource(reader, lora.adapter, None), shard, directory / ADAPTER_WEIGHTS,
                max(t.source_nbytes for t in lora.adapter), progress)
    verify_output(directory, [shard], {t.name: t.shape for t in lora.adapter})
    lora.config.save_pretrained(str(directory))
    tokenizer_files = write_tokenizer(tok_source, directory, cfg)
    _verify_tokenizer(directory, cfg, tokenizer_files)
    return tokenizer_files


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, delta: LoraDelta) -> torch.Tensor:
    """``W + scaling * (B @ A)`` in float32, in PEFT's order (``get_delta_weight``: the product, transposed
    if the layer stores W transposed, times the scaling; then added to W), rounded once by the caller."""
    update = b.float() @ a.float()
    if delta.transpose:
        update = update.T
    update = update * delta.scaling
    merged = weight if weight.dtype == torch.float32 else weight.float()  # a fresh read: ours to change
    return merged.add_(update)


class BaseWeights:
    """The base model's safetensors files, one whole tensor per read, by plain file reads.

    Not memory-mapped (``safe_open``): the pages of a mapped file that were read stay in the process's RSS
    (and its cgroup's memory) until the file is unmapped, so reading a one-file base model through a map
    would grow to the model's size. ``reads`` lists the bytes of every read (the memory test checks it).
    """

    def __init__(self, model_dir: Path, files: dict[str, str]) -> None:
        self.model_dir, self.files = model_dir, files
        self.handles: dict[str, tuple[Any, int, dict[str, Any]]] = {}
        self.reads: list[int] = []

    def _open(self, file: str) -> tuple[Any, int, dict[str, Any]]:
        if file not in self.handles:
            f = open(self.model_dir / file, "rb")  # noqa: SIM115 (closed by close())
            (length,) = struct.unpack("<Q", f.read(8))
            self.handles[file] = (f, 8 + length, json.loads(f.read(length)))
        return self.handles[file]

    def read(self, key: str, region: Any = None) -> torch.Tensor:
        """Checkpoint tensor ``key``, whole, in the file's dtype (``region`` is always None here)."""
        path = self.model_dir / self.files[key]
        try:
            f, start, header = self._open(self.files[key])
            info = header[key]
            begin, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]])
            if end > begin:
                f.seek(start + begin)
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                done = 0
                while done < end - begin:
                    got = f.readinto(view[done:])
                    if not got:
                        raise EOFError(f"the file ends {end - begin - done} bytes early")
                    done += got
        except (OSError, ValueError, KeyError, EOFError, struct.error) as exc:
            raise CheckpointError(f"cannot read {key!r} from the base model's {path}: {type(exc).__name__}: {exc}",
                                  ["the base model (model.name_or_path) changed or is damaged since training"]) from None
        self.reads.append(end - begin)
        return tensor if region is None else tensor[tuple(slice(a, b) for a, b in region)]

    def close(self) -> None:
        for f, _, _ in self.handles.values():
            f.close()
        self.handles.clear()


class MergedSource(TensorSource):
    """The merged model's tensors: each base tensor read from the base model's files (through transformers'
    conversion, as the loader reads it), plus its LoRA update, or replaced by its ``modules_to_save`` copy.
    One model tensor (one conversion group) at a time, like the plain export."""

    def __init__(self, reader: FileSystemReader, tensors: list[TensorPlan], model: Any, base: BaseWeights,
                 entries: dict[str, Any], lora: LoraLayout) -> None:
        super().__init__(reader, tensors, model)
        self.base, self.entries, self.lora = base, entries, lora
        self.applied: set[str] = set()  # model tensors written with their update (check_all_applied)

    def _checkpoint_tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        md = self.reader.read_metadata().state_dict_metadata
        return self._load({k: (tuple(md[k].size), md[k].properties.dtype) for k in keys})  # type: ignore[union-attr]

    def model_tensor(self, name: str) -> torch.Tensor:
        """Model tensor ``name`` of the merged model (float32 where an update was added)."""
        from slurmft.job.conversion import read_region

        if name in self.lora.replaced:
            key = self.lora.replaced[name]
            return self._checkpoint_tensors([key])[key]
        weight = read_region(self.entries[name].sources, name, None, self.base.read, self.model)
        delta = self.lora.deltas.get(name)
        if delta is None:
            return weight
        ab = self._checkpoint_tensors([delta.a, delta.b])
        self.applied.add(name)
        return merged_weight(weight, ab[delta.a], ab[delta.b], delta)

    def check_all_applied(self) -> None:
        """Every trained update went into a written tensor (else the merged model is not the trained one)."""
        missed = sorted(set(self.lora.deltas) - self.applied)
        if missed:
            raise CheckpointError(f"{len(missed)} trained LoRA update(s) were not applied to the merged model",
                                  [f"{name}: trained ({self.lora.deltas[name].a}), not written" for name in missed])

    def _load_plain(self, batch: list[TensorPlan]) -> dict[str, torch.Tensor]:
        return {t.key: self.model_tensor(t.key) for t in batch}

    def _load_group(self, t: TensorPlan) -> dict[str, torch.Tensor]:
        return {name: self.model_tensor(name) for _, name in t.group}


def plan_merge(
    layout: ModelLayout, lora: LoraLayout, entries: dict[str, Any], metadata: Metadata, dtype: torch.dtype
) -> list[TensorPlan]:
    """The merged model's tensors, by model name (``key`` = the model name: MergedSource reads them), from
    the base weights the loader's check matched (``entries``), the updates and the trained copies."""
    problems = list(lora.unmergeable)
    tied = set(layout.aliases) | set(layout.aliases.values())
    for name in sorted(set(lora.replaced) & tied):
        problems.append(f"{name}: a modules_to_save copy of a tied weight (tie_word_embeddings); the merged model "
                        "cannot keep the tie and the trained copy. Use the adapter (consolidate.merge: false)")
    plans = []
    for name, shape in layout.expected.items():
        if name in lora.replaced:
            md = metadata.state_dict_metadata[lora.replaced[name]]
            source = md.properties.dtype  # type: ignore[union-attr]
            if tuple(md.size) != shape:  # type: ignore[union-attr]
                problems.append(f"{lora.replaced[name]}: shape {tuple(md.size)} in the checkpoint, {shape} in the model")  # type: ignore[union-attr]
        elif name in entries:
            source = SAFETENSORS_DTYPES[entries[name].dtype]
        else:
            problems.append(f"{name}: not in the base model's weights")
            continue
        delta = lora.deltas.get(name)
        if delta is not None:
            a = tuple(metadata.state_dict_metadata[delta.a].size)  # type: ignore[union-attr]
            b = tuple(metadata.state_dict_metadata[delta.b].size)  # type: ignore[union-attr]
            update = (a[1], b[0]) if delta.transpose else (b[0], a[1])
            if update != shape:
                problems.append(f"{name}: B @ A has shape {update}, the weight {shape}")
            source = torch.float32  # the merge holds it in float32
        target = dtype if source.is_floating_point else source
        plans.append(TensorPlan(name, name, shape, source, target))
    for name in sorted(set(lora.deltas) - {p.name for p in plans}):  # e.g. the tied head: not a tensor of its own
        alias = layout.aliases.get(name)
        problems.append(f"{name}: the adapters trained an update of it, but the merged model has no such tensor"
                        + (f" (it is {alias}, tied: tie_word_embeddings)" if alias else "")
                        + "; the merge would leave the update out. Train without an adapter on it (lora.target_modules)")
    if problems:
        raise CheckpointError("cannot merge the adapters into the base model", problems)
    return plans


def base_dtype(entries: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> str | None:
    """The dtype most of the base model's floating-point weights are stored in (a name of DTYPES), if one."""
    counts: dict[torch.dtype, int] = {}
    for name, entry in entries.items():
        dtype = SAFETENSORS_DTYPES[entry.dtype]
        if dtype.is_floating_point and name in expected:
            counts[dtype] = counts.get(dtype, 0) + _numel(expected[name])
    names = {v: k for k, v in DTYPES.items()}
    top = max(counts, key=counts.__getitem__, default=None)
    return names.get(top) if top is not None else None


# ------------------------------------------------------------------ the whole job
def output_dtype(cfg: RunConfig, ckpt: Path) -> str:
    """consolidate.dtype, with ``auto`` = the compute dtype of the precision the checkpoint was trained in.

    The train job records the resolved precision in the COMPLETE marker (``auto`` depends on the
    device it ran on, which this CPU job cannot know); an older marker without it falls back to the
    config resolved for the allocation's device.
    """
    from slurmft.precision import PRECISIONS, consolidated_dtype, resolve

    saved = read_marker(ckpt).get("precision")
    mode = PRECISIONS.get(saved) if saved else None
    if mode is None:
        mode = resolve(cfg.train.precision, on_gpu=cfg.resources.gpus_per_node > 0)
    return consolidated_dtype(cfg.consolidate.dtype, mode)


@contextlib.contextmanager
def new_directory(out: Path, needed: int) -> Iterator[Path]:
    """A hidden sibling of ``out`` to fill, put at ``out`` when the block ends without error (removed if it
    fails: a full disk, a bad key or a kill never leaves a half-written output), under ``out``'s lock, after
    the leftovers of an interrupted run are removed and ``needed`` bytes are known to fit."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):  # one consolidation per output at a time
        _clean_leftovers(out)
        check_disk_space(out.parent, needed)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=_partial_prefix(out)))
        tmp.chmod(0o777 & ~umask())  # mkdtemp makes it 0700; the model is for the team and the serving account
        try:
            yield tmp
            fsync_dir(tmp)
            replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def write_model(
    directory: Path, source: TensorSource, shards: list[ShardPlan], write_config: Callable[[Path], None],
    tok_source: str, cfg: RunConfig, progress: Callable[[int], None] | None = None,
) -> None:
    """Fill ``directory`` with the model as save_pretrained lays it out: config, tokenizer, the shards
    (tensors streamed from ``source``), the index last; then re-read and check what was written."""
    write_config(directory)
    tokenizer_files = write_tokenizer(tok_source, directory, cfg)
    tensors = [t for s in shards for t in s.tensors]
    read_budget = max(t.source_nbytes for t in tensors)
    for shard in shards:
        t0 = time.monotonic()
        write_shard(source, shard, directory / shard.filename, read_budget, progress)
        log(
            f"wrote {shard.filename}: {len(shard.tensors)} tensors, {decimal_bytes(shard.file_size)} "
            f"in {time.monotonic() - t0:.1f} s"
        )
    write_index(directory, shards)
    verify_output(directory, shards, {t.name: t.shape for t in tensors})
    _verify_tokenizer(directory, cfg, tokenizer_files)


def _describe(tensors: list[TensorPlan], shards: list[ShardPlan]) -> str:
    return (f"{len(tensors)} tensors, {sum(_numel(t.shape) for t in tensors):,} parameters, "
            f"{decimal_bytes(sum(s.file_size for s in shards))} in {len(shards)} file(s)")


def consolidate_run(
    run_dir: str, checkpoint: str | None = None, out: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Consolidate a run's newest complete checkpoint (or ``checkpoint``) into a Hugging Face model
    directory at ``<run_dir>/model`` (or ``out``); returns a summary of what was written.

    A LoRA checkpoint (its COMPLETE marker has ``lora``) becomes ``<run_dir>/adapter`` (``<out>-adapter``
    with ``out``) and, unless ``consolidate.merge`` is false, the merged model at ``<run_dir>/model``.
    ``progress(done_bytes, total_bytes)`` is called as tensors are written (a progress bar in a terminal).
    """
    started = time.monotonic()
    paths = RunPaths.of(run_dir)
    cfg = read_run_config(paths.config)
    ckpt = resolve_checkpoint(paths, checkpoint)
    out_dir = Path(out).expanduser().resolve() if out else paths.model
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"output {out_dir} exists and is not a directory")
    lora = lora_of(ckpt)
    adapter_dir = (out_dir.with_name(out_dir.name + "-adapter") if out else paths.adapter) if lora else None
    merge = lora is None or cfg.consolidate.merge
    max_shard_bytes = parse_size(cfg.consolidate.max_shard_size)

    # Every check that can fail, before the first byte is written.
    model_dir = ckpt / MODEL_DCP_DIR
    metadata = read_dcp_metadata(model_dir)
    reader = _CachedMetadataReader(model_dir, metadata)
    config, config_source = config_for_export(cfg, ckpt)
    layout = model_layout(config, cfg.model.trust_remote_code)
    adapter: LoraLayout | None = None
    base: BaseWeights | None = None
    if lora is None:
        dtype_name = output_dtype(cfg, ckpt)
        log(f"checkpoint {ckpt} -> {out_dir} ({dtype_name}, shards <= {cfg.consolidate.max_shard_size})")
        tensors = plan_export(plan_tensors(metadata, layout.expected, layout.aliases, DTYPES[dtype_name]),
                              layout.model)
        source = TensorSource(reader, tensors, layout.model)
    else:
        adapter = lora_layout(config, cfg, lora, metadata, ckpt)
        adapter_bytes = ShardPlan(ADAPTER_WEIGHTS, adapter.adapter).file_size
        log(f"LoRA checkpoint {ckpt} (r={lora['r']}, alpha={lora['alpha']}, {', '.join(lora['target_modules'])}"
            f"{', modules_to_save ' + ', '.join(lora['modules_to_save']) if lora.get('modules_to_save') else ''})"
            f" -> adapter {adapter_dir}: {len(adapter.adapter)} tensors, {decimal_bytes(adapter_bytes)}")
        if merge:
            from slurmft.job.inputs import follow_trained_base, resolve_model_dir
            from slurmft.job.weights import check_weights

            # a hub base: the commit the adapters trained on, not what its branch points at now
            base_dir = resolve_model_dir(follow_trained_base(cfg.model, read_marker(ckpt).get("base")),
                                         with_weights=True)
            check_base(ckpt, cfg, base_dir)
            plan = check_weights(layout.model, base_dir)  # base file keys -> model tensors, as the loader reads them
            entries = {e.name: e for e in plan.entries}
            dtype_name = (cfg.consolidate.dtype if cfg.consolidate.dtype != "auto"
                          else base_dtype(entries, layout.expected) or output_dtype(cfg, ckpt))
            log(f"merging into the base model {base_dir} -> {out_dir} ({dtype_name}, shards <= "
                f"{cfg.consolidate.max_shard_size}); W + {adapter_scalings(adapter)} * B @ A for "
                f"{len(adapter.deltas)} weights, {len(adapter.replaced)} replaced by trained modules_to_save copies")
            merged = plan_merge(layout, adapter, entries, metadata, DTYPES[dtype_name])
            tensors = plan_export(merged, layout.model)
            base = BaseWeights(base_dir, plan.files)
            source = MergedSource(reader, tensors, layout.model, base, entries, adapter)
        else:
            log(f"consolidate.merge is false: only the adapter is written, no merged model in {out_dir}")
            tensors = []
    shards = plan_shards(tensors, max_shard_bytes) if merge else []
    tok_source = tokenizer_source(cfg, ckpt)
    model_bytes = sum(s.file_size for s in shards)
    total_bytes = model_bytes + (adapter_bytes if adapter is not None else 0)
    if merge:
        log(f"{_describe(tensors, shards)}; config from {config_source}, tokenizer from {tok_source}")
    done = [0]

    def advance(nbytes: int) -> None:
        done[0] += nbytes
        if progress is not None:
            progress(done[0], total_bytes)

    try:
        if adapter is not None and adapter_dir is not None:
            t0 = time.monotonic()
            same_disk = merge and out_dir.parent == adapter_dir.parent
            with new_directory(adapter_dir, adapter_bytes + (model_bytes if same_disk else 0)) as tmp:
                write_adapter(reader, adapter, tmp, tok_source, cfg, advance)
            log(f"wrote {adapter_dir}: {ADAPTER_CONFIG}, {ADAPTER_WEIGHTS} ({decimal_bytes(adapter_bytes)}) and "
                f"the tokenizer in {time.monotonic() - t0:.1f} s")
        if merge:
            def write_config(directory: Path) -> None:
                write_model_config(config, directory, dtype_name, layout.architecture, [ckpt, config_source])

            with new_directory(out_dir, model_bytes) as tmp:
                write_model(tmp, source, shards, write_config, tok_source, cfg, advance)
                if isinstance(source, MergedSource):
                    source.check_all_applied()  # before the directory is put in place
    finally:
        if base is not None:
            base.close()

    summary: dict[str, Any] = {
        "output": str(out_dir if merge else adapter_dir),
        "model": str(out_dir) if merge else None,
        "checkpoint": str(ckpt),
        "dtype": dtype_name if merge else None,
        "files": sorted(os.listdir(out_dir)) if merge else [],
        "shards": [s.filename for s in shards],
        "total_bytes": total_bytes,
        "tensors": len(tensors),
        "parameters": sum(_numel(t.shape) for t in tensors),
    }
    if adapter is not None:
        summary["adapter"] = {
            "output": str(adapter_dir), "files": sorted(os.listdir(adapter_dir)) if adapter_dir else [],
            "tensors": len(adapter.adapter), "parameters": sum(_numel(t.shape) for t in adapter.adapter),
            "bytes": adapter_bytes, "merged_weights": len(adapter.deltas) if merge else 0,
        }
        if not merge:
            summary["parameters"] = summary["adapter"]["parameters"]
    summary["seconds"] = round(time.monotonic() - started, 2)
    summary["peak_rss_bytes"] = peak_rss_bytes()
    wrote = f"{out_dir} ({decimal_bytes(model_bytes)}, {summary['parameters']:,} parameters)" if merge else ""
    if adapter is not None:
        wrote = ", ".join(filter(None, [f"adapter {adapter_dir} ({decimal_bytes(adapter_bytes)})", wrote]))
    log(f"done: {wrote} in {summary['seconds']} s, peak RSS {decimal_bytes(summary['peak_rss_bytes'])}")
    return summary


def adapter_scalings(lora: LoraLayout) -> str:
    """``2`` (alpha / r), or ``{0.5, 2}`` if layers differ."""
    values = sorted({d.scaling for d in lora.deltas.values()})
    return f"{values[0]:g}" if len(values) == 1 else "{" + ", ".join(f"{v:g}" for v in values) + "}"


def _verify_tokenizer(directory: Path, cfg: RunConfig, files: list[str]) -> None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(directory), trust_remote_code=cfg.model.trust_remote_code)
    except Exception as exc:  # any failure here means the output would not be deployable
        raise CheckpointError(
            f"the tokenizer files copied into the output do not load: {exc.__class__.__name__}: {exc}",
            [f"copied: {', '.join(files) or 'nothing'}"],
        ) from None


# ------------------------------------------------------------------ by hand
def main(argv: list[str] | None = None) -> int:
    """``python -m slurmft.job.consolidate RUN_DIR [--checkpoint DIR] [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog="python -m slurmft.job.consolidate",
        description="Stream a run's sharded checkpoint into a Hugging Face model directory.",
    )
    parser.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/)")
    parser.add_argument(
        "--checkpoint", help="checkpoint directory or name like checkpoint-500 (default: newest complete)"
    )
    parser.add_argument("--out", help="output directory (default: RUN_DIR/model)")
    args = parser.parse_args(argv)
    try:
        summary = consolidate_run(args.run_dir, checkpoint=args.checkpoint, out=args.out)
    except SlurmftError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
