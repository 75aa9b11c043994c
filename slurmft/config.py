"""The run config's schema: one pydantic model per section of ``run.yaml``, unknown keys rejected.

These are the sections users write, each field with its type, default and description (docs/config.md
is generated from them: ``python -m slurmft.plan.configdoc``), and the checks that need more than one
field (:class:`RunConfig`). The sections that say where and how the jobs run (cluster, container,
resources, preemption, the jobs' allocations) are in :mod:`slurmft.config_cluster`; the values that
reach a batch script are typed and checked in :mod:`slurmft.config_values`. Reading a file into a
:class:`RunConfig` (the YAML, ``key=value`` overrides, relative paths, the error lines) is
:mod:`slurmft.config_loading`.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from slurmft.config_cluster import (
    ClusterConfig,
    ConsolidateResources,
    PreemptionConfig,
    PrepareResources,
    ResourcesConfig,
)
from slurmft.config_grpo import GRPOConfig
from slurmft.config_model_checks import EvalConfig, ServeConfig
from slurmft.config_sweep import SweepConfig
from slurmft.config_values import NAME_RE, PATH_RE, Section, Size, check_value, slurm_time_seconds
from slurmft.lora import ALL_LINEAR, lora_scaling
from slurmft.methods import Method, method_of, objective, packs
from slurmft.precision import PRECISIONS

#: train.precision's choices: ``auto`` and the modes of slurmft/precision.py, listed once there.
PrecisionName = Literal[("auto", *PRECISIONS)]  # type: ignore[valid-type]


class Executor(str, Enum):
    """Where the jobs run."""

    AUTO = "auto"
    SLURM = "slurm"
    LOCAL = "local"


class ModelConfig(Section):
    """The model to fine-tune."""

    name_or_path: str = Field(..., description="Hugging Face hub id or local directory with config.json.")
    tokenizer: str | None = Field(None, description="Tokenizer id or path (default: name_or_path).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Compute dtype. Follows train.precision (bf16-* = bfloat16, fp32 = float32); when only this "
        "is set it picks the precision (bfloat16 = bf16-mixed, float16 = fp16-mixed, float32 = fp32). Setting "
        "both to disagreeing values is an error.",
    )
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto", description="auto = flash_attention_2 on a GPU when the architecture supports it, transformers accepts the installed flash-attn (is_flash_attn_2_available) and it imports, else sdpa where the architecture supports it, else eager (logged, with why). flash_attention_2 = that or a setup error; an explicit choice the architecture refuses is refused by validate."
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")


class DatasetSource(Section):
    """One data source; several are mixed by weight."""

    path: str = Field(..., description="Hub id, local .json/.jsonl/.jsonl.zst/.csv/.parquet/.txt/.txt.gz file, or a glob of local "
                      "files of one kind (/data/corpus/*.txt.gz).")
    split: str = Field("train", description="Split to read.")
    weight: float = Field(1.0, gt=0, description="Mixing weight (relative sampling probability).")
    format: Literal["auto", "messages", "sharegpt", "lima", "guanaco", "alpaca", "prompt_completion",
                    "preference", "text", "prompt"] = Field(
        "auto",
        description="Record layout: messages (role/content list), sharegpt (conversations: from/value list), lima "
        "(conversations: [str]), guanaco (text with '### Human:' / '### Assistant:'), alpaca (instruction, "
        "input, output), prompt_completion (prompt, completion), preference (dpo: only; chosen, rejected and an "
        "optional prompt, strings or conversations), prompt (grpo: only; a prompt, string or conversation, and any "
        "columns for the rewards), text (plain text for continued pretraining: the text column, "
        "or the one columns: {text: ...} names; every token in the loss, no chat template; .txt/.txt.gz files are "
        "always text; docs/text.md), or auto-detect (a text column is read as guanaco chat, never as plain text).",
    )
    documents: Literal["file", "blank_line"] = Field(
        "file",
        description="Plain-text .txt/.txt.gz files only: file (each file one document) or blank_line (each block "
        "between blank lines one document).",
    )
    name: str | None = Field(None, description="Hub dataset config name (subset).")
    revision: str | None = Field(
        None, description="Hub dataset revision (branch, tag or commit) to read; unset: the newest, whose commit the "
        "prepare job records, so that a resume after a new push is refused instead of mixing two versions.",
    )
    text_field: str | None = Field(None, description="Column holding the text/conversation if not the default.")
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Your column names for the format's fields, e.g. {prompt: question, completion: answer} or "
        "{instruction: task, output: response}; keys: messages, conversations, text, instruction, input, output, "
        "prompt, completion, chosen, rejected.",
    )

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str]) -> dict[str, str]:
        known = ("messages", "conversations", "text", "instruction", "input", "output", "prompt", "completion",
                 "chosen", "rejected")
        for key in v:
            if key not in known:
                raise ValueError(f"unknown field {key!r}; map any of {', '.join(known)} to your column names")
        return v


class DataConfig(Section):
    """Training data."""

    datasets: list[DatasetSource] = Field(..., min_length=1, description="Sources to mix.")
    max_seq_length: int = Field(2048, ge=8, le=1_048_576, description="Tokens per sequence (packed).")
    packing: bool = Field(True, description="Pack examples into max_seq_length sequences.")
    assistant_only_loss: bool = Field(True, description="Compute the loss on assistant tokens only.")
    num_proc: int | None = Field(None, ge=1, description="Processes for dataset preprocessing.")


DEFAULT_MAX_STEPS = 500


class TrainConfig(Section):
    """Optimisation settings; anything TRL's SFTConfig accepts can go under ``sft``."""

    max_steps: int | None = Field(
        None, ge=1, description="Optimizer steps (500 when neither max_steps nor epochs is set)."
    )
    epochs: float | None = Field(
        None,
        gt=0,
        le=1000,
        description="Passes over the data instead of max_steps: the job computes the steps from the packed "
        "dataset at start and records them in the run directory (plan.json). train.max_steps=N on the command "
        "line replaces it (a smoke test).",
    )
    per_device_batch_size: int = Field(1, ge=1, description="Micro-batch per rank.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(5e-5, gt=0, lt=1, description="Peak learning rate.")
    lr_scheduler: str = Field("cosine", description="transformers scheduler name.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps used for warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    precision: PrecisionName = Field(
        "auto",
        description="bf16-mixed: fp32 sharded weights and AdamW state, bf16 compute, fp32 reduce (16 bytes/"
        "parameter). bf16-true: bf16 weights, gradients and AdamW state, bf16 compute and reduce (8 bytes/"
        "parameter). fp32: all fp32. fp16-mixed: as bf16-mixed with fp16 compute. auto: bf16-mixed on GPU, fp32 "
        "on CPU (or what model.dtype implies). See docs/estimate.md for what fits.",
    )
    optimizer: Literal["adamw", "adamw-stochastic-rounding"] = Field(
        "adamw",
        description="adamw: torch.optim.AdamW (fused where supported). adamw-stochastic-rounding: torchao's AdamW "
        "with bf16 stochastic rounding of the weight update (train.precision=bf16-true only; needs torchao).",
    )
    seed: int = Field(42, ge=0, description="Random seed.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every N steps, and at the last step (the run's final "
                               "loss, which status and a sweep's ranking read).")
    report_to: list[str] = Field(default_factory=list, description=(
        "Extra loggers: tensorboard (into RUN_DIR/tensorboard), wandb (one W&B run across every requeue and "
        "resume; docs/watching.md)."))
    sft: dict[str, Any] = Field(default_factory=dict, description="Extra keys passed to trl.SFTConfig as-is.")

    @field_validator("lr_scheduler")
    @classmethod
    def _sched(cls, v: str) -> str:
        return check_value(NAME_RE, v, "scheduler name")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainConfig:
        if self.epochs is not None and self.max_steps is not None:
            raise ValueError(
                f"train.epochs ({self.epochs}) and train.max_steps ({self.max_steps}) are both set; keep one "
                "(epochs: steps are computed from the packed data; max_steps: a fixed count)"
            )
        if self.epochs is None and self.max_steps is None:
            self.__dict__["max_steps"] = DEFAULT_MAX_STEPS  # not an assignment: that would re-run this check
        return self


class FSDPConfig(Section):
    """FSDP2 sharding."""

    enabled: bool = Field(
        True,
        description="Shard with FSDP2 (full shard). false only models an unsharded run in `slurmft estimate`; "
        "`slurmft submit` refuses it (the trainer always shards).",
    )
    reshard_after_forward: bool = Field(True, description="Free gathered parameters after forward (ZeRO-3).")
    activation_checkpointing: bool = Field(True, description="Recompute activations in backward.")
    cpu_offload: bool = Field(False, description="Offload parameters to CPU.")
    reduce_dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description="Dtype gradients are reduce-scattered in (default: follows train.precision: float32 for "
        "bf16-mixed and fp32, bfloat16 for bf16-true). bfloat16 with bf16-mixed is the setting of accelerate's "
        "FSDP1 bf16 policy: half the reduce-scatter buffer and traffic, less exact sums.",
    )
    wrap_class: str | None = Field(None, description="Decoder layer class to wrap (default: from the model).")
    replicate_across_nodes: bool = Field(
        False,
        description="HSDP: shard over the ranks of each node and keep one full replica per node (a 2-D mesh, "
        "nodes x ranks per node). Parameter all-gathers and gradient reduce-scatters stay inside a node; only a "
        "gradient all-reduce crosses the inter-node network. Needs the model's training state to fit one node: "
        "`slurmft estimate` shows both layouts and recommends this when it fits. With resources.nodes=1 it is "
        "plain FSDP.",
    )


