"""One step's gradients with LoRA dropout under activation checkpointing equal PEFT's on one process without it.

Run inside tests/job/run_many.py's launches by test_lora_cpu.py (``call:tests.job.dropout_gradients:main:RUN_DIR:OUT``)
with a run whose lora section has dropout > 0 and activation checkpointing on:

- every rank builds the run's sharded LoRA model as the job does (slurmft.job.loading.build_sharded_model: FSDP2,
  checkpoint-wrapped layers, seeded adapters), and runs forward and backward on the same batch after
  ``torch.manual_seed(STEP_SEED)`` (the same dropout masks on every rank, so the reduce-scattered mean gradient
  is the one-batch gradient);
- rank 0 then builds transformers' model wrapped by PEFT's ``get_peft_model`` (no FSDP, no checkpointing), the
  same initial adapters (adapters.init_adapters), and runs the same step after the same seed: the same masks;
- ``OUT/gradients.json``: the largest difference per tensor, relative to the tensor's largest gradient, and, as a
  check that the comparison can fail, the same for PEFT's step under another seed (other masks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from slurmft.checkpoints import strip_wrappers
from slurmft.job import adapters, cpu_fsdp, distributed, loading, train
from slurmft.job.inputs import load_model_config, resolve_model_dir
from slurmft.job.rendezvous import JobEnv
from slurmft.rundir import RunPaths

STEP_SEED, OTHER_SEED = 1234, 4321


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[strip_wrappers(name)] = g.detach().clone()
    return out


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)) for n in b}


def main(run_dir: str, out: str) -> None:
    env = JobEnv.from_environ()
    cfg = train.read_config(RunPaths.of(run_dir))
    assert cfg.lora is not None and cfg.lora.dropout > 0 and cfg.fsdp.activation_checkpointing
    ctx = distributed.init(env)
    cpu_fsdp.enable()
    model_dir = resolve_model_dir(cfg.model, with_weights=True)
    config = load_model_config(model_dir, cfg.model, cfg.data.max_seq_length)
    sharded = loading.build_sharded_model(cfg, config, model_dir, ctx)
    model = sharded.model.train()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapped = sum(1 for m in model.modules() if isinstance(m, CheckpointWrapper))  # FSDP2 subclasses it
    assert wrapped == config.num_hidden_layers, wrapped
    assert all(isinstance(p, DTensor) for p in model.parameters())
    batch = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(STEP_SEED)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    ours = _grads(model)
    if ctx.is_main:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        def peft_step(seed: int) -> tuple[float, dict[str, torch.Tensor]]:
            base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                        attn_implementation=sharded.attn_implementation)
            base.config.use_cache = False
            reference = get_peft_model(base, adapters.peft_config(cfg.lora, base))
            adapters.init_adapters(reference, cfg.train.seed)
            reference.train()
            torch.manual_seed(seed)
            ref_loss = reference(input_ids=batch, labels=batch).loss
            ref_loss.backward()
            return float(ref_loss), _grads(reference)

        ref_loss, theirs = peft_step(STEP_SEED)
        _, other = peft_step(OTHER_SEED)
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "gradients.json").write_text(json.dumps({
            "loss": float(loss), "peft_loss": ref_loss, "names": sorted(ours), "peft_names": sorted(theirs),
            "relative": _relative(ours, theirs), "other_masks_relative": _relative(other, theirs),
            "checkpoint_wrapped": wrapped}))
    distributed.barrier()
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
