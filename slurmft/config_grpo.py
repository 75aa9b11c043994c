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


#: TRL's ``GRPOConfig.vllm_gpu_memory_utilization`` default (colocate: vLLM's share of each training GPU)
COLOCATE_GPU_MEMORY_UTILIZATION = 0.3
#: ``trl vllm-serve --gpu_memory_utilization`` default (server: vLLM's share of each server GPU)
SERVER_GPU_MEMORY_UTILIZATION = 0.9


class VLLMServer(Section):
    """``rollouts: server``: the allocation's last node runs TRL's vLLM server (``trl vllm-serve``), the other nodes
    train and ask it for completions (TRL's ``vllm_mode="server"``); slurmft renders both steps (docs/grpo.md)."""

    nodes: int = Field(1, ge=1, description="Nodes at the end of the allocation that run the vLLM server (taken from "
                       "resources.nodes: the others train). One: vLLM spreads a model over nodes only with Ray, which "
                       "slurmft does not start.")
    tensor_parallel_size: int | None = Field(
        None, ge=1, le=64, description="GPUs the served model is split over (trl vllm-serve --tensor_parallel_size; "
        "default: resources.gpus_per_node, the whole server node).")
    gpu_memory_utilization: float = Field(
        SERVER_GPU_MEMORY_UTILIZATION, gt=0, le=1, description="Share of each server GPU vLLM takes for the weights "
        "and its KV cache (trl vllm-serve --gpu_memory_utilization; its default).")
    timeout_s: int = Field(
        600, ge=10, le=86400, description="Seconds the trainer waits for the server to answer before it stops with "
        "an error naming the server's address (TRL's vllm_server_timeout; TRL's default is 240 s, slurmft's 600 s "
        "because the server loads the model from the shared file system while the trainer loads its shards).")
    sync_timeout_s: int = Field(
        900, ge=10, le=86400, description="Seconds the weight-sync group's set-up (TRL's init_communicator) or one "
        "weight sync to the server (NCCL) may take before the job stops (exit 2) with an error naming the call, the "
        "server and the limit, and every thread's stack, instead of hanging (TRL sets no limit: trl#2923, trl#6797). "
        "timeout_s + sync_timeout_s must stay under the collectives' time-out (SLURMFT_COLLECTIVE_TIMEOUT, 1800 s), "
        "which the other ranks wait in meanwhile: the job refuses otherwise.")

    def tensor_parallel(self, gpus_per_node: int) -> int:
        """The GPUs the served model is split over: tensor_parallel_size, else the whole node's."""
        return self.tensor_parallel_size or gpus_per_node or 1

    @field_validator("nodes")
    @classmethod
    def _one_node(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"{v} server nodes: vLLM spreads one model over several nodes only through Ray, which "
                             "slurmft does not start inside a job; set grpo.server.nodes=1 (raise "
                             "grpo.server.tensor_parallel_size to use more of the node's GPUs)")
        return v


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
            import difflib

            close = difflib.get_close_matches(v, list(BUILTINS), n=1, cutoff=0.8)  # a typo of a built-in's name
            raise ValueError(f"{v!r} is not a built-in reward ({', '.join(BUILTINS)})"
                             + (f"; did you mean {close[0]}?" if close else "")
                             + "; name yours as module:function or path/file.py:function")
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
        "Python; the same seeded completions as transformers); server (TRL's vLLM server on the allocation's last "
        "node, grpo.server; `slurmft render` writes its scripts; the train job is wired for it) has not run on a GPU "
        "yet (validate refuses it; docs/grpo.md).",
    )
    vllm_gpu_memory_utilization: float = Field(
        COLOCATE_GPU_MEMORY_UTILIZATION, gt=0, lt=1, description="rollouts: colocate: the share of each training GPU "
        "the vLLM engine takes for its weights and KV cache (TRL's vllm_gpu_memory_utilization and its default); the "
        "rest is the training's (slurmft estimate counts both).")
    server: VLLMServer = Field(default_factory=VLLMServer, description="rollouts: server: the vLLM server's node "
                               "and its time-outs (ignored for the other rollouts).")
    rewards: list[RewardSpec] = Field(..., min_length=1, description="The reward functions, summed with their weights.")

    @field_validator("loss_type")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        from slurmft.grpoopts import loss_type_problem

        problem = loss_type_problem(v, where="loss_type")
        if problem:
            raise ValueError(problem.removeprefix("loss_type: "))
        return v

    @property
    def server_nodes(self) -> int:
        """Nodes of the allocation that serve rather than train (0 unless ``rollouts: server``)."""
        return self.server.nodes if self.rollouts == Rollouts.SERVER else 0

    def server_problem(self, nodes: int, gpus_per_node: int) -> str | None:
        """What a server layout of ``nodes`` nodes with ``gpus_per_node`` GPUs cannot do, with the fix (None: it can)."""
        if self.rollouts != Rollouts.SERVER:
            return None
        if nodes <= self.server.nodes:
            return (f"grpo.rollouts: server takes the allocation's last {self.server.nodes} node(s) for vLLM and "
                    f"trains on the others, but resources.nodes is {nodes}; set resources.nodes to at least "
                    f"{self.server.nodes + 1}, or grpo.rollouts=colocate (vLLM inside the training processes)")
        if gpus_per_node == 0:
            return ("grpo.rollouts: server syncs the trained weights to vLLM over NCCL, which needs GPUs, but "
                    "resources.gpus_per_node is 0; give the nodes GPUs, or set grpo.rollouts=transformers")
        tp = self.server.tensor_parallel_size
        if tp is not None and tp > gpus_per_node:
            return (f"grpo.server.tensor_parallel_size: {tp} GPUs, but the server node has {gpus_per_node} "
                    f"(resources.gpus_per_node); set it to at most {gpus_per_node}")
        return None

    def generations_per_step(self, gradient_accumulation_steps: int) -> int:
        """steps_per_generation as TRL resolves it."""
        return self.steps_per_generation or gradient_accumulation_steps

    def old_policy_forward(self, gradient_accumulation_steps: int) -> bool:
        """Whether TRL's GRPOTrainer forwards the policy once more over each generation batch, without gradients, for
        the old policy's log-probabilities (``old_per_token_logps``): when a generation does not end with an optimizer
        step (the accumulation is not a multiple of ``steps_per_generation``; slurmft leaves ``num_iterations`` at 1),
        or with vLLM's importance-sampling correction, which TRL turns on by default and slurmft keeps for
        ``rollouts: server`` (``colocate`` turns it off: slurmft/job/grpo.py)."""
        return (gradient_accumulation_steps % self.generations_per_step(gradient_accumulation_steps) != 0
                or self.rollouts == Rollouts.SERVER)
