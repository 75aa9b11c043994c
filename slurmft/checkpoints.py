"""Checkpoint discovery shared by the login side (status, resume) and the job side (trainer,
consolidation); no torch import.

Layout: ``<run>/checkpoints/checkpoint-<step>/`` as the HF Trainer writes it (with accelerate's
sharded FSDP model in ``pytorch_model_fsdp_0/``). A checkpoint counts only once rank 0 wrote the
``COMPLETE`` marker after every rank finished saving; anything else is a torn save and is ignored.

What one checkpoint holds (accelerate 1.15 ``save_fsdp_model``/``save_fsdp_optimizer`` with FSDP2
and ``SHARDED_STATE_DICT``, checked by tests/job/test_train_cpu.py)::

    checkpoint-<step>/
      pytorch_model_fsdp_0/   DCP: .metadata + __<rank>_0.distcp, one file per rank
      optimizer_0/            DCP: the AdamW state, same layout
      scheduler.pt  rng_state_<rank>.pth  trainer_state.json
      config.json  generation_config.json          (written by rank 0 before COMPLETE; use_cache true)
      tokenizer.json  tokenizer_config.json  chat_template.jinja  ...   (the tokenizer trained with)
      COMPLETE                                      (JSON: step, world_size, job_id, restart, time,
                                                     save_s, bytes, files: {relative path: size})

A checkpoint whose files match its marker but fail to load is moved to
``unloadable-checkpoint-<step>/`` (with a ``LOAD_FAILED`` note) once an older one loaded
(slurmft/job/checkpointing/fallback.py); discovery ignores that name and rotation removes it.

DCP keys of ``pytorch_model_fsdp_0/``: ``"model." + <Hugging Face parameter name>``, e.g.
``model.model.embed_tokens.weight``, ``model.model.layers.0.self_attn.q_proj.weight``,
``model.lm_head.weight`` (accelerate saves ``{"model": get_model_state_dict(model)}``; wrapper
segments such as ``_checkpoint_wrapped_module`` never appear). Tensors are stored in the training
parameter dtype. Keys of ``optimizer_0/``: ``optimizer.state.<hf name>.{step,exp_avg,exp_avg_sq}``
and ``optimizer.param_groups.*``. Consolidation reads the newest complete checkpoint's
``pytorch_model_fsdp_0/`` plus the config and tokenizer files next to it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "COMPLETE"
#: accelerate's directory for the model part of a checkpoint (DCP); an adapter checkpoint uses the same name.
MODEL_DIR = "pytorch_model_fsdp_0"
# Module-wrapper segments that appear in parameter names (activation checkpointing, FSDP1,
# torch.compile) but never in a Hugging Face checkpoint.
# PEFT's LoRA wrapper adds ``base_layer`` (the wrapped linear layer) and ``original_module`` (what a
# ``modules_to_save`` copy was made from) segments, and the ``base_model.model.`` prefix of a PeftModel.
MODULE_WRAPPERS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})
WRAPPER_SEGMENTS = MODULE_WRAPPERS | {"base_layer", "original_module"}
PEFT_PREFIX = "base_model.model."
#: Segments only adapter tensors have: LoRA's A and B, and a ``modules_to_save`` copy (trained in full).
ADAPTER_SEGMENTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                              "modules_to_save"})
_STEP_DIR = re.compile(r"^checkpoint-(\d+)$")


def step_of(path: Path) -> int | None:
    """Step number of a ``checkpoint-<step>`` directory, else None."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def step_dir(root: Path, step: int) -> Path:
    """``root/checkpoint-<step>``: where the Trainer saves ``step`` (the name :func:`step_of` reads)."""
    return root / f"checkpoint-{step}"


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


def problem(path: Path) -> str | None:
    """Why a checkpoint with a marker cannot be trusted, or None when it can.

    Checks what ``COMPLETE`` lists: every file exists with its recorded size (a stat per file, no
    reads, so it is cheap enough for ``status``). Markers written before the file list existed are
    trusted as they are.
    """
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError) as exc:
        return f"its {COMPLETE_MARKER} marker is unreadable ({exc})"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict):
        return None
    for rel, size in files.items():
        try:
            got = (path / rel).stat().st_size
        except OSError:
            return f"{rel} is missing"
        if got != size:
            return f"{rel} is {got} bytes, {COMPLETE_MARKER} says {size}"
    return None


