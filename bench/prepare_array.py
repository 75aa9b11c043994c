"""A plain-text corpus prepared by one prepare job and by a prepare array; the train job's start on a large prepared set.

Run: python bench/prepare_array.py [--tokens 50000000] [--tasks 4] [--model DIR] [--quick] [--unpacked]
One invocation: it writes a text corpus locally (seeded prose, documents separated by blank lines, nothing
downloaded; ``--tokens`` of the tiny model's tokenizer, 50M by default), builds the tiny model (slurmft.tiny;
``--model``: that preset built already), then:

* **prepare throughput**: the corpus prepared by one prepare job (``python -m slurmft.job.entrypoint prepare``, one
  process) and by an array of ``--tasks`` tasks (``prepare-task``, each a process of its own started at once, as
  Slurm starts an array's tasks; the last one to finish packs). Wall times and tokens/s, their ratio, each task's
  seconds to load its rows (one source of ``FILES`` files: each task reads its share of the files), what the
  packing task did after the shards were done (seconds, MiB written), and whether the rows the train job reads from
  the two ``prepared/`` sets are bitwise equal (they must be: exit 1 otherwise). On a machine with fewer cores than
  tasks the tasks share the cores: the ratio is what this machine gives, not what N nodes give.
* **train job start**: the 2-rank train job (gloo, real FSDP2, tiny model) on the array's prepared set, on the one
  job's (the same rows, saved) and on a tenth of the corpus prepared by one job: seconds from launch to the first
  step, and the first step's peak RSS (``metrics.jsonl``'s ``peak_rss_mib``, the largest rank's). ``prepared/`` is
  read memory-mapped: the one job's saved rows (``datasets.load_from_disk``), the array's shards themselves,
  concatenated without a copy, packed by the recorded plan (each packed row gathered when read) or, ``--unpacked``,
  read through the recorded order: both should be flat in the set's size. Each is launched twice, in turn (the first
  launch pays the libraries' cold start): the faster time, the larger RSS. And what a read costs: rows/s fetched
  from each large set as the DataLoader fetches them (8 at a time, in a random order, one process).

Targets (exit 1 when missed): the two prepared sets are bitwise equal; the train job's time to first step and RSS on
the full set are within ``FLAT`` times the tenth's. ``--quick`` (200k tokens) checks that the pipeline runs and the
sets are equal, not the figures. The tables are what docs/benchmarks.md
quotes.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from prepare_first_step import WORDS, env_for, first_step_s  # noqa: E402 - this directory's sibling bench

SEQ = 512
FILES = 64
#: "flat": the train job's time to its first step and its RSS on the full set at most this times the tenth's
FLAT = 1.25
#: rows read by :func:`read_rate` from each large prepared set
READ_ROWS = 4000


def write_corpus(root: Path, words: int, seed: int = 0) -> None:
    """``words`` words of seeded prose in ``FILES`` files, paragraphs of 20-400 words between blank lines."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    per_file = -(-words // FILES)
    for i in range(FILES):
        left, paragraphs = per_file, []
        while left > 0:
            n = min(left, rng.randint(20, 400))
            paragraphs.append(" ".join(rng.choices(WORDS, k=n)))
            left -= n
        (root / f"part{i:03d}.txt").write_text("\n\n".join(paragraphs) + "\n")


def tokens_per_word(model: Path) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    sample = " ".join(random.Random(1).choices(WORDS, k=20000))
    return len(tok(sample)["input_ids"]) / 20000


def write_run(run: Path, model: Path, corpus: Path, files: str = "*.txt", unpacked: bool = False) -> None:
    from slurmft.config_loading import dump_config, load_config

    cfg = load_config(REPO / "examples" / "tiny" / "run.yaml", [
        f"model.name_or_path={model}", f"output_dir={run}",
        "data.datasets=[{path: '" + str(corpus / files) + "', documents: blank_line}]", f"data.max_seq_length={SEQ}",
        "data.num_proc=1", "train.max_steps=1", "checkpoint.every_steps=1000", "prepare.enabled=true",
        *(["data.packing=false", "train.sft.shuffle_dataset=true"] if unpacked else [])])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))


def prepare_one(run: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "slurmft.job.entrypoint", "prepare", str(run)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=open(run.parent / f"{run.name}.log", "w"))  # noqa: SIM115
    return time.perf_counter() - t0


