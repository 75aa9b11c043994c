"""What each rank really holds under FSDP2: its shards, its gradients, its optimizer state, written per rank.

What the libraries report: accelerate prints the FSDP plugin's configuration, the Trainer logs the
loss and the grad norm; neither says which mesh and placements the parameters ended up on, how many
bytes a rank holds once the optimizer exists, or whether gradient accumulation kept a full,
unsharded gradient back between micro-batches (accelerate's ``no_sync``: ~280 GB per GPU for 70B).
A run that silently trained replicated, or accumulated unsharded gradients, looks the same in the loss.

What we do: :class:`FsdpReport` makes each rank write ``<run>/fsdp_report/rank<r>.json`` when training
starts (DTensor mesh and placements, local bytes), after the first optimizer step (weights, gradients
and AdamW state counted from the local shards: the number ``slurmft estimate`` predicts per rank,
compared exactly by tests/test_precision.py), the gradient layout after each micro-batch of the first
step (:func:`grad_layout`, reading FSDP2's private per-parameter state), and a checksum of the local
shards at the start and end (replicas of a shard, e.g. under HSDP, hold equal checksums).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from slurmft.job.callbacks import peak_rss_mib
from slurmft.job.distributed import DistContext

log = logging.getLogger(__name__)


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


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard): e.g. DPO's frozen reference copy."""
    return sum(_local_bytes(t) for t in tensors)


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
            "peak_rss_mib": round(peak_rss_mib(), 1),
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
