"""What a run produced, read from its run directory: the consolidated model, a LoRA run's adapter, which of the two
is the run's result, and what its adapters are, in words.

Consolidation writes the model's index last and the adapter's config last, so their presence says the export
finished. The LoRA description comes from what the job built (the newest COMPLETE marker, ``fsdp_report``) and, before
either exists, from the config's ``lora`` section as raw YAML: nothing here imports the schema or torch, as in
:mod:`slurmft.watch.progress`, whose overview, ``runs``, sweeps and the report read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from slurmft.checkpoints import latest_complete, read_marker
from slurmft.lora import lora_scaling
from slurmft.rundir import ADAPTER_CONFIG, RunPaths
from slurmft.rundir import MODEL_INDEX as SAFE_INDEX_NAME  # what consolidation writes last


def model_info(paths: RunPaths) -> str | None:
    """Path of the consolidated model once consolidation finished (its index is written last), else None."""
    return str(paths.model) if (paths.model / SAFE_INDEX_NAME).is_file() else None


def adapter_info(paths: RunPaths) -> str | None:
    """Path of a LoRA run's consolidated adapter once it is written (its config), else None."""
    return str(paths.adapter) if (paths.adapter / ADAPTER_CONFIG).is_file() else None


def result_info(paths: RunPaths) -> str | None:
    """Path of the run's result once consolidation wrote it: the model, or, for a LoRA run with consolidate.merge
    false (no model is written), the adapter; else None. What makes a run done (runs) and a sweep point's `best`."""
    model = model_info(paths)
    if model is None and merge_setting(paths) is False:
        return adapter_info(paths)
    return model


def result_lines(run_dir: str | os.PathLike[str]) -> list[str]:
    """:func:`model_lines` of the run directory as it is now, each result with how to load it (what a local submit
    or resume prints at its end)."""
    paths = RunPaths.of(run_dir)
    adapter, model = adapter_info(paths), model_info(paths)
    how = {f"adapter: {adapter}": "  (PeftModel.from_pretrained(base, adapter) loads it)",
           f"model: {model}": "  (AutoModelForCausalLM.from_pretrained loads it)"}
    return [line + how.get(line, "") for line in model_lines(adapter, model, merge_setting(paths))]


def model_lines(adapter: str | None, model: str | None, merge: bool | None) -> list[str]:
    """Where the run's result is: its adapter (a LoRA run) and its model, or why there is no model (``merge``:
    consolidate.merge; false writes the adapter alone)."""
    lines = [f"adapter: {adapter}"] if adapter else []
    if model:
        return [*lines, f"model: {model}"]
    return [*lines, "model: not written (consolidate.merge is false: the adapter is the result)"
            if adapter and merge is False else "model: not consolidated yet"]


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lora_info(paths: RunPaths) -> dict[str, Any] | None:
    """What the run's adapters are, or None for a full fine-tune.

    The newest complete checkpoint's COMPLETE marker and ``fsdp_report/rank0.json`` carry what the job built
    (resolved target names, trainable and total parameters); before either exists, the config's ``lora``
    section says what was asked (``source: config``, no counts). Raw YAML on purpose, as :func:`max_steps_of`.
    """
    ckpt = latest_complete(paths.checkpoints)
    for source, record in (("checkpoint", read_marker(ckpt) if ckpt else {}),
                           ("fsdp_report", _json(paths.fsdp_report / "rank0.json"))):
        lora = record.get("lora")
        if isinstance(lora, dict):
            return {**lora, "source": source}
    try:
        lora = (yaml.safe_load(paths.config.read_text()) or {}).get("lora")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if not isinstance(lora, dict):
        return None
    asked = {"r": lora.get("r", 16), "alpha": lora.get("alpha", 32.0), "dropout": lora.get("dropout", 0.0),
             "target_modules": lora.get("target_modules", "all-linear"),
             "modules_to_save": lora.get("modules_to_save") or [], "source": "config"}
    return {**asked, "use_rslora": True} if lora.get("use_rslora") else asked


def merge_setting(paths: RunPaths) -> bool | None:
    """``consolidate.merge`` of the run's config (raw YAML, as :func:`lora_info`); None when unreadable."""
    try:
        section = (yaml.safe_load(paths.config.read_text()) or {}).get("consolidate") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    value = section.get("merge", True) if isinstance(section, dict) else True
    return value if isinstance(value, bool) else None


def lora_words(info: dict[str, Any] | None) -> str:
    """One line: ``LoRA r=16, alpha=32 (scaling 2), dropout 0 on q_proj, v_proj: 4.2M of 6.74B parameters train
    (0.06 %)``, or ``full fine-tuning (every weight trains)``."""
    if not info:
        return "full fine-tuning (every weight trains)"
    r, alpha = info.get("r"), info.get("alpha")
    targets = info.get("target_modules")
    targets = ", ".join(map(str, targets)) if isinstance(targets, list) else str(targets)
    rslora = bool(info.get("use_rslora"))
    scaling = (f" ({'rsLoRA, ' if rslora else ''}scaling {lora_scaling(alpha, r, rslora):g})"
               if isinstance(r, int) and r and isinstance(alpha, (int, float)) else "")
    out = f"LoRA r={r}, alpha={alpha:g}{scaling}" if isinstance(alpha, (int, float)) else f"LoRA r={r}, alpha={alpha}"
    out += f", dropout {info.get('dropout', 0):g} on {targets}" if isinstance(info.get("dropout", 0), (int, float)) \
        else f" on {targets}"
    if info.get("modules_to_save"):
        out += f", full copies of {', '.join(map(str, info['modules_to_save']))}"
    trainable, total = info.get("trainable_params"), info.get("total_params")
    if isinstance(trainable, int) and isinstance(total, int) and total:
        out += f": {_count(trainable)} of {_count(total)} parameters train ({100 * trainable / total:.2f} %)"
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"
