"""The adapters' part of a checkpoint: a LoRA run saves and loads its trainable tensors only, every rank its shard.

What transformers 5.24 does with a PEFT model: its ``_save_checkpoint`` and ``_load_from_checkpoint`` ask
accelerate's ``save_fsdp_model``/``load_fsdp_model`` for the ``adapter_only`` path. Why that is not enough: with
accelerate 1.15 and our FSDP2-sharded, checkpoint-wrapped PeftModel it wrote a DCP checkpoint of no tensors at all
(measured: ``.metadata`` of 381 bytes, ``__0_0.distcp`` empty), and its load is non-strict, so a resume would have
silently kept the adapters' initial values (accelerate#4206 was a rank-0-only variant of the same loss).

What we do: :func:`own_adapter_checkpoints` puts :func:`save_adapter_model`/:func:`load_adapter_model` in the
Trainer's place for an adapter model (a full model keeps accelerate's): torch's own state-dict API with
``ignore_frozen_params`` gives the trainable DTensors, DCP writes every rank's shard of each and reads them back
strictly, into ``pytorch_model_fsdp_0/`` as for a full model (slurmft/checkpoints.py). Nothing of the frozen base
is written or read; tests/job/adapter_survival.py proves every rank's shard survives a save and a load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurmft import checkpoints
from slurmft.checkpoints import MODEL_DIR


def _trainable_state(model: Any) -> dict[str, Any]:
    """The trainable parameters' sharded state dict (DTensors; torch's names, wrapper segments removed).

    Only adapter tensors (``checkpoints.is_adapter_name``): torch keeps a tied head (``lm_head.weight``, the
    frozen embedding under another name) even with ``ignore_frozen_params``, which would put the whole
    embedding into every adapter checkpoint.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {name: value for name, value in state.items() if checkpoints.is_adapter_name(name)}


def save_adapter_model(model: Any, directory: Path) -> int:
    """Write only the trainable parameters (adapters, ``modules_to_save`` copies) of every rank, with DCP.

    Every rank writes its own shard of every tensor (``dcp.save`` of the DTensors), so no part of an
    adapter depends on rank 0. Returns the number of tensors.
    """
    import torch.distributed.checkpoint as dcp

    state = _trainable_state(model)
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(directory)))
    return len(state)


def load_adapter_model(model: Any, directory: Path) -> None:
    """Read the trainable parameters back into this rank's shards; every one must be in the checkpoint
    (DCP's load plan fails on a missing key, on every rank), nothing of the frozen base is read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = _trainable_state(model)
    dcp.load({"model": state}, storage_reader=dcp.FileSystemReader(str(directory)))
    set_model_state_dict(model, state, options=StateDictOptions(ignore_frozen_params=True, strict=False))


def _is_adapter_model(model: Any) -> bool:
    return any(not p.requires_grad for p in model.parameters()) and any(p.requires_grad for p in model.parameters())


def own_adapter_checkpoints() -> None:
    """The Trainer saves and loads an adapter model's part of a checkpoint with :func:`save_adapter_model` /
    :func:`load_adapter_model`; a full model keeps accelerate's ``save_fsdp_model``/``load_fsdp_model`` (see the
    module for why). Once per process: the names are replaced in ``transformers.trainer``."""
    import transformers.trainer as trainer_module

    if getattr(trainer_module.save_fsdp_model, "slurmft_adapters", False):
        return
    save_full, load_full = trainer_module.save_fsdp_model, trainer_module.load_fsdp_model

    def save_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: str, *args: Any,
                        **kwargs: Any) -> Any:
        if not _is_adapter_model(model):
            return save_full(fsdp_plugin, accelerator, model, output_dir, *args, **kwargs)
        return save_adapter_model(model, Path(output_dir) / MODEL_DIR)

    def load_fsdp_model(fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: str, *args: Any,
                        **kwargs: Any) -> Any:
        if not _is_adapter_model(model):
            return load_full(fsdp_plugin, accelerator, model, input_dir, *args, **kwargs)
        return load_adapter_model(model, Path(input_dir) / MODEL_DIR)

    save_fsdp_model.slurmft_adapters = True  # type: ignore[attr-defined]
    trainer_module.save_fsdp_model, trainer_module.load_fsdp_model = save_fsdp_model, load_fsdp_model
