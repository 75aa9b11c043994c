"""slurmft/job/packing.py: one packing plan for the whole set, TRL's strategies.

On a set of at most one map batch (1,000 rows) TRL's ``pack_dataset`` sees every row at once, so there its packs are
what ours must be: equal row for row, for each strategy. On a larger set TRL packs each batch apart and ours fills
the rows at least as well; and ours does not depend on the number of processes that gather the rows.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from slurmft.job.packing import STRATEGIES, pack, plan


def _rows(n: int, seq_length: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    ids = [[rng.randint(1, 1000) for _ in range(rng.choice([0, rng.randint(1, 2 * seq_length)]))] for _ in range(n)]
    return {"input_ids": ids, "labels": [[-100 if t % 3 else t for t in row] for row in ids]}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("n", "seq_length", "seed"), [(300, 64, 0), (900, 100, 1), (57, 16, 2)])
def test_a_single_batch_packs_as_trl_packs_it(strategy: str, n: int, seq_length: int, seed: int) -> None:
    from datasets import Dataset
    from trl import pack_dataset

    ds = Dataset.from_dict(_rows(n, seq_length, seed))
    assert pack(ds, seq_length, strategy)[:] == pack_dataset(ds, seq_length, strategy)[:]


def test_the_whole_set_is_one_plan_whatever_the_processes() -> None:
    from datasets import Dataset
    from trl import pack_dataset

    ds = Dataset.from_dict(_rows(2500, 64, 3))  # three shards of 834 rows, not batches of 1,000
    ours = pack(ds, 64, "bfd")
    assert pack(ds, 64, "bfd", num_proc=3)[:] == ours[:]
    trl_one, trl_three = pack_dataset(ds, 64, "bfd"), pack_dataset(ds, 64, "bfd", {"num_proc": 3})
    assert trl_one[:] != trl_three[:]  # TRL: another number of processes, other packs (what issue 45 found)
    assert len(ours) <= len(trl_one)  # one plan over 2,500 rows fills at least as well as batches of 1,000
    tokens = sum(map(len, ours["input_ids"]))
    assert tokens == sum(min(len(r), 64) for r in ds["input_ids"])  # bfd: every sequence cut to 64, none lost


def test_the_plan_of_each_strategy_on_trls_own_example() -> None:
    ids = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]
    rows = {}
    for strategy in STRATEGIES:
        source, start, stop, offsets = plan(np.array([len(r) for r in ids]), 4, strategy)
        rows[strategy] = [[t for p in range(offsets[r], offsets[r + 1]) for t in ids[source[p]][start[p]:stop[p]]]
                          for r in range(len(offsets) - 1)]
    # the rows of trl.pack_dataset's docstring
    assert rows["bfd"] == [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]]
    assert rows["bfd_split"] == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]]
    assert rows["wrapped"] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    with pytest.raises(ValueError, match="expected one of bfd, bfd_split, wrapped"):
        plan(np.array([3]), 4, "greedy")


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "trl-shuffles"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_plan_gathered_when_read_is_the_packed_set(strategy: str, shuffle: bool, tmp_path) -> None:
    """A prepare array's packed set is saved as its plan (slurmft.job.prepare.finish_plan) and gathered when read
    (packing.gathered): row for row, in every access the trainer makes (one row, a batch of rows in the sampler's
    order, the whole set), the rows and Python types finish() writes; counted without gathering, as counts() counts."""
    from types import SimpleNamespace

    from datasets import Dataset, load_from_disk

    from slurmft.job.packing import Plan, gathered, gathers_when_read, plan_counts
    from slurmft.job.prepare import counts, finish, finish_plan

    Dataset.from_dict(_rows(1300, 64, 5)).save_to_disk(str(tmp_path / "rows"))  # two map batches, memory-mapped
    ds = load_from_disk(str(tmp_path / "rows"))
    args = SimpleNamespace(shuffle_dataset=shuffle, seed=11, packing=True, max_length=64, packing_strategy=strategy,
                           dataset_num_proc=None)
    want = finish(ds, args)
    finish_plan(ds, args).save(tmp_path / "plan")
    saved = Plan.load(tmp_path / "plan", strategy)
    got = gathered(ds, saved)
    assert gathers_when_read(got) and not gathers_when_read(want)
    assert len(got) == len(want) and got[:] == want[:]
    assert got[3] == want[3] and {k: type(v) for k, v in got[3].items()} == {k: type(v) for k, v in want[3].items()}
    picks = np.random.default_rng(0).permutation(len(want))[:40].tolist()
    assert got.__getitems__(picks) == want.__getitems__(picks)  # the DataLoader's fetch of a sampled batch
    assert next(iter(got)) == want[0]  # TRL's SFTTrainer reads the first row so
    tokens, loss = plan_counts(ds, saved)
    assert {"tokens": tokens, "loss_tokens": loss} == {k: counts(want, 64)[k] for k in ("tokens", "loss_tokens")}
    assert sorted(p.name for p in (tmp_path / "plan").iterdir()) == sorted(
        ["source.npy", "start.npy", "stop.npy", "offsets.npy", *(["order.npy"] if shuffle else [])])
