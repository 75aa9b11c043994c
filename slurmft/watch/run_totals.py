"""The whole run's training figures, over every attempt, from what the attempts recorded.

Why: transformers' end-of-training figures (``Trainer._finalize_training``, 5.24) cover one ``train()`` call, and
each attempt of a requeued or resumed run is a new process with its own call. ``train_loss`` is that call's loss
sum over ``global_step - _initial_global_step`` (the steps this attempt trained, not the run's), ``train_runtime``
the seconds since this call's training loop began. Printed or sent to W&B as they are, a run preempted at step 15
of 30 reports the mean loss of steps 16-30 and half its time as the run's.

What is recorded instead (both by rank 0's ``MetricsLog``, slurmft/job/callbacks.py):

- ``metrics.jsonl``: each logged step's ``loss`` (the mean over the ``loss_steps`` optimizer steps since the
  previous log of the same attempt; every save and every stop is a logging step, so a resume starts right after a
  logged step);
- ``train_summary.jsonl``: one line per attempt whose training loop ended, with transformers' figures for it.

From these, :func:`totals` gives the run's ``train_loss``: the step-weighted mean of the logged losses, each step
once (a step trained again after a resume from an older checkpoint counts with its newest value, the one the
final model went through), which for a single attempt is exactly transformers' ``train_loss``; and the run's
``train_runtime``: the attempts' training-loop seconds added up (queue time and start-up between attempts are
not training). What cannot be known is said, never filled in: an attempt killed outright (SIGKILL, node failure)
wrote no end line, so its seconds are missing; a loss logged as one mean over steps that a later attempt trained
again in part cannot be split, so those steps are left out of the loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.watch.progress import read_metrics, segments

#: transformers' end-of-training figures that cover the attempt's own ``train()`` call (``total_flos`` is not one:
#: the Trainer restores it from the checkpoint's state and adds to it, so it is the run's already).
ATTEMPT_KEYS = ("train_loss", "train_runtime", "train_samples_per_second", "train_steps_per_second")
#: the prefix of the attempt's own figures once the plain names hold the whole run's
LAST_ATTEMPT = "last_attempt/"
#: every key of the end-of-training log once :func:`relabel` has run: one value per run (W&B's summary)
SUMMARY_KEYS = frozenset({*ATTEMPT_KEYS, *(LAST_ATTEMPT + k for k in ATTEMPT_KEYS), "total_flos",
                          "train_loss_steps", "train_attempts"})


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_summaries(path: Path) -> list[dict[str, Any]]:
    """The end lines of ``train_summary.jsonl`` (file order), read as ``metrics.jsonl`` is (a torn or foreign line
    skipped; none yet: [])."""
    return read_metrics(path).records


def _key(rec: dict[str, Any]) -> tuple[str, int]:
    return str(rec.get("job_id", "")), int(rec.get("restart") or 0)


@dataclass(frozen=True)
class RunTotals:
    """The whole run's figures (see the module docstring for how each is made)."""

    loss: float | None  # step-weighted mean of the logged losses, each step once; None: no weighted step logged
    loss_steps: int  # the optimizer steps ``loss`` covers
    last_step: int  # the run's newest logged step
    runtime_s: float | None  # training-loop seconds of the attempts that recorded their end; None: none did
    timed_steps: int  # the optimizer steps those attempts trained
    samples_per_s: float | None  # their samples per second, weighed by their seconds
    attempts: int  # attempts that logged a step or recorded their end
    untimed: tuple[str, ...]  # attempts that logged steps but recorded no end ("job 12 restart 0")

    @property
    def steps_per_s(self) -> float | None:
        return self.timed_steps / self.runtime_s if self.runtime_s else None

    def figures(self) -> dict[str, float | int]:
        """The run's figures under transformers' names (``train_loss``, ``train_runtime``, ...), those known."""
        out: dict[str, float | int] = {}
        if self.loss is not None:
            out["train_loss"] = self.loss
            out["train_loss_steps"] = self.loss_steps
        if self.runtime_s is not None:
            out["train_runtime"] = round(self.runtime_s, 4)
            if self.steps_per_s is not None:
                out["train_steps_per_second"] = round(self.steps_per_s, 3)
            if self.samples_per_s is not None:
                out["train_samples_per_second"] = round(self.samples_per_s, 3)
        out["train_attempts"] = self.attempts
        return out

    def gaps(self) -> list[str]:
        """What the figures leave out, in words (empty: every step's loss and every attempt's time is in)."""
        out = []
        if self.loss_steps < self.last_step:
            out.append(f"train_loss covers {self.loss_steps} of the {self.last_step} steps (the others were "
                       "logged only inside a mean with steps trained again later, or not at all)")
        if self.untimed:
            out.append(f"train_runtime leaves out {', '.join(self.untimed)}: killed before its end, its time was "
                       "not recorded")
        return out


