"""Run under torchrun (4 ranks) by test_weights.py: the weight loader on meshes built here, not by slurmft.

A small module (an embedding with 1001 rows, linears with 7 and 3 rows, a persistent plain buffer) is
sharded with FSDP2 on a 1-D mesh of 4 (``Shard(0)``: 3 rows over 4 ranks leaves one rank none) and on
a 2 x 2 HSDP mesh (``(Replicate(), Shard(0))``), loaded from a bf16 safetensors file both ways (every rank
reads its slice; rank 0 reads and scatters), and each rank's local tensor is compared, bit for bit, with
its rows of the file cut independently (``torch.chunk`` by the rank's coordinate on the shard dimension).
Every rank writes ``OUT/rank<r>.json`` with the mismatches it found.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/job/mesh_check.py OUT
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from slurmft.job import distributed, weights
from slurmft.job.rendezvous import JobEnv


class Net(torch.nn.Module):
    """Uneven row counts and a persistent buffer that stays a plain tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1001, 8)
        self.proj = torch.nn.Linear(8, 7)
        self.head = torch.nn.Linear(7, 3)
        self.register_buffer("scale", torch.zeros(5))


def write_file(model_dir: Path) -> None:
    torch.manual_seed(3)
    reference = Net()
    reference.scale.normal_()
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in reference.state_dict().items()},
              str(model_dir / "model.safetensors"))


def expected_local(full: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> torch.Tensor:
    """This rank's rows of ``full`` under FSDP2's chunking, from its mesh coordinate."""
    coordinate = mesh.get_coordinate()
    part = full
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(part, mesh.size(dim), dim=placement.dim)
            index = coordinate[dim]
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    return part


def check(model_dir: Path, mesh: DeviceMesh, how: str, ctx: distributed.DistContext) -> list[str]:
    from safetensors import safe_open

    with torch.device("meta"):
        model = Net()
    plan = weights.check_weights(model, model_dir) if ctx.is_main else None
    fully_shard(model.proj, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    method, _ = weights.load_weights(model, plan, model_dir if ctx.is_main or how == "sliced" else None, ctx)
    problems = [] if method == how else [f"loaded by {method}, not {how}"]
    replicate = (Replicate(),) if mesh.ndim == 2 else ()
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            full = f.get_tensor(name).to(torch.float32)
            if name == "scale":
                local = tensor
                want = full
                if isinstance(tensor, DTensor):
                    problems.append(f"{name}: a buffer became a DTensor")
            else:
                if tuple(tensor.placements) != (*replicate, Shard(0)):
                    problems.append(f"{name}: placements {tensor.placements}")
                local, want = tensor.to_local(), expected_local(full, mesh, tensor.placements)
            if not torch.equal(local, want):
                problems.append(f"{name} ({how}, mesh {tuple(mesh.shape)}): local {tuple(local.shape)} differs")
    return problems


def main() -> None:
    out = Path(sys.argv[1])
    ctx = distributed.init(JobEnv.from_environ())
    model_dir = out / "weights"
    if ctx.is_main:
        write_file(model_dir)
    distributed.barrier()
    problems: list[str] = []
    meshes = [init_device_mesh("cpu", (ctx.world_size,)),
              init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("replicate", "shard"))]
    for mesh in meshes:
        for how in ("sliced", "scatter"):
            problems += check(model_dir, mesh, how, ctx)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({"rank": ctx.rank, "problems": problems}))
    del meshes, mesh  # a device mesh still alive when the process group is destroyed crashes the exit (torch 2.13)
    gc.collect()
    distributed.shutdown()


if __name__ == "__main__":
    main()
