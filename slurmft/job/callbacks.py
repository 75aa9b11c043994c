"""Trainer callbacks: complete checkpoints, preemption at a step boundary, metrics, the FSDP report.

Every callback method here runs on every rank at the same point of the loop (the Trainer calls
``on_step_end``, ``on_save`` and ``on_log`` everywhere), which is what makes the collectives inside
them safe.
"""

from __future__ import annotations

import copy
import json
import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from slurmft.checkpoints import mark_complete, prune
from slurmft.job import preemption
from slurmft.job.distributed import DistContext, barrier

log = logging.getLogger("slurmft.job")


class CompleteCheckpoints(TrainerCallback):
    """After every save: all ranks barrier, rank 0 adds config + tokenizer, writes COMPLETE, rotates.

    Rotation is ours (the Trainer's ``save_total_limit`` is off): the Trainer rotates by mtime *before*
    the marker exists, so a save that dies afterwards could leave fewer than ``keep_last`` usable
    checkpoints. Here only complete checkpoints count, the newest ``keep_last`` stay, and torn saves
    older than the newest complete one go.
    """

    def __init__(self, ctx: DistContext, model_config: Any, generation_config: Any, tokenizer: Any,
                 keep_last: int, info: dict[str, Any]) -> None:
        self.ctx = ctx
        self.model_config = model_config
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.keep_last = keep_last
        self.info = info

    def on_save(self, args, state, control, **kwargs):
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        barrier()  # every rank's shards are on disk
        if self.ctx.is_main:
            config = copy.deepcopy(self.model_config)
            config.use_cache = True  # turned off for training only
            config.save_pretrained(ckpt)
            if self.generation_config is not None:
                self.generation_config.save_pretrained(ckpt)
            self.tokenizer.save_pretrained(ckpt)
            mark_complete(ckpt, step=state.global_step, world_size=self.ctx.world_size, **self.info)
            prune(Path(args.output_dir), self.keep_last)
            log.info("checkpoint-%d complete", state.global_step)
        barrier()


class PreemptionStop(TrainerCallback):
    """At each step end the ranks agree (all_reduce MAX) on the warning flag; if set: save and stop.

    The signal handler only sets a flag (slurmft/job/preemption.py), so the save is a normal
    collective save at a step boundary on every rank, never a rank-0 save inside a handler.
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        flag = torch.tensor([1 if preemption.requested() else 0], dtype=torch.int32, device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.stopped_at is None:
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            if self.ctx.is_main:
                log.warning("warning signal received: saving at step %d and stopping", state.global_step)
        return control


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class MetricsLog(TrainerCallback):
    """Rank 0 appends one JSON line per logging step: loss, lr, grad norm, tokens/s, peak memory."""

    def __init__(self, ctx: DistContext, path: Path, info: dict[str, Any]) -> None:
        self.ctx = ctx
        self.path = path
        self.info = info
        self._last: tuple[float, int] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = (time.time(), state.num_input_tokens_seen or 0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:
            return
        gpu = torch.cuda.max_memory_allocated(self.ctx.device) / 2**20 if self.ctx.on_gpu else 0.0
        peaks = torch.tensor([_peak_rss_mib(), gpu], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # the worst rank is what sizes a node
        if not self.ctx.is_main:
            return
        now, tokens = time.time(), state.num_input_tokens_seen or 0
        last_t, last_tokens = self._last or (now, tokens)
        self._last = (now, tokens)
        record = {
            "step": state.global_step,
            "time": round(now, 3),
            "epoch": logs.get("epoch"),
            "loss": logs.get("loss"),
            "learning_rate": logs.get("learning_rate"),
            "grad_norm": logs.get("grad_norm"),
            "tokens_per_s": round((tokens - last_tokens) / (now - last_t), 2) if now > last_t else None,
            "num_input_tokens_seen": tokens,
            "peak_rss_mib": round(float(peaks[0]), 1),
            "peak_gpu_mem_mib": round(float(peaks[1]), 1) if self.ctx.on_gpu else None,
            **self.info,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def step_line(logs: dict[str, Any], step: int, max_steps: int) -> str:
    """One readable line for a Trainer log dict: ``step 12/36  loss 2.3456  lr 8.00e-04  grad_norm 1.23``."""
    if "loss" in logs:
        parts = [f"step {step}/{max_steps}", f"loss {logs['loss']:.4f}"]
        if logs.get("learning_rate") is not None:
            parts.append(f"lr {logs['learning_rate']:.2e}")
        if logs.get("grad_norm") is not None:
            parts.append(f"grad_norm {float(logs['grad_norm']):.3f}")
        if logs.get("epoch") is not None:
            parts.append(f"epoch {logs['epoch']:.2f}")
        return "  ".join(parts)
    words = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items()]
    return f"step {step}/{max_steps}  " + " ".join(words)


class StepLog(TrainerCallback):
    """Global rank 0 logs each Trainer log dict as one line; every other rank stays quiet.

    Replaces transformers' PrinterCallback, which prints the raw dict on every node's *local*
    rank 0, so a two-node log held each step twice (docs/design-notes.md).
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.ctx.is_main and logs:
            log.info("%s", step_line(logs, state.global_step, state.max_steps))