class CheckpointConfig(Section):
    """Sharded (torch.distributed.checkpoint) checkpoints."""

    # ``async`` is a Python keyword: the field is ``asynchronous`` in code, ``async`` in YAML and when written back.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True,
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    every_steps: int = Field(100, ge=1, description="Save a sharded checkpoint every N steps; the last step is always saved.")
    keep_last: int = Field(2, ge=1, description="Keep the N newest complete checkpoints.")
    asynchronous: bool = Field(
        True, alias="async",
        description="Periodic saves are staged to CPU memory at the step boundary and written in the background "
        "while training goes on (one save in flight; COMPLETE only once every rank's write succeeded). false: "
        "training waits for every save. The final save and the save on the warning signal are always synchronous.",
    )
    max_failed_saves: int = Field(
        3, ge=1, le=1000,
        description="Stop the run when this many asynchronous saves in a row failed (a failed save leaves no "
        "COMPLETE and training goes on; the next save retries).",
    )


#: A module name as PEFT's ``target_modules`` takes it (q_proj, model.layers.0.mlp).
MODULE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


class LoraConfig(Section):
    """LoRA adapters (PEFT's ``LoraConfig`` meanings, without its ``lora_`` prefix); absent = full fine-tuning."""

    r: int = Field(16, description="Adapter rank: the inner dimension of B·A (typical 8-64).")
    alpha: float = Field(32.0, gt=0, description="Scaling numerator: the update is (alpha / r)·B·A, or (alpha / sqrt(r))·B·A with use_rslora (PEFT's lora_alpha).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (PEFT's lora_dropout); "
                           "exact under activation checkpointing (the recompute replays the forward's masks).")
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA (PEFT's use_rslora): the update is "
                             "(alpha / sqrt(r))·B·A, for the adapter and the merged model alike.")
    use_dora: bool = Field(False, description="DoRA (PEFT's use_dora): not supported, only false is accepted "
                           "(docs/lora.md says why).")
    target_modules: Literal["all-linear"] | list[str] = Field(
        ALL_LINEAR,
        description="Modules that get an adapter: all-linear (every linear layer of the decoder, not the output "
        "head; in mixture-of-experts models the fused experts and the router stay frozen: docs/lora.md) or a list "
        "of module names, e.g. [q_proj, v_proj] (a name matches a module whose name ends with it).",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full beside the adapters and saved with them, e.g. [embed_tokens, lm_head] "
        "when new tokens are added.",
    )

    @field_validator("r")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"the adapter rank must be at least 1 (typical: 8 to 64; got {v}); set lora.r=16")
        return v

    @field_validator("use_dora")
    @classmethod
    def _no_dora(cls, v: bool) -> bool:
        if v:
            raise ValueError("DoRA is not supported: its magnitude vector starts as the norms of the base weight, "
                             "which PEFT computes when it adds the adapter (on the meta device here, before any weight "
                             "is read), and slurmft's merge does not apply it; remove lora.use_dora (plain LoRA, or "
                             "lora.use_rslora: true)")
        return v

    @field_validator("target_modules", "modules_to_save", mode="before")
    @classmethod
    def _module_names(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str) and v != ALL_LINEAR:
            v = [v]  # one name written without brackets
        if isinstance(v, list):
            if not v and info.field_name == "target_modules":
                raise ValueError("an empty list adapts nothing; list module names (e.g. [q_proj, v_proj]) or use "
                                 "all-linear")
            for name in v:
                if not isinstance(name, str) or not MODULE_NAME_RE.match(name):
                    raise ValueError(f"{name!r} is not a module name (letters, digits, _ and .; e.g. q_proj)")
        return v

    @property
    def scaling(self) -> float:
        """The factor of B·A in the forward and the merged weight (:func:`lora_scaling`)."""
        return lora_scaling(self.alpha, self.r, self.use_rslora)


