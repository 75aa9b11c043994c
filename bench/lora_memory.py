"""LoRA against full fine-tuning: peak memory per rank, training state and checkpoint size, same model, same run.

    python bench/lora_memory.py [--model DIR | --size 150m|1b|tiny] [--nproc 2] [--steps 5] [--r 16]
                                [--target-modules all-linear] [--repeat N] [--workdir DIR] [--json OUT]
                                [--keep] [--quick]

Without ``--model`` it uses the ~171M-parameter Llama of ``python -m slurmft.tiny DIR --size 150m``
(cached under ``$TMPDIR/slurmft-bench/150m-float32``). Both runs are the real train job
(``python -m torch.distributed.run --standalone --nproc_per_node N -m slurmft.job.entrypoint train
RUN_DIR``, the body ``slurmft submit`` runs) on examples/tiny/run.yaml with this model, ``--steps``
optimizer steps and one checkpoint at the last: once as it is (full fine-tuning, fp32 + AdamW), once
with a ``lora:`` section (``lora.r=--r``, ``lora.target_modules=--target-modules``, everything else the
config's defaults). Nothing else differs; both run in this invocation and every ratio is LoRA / full.
``--repeat N`` runs the pair N times, alternating which goes first, and reports the median of each
figure.

What is measured, per rank:

- **peak RSS**: the rank process's ``VmHWM`` (its resident high-water mark, kernel-kept, so nothing
  between two samples is missed), read from ``/proc/<pid>/status`` by this script every 20 ms until the
  process exits; the rank is the ``RANK`` in the process's environment. The table also shows it above
  the *import floor*: the VmHWM of a process that only imports the job (``slurmft.job.train``: torch,
  transformers, TRL, PEFT), measured in the same invocation; that floor is the same for both runs.
  Beside it, the job's own VmHWM when training starts (``fsdp_report/rank<r>.json``: model loaded and
  sharded, no step yet), so the peak splits into loading and training. VmHWM counts file-backed pages
  too: the part of the memory-mapped safetensors a rank read while loading is in both runs' peaks.
- **training state**: the bytes of weights, gradients and AdamW state the rank holds after the first
  optimizer step, counted from its local shards by the job itself (``fsdp_report/rank<r>.json``, the
  numbers ``slurmft estimate`` predicts per rank).
- **checkpoint on disk**: the checkpoint directory's bytes, split into the model part
  (``pytorch_model_fsdp_0/``), the optimizer part (``optimizer_0/``) and the rest (trainer state, RNG
  states, config, tokenizer).
- **time per step** (secondary): the median gap between consecutive ``metrics.jsonl`` records after the
  first step (the first includes warm-up; the checkpoint is saved after the last record).

The estimate's prediction (``slurmft estimate`` of each run's config, on a profile of this machine) is
printed beside the measured training state and checkpoint when the estimate knows LoRA, i.e. when its
LoRA plan differs from its full one; otherwise the LoRA column says so.

Targets (exit 1 when one is missed): the LoRA checkpoint's model and optimizer parts hold only the
trainable parameters (at most ``CKPT_SLACK`` x trainable x (4 + 8) bytes + ``CKPT_FIXED`` for DCP's
metadata: no frozen base weight is saved); the LoRA run's gradients and AdamW state are exactly those
of the trainable parameters on every rank; and (not with ``--quick``) every rank's peak RSS above the
floor is lower with LoRA than with full fine-tuning. ``--quick`` (what the test suite runs): the 5M
tiny preset, 2 steps of 64-token rows (``QUICK_SEQ``: ``data.max_seq_length``), one pair. Its targets do not
depend on the steps or the row length (the checkpoint and the training state are the parameters'); a launch is
mostly its ranks' imports, so the two jobs are most of the quick mode's time however short their steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# bench/checkpoint.py: the environment of a local job run and the cached model preset, one definition each
from checkpoint import ensure_model, job_env

REPO = Path(__file__).resolve().parents[1]
TINY_EXAMPLE = REPO / "examples" / "tiny" / "run.yaml"
MIB = 2**20
CKPT_SLACK = 1.1  # LoRA checkpoint model+optimizer bytes <= this x trainable x 12 B ...
CKPT_FIXED = 1 * MIB  # ... + this (the two DCP .metadata files and per-file headers)
ADAMW_BYTES = 8  # exp_avg + exp_avg_sq, fp32 (the step counter is a scalar)
KINDS = ("full", "lora")
QUICK_SEQ = 64  # --quick: data.max_seq_length (the example's 256 otherwise)


# ------------------------------------------------------------------ memory of other processes
def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


class RankPeaks(threading.Thread):
    """The last VmHWM read of each rank process under ``launcher`` (torchrun's children), until it exits."""

    def __init__(self, launcher: subprocess.Popen, interval_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.launcher, self.interval_s = launcher, interval_s
        self.peak_kib: dict[int, int] = {}  # rank -> VmHWM
        self._ranks: dict[int, int] = {}  # pid -> rank

    def run(self) -> None:
        import psutil

        parent = psutil.Process(self.launcher.pid)
        while self.launcher.poll() is None:
            try:
                pids = [c.pid for c in parent.children(recursive=False)]
            except psutil.NoSuchProcess:
                break
            for pid in pids:
                if pid not in self._ranks:
                    rank = _rank_of(pid)
                    if rank is None:
                        continue
                    self._ranks[pid] = rank
                hwm = _status_kib(pid, "VmHWM")
                if hwm is not None:
                    rank = self._ranks[pid]
                    self.peak_kib[rank] = max(self.peak_kib.get(rank, 0), hwm)
            time.sleep(self.interval_s)


def same_imports_env(work: Path) -> dict[str, str]:
    """The jobs' environment, every installed package imported as the floor imports it: without this,
    slurmft.job.unused_packages keeps peft out of a full fine-tune but not out of a LoRA run, and the floor
    would no longer be the same for both."""
    return {**job_env(work), "SLURMFT_IMPORT_EVERYTHING": "1"}


def import_floor(env: dict[str, str]) -> int:
    """VmHWM (bytes) of a process that imports what a rank imports before it loads anything."""
    code = ("import torch.distributed, peft, trl, slurmft.job.train\n"
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=REPO)
    return int(out.stdout.split()[-1]) * 1024


# ------------------------------------------------------------------ the runs
def write_run(run_dir: Path, model_dir: Path, steps: int, lora: list[str] | None, seq: int | None = None) -> None:
    """run_dir/config.yaml from examples/tiny/run.yaml: this model, ``steps`` steps, one checkpoint at the last;
    ``lora``: the overrides of the LoRA run (None: full fine-tuning); ``seq``: data.max_seq_length (None: the
    example's)."""
    import yaml

    from slurmft.config_loading import load_config

    overrides = [f"model.name_or_path={model_dir}", f"output_dir={run_dir}", f"train.max_steps={steps}",
                 f"checkpoint.every_steps={steps}", "checkpoint.keep_last=1", "train.logging_steps=1",
                 "prepare.enabled=false"] + ([f"data.max_seq_length={seq}"] if seq else [])
    cfg = load_config(TINY_EXAMPLE, overrides + (lora or []))
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def checkpoint_sizes(ckpt: Path) -> dict[str, int]:
    """Bytes of one checkpoint: model part, optimizer part, the rest, and the whole directory."""
    model = dir_bytes(ckpt / "pytorch_model_fsdp_0")
    optimizer = dir_bytes(ckpt / "optimizer_0")
    total = dir_bytes(ckpt)
    return {"model": model, "optimizer": optimizer, "other": total - model - optimizer, "total": total}


def run_job(run_dir: Path, env: dict[str, str], nproc: int) -> dict[str, Any]:
    """Run the train job to its end, sampling each rank's VmHWM; the figures of the run."""
    log = run_dir.parent / f"{run_dir.name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "slurmft.job.entrypoint", "train", str(run_dir)]
    with open(log, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(run_dir.parent))
        peaks = RankPeaks(proc)
        peaks.start()
        rc = proc.wait()
        peaks.join()
        wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"the train job failed (exit {rc}); log: {log}\n{log.read_text()[-3000:]}")
    if sorted(peaks.peak_kib) != list(range(nproc)):
        raise SystemExit(f"sampled the peak of ranks {sorted(peaks.peak_kib)} only, expected 0..{nproc - 1}")
    from slurmft.watch.progress import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl").records  # the steps (the save lines apart)
    gaps = [b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False)]
    ckpts = sorted((run_dir / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    ranks = []
    for rank in range(nproc):
        rep = json.loads((run_dir / "fsdp_report" / f"rank{rank}.json").read_text())
        ranks.append({"rank": rank, "peak_rss": peaks.peak_kib[rank] * 1024,
                      "start_peak_rss": int(rep["peak_rss_mib"] * MIB),
                      "weights": rep["weights_bytes"], "gradients": rep["gradients_bytes"],
                      "optimizer": rep["optimizer_bytes"], "trainable": (rep.get("lora") or {}).get("trainable_params"),
                      "total_params": rep["num_params"], "reference": rep.get("reference_bytes")})
    return {"ranks": ranks, "checkpoint": checkpoint_sizes(ckpts[-1]), "checkpoint_name": ckpts[-1].name,
            "step_s": statistics.median(gaps) if gaps else None, "steps": len(records), "wall_s": round(wall, 1),
            "job_peak_rss_mib": max(r["peak_rss_mib"] for r in records)}


def estimate_of(run_dir: Path) -> dict[str, Any] | None:
    """``slurmft estimate`` of the run as written, on a profile of this machine (CPU ranks); None if it fails."""
    import psutil

    from slurmft.config_loading import read_run_config
    from slurmft.plan.estimate import estimate
    from slurmft.profiles import ClusterProfile
    from slurmft.rundir import RunPaths

    profile = ClusterProfile(name="this-machine", description="CPU ranks", gpu={"type": "none", "memory_gb": 1.0},
                             node_memory_gb=psutil.virtual_memory().total / 1e9, gres_gpu=False)
    try:
        plan = estimate(read_run_config(RunPaths.of(run_dir).config), profile)
    except Exception as exc:  # noqa: BLE001  (a secondary figure: the bench reports without it)
        print(f"estimate failed for {run_dir.name}: {exc}", file=sys.stderr)
        return None
    g = plan["per_gpu"]
    return {"weights": g["weights"], "gradients": g["gradients"], "optimizer": g["optimizer"],
            "state": g["weights"] + g["gradients"] + g["optimizer"], "total": g["total"],
            "reference": g["reference_weights"],  # DPO's reference copy, included in weights (0: none)
            "checkpoint": plan["checkpoint_bytes"]}


def median_result(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from ``--repeat`` runs of it: the median of each number (byte counts are equal anyway)."""
    first = results[0]
    ranks = [{**r, **{key: int(statistics.median(x["ranks"][i][key] for x in results))
                      for key in ("peak_rss", "start_peak_rss")}} for i, r in enumerate(first["ranks"])]
    return {**first, "ranks": ranks, "repeats": len(results),
            "step_s": statistics.median(x["step_s"] for x in results if x["step_s"] is not None),
            "peak_rss_each": [[x["ranks"][i]["peak_rss"] for x in results] for i in range(len(ranks))]}


# ------------------------------------------------------------------ report
def _state(r: dict[str, Any]) -> int:
    return r["weights"] + r["gradients"] + r["optimizer"]


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "-"


def table(res: dict[str, Any]) -> str:
    """The markdown table docs/benchmarks.md quotes."""
    full, lora, floor = res["full"], res["lora"], res["import_floor"]
    fr0 = full["ranks"][0]
    trainable = lora["ranks"][0]["trainable"]
    params = fr0["total_params"]
    lines = [
        f"Model: {params / 1e6:.1f}M parameters, fp32 + AdamW, {len(full['ranks'])} CPU ranks (gloo), "
        f"{full['steps']} steps, seq {res['seq']} x micro-batch {res['micro_batch']}, activation checkpointing "
        f"{'on' if res['activation_checkpointing'] else 'off'}. LoRA: r={res['r']}, alpha={res['alpha']:g}, "
        f"{res['target_modules']}: {trainable:,} trainable parameters ({trainable / params:.2%}). "
        f"Import floor (VmHWM of a process that only imports the job): {floor / MIB:.0f} MiB"
        + (f"; median of {full['repeats']} pairs." if full.get("repeats", 1) > 1 else "."),
        "",
        "| per rank unless said | full fine-tuning | LoRA | LoRA / full |",
        "|---|---|---|---|",
    ]
    for i, fr in enumerate(full["ranks"]):
        lr = lora["ranks"][i]
        lines.append(f"| peak RSS, rank {i}, MiB | {fr['peak_rss'] / MIB:.0f} | {lr['peak_rss'] / MIB:.0f} "
                     f"| {_ratio(lr['peak_rss'], fr['peak_rss'])} |")
    for i, fr in enumerate(full["ranks"]):
        lr = lora["ranks"][i]
        fa, la = fr["peak_rss"] - floor, lr["peak_rss"] - floor
        lines.append(f"| peak RSS above the import floor, rank {i}, MiB | {fa / MIB:.0f} | {la / MIB:.0f} "
                     f"| {_ratio(la, fa)} |")
    for i, fr in enumerate(full["ranks"]):
        lr = lora["ranks"][i]
        lines.append(f"| peak RSS by the start of training (loaded; the job's fsdp_report), rank {i}, MiB "
                     f"| {fr['start_peak_rss'] / MIB:.0f} | {lr['start_peak_rss'] / MIB:.0f} "
                     f"| {_ratio(lr['start_peak_rss'], fr['start_peak_rss'])} |")
    lr0 = lora["ranks"][0]
    for key, name in (("weights", "weights (frozen base + adapters)"), ("gradients", "gradients"),
                      ("optimizer", "AdamW state")):
        lines.append(f"| {name}, rank 0, MiB | {fr0[key] / MIB:.1f} | {lr0[key] / MIB:.1f} "
                     f"| {_ratio(lr0[key], fr0[key])} |")
    lines.append(f"| training state (weights + gradients + AdamW), rank 0, MiB | {_state(fr0) / MIB:.1f} "
                 f"| {_state(lr0) / MIB:.1f} | {_ratio(_state(lr0), _state(fr0))} |")
    fe, le = res["estimate"]["full"], res["estimate"]["lora"]
    if fe is not None:
        knows = le is not None and le["state"] != fe["state"]
        lora_state = f"{le['state'] / MIB:.1f}" if knows else "(estimate has no LoRA mode)"
        lines.append(f"| &nbsp;&nbsp;estimate's training state, largest rank, MiB | {fe['state'] / MIB:.1f} "
                     f"| {lora_state} | {_ratio(le['state'], fe['state']) if knows else '-'} |")
    fc, lc = full["checkpoint"], lora["checkpoint"]
    for key, name in (("model", "model part (`pytorch_model_fsdp_0/`)"), ("optimizer", "optimizer part (`optimizer_0/`)"),
                      ("other", "the rest (trainer state, RNG, tokenizer, config)"), ("total", "whole directory")):
        lines.append(f"| checkpoint, {name}, all ranks, MiB | {fc[key] / MIB:.2f} | {lc[key] / MIB:.2f} "
                     f"| {_ratio(lc[key], fc[key])} |")
    if fe is not None:
        knows = le is not None and le["checkpoint"] != fe["checkpoint"]
        lora_ckpt = f"{le['checkpoint'] / MIB:.2f}" if knows else "(estimate has no LoRA mode)"
        lines.append(f"| &nbsp;&nbsp;estimate's checkpoint (model + optimizer), MiB | {fe['checkpoint'] / MIB:.2f} "
                     f"| {lora_ckpt} | {_ratio(le['checkpoint'], fe['checkpoint']) if knows else '-'} |")
    lines.append(f"| time per step (median after the first), s | {full['step_s']:.2f} | {lora['step_s']:.2f} "
                 f"| {_ratio(lora['step_s'], full['step_s'])} |")
    return "\n".join(lines)


def targets(res: dict[str, Any], quick: bool) -> list[str]:
    """The targets this run missed (empty: all met)."""
    full, lora, floor = res["full"], res["lora"], res["import_floor"]
    missed = []
    trainable = lora["ranks"][0]["trainable"]
    if not trainable:
        return ["the LoRA run's fsdp_report has no lora.trainable_params: did the lora section reach the job?"]
    ckpt = lora["checkpoint"]["model"] + lora["checkpoint"]["optimizer"]
    bound = CKPT_SLACK * trainable * (4 + ADAMW_BYTES) + CKPT_FIXED
    if ckpt > bound:
        missed.append(f"LoRA checkpoint model+optimizer {ckpt / MIB:.2f} MiB > {bound / MIB:.2f} MiB "
                      f"({CKPT_SLACK} x {trainable:,} trainable x 12 B + {CKPT_FIXED / MIB:.0f} MiB): base weights saved?")
    held = sum(r["gradients"] + r["optimizer"] for r in lora["ranks"])
    if held != trainable * (4 + ADAMW_BYTES):
        missed.append(f"LoRA gradients + AdamW state on all ranks {held:,} B != {trainable:,} trainable x 12 B")
    if not quick:
        for fr, lr in zip(full["ranks"], lora["ranks"], strict=True):
            if lr["peak_rss"] - floor >= fr["peak_rss"] - floor:
                missed.append(f"rank {fr['rank']}: LoRA peak RSS {lr['peak_rss'] / MIB:.0f} MiB >= full "
                              f"{fr['peak_rss'] / MIB:.0f} MiB")
    return missed


# ------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory with tokenizer (default: build the --size preset)")
    ap.add_argument("--size", default=None, choices=["tiny", "150m", "1b"], help="slurmft.tiny preset (default 150m; "
                    "tiny with --quick)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 5; 2 with --quick)")
    ap.add_argument("--r", type=int, default=16, help="lora.r of the LoRA run")
    ap.add_argument("--target-modules", default="all-linear", help="lora.target_modules of the LoRA run "
                    "(all-linear, or names joined by commas: q_proj,v_proj)")
    ap.add_argument("--repeat", type=int, default=1, help="pairs of runs, alternating which goes first; medians")
    ap.add_argument("--workdir", help="where the run directories go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories and job logs")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--quick", action="store_true", help="smoke test: the tiny preset, 2 steps of 64-token rows; the peak-RSS target "
                    "is not enforced")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.quick else 5)
    model = ensure_model(args.model, args.size or ("tiny" if args.quick else "150m"))
    targets_arg = args.target_modules if args.target_modules == "all-linear" else f"[{args.target_modules}]"
    lora = [f"lora.r={args.r}", f"lora.target_modules={targets_arg}"]
    base = Path(args.workdir) if args.workdir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="slurmft-lora-bench-", dir=base))
    try:
        env = same_imports_env(work)
        floor = import_floor(env)
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for rep in range(args.repeat):
            for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
                run = work / f"{kind}-{rep}"
                write_run(run, model, steps, lora if kind == "lora" else None, QUICK_SEQ if args.quick else None)
                runs[kind].append(run_job(run, env, args.nproc))
                print(f"{kind} run {rep + 1}/{args.repeat}: {runs[kind][-1]['wall_s']} s", flush=True)
        from slurmft.config_loading import read_run_config

        cfg = read_run_config(work / "lora-0" / "config.yaml")
        result = {
            "model": str(model), "import_floor": floor, "r": cfg.lora.r, "alpha": cfg.lora.alpha,
            "target_modules": args.target_modules, "seq": cfg.data.max_seq_length,
            "micro_batch": cfg.train.per_device_batch_size, "activation_checkpointing": cfg.fsdp.activation_checkpointing,
            "full": median_result(runs["full"]), "lora": median_result(runs["lora"]),
            "estimate": {kind: estimate_of(work / f"{kind}-0") for kind in KINDS}, "quick": args.quick,
        }
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    missed = targets(result, args.quick)
    verdict = "met" if not missed else "MISSED: " + "; ".join(missed)
    peak = "" if args.quick else ", LoRA peak RSS above the floor below full fine-tuning's on every rank"
    print(f"\ntargets (LoRA checkpoint = trainable parameters only, LoRA gradients + AdamW = trainable x 12 B{peak}"
          f"{'; the peak target is not enforced with --quick' if args.quick else ''}): {verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
