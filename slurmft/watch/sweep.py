"""``slurmft status SWEEP_DIR``: one row per point (its overrides, state, step/max, last loss, score), the points
ranked by ``sweep.select``, and ``SWEEP_DIR/best``, a link to the best point's model directory.

Each point is a run directory, so a row is what ``slurmft runs`` says of it (:func:`slurmft.watch.runs.run_lines`:
one squeue call for all points, sacct for those squeue forgot). A point's score is what ``sweep.select.metric``
names (sweep.json records it with its defaults said, :func:`slurmft.sweep.select_of`): its final training loss, the
loss of the last logged step once the point has trained every step of its plan (a grpo point: the mean reward of its
last rollouts then), or a score of its evaluation (RUN_DIR/eval/summary.json). A point without one yet (still
training, not evaluated yet, died) is not ranked; ties keep the points' order. A ranking that compares unlike
measures (slurmft/sweep.py ``select_warnings``, kept in sweep.json at submit) is said again under the table. The link is refreshed by every ``status`` of the sweep and by each point's consolidation
and evaluation job when it ends, so it names the best of the points whose models exist.

With ``eval.compare_base`` a point's summary holds its base model's value of the ranking score too, and the best line
says whether the best point beat it (:func:`versus_base`): the best of the ranking can be worse than the model the
sweep started from, and a ``best`` named without a word would read as "it got better". The link is made all the same
(it is the ranking's best, which is what ``best`` means; the words carry the warning).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cmp_to_key
from pathlib import Path
from typing import Any

from slurmft import locks
from slurmft.eval_results import base_words, beats, named_cell, named_score, read_summary
from slurmft.rundir import RunPaths, SweepPaths, read_sweep_record
from slurmft.watch.progress import read_metrics, rollouts_of
from slurmft.watch.results import result_info
from slurmft.watch.runs import NOT_STARTED, run_lines

Query = Callable[[list[str]], dict[str, dict[str, str]]]


def _mode(record: dict[str, Any]) -> str:
    """sweep.json's ``select.mode`` (``min`` where a record from before it kept one has none, as loss ranks)."""
    return (record.get("select") or {}).get("mode", "min")


def score(row: dict[str, Any], metric: str, run_dir: str | os.PathLike[str] | None = None) -> float | None:
    """The point's value of ``metric``, None until it has one: ``loss``, the final training loss, and ``reward``, a
    grpo run's mean reward at its last rollouts (:func:`slurmft.watch.progress.rollouts_of`), once it trained every
    step of its plan; ``eval`` or ``eval/TASK/METRIC``, its fine-tuned model's score in
    ``run_dir/eval/summary.json`` (slurmft.eval_results.named_score), once its evaluation wrote it."""
    if metric not in ("loss", "reward"):
        summary = read_summary(run_dir) if run_dir is not None else None
        return named_score(summary, metric) if summary else None
    done = row["step"] is not None and row["max_steps"] is not None and row["step"] >= row["max_steps"]
    if not done:
        return None
    if metric == "reward":
        rollouts = rollouts_of(read_metrics(RunPaths.of(run_dir).metrics).records) if run_dir is not None else None
        return float(rollouts["reward"]) if rollouts else None
    return float(row["loss"]) if isinstance(row["loss"], int | float) else None


