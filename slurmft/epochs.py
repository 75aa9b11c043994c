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
    """Each rank gets ``ceil(sequences / world_size)`` sequences per epoch (the sampler pads the last round),
    in micro-batches of ``per_device_batch_size``; ``gradient_accumulation_steps`` of those make a step."""
    micro_batches = math.ceil(math.ceil(sequences / world_size) / per_device_batch_size)
    return max(1, micro_batches // gradient_accumulation_steps)


def plan_steps(cfg: RunConfig, sequences: int, world_size: int) -> dict[str, Any]:
    """The record of ``plan.json``: ``train.epochs`` over ``sequences`` on ``world_size`` ranks as steps."""
    t = cfg.train
    assert t.epochs is not None
    per_epoch = steps_per_epoch(sequences, world_size, t.per_device_batch_size, t.gradient_accumulation_steps)
    return {"epochs": t.epochs, "sequences": sequences, "world_size": world_size,
            "sequences_per_step": world_size * t.per_device_batch_size * t.gradient_accumulation_steps,
            "steps_per_epoch": per_epoch, "max_steps": max(1, math.ceil(t.epochs * per_epoch))}
