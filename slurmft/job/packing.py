"""Packing: the tokenized sequences into rows of ``data.max_seq_length``, planned once over the whole set.

What TRL does (1.16, ``trl.pack_dataset`` inside ``SFTTrainer._prepare_dataset``): a batched ``Dataset.map``
packs each 1,000-row batch of each process's shard on its own (best fit decreasing, ``bfd``, by default). So
the packs depend on ``dataset_num_proc``: the prepare job (one process per CPU it was given, 8 by default)
grouped the same rows into other packs than the train job preparing in its allocation (one process), and than
itself with another ``prepare.resources.cpus_per_task``. Measured on a real cluster before this module: 96 chat
rows, a different step-1 loss (9.0357 against 9.0855) and 39 of 39 tensors different after training. Asking
for more CPUs must never change what trains.

What we do: TRL's preparation runs unpacked (``packing=False`` and no ``max_length``, so it neither truncates
nor drops a row: the chat template, tokenization, assistant masks and labels are TRL's, in parallel), then
:func:`plan` places the sequences in one deterministic pass over their lengths alone (a few bytes per sequence,
whatever the corpus), and :func:`pack` gathers the rows the plan names, in parallel over the rows; each packed
row depends on the plan only. TRL's semantics are kept: the same strategies (``bfd``: best fit decreasing,
longest first, each sequence cut to ``max_seq_length``; ``bfd_split``: a longer sequence split into pieces of
``max_seq_length`` and a shorter last one, each placed on its own; ``wrapped``: everything concatenated and cut
every ``max_seq_length`` tokens), empty sequences dropped, a ``seq_lengths`` column for the best-fit
strategies (the collator makes each sequence's ``position_ids`` restart at 0 from it), and TRL's shuffles
around the packing where ``train.sft.shuffle_dataset`` asks for them. Packing the whole set at once also fills
the rows better than packing 1,000 rows at a time (docs/prepare.md has the figures).

Both paths call it: the prepare job (slurmft/job/prepare.py) and the train job preparing in its allocation
(``prepare.enabled: false``), so the two train bitwise the same. A prepare array (slurmft/job/prepare_array.py) saves
the :class:`Plan` instead of the rows, and the train job gathers each packed row when it reads it (:func:`gathered`),
by the same :func:`_gather`: the rows of the packed set one prepare job writes, without their copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("slurmft.job")

STRATEGIES = ("bfd", "bfd_split", "wrapped")
#: the columns a packed row holds (TRL packs these two, after ``select_columns``)
COLUMNS = ("input_ids", "labels")
#: rows of the prepared set read at a time when measuring lengths and when gathering packed rows
BATCH = 1000
#: part of a packed set's cache name: a change to how rows are planned or gathered gets new files
PLAN_VERSION = 1


class _Spaces:
    """The bins' free spaces 1..capacity, answering "the smallest free space of at least n" in log(capacity).

    A max segment tree over space values: leaf ``s`` holds ``s`` while some bin has exactly ``s`` tokens free.
    """

    def __init__(self, capacity: int) -> None:
        self.size = 1
        while self.size < capacity:
            self.size *= 2
        self.tree = [0] * (2 * self.size)
        self.count = [0] * (capacity + 1)

    def _set(self, space: int, value: int) -> None:
        i = self.size + space - 1
        self.tree[i] = value
        i //= 2
        while i:
            left, right = self.tree[2 * i], self.tree[2 * i + 1]
            self.tree[i] = left if left >= right else right
            i //= 2

    def add(self, space: int) -> None:
        self.count[space] += 1
        if self.count[space] == 1:
            self._set(space, space)

    def remove(self, space: int) -> None:
        self.count[space] -= 1
        if self.count[space] == 0:
            self._set(space, 0)

    def smallest_at_least(self, n: int) -> int:
        """The smallest free space >= n, or 0 when no bin has room."""
        if self.tree[1] < n:
            return 0
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= n else 2 * i + 1
        return self.tree[i]


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of the pieces ``0..len(lengths)-1`` (each ``<= capacity``): longest first (ties in their order), each
    into the bin with the least room that still fits it, the oldest such bin first, else a new bin."""
    from collections import deque

    order = np.argsort(-lengths, kind="stable")
    spaces = _Spaces(capacity)
    by_space: dict[int, deque[int]] = {}
    bins: list[list[int]] = []
    for piece in order.tolist():
        n = int(lengths[piece])
        space = spaces.smallest_at_least(n)
        if space:
            b = by_space[space].popleft()
            spaces.remove(space)
        else:
            b, space = len(bins), capacity
            bins.append([])
        bins[b].append(piece)
        left = space - n
        if left:
            by_space.setdefault(left, deque()).append(b)
            spaces.add(left)
    return bins


