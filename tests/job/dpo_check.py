"""Train a DPO run while holding on to its models: run in the ranks by test_dpo_cpu.py (tests/job/run_many.py)

    call:tests.job.dpo_check:main:RUN_DIR:OUT

Runs the job (``slurmft.job.entrypoint.run_train``) unchanged, but keeps every model the job builds
(``loading.build_sharded_model``: the policy, and for full fine-tuning the reference) and each rank's local
shards as they were when the model was built. After training it writes ``OUT/rank<r>.json``: whether every
parameter is a DTensor, how much of the model this rank holds, which tensors require gradients or have one,
and which local shards differ from their start, bit for bit (the reference's must not; the policy's must).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def main(run_dir: str, out: str) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from slurmft.checkpoints import strip_wrappers
    from slurmft.job import entrypoint, loading

    built: list[tuple[bool, Any, dict[str, torch.Tensor]]] = []
    original = loading.build_sharded_model

    def keeping(*args: Any, frozen: bool = False, **kwargs: Any) -> Any:
        sharded = original(*args, frozen=frozen, **kwargs)
        start = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                 for n, p in sharded.model.named_parameters()}
        built.append((frozen, sharded.model, start))
        return sharded

    loading.build_sharded_model = keeping
    try:
        summary = entrypoint.run_train(run_dir)
    finally:
        loading.build_sharded_model = original
    report: dict[str, Any] = {"summary": summary, "models": []}
    for frozen, model, start in built:
        params = dict(model.named_parameters())
        local = {n: (p.to_local() if isinstance(p, DTensor) else p) for n, p in params.items()}
        report["models"].append({
            "frozen": frozen,
            "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
            "local_numel": sum(t.numel() for t in local.values()),
            "dtypes": sorted({str(t.dtype) for t in local.values()}),  # as stored (the compute dtype is FSDP's)
            "total_numel": sum(p.numel() for p in params.values()),
            "requires_grad": sorted(n for n, p in params.items() if p.requires_grad),
            "with_grad": sorted(n for n, p in params.items() if p.grad is not None),
            "changed": sorted(n for n, t in local.items() if not torch.equal(t.view(-1).view(torch.uint8),
                                                                             start[n].view(-1).view(torch.uint8))),
            "names": sorted(strip_wrappers(n) for n in params),  # as checkpoints name them
        })
    rank = os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0"))
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report, default=str))
