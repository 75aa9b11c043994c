"""What each optimizer step trained on: one line per step in ``batches.jsonl``, a digest of its sequences.

Why: a loss curve that matches after a resume says the model is right, not that the data is. A resume
that repeats or skips sequences can still land on similar losses. So every step records the multiset of
sequences it trained on, over every rank and micro-batch: each sequence (a packed row split at its
``position_ids`` resets, or a padded row without its padding) hashed on its own, the hashes sorted and
hashed again. The digest does not depend on how the step's sequences were spread over ranks,
micro-batches or rows, so a run resumed on another number of ranks (slurmft/job/elastic.py) must write
the same digest at every step as the uninterrupted run.

Where: in the data collator, while the micro-batch is still on the host (the collator's tensors, in the
process or the loader worker that collates them), never from the device: a ``.cpu()`` of the batch per
micro-batch would make a GPU rank wait there for the previous backward (issue 45). The hashes travel in the
batch under :data:`HASHES` (accelerate moves only tensors to the device) and the training step takes them out
before the model sees the batch. tests/job/test_batches.py runs the step on a batch on the meta device (whose
data cannot be read) under the profiler: no copy, no item.

The Trainer's own count of the tokens seen (``include_num_input_tokens_seen``, what ``tokens_per_s`` in
metrics.jsonl is made of) gathers a device tensor and reads it back after every micro-batch too; this
callback counts the same tokens (each sequence without its padding) on the host and adds them to
``state.num_input_tokens_seen`` at the step's end instead.

Cost: one blake2b per sequence where the batch is collated, one ``all_gather_object`` of a few short
strings per optimizer step, one line written by rank 0.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from slurmft.job.distributed import DistContext

#: the key of a collated micro-batch that carries its sequences' hashes to the training step
HASHES = "slurmft_sequence_hashes"


def sequences(inputs: dict[str, Any]) -> list[Any]:
    """The token sequences of one collated micro-batch (host tensors), as 1-D tensors: each row without its padding
    (the attention mask), split where ``position_ids`` restart at 0 (padding-free packing puts several in one row)."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    pos = inputs.get("position_ids")
    out = []
    for row in range(ids.shape[0]):
        keep = mask[row].bool() if mask is not None else None
        tokens = ids[row][keep] if keep is not None else ids[row]
        if pos is None:
            out.append(tokens)
            continue
        p = pos[row]
        p = p[keep] if keep is not None else p
        starts = [int(i) for i in (p == 0).nonzero().flatten()] or [0]
        if starts[0] != 0:
            starts.insert(0, 0)
        out.extend(tokens[a:b] for a, b in zip(starts, [*starts[1:], len(tokens)], strict=True))
    return [s for s in out if len(s)]


def loss_tokens(inputs: dict[str, Any]) -> int | None:
    """The targets the causal-LM loss reads in a collated micro-batch: labels after the one-token shift that are not
    -100 (padding-free packing masks each sequence's first label, so a sequence of n tokens, all labelled, gives
    n - 1); None for a batch without labels (DPO)."""
    labels = inputs.get("labels")
    return None if labels is None else int((labels[..., 1:] != -100).sum())


def sequence_hash(tokens: Any) -> str:
    """A short hash of one sequence's token ids (int64 bytes: the same ids hash the same whatever their dtype)."""
    return hashlib.blake2b(tokens.to(dtype=torch.int64).numpy().tobytes(), digest_size=8).hexdigest()


def digest(hashes: list[str]) -> str:
    """The step's digest: its sequences' hashes, sorted (ranks and micro-batches in any order), hashed."""
    return hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()[:16]


class BatchDigest(TrainerCallback):
    """Records every micro-batch a rank trains on (:meth:`watch`); at each step end the ranks gather their
    hashes and rank 0 appends ``{step, sequences, tokens, loss_tokens, digest, world_size, job_id, restart}``
    (``loss_tokens``: :func:`loss_tokens` over the step, absent for DPO)."""

    def __init__(self, ctx: DistContext, path: Path, info: dict[str, Any]) -> None:
        self.ctx = ctx
        self.path = path
        self.info = {k: info[k] for k in ("job_id", "restart") if k in info}
        self._hashes: list[str] = []
        self._tokens = 0
        self._loss_tokens: int | None = None
        self._counts_tokens = False  # state.num_input_tokens_seen: counted here, not by the Trainer per micro-batch

    def watch(self, trainer: Any) -> None:
        """``trainer``'s collator hashes each micro-batch's sequences on the host; its ``training_step`` (one
        micro-batch) records them and hands the model the batch without them."""
        collate = trainer.data_collator

        def collate_and_hash(examples: list[Any]) -> Any:
            batch = collate(examples)
            seqs = sequences(batch)
            batch[HASHES] = ([sequence_hash(s) for s in seqs], sum(len(s) for s in seqs), loss_tokens(batch))
            return batch

        original = trainer.training_step

        def training_step(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            hashes, tokens, in_loss = inputs.pop(HASHES)
            self._hashes.extend(hashes)
            self._tokens += tokens
            if in_loss is not None:
                self._loss_tokens = (self._loss_tokens or 0) + in_loss
            return original(model, inputs, *args, **kwargs)

        trainer.data_collator = collate_and_hash
        trainer.training_step = training_step
        if hasattr(trainer, "_track_num_input_tokens"):  # the Trainer counts in this method: ours instead (on_step_end)
            trainer._track_num_input_tokens = lambda inputs: None
            self._counts_tokens = True

    def on_step_end(self, args, state, control, **kwargs):
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, (self._hashes, self._tokens, self._loss_tokens))  # gloo: host memory
        self._hashes, self._tokens, self._loss_tokens = [], 0, None
        if self._counts_tokens:
            state.num_input_tokens_seen += sum(t for _, t, _ in gathered)
        if self.ctx.is_main:
            hashes = [h for part, _, _ in gathered for h in part]
            in_loss = [n for _, _, n in gathered if n is not None]
            record = {
                "step": state.global_step,
                "sequences": len(hashes),
                "tokens": sum(t for _, t, _ in gathered),
                **({"loss_tokens": sum(in_loss)} if in_loss else {}),
                "digest": digest(hashes),
                "world_size": self.ctx.world_size,
                **self.info,
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return control
