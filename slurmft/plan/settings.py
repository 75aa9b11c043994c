"""The run's settings as ``slurmft estimate`` reads them: one record the arithmetic (``estimate.py``, the memory;
``communication.py``, the collectives) and its words (``estimate_text.py``, which tries changed copies of it for the remedies) both take, so neither
imports the other back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slurmft.precision import DTYPE_BYTES as PRECISION_DTYPE_BYTES
from slurmft.precision import PRECISIONS
from slurmft.units import GiB

RUNTIME_BYTES_GPU_RANK = 2 * GiB  # Python, torch, CUDA libraries per GPU rank
RUNTIME_BYTES_CPU_RANK = GiB // 2
COMPUTE_BYTES = {name: p.compute_bytes for name, p in PRECISIONS.items()}  # read by estimate and communication


@dataclass(frozen=True)
class LoraSettings:
    """A ``lora`` section as the arithmetic reads it (slurmft/config.py ``LoraConfig``)."""

    r: int = 16
    alpha: float = 32.0
    target_modules: str | tuple[str, ...] = "all-linear"
    modules_to_save: tuple[str, ...] = ()
    use_rslora: bool = False  # scaling alpha / sqrt(r) instead of alpha / r

    @classmethod
    def of(cls, lora: Any) -> LoraSettings | None:
        """From a config's ``lora`` section (None: full fine-tuning)."""
        if lora is None:
            return None
        targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
        return cls(lora.r, lora.alpha, targets, tuple(lora.modules_to_save), lora.use_rslora)

    @property
    def scaling(self) -> float:
        """What B·A is multiplied by (slurmft.lora.lora_scaling)."""
        from slurmft.lora import lora_scaling

        return lora_scaling(self.alpha, self.r, self.use_rslora)

    def words(self) -> str:
        targets = self.target_modules if isinstance(self.target_modules, str) else ", ".join(self.target_modules)
        rs = f", rsLoRA (scaling alpha/sqrt(r) = {self.scaling:g})" if self.use_rslora else ""
        return f"r={self.r}, alpha={self.alpha:g}{rs} on {targets}"


@dataclass(frozen=True)
class Settings:
    """The run's settings the arithmetic and its words (estimate_text) read, resolved from config and profile."""

    nodes: int
    ranks_per_node: int
    fsdp: bool
    cpu_offload: bool
    checkpointing: bool
    eager: bool
    seq_len: int
    micro_batch: int
    precision: str
    on_gpu: bool
    capacity: int
    reduce_dtype: str = "float32"
    reduce_configured: str | None = None  # fsdp.reduce_dtype as written (None: follows the precision)
    hsdp: bool = False  # fsdp.replicate_across_nodes
    reshard_after_forward: bool = True
    accumulation: int = 1  # train.gradient_accumulation_steps: no memory term (gradients stay sharded)
    lora: LoraSettings | None = None  # adapters on a frozen base (None: every weight trains)
    dpo: bool = False  # a dpo: section: chosen and rejected in one forward (two sequences per example)
    dpo_precomputed: bool = False  # dpo.reference: precomputed: no reference model while training
    grpo: bool = False  # a grpo: section: completions generated and trained on (slurmft/plan/estimate_grpo.py)
    grpo_kl: bool = False  # grpo.beta > 0: a KL term (with LoRA its reference is the base, adapters disabled)
    grpo_old_policy: bool = False  # TRL forwards the policy over each generation batch for old log-probs (no grad)
    grpo_rollouts: str = ""  # grpo.rollouts: transformers (a KV cache per rank), colocate (vLLM's share), server
    generation_sequences: int = 0  # completions one rank generates at once: per_device_batch_size x steps_per_generation
    vllm_share: float = 0.0  # grpo.vllm_gpu_memory_utilization (colocate)
    server_nodes: int = 0  # nodes of the allocation that serve (grpo.server.nodes with rollouts: server), not in nodes
    async_saves: bool = False  # checkpoint.async: each rank keeps a CPU staging copy of its checkpoint share

    @property
    def dpo_reference(self) -> bool:
        """DPO with full fine-tuning holds a frozen, sharded copy of the model in the compute dtype; LoRA-DPO uses the
        base with the adapters disabled (so the LoRA remedy of a DPO run that does not fit drops the copy too), and
        precomputed reference log-probabilities need no model at all."""
        return self.dpo and self.lora is None and not self.dpo_precomputed

    @property
    def grpo_reference(self) -> bool:
        """GRPO's KL term (``beta > 0``) on a full fine-tune: the same frozen, sharded copy as DPO's; with LoRA the
        reference is the base with the adapters disabled (slurmft/job/grpo.py ``uses_reference_copy``), so the LoRA
        remedy of a GRPO run that does not fit drops the copy too."""
        return self.grpo_kl and self.lora is None

    @property
    def reference_copy(self) -> bool:
        """A frozen, sharded copy of the model in the compute dtype beside the policy: DPO's (above), or GRPO's
        reference for the KL term (``beta > 0``)."""
        return self.dpo_reference or self.grpo_reference

    @property
    def reference_forwards(self) -> int:
        """Forwards of a frozen reference per micro-batch, each one more all-gather of the parameters under FSDP:
        DPO's (unless ``dpo.reference: precomputed``) and GRPO's KL term's (``beta > 0``), whether the reference is
        the sharded copy or, with LoRA, the policy itself with its adapters disabled. GRPO's comes once per
        generation batch (TRL's ``ref_per_token_logps``, ``steps_per_generation`` chunks of the micro-batch), so one
        per micro-batch on average."""
        return int((self.dpo and not self.dpo_precomputed) or self.grpo_kl)

    @property
    def extra_forwards(self) -> int:
        """Forwards without gradients per micro-batch besides the training's, each one more all-gather of the parameters:
        the reference's (:attr:`reference_forwards`) and GRPO's old-policy log-probabilities (``grpo_old_policy``, once
        per generation batch in ``steps_per_generation`` chunks: one per micro-batch on average)."""
        return self.reference_forwards + int(self.grpo_old_policy)

    @property
    def sequences(self) -> int:
        """Sequences in one forward per rank: the micro-batch, twice for DPO (chosen and rejected together)."""
        return self.micro_batch * (2 if self.dpo else 1)

    @property
    def reduce_bytes(self) -> int:
        return PRECISION_DTYPE_BYTES[self.reduce_dtype]

    @property
    def runtime_bytes_per_rank(self) -> int:
        """CPU RAM each rank needs besides the model (Python, torch, CUDA libraries)."""
        return RUNTIME_BYTES_GPU_RANK if self.on_gpu else RUNTIME_BYTES_CPU_RANK

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def shards(self) -> int:
        """Ranks one tensor is split over: every rank (FSDP), the ranks of one node (HSDP), or 1 (no FSDP)."""
        if not self.fsdp:
            return 1
        return self.ranks_per_node if self.hsdp else self.world_size
