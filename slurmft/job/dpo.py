"""DPO on FSDP2: TRL's ``DPOTrainer`` on the sharded policy, with a sharded, frozen reference beside it.

What TRL 1.16 does with a model it did not load: without ``ref_model`` it loads the reference itself
(``create_model_from_path``: a whole unsharded copy on every rank, then ``prepare_fsdp`` shards it with
accelerate's defaults), and with ``precompute_ref_log_probs`` under FSDP it still loads that copy. For a
PEFT model it adds a second, "ref" adapter (``PeftModel.add_adapter``) copied from the first, which on a
model already sharded by FSDP2 would create plain, unsharded parameters inside sharded modules.

What we do instead (:func:`reference_model`, :func:`new_trainer`):

- **full fine-tuning** (``dpo.reference: auto``/``copy``): the reference is built exactly as the policy is
  (slurmft/job/loading.py: meta device, each rank reads its own slice of the model files, FSDP2 units per
  decoder layer), in the compute dtype, with ``requires_grad`` off, and handed to ``DPOTrainer`` as
  ``ref_model``: ``prepare_fsdp`` sees an ``FSDPModule`` and leaves it alone; the optimizer never sees it (it
  is not the Trainer's model), so it has no gradients, no optimizer state and is in no checkpoint. A resume
  builds it again from the model files, never from the checkpoint.
- **precomputed** (``dpo.reference: precomputed``): no reference model while training. The first attempt runs the
  policy, still the starting model, once over every pair before step 1 and keeps the log-probabilities in the run
  directory (slurmft/job/dpo_reference_logps.py); the trainer reads them from its batches.
- **LoRA** (``lora:`` section): no second model. The reference is the policy with its adapters disabled
  (TRL's ``use_adapter(model, None)``, inside its own loss): the base weights are frozen, so that is the
  starting model at every step. TRL's "ref" adapter copy is skipped
  (slurmft/job/adapters.py :func:`~slurmft.job.adapters.no_reference_adapter`).

Everything else is the SFT job's: sliced loading, precision, activation checkpointing, the checkpoint
callbacks (COMPLETE markers, preemption saves, resume), consolidation of the policy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.errors import JobSetupError
from slurmft.job.distributed import DistContext
from slurmft.job.loading import trl_loads_instead

log = logging.getLogger("slurmft.job")

#: the columns of TRL's prepared DPO data (RUN_DIR/prepared/)
PREPARED_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def dpo_config(cfg: RunConfig, common: dict[str, Any]) -> Any:
    """TRL's DPOConfig: the Trainer options every method shares (``common``), then the dpo: section."""
    from trl import DPOConfig

    dpo = cfg.dpo
    assert dpo is not None
    kwargs = {**common, "beta": dpo.beta, "loss_type": list(dpo.loss_type), "label_smoothing": dpo.label_smoothing,
              "max_length": cfg.data.max_seq_length,  # the whole pair's sequence: prompt + the longer reply
              # dpo.reference: precomputed is done by slurmft/job/dpo_reference_logps.py, not by TRL's __init__ (which
              # would load an unsharded copy and hash DTensor weights): the trainer's flag is set after it
              "precompute_ref_log_probs": False}
    try:
        return DPOConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise JobSetupError(f"dpo: TRL rejected the DPO options: {exc}") from None


def check_loss_types(cfg: RunConfig) -> None:
    """dpo.loss_type against this node's TRL (the login node's may differ), before anything is loaded."""
    from slurmft.dpoopts import loss_type_problems

    problems = loss_type_problems(list(cfg.dpo.loss_type)) if cfg.dpo is not None else []
    if problems:
        raise JobSetupError("dpo.loss_type: not a loss type of this TRL", problems=problems)


def uses_reference_copy(cfg: RunConfig) -> bool:
    """A second, sharded model is built: full fine-tuning (LoRA disables its adapters instead), unless the reference's
    log-probabilities are precomputed."""
    return cfg.dpo is not None and cfg.lora is None and not precomputed(cfg)


def precomputed(cfg: RunConfig) -> bool:
    """``dpo.reference: precomputed``: the reference's log-probabilities come from the run directory
    (slurmft/job/dpo_reference_logps.py), no reference model while training."""
    return cfg.dpo is not None and cfg.dpo.precomputed


def reference_model(cfg: RunConfig, model_config: Any, model_dir: Path | None, ctx: DistContext) -> Any:
    """The frozen reference: the starting model, loaded and sharded as the policy is, without gradients."""
    from slurmft.job import loading

    ref = loading.build_sharded_model(cfg, model_config, model_dir, ctx, frozen=True)
    ref.model.eval()
    return ref


@functools.cache
def trainer_class() -> type:
    """``DPOTrainer`` reading data the prepare job tokenized as it is (TRL has no ``skip_prepare_dataset`` for DPO)."""
    from trl import DPOTrainer

    class PreparedDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            if set(PREPARED_COLUMNS) <= set(dataset.column_names):  # RUN_DIR/prepared/: TRL's own output already
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    return PreparedDPOTrainer


def new_trainer(model: Any, reference: Any, args: Any, dataset: Any, tokenizer: Any, callbacks: list[Any],
                optimizer: Any, precomputed: bool = False) -> Any:
    """TRL's DPOTrainer on the sharded policy; ``reference`` is the sharded copy, or None with LoRA or with
    ``precomputed`` reference log-probabilities (slurmft/job/dpo_reference_logps.py attaches them)."""
    from slurmft.job import adapters

    cls = trainer_class()
    # without ref_model on a full fine-tune whose reference log-probabilities are precomputed, TRL would load a
    # whole unsharded copy from the model's files to run as the reference: it gets none, and the trainer reads
    # the precomputed values instead
    skip = precomputed and reference is None
    with (adapters.no_reference_adapter(model, "dpo"),
          trl_loads_instead("dpo_trainer", None) if skip else contextlib.nullcontext()):
        trainer = cls(model=model, ref_model=reference, args=args, train_dataset=dataset, processing_class=tokenizer,
                      callbacks=callbacks)
    if precomputed and trainer.ref_model is not None:
        raise JobSetupError("dpo.reference: precomputed: TRL built a reference model anyway; this TRL is not supported")
    trainer.optimizer_cls_and_kwargs = optimizer  # DPOTrainer does not pass it on; the optimizer is made in train()
    return trainer
