"""Checkpoint discovery shared by the trainer, resume and consolidation (no torch import).

Layout: ``<run>/checkpoints/checkpoint-<step>/`` as the HF Trainer writes it (with accelerate's
sharded FSDP model in ``pytorch_model_fsdp_0/``). A checkpoint counts only once rank 0 wrote the
``COMPLETE`` marker after every rank finished saving; anything else is a torn save and is ignored.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")


def step_of(path: Path) -> int | None:
    """Step number of a ``checkpoint-<step>`` directory, else None."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def is_complete(path: Path) -> bool:
    """True when the checkpoint's completion marker exists."""
    return (path / COMPLETE_MARKER).is_file()


def list_checkpoints(root: Path) -> list[tuple[int, Path, bool]]:
    """All ``checkpoint-<step>`` dirs under ``root`` as (step, path, complete), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = step_of(child)
        if step is not None and child.is_dir():
            found.append((step, child, is_complete(child)))
    return sorted(found)


def latest_complete(root: Path) -> Path | None:
    """Newest complete checkpoint, or None."""
    complete = [p for _, p, ok in list_checkpoints(root) if ok]
    return complete[-1] if complete else None


def mark_complete(path: Path, **info: object) -> None:
    """Write the completion marker (rank 0 only, after a barrier), durably."""
    tmp = path / f".{COMPLETE_MARKER}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"t": time.time(), **info}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / COMPLETE_MARKER)
