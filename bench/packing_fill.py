"""How full the packed rows are: slurmft's one plan over the whole set against TRL's packing per 1,000-row batch.

Run: python bench/packing_fill.py [--rows 20000] [--seq 512] [--quick]
One invocation: bench/prepare_first_step.py's seeded synthetic conversations are tokenized once by TRL's own
preparation (unpacked, the tiny model's tokenizer, nothing downloaded); packing depends on the sequences' lengths
alone, so both packers then get the same lengths: TRL's ``pack_dataset`` (best fit decreasing within each
1,000-row map batch) with 1 and with 8 processes, as a prepare job with 1 or 8 CPUs ran it before, and
slurmft/job/packing.py (one plan for the whole set; the same rows with any number of processes). Printed: rows,
fill (tokens / (rows x seq)) and the packers' time. docs/prepare.md quotes it. ``--quick`` (2,500 rows) checks that
it runs; it also exits 1 when slurmft's packing fills fewer slots than TRL's single-process one (it cannot: its
plan is TRL's best fit over a superset of each batch).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def lengths_of_prepared(rows: int, seq: int, work: Path) -> list[int]:
    """The token count of each conversation, as TRL's preparation (chat template, assistant masks) makes it."""
    from prepare_first_step import write_data

    from slurmft.config_loading import load_config
    from slurmft.job import data, packing
    from slurmft.job.inputs import load_tokenizer
    from slurmft.job.prepare import TrlPreparation, prepare_args
    from slurmft.tiny import build

    model = build(work / "model", "tiny", "float32")
    chat = work / "chat.jsonl"
    write_data(chat, rows)
    cfg = load_config(REPO / "examples" / "tiny" / "run.yaml", [
        f"model.name_or_path={model}", f"output_dir={work / 'run'}", "data.datasets=[{path: " + str(chat) + "}]",
        f"data.max_seq_length={seq}", "data.packing=false"])
    tokenizer = load_tokenizer(model, cfg)
    mixed = data.load_mixture(cfg.data, cfg.train.seed, tokenizer)
    args = prepare_args(cfg, None, work / "trl")
    args.max_length = None  # no truncation: the packers cut each sequence themselves
    prepared = TrlPreparation(tokenizer, args, mixed[0]).run(mixed, args)
    return packing.lengths_of(prepared).tolist()


def as_dataset(lengths: list[int]):  # noqa: ANN201 - a datasets.Dataset
    """Sequences of the given lengths (their token ids do not matter to packing), without Python lists."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.ones(int(offsets[-1]), dtype=np.int64)))
    return Dataset(pa.table({"input_ids": column, "labels": column}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="2,500 rows: it runs")
    args = ap.parse_args(argv)
    rows = 2500 if args.quick else args.rows
    sys.path[:0] = [str(REPO), str(HERE)]
    from datasets.utils.logging import disable_progress_bar
    from trl import pack_dataset

    from slurmft.job.packing import pack

    disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="slurmft-packing-bench-") as tmp:
        lengths = lengths_of_prepared(rows, args.seq, Path(tmp))
        ds = as_dataset(lengths)
        tokens = sum(min(n, args.seq) for n in lengths if n)
        results = {}
        for name, run in (("TRL, 1 process", lambda: pack_dataset(ds, args.seq, "bfd")),
                          ("TRL, 8 processes", lambda: pack_dataset(ds, args.seq, "bfd", {"num_proc": 8})),
                          ("slurmft, any processes", lambda: pack(ds, args.seq, "bfd"))):
            t0 = time.perf_counter()
            packed = run()
            results[name] = {"rows": len(packed), "fill": tokens / (len(packed) * args.seq),
                             "seconds": round(time.perf_counter() - t0, 2)}
    print(f"{rows:,} conversations -> {len(lengths):,} sequences, {tokens:,} tokens after cutting each to {args.seq} "
          "(bfd)")
    print("| packer | packed rows | fill | seconds |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['rows']:,} | {100 * r['fill']:.2f}% | {r['seconds']:.1f} |")
    print(json.dumps(results))
    return 0 if results["slurmft, any processes"]["rows"] <= results["TRL, 1 process"]["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
