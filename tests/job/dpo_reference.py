"""The single-process TRL reference of a DPO run: TRL's DPOTrainer on one process, no FSDP, no process group.

Run by test_dpo_cpu.py with a run directory whose config.yaml has a ``dpo`` section:

    python tests/job/dpo_reference.py RUN_DIR OUT.json

It reads the same data through the job's own data code (same preference conversions, same order) and builds
TRL's ``DPOConfig`` with the job's own options, but the policy is transformers' ``from_pretrained`` and the
reference is TRL's own (``ref_model=None``: TRL loads a second copy from the model's path; for a ``lora`` run
the policy is PEFT's ``get_peft_model`` and TRL's reference is that model with its adapters disabled), and the
batch is the whole global batch of the 2-rank run on one process (tests/job/one_process.py). Writes the
per-step losses and DPO metrics to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from one_process import job_context, load_model, one_process

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def main(run_dir: str, out: str) -> None:
    from transformers import TrainerCallback
    from trl import DPOTrainer

    from slurmft.job import data, train
    from slurmft.job.inputs import load_tokenizer, resolve_model_dir, resolve_tokenizer_dir
    from slurmft.rundir import RunPaths

    paths = RunPaths.of(run_dir)
    cfg = train.read_config(paths)
    assert cfg.dpo is not None and not cfg.dpo.precomputed
    model_dir = resolve_model_dir(cfg.model, with_weights=True)
    tokenizer = load_tokenizer(resolve_tokenizer_dir(cfg.model, model_dir), cfg)
    dataset = data.load_mixture(cfg.data, cfg.train.seed, tokenizer, method="dpo")
    model = load_model(cfg, model_dir)
    args = one_process(train.training_args(cfg, paths, job_context()), cfg, out)
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
