"""The single-process PEFT reference of a LoRA run: PEFT on one process, no FSDP, no process group.

Run by test_lora_cpu.py with a run directory whose config.yaml has a ``lora`` section:

    python tests/job/peft_reference.py RUN_DIR OUT.json

It reads the same data through the job's own data code (same mixture, tokenizer, TRL's preparation, slurmft's
packing, seed: slurmft/job/prepare.py ``prepare_rows``, as the train job does in its allocation) and
builds TRL's ``SFTConfig`` with the job's own options, but the model is transformers' ``from_pretrained``
wrapped by PEFT's ``get_peft_model``, its adapters starting where slurmft's start, and the batch is the whole
global batch of the 2-rank run on one process (tests/job/one_process.py). Writes the per-step losses and the
final adapter tensors (PEFT's names) to OUT.json / OUT.safetensors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from one_process import job_context, load_model, one_process

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def main(run_dir: str, out: str) -> None:
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from slurmft.job import data, prepare, train
    from slurmft.job.inputs import load_tokenizer, resolve_model_dir, resolve_tokenizer_dir
    from slurmft.rundir import RunPaths

    paths = RunPaths.of(run_dir)
    cfg = train.read_config(paths)
    assert cfg.lora is not None
    model_dir = resolve_model_dir(cfg.model, with_weights=True)
    tokenizer = load_tokenizer(resolve_tokenizer_dir(cfg.model, model_dir), cfg)
    dataset = prepare.prepare_rows(cfg, tokenizer, data.load_mixture(cfg.data, cfg.train.seed, tokenizer),
                                   cfg.data.num_proc, paths.checkpoints, paths)
    model = load_model(cfg, model_dir)
    args = one_process(train.sft_config(cfg, paths, job_context()), cfg, out)
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[Losses()])
    trainer.train()
    Path(out).write_text(json.dumps({"losses": losses}))
    # the adapters only, as consolidation writes them: not the embedding's frozen base weight, which PEFT adds to
    # the saved state by default when an embedding is a target
    saved = get_peft_model_state_dict(model, save_embedding_layers=False)
    state = {k: v.detach().contiguous() for k, v in saved.items()}
    save_file(state, str(Path(out).with_suffix(".safetensors")))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
