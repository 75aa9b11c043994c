"""A resume on another number of ranks: what it keeps, what it recomputes, what it refuses.

DCP reshards a sharded model and optimizer at load (checked with torch 2.13: an FSDP2 model and its AdamW
state saved on 2 gloo ranks load on 1 and on 3 with every tensor equal). What does not follow by itself is
everything the Trainer derives from the world size: one optimizer step consumes ``ranks x
per_device_batch_size x gradient_accumulation_steps`` sequences (the *global batch*), and on resume the
Trainer skips ``global_step x gradient_accumulation_steps`` micro-batches on each rank. Keep the global
batch and that skip lands on exactly the sequences the saved run had consumed (``global_step x global
batch``, Megatron's ``consumed_samples``): accelerate's seedable sampler draws one permutation from the
seed and epoch, whatever the world size, and step ``s`` always trains on its ``s``-th slice of
``global_batch`` sequences. So a world-size change recomputes accumulation (or, when the new ranks are
too many for one micro-batch each, the per-device batch) and refuses, with the fix, a world size that
cannot divide the global batch; an explicit batch override that changes it is refused too.

Pure functions, no torch: ``resume`` (slurmft/submit/resume.py) calls them before anything is queued; the
job checks the checkpoint's record again (slurmft/job/elastic.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurmft.errors import ConfigError

if TYPE_CHECKING:
    from slurmft.config import RunConfig

#: Overrides a resume accepts because they change where the run trains, not what it computes.
ALLOCATION_KEYS = ("resources.nodes", "resources.tasks_per_node", "resources.gpus_per_node")
#: Batch keys a resume accepts only when the global batch stays what the checkpoint was trained with.
BATCH_KEYS = ("train.per_device_batch_size", "train.gradient_accumulation_steps")


@dataclass(frozen=True)
class BatchShape:
    """How one optimizer step's sequences are spread: ranks x per-device batch x accumulation."""

    world_size: int
    per_device_batch_size: int
    gradient_accumulation_steps: int

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.world_size * self.per_device_batch_size * self.gradient_accumulation_steps

    def words(self) -> str:
        return (
            f"{self.world_size} rank{'s' if self.world_size != 1 else ''} x {self.per_device_batch_size} "
            f"x {self.gradient_accumulation_steps} accumulation"
        )


def world_sizes_for(global_batch: int, limit: int = 12) -> list[int]:
    """The world sizes that can keep ``global_batch`` (its divisors), smallest first, at most ``limit``."""
    return [n for n in range(1, global_batch + 1) if global_batch % n == 0][:limit]


def refit(global_batch: int, world_size: int, per_device_batch_size: int) -> BatchShape:
    """The batch shape on ``world_size`` ranks that keeps ``global_batch``: the per-device batch kept when it
    divides each rank's share (accumulation recomputed), else the largest per-device batch below it that does.

    Raises ConfigError naming the fields and the world sizes that would work when ``world_size`` does not
    divide ``global_batch``.
    """
    if global_batch % world_size:
        raise ConfigError(
            f"resources: {world_size} ranks cannot keep the global batch of {global_batch} sequences per optimizer "
            "step that the checkpoint was trained with (resources.nodes x ranks per node must divide it, so that "
            "every step trains on the same sequences)",
            [
                f"choose a world size among {', '.join(map(str, world_sizes_for(global_batch)))} ranks",
                "or submit a new run (a new output_dir) to train with another global batch",
            ],
        )
    share = global_batch // world_size
    per_device = max(b for b in range(1, min(per_device_batch_size, share) + 1) if share % b == 0)
    return BatchShape(world_size, per_device, share // per_device)


def reshape(saved: BatchShape, world_size: int, requested: BatchShape | None = None) -> BatchShape:
    """The batch shape a resume on ``world_size`` ranks trains with, from the one the checkpoint was saved with.

    ``requested``: the shape the overrides spell out when they name a batch key (``BATCH_KEYS``); it must keep
    the global batch. Without it the per-device batch is kept where it can be (:func:`refit`).
    """
    if requested is not None:
        if requested.global_batch != saved.global_batch:
            raise ConfigError(
                f"train: the overrides ask for a global batch of {requested.global_batch} sequences per step "
                f"({requested.words()}), but the checkpoint was trained with {saved.global_batch} "
                f"({saved.words()}); a resume keeps the global batch (the data position, the learning-rate "
                "schedule and the loss scale depend on it)",
                [
                    "leave train.per_device_batch_size and train.gradient_accumulation_steps out: slurmft recomputes "
                    "them for the new allocation",
                    "or submit a new run (a new output_dir) to train with another global batch",
                ],
            )
        return requested
    if world_size == saved.world_size:
        return saved
    return refit(saved.global_batch, world_size, saved.per_device_batch_size)


def allocation(cfg: RunConfig) -> dict[str, int]:
    """What an attempt runs on, for its manifest entry (``status`` and the report show it): the allocation's nodes,
    the training ranks (``world_size``: a GRPO vLLM server's node holds none, ``server_nodes`` says how many serve)."""
    r, t = cfg.resources, cfg.train
    served = {"server_nodes": r.nodes - cfg.train_nodes} if cfg.train_nodes != r.nodes else {}
    return {
        "nodes": r.nodes,
        "ranks_per_node": r.ranks_per_node,
        "world_size": cfg.train_world_size,
        **served,
        "per_device_batch_size": t.per_device_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
    }
