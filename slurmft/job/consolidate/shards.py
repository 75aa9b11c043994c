"""Writing the planned safetensors files, and checking what was written, as ``save_pretrained`` lays them out.

Each file is written header first (planned in plan.py), then each tensor as it is read (read_dcp.py), cast to
its planned dtype and appended; the file is fsynced before the next one starts. The layout is the one
``save_pretrained`` writes for a sharded model, tensor names included: ``model-0000N-of-0000M.safetensors``
files plus ``model.safetensors.index.json``, always, even for one file, so a deployment can rely on one
layout. After the last file, every header is read back: each expected tensor present once, with its shape,
and every file exactly its planned size; a mismatch is a CheckpointError before the directory is put in
place (output_dir.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from slurmft.errors import CheckpointError
from slurmft.job.consolidate.plan import ShardPlan
from slurmft.job.consolidate.read_dcp import TensorSource, read_groups
from slurmft.rundir import MODEL_INDEX


def write_shard(
    source: TensorSource, shard: ShardPlan, path: Path, read_budget: int,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write one safetensors file: header first, then each tensor as it is read and cast.

    ``progress`` is called with the bytes written after each group of tensors.
    """
    with open(path, "wb") as f:
        f.write(shard.header())
        for group in read_groups(shard.tensors, read_budget):
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
            "total_parameters": sum(t.numel for s in shards for t in s.tensors),
            "total_size": sum(s.nbytes for s in shards),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / MODEL_INDEX).write_text(json.dumps(index, indent=2) + "\n")