def verified(root: Path) -> list[Path]:
    """Complete checkpoints whose files match their marker, oldest first."""
    return [p for _, p, ok in list_checkpoints(root) if ok and problem(p) is None]


def damaged(root: Path) -> list[tuple[Path, str]]:
    """Checkpoints with a marker whose files do not match it, with why, oldest first."""
    out = []
    for _, path, ok in list_checkpoints(root):
        why = problem(path) if ok else None
        if why:
            out.append((path, why))
    return out


def named(root: Path, checkpoint: str | os.PathLike[str]) -> Path:
    """A checkpoint given by the user: a path, or a name like ``checkpoint-500`` inside ``root``."""
    chosen = Path(checkpoint).expanduser()
    if not chosen.is_absolute() and not chosen.exists():
        chosen = root / chosen
    return chosen


def latest_complete(root: Path) -> Path | None:
    """Newest complete checkpoint whose files match its marker (damaged ones are skipped), or None."""
    good = verified(root)
    return good[-1] if good else None


def list_files(path: Path) -> dict[str, int]:
    """Every file under a checkpoint (but the marker) with its size, by path relative to it."""
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*"))
            if f.is_file() and f.name != COMPLETE_MARKER and not f.name.startswith(f".{COMPLETE_MARKER}")}


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (bench/checkpoint.py's baseline; a save uses :func:`make_durable`)."""
    for item in [*sorted(path.rglob("*")), path]:
        _fsync(item)


def _fsync(item: Path) -> None:
    try:
        fd = os.open(item, os.O_RDONLY)
    except OSError:
        return  # vanished or unreadable: the marker's file list will not match
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


# The files of a checkpoint that one rank writes alone: its DCP shard (``__<rank>_<n>.distcp``) and its
# random generator state (``rng_state_<rank>.pth``); everything else (DCP's ``.metadata``, the scheduler,
# trainer state, config, tokenizer) is rank 0's.
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng_state_(\d+)\.pth)$")


def owner(name: str) -> int:
    """The rank that writes the checkpoint file called ``name`` (0 for the files only rank 0 writes)."""
    m = _RANK_FILE.match(name)
    return int(m.group(1) or m.group(2)) if m else 0


def make_durable(path: Path, rank: int) -> int:
    """fsync the files of checkpoint ``path`` that ``rank`` wrote; rank 0 also the shared files and every
    directory (the entries). Returns how many fsync calls it made.

    Why not every rank everything (what the save did before): on a shared file system a rank's fsync
    flushes only what its own node wrote, so fsyncing another rank's shard protects nothing, and with R
    ranks every rank fsyncing every file is R x (2R + 10) calls per save: two million at 1,000 ranks, in
    the preemption lead time. Now it is 2 or 3 per rank and ~2R + 10 on rank 0 (a ``stat`` walk it
    does anyway for the marker's file list). Call it on every rank, then a barrier, then the marker.
    """
    items = sorted(path.rglob("*"))
    files = [f for f in items if f.is_file() and owner(f.name) == rank]
    if rank == 0:
        files += [d for d in items if d.is_dir()] + [path]
    for item in files:
        _fsync(item)
    return len(files)


def mark_complete(path: Path, **info: object) -> dict[str, object]:
    """Write the completion marker (rank 0 only, after a barrier, after :func:`fsync_tree`), durably.

    It lists every file of the checkpoint with its size (``files``) and their total (``bytes``), so
    discovery can tell a truncated or missing shard from a good checkpoint without reading it.
    """
    files = list_files(path)
    record = {"t": time.time(), **info, "bytes": sum(files.values()), "files": files}
    tmp = path / f".{COMPLETE_MARKER}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / COMPLETE_MARKER)
    fsync_dir(path)
    return record


def read_marker(path: Path) -> dict[str, Any]:
    """The record in checkpoint ``path``'s COMPLETE marker (precision, world size, lora, ...); {} when it is
    missing, unreadable or not a mapping (for why a marker cannot be trusted, see :func:`problem`)."""
    try:
        record = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def saved_world_size(path: Path) -> int | None:
    """The number of ranks that saved checkpoint ``path`` (its COMPLETE marker), None for a marker without it."""
    value = read_marker(path).get("world_size")
    return value if isinstance(value, int) else None