class ConsolidateConfig(Section):
    """Turn the final sharded checkpoint into a deployable Hugging Face model."""

    enabled: bool = Field(True, description="Chain a consolidation job after training (afterok).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Dtype of the saved model; auto = the training compute dtype (bfloat16 for bf16-mixed and "
        "bf16-true, float32 for fp32), as recorded in the checkpoint; for a LoRA run's merged model, auto = the "
        "base model's file dtype (its untouched weights stay bit for bit). LoRA adapters are saved as trained "
        "(float32).",
    )
    max_shard_size: Size = Field("5GB", description="Largest safetensors file, e.g. 5GB, 500MB.")
    merge: bool = Field(
        True,
        description="LoRA runs: also write the merged full model (W + scaling·B·A, streamed from the base "
        "model's files) into RUN_DIR/model/; false writes only the adapter (RUN_DIR/adapter/).",
    )
    resources: ConsolidateResources = Field(default_factory=ConsolidateResources)


class PrepareConfig(Section):
    """Tokenize once: a CPU job before the train job prepares the data into RUN_DIR/prepared/ (docs/prepare.md)."""

    enabled: bool = Field(
        True,
        description="Chain a prepare job (CPU) before the train job (afterok): it loads, converts, tokenizes and "
        "packs the data with TRL's own preparation; the train job and every requeue and resume read the result. "
        "false: the train job prepares the data inside its allocation (small data, quick local runs).",
    )
    tasks: int = Field(
        1, ge=1, le=10000,
        description="Tasks of the prepare job array (--array=0-(N-1)): task k tokenizes the k-th contiguous share of "
        "the mixture into a shard of its own, the last task to finish packs them all in one plan, and the train job "
        "waits for the whole array. The prepared data is the same for every value (docs/text.md#corpus-scale-a-prepare-array); 1: "
        "one prepare job. A sweep's shared prepare job, and dpo and grpo runs, prepare in one job.",
    )
    resources: PrepareResources = Field(default_factory=PrepareResources)


