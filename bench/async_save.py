"""Saves that do not stop training: the same run with no periodic saves, with synchronous and with asynchronous ones.

    python bench/async_save.py [--model DIR] [--size tiny] [--steps 30] [--every 5] [--seq-len 256] [--batch 2]
                               [--nproc 2] [--workdir DIR] [--json OUT] [--keep] [--quick]

In one invocation, the real job entrypoint (``python -m torch.distributed.run --standalone --nproc_per_node N
-m slurmft.job.entrypoint train RUN_DIR``, what ``slurmft submit`` runs) trains examples/tiny/run.yaml on
``--model`` (default: the ``slurmft.tiny`` preset ``--size``, cached as bench/checkpoint.py does) three times,
same data, same steps, one after the other:

1. *none*: ``checkpoint.every_steps`` larger than the run (only the final save, after the last step);
2. *sync*: a save every ``--every`` steps, ``checkpoint.async=false`` (training waits for each write);
3. *async*: the same saves with ``checkpoint.async=true`` (staged at the step boundary, written in the
   background, marked when every rank's write is done).

Training time = ``time`` of the last step's ``metrics.jsonl`` record minus the first step's (rank 0; start-up and
the final save are outside it, every periodic save inside). Time lost per save = (training time of the mode -
training time of *none*) / periodic saves. The save records of ``metrics.jsonl`` give each save's ``blocked_s``
(how long training waited for it) and ``durable_s`` (staging to COMPLETE).

Figures: lost per save async / sync, and blocked per save (async) / synchronous save time (``durable_s`` of the
sync run's saves); target <= 0.2 for the latter. The bench also says whether a synchronous save is at least a
fifth of the time between saves (the issue's condition for a meaningful comparison). Prints a markdown table;
``--json OUT`` writes the raw figures; exits 1 when the target is missed. ``--seq-len``/``--batch`` set
``data.max_seq_length``/``train.per_device_batch_size``: a short sequence makes a step cheap beside the save of
a larger model (docs/benchmarks.md's figures: ``--size 150m --seq-len 64 --batch 1``). ``--quick`` (what the test
suite runs): the tiny preset, 6 steps, a save every 2, the target not enforced. The machine's other load hits the
three runs differently: run it on an idle machine and look at the per-save columns first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import REPO, TINY_EXAMPLE, ensure_model, job_env  # noqa: E402 - the bench's shared helpers

TARGET_BLOCKED_RATIO = 0.2


def write_run(run_dir: Path, model_dir: Path, steps: int, every: int, asynchronous: bool, seq_len: int,
              batch: int) -> None:
    import yaml

    from slurmft.config_loading import load_config

    cfg = load_config(TINY_EXAMPLE, [f"model.name_or_path={model_dir}", f"output_dir={run_dir}", "prepare.enabled=false",
                                     f"train.max_steps={steps}", f"checkpoint.every_steps={every}",
                                     f"checkpoint.async={str(asynchronous).lower()}", "checkpoint.keep_last=2",
                                     f"data.max_seq_length={seq_len}", f"train.per_device_batch_size={batch}"])
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def run_mode(name: str, run_dir: Path, env: dict[str, str], nproc: int) -> dict[str, Any]:
    """One training run; its training time and its periodic saves' records."""
    log = run_dir.parent / f"{name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "slurmft.job.entrypoint", "train", str(run_dir)]
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(run_dir.parent))
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run failed (exit {proc.returncode}); log: {log}\n{log.read_text()[-3000:]}")
    from slurmft.watch.progress import read_metrics

    metrics = read_metrics(run_dir / "metrics.jsonl")
    steps = metrics.records
    last = steps[-1]["step"]
    saves = [r for r in metrics.saves if r["step"] < last]  # the final save is outside
    return {"train_s": round(steps[-1]["time"] - steps[0]["time"], 3), "steps": last,
            "step_s": round((steps[-1]["time"] - steps[0]["time"]) / max(1, len(steps) - 1), 4),
            "saves": saves}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(runs: dict[str, dict[str, Any]], every: int) -> dict[str, Any]:
    none, sync, asyn = runs["none"], runs["sync"], runs["async"]
    n = len(sync["saves"])
    lost = {m: (runs[m]["train_s"] - none["train_s"]) / max(1, len(runs[m]["saves"])) for m in ("sync", "async")}
    sync_save = _mean([r["durable_s"] for r in sync["saves"]]) or 0.0
    blocked = _mean([r["blocked_s"] for r in asyn["saves"]]) or 0.0
    between = every * none["step_s"]
    return {"periodic_saves": n, "sync_save_s": round(sync_save, 3), "async_blocked_s": round(blocked, 3),
            "async_durable_s": round(_mean([r["durable_s"] for r in asyn["saves"]]) or 0.0, 3),
            "lost_per_save_s": {m: round(v, 3) for m, v in lost.items()},
            "lost_ratio": round(lost["async"] / lost["sync"], 3) if lost["sync"] > 0 else None,
            "blocked_ratio": round(blocked / sync_save, 3) if sync_save else None,
            "time_between_saves_s": round(between, 3),
            "sync_save_share_of_interval": round(sync_save / between, 3) if between else None,
            "bytes_per_save": sync["saves"][0]["bytes"] if sync["saves"] else None}