def _covers(rec: dict[str, Any]) -> tuple[int, bool]:
    """(start, known) of a logged step record: it covers the steps ``(start, step]``; ``known``: its ``loss_steps``
    says so (an older slurmft's record is taken to cover its own step, and gives its loss no weight)."""
    step, n = rec["step"], rec.get("loss_steps")
    known = isinstance(n, int) and not isinstance(n, bool) and 0 < n <= step
    return (step - n if known else step - 1), known  # type: ignore[operator]


def newest_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The logged step records that stand, in file order: each step once, with its newest value.

    A record covers the steps ``(step - loss_steps, step]``. A later record that starts at or below an earlier
    record's end (a resume from an older checkpoint) replaces every earlier record reaching past its start: those
    steps were trained again, and the newest training is the run's (the one the final model went through)."""
    kept: list[tuple[int, dict[str, Any]]] = []  # (start, record)
    for rec in records:
        start = _covers(rec)[0]
        while kept and kept[-1][1]["step"] > start:
            kept.pop()
        kept.append((start, rec))
    return [rec for _, rec in kept]


def loss_over_steps(records: Iterable[dict[str, Any]]) -> tuple[float | None, int]:
    """(step-weighted mean loss, steps covered) over logged step records in file order, each step once
    (:func:`newest_records`). A record without ``loss_steps`` (an older slurmft) or without a loss still replaces
    what it overlaps but adds no weight."""
    weighted = []
    for rec in newest_records(records):
        (start, known), loss = _covers(rec), _num(rec.get("loss"))
        if known and loss is not None:
            weighted.append((rec["step"] - start, loss))
    steps = sum(n for n, _ in weighted)
    return (sum(n * loss for n, loss in weighted) / steps if steps else None), steps


def totals(records: list[dict[str, Any]], ends: list[dict[str, Any]]) -> RunTotals:
    """The run's figures from ``metrics.jsonl``'s step records and ``train_summary.jsonl``'s end lines."""
    loss, covered = loss_over_steps(records)
    timed = [(r, t) for r in ends if (t := _num(r.get("train_runtime"))) is not None]
    runtime = sum(t for _, t in timed) if timed else None
    steps = sum(r["step"] - int(r.get("from_step") or 0) for r, _ in timed)
    rated = [(v, t) for r, t in timed if (v := _num(r.get("train_samples_per_second"))) is not None]
    samples = sum(v * t for v, t in rated) / runtime if runtime and len(rated) == len(timed) else None
    ended = {_key(r) for r, _ in timed}
    logged = [(s.job_id, s.restart) for s in segments(records)]
    seen = list(dict.fromkeys([*logged, *(_key(r) for r in ends)]))
    untimed = tuple(f"job {job} restart {restart}" for job, restart in dict.fromkeys(logged) if (job, restart) not in ended)
    last = max([r["step"] for r in records] + [r["step"] for r in ends], default=0)
    return RunTotals(loss=loss, loss_steps=covered, last_step=last, runtime_s=runtime, timed_steps=steps,
                     samples_per_s=samples, attempts=len(seen), untimed=untimed)


def relabel(logs: dict[str, Any], run: RunTotals) -> None:
    """The end-of-training log dict, in place: the attempt's own figures under ``last_attempt/``, the run's under
    the plain names (what the console, TensorBoard and W&B's summary then show)."""
    own = {LAST_ATTEMPT + key: logs.pop(key) for key in ATTEMPT_KEYS if key in logs}
    rest = dict(logs)
    logs.clear()  # the run's first, then the attempt's, then the rest (total_flos, epoch): the console line's order
    logs.update({**run.figures(), **own, **rest})