def prepare_array(run: Path, tasks: int, env: dict[str, str]) -> float:
    """Every task started at once, each its own process (as the array's tasks on their nodes); until the last ends."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "slurmft.job.entrypoint", "prepare-task", str(run), "--task",
                               str(k), "--tasks", str(tasks), "--group", "bench"], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(run.parent / f"{run.name}-task{k}.log", "w"))  # noqa: SIM115
             for k in range(tasks)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"prepare array: task exit codes {codes}; see {run.parent}/{run.name}-task*.log")
    return time.perf_counter() - t0


def same_prepared(a: Path, b: Path) -> bool:
    """Whether the train job reads the same rows, in the same order, from both runs' ``prepared/``."""
    from slurmft.job.packing import gathers_when_read
    from slurmft.job.prepare import read_prepared

    x, y = (read_prepared(r / "prepared", json.loads((r / "prepared" / "slurmft-prepared.json").read_text()))
            for r in (a, b))
    if gathers_when_read(y):  # a packed array's plan: its rows as the trainer gets them, a thousand at a time
        return len(x) == len(y) and all(x[i:i + 1000] == y[i:i + 1000] for i in range(0, len(x), 1000))
    return x.features == y.features and x.with_format("arrow")[:].equals(y.with_format("arrow")[:])


def mib(root: Path, pattern: str = "**/*.arrow") -> float:
    return sum(p.stat().st_size for p in root.glob(pattern) if p.is_file()) / 2**20


def packing_task(record: dict, prepared: Path) -> str:
    """What the task that packs did after every shard was done: its seconds, and what it wrote into ``prepared/``."""
    seconds = record["time"] - record["pack_started"]
    if record.get("layout") in ("shards", "plan"):  # the shards moved in: only the order or the plan are new
        plan = record["layout"] == "plan"
        new = (mib(prepared, f"{record['plan']}/*.npy") if plan
               else (prepared / record["order"]).stat().st_size / 2**20 if record.get("order") else 0.0)
        size = f"{new:.1f} MiB" if new >= 1 else f"{new * 1024:.0f} KiB"
        return (f"the packing task: {seconds:.1f} s, {size} written ({'the plan' if plan else 'the order'}; the "
                f"shards, {mib(prepared):.1f} MiB, moved into prepared/ as they are)")
    return f"the packing task: {seconds:.1f} s, {mib(prepared, '*.arrow'):.1f} MiB written (the packed rows)"


def task_loads(record: dict, run: Path) -> str:
    """Each task's seconds from its start to its rows loaded, and what it loaded (its share of the files, or the whole
    mixture): the record's ``load_seconds``, or (slurmft before they were recorded) its log's ``loaded ... in S s``."""
    out = []
    for shard in record["shards"]:
        seconds = shard.get("load_seconds")
        if seconds is None:
            log = (run.parent / f"{run.name}-task{shard['task']}.log").read_text()
            seconds = float(re.findall(r"loaded \d+ conversations in ([\d.]+) s", log)[-1])
        what = f"files {shard['files'][0]}..{shard['files'][1] - 1}" if "files" in shard else "the whole mixture"
        out.append(f"task {shard['task']}: {seconds:.1f} s ({what})")
    return "each task's loading: " + ", ".join(out)


def read_rate(run: Path, rows: int = READ_ROWS, batch: int = 8) -> tuple[float, int]:
    """(rows/s, rows read): ``rows`` rows of ``run``'s ``prepared/`` fetched as the DataLoader fetches them (batches of
    ``batch`` in a random order, ``__getitems__``), in this process: what reading costs a rank per sequence."""
    import numpy as np

    from slurmft.job.prepare import read_prepared

    ds = read_prepared(run / "prepared", json.loads((run / "prepared" / "slurmft-prepared.json").read_text()))
    picks = np.random.default_rng(0).permutation(len(ds))[:rows].tolist()
    t0 = time.perf_counter()
    for i in range(0, len(picks), batch):
        ds.__getitems__(picks[i:i + batch])
    return len(picks) / (time.perf_counter() - t0), len(picks)


def twin(run: Path, name: str) -> Path:
    """Another run directory on ``run``'s prepared set (hard links: nothing copied), to launch its train job again."""
    import os
    import shutil

    other = run.parent / name
    shutil.copytree(run / "prepared", other / "prepared", copy_function=os.link)
    (other / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(run), str(other)))
    return other