class DPOReference(str, Enum):
    """How a DPO run gets the reference model's log-probabilities."""

    AUTO = "auto"
    COPY = "copy"
    PRECOMPUTED = "precomputed"


class DPOConfig(Section):
    """Direct preference optimisation (TRL's ``DPOTrainer``/``DPOConfig`` meanings); absent = supervised fine-tuning.

    A later method (KTO, ORPO, ...) is one more section like this one: RunConfig.method names the one set.
    """

    beta: float = Field(0.1, gt=0, description="Strength of the pull towards the reference model (TRL's beta): "
                        "higher stays closer to it.")
    loss_type: list[str] = Field(
        default_factory=lambda: ["sigmoid"],
        description="TRL's DPO loss: sigmoid (DPO), ipo, hinge, robust, ... (the names the installed TRL's "
        "DPOTrainer computes; validate lists them). A list combines several (TRL's loss_type list).",
    )
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Probability that a preference label is flipped "
                                   "(cDPO / robust DPO; TRL's label_smoothing).")
    reference: DPOReference = Field(
        DPOReference.AUTO,
        description="The frozen reference model: copy = a second copy of the starting model, loaded and "
        "FSDP2-sharded like the policy, without gradients or optimizer state; precomputed = no reference in memory "
        "while training: the train job's first attempt runs the starting model (the policy before step 1, "
        "dropout off) once over every pair and keeps the log-probabilities in RUN_DIR/reference_logps.safetensors, "
        "which every later attempt reads (TRL's precompute_ref_log_probs); auto = copy, or with a lora: section the "
        "base model with the adapters disabled (no second copy). The reference is never saved in a checkpoint: a "
        "resume rebuilds the copy from the model files.",
    )

    @property
    def precomputed(self) -> bool:
        """``reference: precomputed``: no reference model while training (the job and the estimate ask this)."""
        return self.reference == DPOReference.PRECOMPUTED

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]  # one name written without brackets
        if isinstance(v, list) and not v:
            raise ValueError("an empty list computes no loss; use sigmoid (DPO) or another of TRL's loss types")
        return v

    @field_validator("loss_type")
    @classmethod
    def _known_loss(cls, v: list[str]) -> list[str]:
        from slurmft.dpoopts import loss_type_problems

        problems = loss_type_problems(v, where="loss_type")
        if problems:
            raise ValueError("; ".join(p.removeprefix("loss_type: ") for p in problems))
        return v


