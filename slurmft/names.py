"""Keys users bring from other tools, mapped to ours, so an unknown key gets a did-you-mean (and the
container runtimes' other names, so an unknown runtime gets one too).

People arrive with a Hugging Face ``TrainingArguments``/TRL ``SFTConfig``, an Axolotl or a
torchtune config in their head. A bare "unknown key" sends them to the reference; the same error
naming our field (and the ``train.sft:`` passthrough for TRL options we do not wrap) fixes it in
place. The table is also printed in docs/config.md (``slurmft.plan.configdoc``), so it is documented
where the fields are.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    """A foreign spelling: which tools use it, our field, and a note when the meaning differs."""

    tools: str
    ours: str
    note: str = ""


HF = "HF/TRL"
AX = "Axolotl"
TT = "torchtune"
LF = "LLaMA-Factory"

#: foreign key (the last component, as written) -> our field
ALIASES: dict[str, Alias] = {
    "per_device_train_batch_size": Alias(HF, "train.per_device_batch_size"),
    "micro_batch_size": Alias(AX, "train.per_device_batch_size"),
    "batch_size": Alias(TT, "train.per_device_batch_size"),
    "train_batch_size": Alias(HF, "train.per_device_batch_size", "ours is per rank; the global batch is printed by validate"),
    "gradient_accumulation_steps": Alias(f"{HF}, {AX}, {TT}", "train.gradient_accumulation_steps"),
    "bf16": Alias(f"{HF}, {AX}", "model.dtype", "bfloat16; auto = bfloat16 on GPU"),
    "fp16": Alias(f"{HF}, {AX}", "model.dtype", "float16"),
    "tf32": Alias(f"{HF}, {AX}", "train.sft.tf32"),
    "torch_dtype": Alias(HF, "model.dtype"),
    "dtype": Alias(TT, "model.dtype"),
    "gradient_checkpointing": Alias(f"{HF}, {AX}", "fsdp.activation_checkpointing"),
    "enable_activation_checkpointing": Alias(TT, "fsdp.activation_checkpointing"),
    "activation_checkpointing": Alias(HF, "fsdp.activation_checkpointing"),
    "lr_scheduler_type": Alias(HF, "train.lr_scheduler"),
    "lr": Alias(TT, "train.learning_rate"),
    "num_train_epochs": Alias(HF, "train.epochs"),
    "num_epochs": Alias(AX, "train.epochs"),
    "max_steps_per_epoch": Alias(TT, "train.max_steps"),
    "warmup_steps": Alias(f"{HF}, {AX}", "train.warmup_ratio",
                          "a fraction of the steps; for a step count use train.sft.warmup_steps"),
    "num_warmup_steps": Alias(TT, "train.warmup_ratio",
                              "a fraction of the steps; for a step count use train.sft.warmup_steps"),
    "sequence_len": Alias(AX, "data.max_seq_length"),
    "max_seq_len": Alias(TT, "data.max_seq_length"),
    "max_seq_length": Alias(HF, "data.max_seq_length"),
    "max_length": Alias(HF, "data.max_seq_length"),
    "sample_packing": Alias(AX, "data.packing"),
    "packed": Alias(TT, "data.packing"),
    "packing": Alias(HF, "data.packing"),
    "train_on_inputs": Alias(AX, "data.assistant_only_loss", "inverted: train_on_inputs: false = assistant_only_loss: true"),
    "assistant_only_loss": Alias(HF, "data.assistant_only_loss"),
    "datasets": Alias(AX, "data.datasets"),
    "dataset": Alias(TT, "data.datasets"),
    "type": Alias(AX, "data.datasets[].format", "alpaca, sharegpt, messages, ..."),
    "base_model": Alias(AX, "model.name_or_path"),
    "model_name_or_path": Alias(HF, "model.name_or_path"),
    "tokenizer_config": Alias(AX, "model.tokenizer"),
    "tokenizer_name": Alias(HF, "model.tokenizer"),
    "flash_attention": Alias(AX, "model.attn_implementation", "flash_attention_2"),
    "attn_implementation": Alias(HF, "model.attn_implementation"),
    "save_steps": Alias(f"{HF}, {AX}", "checkpoint.every_steps"),
    "save_total_limit": Alias(f"{HF}, {AX}", "checkpoint.keep_last"),
    "max_grad_norm": Alias(f"{HF}, {AX}", "train.max_grad_norm"),
    "clip_grad_norm": Alias(TT, "train.max_grad_norm"),
    "log_every_n_steps": Alias(TT, "train.logging_steps"),
    "logging_steps": Alias(f"{HF}, {AX}", "train.logging_steps"),
    "report_to": Alias(HF, "train.report_to"),
    "wandb_project": Alias(AX, "train.report_to", "train.report_to: [wandb] and export WANDB_PROJECT before submit"),
    "optimizer": Alias(f"{AX}, {TT}", "train.sft.optim", "TRL's optim name, e.g. adamw_torch_fused"),
    "optim": Alias(HF, "train.sft.optim"),
    "learning_rate": Alias(f"{HF}, {AX}", "train.learning_rate"),
    "weight_decay": Alias(f"{HF}, {AX}", "train.weight_decay"),
    "seed": Alias(f"{HF}, {AX}, {TT}", "train.seed"),
    "max_steps": Alias(HF, "train.max_steps"),
    "output_dir": Alias(f"{HF}, {AX}, {TT}", "output_dir", "top level"),
    "fsdp_config": Alias(f"{HF}, {AX}", "fsdp"),
    "hybrid_shard": Alias("FSDP1", "fsdp.replicate_across_nodes", "HYBRID_SHARD: true = shard per node"),
    "sharding_strategy": Alias("FSDP1, accelerate", "fsdp.replicate_across_nodes",
                               "HYBRID_SHARD = true, FULL_SHARD = false"),
    "dp_replicate_size": Alias("transformers, accelerate", "fsdp.replicate_across_nodes",
                               "true = one replica per node (resources.nodes)"),
    "num_nodes": Alias(TT, "resources.nodes"),
    "adapter": Alias(AX, "lora", "adapter: lora = a lora: section (r, alpha, dropout, target_modules)"),
    "use_peft": Alias(HF, "lora", "use_peft: true = a lora: section"),
    "peft_config": Alias(HF, "lora"),
    "peft": Alias("PEFT", "lora"),
    "use_rslora": Alias(f"PEFT, {HF}", "lora.use_rslora"),
    "peft_use_rslora": Alias(AX, "lora.use_rslora"),
    "use_dora": Alias(f"PEFT, {HF}", "lora.use_dora", "refused: DoRA is not supported (docs/lora.md)"),
    "peft_use_dora": Alias(AX, "lora.use_dora", "refused: DoRA is not supported (docs/lora.md)"),
    "lora_r": Alias(f"{HF}, {AX}", "lora.r"),
    "lora_rank": Alias(TT, "lora.r"),
    "rank": Alias(TT, "lora.r"),
    "lora_alpha": Alias(f"{HF}, {AX}, {TT}", "lora.alpha"),
    "lora_dropout": Alias(f"{HF}, {AX}, {TT}", "lora.dropout"),
    "lora_target_modules": Alias(f"{HF}, {AX}", "lora.target_modules"),
    "lora_target_linear": Alias(AX, "lora.target_modules", "true = target_modules: all-linear"),
    "lora_attn_modules": Alias(TT, "lora.target_modules", "e.g. [q_proj, v_proj]"),
    "apply_lora_to_mlp": Alias(TT, "lora.target_modules", "all-linear covers the MLP"),
    "lora_modules_to_save": Alias(f"{HF}, {AX}", "lora.modules_to_save"),
    "merge_lora": Alias(AX, "consolidate.merge"),
    "nproc_per_node": Alias(TT, "resources.gpus_per_node"),
    "rl": Alias(AX, "dpo", "rl: dpo = a dpo: section (beta, loss_type, reference)"),
    "rl_beta": Alias(AX, "dpo.beta"),
    "dpo_beta": Alias(AX, "dpo.beta"),
    "dpo_label_smoothing": Alias(AX, "dpo.label_smoothing"),
    "dpo_loss_type": Alias(AX, "dpo.loss_type"),
    "stage": Alias(LF, "dpo", "stage: dpo = a dpo: section; stage: sft = no dpo: section"),
    "pref_beta": Alias(LF, "dpo.beta"),
    "pref_loss": Alias(LF, "dpo.loss_type", "sigmoid = DPO; orpo/simpo are not DPO loss types"),
    "pref_ftx": Alias(LF, "dpo.loss_type", "a weighted SFT term: loss_type: [sigmoid, sft]"),
    "rlhf_type": Alias("ms-swift", "dpo", "rlhf_type: dpo = a dpo: section"),
    "rpo_alpha": Alias(HF, "dpo.loss_type", "an SFT term: loss_type: [sigmoid, sft]"),
    "precompute_ref_log_probs": Alias(HF, "dpo.reference", "true = reference: precomputed"),
    "ref_model": Alias(HF, "dpo.reference", "copy (the starting model), precomputed, or auto"),
    "beta": Alias(HF, "dpo.beta"),
    "label_smoothing": Alias(HF, "dpo.label_smoothing"),
    "loss_type": Alias(HF, "dpo.loss_type"),
}


#: A container runtime by the name of its program or its former name -> ours (cluster.container.runtime).
RUNTIME_ALIASES = {"enroot": "pyxis", "singularity": "apptainer", "ch-run": "charliecloud", "podman-hpc": "podman"}


def suggest(key: str, section: str, valid_here: list[str], all_fields: list[str]) -> str:
    """A did-you-mean for ``key`` found in ``section`` ("" for the top level): our field, or nothing.

    The alias table wins (its field may live in another section); else the closest key of this section;
    else the closest field anywhere (``train.max_seq_length`` -> ``data.max_seq_length``).
    """
    here = f"{section}.{key}" if section else key
    alias = ALIASES.get(key)
    if alias and alias.ours != here:
        note = f" ({alias.note})" if alias.note else ""
        return f"did you mean {alias.ours}?{note} [{alias.tools} spelling]"
    close = difflib.get_close_matches(key, valid_here, n=1, cutoff=0.7)
    if close:
        return f"did you mean {(section + '.') if section else ''}{close[0]}?"
    leaves = {f.rsplit(".", 1)[-1]: f for f in all_fields}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.8)
    if close and leaves[close[0]] != here:
        return f"did you mean {leaves[close[0]]}?"
    return ""


def alias_table() -> list[str]:
    """The alias table as Markdown rows (for docs/config.md)."""
    rows = ["| their key | used by | ours | note |", "|---|---|---|---|"]
    for key, alias in sorted(ALIASES.items()):
        rows.append(f"| `{key}` | {alias.tools} | `{alias.ours}` | {alias.note} |")
    return rows
