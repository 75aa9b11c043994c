"""The single-process TRL reference of a GRPO run: TRL's GRPOTrainer on one process, no FSDP, no process group.

Run by test_grpo_cpu.py with a run directory whose config.yaml has a ``grpo`` section:

    python tests/job/grpo_reference.py RUN_DIR OUT.json

It reads the same prompts through the job's own data code, resolves the same reward functions and builds TRL's
``GRPOConfig`` with the job's own options, but the policy is transformers' ``from_pretrained``, the reference (beta
> 0) is the copy TRL loads itself from the model's path, and the batch is the whole global batch of the 2-rank run
on one process (tests/job/one_process.py; the generation batch recomputed for one process: the same size). A
``lora`` run's policy is PEFT's ``get_peft_model`` (its adapters starting where slurmft's start), and with beta > 0
TRL makes its own reference: a "ref" adapter copied from the fresh one; the final adapter goes to OUT.safetensors.

What is slurmft's here: the completions are sampled by ``slurmft.job.grpo.generate_seeded`` (the trainer class is
``slurmft.job.grpo.trainer_class()``, which replaces only ``GRPOTrainer._generate_single_turn``), so the same
prompts get the same completions as on two ranks (TRL's own sampling draws from each rank's RNG stream: other
completions on every world size). The rewards, advantages, loss, KL, clipping and logging are TRL's. Writes the
per-step logs and the completions TRL scored to OUT.json.
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

    from slurmft.job import data, grpo, train
    from slurmft.job.inputs import load_tokenizer, resolve_model_dir, resolve_tokenizer_dir
    from slurmft.rundir import RunPaths

    paths = RunPaths.of(run_dir)
    cfg = train.read_config(paths)
    assert cfg.grpo is not None
    model_dir = resolve_model_dir(cfg.model, with_weights=True)
    tokenizer = load_tokenizer(resolve_tokenizer_dir(cfg.model, model_dir), cfg)
    dataset = data.load_mixture(cfg.data, cfg.train.seed, tokenizer, method="grpo")
    model = load_model(cfg, model_dir)
    # the 2-rank global batch on one process: GRPOConfig checks its generation batch (ranks x batch) when built
    whole = cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"per_device_batch_size": 2 * cfg.train.per_device_batch_size})})
    args = one_process(train.training_args(whole, paths, job_context()), cfg, out, generation_batch_size=None)
    records: list[dict[str, float]] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                records.append({k: float(v) for k, v in logs.items() if isinstance(v, int | float)})

    trainer = grpo.trainer_class()(model=model, reward_funcs=grpo.reward_functions(cfg), args=args,
                                   train_dataset=dataset, processing_class=tokenizer, callbacks=[Logs()])
    if cfg.lora is None:  # TRL's own reference: the copy it loads itself
        assert (trainer.ref_model is not None) == (cfg.grpo.beta > 0)
    else:  # a PeftModel: TRL's own "ref" adapter, a copy of the fresh one (beta > 0), no second model
        assert trainer.ref_model is None and ("ref" in model.peft_config) == (cfg.grpo.beta > 0)
    assert trainer.args.generation_batch_size == 2 * cfg.train.per_device_batch_size * trainer.args.steps_per_generation
    trainer.train()
    Path(out).write_text(json.dumps({"logs": records}))
    if cfg.lora is not None:  # the trained adapter, PEFT's names (as tests/job/peft_reference.py writes it)
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        saved = get_peft_model_state_dict(model, save_embedding_layers=False)  # the "default" adapter
        save_file({k: v.detach().contiguous() for k, v in saved.items()}, str(Path(out).with_suffix(".safetensors")))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
