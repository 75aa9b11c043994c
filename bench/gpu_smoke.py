"""GPU smoke test: one rank, NCCL, flash-attn when installed; per precision mode the tokens/s, MFU and peak
memory against `slurmft estimate` of a ~1B Llama.

    bash bench/gpu_smoke.sh [--steps 30] [--seq 2048] [--batch 4] [--peak-tflops 989] [--workdir DIR]
                            [--modes bf16-true,bf16-mixed]
    bash bench/gpu_smoke.sh --dry-run      # CPU: tiny model, 3 steps, fp32, same code path minus CUDA

With a GPU both modes run by default (train.precision bf16-true, then bf16-mixed); each line of the
summary gives the peak allocated GPU memory next to the estimator's per-GPU total for that run, and
the sharded bytes FSDP2 really held (fsdp_report) next to the estimated weights + gradients + optimizer.

Builds everything locally (``python -m slurmft.tiny --size 1b --dtype bfloat16``: random weights,
locally trained tokenizer; a synthetic chat dataset), writes a run directory the way ``slurmft
submit`` would, runs the real in-job entrypoint under ``torch.distributed.run --nproc_per_node 1``
and reads its metrics.jsonl and fsdp_report. One machine with one GPU, well under 5 minutes.

MFU = tokens/s x (6 N + 12 L d T) / peak bf16 FLOP/s (PaLM's accounting: N parameters, L layers,
model width d, sequence length T; activation recomputation is not counted as useful work).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    "the", "model", "reads", "a", "long", "document", "about", "distributed", "training", "and", "answers",
    "questions", "on", "sharding", "checkpoints", "memory", "throughput", "gradients", "optimizers", "schedules",
    "tokens", "packing", "attention",
]
# Dense bf16 peak per GPU, FLOP/s (vendor spec sheets, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def make_data(path: Path, n: int, seed: int = 0) -> Path:
    """Synthetic multi-turn chats in ``messages`` format (enough tokens to pack full sequences)."""
    rng = random.Random(seed)
    words = WORDS
    with open(path, "w") as f:
        for _ in range(n):
            messages = []
            for _ in range(rng.randint(1, 4)):
                messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(8, 60)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(20, 200)))})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_run(run: Path, model: Path, data: Path, args: argparse.Namespace, on_gpu: bool, mode: str) -> Path:
    """config.yaml as ``slurmft submit`` would resolve it."""
    from slurmft.config import validate

    cfg = {
        "name": "gpu-smoke", "output_dir": str(run), "executor": "local",
        "resources": {"nodes": 1, "gpus_per_node": 1 if on_gpu else 0, "tasks_per_node": 1, "cpus_per_task": 8},
        "model": {"name_or_path": str(model), "attn_implementation": "auto"},
        "data": {"datasets": [{"path": str(data)}], "max_seq_length": args.seq, "packing": True},
        "train": {"precision": mode, "max_steps": args.steps, "per_device_batch_size": args.batch, "learning_rate": 1e-5,
                  "warmup_ratio": 0.1, "logging_steps": 1},
        "fsdp": {"activation_checkpointing": True},
        "checkpoint": {"every_steps": args.steps, "keep_last": 1},
    }
    validate(cfg)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run


def flops_per_token(model_dir: Path, seq: int) -> tuple[float, int]:
    """(6N + 12 L d T, N) from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    d, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or d // heads
    attn = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d
    per_layer = attn + 3 * d * inter + 2 * d
    n = layers * per_layer + 2 * vocab * d + d  # untied embeddings + head, final norm
    return 6 * n + 12 * layers * d * seq, n


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    """Dense bf16 peak of the GPU, from --peak-tflops or the table above."""
    if override_tflops:
        return override_tflops * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def estimate_of(run: Path, device_name: str, on_gpu: bool) -> dict:
    """``slurmft estimate`` of the run as written, on a profile describing this machine's device."""
    import psutil
    import torch

    from slurmft.estimate import estimate
    from slurmft.job.train import read_config
    from slurmft.profiles import ClusterProfile
    from slurmft.rundir import RunPaths

    gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if on_gpu else 1.0
    profile = ClusterProfile(name="this-machine", description=device_name,
                             gpu={"type": device_name if on_gpu else "none", "memory_gb": gb},
                             node_memory_gb=psutil.virtual_memory().total / 1e9, gres_gpu=on_gpu)
    return estimate(read_config(RunPaths.of(run)), profile)


