"""DPO's memory per rank: its frozen reference copy against precomputed reference log-probabilities and LoRA-DPO.

    python bench/dpo_memory.py [--model DIR | --size 150m|1b|tiny] [--nproc 2] [--steps 3] [--r 16]
                               [--seq 128] [--workdir DIR] [--json OUT] [--keep] [--quick]

Without ``--model`` it uses the ~171M-parameter Llama of ``python -m slurmft.tiny DIR --size 150m`` (cached under
``$TMPDIR/slurmft-bench/150m-float32``). Both runs are the real train job (``python -m torch.distributed.run
--standalone --nproc_per_node N -m slurmft.job.entrypoint train RUN_DIR``, the body ``slurmft submit`` runs) on
examples/tiny/dpo.yaml (the tiny DPO example's 63 preference pairs) with this model, ``--steps`` optimizer steps
and one checkpoint at the last: once as it is (full fine-tuning, fp32 + AdamW: the reference is a second copy of
the starting model, loaded and FSDP2-sharded like the policy, frozen), once with a ``lora:`` section
(``lora.r=--r`` on every linear layer: the reference is the base with the adapters disabled, no copy). Nothing
else differs; all run in this invocation and every ratio is against DPO with the copy.

A third run in the same invocation takes TRL's third way, ``dpo.reference: precomputed``
(``precompute_ref_log_probs``): no reference model while training; the first attempt computes every pair's
reference log-probabilities before step 1 and keeps them in the run directory (docs/dpo.md).

What is measured, per rank, with bench/lora_memory.py's instruments: the rank process's **peak RSS** (VmHWM,
sampled every 20 ms), also above the *import floor* (a process that only imports the job) and by the start of
training (the job's ``fsdp_report``); the **training state** (weights, gradients, AdamW state counted from the
local shards after the first optimizer step); the **reference copy** the rank holds (``fsdp_report``'s
``reference_bytes``, counted from the copy's local shards); the **checkpoint** on disk. Beside them, what
``slurmft estimate`` predicts per rank for the same configs (a profile of this machine).

Targets (exit 1 when one is missed): with the copy, the largest rank's reference shards are exactly the estimate's
``reference_weights`` and the checkpoint's model part holds the policy only (at most ``CKPT_SLACK`` x the
policy's fp32 bytes + ``CKPT_FIXED``: no reference weight saved), also with precomputed values; precomputed and
LoRA-DPO hold no reference at all, and the estimate counts none for them; the precomputed values take 8 bytes a
pair (+ the file's header); LoRA-DPO's gradients and AdamW state are exactly the trainable parameters'; and (not
with ``--quick``) every rank's peak RSS above the floor is lower with precomputed values and with LoRA-DPO than
with the copy. ``--quick`` (what the test suite runs): the 5M tiny preset, 2 steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# bench/checkpoint.py: the cached model preset; bench/lora_memory.py: the instruments (the jobs' environment, peak
# RSS sampling, the import floor, fsdp_report and checkpoint figures, the estimate)
from checkpoint import ensure_model
from lora_memory import (
    ADAMW_BYTES,
    CKPT_FIXED,
    CKPT_SLACK,
    MIB,
    estimate_of,
    import_floor,
    run_job,
    same_imports_env,
)

REPO = Path(__file__).resolve().parents[1]
TINY_DPO = REPO / "examples" / "tiny" / "dpo.yaml"
KINDS = ("copy", "precomputed", "lora")  # DPO with the reference copy, with precomputed log-probabilities, LoRA-DPO
NAMES = {"copy": "DPO, reference copy", "precomputed": "DPO, precomputed reference", "lora": "LoRA-DPO (no copy)"}
EXTRA = {"copy": [], "precomputed": ["dpo.reference=precomputed"]}


def write_run(run_dir: Path, model_dir: Path, steps: int, seq: int, extra: list[str]) -> None:
    """run_dir/config.yaml from examples/tiny/dpo.yaml: this model, ``steps`` steps, one checkpoint at the last."""
    import yaml

    from slurmft.config_loading import load_config

    overrides = [f"model.name_or_path={model_dir}", f"output_dir={run_dir}", f"train.max_steps={steps}",
                 f"checkpoint.every_steps={steps}", "checkpoint.keep_last=1", f"data.max_seq_length={seq}",
                 "prepare.enabled=false"]
    cfg = load_config(TINY_DPO, overrides + extra)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "-"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:.1f}"


def _row(name: str, values: dict[str, float | None], fmt: Any = _mib) -> str:
    """One table row: the three runs, then precomputed / copy and LoRA-DPO / copy."""
    cells = " | ".join(fmt(values[k]) for k in KINDS)
    ratios = " | ".join(_ratio(values[k], values["copy"]) for k in KINDS[1:])
    return f"| {name} | {cells} | {ratios} |"


def table(res: dict[str, Any]) -> str:
    """The markdown table docs/benchmarks.md quotes."""
    copy, lora, floor = res["copy"], res["lora"], res["import_floor"]
    params = copy["ranks"][0]["total_params"]
    trainable = lora["ranks"][0]["trainable"]

    def whole(n: float | None) -> str:
        return "-" if n is None else f"{n / MIB:.0f}"

    lines = [
        f"Model: {params / 1e6:.1f}M parameters, fp32 + AdamW, {len(copy['ranks'])} CPU ranks (gloo), DPO (sigmoid, "
        f"beta {res['beta']:g}) on examples/tiny/dpo.yaml's pairs, {copy['steps']} steps, {res['micro_batch']} pairs "
        f"per rank and step (chosen + rejected: {2 * res['micro_batch']} sequences of up to {res['seq']} tokens), "
        f"activation checkpointing on. Precomputed: dpo.reference=precomputed (the log-probabilities of every pair "
        f"computed before step 1 and kept in the run directory: {res['precomputed_file']:,} B). LoRA-DPO: "
        f"r={res['r']}, all-linear, {trainable:,} trainable parameters. Import floor: {floor / MIB:.0f} MiB.",
        "",
        f"| per rank unless said | {' | '.join(NAMES[k] for k in KINDS)} | precomputed / copy | LoRA-DPO / copy |",
        "|---|---|---|---|---|---|",
    ]
    ranks = range(len(copy["ranks"]))
    for i in ranks:
        lines.append(_row(f"peak RSS, rank {i}, MiB", {k: res[k]["ranks"][i]["peak_rss"] for k in KINDS}, whole))
    for i in ranks:
        lines.append(_row(f"peak RSS above the import floor, rank {i}, MiB",
                          {k: res[k]["ranks"][i]["peak_rss"] - floor for k in KINDS}, whole))
    for i in ranks:
        lines.append(_row(f"peak RSS by the start of training, rank {i}, MiB",
                          {k: res[k]["ranks"][i]["start_peak_rss"] for k in KINDS}, whole))
    first = {k: res[k]["ranks"][0] for k in KINDS}
    estimate = res["estimate"]
    lines.append(_row("reference copy, rank 0, MiB", {k: first[k]["reference"] for k in KINDS}))
    if all(estimate[k] is not None for k in KINDS):
        lines.append(_row("&nbsp;&nbsp;estimate's reference copy, largest rank, MiB",
                          {k: estimate[k]["reference"] for k in KINDS}))
    for key, name in (("weights", "policy weights"), ("gradients", "gradients"), ("optimizer", "AdamW state")):
        lines.append(_row(f"{name}, rank 0, MiB", {k: first[k][key] for k in KINDS}))
    lines.append(_row("training state + reference, rank 0, MiB",
                      {k: r["weights"] + r["gradients"] + r["optimizer"] + (r["reference"] or 0)
                       for k, r in first.items()}))
    if all(estimate[k] is not None for k in KINDS):
        lines.append(_row("&nbsp;&nbsp;estimate's (weights incl. reference + gradients + AdamW), largest rank, MiB",
                          {k: estimate[k]["state"] for k in KINDS}))
        lines.append(_row("&nbsp;&nbsp;estimate's total per rank (+ buffers, activations, runtime), MiB",
                          {k: estimate[k]["total"] for k in KINDS}))
    for key, name in (("model", "model part"), ("optimizer", "optimizer part"), ("total", "whole directory")):
        lines.append(_row(f"checkpoint, {name}, all ranks, MiB", {k: res[k]["checkpoint"][key] for k in KINDS},
                          lambda n: f"{n / MIB:.2f}"))
    lines.append(_row("time per step (median after the first), s", {k: res[k]["step_s"] for k in KINDS},
                      lambda n: f"{n:.2f}"))
    lines.append(_row("whole job (start-up, reference values, steps, save), s", {k: res[k]["wall_s"] for k in KINDS},
                      lambda n: f"{n:.1f}"))
    return "\n".join(lines)


def targets(res: dict[str, Any], quick: bool) -> list[str]:
    """The targets this run missed (empty: all met)."""
    copy, lora, floor = res["copy"], res["lora"], res["import_floor"]
    missed = []
    refs = [r["reference"] for r in copy["ranks"]]
    estimate = res["estimate"]["copy"]
    if None in refs or not all(refs):
        missed.append(f"the DPO run's fsdp_report has no reference copy on every rank ({refs}): did dpo reach the job?")
    elif estimate is None or max(refs) != estimate["reference"]:
        missed.append(f"reference copy on the largest rank {max(refs):,} B != the estimate's "
                      f"{None if estimate is None else estimate['reference']} B")
    policy_bytes = copy["ranks"][0]["total_params"] * 4  # fp32
    bound = CKPT_SLACK * policy_bytes + CKPT_FIXED
    for kind in ("copy", "precomputed"):
        if res[kind]["checkpoint"]["model"] > bound:
            missed.append(f"{NAMES[kind]}: checkpoint model part {res[kind]['checkpoint']['model'] / MIB:.1f} MiB > "
                          f"{bound / MIB:.1f} MiB (the policy's fp32 weights): the reference saved too?")
    for kind in ("precomputed", "lora"):
        if any(r["reference"] != 0 for r in res[kind]["ranks"]):
            missed.append(f"{NAMES[kind]} holds a reference copy: {[r['reference'] for r in res[kind]['ranks']]} B")
        if res["estimate"][kind] is None or res["estimate"][kind]["reference"] != 0:
            missed.append(f"{NAMES[kind]}: the estimate counts a reference copy ({res['estimate'][kind]})")
    if res["precomputed_file"] != 8 * res["pairs"] + res["precomputed_header"]:
        missed.append(f"the precomputed values take {res['precomputed_file']:,} B, not 8 B a pair for "
                      f"{res['pairs']} pairs (+ the {res['precomputed_header']} B safetensors header)")
    trainable = lora["ranks"][0]["trainable"]
    held = sum(r["gradients"] + r["optimizer"] for r in lora["ranks"])
    if not trainable or held != trainable * (4 + ADAMW_BYTES):
        missed.append(f"LoRA-DPO gradients + AdamW state on all ranks {held:,} B != {trainable} trainable x 12 B")
    if not quick:
        for kind in ("precomputed", "lora"):
            for cr, other in zip(copy["ranks"], res[kind]["ranks"], strict=True):
                if other["peak_rss"] - floor >= cr["peak_rss"] - floor:
                    missed.append(f"rank {cr['rank']}: {NAMES[kind]} peak RSS {other['peak_rss'] / MIB:.0f} MiB >= "
                                  f"with the copy {cr['peak_rss'] / MIB:.0f} MiB")
    return missed


def _values_file(run_dir: Path) -> tuple[int, int, int]:
    """(pairs, file bytes, header bytes) of a precomputed run's reference_logps.safetensors."""
    import struct

    path = run_dir / "reference_logps.safetensors"
    data = path.read_bytes()
    header = 8 + struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8:header])
    return int(meta["__metadata__"]["rows"]), len(data), header


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory with tokenizer (default: build the --size preset)")
    ap.add_argument("--size", default=None, choices=["tiny", "150m", "1b"], help="slurmft.tiny preset (default 150m; "
                    "tiny with --quick)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default 3; 2 with --quick)")
    ap.add_argument("--r", type=int, default=16, help="lora.r of the LoRA-DPO run (all-linear)")
    ap.add_argument("--seq", type=int, default=128, help="data.max_seq_length: prompt + reply per sequence")
    ap.add_argument("--workdir", help="where the run directories go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories and job logs")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--quick", action="store_true", help="smoke test: the tiny preset, 2 steps; the peak-RSS target "
                    "is not enforced")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.quick else 3)
    model = ensure_model(args.model, args.size or ("tiny" if args.quick else "150m"))
    lora = [f"lora.r={args.r}", "lora.target_modules=all-linear"]
    base = Path(args.workdir) if args.workdir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="slurmft-dpo-bench-", dir=base))
    try:
        env = same_imports_env(work)
        floor = import_floor(env)
        runs = {}
        for kind in KINDS:
            write_run(work / kind, model, steps, args.seq, lora if kind == "lora" else EXTRA[kind])
            runs[kind] = run_job(work / kind, env, args.nproc)
            print(f"{NAMES[kind]}: {runs[kind]['wall_s']} s", flush=True)
        from slurmft.config_loading import read_run_config

        cfg = read_run_config(work / "lora" / "config.yaml")
        pairs, size, header = _values_file(work / "precomputed")
        result = {"model": str(model), "import_floor": floor, "r": cfg.lora.r, "beta": cfg.dpo.beta,
                  "pairs": pairs, "precomputed_file": size, "precomputed_header": header,
                  "seq": cfg.data.max_seq_length, "micro_batch": cfg.train.per_device_batch_size, **runs,
                  "estimate": {kind: estimate_of(work / kind) for kind in KINDS}, "quick": args.quick}
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
    peak = "" if args.quick else ", precomputed's and LoRA-DPO's peak RSS above the floor below the copy's on every rank"
    print(f"\ntargets (the reference copy = the estimate's, exactly; checkpoints without it; precomputed and LoRA-DPO "
          f"without a copy, in the job and in the estimate; the precomputed values 8 B a pair; LoRA-DPO's gradients + "
          f"AdamW = trainable x 12 B{peak}"
          f"{'; the peak target is not enforced with --quick' if args.quick else ''}): {verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
