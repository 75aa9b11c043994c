"""The ``grpo`` section: online RL with verifiable rewards (TRL's ``GRPOTrainer``/``GRPOConfig`` meanings).

Part of the run config's schema (:class:`slurmft.config.RunConfig` holds it; absent = SFT or DPO). What needs
more than this section (the generation batch against ``num_generations``, ``train.sft``, ``dpo``) is checked by
``RunConfig``; what needs the job's Python (each reward imports and takes TRL's arguments, vLLM for
``rollouts: colocate``/``server``) by ``validate`` (slurmft/plan/grpo_checks.py).
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Literal

from pydantic import Field, field_validator

from slurmft.config_values import Section

#: ``module:function`` (a dotted module importable in the job's Python) or ``path/file.py:function``
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Rollouts(str, Enum):
    """Where the completions are generated."""

    TRANSFORMERS = "transformers"
    COLOCATE = "colocate"
    SERVER = "server"


class RewardSpec(Section):
    """One reward function and its weight in the sum (TRL's ``reward_funcs`` and ``reward_weights``)."""

    function: str = Field(
        ..., description="module:function importable in the job's Python (my_rewards:accuracy), a file of yours "
        "(/shared/rewards.py:format; relative to run.yaml's folder), or a built-in: exact_match (the completion, or "
        "its <answer>...</answer>, equals the row's answer column), think_format (<think>...</think> "
        "<answer>...</answer>). Called with prompts=, completions=, completion_ids=, trainer_state=, log_extra=, "
        "log_metric= and every extra column of the prompt data (accept **kwargs); returns one float per completion.",
    )
    weight: float = Field(1.0, description="Its weight in the summed reward (TRL's reward_weights).")

    @field_validator("function")
    @classmethod
    def _spec(cls, v: str) -> str:
        from slurmft.rewards import BUILTINS

        where, sep, function = v.rpartition(":")
        if not sep:
            if v in BUILTINS:
                return v
            raise ValueError(f"{v!r} is not a built-in reward ({', '.join(BUILTINS)}); name yours as "
                             "module:function or path/file.py:function")
        if not _NAME_RE.match(function):
            raise ValueError(f"{function!r} (after the colon) is not a function name; write module:function or "
                             "path/file.py:function")
        if not (where.endswith(".py") or _MODULE_RE.match(where)):
            raise ValueError(f"{where!r} is neither a module name (my_rewards, pkg.rewards) nor a .py file; write "
                             "module:function or path/file.py:function")
        return v

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("the weight must be a finite number (e.g. 1.0)")
        return v


class GRPOConfig(Section):
    """Group relative policy optimisation (TRL's ``GRPOTrainer``/``GRPOConfig`` meanings); absent = SFT or DPO.

    Each prompt is completed ``num_generations`` times, the completions are scored by the rewards, and each one's
    advantage is its reward against its group's mean (docs/grpo.md).
    """

    num_generations: int = Field(8, ge=2, le=1024, description="Completions sampled per prompt (TRL's "
                                 "num_generations; G in the paper). The generation batch (ranks x "
                                 "train.per_device_batch_size x steps_per_generation) must hold whole groups.")
    max_completion_length: int = Field(512, ge=1, le=1_048_576, description="Most tokens generated per completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also divides the logits the loss "
                               "scores the completions with, as TRL does).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose "
                         "probability reaches top_p (1.0: all).")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the frozen starting model (TRL's beta); 0 = "
                        "no reference model is loaded and no KL is computed.")
    loss_type: str = Field("dapo", description="TRL's GRPO loss: dapo (TRL's default), grpo, dr_grpo, bnpo, cispo, "
                           "sapo, luspo, vespo (the names the installed TRL's GRPOTrainer computes).")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clipping range of the importance ratio (TRL's epsilon).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratios per token, or one per sequence (GSPO; TRL's importance_sampling_level).")
    steps_per_generation: int | None = Field(
        None, ge=1, le=4096, description="Optimizer micro-steps each generation batch is split into (TRL's "
        "steps_per_generation; default: train.gradient_accumulation_steps).")
    rollouts: Rollouts = Field(
        Rollouts.TRANSFORMERS,
        description="Who generates: transformers (transformers' generate on the FSDP2-sharded policy, every rank "
        "its share; works everywhere, slow for long completions); colocate (TRL's colocate mode: a vLLM engine in "
        "every training process, the weights synced into it after each optimizer step; needs vLLM in the job's "
        "Python; the same seeded completions as transformers); server (vLLM on the allocation's last node) is not "
        "implemented yet (validate refuses it).",
    )
    rewards: list[RewardSpec] = Field(..., min_length=1, description="The reward functions, summed with their weights.")

    @field_validator("loss_type")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        from slurmft.grpoopts import loss_type_problem

        problem = loss_type_problem(v, where="loss_type")
        if problem:
            raise ValueError(problem.removeprefix("loss_type: "))
        return v

    def generations_per_step(self, gradient_accumulation_steps: int) -> int:
        """steps_per_generation as TRL resolves it."""
        return self.steps_per_generation or gradient_accumulation_steps
