"""The merged model: the base model's weights with the trained adapters added, written as a full fine-tune's.

Unless ``consolidate.merge: false``, a LoRA run also gets the merged model in ``RUN_DIR/model/``: the same
export as a full fine-tune's (plan, shards, index, config, atomic replace, disk check) but each tensor read
from the *base* model's safetensors files (``model.name_or_path``), matched onto the model by the loader's own
check (slurmft/job/weights.py, through transformers' conversion mapping: per-expert files, fused model tensors,
save_pretrained names out), one tensor or conversion group at a time, with plain file reads (a memory-mapped
file would keep every page read in RSS). Each adapted weight becomes ``W + scaling·(B @ A)`` (PEFT's scaling of
each layer: alpha/r, or alpha/sqrt(r) with rsLoRA) computed in float32 in PEFT's order, so on a float32 model
it is bitwise PEFT's ``merge_and_unload()``; ``modules_to_save`` tensors come from the checkpoint's trained
copies.

The base found must be the one the checkpoint's marker records (:func:`check_base`: file sizes and
header-and-sample hashes), and every trained update must land in a written tensor (:func:`plan_merge`,
:meth:`MergedSource.check_all_applied`), else the merge stops before ``model/`` is put in place.
``consolidate.dtype: auto`` is the base model's file dtype here (not the training precision): the merged model
has the base model's size and every weight the adapters did not touch is its exact copy. Memory: about one
base tensor in its file dtype, its float32 copy and its update.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from slurmft.checkpoints import COMPLETE_MARKER, read_marker
from slurmft.config import RunConfig
from slurmft.errors import CheckpointError
from slurmft.job.consolidate.lora import LoraDelta, LoraLayout, adapter_scalings
from slurmft.job.consolidate.plan import ModelLayout, TensorPlan, output_dtype, plan_export
from slurmft.job.consolidate.read_dcp import TensorSource
from slurmft.job.dtypes import DTYPES, SAFETENSORS_DTYPES

log = logging.getLogger(__name__)


def plan_merged_model(
    cfg: RunConfig, ckpt: Path, out_dir: Path, reader: FileSystemReader, layout: ModelLayout, lora: LoraLayout
) -> tuple[str, list[TensorPlan], MergedSource]:
    """The merged model to write to ``out_dir``: its dtype, its tensors and their source, once the base found
    is the one the adapters trained on and every tensor of it is matched onto the model."""
    from slurmft.job.inputs import follow_trained_base, resolve_model_dir
    from slurmft.job.weights import check_weights

    # a hub base: the commit the adapters trained on, not what its branch points at now
    base_dir = resolve_model_dir(follow_trained_base(cfg.model, read_marker(ckpt).get("base")), with_weights=True)
    check_base(ckpt, cfg, base_dir)
    plan = check_weights(layout.model, base_dir)  # base file keys -> model tensors, as the loader reads them
    entries = {e.name: e for e in plan.entries}
    dtype_name = (cfg.consolidate.dtype if cfg.consolidate.dtype != "auto"
                  else base_dtype(entries, layout.expected) or output_dtype(cfg, ckpt))
    log.info("merging into the base model %s -> %s (%s, shards <= %s); W + %s * B @ A for %d weights, %d replaced "
             "by trained modules_to_save copies", base_dir, out_dir, dtype_name, cfg.consolidate.max_shard_size,
             adapter_scalings(lora), len(lora.deltas), len(lora.replaced))
    merged = plan_merge(layout, lora, entries, reader.read_metadata(), DTYPES[dtype_name])
    tensors = plan_export(merged, layout.model)
    source = MergedSource(reader, tensors, layout.model, BaseWeights(base_dir, plan.files), entries, lora)
    return dtype_name, tensors, source


def check_base(ckpt: Path, cfg: RunConfig, base_dir: Path) -> None:
    """The base model found now is the one the adapters were trained on (the marker's ``base``), else a
    CheckpointError naming both; a checkpoint from before the marker recorded it is merged with a warning."""
    from slurmft.job.inputs import base_differences, base_identity

    trained = read_marker(ckpt).get("base")
    if not isinstance(trained, dict):
        log.warning("warning: %s's %s does not record its base model (written before slurmft did); merging onto %s "
                    "unchecked", ckpt.name, COMPLETE_MARKER, base_dir)
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
        """Close the base model's files."""
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

    def close(self) -> None:
        self.base.close()

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
            counts[dtype] = counts.get(dtype, 0) + math.prod(expected[name])
    names = {v: k for k, v in DTYPES.items()}
    top = max(counts, key=counts.__getitem__, default=None)
    return names.get(top) if top is not None else None
