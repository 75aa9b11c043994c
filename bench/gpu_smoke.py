"""GPU smoke test: one rank, NCCL, flash-attn when transformers accepts it; per precision mode the
tokens/s, MFU and peak memory against `slurmft estimate` of a ~1B Llama.

    bash bench/gpu_smoke.sh [--steps 30] [--seq 2048] [--batch 4] [--peak-tflops 989] [--workdir DIR]
                            [--modes bf16-true,bf16-mixed] [--attn auto|flash_attention_2|sdpa]
    bash bench/gpu_smoke.sh --dry-run      # CPU: tiny model, 3 steps, the same modes and checks, no CUDA

Both modes run by default (train.precision bf16-true, then bf16-mixed), in the dry run too. Builds
everything locally (``python -m slurmft.tiny --size 1b --dtype bfloat16``: random weights, locally
trained tokenizer; a synthetic chat dataset), writes a run directory the way ``slurmft submit``
would, runs the real in-job entrypoint under ``torch.distributed.run --nproc_per_node 1`` and reads
its metrics.jsonl and fsdp_report. One H200: about 3-4 minutes.

Checks (``check``: the same ones in the dry run, against the CPU's expectations, so the test suite
catches a wrong check): the precision ran, the sharded parameters are the mode's master dtype and the
compute dtype is the mode's (bfloat16 for both modes: ``dtype`` is the master dtype, float32 in
bf16-mixed), the attention transformers set up is flash_attention_2 when it was asked for or when
``auto`` finds a flash-attn transformers accepts (sdpa otherwise; on CPU always sdpa), the backend
(NCCL on a GPU, gloo on CPU), every step logged with a finite loss, the final checkpoint COMPLETE,
the sharded bytes FSDP2 holds equal to the estimate's weights + gradients + optimizer, and on a GPU
0 < MFU < 1. Peak memory next to the estimate is printed, not checked.

MFU = tokens/s x FLOPs per token / the GPU's dense bf16 peak (H200 and H100 SXM: 989 TFLOP/s).
FLOPs per token, torchtitan's accounting: 6 N + 12 L H Dh T, where N counts every parameter that
multiplies (the LM head included) but not the input embedding (a lookup), L layers, H heads of
Dh, T = data.max_seq_length (the packed row's sequence length; full, non-causal attention, as the
convention has it); activation recomputation is not counted as useful work.
"""

from __future__ import annotations

import argparse
import json
import math
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
        "model": {"name_or_path": str(model), "attn_implementation": args.attn},
        "data": {"datasets": [{"path": str(data)}], "max_seq_length": args.seq, "packing": True},
        "train": {"precision": mode, "max_steps": args.steps, "per_device_batch_size": args.batch, "learning_rate": 1e-5,
                  "warmup_ratio": 0.1, "logging_steps": 1},
        "fsdp": {"activation_checkpointing": True},
        "checkpoint": {"every_steps": args.steps, "keep_last": 1},
        "prepare": {"enabled": False},  # the entrypoint runs alone here: the train job prepares its data
    }
    validate(cfg)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run


def flops_per_token(model_dir: Path, seq: int) -> dict[str, int]:
    """Parameters and training FLOPs per token, torchtitan's way (module docstring), from config.json."""
    from slurmft.plan.estimate import count_parameters, model_shape

    cfg = json.loads((model_dir / "config.json").read_text())
    shape = model_shape(cfg)
    total = count_parameters(cfg)
    # The input embedding is a lookup; a tied embedding matrix still multiplies as the LM head.
    non_embedding = total if shape.tied else total - shape.vocab * shape.hidden
    attention = 12 * shape.layers * shape.heads * shape.head_dim * seq
    return {"params": total, "params_non_embedding": non_embedding,
            "flops_per_token": 6 * non_embedding + attention, "attention_flops_per_token": attention}


def peak_flops(device_name: str, override_tflops: float | None) -> float | None:
    """Dense bf16 peak of the GPU, from --peak-tflops or the table above."""
    if override_tflops:
        return override_tflops * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


