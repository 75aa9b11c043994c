"""The ``train.sft`` and ``train.report_to`` rules, applied the same way by ``validate`` and by the job.

``validate`` checks ``train.sft`` against TRL's ``SFTConfig`` without importing TRL (a child process
lists its fields once per TRL/transformers version, cached); the job checks the same keys again with
TRL imported, because a hub-only setup or a different job Python may differ from the login node. Both
must refuse the same keys with the same words, so the rules live here, in a module with no slurmft
imports that either side can load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import typing
from typing import Any

from slurmft.modelinfo import cache_dir

# SFTConfig keys slurmft sets itself: the run.yaml field to use instead (or why it is fixed).
OWNED_SFT_KEYS = {
    "output_dir": "the run directory's checkpoints/ (output_dir)",
    "overwrite_output_dir": "the run directory's checkpoints/",
    "save_strategy": "checkpoint.every_steps",
    "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep_last",
    "save_only_model": "full checkpoints are needed to resume",
    "resume_from_checkpoint": "automatic: the newest COMPLETE checkpoint",
    "fsdp": "the fsdp: section",
    "fsdp_config": "the fsdp: section",
    "gradient_checkpointing": "fsdp.activation_checkpointing",
    "activation_checkpointing": "fsdp.activation_checkpointing",
    "max_steps": "train.max_steps",
    "num_train_epochs": "train.epochs",
    "per_device_train_batch_size": "train.per_device_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "learning_rate": "train.learning_rate",
    "lr_scheduler_type": "train.lr_scheduler",
    "warmup_ratio": "train.warmup_ratio",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm",
    "seed": "train.seed",
    "logging_steps": "train.logging_steps",
    "report_to": "train.report_to",
    "max_length": "data.max_seq_length",
    "max_seq_length": "data.max_seq_length",
    "packing": "data.packing",
    "assistant_only_loss": "data.assistant_only_loss",
    "dataset_num_proc": "data.num_proc",
    "bf16": "model.dtype (the compute dtype; auto = bf16 on GPU)",
    "fp16": "model.dtype (the compute dtype; auto = bf16 on GPU)",
    "use_cpu": "the device (CPU only when there is no GPU)",
    "ddp_backend": "the device (NCCL on GPU, gloo on CPU)",
    "accelerator_config": "train.gradient_accumulation_steps (slurmft sets sync_each_batch: gradients stay sharded)",
}
#: train.report_to name -> packages that provide it (any one)
REPORTERS = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "none": ()}


def _kinds(tp: Any) -> list[str]:
    """A declared type as simple kinds: bool, int, float, str, list, dict, none, any."""
    import enum
    import types

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return sorted({k for arg in typing.get_args(tp) for k in _kinds(arg)})
    if origin is typing.Literal:
        return sorted({type(a).__name__ if a is not None else "none" for a in typing.get_args(tp)})
    if tp is type(None):
        return ["none"]
    if origin in (list, tuple, set) or tp in (list, tuple, set):
        return ["list"]
    if origin is dict or tp is dict:
        return ["dict"]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return ["str"]
    if tp in (bool, int, float, str):
        return [tp.__name__]
    return ["any"]


def field_kinds_of(config_cls: Any) -> dict[str, list[str]]:
    """Init fields of a dataclass (SFTConfig) -> the kinds of value each accepts."""
    import dataclasses

    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: accept anything there
        hints = {}
    return {f.name: _kinds(hints.get(f.name, Any)) for f in dataclasses.fields(config_cls) if f.init}


def sft_field_kinds() -> tuple[dict[str, list[str]] | None, str]:
    """SFTConfig's fields and kinds, and TRL's version; (None, why) when TRL is not installed here.

    In a process that already imported TRL (the job) they come from it directly; elsewhere from a
    child process (importing TRL imports torch, which the login side never does), cached per
    TRL and transformers version so that only the first ``validate`` pays the ~5 s.
    """
    from importlib.metadata import PackageNotFoundError, version

    if "trl" in sys.modules:
        from trl import SFTConfig

        return field_kinds_of(SFTConfig), version("trl")
    try:
        trl_v, tf_v = version("trl"), version("transformers")
    except PackageNotFoundError:
        return None, "trl is not installed here"
    if importlib.util.find_spec("trl") is None:
        return None, "trl is not installed here"
    cache = cache_dir() / f"sftconfig-trl{trl_v}-transformers{tf_v}.json"
    if cache.is_file():
        try:
            return json.loads(cache.read_text()), trl_v
        except ValueError:
            pass
    code = ("import json; from trl import SFTConfig; from slurmft.sftopts import field_kinds_of; "
            "print(json.dumps(field_kinds_of(SFTConfig)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"importing trl failed here ({last})"
    kinds = json.loads(proc.stdout)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kinds))
        tmp.replace(cache)
    except OSError:
        pass  # no cache: the next validate asks again
    return kinds, trl_v


def coerce(value: Any, kinds: list[str]) -> tuple[bool, Any]:
    """(ok, value converted to a declared kind): YAML strings like '1e-8' become the number SFTConfig wants."""
    if "any" in kinds or value is None:
        return True, value
    if isinstance(value, bool):
        return ("bool" in kinds), value
    if isinstance(value, int) and not isinstance(value, bool):
        if "int" in kinds:
            return True, value
        if "float" in kinds:
            return True, float(value)
        return ("str" in kinds), (str(value) if "str" in kinds else value)
    if isinstance(value, float):
        if "float" in kinds:
            return True, value
        if "int" in kinds and value.is_integer():
            return True, int(value)
        return ("str" in kinds), (str(value) if "str" in kinds else value)
    if isinstance(value, str):
        if "str" in kinds:
            return True, value
        text = value.strip()
        if "int" in kinds and re.fullmatch(r"[-+]?\d+", text):
            return True, int(text)
        if "float" in kinds:
            try:
                return True, float(text)
            except ValueError:
                pass
        if "bool" in kinds and text.lower() in ("true", "false"):
            return True, text.lower() == "true"
        return False, value
    if isinstance(value, list):
        return ("list" in kinds), value
    if isinstance(value, dict):
        return ("dict" in kinds), value
    return True, value


def sft_problems(sft: dict[str, Any], kinds: dict[str, list[str]] | None, trl_version: str = "") -> tuple[
        list[str], dict[str, Any]]:
    """Problems with ``train.sft`` and the values coerced to SFTConfig's types (shared with the job)."""
    import difflib

    problems, out = [], dict(sft)
    for key, value in sft.items():
        if key in OWNED_SFT_KEYS:
            problems.append(f"train.sft.{key}: set by slurmft; use {OWNED_SFT_KEYS[key]}")
            continue
        if kinds is None:
            continue
        if key not in kinds:
            close = difflib.get_close_matches(key, list(kinds), n=1, cutoff=0.75)
            hint = f"; did you mean train.sft.{close[0]}?" if close else ""
            problems.append(f"train.sft.{key}: not an option of TRL {trl_version} SFTConfig{hint}")
            continue
        ok, coerced = coerce(value, kinds[key])
        if not ok:
            want = " or ".join(k for k in kinds[key] if k != "none") or "null"
            problems.append(f"train.sft.{key}: expects {want}, got {value!r} ({type(value).__name__})")
            continue
        out[key] = coerced
    return problems, out
