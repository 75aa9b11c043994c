"""What a run trains by, decided once: its method (sft, dpo, grpo; ``text`` for sft on plain text alone: continued
pretraining) and whether its data is packed. Torch-free and schema-free.

The schema answers from a validated config (``RunConfig.method``, ``packed``, ``objective``: all through
:func:`method_of`, :func:`packs` and :func:`objective`), and ``submit`` records the answer in each run's manifest (``objective``,
every point of a sweep too). The watching commands never build the schema (tests/test_lazy_imports.py), so they read
that record (:func:`recorded_objective`) instead of deciding again from config.yaml: a second copy of the rule
drifted from the first once already. A manifest written before the record was kept is the one case that decides
from config.yaml's raw mapping, through the same functions.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class Method(str, Enum):
    """What the train job optimises: the section that selects it (none = sft)."""

    SFT = "sft"
    DPO = "dpo"
    GRPO = "grpo"


#: the recorded method of an sft run whose every source is plain text (continued pretraining, every token in the loss)
TEXT = "text"


def method_of(dpo: bool, grpo: bool) -> Method:
    """sft, or the method whose section is set (a config with both is refused by the schema)."""
    return Method.DPO if dpo else Method.GRPO if grpo else Method.SFT


def packs(method: Method, packing: bool) -> bool:
    """data.packing where it applies: supervised fine-tuning. DPO trains on each pair, GRPO on each prompt and its
    completions, padded, never packed."""
    return packing and method == Method.SFT


def epoch_rows(method: Method, packing: bool) -> str:
    """What one row of the prepared data (its count: an epoch) is: a DPO pair is one row scored as two sequences,
    a GRPO prompt one row completed at every generation; only SFT's rows are (packed) sequences."""
    if method == Method.DPO:
        return "preference pairs"
    if method == Method.GRPO:
        return "prompts"
    return "packed sequences" if packs(method, packing) else "sequences"


def objective(method: Method, packing: bool, text_only: bool) -> dict[str, Any]:
    """The manifest's record: ``{"method": sft|dpo|grpo|text, "packed": bool}`` (``text_only``: every data source
    is plain text; ``packing``: data.packing)."""
    return {"method": TEXT if method == Method.SFT and text_only else method.value, "packed": packs(method, packing)}


def recorded_objective(manifest: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The run's objective as its submit recorded it in ``manifest``; for a manifest written before that record
    (slurmft before 2026-12-06), decided from ``config`` (config.yaml's raw mapping: the resolved config, every key
    there) by the same rule."""
    record = manifest.get("objective")
    if isinstance(record, dict) and isinstance(record.get("method"), str):
        return record
    from slurmft.sourcefiles import is_text

    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    sources = [d for d in data.get("datasets") or [] if isinstance(d, dict) and isinstance(d.get("path"), str)]
    text_only = bool(sources) and all(is_text(d["path"], str(d.get("format", "auto"))) for d in sources)
    method = method_of(isinstance(config.get("dpo"), dict), isinstance(config.get("grpo"), dict))
    return objective(method, data.get("packing") is True, text_only)