def sweep_rows(root: Path, query: Query | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(sweep.json, one row per point in point order: index, name, overrides, dir, state, step, max_steps, loss,
    score, rank (1 = best; None without a score), model (its directory when it has one), score_name and base (the
    ranking score's name and its base model's value, with ``eval.compare_base``), beats_base (None unless both the
    score and the base are known))."""
    record = read_sweep_record(SweepPaths(root))
    by_path = {row["path"]: row for row in run_lines(root, query=query)}
    metric, mode = (record.get("select") or {}).get("metric", "loss"), _mode(record)
    rows = []
    # a point not started while a command of the sweep holds its lock (a local submit or resume runs the points one
    # after another) waits its turn; with no such command, nothing will start it but `slurmft resume`
    running = any(r["state"] == NOT_STARTED for r in by_path.values()) and locks.live_holder(RunPaths.of(root).lock)
    for point in record["points"]:
        row = by_path.get(str(Path(point["dir"])), {"state": "missing", "step": None, "max_steps": None,
                                                     "loss": None})
        paths = RunPaths.of(point["dir"])
        summary = read_summary(point["dir"]) if metric.startswith("eval") else None
        cell = named_cell(summary, metric) if summary else None  # which score, and the base's: did it get better?
        state = WAITING if row["state"] == NOT_STARTED and running else row["state"]
        rows.append({"index": point["index"], "name": point["name"], "overrides": point["overrides"],
                     "dir": point["dir"], "state": state, "step": row["step"], "max_steps": row["max_steps"],
                     "loss": row["loss"], "score": score(row, metric, point["dir"]), "rank": None,
                     "model": result_info(paths), "score_name": cell[0] if cell else None,
                     "base": cell[1] if cell else None})
        rows[-1]["beats_base"] = _beats_base(rows[-1], mode)
    rank(rows, mode)
    return record, rows


#: A point not started yet while the sweep's own command (its local ``submit``, a ``resume``) runs the points.
WAITING = "waiting its turn"


def not_started_lines(root: Path, rows: list[dict[str, Any]]) -> list[str]:
    """What the points without a job mean and what starts them: a local sweep runs its points one after another, so
    a killed one leaves the points after it with no job at all (status said "unknown")."""
    lines = []
    for state, words in ((WAITING, "the sweep runs its points here one after another"),
                         (NOT_STARTED, f"the sweep stopped before them; `slurmft resume {root}` runs them, and "
                                       "continues the points that stopped")):
        names = [r["name"] for r in rows if r["state"] == state]
        if names:
            lines.append(f"{state}: {', '.join(names)}: {words}")
    return lines


def rank(rows: list[dict[str, Any]], mode: str) -> None:
    """Each scored row's ``rank`` (1 = best: the lowest score with ``min``, the highest with ``max``); ties keep the
    rows' order (the earlier point ranks first); a row without a score keeps None."""
    def order(a: dict[str, Any], b: dict[str, Any]) -> int:
        return -1 if beats(a["score"], b["score"], mode) else 1 if beats(b["score"], a["score"], mode) else 0

    scored = sorted((r for r in rows if r["score"] is not None), key=cmp_to_key(order))
    for place, r in enumerate(scored, 1):
        r["rank"] = place


def point_dir(root: Path, name: str) -> Path:
    """The directory of the sweep's point ``name`` (as sweep.json and ``status`` name it); another name is refused
    with the sweep's names (did you mean)."""
    import difflib

    from slurmft.errors import RunDirError

    points = read_sweep_record(SweepPaths(root))["points"]
    for point in points:
        if point["name"] == name:
            return Path(point["dir"])
    names = [p["name"] for p in points]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    raise RunDirError(f"--point {name}: sweep {root} has no such point" + (f"; did you mean {close[0]}?" if close
                                                                           else ""), [f"its points: {', '.join(names)}"])


def best_point(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best-ranked point that has a model directory."""
    ranked = sorted((r for r in rows if r["rank"] is not None and r["model"]), key=lambda r: r["rank"])
    return ranked[0] if ranked else None


def _beats_base(row: dict[str, Any], mode: str) -> bool | None:
    """Whether the row's score beats its own base model's value of it; None when either is unknown."""
    if row.get("score") is None or row.get("base") is None:
        return None
    return beats(row["score"], row["base"], mode)


def versus_base(rows: list[dict[str, Any]], best: dict[str, Any] | None, mode: str) -> dict[str, Any] | None:
    """The best point against its base model, where both values are known (``eval.compare_base`` and a ranking by an
    evaluation score), else None (nothing is said): ``beats`` (a tie does not), ``base``, ``score``, ``by``
    (score - base), ``metric``, ``mode``, ``one_base`` (every point with both values has the best's base value: a
    sweep varying no ``model.*`` or ``eval.*`` scores one base once, SWEEP_DIR/base-eval/) and ``others`` (the other
    points that beat their own base: with bases that differ, the best's verdict is not the sweep's)."""
    if best is None or _beats_base(best, mode) is None:
        return None
    known = [r for r in rows if _beats_base(r, mode) is not None]
    return {"beats": _beats_base(best, mode), "base": best["base"], "score": best["score"],
            "by": round(best["score"] - best["base"], 10), "metric": best.get("score_name"), "mode": mode,
            "one_base": all(r["base"] == best["base"] for r in known),
            "others": [r["name"] for r in known if r is not best and _beats_base(r, mode)]}


def versus_base_words(best: dict[str, Any], versus: dict[str, Any] | None) -> str:
    """What follows the best line's ``linked as best)``: whether the best point beats the base model, in
    :func:`slurmft.eval_results.base_words`' words, with both values, the score and the mode; "" when unknown."""
    if versus is None:
        return ""
    values = (f"base {_number(versus['base'])}, {best['name']} {_number(versus['score'])} on "
              f"{versus['metric'] or 'the score'}, {versus['mode']}")
    if versus["beats"]:
        return f"; it {base_words(versus['score'], versus['base'], versus['mode'])} ({values})"
    if versus["others"]:
        return (f" — but it does not beat its base model ({values}); {', '.join(versus['others'])} beat their own "
                "(the points' base models differ)")
    if versus["one_base"]:
        return f" — but no point beats the base model ({values})"
    return f" — but no point beats its base model (the points' base models differ; {values})"


def update_best(root: Path, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Point ``root/best`` at the best point's model directory (a relative link, replaced atomically); remove a
    link no point earns. Returns the best point's row."""
    best = best_point(rows)
    link = SweepPaths(root).best
    if best is None:
        if link.is_symlink():
            link.unlink(missing_ok=True)
        return None
    target = os.path.relpath(best["model"], root)
    if link.is_symlink() and os.readlink(link) == target:
        return best
    tmp = link.with_name(f".best.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)
    return best


def refresh_best_safely(run_dir: str | os.PathLike[str]) -> None:
    """After a point's consolidation or evaluation: when ``run_dir`` is a point of a sweep, refresh ``best``; never raises (a
    ranking problem must not fail an export)."""
    root = Path(run_dir).resolve().parent
    if not SweepPaths(root).record.is_file():
        return
    try:
        update_best(root, sweep_rows(root, query=lambda ids: {})[1])
    except Exception as exc:  # noqa: BLE001 - the export is done; say why the link was not updated
        print(f"[slurmft] {root}/best not updated: {exc}", flush=True)


def ranked_by(record: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """``eval: tiny_choice acc_norm (max)``: the ranking metric, the score ``eval`` stands for once a point has one
    (the first task's headline metric), and the direction."""
    select = record.get("select") or {}
    metric = select.get("metric", "loss")
    named = next((r["score_name"] for r in rows if r.get("score_name")), None) if metric == "eval" else None
    return f"{metric}{f': {named}' if named else ''} ({_mode(record)})"


def _number(value: Any) -> str:  # noqa: ANN401 - a score, a loss or None
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


def format_table(root: Path, record: dict[str, Any], rows: list[dict[str, Any]], best: dict[str, Any] | None
                 ) -> list[str]:
    """Aligned lines: point, overrides, state, step/max, last loss, score (rank), the base model's score when the
    evaluation scored it (``eval.compare_base``), then the best point (and whether it beats the base model) and
    what starts the points not started."""
    with_base = any(r.get("base") is not None for r in rows)
    table = [("point", "overrides", "state", "step", "loss", ranked_by(record, rows)) + (("base",) if with_base else ())]
    for r in rows:
        step = f"{'-' if r['step'] is None else r['step']}/{'?' if r['max_steps'] is None else r['max_steps']}"
        shown = f"{r['score']:.4f} (#{r['rank']})" if r["score"] is not None else "-"
        overrides = " ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "(as written)"
        table.append((r["name"], overrides, r["state"], step, _number(r["loss"]), shown)
                     + ((_number(r.get("base")),) if with_base else ()))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [f"sweep {record.get('name')} ({record.get('executor')}): {len(rows)} point(s)"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines += select_warnings_of(record)
    if best:
        lines.append(f"best: {best['name']} ({best['model']}; linked as best)"
                     f"{versus_base_words(best, versus_base(rows, best, _mode(record)))}")
    else:
        lines.append("best: none yet (no point has a score and a model)")
    return lines + not_started_lines(root, rows)


def select_warnings_of(record: dict[str, Any]) -> list[str]:
    """What submit warned of the ranking (slurmft/sweep.py ``select_warnings``, kept in sweep.json): said again
    wherever the ranking is shown, since ``best`` follows it whether or not the warning was read."""
    warned = record.get("select_warnings")
    return [str(line) for line in warned] if isinstance(warned, list) else []


def status_lines(root: Path, as_json: bool = False) -> list[str]:
    """``slurmft status SWEEP_DIR``: the table (or, ``as_json``, the sweep, its jobs, the rows and the best point as
    one JSON document, with ``best_beats_base`` (true, false, or null when unknown) and ``best_vs_base``
    (:func:`versus_base`)); ``best`` refreshed first."""
    import json

    record, rows = sweep_rows(root)
    best = update_best(root, rows)
    if as_json:
        versus = versus_base(rows, best, _mode(record))
        return [json.dumps({"sweep": record["name"], "executor": record["executor"], "select": record["select"],
                            "select_warnings": select_warnings_of(record),
                            "jobs": record["jobs"], "points": rows, "best": best and best["name"],
                            "best_beats_base": versus and versus["beats"], "best_vs_base": versus}, indent=2)]
    return format_table(root, record, rows, best)


def plot_sweep(root: Path, out: str | Path | None = None) -> Path:
    """``SWEEP_DIR/loss.png`` (or ``out``): every point's loss by step on one axes, lightly smoothed, one colour and
    legend entry each (its name); a point without a step yet is left out. Returns the path written."""
    from slurmft.errors import SlurmftError
    from slurmft.watch.plot import DPI, SIZE_INCHES, series, smooth

    curves = []
    record = read_sweep_record(SweepPaths(root))
    for point in record["points"]:
        steps, loss = series(read_metrics(RunPaths.of(point["dir"]).metrics).records, "loss")
        if steps:
            curves.append((point["name"], steps, loss))
    if not curves:
        raise SlurmftError(f"nothing to plot for {root}", ["no point has logged a step yet"])
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise SlurmftError("plotting needs matplotlib", ["pip install 'slurmft[plot]' (or pip install matplotlib)"]
                           ) from None
    fig = Figure(figsize=SIZE_INCHES, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, steps, loss in curves:
        weight = min(0.9, max(0.5, 1 - 10 / len(loss))) if len(loss) > 2 else 0.0
        ax.plot(steps, smooth(loss, weight) if weight else loss, linewidth=1.6, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (smoothed)")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"sweep {record.get('name')}: the points' loss by step")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    target = Path(out) if out else Path(root) / "loss.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(target)
    return target


def write_sweep_report(root: Path) -> Path:
    """``slurmft report SWEEP_DIR``: ``SWEEP_DIR/report.md``, the points ranked by ``sweep.select`` (best first, the
    unranked after in the file's order) with each one's overrides, state, steps, last loss, score and model, the best
    point named (and whether it beats the base model); ``loss.png`` beside it (a plot that cannot be drawn is said,
    not raised). ``best`` refreshed first."""
    from slurmft.errors import SlurmftError
    from slurmft.rundir import atomic_write

    record, rows = sweep_rows(root)
    best = update_best(root, rows)
    try:
        plot = f"![loss by step]({plot_sweep(root).name})"
    except SlurmftError as exc:
        plot = f"(no plot: {exc})"
    ordered = sorted(rows, key=lambda r: (r["rank"] is None, r["rank"] or 0))
    warned = select_warnings_of(record)
    with_base = any(r.get("base") is not None for r in rows)
    lines = [f"# Sweep {record.get('name')}", "",
             f"{len(rows)} point(s), executor {record.get('executor')}, ranked by {ranked_by(record, rows)}.", "",
             *[f"> {line.strip()}  " for line in warned], *([""] if warned else []),
             f"**Best:** {best['name']} (`{best['model']}`, linked as `best`)"
             f"{versus_base_words(best, versus_base(rows, best, _mode(record)))}" if best
             else "**Best:** none yet (no point has a score and a model)", "",
             "| rank | point | overrides | state | step | loss | score |" + (" base |" if with_base else "") + " model |",
             "|---|---|---|---|---|---|---|" + ("---|" if with_base else "") + "---|"]
    for r in ordered:
        overrides = " ".join(f"`{k}={v}`" for k, v in r["overrides"].items()) or "(as written)"
        step = f"{'-' if r['step'] is None else r['step']}/{'?' if r['max_steps'] is None else r['max_steps']}"
        base = f" {_number(r.get('base'))} |" if with_base else ""
        lines.append(f"| {r['rank'] or '-'} | {r['name']} | {overrides} | {r['state']} | {step} | {_number(r['loss'])} | "
                     f"{_number(r['score'])} |{base} {r['model'] or '-'} |")
    waiting = [f"{line}  " for line in not_started_lines(root, rows)]  # a markdown line break after each
    lines += ["", *waiting, *([""] if waiting else []), plot, ""]
    target = Path(root) / "report.md"
    atomic_write(target, "\n".join(lines))
    return target
