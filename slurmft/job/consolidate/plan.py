"""What to write, decided before any tensor is read: names, shapes, dtypes, shard files and their headers.

The DCP metadata already names every tensor of the checkpoint with its shape and dtype, so the whole
output is planned from it alone: each tensor's name in the output, the dtype it is stored in, the split
into ``model-0000N-of-0000M.safetensors`` files at ``consolidate.max_shard_size`` and each file's
safetensors header (so its size is known, and the disk checked, before the first byte is written).

Why a meta-device model to plan against: a checkpoint whose keys do not match the architecture would
otherwise produce a directory that ``from_pretrained`` loads with randomly initialised, silently "missing"
weights. The model built from its config on the ``meta`` device (no memory) names every tensor
``from_pretrained`` will look for, with ``tie_word_embeddings`` aliases folded out as ``save_pretrained``
does; every key, shape and dtype mismatch is collected into one error before anything is written.

Why through transformers' conversion mapping: a model whose layout differs from its checkpoint's (fused
mixture-of-experts tensors, renamed modules: slurmft/job/conversion.py) must be exported in the layout
``save_pretrained`` writes, or vLLM, llama.cpp's converters and ``from_pretrained`` read it wrongly or
not at all. :func:`plan_export` groups the model's tensors by transformers' reversed converters and runs
them on meta tensors: the names and shapes written come from transformers itself.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from slurmft.checkpoints import read_marker, strip_wrappers
from slurmft.config import RunConfig
from slurmft.errors import CheckpointError
from slurmft.job.consolidate.checkpoint import DCP_CONTAINER
from slurmft.job.dtypes import SAFETENSORS_CODES

log = logging.getLogger(__name__)

SHARD_NAME = "model-{index:05d}-of-{total:05d}.safetensors"


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
    def numel(self) -> int:
        """Elements (parameters) in the tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes in the output file."""
        return self.numel * self.dtype.itemsize

    @property
    def source_nbytes(self) -> int:
        """Bytes held in memory while it is read."""
        return self.numel * self.source_dtype.itemsize


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
        log.info("ignored %d checkpoint entr%s that are not model tensors", ignored, "y" if ignored == 1 else "ies")
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