class FsdpReport(TrainerCallback):
    """Each rank writes ``<run>/fsdp_report/rank<r>.json``: what it really holds once training starts."""

    def __init__(self, ctx: DistContext, out_dir: Path, info: dict[str, Any]) -> None:
        self.ctx = ctx
        self.out_dir = out_dir
        self.info = info
        self._report: dict[str, Any] | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from accelerate.state import AcceleratorState
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        params = list(model.named_parameters())
        local = sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else p.numel() * p.element_size()
                    for _, p in params)
        full = sum(p.numel() * p.element_size() for _, p in params)
        report = {
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "device": str(self.ctx.device),
            "backend": self.ctx.backend,
            "distributed_type": str(AcceleratorState().distributed_type),
            "param_types": sorted({type(p).__name__ for _, p in params}),
            "placements": sorted({str(p.placements) for _, p in params if isinstance(p, DTensor)}),
            "num_tensors": len(params),
            "num_dtensors": sum(isinstance(p, DTensor) for _, p in params),
            "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "local_bytes": local,
            "full_bytes": full,
            "local_fraction": local / full if full else 0.0,
            "peak_rss_mib": round(_peak_rss_mib(), 1),
            **self.info,
        }
        report["param_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for _, p in params})
        self._report = report
        self._write()

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        """After the first optimizer step (gradients still there): the sharded bytes this rank holds.

        weights, gradients and AdamW state are counted from the local shards, the number
        ``slurmft estimate`` predicts per rank (tests/test_precision.py compares them exactly).
        """
        if self._report is None or "gradients_bytes" in self._report:
            return
        from torch.distributed.tensor import DTensor

        def local(t):
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = [p for p in model.parameters()]
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
        states = [inner.state[p][k] for p in params if p in inner.state for k in ("exp_avg", "exp_avg_sq")
                  if k in inner.state[p]]
        grads = [p.grad for p in params if p.grad is not None]
        self._report.update({
            "weights_bytes": sum(local(p) for p in params),
            "gradients_bytes": sum(local(g) for g in grads),
            "optimizer_bytes": sum(local(t) for t in states),
            "grad_dtypes": sorted({str(g.dtype).removeprefix("torch.") for g in grads}),
            "grad_types": sorted({type(g).__name__ for g in grads}),
            "optimizer_state_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in states}),
            "optimizer_state_types": sorted({type(t).__name__ for t in states}),
            "optimizer_states": len(states),
            "optimizer_class": type(inner).__module__ + "." + type(inner).__name__,
        })
        self._write()

    def _write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{self.ctx.rank}.json").write_text(json.dumps(self._report, indent=1) + "\n")
