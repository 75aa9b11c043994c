"""Every rank's part of every adapter survives a checkpoint: run twice per rank by test_lora_cpu.py.

    (srun-like, 2 ranks) python tests/job/adapter_survival.py save RUN_DIR OUT
    (srun-like, 2 ranks) python tests/job/adapter_survival.py load RUN_DIR OUT

or inside tests/job/run_many.py's launches (``call:tests.job.adapter_survival:main:save:RUN_DIR:OUT``).

``save``: builds the run's sharded LoRA model as the job does (slurmft.job.loading.build_sharded_model),
writes into each rank's local shard of every trainable tensor values that depend on the rank (so a save
that kept only rank 0's slice, or one rank's slice for every rank, cannot pass), saves the adapter
checkpoint with the job's own function (adapter_state.save_adapter_model, what the Trainer calls) and
keeps each rank's local shards in ``OUT/rank<r>.pt``. ``load``: new processes build the model afresh
(seeded initial adapters), load the checkpoint with adapter_state.load_adapter_model, and compare every
local shard bit for bit with what this rank held before the save; ``OUT/rank<r>.json`` lists mismatches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from slurmft.job import distributed, loading, train
from slurmft.job.checkpointing import adapter_state
from slurmft.job.inputs import load_model_config, resolve_model_dir
from slurmft.job.rendezvous import JobEnv
from slurmft.rundir import RunPaths


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def main(phase: str, run_dir: str, out: str) -> None:
    env = JobEnv.from_environ()
    cfg = train.read_config(RunPaths.of(run_dir))
    ctx = distributed.init(env)
    model_dir = resolve_model_dir(cfg.model, with_weights=True)
    config = load_model_config(model_dir, cfg.model, cfg.data.max_seq_length)
    sharded = loading.build_sharded_model(cfg, config, model_dir, ctx)
    model = sharded.model
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(isinstance(p, DTensor) for p in trainable.values())
    directory = Path(out) / "adapter_checkpoint"
    mine = Path(out) / f"rank{ctx.rank}.pt"
    if phase == "save":
        with torch.no_grad():
            for i, p in enumerate(trainable.values()):
                local = p.to_local()
                local.copy_(torch.arange(local.numel(), dtype=local.dtype).reshape(local.shape) * 1e-3
                            + 100.0 * (ctx.rank + 1) + i)
        adapter_state.save_adapter_model(model, directory)
        torch.save({n: _local(p) for n, p in trainable.items()}, mine)
    else:
        before = torch.load(mine)
        fresh_equal = sum(torch.equal(_local(p), before[n]) for n, p in trainable.items() if before[n].numel())
        adapter_state.load_adapter_model(model, directory)
        mismatches = [n for n, p in trainable.items() if not torch.equal(_local(p), before[n])]
        frozen = sum(1 for p in model.parameters() if not p.requires_grad)
        Path(out, f"rank{ctx.rank}.json").write_text(json.dumps({
            "rank": ctx.rank, "tensors": len(trainable), "mismatches": mismatches, "equal_before_load": fresh_equal,
            "local_elements": sum(before[n].numel() for n in trainable), "frozen": frozen}))
    distributed.barrier()
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
