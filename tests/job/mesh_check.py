"""Run under torchrun (4 ranks) by test_weights.py: the weight loader on meshes built here, not by slurmft.

A small module (an embedding with 1001 rows, linears with 7 and 3 rows, a persistent plain buffer) is
sharded with FSDP2 on a 1-D mesh of 4 (``Shard(0)``: 3 rows over 4 ranks leaves one rank none) and on
a 2 x 2 HSDP mesh (``(Replicate(), Shard(0))``), loaded from a bf16 safetensors file both ways (every rank
reads its slice; rank 0 reads and scatters), and each rank's local tensor is compared, bit for bit, with
its rows of the file cut independently (``torch.chunk`` by the rank's coordinate on the shard dimension).
The same for a tiny Mixtral (six experts: 2, 2, 2 and none on the 1-D mesh of 4), whose checkpoint keeps one
tensor per expert while the model has fused ones: each rank's slice of ``mlp.experts.gate_up_proj`` (read
from only its experts' tensors) must equal its rows of what transformers' own ``from_pretrained`` builds, and
the bytes a rank reads (sliced) are exactly those of its slices.
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


def write_moe(model_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mixtral", hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                  num_local_experts=6, num_experts_per_tok=2)
    torch.manual_seed(4)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(model_dir)


def check_moe(model_dir: Path, mesh: DeviceMesh, how: str, ctx: distributed.DistContext) -> list[str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    plan = weights.check_weights(model, model_dir) if ctx.is_main else None
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    method, read = weights.load_weights(model, plan, model_dir if ctx.is_main or how == "sliced" else None, ctx)
    problems = [] if method == how else [f"moe loaded by {method}, not {how}"]
    local_bytes = sum(p.to_local().numel() for p in model.parameters()) * 2  # bf16 in the file
    if how == "sliced" and read != local_bytes:  # only this rank's experts' tensors were read, nothing more
        problems.append(f"moe: read {read} bytes, its slices hold {local_bytes}")
    reference = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    names = [n for n, _ in model.named_parameters()]
    if "model.layers.0.mlp.experts.gate_up_proj" not in names:
        problems.append(f"no fused expert parameter in {names}")
    for name, tensor in model.named_parameters():
        want = expected_local(reference[name].detach(), mesh, tensor.placements)
        if not torch.equal(tensor.to_local(), want):
            problems.append(f"{name} ({how}, mesh {tuple(mesh.shape)}): local {tuple(tensor.to_local().shape)} "
                            "differs from transformers' own load")
    return problems


def main() -> None:
    out = Path(sys.argv[1])
    ctx = distributed.init(JobEnv.from_environ())
    model_dir = out / "weights"
    moe_dir = out / "moe"
    if ctx.is_main:
        write_file(model_dir)
        write_moe(moe_dir)
    distributed.barrier()
    problems: list[str] = []
    meshes = [init_device_mesh("cpu", (ctx.world_size,)),
              init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("replicate", "shard"))]
    for mesh in meshes:
        for how in ("sliced", "scatter"):
            problems += check(model_dir, mesh, how, ctx)
            problems += check_moe(moe_dir, mesh, how, ctx)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({"rank": ctx.rank, "problems": problems}))
    del meshes, mesh  # a device mesh still alive when the process group is destroyed crashes the exit (torch 2.13)
    gc.collect()
    distributed.shutdown()


if __name__ == "__main__":
    main()
