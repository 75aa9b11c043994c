"""The prepare job as a Slurm job array (``prepare.tasks``): a corpus's tokenization spread over N tasks.

One prepare job tokenizes a corpus with the CPUs of one node: hours for billions of tokens, while the train job
waits. With ``prepare.tasks: N`` the prepare job is an array (``--array=0-(N-1)``, slurmft/submit/prepare.py). Task k
loads its share and runs TRL's preparation on it row by row (:meth:`slurmft.job.prepare.TrlPreparation.rows`: no
packing, no shuffle), and saves the rows as shard k of ``RUN_DIR/.prepared.array-<array id>/`` with a record of its
own (rows, tokens, load seconds, seconds, tokens/s, the inputs' identity). Its share:

* **a share of the files** when the mixture is one plain-text source of local files matched by a glob, at least as
  many as tasks (:func:`shared_files`): the k-th contiguous range of the files, cut by their bytes (:func:`file_share`;
  the sizes are in the inputs' identity, taken before any file is read), and the task reads those files only, so its
  loading grows with its share, not with the corpus (a task on a node without datasets' cache of the corpus reads
  its files, not every file). A document is a file or a block of one, and one source is not interleaved, so the
  shards in task order are the source's rows in file order;
* **a share of the rows** otherwise: the task loads and mixes every source as one prepare job does and takes the
  k-th contiguous share of the mixture's rows (:func:`share`). Several sources are interleaved by weight in an order
  that depends on every source's length, so no task can place its rows without them all.

A prepared row depends on its own source row only, so the shards concatenated in task order are the rows one
prepare job makes. The task that finds every shard complete (the last to finish: each writes its
shard before it looks) runs what needs the whole set, over the shards read memory-mapped and concatenated without a
copy (``load_from_disk`` + ``concatenate_datasets`` keep datasets' Arrow files mapped), and writes ``prepared/`` with
a record covering every shard:

* packed (``data.packing``): nothing is gathered. TRL's shuffle and slurmft's one packing plan over the whole set
  (:func:`slurmft.job.prepare.finish_plan`: the plan :func:`slurmft.job.prepare.finish` packs by, its pieces' rows
  composed with TRL's shuffle before packing, TRL's shuffle after packing as the packed rows' order) are saved in
  place of the packed rows (``layout: plan``, ``prepared/plan/``: 24 bytes a piece, 16 a packed row), and the shards
  are moved into ``prepared/`` as its own files; the train job gathers each packed row when it reads it
  (:func:`slurmft.job.packing.gathered`, by :func:`slurmft.job.packing._gather`, the function one prepare job writes the
  rows with). Writing the rows took the packing task 33 s and ~12 bytes a token for 50M tokens (about an hour and
  ~56 GiB at 5B), one task while the others had finished; the counts of the record are taken from the plan and one
  pass over the labels;
* unpacked: nothing is copied either. The shards are moved into ``prepared/`` as its own files, and the record names
  them (``layout: shards``) and the order the trainer reads their rows in (TRL's shuffle as a permutation,
  ``order.npy``); the train job reads the shards memory-mapped, concatenated, through that order
  (:func:`slurmft.job.prepare.read_prepared`).

Either way the train job reads bitwise the rows ``prepare.tasks: 1`` gives, whatever N and the CPUs
(tests/job/test_prepare_array.py). The train job waits for the whole array (``afterok:<array id>``).

A cache is bound to what it was computed from: every task records the inputs (files' sizes and times, tokenizer
hashes, hub commits) as it began, and the packing task refuses shards made from different inputs (a file changed
while the array ran) instead of mixing them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from bisect import bisect_left
from dataclasses import replace
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from slurmft import prepared, sourcefiles
from slurmft.errors import JobSetupError
from slurmft.job import packing
from slurmft.job.prepare import (
    TEXT,
    Loaded,
    TrlPreparation,
    finish_plan,
    load_run,
    prepare_args,
    result_counts,
    save_prepared,
    shuffled_order,
    trl_said,
)
from slurmft.prepared import (
    ORDER_FILE,
    PLAN_DIR,
    PLAN_LAYOUT,
    PLAN_RECORD_VERSION,
    SHARD_RECORD,
    SHARDS_LAYOUT,
    shard_dir,
    shard_records,
)
from slurmft.rundir import atomic_write

if TYPE_CHECKING:
    from slurmft.config import RunConfig

log = logging.getLogger("slurmft.job")
#: made (O_EXCL) by the one task that packs the shards; the others see it and stop
CLAIM = "packing"


def share(rows: int, task: int, tasks: int) -> range:
    """The mixture's rows task ``task`` of ``tasks`` prepares: a contiguous share, sizes differing by one at most."""
    return range(rows * task // tasks, rows * (task + 1) // tasks)


def file_share(sizes: list[int], task: int, tasks: int) -> range:
    """The files (of ``sizes`` bytes, in the source's order) task ``task`` of ``tasks`` reads: a contiguous share, each
    cut where the bytes before it come nearest to its fraction of the whole, every task at least one file when there
    are as many files as tasks. Bytes, not rows: a task knows the files' sizes (the inputs' identity) before it
    reads any, not their rows."""
    cum = list(accumulate(sizes, initial=0))
    bounds = [0]
    for k in range(1, tasks):
        target = cum[-1] * k / tasks
        lo, hi = min(bounds[-1] + 1, len(sizes)), max(len(sizes) - (tasks - k), bounds[-1])
        i = min(max(bisect_left(cum, target), lo), hi)
        if i > lo and target - cum[i - 1] <= cum[i] - target:  # the nearer of the two cuts around the target
            i -= 1
        bounds.append(i)
    bounds.append(len(sizes))
    return range(bounds[task], bounds[task + 1])


def shared_files(cfg: RunConfig, before: dict[str, Any], tasks: int) -> list[dict[str, Any]] | None:
    """The files the tasks share out (the inputs' identity's entries, each ``file`` and ``size``, in the order one job
    reads them) when the mixture allows it; None: each task reads the whole mixture and takes a share of its rows.

    It allows it when a prepared row depends on one file alone and the files' order is the mixture's: one source (the
    weighted interleaving of several orders the rows by every source's length), plain text (a document is a file or a
    block of one; its columns are fixed whatever datasets infers from the files read; a chat source's format and
    template checks read its first rows), local files matched by a glob, at least as many as tasks (fewer would leave
    tasks idle: one large file is shared by rows)."""
    sources = before["inputs"]["sources"]
    if tasks < 2 or cfg.method.value != "sft" or len(cfg.data.datasets) != 1 or len(sources) != 1:
        return None
    src, files = cfg.data.datasets[0], sources[0].get("files")
    if not sourcefiles.is_text(src.path, src.format) or not files or len(files) < tasks:
        return None
    return files


def run_task(run_dir: str, task: int, tasks: int, group: str, num_proc: int | None = None) -> dict[str, Any]:
    """Task ``task`` of prepare array ``group`` (its job id): its share tokenized into its shard; the last task to
    finish also packs every shard into ``prepared/``. Returns the shard's record."""
    import pyarrow.compute as pc

    from slurmft.job.packing import lengths_of
    from slurmft.slurm import own_job_id

    if not 0 <= task < tasks:
        raise JobSetupError(f"prepare array task {task} is not one of 0..{tasks - 1}")
    mine_files: list[range] = []  # its range of the source's files, when the tasks share the files

    def files(cfg: RunConfig, before: dict[str, Any]) -> list[Path] | None:
        entries = shared_files(cfg, before, tasks)
        if entries is None:
            return None
        sizes = [int(f["size"]) for f in entries]
        got = file_share(sizes, task, tasks)
        mine_files.append(got)
        log.info("task %d of %d: reads files %d..%d of the source's %d (%.1f of %.1f MiB), not the others", task,
                 tasks, got.start, got.stop - 1, len(entries), sum(sizes[got.start:got.stop]) / 2**20, sum(sizes) / 2**20)
        return [Path(f["file"]) for f in entries[got.start:got.stop]]

    run = load_run(run_dir, num_proc, files=files)
    load_seconds = time.time() - run.t0
    parts = run.paths.prepared_parts(group)
    parts.mkdir(parents=True, exist_ok=True)
    args = prepare_args(run.cfg, run.num_proc, parts)
    trl = TrlPreparation(run.tokenizer, args, run.mixed[0] if len(run.mixed) else dict.fromkeys(run.mixed.column_names))
    if mine_files:  # its files' rows, all of them: the shares in task order are the source's rows in file order
        rows, mine = range(len(run.mixed)), run.mixed
        log.info("task %d of %d: the %d documents of its files, loaded in %.1f s (TRL's preparation, unpacked; the "
                 "packing waits for every task)", task, tasks, len(mine), load_seconds)
    else:
        rows = share(len(run.mixed), task, tasks)
        mine = run.mixed.select(rows)
        log.info("task %d of %d: rows %d..%d of the mixture's %d, loaded whole in %.1f s (TRL's preparation, unpacked; "
                 "the packing waits for every task)", task, tasks, rows.start, rows.stop - 1, len(run.mixed),
                 load_seconds)
    chat = TEXT not in mine.column_names or not pc.all(mine.with_format("arrow")[:][TEXT].is_valid()).as_py()
    t = time.time()
    target, tmp = shard_dir(parts, task), parts / f".shard-{task:05d}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if len(mine):
        ready = trl_said(run.cfg, run.paths, lambda: trl.rows(mine, args))
        ready.save_to_disk(str(tmp))
        sequences, tokens = len(ready), int(lengths_of(ready).sum())
    else:  # more tasks than rows: an empty share, a shard of no rows (the packing task leaves it out)
        tmp.mkdir(parents=True)
        sequences, tokens = 0, 0
    seconds = time.time() - t
    record = {"task": task, "tasks": tasks, "rows": [rows.start, rows.stop], "sequences": sequences, "tokens": tokens,
              "seconds": round(seconds, 1), "tokens_per_s": round(tokens / max(seconds, 1e-9)), "chat": chat,
              "load_seconds": round(load_seconds, 1),
              # a share of the files: which ones ([first, stop) of the source's), and "rows" counts its files' rows
              **({"files": [mine_files[0].start, mine_files[0].stop]} if mine_files else {}),
              "job_id": own_job_id(os.environ) or None, "host": socket.gethostname(), "started": run.t0,
              "inputs": run.before}
    atomic_write(tmp / SHARD_RECORD, json.dumps(record, indent=2) + "\n")  # last: the shard is complete
    shutil.rmtree(target, ignore_errors=True)  # a task run again (requeued) replaces its shard
    os.replace(tmp, target)
    log.info("task %d of %d: %d sequences, %d tokens in %.1f s (%.0f tokens/s)", task, tasks, sequences, tokens,
             seconds, tokens / max(seconds, 1e-9))
    if _last(parts, tasks):
        pack_shards(run, parts, tasks, group, task)
    else:
        log.info("task %d of %d: done; the last task to finish packs the shards", task, tasks)
    return record


def _last(parts: Path, tasks: int) -> bool:
    """Whether this task packs: every shard is complete and no other task claimed the packing first (each task
    writes its shard before it looks, so the last one to finish always sees them all)."""
    if any(r is None for r in shard_records(parts, tasks)):
        return False
    try:
        os.close(os.open(parts / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def pack_shards(run: Loaded, parts: Path, tasks: int, group: str, me: int) -> dict[str, Any]:
    """Every shard, memory-mapped and concatenated in task order, made ``prepared/`` with a record covering every
    shard, without a copy: the shards are moved into ``prepared/`` as its own files, and the record names them and how
    the train job reads them (:func:`slurmft.job.prepare.read_prepared`). Packed (``data.packing``): by the packing plan
    over all of them, composed with TRL's shuffles (``plan/``, :func:`slurmft.job.prepare.finish_plan`); unpacked: in
    the order TRL's shuffle puts them (``order.npy``), if it does. ``me``: the task that packs (its inputs are
    ``run.before``)."""
    from datasets import concatenate_datasets

    from slurmft.slurm import own_job_id

    records = [r for r in shard_records(parts, tasks) if r is not None]
    for r in records:
        changed = prepared.differences(r["inputs"], run.before)
        if changed:
            raise JobSetupError(f"data: the sources changed while the prepare array ran (task {r['task']} read other "
                                f"inputs than task {me}, which packs): {'; '.join(changed)}; prepare again: "
                                f"`slurmft prepare {run.paths.root}`")
    # the record's conversations (len(run.mixed), all save_prepared reads of it): every share's rows, whichever kind of
    # share (a task that read a share of the files holds its own rows only)
    run = replace(run, mixed=range(sum(r["rows"][1] - r["rows"][0] for r in records)))
    kept = [r for r in records if r["rows"][1] > r["rows"][0]]  # an empty share saved no rows
    rows = concatenate_datasets(_alike(parts, kept))
    args = prepare_args(run.cfg, run.num_proc, parts)
    started = min(r["started"] for r in records)
    log.info("packing %d shards: %d sequences, %d tokens (%s)", tasks, len(rows), sum(r["tokens"] for r in records),
             "one plan for the whole set" if args.packing else "unpacked: the shards become prepared/'s files")
    shard_list = [{k: r[k] for k in ("task", "rows", "files", "sequences", "tokens", "load_seconds", "seconds",
                                     "tokens_per_s", "job_id", "host") if k in r} for r in records]
    extra = {"tasks": tasks, "array_job": group, "shards": shard_list, "pack_started": time.time(),
             "job_id": own_job_id(os.environ) or None}  # this task's, as <array>_<task>
    names = [shard_dir(parts, r["task"]).name for r in kept]
    if args.packing:  # one plan over every shard, saved instead of the rows it makes (nothing gathered here)
        plan = finish_plan(rows, args)
        files: dict[str, Any] = {"version": PLAN_RECORD_VERSION, "layout": PLAN_LAYOUT, "shard_files": names,
                                 "plan": PLAN_DIR, "packing_strategy": plan.strategy}
        tokens, loss = packing.plan_counts(rows, plan)
        count = result_counts(plan.rows, tokens, loss, args.max_length)
    else:
        plan, count = None, None
        files = {"layout": SHARDS_LAYOUT, "shard_files": names, "order": ORDER_FILE if args.shuffle_dataset else None}

    def move(_: Any, staging: Path) -> None:
        staging.mkdir(parents=True)
        if plan is not None:
            plan.save(staging / PLAN_DIR)
        elif files["order"]:  # TRL's shuffle (finish: rows.shuffle(seed)) as the permutation of the rows, not a copy
            np.save(staging / ORDER_FILE, shuffled_order(len(rows), args.seed))
        for name in names:
            os.replace(parts / name, staging / name)

    record = save_prepared(run, lambda _: packing.gathered(rows, plan) if plan is not None else rows, time.time(),
                           {**extra, **files, "array_seconds": round(time.time() - started, 1)}, save=move,
                           count=None if count is None else lambda _: count)
    shutil.rmtree(parts, ignore_errors=True)
    return record


def _alike(parts: Path, kept: list[dict[str, Any]]) -> list[Any]:
    """The kept shards, memory-mapped, all with the same column types. A share without a conversation has the text
    rows' column types; one prepare job casts the text rows to the conversations' (slurmft/job/prepare.py:
    TrlPreparation._with_text), so such a shard is cast and saved again in its place (only it is rewritten), so that
    the shards concatenate as they are, here and in the train job."""
    from datasets import load_from_disk

    shards = [load_from_disk(str(shard_dir(parts, r["task"]))) for r in kept]
    like = next((s for s, r in zip(shards, kept, strict=True) if r["chat"] and len(s)), shards[0]).features
    out = []
    for shard, r in zip(shards, kept, strict=True):
        if shard.features != like:
            where, tmp = shard_dir(parts, r["task"]), parts / f".cast-{r['task']:05d}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shard.cast(like).save_to_disk(str(tmp))
            shutil.copyfile(where / SHARD_RECORD, tmp / SHARD_RECORD)
            shutil.rmtree(where)
            os.replace(tmp, where)
            shard = load_from_disk(str(where))
        out.append(shard)
    return out
