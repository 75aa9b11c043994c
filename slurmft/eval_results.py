"""The evaluation's scores, read on the login side: RUN_DIR/eval/summary.json into rows for ``status``, the
report and ``runs``.

The evaluation job (slurmft.job.evaluate) writes the summary; this module only reads it, with the standard
library (no torch, transformers or lm_eval: the login side never imports them). A missing or torn summary
reads as None, never an error: the report of a run that has not been evaluated still renders.

- :func:`read_summary`: the summary, or None;
- :func:`score_rows`: ``(task, metric, base, finetuned)`` per task and metric, metric names as lm-eval writes
  them (``acc,none``), the base None without ``eval.compare_base``;
- :func:`headline_score`: one number for the ``runs`` table: the first task's main metric;
- :func:`named_cell` / :func:`named_score`: a sweep's ranking metric, with the base's value beside it;
- :func:`beats`: whether one score is better than another under a mode (``max``/``min``), the one home of that
  question: a sweep's ranking, its best point against the base model, and a run's scores against its base;
- :func:`metric_mode`: a metric's direction as lm-eval declares it (the summary's ``higher_is_better``), for a run
  alone, which has no ``sweep.select.mode``;
- :func:`base_words`: ``beats the base model by +0.0200`` / ``does not beat the base model (-0.0200)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: The summary's place in a run directory.
SUMMARY = Path("eval") / "summary.json"
#: The metrics a headline prefers, in order (lm-eval's names before the ``,filter``); then the first other one.
HEADLINE_METRICS = ("acc_norm", "acc", "exact_match")


def read_summary(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """RUN_DIR/eval/summary.json, or None when there is none (not evaluated yet) or it cannot be read."""
    try:
        data = json.loads((Path(run_dir) / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("tasks"), dict) else None


def _value(cell: Any, which: str) -> float | None:  # noqa: ANN401 - one JSON value
    value = cell.get(which) if isinstance(cell, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _is_stderr(metric: str) -> bool:
    return metric.split(",", 1)[0].endswith("_stderr")


def score_rows(summary: dict[str, Any]) -> list[tuple[str, str, float | None, float | None]]:
    """``(task, metric, base, finetuned)`` rows in the summary's order (stderr entries left out)."""
    rows: list[tuple[str, str, float | None, float | None]] = []
    for task, metrics in summary.get("tasks", {}).items():
        if not isinstance(metrics, dict):
            continue
        for metric, cell in metrics.items():
            if not _is_stderr(metric):
                rows.append((task, metric, _value(cell, "base"), _value(cell, "finetuned")))
    return rows


def metric_label(metric: str) -> str:
    """``acc,none`` -> ``acc``; a filtered metric keeps its filter (``exact_match,strict-match``)."""
    name, _, filt = metric.partition(",")
    return name if filt in ("", "none") else metric


def _headline(summary: dict[str, Any]) -> tuple[str, str, float | None, float] | None:
    """``(task, metric, base, fine-tuned)`` of the first task's main metric: its acc_norm, acc or exact_match (the
    first filter of each), else its first metric; None when the summary has no fine-tuned score."""
    rows = [(t, m, b, ft) for t, m, b, ft in score_rows(summary) if ft is not None]
    if not rows:
        return None
    first = rows[0][0]
    candidates = [row for row in rows if row[0] == first]
    for preferred in HEADLINE_METRICS:
        for row in candidates:
            if row[1].split(",", 1)[0] == preferred:
                return row
    return candidates[0]


def headline_score(summary: dict[str, Any]) -> tuple[str, float] | None:
    """``("<task> <metric>", fine-tuned value)`` of the first task: its acc_norm, acc or exact_match (the first
    filter of each), else its first metric; None when the summary has no fine-tuned score."""
    head = _headline(summary)
    return (f"{head[0]} {metric_label(head[1])}", head[3]) if head else None


def named_cell(summary: dict[str, Any], metric: str) -> tuple[str, float | None, float | None] | None:
    """``("<task> <metric>", base, fine-tuned)`` of a sweep's ranking metric (slurmft.config_sweep.SweepSelect):
    ``eval`` is :func:`headline_score`'s; ``eval/TASK/METRIC`` is that task's metric as lm-eval names it (``acc``
    stands for ``acc,none``, as in W&B's ``eval/TASK/METRIC`` keys). None while the summary has no such score. The
    base beside it says whether a point got better at all, which its rank among the points does not."""
    if metric == "eval":
        head = _headline(summary)
        return (f"{head[0]} {metric_label(head[1])}", head[2], head[3]) if head else None
    _, task, name = metric.split("/", 2)
    for t, m, base, finetuned in score_rows(summary):
        if t == task and m in (name, f"{name},none"):
            return f"{t} {metric_label(m)}", base, finetuned
    return None


def named_score(summary: dict[str, Any], metric: str) -> float | None:
    """The fine-tuned model's value of a sweep's ranking metric (:func:`named_cell`); None while it has none."""
    cell = named_cell(summary, metric)
    return cell[2] if cell else None


def beats(score: float, other: float, mode: str) -> bool:
    """Whether ``score`` is better than ``other`` under ``mode``: higher with ``max``, lower with ``min``. A tie is not
    better: a fine-tune that only equals its base did not get better. The sweep's ranking orders by it too."""
    return score > other if mode == "max" else score < other


def metric_mode(summary: dict[str, Any], task: str, metric: str) -> str | None:
    """``max`` or ``min`` for ``task``'s ``metric`` (lm-eval's name, ``acc,none``) as lm-eval declares its direction
    (its results' ``higher_is_better``, which the evaluation job keeps in the summary); None when unknown (a summary
    written before it kept them, a metric lm-eval gave no direction)."""
    directions = summary.get("higher_is_better")
    task_directions = directions.get(task) if isinstance(directions, dict) else None
    higher = task_directions.get(metric.split(",", 1)[0]) if isinstance(task_directions, dict) else None
    return ("max" if higher else "min") if isinstance(higher, bool) else None


def base_words(score: float, base: float, mode: str) -> str:
    """Whether a fine-tuned ``score`` beat its ``base`` under ``mode``, with the difference (fine-tuned minus base):
    ``beats the base model by +0.0200`` or ``does not beat the base model (-0.0200)``. The same words for a run and
    for a sweep's best point."""
    diff = f"{score - base:+.4f}"
    return f"beats the base model by {diff}" if beats(score, base, mode) else f"does not beat the base model ({diff})"
