"""The single-process TRL reference of a DPO run: TRL's DPOTrainer on one process, no FSDP, no process group.

Run by test_dpo_cpu.py with a run directory whose config.yaml has a ``dpo`` section:

    python tests/job/dpo_reference.py RUN_DIR OUT.json

It reads the same data through the job's own data code (same preference conversions, same order) and builds
TRL's ``DPOConfig`` with the job's own options, but the policy is transformers' ``from_pretrained`` and the
reference is TRL's own (``ref_model=None``: TRL loads a second copy from the model's path), and the batch is
the whole global batch of the 2-rank run on one process (``per_device_batch_size`` x 2): the same pairs per
optimizer step. Writes the per-step losses and DPO metrics to OUT.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def main(run_dir: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOTrainer

    from slurmft.job import data, train
    from slurmft.job.distributed import DistContext
    from slurmft.job.inputs import load_tokenizer, resolve_model_dir, resolve_tokenizer_dir
    from slurmft.job.rendezvous import JobEnv
    from slurmft.rundir import RunPaths

    paths = RunPaths.of(run_dir)
    cfg = train.read_config(paths)
    assert cfg.dpo is not None and cfg.lora is None
    model_dir = resolve_model_dir(cfg.model, with_weights=True)
    tokenizer = load_tokenizer(resolve_tokenizer_dir(cfg.model, model_dir), cfg)
    dataset = data.load_mixture(cfg.data, cfg.train.seed, tokenizer, preference=True)

    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False

    env = JobEnv.from_environ()
    ctx = DistContext(env=env, device=torch.device("cpu"), backend="gloo", collective_timeout_s=60)
    args = train.training_args(cfg, paths, ctx)
    args = dataclasses.replace(
        args, output_dir=str(Path(out).parent / "reference-out"), fsdp="", fsdp_config=None, save_strategy="no",
        per_device_train_batch_size=cfg.train.per_device_batch_size * 2, report_to="none",
        accelerator_config={}, max_steps=cfg.train.max_steps)
    records: list[dict[str, float]] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                records.append({k: float(v) for k, v in logs.items() if isinstance(v, int | float)})

    trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[Logs()])
    trainer.train()
    Path(out).write_text(json.dumps({"logs": records}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
