"""A LoRA checkpoint read against PEFT's own model of it, and its adapter written as PEFT writes one.

A LoRA run's checkpoint (a ``lora`` entry in its COMPLETE marker) holds only the trainable tensors
(``lora_A``/``lora_B`` in float32, and the full ``modules_to_save`` copies). They are matched against PEFT's
own model of them: the job's adapters (slurmft/job/adapters.py, the marker's resolved target modules) added to
a meta-device model, and ``get_peft_model_state_dict`` names each tensor; so names and layer kinds are PEFT's,
not a copy of its rules, and a checkpoint the run's ``lora`` section does not rebuild is refused.

The adapter is written to ``RUN_DIR/adapter/`` (``<out>-adapter`` with ``--out``): ``adapter_config.json`` and
``adapter_model.safetensors`` exactly as ``PeftModel.save_pretrained`` writes them, streamed from the
checkpoint in the dtype they trained in (float32: the adapter is a few MB, and PEFT computes in fp32 on a
half-precision base anyway), plus the tokenizer. The same reading records how each adapted base weight changes
(:class:`LoraDelta`) for the merge (merge.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from slurmft.checkpoints import COMPLETE_MARKER, peft_name, read_marker, strip_wrappers
from slurmft.config import RunConfig
from slurmft.errors import CheckpointError
from slurmft.job.consolidate.checkpoint import DCP_CONTAINER
from slurmft.job.consolidate.model_files import verify_tokenizer, write_tokenizer
from slurmft.job.consolidate.plan import ShardPlan, TensorPlan
from slurmft.job.consolidate.read_dcp import TensorSource
from slurmft.job.consolidate.shards import verify_output, write_shard
from slurmft.rundir import ADAPTER_WEIGHTS

ADAPTER_NAME = "default"  # PEFT's name of the one adapter the job trains (dropped from the saved names)


@dataclass(frozen=True)
class LoraDelta:
    """How one base weight changes in the merge: ``W + scaling * (B @ A)`` (``B @ A`` transposed for an
    embedding and a ``fan_in_fan_out`` layer, as PEFT's ``get_delta_weight``)."""

    a: str  # DCP key of lora_A (lora_embedding_A)
    b: str  # DCP key of lora_B (lora_embedding_B)
    scaling: float  # PEFT's layer scaling: alpha / r (alpha / sqrt(r) with use_rslora)
    transpose: bool


@dataclass(frozen=True)
class LoraLayout:
    """A LoRA checkpoint read against PEFT's own model of it: the job's adapters added to a meta-device
    model (slurmft/job/adapters.py), so names and layer kinds are PEFT's, not a copy of its rules."""

    config: Any  # peft's LoraConfig as ``save_pretrained`` writes it (adapter_config.json)
    adapter: list[TensorPlan]  # name = PEFT's saved name (``get_peft_model_state_dict``), key = the DCP key
    deltas: dict[str, LoraDelta]  # model tensor name -> its update
    replaced: dict[str, str]  # model tensor name -> DCP key of its trained ``modules_to_save`` copy
    unmergeable: list[str]  # why the merge cannot be done (adapters on layers it does not handle)

    @property
    def file(self) -> ShardPlan:
        """``adapter_model.safetensors``: every adapter tensor, in one file."""
        return ShardPlan(ADAPTER_WEIGHTS, self.adapter)


def lora_of(ckpt: Path) -> dict[str, Any] | None:
    """The ``lora`` entry of a checkpoint's COMPLETE marker; None for a full fine-tuning checkpoint."""
    lora = read_marker(ckpt).get("lora")
    return lora if isinstance(lora, dict) else None


def lora_layout(config: Any, cfg: RunConfig, lora: dict[str, Any], metadata: Metadata, ckpt: Path) -> LoraLayout:
    """Every adapter tensor of the checkpoint matched onto PEFT's model of the marker's ``lora`` entry (the
    resolved target modules), with the name PEFT saves it under; a mismatch is one CheckpointError."""
    from peft.tuners.lora import Embedding as LoraEmbedding
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper, get_peft_model_state_dict
    from pydantic import ValidationError
    from transformers import AutoModelForCausalLM

    from slurmft.config import LoraConfig
    from slurmft.job.adapters import add_adapters

    # The run's own lora section, as the job used it (all-linear resolved by PEFT on this model), else the
    # marker's record of it; either way the rebuilt adapters must be the ones the marker describes.
    section = cfg.lora
    if section is None:
        try:
            section = LoraConfig(r=lora["r"], alpha=lora["alpha"], dropout=lora.get("dropout", 0.0),
                                 use_rslora=bool(lora.get("use_rslora", False)),
                                 target_modules=list(lora["target_modules"]),
                                 modules_to_save=list(lora.get("modules_to_save") or []))
        except (KeyError, TypeError, ValidationError) as exc:
            raise CheckpointError(f"the lora entry of {ckpt / COMPLETE_MARKER} is not readable: {exc}") from None
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    peft_model, summary = add_adapters(base, section)
    rebuilt = summary.marker()
    differ = [f"{k}: {lora.get(k)!r} in the checkpoint, {rebuilt[k]!r} rebuilt from the run's lora section"
              for k in rebuilt if k in lora and lora[k] != rebuilt[k]]
    if differ:
        raise CheckpointError(f"the run's lora section does not rebuild the adapters {ckpt.name} was trained with "
                              "(was config.yaml edited?)", differ)

    index: dict[str, str] = {}  # PeftModel state-dict name -> DCP key
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(DCP_CONTAINER + ".") and isinstance(md, TensorStorageMetadata):
            index[peft_name(key[len(DCP_CONTAINER) + 1 :])] = key
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    problems = []
    unknown, missing = sorted(set(index) - set(trainable)), sorted(set(trainable) - set(index))
    if unknown:
        problems.append(f"{len(unknown)} checkpoint tensor(s) are not adapters of this LoRA configuration: "
                        + ", ".join(index[n] for n in unknown[:8]) + (" ..." if len(unknown) > 8 else ""))
    if missing:
        problems.append(f"{len(missing)} adapter tensor(s) are not in the checkpoint: "
                        + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
    for name in sorted(set(index) & set(trainable)):
        size = tuple(metadata.state_dict_metadata[index[name]].size)  # type: ignore[union-attr]
        if size != tuple(trainable[name].shape):
            problems.append(f"{index[name]}: shape {size} in the checkpoint, {tuple(trainable[name].shape)} in the adapters")
    if problems:
        raise CheckpointError(
            f"the checkpoint does not match its LoRA adapters (the lora entry of its {COMPLETE_MARKER} marker on the "
            "architecture of model.name_or_path)", problems)

    # PEFT's own naming: what PeftModel.save_pretrained writes, tensor by tensor (its values are ours, unchanged).
    by_id = {id(p): n for n, p in trainable.items()}
    saved = get_peft_model_state_dict(peft_model, state_dict=dict(trainable), save_embedding_layers=False)
    if sorted(by_id.get(id(v), "?") for v in saved.values()) != sorted(trainable):  # our bug, not the user's
        raise RuntimeError(f"PEFT saves {len(saved)} tensors, the checkpoint has {len(trainable)} adapter tensors")
    adapter = []
    for saved_name, value in saved.items():
        key = index[by_id[id(value)]]
        md = metadata.state_dict_metadata[key]
        dtype = md.properties.dtype  # type: ignore[union-attr]
        adapter.append(TensorPlan(saved_name, key, tuple(md.size), dtype, dtype))  # type: ignore[union-attr]

    deltas: dict[str, LoraDelta] = {}
    replaced: dict[str, str] = {}
    other: dict[str, list[str]] = {}  # LoRA layer kind the merge does not handle -> module names
    for name, module in peft_model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            for p, _ in module.modules_to_save[ADAPTER_NAME].named_parameters():
                replaced[strip_wrappers(f"{name}.{p}")] = index[f"{name}.modules_to_save.{ADAPTER_NAME}.{p}"]
        elif isinstance(module, LoraLinear) and ADAPTER_NAME in module.lora_A:
            deltas[strip_wrappers(name) + ".weight"] = LoraDelta(
                index[f"{name}.lora_A.{ADAPTER_NAME}.weight"], index[f"{name}.lora_B.{ADAPTER_NAME}.weight"],
                float(module.scaling[ADAPTER_NAME]), bool(module.fan_in_fan_out))
        elif isinstance(module, LoraEmbedding) and ADAPTER_NAME in module.lora_embedding_A:
            deltas[strip_wrappers(name) + ".weight"] = LoraDelta(
                index[f"{name}.lora_embedding_A.{ADAPTER_NAME}"], index[f"{name}.lora_embedding_B.{ADAPTER_NAME}"],
                float(module.scaling[ADAPTER_NAME]), True)
        elif isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
            other.setdefault(type(module).__name__, []).append(strip_wrappers(name))
    unmergeable = [f"{len(names)} LoRA {kind} layer(s), e.g. {', '.join(dict.fromkeys(names[:2]))}: the merge "
                   "handles LoRA on linear and embedding layers only (a ParamWrapper adapts a parameter, such as "
                   "fused mixture-of-experts tensors or a router); set consolidate.merge: false to write the "
                   "adapter only" for kind, names in other.items()]

    peft_config = copy.deepcopy(peft_model.peft_config[ADAPTER_NAME])
    peft_config.base_model_name_or_path = cfg.model.name_or_path
    peft_config.revision = cfg.model.revision
    peft_config.inference_mode = True  # as PeftModel.save_pretrained writes it
    return LoraLayout(peft_config, adapter, deltas, replaced, unmergeable)


def write_adapter(
    reader: FileSystemReader, lora: LoraLayout, directory: Path, tokenizer: str, cfg: RunConfig,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` writes them,
    plus the tokenizer; the tensors are streamed from the checkpoint in the dtype they trained in. Returns
    the tokenizer files."""
    shard = lora.file
    write_shard(TensorSource(reader, lora.adapter, None), shard, directory / ADAPTER_WEIGHTS,
                max(t.source_nbytes for t in lora.adapter), progress)
    verify_output(directory, [shard], {t.name: t.shape for t in lora.adapter})
    lora.config.save_pretrained(str(directory))
    tokenizer_files = write_tokenizer(tokenizer, directory, cfg)
    verify_tokenizer(directory, cfg, tokenizer_files)
    return tokenizer_files


def adapter_scalings(lora: LoraLayout) -> str:
    """``2`` (alpha / r), or ``{0.5, 2}`` if layers differ."""
    values = sorted({d.scaling for d in lora.deltas.values()})
    return f"{values[0]:g}" if len(values) == 1 else "{" + ", ".join(f"{v:g}" for v in values) + "}"
