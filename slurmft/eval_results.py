"""The evaluation's scores, read on the login side: RUN_DIR/eval/summary.json into rows for ``status``, the
report and ``runs``.

The evaluation job (slurmft.job.evaluate) writes the summary; this module only reads it, with the standard
library (no torch, transformers or lm_eval: the login side never imports them). A missing or torn summary
reads as None, never an error: the report of a run that has not been evaluated still renders.

- :func:`read_summary`: the summary, or None;
- :func:`score_rows`: ``(task, metric, base, finetuned)`` per task and metric, metric names as lm-eval writes
  them (``acc,none``), the base None without ``eval.compare_base``;
- :func:`headline_score`: one number for the ``runs`` table: the first task's main metric;
- :func:`named_cell` / :func:`named_score`: a sweep's ranking metric, with the base's value beside it.
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
