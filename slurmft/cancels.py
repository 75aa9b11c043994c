"""Who cancelled a run's jobs with ``slurmft cancel``, and when: ``RUN_DIR/cancels.jsonl``.

Slurm keeps only that a job ended CANCELLED, and a job it cancelled itself (a dependent job whose ``afterok`` can
never be satisfied: ``--kill-on-invalid-dep``) reads the same as one the user cancelled. ``status`` took every
consolidation job cancelled before it started for Slurm's doing, so after ``slurmft cancel`` it said "cancelled by
Slurm before it started: train job T did not succeed". ``cancel`` writes down what it cancelled, and ``status``
says so.

Not in the manifest: a local run's own process (the ``submit`` or ``resume`` that runs its jobs one after another)
holds the run's lock for hours and writes the manifest from its memory when each job ends, so ``cancel``, which
only signals that process's jobs, could neither take the lock nor write the manifest without losing its entry.
One line per ``cancel`` is appended here instead, by one ``write``: for a Slurm run under the run's lock, after
``scancel``; for a local run before the signal, so that the run's process, seeing its job end, finds the line
and records the job CANCELLED, not FAILED.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from slurmft.rundir import RunPaths, current_user, this_host
from slurmft.units import fmt_time


def record(paths: RunPaths, job_ids: list[str], say: Callable[[str], None] = lambda _: None) -> None:
    """Append that this user cancels ``job_ids`` of the run now (nothing for none). A run directory this user may not
    write to does not stop the cancel: it is said (``say``), and ``status`` then says only "cancelled"."""
    if not job_ids:
        return
    entry = {"jobs": [str(j) for j in job_ids], "time": time.time(), **current_user().record(), "host": this_host()}
    try:
        with open(paths.cancels, "a") as f:  # the user's umask and the directory's group, as every file of the run
            f.write(json.dumps(entry) + "\n")
    except OSError as exc:
        say(f"could not record who cancelled in {paths.cancels} ({exc.strerror}): status says only 'cancelled'")


def read(paths: RunPaths) -> dict[str, dict[str, Any]]:
    """Job id -> the newest ``cancel`` that named it; {} when no job was cancelled so (a line that is not one of
    ours, a torn last line, is skipped)."""
    try:
        text = paths.cancels.read_text(errors="replace")
    except OSError:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("jobs"), list):
            out.update({str(j): entry for j in entry["jobs"]})
    return out


def words(entry: dict[str, Any]) -> str:
    """``cancelled by `slurmft cancel` (ann, 2026-12-06 19:40:12)``."""
    time_ = entry.get("time")
    return (f"cancelled by `slurmft cancel` ({entry.get('user') or 'someone'}, "
            f"{fmt_time(time_ if isinstance(time_, int | float) else None)})")
