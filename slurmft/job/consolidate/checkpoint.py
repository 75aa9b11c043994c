"""Which checkpoint to consolidate: the one named, else the newest complete one; a torn save is refused.

A checkpoint counts only once every rank finished writing it (its COMPLETE marker, slurmft/checkpoints.py)
and it holds a sharded (DCP) model: exporting a save that was interrupted, or that training is still
writing, would ship a model with some tensors from one step and some from none. The refusal lists every
checkpoint of the run with what it lacks, so the user can name one that is whole.

Where the model is inside a checkpoint: accelerate's ``save_fsdp_model`` (SHARDED_STATE_DICT, FSDP2) writes
it to ``pytorch_model_fsdp_0/`` with ``dcp.save({"model": get_model_state_dict(model)})``, so every DCP key
is ``model.`` + the Hugging Face parameter name.
"""

from __future__ import annotations

import os
from pathlib import Path

from slurmft.checkpoints import (
    COMPLETE_MARKER,
    MODEL_DIR,
    is_complete,
    latest_complete,
    list_checkpoints,
    named,
)
from slurmft.errors import CheckpointError
from slurmft.rundir import RunPaths

DCP_METADATA = ".metadata"
DCP_CONTAINER = "model"


def describe_checkpoints(root: Path) -> str:
    """``checkpoint-5 (complete), checkpoint-10 (no COMPLETE marker)`` for error messages."""
    found = list_checkpoints(root)
    if not found:
        return f"no checkpoint-<step> directories in {root}"
    parts = []
    for _, path, complete in found:
        if not complete:
            parts.append(f"{path.name} (no {COMPLETE_MARKER} marker)")
        elif not (path / MODEL_DIR / DCP_METADATA).is_file():
            parts.append(f"{path.name} (complete, but no {MODEL_DIR}/{DCP_METADATA})")
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
    if not (chosen / MODEL_DIR / DCP_METADATA).is_file():
        missing.append(
            f"{chosen / MODEL_DIR / DCP_METADATA} is missing: no sharded (DCP) model in this checkpoint"
        )
    if missing:
        raise CheckpointError(
            f"refusing to consolidate {chosen}: it is not a complete sharded checkpoint",
            [*missing, describe_checkpoints(root)],
        )
    return chosen
