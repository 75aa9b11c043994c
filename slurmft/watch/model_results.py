"""What the jobs after consolidation found, for ``status``, ``runs`` and the report (files only, no torch).

``RUN_DIR/serve/result.json`` (the serve check, :mod:`slurmft.job.serve_check`) and ``RUN_DIR/eval/summary.json``
(lm-eval on the model and the base, :mod:`slurmft.job.evaluate`), read as they are; a missing or unreadable file is
"not run yet", never an error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurmft.eval_results import SUMMARY, base_words, metric_mode, read_summary, score_rows
from slurmft.slurm_states import State, is_live, parse, words
from slurmft.units import fmt_time


def read_serve(run_dir: Path) -> dict[str, Any] | None:
    """The serve check's record, or None when it has not run (or its file cannot be read)."""
    try:
        record = json.loads((run_dir / "serve" / "result.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def serve_lines(record: dict[str, Any] | None) -> list[str]:
    """One line per engine: passed or failed, how (exact or within tolerance), start-up and speed; the problems."""
    if not record:
        return []
    lines = []
    for label, e in record.get("engines", {}).items():
        what = "model/" if label == "model" else "the base with adapter/ (vLLM LoRA)"
        agree = [p.get("agree") for p in e.get("prompts", [])]
        lengths = [len(p.get("vllm", [])) for p in e.get("prompts", [])]
        how = (f"greedy tokens equal transformers' on {len(agree)} prompt(s) ({e.get('dtype')})" if e.get("exact")
               else f"greedy tokens agree for {agree} of {lengths} ({e.get('dtype')}; kernels differ)")
        gaps = [p.get("max_first_logprob_gap") for p in e.get("prompts", []) if isinstance(p.get("max_first_logprob_gap"),
                                                                                         int | float)]
        gap = f", first-token log-prob gap <= {max(gaps):.2g}" if gaps else ""
        speed = f", {e['tokens_per_s']} tokens/s" if e.get("tokens_per_s") else ""
        verdict = "passed" if e.get("ok") else "FAILED"
        lines.append(f"serve check {verdict}: vLLM {e.get('vllm_version')} served {what}: {how}{gap}; engine start "
                     f"{e.get('startup_s')} s{speed}{_with(record)}")
        lines += [f"  - {p}" for p in e.get("problems", [])]
    if not record.get("ok") and record.get("problems") and not any(not e.get("ok") for e in
                                                                   record.get("engines", {}).values()):
        lines.append(f"serve check FAILED: {record['problems'][0]}")
        lines += [f"  - {p}" for p in record["problems"][1:]]
    return lines


def _with(result: dict[str, Any]) -> str:
    """The overrides a result was made with (``slurmft serve|eval RUN_DIR KEY=VALUE``): its settings are not
    config.yaml's then."""
    overrides = result.get("overrides")
    return f"; with {' '.join(map(str, overrides))}" if isinstance(overrides, list) and overrides else ""


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else "-"


def eval_lines(run_dir: Path) -> list[str]:
    """One line per task and metric: base -> fine-tuned, and whether the fine-tune beat the base (by the metric's
    direction as lm-eval declares it; nothing said where that or a score is unknown): the arrow alone left the
    reader to know that a lower perplexity, but a higher accuracy, is better."""
    summary = read_summary(run_dir)
    if not summary:
        return []
    lines = [f"evaluation (lm-eval {summary.get('lm_eval_version', '?')}, {summary.get('backend', '?')} backend"
             f"{_with(summary)}):"]
    for task, metric, base, tuned in score_rows(summary):
        if base is None:
            lines.append(f"  {task} {metric}: {_number(tuned)}")
            continue
        mode = metric_mode(summary, task, metric)
        verdict = (f": {base_words(tuned, base, mode)}{' (lower is better)' if mode == 'min' else ''}"
                   if mode and tuned is not None else "")
        lines.append(f"  {task} {metric}: {_number(base)} -> {_number(tuned)}{verdict}")
    return lines


def from_job(path: Path, kind: str, rows: list[dict[str, Any]] | None) -> list[str]:
    """When the shown result was written and, for the scores, by which eval job (only a completed one writes
    summary.json; a failed serve check writes its own verdict); and, when a newer job of ``kind`` runs or ended
    without writing, that the result is the previous one. ``status`` showed the previous scores beside a newer eval
    job, running or failed, without a word. ``rows``: status's job rows, oldest first (None: nothing said)."""
    try:
        written = path.stat().st_mtime
    except OSError:
        return []
    if rows is None:
        return []
    mine = [r for r in rows if r.get("kind") == kind]
    done = [r for r in mine if parse(r.get("state")) == State.COMPLETED]
    by = f" by {kind} job {done[-1]['job_id']}" if kind == "eval" and done else ""
    line = f"  (written {fmt_time(written)}{by}"
    newest = mine[-1] if mine else None
    what = "scores" if kind == "eval" else "verdict"
    if newest is not None and (not done or newest is not done[-1]):
        if is_live(newest.get("state")):
            line += f"; {kind} job {newest['job_id']} is {words(newest.get('state')).split(' (')[0]}: these are the " \
                    f"previous {what}"
        elif kind == "eval":  # it ended without writing: the scores are an earlier job's
            line += f"; the newer {kind} job {newest['job_id']} ended {newest.get('state')}: these are the previous scores"
    return [line + ")"]


def result_lines(run_dir: Path, rows: list[dict[str, Any]] | None = None) -> list[str]:
    """Both, for ``status`` (with its job ``rows``: which job wrote them, a newer one running or failed) and the
    report."""
    serve = serve_lines(read_serve(run_dir))
    scores = eval_lines(run_dir)
    return (serve + (from_job(run_dir / "serve" / "result.json", "serve", rows) if serve else [])
            + scores + (from_job(run_dir / SUMMARY, "eval", rows) if scores else []))