def summarize(run: Path, model_dir: Path, seq: int, device_name: str, peak: float | None, skip: int,
              plan: dict | None = None) -> dict:
    """Throughput and MFU from the job's metrics.jsonl and fsdp_report; memory against ``plan`` (the estimate)."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [m["tokens_per_s"] for m in metrics[skip:] if m.get("tokens_per_s")] or \
             [m["tokens_per_s"] for m in metrics if m.get("tokens_per_s")]
    tps = statistics.median(steady) if steady else 0.0
    fpt, n_params = flops_per_token(model_dir, seq)
    report = json.loads((run / "fsdp_report" / "rank0.json").read_text())
    out = {
        "device": device_name, "params": n_params, "steps": len(metrics), "seq": seq,
        "backend": report["backend"], "dtype": report["dtype"], "compute_dtype": report["compute_dtype"],
        "precision": report.get("precision"), "reduce_dtype": report.get("reduce_dtype"),
        "attn_implementation": report["attn_implementation"],
        "tokens_per_s": round(tps, 1), "tflops_per_s": round(tps * fpt / 1e12, 1),
        "mfu": round(tps * fpt / peak, 4) if peak else None,
        "peak_gpu_mem_mib": metrics[-1].get("peak_gpu_mem_mib"), "peak_rss_mib": metrics[-1].get("peak_rss_mib"),
        "first_loss": metrics[0]["loss"], "last_loss": metrics[-1]["loss"],
        "final_checkpoint_complete": (run / "checkpoints" / f"checkpoint-{len(metrics)}" / "COMPLETE").is_file(),
        "sharded_state_bytes": sum(report.get(k, 0) for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes")),
    }
    if plan is not None:
        g = plan["per_gpu"]
        out["estimate"] = {k: g[k] for k in ("weights", "gradients", "optimizer", "comm_buffers", "reduce_scatter",
                                             "activations", "overhead", "total", "capacity")}
        out["estimated_state_bytes"] = g["weights"] + g["gradients"] + g["optimizer"]
        if out["peak_gpu_mem_mib"]:
            out["peak_vs_estimate"] = round(out["peak_gpu_mem_mib"] * 2**20 / g["total"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=os.environ.get("SLURMFT_SMOKE_DIR", "/tmp/slurmft-gpu-smoke"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: from its name)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: tiny model, 3 steps on one CPU rank")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--modes", help="comma-separated train.precision values (default: bf16-true,bf16-mixed on a "
                    "GPU, fp32 in a dry run)")
    args = ap.parse_args(argv)

    import torch

    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        print("no CUDA device: run with --dry-run to check the CPU-testable parts", file=sys.stderr)
        return 2
    if args.dry_run:
        args.steps, args.seq, args.batch = 3, 256, 2
    size, file_dtype = ("1b", "bfloat16") if on_gpu else ("tiny", "float32")
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu (dry run)"
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model_dir = work / f"model-{size}"
    if not (model_dir / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-m", "slurmft.tiny", str(model_dir), "--size", size, "--dtype", file_dtype],
                       check=True, cwd=REPO)
    data = make_data(work / "chat.jsonl", 4000 if on_gpu else 200)
    modes = (args.modes or ("bf16-true,bf16-mixed" if on_gpu else "fp32")).split(",")
    print(f"[smoke] assets ready in {time.time() - t0:.0f}s; modes {', '.join(modes)}", flush=True)

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(work / "hf_datasets"),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if not on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    summary: dict = {"modes": {}}
    ok = True
    for mode in modes:
        run = write_run(work / f"run-{mode}-{int(time.time())}", model_dir, data, args, on_gpu, mode)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "slurmft.job.entrypoint", "train", str(run)]
        t1 = time.time()
        proc = subprocess.run(cmd, env=env, cwd=REPO)
        if proc.returncode != 0:
            print(f"[smoke] {mode}: training failed with exit code {proc.returncode}", file=sys.stderr)
            return proc.returncode
        one = summarize(run, model_dir, args.seq, device_name, peak_flops(device_name, args.peak_tflops),
                        skip=5 if on_gpu else 0, plan=estimate_of(run, device_name, on_gpu))
        one["train_wall_s"] = round(time.time() - t1, 1)
        summary["modes"][mode] = one
        print(f"[smoke] {mode}: " + json.dumps(one, indent=1), flush=True)
        ok = ok and one["final_checkpoint_complete"] and one["tokens_per_s"] > 0 and one["precision"] == mode
        if on_gpu:
            ok = ok and one["backend"].startswith("cuda:nccl") and one["compute_dtype"] == "bfloat16"
    summary["total_wall_s"] = round(time.time() - t0, 1)
    for mode, one in summary["modes"].items():
        print(f"[smoke] {mode:10s} {one['tokens_per_s']:>10,.0f} tok/s  MFU {one['mfu']}  peak "
              f"{one['peak_gpu_mem_mib']} MiB vs estimate {one['estimate']['total'] / 2**20:,.0f} MiB "
              f"(ratio {one.get('peak_vs_estimate')}); sharded state {one['sharded_state_bytes']:,} B vs "
              f"{one['estimated_state_bytes']:,} B estimated", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
