"""``train.epochs`` as optimizer steps, counted the way the Trainer batches the packed dataset.

One function for both sides: the train job fixes ``max_steps`` with it at its first start (``plan.json``), and
``validate``/``estimate`` give the same figure before any job when ``RUN_DIR/prepared/`` holds the exact count
of packed sequences (``slurmft prepare``); without it they can only estimate it from the files.
Torch-free.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slurmft.config import RunConfig


def steps_per_epoch(sequences: int, world_size: int, per_device_batch_size: int,
                    gradient_accumulation_steps: int) -> int:
    """Every step trains one whole global batch (``world_size x per_device_batch_size x
    gradient_accumulation_steps`` sequences; the last one of an epoch is completed from the epoch's first
    sequences: slurmft/job/sampler.py), so an epoch is ``ceil(sequences / global batch)`` steps on every shape."""
    global_batch = world_size * per_device_batch_size * gradient_accumulation_steps
    return max(1, math.ceil(sequences / global_batch))


def plan_steps(cfg: RunConfig, sequences: int, world_size: int) -> dict[str, Any]:
    """The record of ``plan.json``: ``train.epochs`` over ``sequences`` on ``world_size`` ranks as steps."""
    t = cfg.train
    assert t.epochs is not None
    per_epoch = steps_per_epoch(sequences, world_size, t.per_device_batch_size, t.gradient_accumulation_steps)
    return {"epochs": t.epochs, "sequences": sequences, "world_size": world_size,
            "sequences_per_step": world_size * t.per_device_batch_size * t.gradient_accumulation_steps,
            "steps_per_epoch": per_epoch, "max_steps": max(1, math.ceil(t.epochs * per_epoch))}
