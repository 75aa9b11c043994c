"""The base weights, read straight into the FSDP2 shards: every rank reads its own slice.

What transformers does (``from_pretrained``): every rank that loads reads whole tensors, and a
checkpoint that does not match its config loads with the missing tensors initialised at random, with
a warning; accelerate then broadcasts every full parameter from rank 0 (slurmft/job/loading.py has the
whole comparison). Why that is not enough: a rank holds a full parameter at a time, a wrong
checkpoint trains, and a read failure on one rank leaves the others in a collective until the time-out.

What we do, once the model is sharded on the meta device and its shards allocated
(slurmft/job/parallelize.py):

1. rank 0 checks every parameter name, shape and dtype against the safetensors headers
   (:func:`check_weights`; a mismatch is a :class:`JobSetupError` on every rank, before any
   collective that could hang), and sends the :class:`WeightPlan` to every rank. Checkpoint keys
   are matched onto parameters by transformers' own conversion mapping (slurmft/job/conversion.py):
   a fused mixture-of-experts parameter is built from its per-expert tensors, and a rank's
   ``Shard(0)`` slice of it reads only the experts in that slice;
2. every rank checks that it sees every weight file with the size rank 0 saw (one all-gather), then
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
in the file's dtype instead of fp32 brings that to 1.14x, 0.72x the time).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurmft.checkpoints import is_adapter_name, strip_wrappers
from slurmft.errors import JobSetupError
from slurmft.job.conversion import Region, Sources, plan_loading, read_region
from slurmft.job.distributed import DistContext, agree
from slurmft.job.dtypes import SAFETENSORS_DTYPES
from slurmft.job.inputs import weight_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightEntry:
    """One model tensor to load: its name, the checkpoint tensors it is built from, their dtype in the file."""

    name: str  # before activation checkpointing and FSDP wrapped the modules (strip_wrappers of today's name)
    sources: Sources  # one key (maybe renamed), or the keys transformers' converter fuses (slurmft/job/conversion.py)
    dtype: str  # safetensors dtype code ("BF16", "F32", ...)

    @property
    def keys(self) -> list[str]:
        return self.sources.all_keys


@dataclass(frozen=True)
class WeightPlan:
    """What rank 0 checked against the safetensors headers, sent to every rank before the reads."""

    entries: list[WeightEntry]
    sizes: dict[str, int]  # file name -> size in bytes, as rank 0 saw it
    files: dict[str, str]  # checkpoint key -> file name, for the keys the entries read


def check_weights(model: torch.nn.Module, model_dir: Path) -> WeightPlan:
    """Rank 0: every tensor to load, checked by name, shape and dtype against the headers (JobSetupError if not).

    Checkpoint keys are matched onto the model's tensors by transformers' own conversion mapping (renamed
    keys, per-expert tensors fused into one), so a missing expert is named here, before anything is read.
    """
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
    required = {strip_wrappers(n): tuple(p.shape) for n, p in model.named_parameters() if not is_adapter_name(n)}
    buffers = {strip_wrappers(n): tuple(b.shape) for n, b in model.named_buffers() if not is_adapter_name(n)}
    targets = {**{n: s for n, s in buffers.items() if n not in required}, **required}
    mapped = plan_loading(model, {k: shapes[k] for k in files if k in shapes}, targets)
    problems = list(mapped.problems)
    problems += [f"{key}: listed in the safetensors index but not in its file" for key in files if key not in shapes]
    plan = []
    for key in required:
        if key not in mapped.sources and not any(p.startswith(key + ":") or p.endswith(f"(it is part of {key})")
                                                 for p in mapped.problems):
            problems.append(f"{key}: missing from the checkpoint")
    for name in [n for n in targets if n in mapped.sources]:  # parameters, then the persistent buffers saved
        sources = mapped.sources[name]
        if sources.converter is None and shapes[sources.keys[0][0]] != targets[name]:
            problems.append(f"{name}: checkpoint shape {shapes[sources.keys[0][0]]} != model shape {targets[name]}")
            continue
        kinds = sorted({dtypes[k] for k in sources.all_keys})
        bad = [d for d in kinds if d not in SAFETENSORS_DTYPES]
        if bad or len(kinds) > 1:
            problems.append(f"{name}: dtype {'/'.join(kinds)} in the file, which the loader does not read "
                            f"(one of {', '.join(SAFETENSORS_DTYPES)}, the same for every tensor it is built from)")
            continue
        plan.append(WeightEntry(name, sources, kinds[0]))
    if problems:
        raise JobSetupError(
            f"model.name_or_path: the weights in {model_dir} do not match the architecture of its config.json",
            problems=problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else []),
        )
    order = {strip_wrappers(n): i for i, (n, _) in enumerate(model.named_parameters())}
    plan.sort(key=lambda e: order.get(e.name, len(order)))  # the model's order: files are read front to back
    used = {k for e in plan for k in e.keys}
    unused = sorted(set(mapped.unused) | (set(files) - used))
    if unused:
        log.warning("%d checkpoint tensor(s) not used by the model, e.g. %s", len(unused), unused[:3])
    return WeightPlan(plan, {file: sizes[file] for file in sorted({files[k] for k in used})},
                      {k: files[k] for k in sorted(used)})


def _named_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of the base model by checkpoint name (wrapper segments removed; no adapters)."""
    targets = {strip_wrappers(n): p for n, p in model.named_parameters() if not is_adapter_name(n)}
    targets.update((strip_wrappers(n), b) for n, b in model.named_buffers() if not is_adapter_name(n))
    return targets


