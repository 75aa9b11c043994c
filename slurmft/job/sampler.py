"""The order the train job reads its sequences in: one seeded permutation, padded to whole global batches.

What the libraries do: the Trainer samples with a ``RandomSampler``, which accelerate replaces by its
``SeedableRandomSampler`` (a permutation seeded by ``data_seed`` or ``seed`` plus the epoch: the same on every
world size), batches it per device and deals the batches to the ranks. When the epoch's sequences are not a
multiple of the global batch, the last step is made up differently on each shape: accelerate completes the
last round of per-device batches from the epoch's first indices (``even_batches``), and gradient accumulation
ends the epoch on a short step. 30 sequences, global batch 8: on 2 ranks x 2 x 2 accumulation the fourth step
trains the last six and the first two again, on 1 rank x 2 x 4 the last six alone. A resume on another number
of ranks (slurmft/job/elastic.py) then trains other sequences than the run it continues.

What we do: :class:`WholeGlobalBatches` is that same permutation (``torch.randperm`` seeded with the seed plus
the epoch, as accelerate seeds it), then its first sequences again until the epoch is a whole number of global
batches (every shape's ``even_batches`` padding, made once, for the global batch). Accelerate keeps a sampler
that is not a ``RandomSampler`` as it is, every round of per-device batches is full, every accumulation group
whole: each step trains the same sequences on every shape. With ``train.sft.dataloader_drop_last`` the epoch
is cut to whole global batches instead. An epoch is ``ceil(sequences / global batch)`` steps on every shape
(slurmft/epochs.py). A sampling strategy other than TRL's default (``train_sampling_strategy``) keeps the
Trainer's own sampler, and with it the per-shape last step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

log = logging.getLogger("slurmft.job")


class WholeGlobalBatches(Sampler[int]):
    """A seeded permutation of ``n`` sequences, padded (or, with ``drop_last``, cut) to whole global batches."""

    def __init__(self, n: int, global_batch: int, seed: int, drop_last: bool = False) -> None:
        self.n = n
        self.global_batch = global_batch
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def __len__(self) -> int:
        whole = self.n // self.global_batch if self.drop_last else -(-self.n // self.global_batch)
        return whole * self.global_batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # accelerate's SeedableRandomSampler: seed + epoch
        order = torch.randperm(self.n, generator=generator).tolist()
        while order and len(order) < len(self):
            order += order[: len(self) - len(order)]
        yield from order[: len(self)]
        self.epoch += 1  # as accelerate's sampler: an epoch iterated to its end is followed by the next


def use_whole_global_batches(trainer: Any, global_batch: int) -> None:
    """``trainer`` samples its training data with :class:`WholeGlobalBatches` (TRL's default sampling only)."""
    original = trainer._get_train_sampler

    def train_sampler(train_dataset: Any = None) -> Any:
        args = trainer.args
        dataset = train_dataset if train_dataset is not None else trainer.train_dataset
        if args.train_sampling_strategy != "random" or not hasattr(dataset, "__len__"):
            return original(train_dataset)
        seed = args.data_seed if args.data_seed is not None else args.seed
        return WholeGlobalBatches(len(dataset), global_batch, seed, drop_last=args.dataloader_drop_last)

    trainer._get_train_sampler = train_sampler
