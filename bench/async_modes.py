"""Thread or process for the background write of an asynchronous save: ``dcp.async_save`` both ways, 2 gloo ranks.

    python bench/async_modes.py [--mib 144] [--repeat 3] [--nproc 2] [--workdir DIR] [--json OUT]

In one invocation (it starts itself under ``torch.distributed.run --standalone``), each rank holds ``--mib`` MiB
of float32 state and runs a stand-in for training (a fixed matmul per "step"). Per repetition and mode,
alternating thread, process, thread, ...: ``dcp.async_save`` of the state at step 2 on a gloo group of its
own, with a reused ``DefaultStager`` (shared memory for the process mode, as it needs; the CPU stager's
non-blocking copy asserts without an accelerator), training goes on until the write is done, then the future
is waited for. Figures per mode (rank 0, medians): *blocked* (how long ``async_save`` held the training thread:
staging, planning), *durable* (the call to the future's result), the steps' slowdown while the write was in
flight against steps with none, and, for the process mode, the one-off cost of its first save (the
background process starts and joins its own process group). What the train job uses (thread:
``slurmft.job.checkpointing.writing.BackgroundWriter``) is said in its docstring with these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _steps(n: int, a, until=None) -> list[float]:  # noqa: ANN001 - torch tensors, imported lazily
    """``n`` stand-in training steps, or, given ``until``, steps until ``until()`` is true (at least one); each
    step's seconds."""
    out: list[float] = []

    def done() -> bool:
        return len(out) >= n if until is None else bool(out) and until()

    while not done():
        t0 = time.perf_counter()
        for _ in range(4):
            a = (a @ a).tanh_()
        out.append(time.perf_counter() - t0)
    return out


def rank_main(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.utils.serialization.config as serialization
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    serialization.save.compute_crc32 = False  # as the train job saves (skip_unchecked_crc32)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    tensors = 16
    per = args.mib * 1024 * 1024 // 4 // tensors
    state = {f"r{rank}.w{i}": torch.randn(per) for i in range(tensors)}
    a = torch.randn(256, 256) / 16
    baseline = statistics.median(_steps(20, a))
    stagers = {"thread": DefaultStager(StagingOptions(False, False, False, False)),
               "process": DefaultStager(StagingOptions(False, True, False, False))}
    kinds = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
    out: dict[str, list[dict[str, float]]] = {"thread": [], "process": []}
    work = Path(args.workdir)
    for rep in range(args.repeat):
        for mode in ("thread", "process"):
            path = work / f"{mode}-{rep}"
            _steps(2, a)
            dist.barrier()
            t0 = time.perf_counter()
            response = dcp.async_save(state, checkpoint_id=path, process_group=group,
                                      async_checkpointer_type=kinds[mode], async_stager=stagers[mode])
            future = getattr(response, "upload_completion", response)
            blocked = time.perf_counter() - t0
            during = _steps(0, a, until=future.done)
            future.result()
            durable = time.perf_counter() - t0
            dist.barrier()
            out[mode].append({"blocked_s": blocked, "durable_s": durable, "steps_during": len(during),
                              "slowdown": statistics.median(during) / baseline})
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    for stager in stagers.values():
        stager.close()
    if rank == 0:
        Path(args.json_rank0).write_text(json.dumps({"baseline_step_s": baseline, "runs": out}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def summarize(raw: dict) -> dict:
    s: dict[str, dict[str, float]] = {}
    for mode, runs in raw["runs"].items():
        later = runs[1:] or runs  # the first save of the process mode also starts its process
        s[mode] = {k: round(statistics.median(r[k] for r in later), 3) for k in ("blocked_s", "durable_s", "slowdown")}
        s[mode]["first_save_blocked_s"] = round(runs[0]["blocked_s"], 3)
        s[mode]["first_save_durable_s"] = round(runs[0]["durable_s"], 3)
    return s


def table(s: dict, mib: int, nproc: int) -> str:
    rows = [f"| mode ({nproc} gloo ranks, {mib} MiB per rank) | training blocked per save | to durable | "
            "step time while writing / without | first save: blocked, durable |", "|---|---|---|---|---|"]
    for mode, m in s.items():
        rows.append(f"| {mode} | {m['blocked_s']:.3f} s | {m['durable_s']:.3f} s | {m['slowdown']:.2f}x | "
                    f"{m['first_save_blocked_s']:.3f} s, {m['first_save_durable_s']:.3f} s |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=144)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--workdir", help="directory on the disk to measure (default: a temporary directory)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-rank0", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        rank_main(args)
        return 0
    work = Path(tempfile.mkdtemp(prefix="slurmft-async-modes-", dir=args.workdir))
    try:
        raw_path = work / "raw.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--rank", "--mib", str(args.mib), "--repeat", str(args.repeat), "--workdir", str(work),
               "--json-rank0", str(raw_path)]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the ranks failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        raw = json.loads(raw_path.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = summarize(raw)
    print(table(s, args.mib, args.nproc))
    if args.json:
        Path(args.json).write_text(json.dumps({"raw": raw, "summary": s}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