def fsync_dir(path: Path) -> None:
    """fsync a directory (a rename in it is durable)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def strip_wrappers(name: str) -> str:
    """A parameter name without module-wrapper segments (and PEFT's prefix): the Hugging Face name."""
    return ".".join(part for part in name.removeprefix(PEFT_PREFIX).split(".") if part not in WRAPPER_SEGMENTS)


def peft_name(name: str) -> str:
    """A parameter name without the module-wrapper segments of training (activation checkpointing, FSDP1,
    torch.compile) but with PEFT's own structure: the name in a ``PeftModel``'s state dict."""
    return ".".join(part for part in name.split(".") if part not in MODULE_WRAPPERS)


def is_adapter_name(name: str) -> bool:
    """True for a tensor the adapters add (LoRA's A/B, a ``modules_to_save`` copy): not in the base weights."""
    return any(part in ADAPTER_SEGMENTS for part in name.split("."))


DELETING_PREFIX = ".deleting-"
UNLOADABLE_PREFIX = "unloadable-"
LOAD_FAILED_NOTE = "LOAD_FAILED"


def set_aside(path: Path, problems: list[str], **info: object) -> Path:
    """Move a checkpoint that failed to load out of discovery: ``unloadable-checkpoint-<step>/`` (rank 0).

    Its sizes match its marker, so only loading it showed the damage; renamed, it is never offered
    again (no requeue fails on it twice), it no longer counts towards ``keep_last``, and a later save
    of the same step gets a fresh directory instead of writing next to a stale ``COMPLETE``. A
    ``LOAD_FAILED`` note inside says why. :func:`prune` removes it like a damaged checkpoint.
    """
    target = path.with_name(UNLOADABLE_PREFIX + path.name)
    if target.exists():  # set aside before, and the same step failed again
        shutil.rmtree(target)
    os.replace(path, target)
    note = target / LOAD_FAILED_NOTE
    note.write_text(json.dumps({"t": time.time(), **info, "problems": problems}, indent=1) + "\n")
    fsync_dir(target)
    fsync_dir(path.parent)
    return target


def unloadable(root: Path) -> list[Path]:
    """Checkpoints set aside because loading them failed (:func:`set_aside`), by name."""
    return sorted(p for p in root.glob(UNLOADABLE_PREFIX + "checkpoint-*") if p.is_dir()) if root.is_dir() else []


def prune(root: Path, keep_last: int | None = None, protect: tuple[Path, ...] = (),
          delete: Callable[[Path], object] | None = None) -> list[Path]:
    """Delete torn saves (no marker), damaged ones (files do not match the marker), unloadable ones
    (set aside after a failed load) and, with ``keep_last``, all but the newest ``keep_last`` verified
    checkpoints; never one in ``protect`` (the checkpoint a fallback resumed from).

    Nothing is deleted while no verified checkpoint exists: a torn or damaged checkpoint may be the
    only trace of the run (someone may repair it). Rank 0 only, while no save is in flight. Each
    victim is first renamed to a hidden ``.deleting-*`` name (atomic), so a kill mid-delete never
    leaves a ``checkpoint-N`` with its marker but without all its shards; leftovers of such a kill
    are removed on the next call. ``delete`` removes a hidden directory (default: at once, here); the
    train job passes its background writer's, so that deleting gigabytes never holds training (measured:
    1.8 s for one 2 GB checkpoint on a loaded machine) — the renames, which decide what stays, are done here.
    """
    found = list_checkpoints(root)
    good = [step for step, path, ok in found if ok and problem(path) is None]
    if not good:
        return []
    keep = set(good if keep_last is None else good[-keep_last:])
    keep |= {step_of(path) for path in protect}
    victims = [path for step, path, ok in found if step not in keep] + unloadable(root)
    removed = []
    for path in victims:
        hidden = path.with_name(DELETING_PREFIX + path.name)
        os.replace(path, hidden)
        removed.append(path)
    for leftover in root.glob(DELETING_PREFIX + "*") if root.is_dir() else []:
        (delete or _remove_tree)(leftover)
    return removed


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