def table(runs: dict[str, dict[str, Any]], s: dict[str, Any]) -> str:
    rows = ["| run | training time | per step | periodic saves | lost per save | training waited per save | "
            "to COMPLETE per save |", "|---|---|---|---|---|---|---|"]
    for m in ("none", "sync", "async"):
        r = runs[m]
        blocked = _mean([x["blocked_s"] for x in r["saves"]])
        durable = _mean([x["durable_s"] for x in r["saves"]])
        rows.append(f"| {m} | {r['train_s']:.2f} s | {r['step_s']:.3f} s | {len(r['saves'])} | "
                    f"{s['lost_per_save_s'].get(m, 0.0):.3f} s | "
                    f"{'-' if blocked is None else f'{blocked:.3f} s'} | {'-' if durable is None else f'{durable:.3f} s'} |")
    rows += ["", f"- lost per save, async / sync: **{s['lost_ratio']}**",
             f"- training waited per async save / synchronous save time: **{s['blocked_ratio']}** "
             f"(target <= {TARGET_BLOCKED_RATIO})",
             f"- synchronous save {s['sync_save_s']} s = {s['sync_save_share_of_interval']} of the "
             f"{s['time_between_saves_s']} s between saves (wanted >= 0.2); {s['bytes_per_save']} bytes per checkpoint"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory with tokenizer (default: build the --size preset)")
    ap.add_argument("--size", default="tiny", help="slurmft.tiny preset when --model is not given (default tiny)")
    ap.add_argument("--steps", type=int, help="training steps (default 30; 6 with --quick)")
    ap.add_argument("--every", type=int, help="a periodic save every this many steps (default 5; 2 with --quick)")
    ap.add_argument("--seq-len", type=int, default=256, help="data.max_seq_length (default 256)")
    ap.add_argument("--batch", type=int, default=2, help="train.per_device_batch_size (default 2)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--workdir", help="directory on the disk to measure (default: a temporary directory)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny preset, 6 steps, a save every 2, no target")
    args = ap.parse_args(argv)
    steps, every = args.steps or (6 if args.quick else 30), args.every or (2 if args.quick else 5)
    model = ensure_model(args.model, "tiny" if args.quick else args.size)
    work = Path(tempfile.mkdtemp(prefix="slurmft-async-", dir=args.workdir))
    env = job_env(work)
    runs: dict[str, dict[str, Any]] = {}
    try:
        for name, interval, asynchronous in (("none", steps + 1, False), ("sync", every, False),
                                             ("async", every, True)):
            write_run(work / name, model, steps, interval, asynchronous, args.seq_len, args.batch)
            t0 = time.time()
            runs[name] = run_mode(name, work / name, env, args.nproc)
            print(f"{name}: {runs[name]['train_s']:.2f} s of training ({time.time() - t0:.0f} s in all)", flush=True)
            shutil.rmtree(work / name / "checkpoints")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    s = summarize(runs, every)
    print(table(runs, s))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": s, "model": str(model),
                                               "cpus": os.cpu_count()}, indent=1) + "\n")
    if args.quick:
        print("target not enforced with --quick")
        return 0
    return 0 if s["blocked_ratio"] is not None and s["blocked_ratio"] <= TARGET_BLOCKED_RATIO else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
