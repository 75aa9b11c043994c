"""Run under torchrun by test_weights.py: load models with slurmft's sharded loader and verify them.

For each model directory: every parameter must come from a tensor of the file and every tensor of the
file must reach a parameter (a tied head counts once), each gathered parameter must equal the
safetensors tensor bit for bit (cast to float32, exact for a bf16 file),
rotary ``inv_freq`` must be the freshly computed one (not ``to_empty`` garbage), and the sharded
model's logits must equal a plain ``from_pretrained`` model's. Every rank writes
``OUT/<name>.<how>.rank<r>.json``.

``DIR:sliced`` gives every rank the directory (each reads its own slice); ``DIR:scatter`` gives it to
rank 0 only (the fallback: rank 0 reads and scatters).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/job/load_check.py OUT DIR:HOW [...]
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from slurmft.config import RunConfig
from slurmft.job import distributed, inputs, loading
from slurmft.job.rendezvous import JobEnv


def run_config(model_dir: Path, activation_checkpointing: bool) -> RunConfig:
    return RunConfig.model_validate({
        "name": "load-check", "output_dir": "/tmp/unused",
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "data": {"datasets": [{"path": "unused.jsonl"}], "max_seq_length": 64},
        "train": {"max_steps": 1}, "checkpoint": {"every_steps": 1},
        "fsdp": {"activation_checkpointing": activation_checkpointing},
    })


def check(model_dir: Path, ctx: distributed.DistContext, activation_checkpointing: bool, how: str) -> dict:
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    cfg = run_config(model_dir, activation_checkpointing)
    config = inputs.load_model_config(model_dir, cfg.model, 64)
    sharded = loading.build_sharded_model(cfg, config, model_dir if ctx.is_main or how == "sliced" else None, ctx)
    model = sharded.model
    mismatched, checked, not_in_file, local, full = [], [], [], 0, 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for name, param in loading.iter_param_shards(model):
            assert isinstance(param, DTensor), name
            local += param.to_local().numel()
            full += param.numel()
            gathered = param.full_tensor()  # collective: every rank
            if name not in keys:
                not_in_file.append(name)
            elif ctx.is_main:
                checked.append(name)
                if not torch.equal(gathered, f.get_tensor(name).to(gathered.dtype)):
                    mismatched.append(name)
    # Every tensor of the file must have reached a parameter, and every parameter must come from the
    # file. A tied head is one parameter (named_parameters lists it once, as the embeddings), whether
    # or not the file also stores lm_head.weight.
    tied = bool(config.tie_word_embeddings)
    unchecked = sorted(keys - set(checked)) if ctx.is_main else []
    if tied:
        unchecked = [k for k in unchecked if k != "lm_head.weight"]
    bad_rotary = []
    for name, module in model.named_modules():
        if hasattr(module, "inv_freq") and hasattr(module, "compute_default_rope_parameters"):
            expected, _ = module.compute_default_rope_parameters(module.config)
            if not torch.equal(module.inv_freq.cpu(), expected):
                bad_rotary.append(name)
    ids = torch.arange(3, 40).unsqueeze(0) % config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    result = {"rank": ctx.rank, "checked": len(checked), "file_keys": len(keys), "unchecked_keys": unchecked,
              "params_not_in_file": not_in_file, "mismatched": mismatched, "bad_rotary": bad_rotary,
              "local_fraction": local / full, "tied": tied, "load_method": sharded.load_method,
              "bytes_read": sharded.bytes_read, "file_bytes": (model_dir / "model.safetensors").stat().st_size}
    if ctx.is_main:
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        with torch.no_grad():
            ref_logits = ref(input_ids=ids).logits
        result["max_abs_logit_diff"] = float((logits - ref_logits).abs().max())
    return result


def main() -> None:
    out = Path(sys.argv[1])
    ctx = distributed.init(JobEnv.from_environ())
    for i, spec in enumerate(sys.argv[2:]):
        model_dir, how = Path(spec.rsplit(":", 1)[0]), spec.rsplit(":", 1)[1]
        result = check(model_dir, ctx, activation_checkpointing=i % 2 == 0, how=how)
        (out / f"{model_dir.name}.{how}.rank{ctx.rank}.json").write_text(json.dumps(result))
    gc.collect()  # free the FSDP models (their meshes) first: one alive at destroy crashes the exit (torch 2.13)
    distributed.shutdown()


if __name__ == "__main__":
    main()
