"""Reading the checkpoint's tensors, one tensor (or a few small ones) at a time: memory for the largest tensor.

Why streaming: loading every key of a sharded checkpoint before saving needs the whole model in RAM (~1x its
size; ``dcp_to_torch_save`` ~3x plus a temporary copy on disk), which is what kills consolidation jobs for
large models. Since the output is planned from the metadata alone (plan.py), the tensors can be read in file
order with ``dcp.load(..., no_dist=True)``: one at a time, or a group of consecutive small ones no larger than
the largest tensor (the read budget), each cast and written before the next is read. Peak memory is about the
largest tensor (0.13x the model on a 170M-parameter Llama, bench/consolidate_memory.py), not the model;
tests/test_consolidate.py checks that no read asks for more than the largest tensor's bytes.

A converted tensor (one layer's fused ``gate_up_proj``, plan.py) is read as its group once, converted by
transformers' ``revert_weight_conversion`` into its per-expert tensors and handed out until its last one is
written: memory stays about one group, the largest fused tensor plus its converted copy.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from slurmft.checkpoints import MODEL_DIR
from slurmft.errors import CheckpointError
from slurmft.job.consolidate.checkpoint import DCP_METADATA
from slurmft.job.consolidate.plan import TensorPlan


def open_model_checkpoint(ckpt: Path) -> CachedMetadataReader:
    """The reader of a checkpoint's sharded model, its ``.metadata`` parsed once (unreadable: a CheckpointError)."""
    model_dir = ckpt / MODEL_DIR
    return CachedMetadataReader(model_dir, read_dcp_metadata(model_dir))


class CachedMetadataReader(FileSystemReader):
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


def read_groups(tensors: list[TensorPlan], budget: int) -> Iterator[list[TensorPlan]]:
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

    def close(self) -> None:
        """Release what the reads hold open: nothing here (DCP opens the checkpoint's files per read)."""

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
