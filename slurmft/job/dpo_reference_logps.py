"""``dpo.reference: precomputed``: the reference's log-probabilities, computed once, kept in the run directory.

TRL's own ``precompute_ref_log_probs`` does not fit a policy that is already FSDP2-sharded when the trainer is built:
under FSDP it loads a whole unsharded copy of the reference to compute them, it hashes the model's weights (DTensor
parameters cannot be hashed), and a resumed job's policy holds trained weights, not the starting model's. So the
train job does it itself, on its first attempt, before step 1:

- the policy *is* the reference then (the starting model; dropout off in eval mode): every rank runs it, without
  gradients, over its share of the pairs (rank r takes rows r, r + world, ...; the last rows repeat so that every
  rank runs the same forwards, FSDP's all-gathers being collectives), through TRL's own
  ``DPOTrainer.compute_ref_log_probs`` (the same fused LM head, masks and ``ld_alpha`` as its loss);
- the ranks all-gather their results and rank 0 writes ``RUN_DIR/reference_logps.safetensors`` (two float32
  vectors, one value per pair and reply, in the trainer dataset's row order) atomically, with what it was computed
  from;
- every attempt (a requeue, ``slurmft resume``, a resume on another number of ranks) reads that file instead: the
  rows do not depend on the world size. A resumed full fine-tune has no starting model to compute them from, so a
  checkpoint without the file is refused in words; LoRA's reference is the base with the adapters disabled, which
  a resume still has, so there the file is computed again when it is missing.

The trainer then reads the values from its batches (TRL's ``ref_chosen_logps``/``ref_rejected_logps`` columns and
``precompute_ref_logps``): no reference forward during training and no second model in memory. A warning signal
while the values are computed stops the job before step 1 (nothing is written; the next attempt starts over).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from slurmft.config import RunConfig
from slurmft.errors import JobSetupError
from slurmft.job import distributed, preemption
from slurmft.job.distributed import DistContext
from slurmft.rundir import RunPaths, atomic_write

log = logging.getLogger("slurmft.job")

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
#: batches between two checks of the warning signal (a collective: every rank must agree where it stops)
SIGNAL_EVERY = 8


def _identity(cfg: RunConfig, rows: int) -> dict[str, str]:
    """What the values depend on, kept in the file's metadata and checked when it is read."""
    return {"rows": str(rows), "model": str(cfg.model.name_or_path), "max_length": str(cfg.data.max_seq_length),
            "lora": "yes" if cfg.lora is not None else "no"}


def read(cfg: RunConfig, paths: RunPaths, rows: int) -> tuple[Any, Any] | None:
    """The stored values, or None when there is no file; a file made for other data or another model is refused."""
    from safetensors import safe_open

    path = paths.reference_logps
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        chosen, rejected = (f.get_tensor(name) for name in COLUMNS)
    expected = _identity(cfg, rows)
    different = [f"{key}: the file says {meta.get(key)!r}, this run {value!r}" for key, value in expected.items()
                 if meta.get(key) != value]
    if different:
        raise JobSetupError(
            f"dpo.reference: precomputed: {path} was computed for another run (its data, model or length changed "
            f"since); move it away to compute the values again on a fresh start", problems=different)
    return chosen, rejected


def _write(cfg: RunConfig, paths: RunPaths, chosen: Any, rejected: Any) -> None:
    from safetensors.torch import save

    data = save({COLUMNS[0]: chosen.contiguous(), COLUMNS[1]: rejected.contiguous()},
                metadata=_identity(cfg, chosen.numel()))
    atomic_write(paths.reference_logps, data)


def compute(trainer: Any, cfg: RunConfig, ctx: DistContext) -> tuple[Any, Any] | None:
    """Every pair's reference log-probabilities through the policy as it is now (the starting model), on every rank;
    None when the warning signal came first (every rank stops at the same batch)."""
    import torch
    import torch.distributed as dist

    dataset = trainer.train_dataset
    rows, world = len(dataset), ctx.world_size
    count = math.ceil(rows / world)
    mine = list(range(ctx.rank, rows, world))
    mine += [mine[-1] if mine else 0] * (count - len(mine))  # every rank the same number of forwards
    batch_size = cfg.train.per_device_batch_size
    batches = math.ceil(count / batch_size)
    model = trainer.model
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    t0, last_note = time.time(), time.time()
    try:
        for b in range(batches):
            if b % SIGNAL_EVERY == 0 and distributed.any_rank(ctx, preemption.requested()):
                return None
            examples = [dataset[i] for i in mine[b * batch_size:(b + 1) * batch_size]]
            batch = {k: v.to(ctx.device) if hasattr(v, "to") else v for k, v in trainer.data_collator(examples).items()}
            c, r = trainer.compute_ref_log_probs(model, batch)
            chosen.append(c.detach().float())
            rejected.append(r.detach().float())
            if ctx.is_main and time.time() - last_note > 30:
                last_note = time.time()
                log.info("dpo: reference log-probabilities: batch %d of %d (%.0fs)", b + 1, batches, last_note - t0)
    finally:
        model.train(was_training)
    local = torch.stack([torch.cat(chosen), torch.cat(rejected)]) if chosen else torch.zeros(2, 0, device=ctx.device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    out = torch.empty(2, rows, dtype=torch.float32)
    for r, part in enumerate(gathered):
        index = list(range(r, rows, world))
        out[:, index] = part[:, :len(index)].cpu()
    if ctx.is_main:
        log.info("dpo: reference log-probabilities of %d pairs computed in %.1fs (%d batches of %d a rank)", rows,
                 time.time() - t0, batches, batch_size)
    return out[0], out[1]


def obtain(trainer: Any, cfg: RunConfig, paths: RunPaths, ctx: DistContext, resuming: bool) -> tuple[Any, Any] | None:
    """The values for ``trainer``'s dataset: read from the run directory, or computed and written there (a fresh start,
    or LoRA); None when the warning signal stopped the computation."""
    rows = len(trainer.train_dataset)
    stored = distributed.guarded(ctx, "reading the reference log-probabilities", lambda: read(cfg, paths, rows))
    if stored is not None:
        if ctx.is_main:
            log.info("dpo: reference log-probabilities of %d pairs read from %s (computed by the first attempt)", rows,
                     paths.reference_logps)
        return stored
    if resuming and cfg.lora is None:
        raise JobSetupError(
            f"dpo.reference: precomputed: {paths.reference_logps} is missing, and this attempt resumes from a "
            f"checkpoint: its policy is no longer the starting model, so the values cannot be computed again; put the "
            f"file back, or train the run again from the start in a new output_dir")
    values = compute(trainer, cfg, ctx)
    if values is None:
        return None
    distributed.guarded(ctx, "writing the reference log-probabilities",
                        lambda: _write(cfg, paths, *values) if ctx.is_main else None)
    if ctx.is_main:
        log.info("dpo: kept in %s: later attempts read them", paths.reference_logps)
    return values


def attach(trainer: Any, values: tuple[Any, Any]) -> None:
    """The trainer reads the reference's log-probabilities from its batches from now on (no reference forward)."""
    dataset = trainer.train_dataset
    present = [c for c in COLUMNS if c in dataset.column_names]
    if present:
        dataset = dataset.remove_columns(present)
    for name, column in zip(COLUMNS, values, strict=True):
        dataset = dataset.add_column(name, column.tolist())
    trainer.train_dataset = dataset
    trainer.precompute_ref_logps = True
