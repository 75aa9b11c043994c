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
  rows do not depend on the world size.

The file is bound to what the values were computed from (issue 45: fixed data, prepared again, trained on the old
pairs' values): a digest of the pairs' token ids in row order (:func:`rows_digest`), ``data.max_seq_length``, the
LoRA flag and the base model's identity (``inputs.base_identity``: its hub commit, its files' sizes and sampled
hashes). A file that does not match this attempt's data is computed again from the starting model, which is on
disk: on a fresh start it is the policy; a resumed LoRA run has it too (the base with the adapters disabled); a
resumed full fine-tune reads the model files into the policy's shards first (they hold nothing yet: the
checkpoint's load replaces them before step 1). A base that changed under a checkpoint is refused earlier, by
the train job's base check (slurmft/job/checkpointing/candidates.py ``check_resume_base``).

The trainer then reads the values from its batches (TRL's ``ref_chosen_logps``/``ref_rejected_logps`` columns and
``precompute_ref_logps``): no reference forward during training and no second model in memory. A warning signal
while the values are computed stops the job before step 1 (nothing is written; the next attempt starts over).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from slurmft.config import RunConfig
from slurmft.job import distributed, preemption
from slurmft.job.distributed import DistContext
from slurmft.rundir import RunPaths, atomic_write

log = logging.getLogger("slurmft.job")

COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
#: batches between two checks of the warning signal (a collective: every rank must agree where it stops)
SIGNAL_EVERY = 8


def rows_digest(dataset: Any) -> str:
    """SHA-256 of the pairs' token ids (prompt, chosen, rejected), row by row in the dataset's order: what the values
    were computed over."""
    import hashlib

    import numpy as np
    import pyarrow.compute as pc

    columns = [c for c in ("prompt_ids", "chosen_ids", "rejected_ids") if c in dataset.column_names]
    digest = hashlib.sha256(",".join(columns).encode())
    for batch in dataset.select_columns(columns).with_format("arrow").iter(batch_size=1000):
        for name in columns:
            digest.update(pc.list_value_length(batch[name]).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
            digest.update(pc.list_flatten(batch[name]).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
    return digest.hexdigest()


def identity(cfg: RunConfig, dataset: Any, base: dict[str, Any] | None) -> dict[str, str]:
    """What the values depend on, kept in the file's metadata and compared when it is read."""
    import json

    return {"rows": str(len(dataset)), "data_sha256": rows_digest(dataset), "max_length": str(cfg.data.max_seq_length),
            "lora": "yes" if cfg.lora is not None else "no",
            "base": json.dumps({k: (base or {}).get(k) for k in ("revision", "files")}, sort_keys=True)}


WHAT = {"rows": "the number of pairs", "data_sha256": "the pairs' token ids", "max_length": "data.max_seq_length",
        "lora": "the lora section", "base": "the base model's files"}


def read(paths: RunPaths, expected: dict[str, str]) -> tuple[tuple[Any, Any] | None, list[str]]:
    """(the stored values, []) when the file matches ``expected``; (None, []) without a file; (None, what differs)
    for a file computed from other data or another model."""
    from safetensors import safe_open

    path = paths.reference_logps
    if not path.is_file():
        return None, []
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        values = tuple(f.get_tensor(name) for name in COLUMNS)
    different = [WHAT[key] for key, value in expected.items() if meta.get(key) != value]
    return (None, different) if different else ((values[0], values[1]), [])


def _write(paths: RunPaths, chosen: Any, rejected: Any, expected: dict[str, str]) -> None:
    from safetensors.torch import save

    data = save({COLUMNS[0]: chosen.contiguous(), COLUMNS[1]: rejected.contiguous()}, metadata=expected)
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


def obtain(trainer: Any, cfg: RunConfig, paths: RunPaths, ctx: DistContext, resuming: bool,
           base: dict[str, Any] | None, starting_weights: Callable[[], object]) -> tuple[Any, Any] | None:
    """The values for ``trainer``'s dataset: read from the run directory when they were computed from this data and
    this base, else computed (from the starting model: ``starting_weights()`` reads it into a resumed full
    fine-tune's policy first) and written there; None when the warning signal stopped the computation."""
    rows = len(trainer.train_dataset)
    expected = identity(cfg, trainer.train_dataset, base)
    stored, stale = distributed.guarded(ctx, "reading the reference log-probabilities",
                                        lambda: read(paths, expected))
    if stored is not None:
        if ctx.is_main:
            log.info("dpo: reference log-probabilities of %d pairs read from %s (computed by an earlier attempt)", rows,
                     paths.reference_logps)
        return stored
    if ctx.is_main and stale:
        log.warning("dpo: %s was computed from other data or another model (%s changed since): computing the values "
                    "again", paths.reference_logps, ", ".join(stale))
    if resuming and cfg.lora is None:  # the policy's shards hold nothing yet: the starting model first
        t0 = time.time()
        starting_weights()
        if ctx.is_main:
            log.info("dpo: the starting model read from its files to compute the values (%.1fs); the checkpoint's "
                     "load replaces it before step 1", time.time() - t0)
    values = compute(trainer, cfg, ctx)
    if values is None:
        return None
    distributed.guarded(ctx, "writing the reference log-probabilities",
                        lambda: _write(paths, *values, expected) if ctx.is_main else None)
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
