"""slurmft's sampler for GRPO rollouts: each token a Gumbel-max draw keyed by its place in the run, not by an RNG
stream, so the completions do not depend on the world size, the attempt, or the engine that computed the logits.

``argmax(logits / T (top-p masked) + Gumbel noise)`` is a draw from TRL's sampling distribution (with float32
uniforms); the noise comes from a generator seeded by ``(train.seed, generation point, the completion's index in the
global generation batch, token position)``. transformers' ``generate`` applies it as a logits processor
(slurmft/job/grpo.py ``generate_seeded``), a colocated vLLM engine through a logits processor of its own
(slurmft/job/vllm_rollouts.py) on greedy requests: the same function on both paths.
"""

from __future__ import annotations

import hashlib
from typing import Any


def noise_seed(seed: int, point: int, row: int, position: int) -> int:
    """A 63-bit generator seed for one token of one completion: the same on every world size and attempt."""
    digest = hashlib.blake2b(f"{seed}:{point}:{row}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeededSampling:
    """A logits processor for greedy ``generate``: temperature, top-p, then per-completion Gumbel noise, so the
    argmax is a sample from TRL's distribution drawn from ``(seed, point, first_row + i, position)``."""

    def __init__(self, seed: int, point: int, first_row: int, prompt_length: int, temperature: float,
                 top_p: float) -> None:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        self.seed, self.point, self.first_row, self.prompt_length = seed, point, first_row, prompt_length
        warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        self.warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        return self.at(scores, input_ids.shape[1] - self.prompt_length, input_ids)

    def at(self, scores: Any, position: int, input_ids: Any = None) -> Any:
        """``scores`` (rows ``first_row``, ``first_row + 1``, ...) warped and noised for the token at ``position``
        of their completions: transformers' ``generate`` calls it through ``__call__``, vLLM's rollouts directly
        (slurmft/job/vllm_rollouts.py; the warpers do not read ``input_ids``)."""
        import torch

        scores = self.warpers(input_ids, scores.float())
        # drawn where the logits are: one small draw per completion (a vocabulary of uniforms), no host round trip;
        # CUDA's generator gives other numbers than the CPU's, each the same on every world size of its kind
        noise = torch.empty_like(scores)
        generator = torch.Generator(device=scores.device)
        for i in range(scores.shape[0]):
            generator.manual_seed(noise_seed(self.seed, self.point, self.first_row + i, position))
            torch.rand(scores.shape[1], generator=generator, out=noise[i])
        tiny = torch.finfo(noise.dtype).tiny
        return scores - torch.log(-torch.log(noise.clamp_(tiny, 1 - 1e-7)))


def generation_point(trainer: Any) -> int:
    """Where in the run a generation happens, the same on every world size and attempt: the completions the run
    has trained on before it, ``(global_step x gradient_accumulation_steps + micro-step) x ranks x
    per_device_batch_size``. A resume on another number of ranks keeps the global batch by recomputing accumulation
    (slurmft/plan/elastic.py): counted in micro-steps alone, 2 ranks x 2 x 1 and 1 rank x 2 x 2 would key the same
    generation by other points (tests/job/test_grpo_cpu.py, the elastic resume)."""
    args = trainer.args
    micro_steps = trainer.state.global_step * args.gradient_accumulation_steps + (
        trainer._step % args.gradient_accumulation_steps)
    return micro_steps * trainer.accelerator.num_processes * args.per_device_train_batch_size