# ----------------------------------------------------------------------------- reading the weights

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


def local_part(target: torch.Tensor) -> tuple[torch.Tensor, Region | None]:
    """(this rank's local tensor, the region of the full tensor it holds; None: all of it)."""
    return _local(target), _region(target)


class _Files:
    """The safetensors files of a plan, memory-mapped on first use and closed after their last tensor."""

    def __init__(self, model_dir: Path, plan: WeightPlan, rank: int, model: torch.nn.Module) -> None:
        self.model_dir, self.rank, self.files, self.model = model_dir, rank, plan.files, model
        self.last_use = {plan.files[k]: i for i, e in enumerate(plan.entries) for k in e.keys}
        self.handles: dict[str, Any] = {}
        self.bytes_read = 0

    def read(self, entry: WeightEntry, region: Region | None) -> torch.Tensor:
        """``region`` of the model tensor (all of it for None), in the file's dtype, built from the checkpoint
        tensors transformers' conversion names (a fused expert tensor: only the experts in ``region``)."""
        return read_region(entry.sources, entry.name, region, self._read_key, self.model)

    def _read_key(self, key: str, region: Region | None) -> torch.Tensor:
        """``region`` of one checkpoint tensor; JobSetupError naming file, key, rank."""
        from safetensors import safe_open

        file = self.files[key]
        path = self.model_dir / file
        try:
            if file not in self.handles:
                self.handles[file] = safe_open(str(path), framework="pt").__enter__()
            handle = self.handles[file]
            if region is None:
                tensor = handle.get_tensor(key)
            else:
                tensor = handle.get_slice(key)[tuple(slice(a, b) for a, b in region)]
        except Exception as exc:  # OSError, SafetensorError, a slice that does not fit: the file changed
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise JobSetupError(
                f"rank {self.rank} could not read {key!r} from {path} ({type(exc).__name__}: {first}); the file "
                "changed or is damaged since rank 0 checked its header: download or copy the model again"
            ) from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def done(self, index: int) -> None:
        """Unmap the files whose last tensor is entry ``index``."""
        for file in [f for f, last in self.last_use.items() if last == index and f in self.handles]:
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
    files = _Files(model_dir, plan, ctx.rank, model)
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
    files = _Files(model_dir, plan, ctx.rank, model) if ctx.is_main and model_dir is not None else None
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


def load_weights(model: torch.nn.Module, plan: WeightPlan | None, model_dir: Path | None,
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
