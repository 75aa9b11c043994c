"""What preserving the RNG state costs under activation checkpointing (slurmft/job/parallelize.py).

    python bench/rng_checkpointing.py [--size tiny|150m] [--steps 20] [--model DIR]

One process, the tiny model (``slurmft.tiny``, fp32, CPU unless a GPU is there) with PEFT's LoRA r=16 on every
linear layer and ``lora_dropout`` 0.1, every decoder layer wrapped by torch's ``checkpoint_wrapper`` as the job
wraps it; forward + backward of one batch (2 x 256 tokens) per step, ``preserve_rng_state`` True and False
alternating step by step (the machine's load hits both alike). Prints the median time per step of each and the
difference, and whether the gradients of the same seeded step equal those without checkpointing (they must
with True; with False the recompute draws new dropout masks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import ensure_model  # noqa: E402  (bench/checkpoint.py: the cached tiny model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--model")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = ensure_model(args.model, args.size)

    def build(preserve: bool | None) -> torch.nn.Module:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
        base.config.use_cache = False
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1, target_modules="all-linear",
                                                task_type="CAUSAL_LM", init_lora_weights=False))
        if preserve is not None:
            layers = model.get_base_model().model.layers
            for i in range(len(layers)):
                layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=preserve)
        return model.to(device).train()

    vocab = build(None).config.vocab_size
    batch = torch.randint(0, vocab, (2, 256), generator=torch.Generator().manual_seed(1)).to(device)

    def step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.detach().clone()
                 for n, p in model.named_parameters() if p.grad is not None}
        return time.perf_counter() - t0, grads

    plain, preserved, fresh = build(None), build(True), build(False)
    _, reference = step(plain)
    times: dict[str, list[float]] = {"preserve_rng_state=True": [], "preserve_rng_state=False": []}
    same: dict[str, bool] = {}
    for i in range(args.steps + 2):  # two warm-up steps each
        pair = [("preserve_rng_state=True", preserved), ("preserve_rng_state=False", fresh)]
        for key, model in pair if i % 2 else pair[::-1]:  # each goes first every other step
            seconds, grads = step(model)
            if i >= 2:
                times[key].append(seconds)
            same[key] = all(torch.allclose(grads[n], reference[n], rtol=1e-5, atol=1e-7) for n in reference)
    medians = {k: statistics.median(v) for k, v in times.items()}
    on, off = medians["preserve_rng_state=True"], medians["preserve_rng_state=False"]
    print(json.dumps({"device": device.type, "model": str(model_dir), "steps": args.steps,
                      "median_s_per_step": medians, "cost_pct": round(100 * (on - off) / off, 2),
                      "gradients_equal_no_checkpointing": same}, indent=1))
    return 0 if same["preserve_rng_state=True"] else 1


if __name__ == "__main__":
    sys.exit(main())