def expected(mode: str, on_gpu: bool, attn_requested: str) -> dict[str, str]:
    """What the job must report for ``mode`` on this device (the dry run's CPU expectations included)."""
    from slurmft.job.loading import flash_attention_problem
    from slurmft.precision import PRECISIONS

    precision = PRECISIONS[mode]
    if attn_requested in ("sdpa", "eager"):
        attn = attn_requested
    elif attn_requested == "flash_attention_2" or flash_attention_problem(on_gpu) is None:
        attn = "flash_attention_2"
    else:
        attn = "sdpa"
    return {"precision": mode, "dtype": precision.param_dtype, "compute_dtype": precision.compute_dtype,
            "attn_implementation": attn, "backend": "cuda:nccl" if on_gpu else "gloo"}


def check(one: dict, want: dict[str, str], steps: int, on_gpu: bool) -> list[str]:
    """Every way this mode's run failed the smoke test (empty: it passed)."""
    problems = []
    for key in ("precision", "dtype", "compute_dtype", "attn_implementation"):
        if one.get(key) != want[key]:
            problems.append(f"{key} is {one.get(key)!r}, expected {want[key]!r}")
    if not str(one.get("backend", "")).startswith(want["backend"]):
        problems.append(f"backend is {one.get('backend')!r}, expected {want['backend']}...")
    if one["steps"] != steps:
        problems.append(f"{one['steps']} steps logged, expected {steps}")
    if not (math.isfinite(one["first_loss"]) and math.isfinite(one["last_loss"])):
        problems.append(f"loss is not finite ({one['first_loss']} -> {one['last_loss']})")
    if not one["final_checkpoint_complete"]:
        problems.append(f"checkpoint-{steps} has no COMPLETE marker")
    if not one["tokens_per_s"] > 0:
        problems.append("no throughput measured")
    if one.get("estimated_state_bytes") is not None and one["sharded_state_bytes"] != one["estimated_state_bytes"]:
        problems.append(f"FSDP2 held {one['sharded_state_bytes']:,} B of weights + gradients + optimizer state, "
                        f"slurmft estimate says {one['estimated_state_bytes']:,} B")
    if on_gpu and not (one["mfu"] is not None and 0 < one["mfu"] < 1):
        problems.append(f"MFU {one['mfu']} is outside (0, 1): the FLOP count or the peak is wrong")
    return problems