class RunConfig(Section):
    """A whole run: the contents of run.yaml."""

    name: str = Field(..., description="Run name (job names, directories): letters, digits, . _ -")
    output_dir: str = Field(..., description="Run directory on the shared filesystem.")
    executor: Executor = Field(Executor.AUTO, description="slurm, local, or auto (slurm when sbatch exists).")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    consolidate: ConsolidateConfig = Field(default_factory=ConsolidateConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters on a frozen base model instead of every weight (docs/lora.md)."
    )
    dpo: DPOConfig | None = Field(
        None, description="Preference tuning with DPO on preference data (prompt/chosen/rejected) instead of "
        "supervised fine-tuning (docs/dpo.md)."
    )
    grpo: GRPOConfig | None = Field(
        None, description="Online RL with rewards (GRPO) on prompt data (a prompt column, string or conversation) "
        "instead of supervised fine-tuning (docs/grpo.md)."
    )
    serve: ServeConfig | None = Field(
        None, description="After consolidation, a job that serves the model with vLLM and checks it against "
        "transformers (docs/serve-eval.md)."
    )
    eval: EvalConfig | None = Field(
        None, description="After consolidation, a job that scores the model (and the base) with lm-eval-harness "
        "(docs/serve-eval.md)."
    )
    sweep: SweepConfig | None = Field(
        None, description="Several runs from this file, one per point of a grid of overrides, as one Slurm job "
        "array sharing one prepare job (docs/sweeps.md)."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_value(NAME_RE, v, "run name (letters, digits, '.', '_', '-')")

    @field_validator("output_dir")
    @classmethod
    def _outdir(cls, v: str) -> str:
        return check_value(PATH_RE, v, "path (no spaces, quotes or shell characters)")

    @model_validator(mode="after")
    def _cross(self) -> RunConfig:
        self._reconcile_precision()
        limit = slurm_time_seconds(self.cluster.time)
        if self.preemption.lead_time_s >= limit:
            raise ValueError(
                f"preemption.lead_time_s: {self.preemption.lead_time_s} s is not shorter than cluster.time "
                f"({self.cluster.time} = {limit} s): Slurm would send the warning signal at the start. Set "
                f"preemption.lead_time_s below {limit} (e.g. {max(30, limit // 10)}) or raise cluster.time"
            )
        if self.fsdp.replicate_across_nodes and not self.fsdp.enabled:
            raise ValueError(
                "fsdp.replicate_across_nodes: shards inside each node, which needs fsdp.enabled=true; set "
                "fsdp.enabled=true or fsdp.replicate_across_nodes=false"
            )
        if self.dpo is not None:
            self._check_dpo(self.dpo)
        if self.prepare.tasks > 1 and self.method != Method.SFT:
            raise ValueError(f"prepare.tasks: an array splits SFT's tokenization; a {self.method.value} run prepares in "
                             "one job. Set prepare.tasks=1")
        self._check_text()
        if self.grpo is not None:
            self._check_grpo(self.grpo)
        for kind in ("serve", "eval"):
            section = self.model_job(kind)
            if section is not None and not self.consolidate.enabled:
                raise ValueError(f"{kind}: its job runs on the consolidated model, after the consolidation job, but "
                                 f"consolidate.enabled is false; set consolidate.enabled=true or remove the {kind} "
                                 "section")
            if self.executor == Executor.LOCAL and section is not None and section.container:
                raise ValueError(f"{kind}.container: the local executor runs the job on this machine, outside any "
                                 f"image; remove {kind}.container (or set executor=slurm)")
        if self.executor == Executor.LOCAL and self.cluster.container is not None:
            raise ValueError(
                "cluster.container: the local executor runs the job on this machine, outside any image; remove "
                "cluster.container (or set executor=slurm)"
            )
        if self.executor == Executor.LOCAL and self.resources.nodes != 1:
            raise ValueError(
                "resources.nodes: the local executor runs on this machine only; set resources.nodes=1 "
                "(or executor=slurm)"
            )
        return self

    def _check_dpo(self, dpo: DPOConfig) -> None:
        """What a DPO run cannot combine with."""
        if dpo.reference == DPOReference.COPY and self.lora is not None:
            raise ValueError(
                "dpo.reference: copy loads a second model, but with a lora: section the reference is the base model "
                "with the adapters disabled (no copy needed); remove dpo.reference (auto) or the lora: section"
            )
        if self.train.sft:
            raise ValueError(
                f"train.sft: passes options to TRL's SFTConfig, but a dpo run trains with TRL's DPOTrainer; remove "
                f"train.sft ({', '.join(sorted(self.train.sft))}) or the dpo: section"
            )

    def _check_text(self) -> None:
        """Plain-text sources (continued pretraining): what cannot keep their documents apart or train on them."""
        from slurmft.sourcefiles import is_text

        text = [i for i, s in enumerate(self.data.datasets) if is_text(s.path, s.format)]
        if not text:
            return
        where = f"data.datasets[{text[0]}]"
        if self.method != Method.SFT:  # dpo: preference pairs; grpo: prompts to complete
            raise ValueError(f"{where}: plain text (format text, or a .txt file) trains by language modelling, not by "
                             f"{self.method.value}; remove that source or the {self.method.value}: section")
        if self.train.sft.get("packing_strategy") == "wrapped" and self.data.packing:
            raise ValueError(
                f"train.sft.packing_strategy: wrapped concatenates the documents of {where} (plain text) and cuts "
                "the stream every max_seq_length tokens, without sequence lengths: each document would attend to "
                "the ones before it in its row. Remove packing_strategy (bfd: each document's positions restart and "
                "attention stays inside it) or set it to bfd_split")

    @property
    def chat_data(self) -> bool:
        """Whether some source is chat or instruction data (it needs the tokenizer's chat template); a run of plain
        text alone (continued pretraining) uses none."""
        from slurmft.sourcefiles import is_text

        return self.dpo is not None or not all(is_text(s.path, s.format) for s in self.data.datasets)

    def _check_grpo(self, grpo: GRPOConfig) -> None:
        """What a GRPO run cannot combine with, and whole prompt groups in every generation batch."""
        if self.dpo is not None:
            raise ValueError("grpo and dpo: a run trains with one method; remove one of the two sections")
        if self.train.sft:
            raise ValueError(
                f"train.sft: passes options to TRL's SFTConfig, but a grpo run trains with TRL's GRPOTrainer; remove "
                f"train.sft ({', '.join(sorted(self.train.sft))}) or the grpo: section"
            )
        if self.train.epochs is not None:
            raise ValueError(
                f"train.epochs: a grpo run counts optimizer steps (each prompt is completed num_generations times, so "
                f"an epoch of prompts is not a fixed number of steps yet); replace train.epochs ({self.train.epochs:g}) "
                "with train.max_steps"
            )
        problem = grpo.server_problem(self.resources.nodes, self.resources.gpus_per_node)
        if problem:
            raise ValueError(problem)
        t, ranks = self.train, self.train_world_size
        steps = grpo.generations_per_step(t.gradient_accumulation_steps)
        batch = ranks * t.per_device_batch_size * steps
        if batch % grpo.num_generations:
            fits = [g for g in range(2, batch + 1) if batch % g == 0]
            raise ValueError(
                f"grpo.num_generations: {grpo.num_generations} does not divide the generation batch, {ranks} rank(s) "
                f"x train.per_device_batch_size {t.per_device_batch_size} x steps_per_generation {steps} = {batch} "
                "completions (TRL needs whole groups of num_generations completions per prompt); set "
                f"grpo.num_generations to a divisor ({', '.join(map(str, fits)) or 'none: the batch is 1'}), or raise "
                "train.per_device_batch_size or grpo.steps_per_generation to a multiple"
            )

    def model_job(self, kind: str) -> ServeConfig | EvalConfig | None:
        """The section of a job after consolidation: ``serve`` or ``eval`` (None when the config has none)."""
        return self.serve if kind == "serve" else self.eval

    def model_job_python(self, kind: str, step_python: str) -> str:
        """The interpreter that job runs its tool in: the section's ``python``, else ``step_python``, the interpreter
        of wherever the job's step runs (the image's in a container, cluster.python on the host: the job passes its
        own sys.executable, the login side slurmft.plan.container.step_python)."""
        section = self.model_job(kind)
        return (section.python if section is not None else None) or step_python

    @property
    def train_nodes(self) -> int:
        """Nodes the train step runs on: the allocation's, but for a GRPO vLLM server's (``grpo.server``)."""
        return self.resources.nodes - (self.grpo.server_nodes if self.grpo is not None else 0)

    @property
    def train_world_size(self) -> int:
        """Training ranks: ``train_nodes`` x ranks per node (the server node's GPUs are vLLM's, not ranks)."""
        return self.train_nodes * self.resources.ranks_per_node

    @property
    def method(self) -> Method:
        """sft, or the method whose section is set (dpo, grpo): slurmft/methods.py decides."""
        return method_of(self.dpo is not None, self.grpo is not None)

    @property
    def packed(self) -> bool:
        """data.packing where it applies (slurmft/methods.py ``packs``: supervised fine-tuning only)."""
        return packs(self.method, self.data.packing)

    @property
    def objective(self) -> dict[str, Any]:
        """What ``submit`` records in the run's manifest, so that the watching commands need not decide it again:
        ``{"method": sft|dpo|grpo|text, "packed": bool}`` (slurmft/methods.py)."""
        return objective(self.method, self.data.packing, not self.chat_data)

    @property
    def assistant_masks(self) -> bool:
        """data.assistant_only_loss where it applies: supervised fine-tuning of chat data (DPO and GRPO score the
        replies only; plain text has every token in the loss)."""
        return self.data.assistant_only_loss and self.method == Method.SFT and self.chat_data

    def _reconcile_precision(self) -> None:
        """train.precision and model.dtype: one derives the other; a contradiction names both fields."""
        from slurmft.precision import reconcile

        precision, dtype, problem = reconcile(self.train.precision, self.model.dtype)
        if problem:
            raise ValueError(problem)
        if self.train.optimizer == "adamw-stochastic-rounding" and precision != "bf16-true":
            raise ValueError(
                f"train.optimizer: adamw-stochastic-rounding rounds bf16 weights, but train.precision is {precision}; "
                "set train.precision=bf16-true or train.optimizer=adamw"
            )
        # not assignments: those would re-run the section validators for a value already checked
        self.train.__dict__["precision"] = precision
        self.model.__dict__["dtype"] = dtype

    @property
    def resolved_executor(self) -> Executor:
        """``auto`` resolved: slurm when sbatch is on PATH, else local."""
        if self.executor != Executor.AUTO:
            return self.executor
        from slurmft.slurm import available

        return Executor.SLURM if available("sbatch") else Executor.LOCAL


