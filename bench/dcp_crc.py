"""What DCP's per-tensor CRC-32 costs a save: ``dcp.save`` of the same state with and without it, in one process.

    python bench/dcp_crc.py [--mib 512] [--tensors 32] [--repeat 5] [--workdir DIR] [--json OUT] [--quick]

DCP writes every tensor with ``torch.save``, whose zip writer computes a CRC-32 of each record unless
``torch.utils.serialization.config.save.compute_crc32`` is off; the train job turns it off
(``slurmft.job.checkpointing.writing.skip_unchecked_crc32``) because nothing reads it: neither ``torch.load`` nor DCP's
reader checks it (tests/job/test_checkpointing_cpu.py flips a byte of a shard and the load succeeds). This bench
saves ``--mib`` MiB of float32 state in ``--tensors`` tensors ``--repeat`` times each way, alternating (with,
without, with, ...) so that the machine's other load hits both alike, each save fsynced (``sync_files``, DCP's
default) and deleted before the next. It prints the seconds of each save and the median ratio without / with;
``--quick`` (what the test suite runs): 64 MiB, 3 repetitions, no target. Exits 1 when, without ``--quick``, the
save without the CRC is not faster (median ratio >= 1).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def measure(mib: int, tensors: int, repeat: int, work: Path) -> dict[str, object]:
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.utils.serialization.config as serialization

    per = mib * 1024 * 1024 // 4 // tensors
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(per, generator=gen) for i in range(tensors)}
    seconds: dict[str, list[float]] = {"with_crc": [], "without_crc": []}
    was = serialization.save.compute_crc32
    try:
        for rep in range(repeat):
            for name, crc in (("with_crc", True), ("without_crc", False)):
                serialization.save.compute_crc32 = crc
                path = work / f"{name}-{rep}"
                t0 = time.perf_counter()
                dcp.save(state, checkpoint_id=path)
                seconds[name].append(round(time.perf_counter() - t0, 4))
                shutil.rmtree(path)
    finally:
        serialization.save.compute_crc32 = was
    ratios = [b / a for a, b in zip(seconds["with_crc"], seconds["without_crc"], strict=True)]
    return {"mib": mib, "tensors": tensors, "repeat": repeat, "seconds": seconds,
            "median_s": {k: statistics.median(v) for k, v in seconds.items()},
            "ratio_without_over_with": round(statistics.median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios]}


def table(r: dict[str, object]) -> str:
    med = r["median_s"]
    rows = [f"| dcp.save of {r['mib']} MiB ({r['tensors']} tensors), fsync | with CRC-32 | without | without / with |",
            "|---|---|---|---|",
            f"| median of {r['repeat']} | {med['with_crc']:.3f} s | {med['without_crc']:.3f} s | "
            f"**{r['ratio_without_over_with']}** |",
            "", "each repetition, with / without (s): " + ", ".join(
                f"{a:.3f} / {b:.3f}" for a, b in zip(r["seconds"]["with_crc"], r["seconds"]["without_crc"], strict=True))]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, help="state size in MiB (default 512; 64 with --quick)")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--repeat", type=int, help="saves each way (default 5; 3 with --quick)")
    ap.add_argument("--workdir", help="directory on the disk to measure (default: a temporary directory)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--quick", action="store_true", help="smoke test: 64 MiB, 3 repetitions, no target")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="slurmft-crc-", dir=args.workdir))
    try:
        r = measure(args.mib or (64 if args.quick else 512), args.tensors, args.repeat or (3 if args.quick else 5), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    if args.quick:
        print("target not enforced with --quick")
        return 0
    met = r["ratio_without_over_with"] < 1
    print(f"target: a save without the CRC is faster (ratio < 1): {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
