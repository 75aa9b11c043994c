"""Resuming a checkpoint saved by another number of ranks: the data position, the RNG, what the log says.

What the libraries do: DCP reshards the model and optimizer at load (accelerate's ``load_fsdp_model`` /
``load_fsdp_optimizer`` read the saved shards into this world size's DTensors); the Trainer skips
``global_step x gradient_accumulation_steps`` micro-batches per rank and loads ``rng_state_<rank>.pth``.
Why that is not enough: the skip lands on the sequences the saved run consumed only when the global batch
is the same (the login side recomputes accumulation to keep it: slurmft/plan/elastic.py), and the RNG
files are per rank: on fewer ranks some are never read, on more ranks the new ones find no file and keep
whatever state the process had, a different stream on every rank for no reason anyone can repeat.

What we do here, before the first step:

- :func:`check_data_position`: the checkpoint's record (``global_batch``, ``sequences_consumed``) must
  agree with this attempt's global batch, or every rank stops with the reason (a config edited by hand
  past the login side's check);
- :func:`reseed_on_change`: on another world size every rank seeds Python, NumPy and torch from
  ``(train.seed, step, rank)`` instead of reading an RNG file: deterministic, different per rank, the same
  on every resume of that checkpoint at that world size. At the same world size the Trainer's own RNG
  files load as before (a 2 -> 2 resume stays bitwise).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft import checkpoints
from slurmft.errors import JobSetupError

log = logging.getLogger("slurmft.job")


def check_data_position(checkpoint: Path, global_batch: int) -> int:
    """Sequences ``checkpoint`` had consumed; raises JobSetupError when its global batch is not this run's."""
    record = checkpoints.read_marker(checkpoint)
    step = checkpoints.step_of(checkpoint) or 0
    saved = record.get("global_batch")
    if isinstance(saved, int) and saved != global_batch:
        raise JobSetupError(
            f"train: {checkpoint.name} was trained with a global batch of {saved} sequences per step, this attempt "
            f"has {global_batch} (resources x train.per_device_batch_size x train.gradient_accumulation_steps); "
            "resuming would skip or repeat data. Resume with `slurmft resume RUN_DIR resources...`, which keeps the "
            "global batch, or start a new run (new output_dir)"
        )
    consumed = record.get("sequences_consumed")
    return consumed if isinstance(consumed, int) else step * global_batch


def rank_seed(seed: int, step: int, rank: int) -> int:
    """A 32-bit seed for ``rank`` resuming at ``step`` (train.seed first): stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:4], "little")


def reseed_on_change(trainer: Any, rank: int, world_size: int, seed: int) -> None:
    """Wrap ``trainer._load_rng_state``: a checkpoint saved by another world size reseeds from
    :func:`rank_seed`; one saved by this world size (or with no record) loads its RNG files as before."""
    original: Callable[..., Any] = trainer._load_rng_state

    @functools.wraps(original)
    def load_rng_state(checkpoint: str | None) -> None:
        if checkpoint is None:
            return original(checkpoint)
        saved = checkpoints.saved_world_size(Path(checkpoint))
        if saved is None or saved == world_size:
            return original(checkpoint)
        from transformers import set_seed

        step = checkpoints.step_of(Path(checkpoint)) or 0
        set_seed(rank_seed(seed, step, rank))
        if rank == 0:
            log.info(
                "random generators reseeded per rank from train.seed %d and step %d (%s was saved by %d ranks, "
                "this attempt has %d)",
                seed,
                step,
                Path(checkpoint).name,
                saved,
                world_size,
            )
        return None

    trainer._load_rng_state = load_rng_state


def describe(checkpoint: Path, world_size: int, per_device: int, accumulation: int) -> str | None:
    """The log line of a resume on another world size (None at the same one), after
    :func:`check_data_position` (at any world size)."""
    global_batch = world_size * per_device * accumulation
    consumed = check_data_position(checkpoint, global_batch)
    saved = checkpoints.saved_world_size(checkpoint)
    if saved is None or saved == world_size:
        return None
    record = checkpoints.read_marker(checkpoint)
    was = (
        f" ({saved} x {record['per_device_batch_size']} x {record['gradient_accumulation_steps']})"
        if isinstance(record.get("per_device_batch_size"), int)
        and isinstance(record.get("gradient_accumulation_steps"), int)
        else ""
    )
    return (
        f"{checkpoint.name} was saved by {saved} ranks{was}, resuming on {world_size} "
        f"({world_size} x {per_device} x {accumulation}): global batch {global_batch} kept, "
        f"{consumed} sequences consumed, each rank skips {consumed // (world_size * per_device)} micro-batches; "
        "model and optimizer resharded by DCP"
    )
