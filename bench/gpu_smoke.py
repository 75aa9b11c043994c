"""GPU smoke test: the real in-job training on one GPU (NCCL, flash-attn when transformers accepts it), per
model and precision mode the tokens/s, MFU and peak memory against `slurmft estimate`, the asynchronous save's
blocked time against a synchronous save, the sliced load's host RSS; one JSON and a short text.

    bash bench/gpu_smoke.sh [--out DIR] [--budget-s 300] [--steps 30] [--seq 2048] [--batch 4] [--peak-tflops 989]
                            [--workdir DIR] [--modes bf16-true,bf16-mixed] [--attn auto|flash_attention_2|sdpa]
    bash bench/gpu_smoke.sh --dry-run      # CPU: tiny models, 3 steps, the same cases and checks, no CUDA

On the lent GPU machine it is one device command (docs/development.md): the wheels of bench/gpu_wheels.sh
installed with ``pip install --no-index --no-deps --target``, slurmft from the checkout, ``--out $OUT``.

The cases, in this order (each its own run of the real entrypoint under ``torch.distributed.run
--nproc_per_node 1``, reading its metrics.jsonl and fsdp_report), so that a budget cut keeps the first ones:

1. the ~1.1B Llama (``python -m slurmft.tiny --size 1b --dtype bfloat16``: random weights, local tokenizer) in the
   first mode, with a checkpoint every third of the steps: the periodic saves are asynchronous (the default:
   staged into pinned CPU memory on a GPU, written in the background) and the final one synchronous, so one run
   gives the time training waited per asynchronous save against a synchronous save of the same state;
2. the ~1.1B Llama in the other modes;
3. an 8B-shaped Llama in every mode: configs/models/llama-3-8b.json's width (hidden 4096, MLP 14336, 32 heads of
   128, 8 KV heads, vocabulary 128,256) with ``--layers`` decoder layers (4: it fits one GPU with AdamW in either
   mode), so its per-layer figures are Llama-3-8B's; the embedding and the head are 8B's too, a larger share of
   the FLOPs than in the 32-layer model;
4. where flash-attn is usable, the ~1.1B Llama once more with SDPA, beside case 1's flash-attn.

The dry run (3 steps of 64-token rows, 2 sequences) trains each mode and each model once, as many runs as modes:
the tiny preset in the first mode with its asynchronous saves (one every step), then the 8B shape narrowed to
CPU_WIDTH (the same build, one layer) in the other mode.

A synthetic chat dataset, written the way ``slurmft submit`` would write a run directory. ``--budget-s`` (the
device command sets it below the command's time limit): a case starts only when the time left holds it (the
longest case of that model so far, or 1.5x the longest of any for a new model), and a case still running when
the budget ends is stopped; both are recorded as skipped. The JSON and the text are rewritten after every case.

Checks (``check``; the same ones in the dry run, against the CPU's expectations, so the test suite catches a
wrong check): the precision ran, the sharded parameters are the mode's master dtype and the compute dtype is the
mode's (bfloat16 for both modes: ``dtype`` is the master dtype, float32 in bf16-mixed), the attention
transformers set up is flash_attention_2 when it was asked for or when ``auto`` finds a flash-attn transformers
accepts (sdpa otherwise; on CPU always sdpa), the backend (NCCL on a GPU, gloo on CPU), every step logged with a
finite loss, the final checkpoint COMPLETE, the sharded bytes FSDP2 holds equal to the estimate's weights +
gradients + optimizer, the periodic saves asynchronous and the final one synchronous, and on a GPU 0 < MFU < 1.
Peak memory next to the estimate is printed, not checked.

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
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # slurmft from this checkout: on the lent GPU machine nothing is installed
if str(REPO / "bench") not in sys.path:  # run as a script it is there already
    sys.path.append(str(REPO / "bench"))
import gpu_image  # noqa: E402 - bench/gpu_image.py, found through the path above

WORDS = [
    "the", "model", "reads", "a", "long", "document", "about", "distributed", "training", "and", "answers",
    "questions", "on", "sharding", "checkpoints", "memory", "throughput", "gradients", "optimizers", "schedules",
    "tokens", "packing", "attention",
]
# Dense bf16 peak per GPU, FLOP/s (vendor spec sheets, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}
#: The model the 8B-shaped case takes its width from.
LLAMA3_8B = REPO / "configs" / "models" / "llama-3-8b.json"
#: The dry run's 8B-shaped model: the same build, narrower, so it trains on a CPU (vocabulary: the tokenizer's).
CPU_WIDTH = {"hidden_size": 256, "intermediate_size": 896, "num_attention_heads": 4, "num_key_value_heads": 1,
             "num_hidden_layers": 1}
#: The versions the output's first line names (the JSON has every one the job needs).
KEY_PACKAGES = ("torch", "transformers", "accelerate", "trl", "datasets", "peft", "safetensors", "pydantic")
#: Published figures the smoke's are read against (the text's last lines).
TARGETS = ("torchtitan, Llama-3-8B, FSDP: 5,762 tok/s/GPU, 33-39 % MFU on H100; HF-stack FSDP2 baseline ~21 % MFU; "
           "asynchronous save: 0.02 s blocked per save (torchtitan#1287)")


@dataclass(frozen=True)
class Case:
    """One training run of the smoke: which model, which precision mode, which attention, how often it saves."""

    model: str  # "1b" or "8b-shaped" (a GPU); "tiny" or "8b-shaped" (the dry run, CPU_WIDTH)
    mode: str
    attn: str
    every: int  # checkpoint.every_steps: below the step count, the periodic saves are asynchronous

    @property
    def name(self) -> str:
        return f"{self.model}/{self.mode}" + ("" if self.attn == "auto" else f"/{self.attn}")


def plan_cases(modes: list[str], steps: int, attn: str, on_gpu: bool, flash_usable: bool) -> list[Case]:
    """The cases in the order they run (the module docstring's list). The dry run trains each mode and each model
    once, in as many runs as the modes (each run costs a CPU start-up): the small model in the first mode with
    the asynchronous saves, the 8B shape in the others (in the first too when there is only one)."""
    small = "1b" if on_gpu else "tiny"
    first = Case(small, modes[0], attn, max(1, steps // 3))
    if not on_gpu:
        return [first] + [Case("8b-shaped", mode, attn, steps) for mode in (modes[1:] or modes)]
    cases = [first] + [Case(small, mode, attn, steps) for mode in modes[1:]]
    cases += [Case("8b-shaped", mode, attn, steps) for mode in modes]
    if flash_usable and attn == "auto":
        cases.append(Case(small, modes[0], "sdpa", steps))
    return cases


def over_budget(case: Case, took: dict[str, float], left: float | None) -> str | None:
    """Why ``case`` must not start with ``left`` seconds of the budget left (None: it may): it needs as long as the
    longest case of its model so far, or 1.5x the longest of any for a model not run yet (a larger one follows)."""
    need = took.get(case.model, 1.5 * max(took.values(), default=0.0))
    if left is None or need <= left:
        return None
    return f"budget: {left:.0f}s left, the case needs ~{need:.0f}s"


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


def build_8b_shaped(out: Path, tokenizer_dir: Path, layers: int, on_gpu: bool) -> Path:
    """Llama-3-8B's config with ``layers`` decoder layers, random bf16 weights (built on the GPU when there is one:
    seconds instead of a minute), and the tokenizer of ``tokenizer_dir`` (its ids fit the larger vocabulary). In a
    dry run the width is CPU_WIDTH's and the vocabulary the tokenizer's."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    spec = json.loads(LLAMA3_8B.read_text())
    spec.update(num_hidden_layers=layers, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    if not on_gpu:
        spec.update(CPU_WIDTH, vocab_size=len(tokenizer))
    for key in ("_name_or_path", "architectures", "model_type", "torch_dtype"):
        spec.pop(key, None)
    config = LlamaConfig(**spec)
    torch.manual_seed(0)
    with torch.device("cuda" if on_gpu else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del model
    if on_gpu:
        torch.cuda.empty_cache()
    return out


def write_run(run: Path, model: Path, data: Path, args: argparse.Namespace, on_gpu: bool, case: Case) -> Path:
    """config.yaml as ``slurmft submit`` would resolve it."""
    from slurmft.config_loading import validate

    cfg = {
        "name": "gpu-smoke", "output_dir": str(run), "executor": "local",
        "resources": {"nodes": 1, "gpus_per_node": 1 if on_gpu else 0, "tasks_per_node": 1, "cpus_per_task": 8},
        "model": {"name_or_path": str(model), "attn_implementation": case.attn},
        "data": {"datasets": [{"path": str(data)}], "max_seq_length": args.seq, "packing": True},
        "train": {"precision": case.mode, "max_steps": args.steps, "per_device_batch_size": args.batch,
                  "learning_rate": 1e-5, "warmup_ratio": 0.1, "logging_steps": 1},
        "fsdp": {"activation_checkpointing": True},
        "checkpoint": {"every_steps": case.every, "keep_last": 1},
        "prepare": {"enabled": False},  # the entrypoint runs alone here: the train job prepares its data
    }
    validate(cfg)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run


def flops_per_token(model_dir: Path, seq: int) -> dict[str, int]:
    """Parameters and training FLOPs per token, torchtitan's way (module docstring), from config.json."""
    from slurmft.plan.modelshape import count_parameters, model_shape

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
    """Every way this case's run failed the smoke test (empty: it passed)."""
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
    saves = one.get("saves", [])
    periodic = [s for s in saves if s["step"] < steps]
    if any(s["mode"] != "async" for s in periodic):
        problems.append(f"periodic saves not asynchronous: {[(s['step'], s['mode']) for s in periodic]}")
    if [s["mode"] for s in saves if s["step"] == steps] != ["sync"]:
        problems.append(f"the final save (step {steps}) is not one synchronous save: {saves}")
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

    read = read_metrics(run / "metrics.jsonl")
    metrics = read.records  # the steps (the save lines apart)
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
        # the host RSS when training began: the sliced load's peak (each rank reads only its slice)
        "load_peak_rss_mib": report.get("peak_rss_mib"),
        "first_loss": metrics[0]["loss"] if metrics else math.nan,
        "last_loss": metrics[-1]["loss"] if metrics else math.nan,
        "final_checkpoint_complete": (run / "checkpoints" / f"checkpoint-{len(metrics)}" / "COMPLETE").is_file(),
        "sharded_state_bytes": sum(report.get(k, 0) for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes")),
        "saves": [{k: s.get(k) for k in ("step", "mode", "blocked_s", "durable_s", "bytes")} for s in read.saves],
    }
    if plan is not None:
        g = plan["per_gpu"]
        out["estimate"] = {k: g[k] for k in ("weights", "gradients", "optimizer", "comm_buffers", "reduce_scatter",
                                             "activations", "overhead", "total", "capacity")}
        out["estimated_state_bytes"] = g["weights"] + g["gradients"] + g["optimizer"]
        if out["peak_gpu_mem_mib"]:
            out["peak_vs_estimate"] = round(out["peak_gpu_mem_mib"] * 2**20 / g["total"], 3)
    return out


def async_figures(one: dict, steps: int) -> dict | None:
    """The asynchronous saves' blocked time against the synchronous final save of the same run."""
    periodic = [s for s in one["saves"] if s["mode"] == "async"]
    final = [s for s in one["saves"] if s["step"] == steps and s["mode"] == "sync"]
    if not periodic or not final:
        return None
    sync_s = final[0]["durable_s"]
    return {"async_blocked_s": [s["blocked_s"] for s in periodic], "async_durable_s": [s["durable_s"] for s in periodic],
            "sync_save_s": sync_s, "bytes": final[0]["bytes"],
            "blocked_over_sync": round(min(s["blocked_s"] for s in periodic) / sync_s, 4) if sync_s else None}


def text_report(summary: dict) -> str:
    """The short text beside the JSON: one line per case, the saves, flash-attn, what failed, the targets."""
    lines = [f"slurmft GPU smoke, {summary['date']}, {summary['device']}",
             "versions: " + ", ".join(f"{k} {summary['versions'].get(k)}" for k in KEY_PACKAGES)]
    lines += [f"unmet: {u}" for u in summary["unmet"]]
    if summary["unlisted"] and not summary["dry_run"]:  # on the lent machine: names the image's list lacks
        lines.append(f"installed, not in bench/gpu_image_packages.txt: {', '.join(summary['unlisted'])}")
    lines.append("| case | tok/s | MFU | peak GPU MiB (x estimate) | load RSS MiB | sync save s | attention |")
    lines.append("|---|---|---|---|---|---|---|")
    for name, one in summary["cases"].items():
        peak = (f"{one['peak_gpu_mem_mib']:,.0f} ({one.get('peak_vs_estimate')})" if one["peak_gpu_mem_mib"]
                else f"RSS {one['peak_rss_mib']:,.0f}")
        sync = next((s["durable_s"] for s in one["saves"] if s["mode"] == "sync"), None)
        lines.append(f"| {name} | {one['tokens_per_s']:,.0f} | {one['mfu']} | {peak} | {one['load_peak_rss_mib']} | "
                     f"{sync} | {one['attn_implementation']} |")
    if summary.get("async_save"):
        a = summary["async_save"]
        lines.append(f"async save ({a['case']}, {a['bytes'] / 2**30:.1f} GiB): training waited {a['async_blocked_s']} s "
                     f"per save (durable after {a['async_durable_s']} s) against {a['sync_save_s']} s synchronous: "
                     f"{a['blocked_over_sync']} of it")
    flash = summary["flash_attn"]
    lines.append("flash-attn: " + ("used (SDPA beside it: the /sdpa case)" if flash["usable"] else
                                   f"not used: {flash['why']}"))
    lines += [f"skipped {name}: {why}" for name, why in summary["skipped"].items()]
    lines += [f"FAILED {name}: {p}" for name, problems in summary["problems"].items() for p in problems]
    lines.append(f"targets: {TARGETS}")
    lines.append(f"{'FAILED' if any(summary['problems'].values()) else 'passed'} in {summary['total_wall_s']:.0f}s")
    return "\n".join(lines) + "\n"


def write_outputs(summary: dict, out: Path | None) -> None:
    """The JSON and the text, rewritten after every case (a budget cut or a kill keeps what was measured)."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_smoke.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "gpu_smoke.txt").write_text(text_report(summary))


FLASH_DOES_NOT_TRAVEL = ("flash-attn has no wheel on PyPI (its source builds against the local torch and CUDA for "
                         "about an hour), so none travels to the lent machine")


def parser() -> argparse.ArgumentParser:
    """The smoke's options (docs/development.md's device command passes some)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=os.environ.get("SLURMFT_SMOKE_DIR", "/tmp/slurmft-gpu-smoke"))
    ap.add_argument("--out", type=Path, help="write gpu_smoke.json and gpu_smoke.txt here (the device's $OUT)")
    ap.add_argument("--budget-s", type=float, help="seconds from the start: no case starts that the time left cannot hold, one still running is stopped")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 8B-shaped model")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the GPU (default: from its name)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU needed: tiny models, 3 steps on one CPU rank")
    ap.add_argument("--modes", default="bf16-true,bf16-mixed",
                    help="comma-separated train.precision values (default: bf16-true,bf16-mixed, in a dry run too)")
    ap.add_argument("--attn", default="auto", choices=["auto", "flash_attention_2", "sdpa"],
                    help="model.attn_implementation (default auto: flash-attention 2 where transformers accepts it)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    t0 = time.time()

    image = gpu_image.read_image()
    versions, missing, unmet = gpu_image.job_environment(image)
    if missing:
        print(f"[smoke] missing Python packages: {', '.join(missing)}. Install them (pip install -e '.[train]' from "
              "this repository; on the lent GPU machine the wheels of bench/gpu_wheels.sh, docs/development.md), "
              "then run again", file=sys.stderr)
        return 2
    import torch

    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        print("no CUDA device: run with --dry-run to check the CPU-testable parts", file=sys.stderr)
        return 2
    if args.dry_run:
        args.steps, args.seq, args.batch = 3, 64, 2  # bf16 matmuls are slow on CPU: short rows keep it quick
    device_name = torch.cuda.get_device_name(0) if on_gpu else "cpu (dry run)"
    print(f"[smoke] {device_name}; " + ", ".join(f"{k} {versions.get(k)}" for k in KEY_PACKAGES), flush=True)
    for line in unmet:
        print(f"[smoke] unmet: {line}", flush=True)
    from slurmft.job.loading import flash_attention_problem

    flash_problem = flash_attention_problem(on_gpu)
    if flash_problem == "flash-attn is not installed":
        flash_problem += f" ({FLASH_DOES_NOT_TRAVEL})"
    modes = args.modes.split(",")
    cases = plan_cases(modes, args.steps, args.attn, on_gpu, flash_problem is None)
    summary: dict = {"date": time.strftime("%Y-%m-%d"), "device": device_name, "dry_run": not on_gpu,
                     "versions": versions, "unmet": unmet, "unlisted": gpu_image.unlisted(image),
                     "flash_attn": {"usable": flash_problem is None, "why": flash_problem},
                     "settings": {"steps": args.steps, "seq": args.seq, "batch": args.batch, "layers": args.layers,
                                  "budget_s": args.budget_s},
                     "cases": {}, "skipped": {}, "problems": {}, "async_save": None, "total_wall_s": 0.0}
    print(f"[smoke] flash-attention 2: {'available' if flash_problem is None else 'not used: ' + flash_problem}; "
          f"cases {', '.join(c.name for c in cases)}", flush=True)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    small = work / ("model-1b" if on_gpu else "model-tiny")
    if not (small / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-m", "slurmft.tiny", str(small), "--size", "1b" if on_gpu else "tiny",
                        "--dtype", "bfloat16" if on_gpu else "float32"], check=True, cwd=REPO)
    models = {cases[0].model: small}
    data = make_data(work / "chat.jsonl", 1500 if on_gpu else 200)
    print(f"[smoke] assets ready in {time.time() - t0:.0f}s", flush=True)

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(work / "hf_datasets"),
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if not on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    took: dict[str, float] = {}  # model -> the longest case of it so far, s
    for case in cases:
        left = args.budget_s - (time.time() - t0) if args.budget_s else None
        why = over_budget(case, took, left)
        if why:
            summary["skipped"][case.name] = why
            print(f"[smoke] {case.name}: skipped, {why}", flush=True)
            continue
        t1 = time.time()
        if case.model not in models:
            models[case.model] = build_8b_shaped(work / f"model-{case.model}", small, args.layers, on_gpu)
        run = write_run(work / f"run-{case.name.replace('/', '-')}-{int(time.time())}", models[case.model], data,
                        args, on_gpu, case)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "slurmft.job.entrypoint", "train", str(run)]
        try:
            proc = subprocess.run(cmd, env=env, cwd=REPO, timeout=left)
        except subprocess.TimeoutExpired:
            summary["skipped"][case.name] = f"budget: stopped after {time.time() - t1:.0f}s"
            print(f"[smoke] {case.name}: {summary['skipped'][case.name]}", flush=True)
            break
        if proc.returncode != 0:
            summary["problems"][case.name] = [f"training failed with exit code {proc.returncode}"]
            print(f"[smoke] {case.name}: training failed with exit code {proc.returncode}", file=sys.stderr)
            break
        one = summarize(run, models[case.model], args.seq, device_name, peak_flops(device_name, args.peak_tflops),
                        skip=5 if on_gpu else 0, plan=estimate_of(run, device_name, on_gpu))
        one["train_wall_s"] = round(time.time() - t1, 1)
        took[case.model] = max(took.get(case.model, 0.0), one["train_wall_s"])
        summary["cases"][case.name] = one
        summary["problems"][case.name] = check(one, expected(case.mode, on_gpu, case.attn), args.steps, on_gpu)
        if case.every < args.steps and summary["async_save"] is None:
            figures = async_figures(one, args.steps)
            summary["async_save"] = {"case": case.name, **figures} if figures else None
        shutil.rmtree(run / "checkpoints", ignore_errors=True)  # gigabytes each on a GPU; the figures are read
        summary["total_wall_s"] = round(time.time() - t0, 1)
        write_outputs(summary, args.out)
        print(f"[smoke] {case.name}: " + json.dumps(one), flush=True)
    summary["total_wall_s"] = round(time.time() - t0, 1)
    write_outputs(summary, args.out)
    print(text_report(summary), end="", flush=True)
    return 1 if any(summary["problems"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
