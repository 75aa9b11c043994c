"""The loss picture of a run: loss against step, a smoothing line, the learning rate, and the restarts.

A run that was preempted and requeued logs its steps in several attempts; where one attempt
stopped and the next began is exactly what a user looks for when a loss curve jumps, so each
restart (same Slurm job id, new ``restart``) and each ``slurmft resume`` (new job id) is a labelled
vertical line at the step the earlier attempt reached. Steps computed twice (after a hard kill,
from the last periodic checkpoint) are drawn once, with the newest attempt's value.

Headless on purpose: matplotlib's ``Figure`` with the Agg canvas, no pyplot (no display, no global
state), imported only when a picture is made. matplotlib is the optional ``plot`` extra; the data
side (:func:`series`, :func:`marker_steps`, :func:`smooth`) needs nothing beyond the standard library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from slurmft.errors import SlurmftError
from slurmft.rundir import RunPaths, check_run_dir
from slurmft.watch.progress import read_metrics, segments

SIZE_INCHES = (9.0, 4.8)
DPO_HEIGHT = 1.8  # a DPO run's figure: the loss, and its rewards under it
DPI = 100


@dataclass(frozen=True)
class Marker:
    """A vertical line: the step where one attempt stopped and the next took over."""

    step: int
    label: str


def smooth(values: list[float], weight: float = 0.8) -> list[float]:
    """Exponential moving average, debiased at the start (TensorBoard's smoothing), light by default."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``, one point per step (the newest attempt's value wins), step order."""
    by_step: dict[int, float] = {}
    for rec in records:
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            by_step[rec["step"]] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def marker_steps(records: list[dict[str, Any]]) -> list[Marker]:
    """One marker per attempt after the first: at the last step the previous attempt logged."""
    segs = segments(records)
    out = []
    for prev, cur in pairwise(segs):
        if cur.job_id == prev.job_id:
            label = f"requeued (restart {cur.restart})"
        else:
            label = f"resumed (job {cur.job_id})"
        was, now = (seg.records[0].get("world_size") for seg in (prev, cur))
        if isinstance(was, int) and isinstance(now, int) and was != now:
            label += f"\n{was} -> {now} ranks"
        out.append(Marker(prev.last_step, label))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``RUN/loss.png`` (or ``out``) from ``metrics.jsonl``; return the path written."""
    paths = RunPaths.of(run_dir)
    check_run_dir(paths)
    metrics = read_metrics(paths.metrics)
    if not metrics.records:
        raise SlurmftError(f"nothing to plot for {paths.root}", metrics.problems or ["metrics.jsonl has no step"])
    target = Path(out) if out else paths.loss_plot
    draw(metrics.records, target, title=paths.root.name)
    return target


