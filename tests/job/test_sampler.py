"""slurmft/job/sampler.py: every step trains the same sequences whatever the number of ranks (issue 45, item 8).

The data loader is accelerate's own (``prepare_data_loader``, as the Trainer's ``accelerator.prepare`` calls it:
seedable sampler, even batches), dealt to each rank of a shape; a step is what every rank's next
``gradient_accumulation_steps`` micro-batches hold. 30 sequences, a global batch of 8: with the Trainer's own
``RandomSampler`` the epoch's last step differs between 2 ranks x 2 x 2 and 1 rank x 2 x 4 (the defect);
with :class:`WholeGlobalBatches` every step is the same on every shape, the last one completed from the epoch's
first sequences, and an epoch is ``ceil(30 / 8)`` steps (slurmft/epochs.py) everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from torch.utils.data import DataLoader, RandomSampler, Sampler

from slurmft.epochs import steps_per_epoch
from slurmft.job.sampler import WholeGlobalBatches

SHAPES = [(2, 2, 2), (1, 2, 4), (4, 1, 2), (8, 1, 1)]  # ranks x per-device batch x accumulation: 8 a step
SEED = 42


def _steps(n: int, shape: tuple[int, int, int], make: Callable[[list[int]], Sampler], epoch: int = 0) -> list[list[int]]:
    from accelerate.data_loader import prepare_data_loader

    world, per_device, accumulation = shape
    data = list(range(n))
    per_rank = []
    for rank in range(world):
        loader = prepare_data_loader(DataLoader(data, batch_size=per_device, sampler=make(data)), num_processes=world,
                                     process_index=rank, rng_types=[], use_seedable_sampler=True, data_seed=SEED)
        loader.set_epoch(epoch)
        per_rank.append([b.tolist() for b in loader])
    micro = len(per_rank[0])
    assert all(len(r) == micro for r in per_rank)
    return [sorted(x for r in per_rank for b in r[s:s + accumulation] for x in b)
            for s in range(0, micro, accumulation)]


def test_the_trainers_own_sampler_ends_an_epoch_differently_on_each_shape() -> None:
    steps = {shape: _steps(30, shape, RandomSampler) for shape in SHAPES[:2]}
    two, one = steps[(2, 2, 2)], steps[(1, 2, 4)]
    assert two[:3] == one[:3] and two[3] != one[3]  # the last step: 8 sequences on one shape, 6 on the other
    assert sorted(map(len, (two[3], one[3]))) == [6, 8]


@pytest.mark.parametrize("n", [30, 29, 32, 5])
@pytest.mark.parametrize("epoch", [0, 1])
def test_every_step_is_the_same_global_batch_on_every_shape(n: int, epoch: int) -> None:
    steps = {shape: _steps(n, shape, lambda data: WholeGlobalBatches(len(data), 8, SEED), epoch) for shape in SHAPES}
    first = steps[SHAPES[0]]
    assert all(s == first for s in steps.values()), steps
    assert len(first) == steps_per_epoch(n, 2, 2, 2) == -(-n // 8)
    assert all(len(step) == 8 for step in first)
    assert sorted(set(x for step in first for x in step)) == list(range(n))  # every sequence, the pad repeats some


def test_the_order_is_acceleratess_seeded_permutation_and_drop_last_cuts() -> None:
    from accelerate.data_loader import SeedableRandomSampler

    ours = list(WholeGlobalBatches(30, 8, SEED))
    theirs = SeedableRandomSampler(list(range(30)), data_seed=SEED)
    assert ours[:30] == list(theirs) and ours[30:] == ours[:2]  # the Trainer's order, then the pad
    assert list(WholeGlobalBatches(30, 8, SEED, drop_last=True)) == ours[:24]
    sampler = WholeGlobalBatches(30, 8, SEED)
    sampler.set_epoch(1)
    assert list(sampler) != ours and len(sampler) == 32