def estimate_of(run: Path, device_name: str, on_gpu: bool) -> dict:
    """``slurmft estimate`` of the run as written, on a profile describing this machine's device."""
    import psutil
    import torch

    from slurmft.job.train import read_config
    from slurmft.plan.estimate import estimate
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
    from slurmft.watch.progress import read_metrics

    metrics = read_metrics(run / "metrics.jsonl").records  # the steps (the save lines apart)
    steady = [m["tokens_per_s"] for m in metrics[skip:] if m.get("tokens_per_s")] or \
             [m["tokens_per_s"] for m in metrics if m.get("tokens_per_s")]
    tps = statistics.median(steady) if steady else 0.0
    flops = flops_per_token(model_dir, seq)
    fpt = flops["flops_per_token"]
    report = json.loads((run / "fsdp_report" / "rank0.json").read_text())
    out = {
        "device": device_name, **flops, "steps": len(metrics), "seq": seq,
        "backend": report["backend"], "dtype": report["dtype"], "compute_dtype": report["compute_dtype"],
        "precision": report.get("precision"), "reduce_dtype": report.get("reduce_dtype"),
        "attn_implementation": report["attn_implementation"], "attn_requested": report.get("attn_requested"),
        "tokens_per_s": round(tps, 1), "tflops_per_s": round(tps * fpt / 1e12, 1),
        "mfu": round(tps * fpt / peak, 4) if peak else None,
        "peak_gpu_mem_mib": metrics[-1].get("peak_gpu_mem_mib") if metrics else None,
        "peak_rss_mib": metrics[-1].get("peak_rss_mib") if metrics else None,
        "first_loss": metrics[0]["loss"] if metrics else math.nan,
        "last_loss": metrics[-1]["loss"] if metrics else math.nan,
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


#: What the job needs on the machine (module -> pip name), checked before anything is built.
NEEDED = {"torch": "torch", "transformers": "transformers", "accelerate": "accelerate", "trl": "trl",
          "datasets": "datasets", "safetensors": "safetensors", "tokenizers": "tokenizers", "submitit": "submitit",
          "pydantic": "pydantic", "yaml": "pyyaml", "jinja2": "jinja2", "rich": "rich", "click": "click",
          "psutil": "psutil"}


def missing_packages() -> list[str]:
    """pip names of what the job would fail to import here."""
    import importlib.util

    return [pip for module, pip in NEEDED.items() if importlib.util.find_spec(module) is None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=os.environ.get("SLURMFT_SMOKE_DIR", "/tmp/slurmft-gpu-smoke"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: from its name)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: tiny model, 3 steps on one CPU rank")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--modes", default="bf16-true,bf16-mixed",
                    help="comma-separated train.precision values (default: bf16-true,bf16-mixed, in a dry run too)")
    ap.add_argument("--attn", default="auto", choices=["auto", "flash_attention_2", "sdpa"],
                    help="model.attn_implementation (default auto: flash-attention 2 where transformers accepts it)")
    args = ap.parse_args(argv)

    missing = missing_packages()
    if missing:
        print(f"[smoke] missing Python packages: {', '.join(missing)}. Install them (pip install -e '.[train]' "
              "from this repository; on a machine without network, pip download them elsewhere and pip install "
              "--no-index --find-links DIR), then run again", file=sys.stderr)
        return 2
    import torch

    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        print("no CUDA device: run with --dry-run to check the CPU-testable parts", file=sys.stderr)
        return 2
    if args.dry_run:
        args.steps, args.seq, args.batch = 3, 64, 2  # bf16 matmuls are slow on CPU: short rows keep it quick
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
    modes = args.modes.split(",")
    print(f"[smoke] assets ready in {time.time() - t0:.0f}s; modes {', '.join(modes)}", flush=True)
    if on_gpu:
        from slurmft.job.loading import flash_attention_problem

        problem = flash_attention_problem(True)
        print(f"[smoke] flash-attention 2: {'available' if problem is None else 'not used: ' + problem}", flush=True)

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(work / "hf_datasets"),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if not on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    summary: dict = {"modes": {}, "problems": {}}
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
        summary["problems"][mode] = check(one, expected(mode, on_gpu, args.attn), args.steps, on_gpu)
    summary["total_wall_s"] = round(time.time() - t0, 1)
    for mode, one in summary["modes"].items():
        peak = (f"peak {one['peak_gpu_mem_mib']:,.0f} MiB allocated" if one["peak_gpu_mem_mib"] is not None
                else f"peak RSS {one['peak_rss_mib']:,.0f} MiB")
        print(f"[smoke] {mode:10s} {one['tokens_per_s']:>10,.0f} tok/s  MFU {one['mfu']}  {peak} vs estimate "
              f"{one['estimate']['total'] / 2**20:,.0f} MiB (ratio {one.get('peak_vs_estimate')}); attention "
              f"{one['attn_implementation']}, compute {one['compute_dtype']}; sharded state "
              f"{one['sharded_state_bytes']:,} B vs {one['estimated_state_bytes']:,} B estimated", flush=True)
    failed = {mode: p for mode, p in summary["problems"].items() if p}
    for mode, problems in failed.items():
        for problem in problems:
            print(f"[smoke] FAILED {mode}: {problem}", file=sys.stderr, flush=True)
    print(f"[smoke] {'FAILED' if failed else 'passed'} in {summary['total_wall_s']:.0f}s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