def first_step_rss_mib(run: Path) -> float:
    first = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in line)
    return float(first["peak_rss_mib"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=50_000_000, help="the corpus's size in tokens (default 50M)")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--model", help="the slurmft.tiny tiny preset, built already (default: build it here)")
    ap.add_argument("--quick", action="store_true", help="200k tokens: the pipeline runs (figures not meaningful)")
    ap.add_argument("--keep", help="keep the work directory here (default: a temporary one, removed)")
    ap.add_argument("--unpacked", action="store_true", help="data.packing false, TRL's shuffle on: the array's shards "
                    "stay as prepared/'s files and the train job reads them memory-mapped through the order")
    args = ap.parse_args(argv)
    tokens = 200_000 if args.quick else args.tokens
    sys.path.insert(0, str(REPO))

    with tempfile.TemporaryDirectory(prefix="slurmft-prepare-array-bench-", dir=args.keep) as tmp:
        work = Path(tmp)
        if args.model:
            model = Path(args.model).resolve()
        else:
            from slurmft.tiny import build

            model = build(work / "model", "tiny", "float32")
        words = int(tokens / tokens_per_word(model))
        corpus = work / "corpus"
        write_corpus(corpus, words)
        one, many, small = work / "one", work / "array", work / "small"
        write_run(one, model, corpus, unpacked=args.unpacked)
        write_run(many, model, corpus, unpacked=args.unpacked)
        write_run(small, model, corpus, f"part00[0-{FILES // 10 - 1}].txt", args.unpacked)  # a tenth of the files
        one_s = prepare_one(one, env_for(work / "cache-one"))
        many_s = prepare_array(many, args.tasks, env_for(work / "cache-array"))
        equal = same_prepared(one, many)
        prepare_one(small, env_for(work / "cache-small"))
        big = json.loads((one / "prepared" / "slurmft-prepared.json").read_text())
        record = json.loads((many / "prepared" / "slurmft-prepared.json").read_text())
        tenth = json.loads((small / "prepared" / "slurmft-prepared.json").read_text())["result"]
        packer = packing_task(record, many / "prepared")
        loads = task_loads(record, many)
        # the large set as the array left it (its shards, memory-mapped: packed by the plan, or through the order), the
        # same rows saved by one prepare job, the tenth; each launched twice, in turn (the first launch of all pays the
        # cold start of the libraries): the faster time, the larger RSS
        sets = {"big": many, "one": one, "small": small}
        runs = [*sets.items(), *((k, twin(r, f"{r.name}-again")) for k, r in reversed(sets.items()))]
        starts = [(k, first_step_s(r, env_for(work / f"cache-train-{r.name}")), first_step_rss_mib(r)) for k, r in runs]
        (start_big, rss_big), (start_one, rss_one), (start_small, rss_small) = (
            (min(t for k, t, _ in starts if k == key), max(m for k, _, m in starts if k == key)) for key in sets)
        (rate_many, read), (rate_one, _) = read_rate(many), read_rate(one)
    result = big["result"]
    n = result["tokens"]
    print(f"corpus: {FILES} .txt files, documents between blank lines -> {result['conversations']:,} documents, "
          f"{n:,} tokens in {result['sequences']:,} {'rows (unpacked, shuffled)' if args.unpacked else 'packed rows'} "
          f"of <= {SEQ}; tiny model's tokenizer")
    print("| preparation | wall | tokens/s |")
    print("|---|---|---|")
    print(f"| one prepare job (1 process) | {one_s:.1f} s | {n / one_s:,.0f} |")
    print(f"| prepare array, {args.tasks} tasks at once (the last one packs) | {many_s:.1f} s | {n / many_s:,.0f} |")
    per_task = ", ".join(f"{s['tokens_per_s']:,}" for s in record["shards"])
    print(f"ratio: the array takes {many_s / one_s:.2f}x the one job's time; its tasks' own tokens/s: {per_task}")
    print(loads)
    print(packer)
    print(f"the rows the train job reads from the array's prepared/ bitwise equal to the one job's: "
          f"{'yes' if equal else 'NO'}")
    print("| train job (2 gloo ranks, tiny model) on a prepared set of | time to first step | first step's peak RSS |")
    print("|---|---|---|")
    print(f"| {tenth['tokens']:,} tokens | {start_small:.1f} s | {rss_small:.0f} MiB |")
    print(f"| {n:,} tokens (one prepare job's saved rows) | {start_one:.1f} s | {rss_one:.0f} MiB |")
    kind = "shards through the order" if args.unpacked else "shards packed by the plan"
    print(f"| {n:,} tokens (the array's {kind}) | {start_big:.1f} s | {rss_big:.0f} MiB |")
    time_ratio, rss_ratio = start_big / start_small, rss_big / rss_small
    print(f"ratio (large / small): time to first step {time_ratio:.2f}x, RSS {rss_ratio:.2f}x; the array's / one job's "
          f"set: {start_big / start_one:.2f}x, {rss_big / rss_one:.2f}x")
    print(f"reading {read:,} rows in a random order, 8 at a time (one process): the array's {kind}: "
          f"{rate_many:,.0f} rows/s; one prepare job's saved rows: {rate_one:,.0f} rows/s")
    if args.quick:
        print(f"targets (--quick: the pipeline runs, the two prepared sets are equal): {'met' if equal else 'MISSED'}")
        return 0 if equal else 1
    missed = [what for what, ok in (("prepared sets equal", equal), (f"RSS flat (<= {FLAT:g}x)", rss_ratio <= FLAT),
                                    (f"time to first step flat (<= {FLAT:g}x)", time_ratio <= FLAT)) if not ok]
    print(f"targets (the array's prepared set equal to one job's; first step's time and RSS within {FLAT:g}x for "
          f"{n / max(tenth['tokens'], 1):.0f}x the tokens): {'met' if not missed else 'MISSED ' + ', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