def plan(lengths: np.ndarray, seq_length: int, strategy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where every packed row's tokens come from, from the sequences' lengths alone.

    Returns ``(source, start, stop, row_offsets)``: piece ``p`` is tokens ``start[p]:stop[p]`` of sequence
    ``source[p]``, and packed row ``r`` is pieces ``row_offsets[r]:row_offsets[r + 1]`` in that order.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"packing strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    lengths = np.asarray(lengths, dtype=np.int64)
    nonempty = np.flatnonzero(lengths > 0)
    if strategy == "wrapped":  # one stream of every token, cut every seq_length tokens
        ends = np.cumsum(lengths)
        begins = ends - lengths
        total = int(ends[-1]) if len(ends) else 0
        # a piece runs from one boundary to the next: a sequence's start or a row's start
        bounds = np.union1d(np.union1d(begins[nonempty], np.arange(0, total, seq_length)), [total])
        piece_begin, piece_end = bounds[:-1], bounds[1:]
        source = np.searchsorted(ends, piece_begin, side="right")
        row = piece_begin // seq_length
        offsets = np.searchsorted(row, np.arange(-(-total // seq_length) + 1), side="left")
        return source, piece_begin - begins[source], piece_end - begins[source], offsets.astype(np.int64)
    if strategy == "bfd":  # each sequence cut to seq_length, the overflow dropped (TRL's "truncate")
        piece_source = nonempty
        piece_start = np.zeros(len(nonempty), dtype=np.int64)
        piece_len = np.minimum(lengths[nonempty], seq_length)
    else:  # bfd_split: pieces of seq_length, the last one shorter (TRL's "split")
        counts = -(-lengths[nonempty] // seq_length)
        piece_source = np.repeat(nonempty, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        piece_start = (np.arange(len(piece_source)) - first) * seq_length
        piece_len = np.minimum(lengths[piece_source] - piece_start, seq_length)
    bins = _best_fit_decreasing(piece_len, seq_length)
    pieces = np.asarray([p for b in bins for p in b], dtype=np.int64)
    offsets = np.cumsum([0, *(len(b) for b in bins)]).astype(np.int64)
    start = piece_start[pieces] if len(pieces) else np.zeros(0, dtype=np.int64)
    return piece_source[pieces], start, start + piece_len[pieces], offsets


def lengths_of(dataset: Any, column: str = "input_ids") -> np.ndarray:
    """Every row's sequence length, read a batch at a time (the lengths, never the tokens, stay in memory)."""
    import pyarrow.compute as pc

    parts = [pc.list_value_length(batch[column]).to_numpy(zero_copy_only=False)
             for batch in dataset.with_format("arrow").iter(batch_size=BATCH)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Plan:
    """Where every packed row's tokens come from (:func:`plan`): piece ``p`` is tokens ``start[p]:stop[p]`` of row
    ``source[p]``, packed row ``r`` is pieces ``offsets[r]:offsets[r + 1]``; ``order``: the packed rows in the order the
    trainer reads them (None: as planned). 24 bytes a piece and 8 (16 with an order) a packed row: a prepare array saves
    this instead of the packed rows (slurmft/job/prepare_array.py) and the train job gathers each row when it reads it
    (:func:`gathered`)."""

    source: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    offsets: np.ndarray
    strategy: str
    order: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    def save(self, where: Path) -> None:
        """One ``.npy`` per array in ``where`` (a new directory), so :meth:`load` maps them without reading them."""
        where.mkdir(parents=True)
        for name in (*PLAN_ARRAYS, *(["order"] if self.order is not None else [])):
            np.save(where / f"{name}.npy", np.asarray(getattr(self, name), dtype=np.int64))

    @classmethod
    def load(cls, where: Path, strategy: str) -> Plan:
        """The plan :meth:`save` wrote, memory-mapped (the ranks share its pages; nothing is copied into RAM)."""
        arrays = {name: np.load(where / f"{name}.npy", mmap_mode="r") for name in PLAN_ARRAYS}
        order = where / "order.npy"
        return cls(**arrays, strategy=strategy, order=np.load(order, mmap_mode="r") if order.exists() else None)


#: the arrays of a saved :class:`Plan` (``order.npy`` beside them when the packed rows are shuffled)
PLAN_ARRAYS = ("source", "start", "stop", "offsets")


def has_lengths(strategy: str) -> bool:
    """Whether packed rows carry ``seq_lengths`` (TRL's best-fit strategies; ``wrapped`` rows are one stream)."""
    return strategy != "wrapped"


def _gather(batch: dict[str, list[Any]], source: Any, pieces: Plan, columns: list[str],
            with_lengths: bool) -> dict[str, list[Any]]:
    """The packed rows ``batch["row"]`` (any rows, in any order): each the concatenation of its planned pieces of
    ``source``'s rows. The one place a packed row is made: :func:`pack` writes them, :func:`gathered` reads them."""
    rows = np.asarray(batch["row"], dtype=np.int64)
    first, counts = pieces.offsets[rows], pieces.offsets[rows + 1] - pieces.offsets[rows]
    ends = np.cumsum(counts)
    idx = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - counts - first, counts)  # their pieces
    starts, stops = pieces.start[idx].tolist(), pieces.stop[idx].tolist()
    unique, where = np.unique(pieces.source[idx], return_inverse=True)
    # (select_columns copies the set's metadata: 60% of a read's time where source holds these columns already)
    data = (source if source.column_names == columns else source.select_columns(columns))[unique.tolist()]
    where = where.tolist()
    out: dict[str, list[Any]] = {c: [] for c in columns}
    if with_lengths:
        out["seq_lengths"] = []
    k = 0
    for n in counts.tolist():
        for c in columns:
            row: list[Any] = []
            for p in range(k, k + n):
                row.extend(data[c][where[p]][starts[p]:stops[p]])
            out[c].append(row)
        if with_lengths:
            out["seq_lengths"].append([stops[p] - starts[p] for p in range(k, k + n)])
        k += n
    return out


def gathered(source: Any, plan: Plan) -> Any:
    """The packed set ``plan`` makes of ``source`` (TRL's prepared, unpacked rows), its rows gathered when they are
    read: a ``datasets.Dataset`` (TRL's SFTTrainer takes no other map-style set) of the packed rows' numbers, in the
    plan's order, whose transform returns each row's ``input_ids``, ``labels`` and ``seq_lengths`` by :func:`_gather`,
    the function :func:`pack` writes them with: the rows, and their Python types, of the packed set :func:`pack` saves.
    Nothing is written; ``source`` stays memory-mapped. Its one column (``row``) is no model input: the train job turns
    the Trainer's ``remove_unused_columns`` off for it (:func:`gathers_when_read`)."""
    from datasets import Dataset

    order = plan.order if plan.order is not None else np.arange(plan.rows, dtype=np.int64)
    index = Dataset.from_dict({"row": np.asarray(order, dtype=np.int64)})
    return index.with_transform(partial(_gather, source=source.with_format(None).select_columns(list(COLUMNS)),
                                         pieces=plan, columns=list(COLUMNS), with_lengths=has_lengths(plan.strategy)))


def gathers_when_read(dataset: Any) -> bool:
    """Whether ``dataset`` is a :func:`gathered` packed set (its rows are not its columns)."""
    format_ = getattr(dataset, "format", None) or {}
    return format_.get("type") == "custom" and list(getattr(dataset, "column_names", [])) == ["row"]


def plan_counts(source: Any, plan: Plan) -> tuple[int, int]:
    """(tokens, tokens in the loss) of the packed rows ``plan`` makes of ``source``, without gathering them: one pass
    over the labels, a batch of rows at a time (what :func:`slurmft.job.prepare.counts` finds in the packed rows)."""
    import pyarrow.compute as pc

    by_row = np.argsort(plan.source, kind="stable")
    rows, starts, stops = plan.source[by_row], plan.start[by_row], plan.stop[by_row]
    loss, base, done = 0, 0, 0
    for batch in source.with_format("arrow").select_columns(["labels"]).iter(batch_size=BATCH):
        labels = batch["labels"]
        upto = int(np.searchsorted(rows, base + len(labels), side="left"))
        if upto > done:
            lengths = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            kept = pc.not_equal(pc.list_flatten(labels), -100).to_numpy(zero_copy_only=False)
            cum = np.concatenate([[0], np.cumsum(kept, dtype=np.int64)])
            at = offsets[rows[done:upto] - base]
            loss += int((cum[at + stops[done:upto]] - cum[at + starts[done:upto]]).sum())
            done = upto
        base += len(labels)
    return int((plan.stop - plan.start).sum()), loss


def pack(dataset: Any, seq_length: int, strategy: str = "bfd", num_proc: int | None = None) -> Any:
    """``dataset`` (TRL's prepared, unpacked set) packed into rows of at most ``seq_length`` tokens by
    :func:`plan`; the same rows whatever ``num_proc`` (the processes gather rows, the plan is one).

    A ``dataset`` backed by files (the datasets cache) gets its packed rows written beside them, under a name
    made from its fingerprint and the packing, so the train job's other ranks read rank 0's instead of packing
    again, and no rank holds the packed set in memory.
    """
    import hashlib

    from datasets import Dataset, Features, List, Value

    source = dataset.with_format(None).select_columns(list(COLUMNS))
    pieces_source, start, stop, offsets = plan(lengths_of(source), seq_length, strategy)
    rows = len(offsets) - 1
    with_lengths = has_lengths(strategy)
    features = Features({**{c: source.features[c] for c in COLUMNS},
                         **({"seq_lengths": List(Value("int32"))} if with_lengths else {})})
    key = hashlib.sha256(f"{source._fingerprint}:{seq_length}:{strategy}:{PLAN_VERSION}".encode()).hexdigest()[:16]
    cache = (str(Path(source.cache_files[0]["filename"]).parent / f"slurmft-packed-{key}.arrow")
             if source.cache_files else None)
    index = Dataset.from_dict({"row": list(range(rows))})
    packed = index.map(
        _gather, batched=True, batch_size=BATCH, remove_columns=["row"], features=features,
        num_proc=num_proc if num_proc and rows > BATCH else None, desc="Packing (one plan for the whole set)",
        cache_file_name=cache, new_fingerprint=key,
        fn_kwargs={"source": source, "columns": list(COLUMNS), "with_lengths": with_lengths,
                   "pieces": Plan(pieces_source, start, stop, offsets, strategy)})
    tokens = int((stop - start).sum())
    log.info("packed %d sequences into %d rows of <= %d tokens (%s): %.1f%% of the slots filled", len(source), rows,
             seq_length, strategy, 100 * tokens / max(1, rows * seq_length))
    return packed