def draw(records: list[dict[str, Any]], target: Path, title: str) -> None:
    """Render the figure into ``target`` (PNG), written atomically."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise SlurmftError("plotting needs matplotlib", ["pip install 'slurmft[plot]' (or pip install matplotlib)"]
                           ) from None

    steps, loss = series(records, "loss")
    lr_steps, lr = series(records, "learning_rate")
    margin_steps, margins = series(records, "rewards/margins")
    accuracy_steps, accuracies = series(records, "rewards/accuracies")
    dpo = bool(margins or accuracies)
    grpo = bool(series(records, "reward")[1])
    two = dpo or grpo  # a method's own metrics in a panel under the loss
    width, height = SIZE_INCHES
    fig = Figure(figsize=(width, height * DPO_HEIGHT if two else height), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if two else fig.add_subplot(1, 1, 1)
    ax.plot(steps, loss, color="tab:blue", alpha=0.4, linewidth=1, marker=".", markersize=3, label="loss")
    if len(loss) > 2:
        weight = min(0.9, max(0.5, 1 - 10 / len(loss)))  # light: ~a tenth of the run, at most ~10 points
        ax.plot(steps, smooth(loss, weight), color="tab:blue", linewidth=2, label="loss (smoothed)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if lr:
        ax2 = ax.twinx()
        ax2.plot(lr_steps, lr, color="tab:orange", linewidth=1.2, label="learning rate")
        ax2.set_ylabel("learning rate", color="tab:orange")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    markers = marker_steps(records)
    for k, m in enumerate(markers):
        ax.axvline(m.step, color="tab:red", linestyle="--", linewidth=1.2)
        # Labels step down the axes in turn, so close markers (two preemptions a few steps apart) stay legible.
        ax.annotate(f"{m.label}\nstep {m.step}", xy=(m.step, 1.0 - 0.12 * (k % 3)), xycoords=("data", "axes fraction"),
                    xytext=(3, -3), textcoords="offset points", va="top", fontsize=8, color="tab:red",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set_title(f"{title}: loss and learning rate by step")
    if dpo:  # DPO's own metrics (TRL's names) under the loss, on the same steps and markers
        low = fig.add_subplot(2, 1, 2, sharex=ax)
        low.plot(margin_steps, margins, color="tab:green", linewidth=1.5, marker=".", markersize=3,
                 label="reward margin (chosen - rejected)")
        low.axhline(0.0, color="grey", linewidth=0.8)
        low.set_ylabel("reward margin", color="tab:green")
        low.set_xlabel("step")
        low.grid(True, alpha=0.3)
        h3, l3 = low.get_legend_handles_labels()
        if accuracies:
            acc = low.twinx()
            acc.plot(accuracy_steps, accuracies, color="tab:purple", linewidth=1.2, label="reward accuracy")
            acc.set_ylim(-0.05, 1.05)
            acc.set_ylabel("accuracy", color="tab:purple")
            h4, l4 = acc.get_legend_handles_labels()
            h3, l3 = h3 + h4, l3 + l4
        handles, labels = handles + h3, labels + l3
        for m in markers:
            low.axvline(m.step, color="tab:red", linestyle="--", linewidth=1.2)
        low.set_title("DPO: implicit rewards (beta x log-ratio to the reference)")
    if grpo:
        h5, l5 = _grpo_panel(fig, ax, records, markers)
        handles, labels = handles + h5, labels + l5
    # Below the axes: inside, it would cover a marker's label or the curves' ends.
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1 if two else 0.06, 1, 1))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(target)


#: the per-function reward lines (not the loss's blue, the learning rate's orange, the markers' red, the total's
#: green nor the KL's purple)
FUNCTION_COLORS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def _grpo_panel(fig: Any, ax: Any, records: list[dict[str, Any]], markers: list[Marker]) -> tuple[list, list]:
    """GRPO's own metrics (TRL's names) under the loss: the weighted reward and each function's mean at the steps
    that generated, the KL to the reference on its own axis; the markers again. Returns the legend's entries."""
    from slurmft.grpoopts import REWARD_METRIC

    low = fig.add_subplot(2, 1, 2, sharex=ax)
    low.plot(*series(records, "reward"), color="tab:green", linewidth=1.5, marker=".", markersize=3,
             label="reward (weighted sum, mean)")
    names = sorted({k for r in records for k in r if REWARD_METRIC.match(k)})
    for name, color in zip(names, FUNCTION_COLORS * (len(names) // len(FUNCTION_COLORS) + 1), strict=False):
        low.plot(*series(records, name), color=color, linewidth=0.9, alpha=0.8, label=name.split("/")[1])
    low.set_ylabel("reward", color="tab:green")
    low.set_xlabel("step")
    low.grid(True, alpha=0.3)
    handles, labels = low.get_legend_handles_labels()
    kl_steps, kl = series(records, "kl")
    if kl:
        right = low.twinx()
        right.plot(kl_steps, kl, color="tab:purple", linewidth=1.2, label="KL to the reference")
        right.set_ylabel("KL", color="tab:purple")
        h, lab = right.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    for m in markers:
        low.axvline(m.step, color="tab:red", linestyle="--", linewidth=1.2)
    low.set_title("GRPO: rewards of each generation, KL to the reference")
    return handles, labels
