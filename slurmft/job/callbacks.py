"""Trainer callbacks: complete checkpoints, preemption at a step boundary, metrics, the FSDP report.

Every callback method here runs on every rank at the same point of the loop (the Trainer calls
``on_step_end``, ``on_save`` and ``on_log`` everywhere), which is what makes the collectives inside
them safe.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from slurmft.checkpoints import damaged, fsync_tree, latest_complete, mark_complete, prune, step_of
from slurmft.job import preemption
from slurmft.job.distributed import DistContext, barrier
from slurmft.units import MiB, peak_rss_bytes

log = logging.getLogger("slurmft.job")


def agree(ctx: DistContext, local: bool) -> bool:
    """True on every rank when ``local`` is true on any rank (all_reduce MAX): a collective."""
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class CompleteCheckpoints(TrainerCallback):
    """After every save: fsync, all ranks barrier, rank 0 adds config + tokenizer, writes COMPLETE, rotates.

    Rotation is ours (the Trainer's ``save_total_limit`` is off): the Trainer rotates by mtime *before*
    the marker exists, so a save that dies afterwards could leave fewer than ``keep_last`` usable
    checkpoints. Here only verified checkpoints count, the newest ``keep_last`` stay, and torn or
    damaged ones go only while a verified one remains, and a checkpoint that a fallback resumed from
    (:meth:`protect`, slurmft/job/fallback.py) never goes. COMPLETE records how long the save took and
    every file with its size; rank 0 warns when a save took more than half of ``lead_time_s`` (the
    warning signal would leave too little time to save).
    """

    def __init__(self, ctx: DistContext, model_config: Any, generation_config: Any, tokenizer: Any,
                 keep_last: int, info: dict[str, Any], lead_time_s: float | None = None) -> None:
        self.ctx = ctx
        self.model_config = model_config
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.keep_last = keep_last
        self.info = info
        self.lead_time_s = lead_time_s
        self.save_started: float | None = None
        self.last_save_s: float | None = None
        self.protected: tuple[Path, ...] = ()

    def protect(self, checkpoint: Path) -> None:
        """Rotation never deletes ``checkpoint`` (this attempt fell back to it: the one known to load)."""
        self.protected = (*self.protected, checkpoint)

    def watch(self, trainer: Any) -> None:
        """Time every save from the Trainer's first write (``_save_checkpoint``) to our marker."""
        original = trainer._save_checkpoint

        def timed_save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            self.save_started = time.time()
            return original(*args, **kwargs)

        trainer._save_checkpoint = timed_save_checkpoint

    def on_save(self, args, state, control, **kwargs):
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        fsync_tree(ckpt)  # this rank's shards, rng state (and rank 0's small files) are durable
        barrier()  # every rank's files are on disk
        if self.ctx.is_main:
            config = copy.deepcopy(self.model_config)
            config.use_cache = True  # turned off for training only
            config.save_pretrained(ckpt)
            if self.generation_config is not None:
                self.generation_config.save_pretrained(ckpt)
            self.tokenizer.save_pretrained(ckpt)
            fsync_tree(ckpt)
            started = self.save_started or time.time()
            seconds = time.time() - started
            mark_complete(ckpt, step=state.global_step, world_size=self.ctx.world_size, save_s=round(seconds, 3),
                          **self.info)
            self.last_save_s = seconds
            for path, why in damaged(Path(args.output_dir)):
                log.warning("removing damaged %s: %s", path.name, why)
            prune(Path(args.output_dir), self.keep_last, self.protected)
            log.info("checkpoint-%d complete (%.1fs)", state.global_step, seconds)
            if self.lead_time_s and seconds > self.lead_time_s / 2:
                log.warning("saving checkpoint-%d took %.1fs, more than half of preemption.lead_time_s (%gs): a "
                            "warning signal may not leave enough time to save; raise preemption.lead_time_s",
                            state.global_step, seconds, self.lead_time_s)
        self.save_started = None
        barrier()


class StopBeforeFirstStep(Exception):
    """Raised on every rank (after agreeing) when the flag came before this attempt's first step."""


class PreemptionStop(TrainerCallback):
    """The ranks agree (all_reduce MAX) on the flag at step boundaries; if set: save unless needless, stop.

    The signal handlers only set a flag (slurmft/job/preemption.py), so the save is a normal collective
    save at a step boundary on every rank, never a rank-0 save inside a handler. Agreement points:

    - before this attempt's first optimizer step: a flag raised during start-up stops with no save
      (nothing new to save; :class:`StopBeforeFirstStep`);
    - at each step end: save and stop, unless the newest complete checkpoint is at this step already;
    - right after each periodic save: stop without saving again (the flag came during that save).

    Must come after :class:`CompleteCheckpoints` in the callback list (its ``on_save`` runs first).
    """

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.stopped_at: int | None = None
        self.saved = False
        self._first_step_checked = False

    def _stop(self, step: int, control: Any, save: bool, why: str) -> None:
        self.stopped_at = step
        self.saved = True  # a checkpoint at this step exists or is being written now
        control.should_save = control.should_save or save
        control.should_training_stop = True
        if self.ctx.is_main:
            log.warning("%s received: stopping at step %d, %s", preemption.received() or "stop signal", step, why)

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._first_step_checked:
            self._first_step_checked = True
            if agree(self.ctx, preemption.requested()):
                self.stopped_at = state.global_step
                raise StopBeforeFirstStep(f"stop requested before the first step (at step {state.global_step})")
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if agree(self.ctx, preemption.requested()) and self.stopped_at is None:
            latest = latest_complete(Path(args.output_dir))
            if latest is not None and step_of(latest) == state.global_step:
                self._stop(state.global_step, control, False, f"{latest.name} is already complete (no second save)")
            else:
                self._stop(state.global_step, control, True, f"saving checkpoint-{state.global_step}")
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.stopped_at is None and agree(self.ctx, preemption.requested()):
            self._stop(state.global_step, control, False, f"checkpoint-{state.global_step} was just saved (no second save)")
        return control


def _peak_rss_mib() -> float:
    return peak_rss_bytes() / MiB


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


def _mesh_info(dtensors: list[Any]) -> dict[str, Any]:
    """The parameters' device mesh(es): shapes, dim names, and this rank's coordinate (HSDP: replica, shard)."""
    meshes = {id(p.device_mesh): p.device_mesh for p in dtensors}
    first = next(iter(meshes.values()), None)
    return {
        "mesh_shapes": sorted({tuple(m.shape) for m in meshes.values()}),
        "mesh_dim_names": list(first.mesh_dim_names) if first is not None and first.mesh_dim_names else None,
        "mesh_coordinate": first.get_coordinate() if first is not None else None,
    }


@torch.no_grad()
def _checksum(tensors: Any) -> float:
    """Sum of this rank's local parameter elements (float64): replicas of a shard hold equal sums."""
    from torch.distributed.tensor import DTensor

    total = 0.0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        for piece in local.detach().reshape(-1).split(1 << 22):  # float64 copies of 4M elements at most
            total += float(piece.double().sum())
    return total


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def unsharded_grad_bytes(model: torch.nn.Module) -> int | None:
    """Bytes of full (unsharded) gradients FSDP2 holds back for a later reduce-scatter; None if unknown.

    Reads FSDP2's private per-parameter state (``FSDPParam._unsharded_param.grad`` and
    ``unsharded_accumulated_grad``, torch 2.13): it is where a micro-batch's gradients stay when the
    reduce-scatter is skipped (``set_requires_gradient_sync(False)``, i.e. accelerate's ``no_sync``).
    """
    from torch.distributed.fsdp import FSDPModule

    total = 0
    try:
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    held = [fsdp_param.unsharded_accumulated_grad, fsdp_param._unsharded_param.grad
                            if hasattr(fsdp_param, "_unsharded_param") else None]
                    total += sum(g.numel() * g.element_size() for g in held if g is not None)
    except AttributeError:
        return None
    return total


def grad_layout(model: torch.nn.Module) -> dict[str, Any]:
    """Where this rank's gradients are now: on the sharded parameters, and held unsharded inside FSDP2."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    return {
        "grad_types": sorted({type(g).__name__ for g in grads}),
        "params_without_grad": len(params) - len(grads),
        "sharded_grad_bytes": sum(_local_bytes(g) for g in grads),
        "unsharded_grad_bytes": unsharded_grad_bytes(model),
    }


class FsdpReport(TrainerCallback):
    """Each rank writes ``<run>/fsdp_report/rank<r>.json``: what it really holds once training starts (the
    DTensor mesh and placements, local bytes), after the first optimizer step, and a checksum of its
    local shards at the start and end (replicas of a shard, e.g. under HSDP, hold equal checksums).

    ``micro_batches``: for this attempt's first optimizer step, the gradient layout after each
    micro-batch's backward (``on_substep_end``, and ``on_pre_optimizer_step`` for the last one). With
    gradient accumulation every entry must show sharded DTensor gradients and no unsharded ones.
    """

    def __init__(self, ctx: DistContext, out_dir: Path, info: dict[str, Any]) -> None:
        self.ctx = ctx
        self.out_dir = out_dir
        self.info = info
        self._report: dict[str, Any] | None = None
        self._micro: list[dict[str, Any]] | None = []  # None once the first optimizer step is recorded

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        """After a micro-batch that is not the last of its optimizer step."""
        if self._micro is not None and model is not None:
            self._micro.append(grad_layout(model))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        """After the last micro-batch (gradients reduced and clipped): close the first step's record."""
        if self._micro is None or model is None or self._report is None:
            return
        self._report["micro_batches"] = [*self._micro, grad_layout(model)]
        self._micro = None
        self._write()

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
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "device": str(self.ctx.device),
            "backend": self.ctx.backend,
            "distributed_type": str(AcceleratorState().distributed_type),
            "param_types": sorted({type(p).__name__ for _, p in params}),
            "placements": sorted({str(p.placements) for _, p in params if isinstance(p, DTensor)}),
            **_mesh_info([p for _, p in params if isinstance(p, DTensor)]),
            "local_checksum": _checksum(p for _, p in params),
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
        local = _local_bytes
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

    def on_train_end(self, args, state, control, model=None, **kwargs):
        """This attempt's last weights: under HSDP, ranks holding the same shard on different nodes must agree."""
        if self._report is not None and model is not None:
            self._report["local_checksum_at_end"] = _checksum(model.parameters())
            self._report["step_at_end"] = state.global_step
            self._write()

    def _write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{self.ctx.rank}.json").write_text(json.dumps(self._report, indent=1) + "\n")
