"""What the single-process references (dpo_reference.py, peft_reference.py) share: transformers' own model,
PEFT-wrapped for a ``lora`` run, and the job's own training arguments without FSDP or a process group.

The batch is the whole global batch of the 2-rank run on one process (``per_device_batch_size`` x 2): the
same examples per optimizer step. A LoRA model's adapters start from slurmft's seeded initial values
(``adapters.init_adapters``: a deterministic function of the seed and the tensor's name), so both runs start
from the same point, but PEFT matches the modules and builds the LoRA layers, not slurmft.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


def load_model(cfg: Any, model_dir: Path) -> Any:
    """The model as transformers loads it (fp32, SDPA), with PEFT's LoRA layers when the run has a lora section."""
    import torch
    from transformers import AutoModelForCausalLM

    from slurmft.job import adapters

    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    if cfg.lora is None:
        return model
    from peft import get_peft_model

    model = get_peft_model(model, adapters.peft_config(cfg.lora, model))
    assert adapters.init_adapters(model, cfg.train.seed) > 0
    return model


def job_context() -> Any:
    """A CPU DistContext for building the job's arguments (no process group is started)."""
    import torch

    from slurmft.job.distributed import DistContext
    from slurmft.job.rendezvous import JobEnv

    return DistContext(env=JobEnv.from_environ(), device=torch.device("cpu"), backend="gloo", collective_timeout_s=60)


def one_process(args: Any, cfg: Any, out: str, **more: Any) -> Any:
    """The job's training arguments on one process: no FSDP, no saves, no trackers, the 2-rank global batch
    (``more``: other fields to replace, e.g. GRPO's generation batch, recomputed for one process)."""
    return dataclasses.replace(
        args, output_dir=str(Path(out).parent / "reference-out"), fsdp="", fsdp_config=None, save_strategy="no",
        per_device_train_batch_size=cfg.train.per_device_batch_size * 2, report_to="none",
        accelerator_config={}, max_steps=cfg.train.max_steps, **more)
