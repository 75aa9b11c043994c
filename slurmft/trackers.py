"""One experiment-tracker run per slurmft run: the W&B run id every attempt uses, and the record of it.

What W&B does on its own: every attempt of a run (each requeue after the warning signal, each
``slurmft resume``) is a new process whose Trainer calls ``wandb.init`` afresh, and ``wandb.init``
without an id makes a new W&B run, so a run preempted twice showed up as three runs, each with a
third of the loss curve. ``wandb.init`` reads ``WANDB_RUN_ID``, ``WANDB_RESUME``, ``WANDB_NAME`` and
``WANDB_DIR`` from the environment: the job sets those the user left unset (:func:`wandb_environment`),
so every attempt asks W&B to resume one run under one id, and a user's own ``WANDB_RUN_ID`` (or
name, or directory) wins. With ``WANDB_MODE=offline`` each attempt writes its own
``offline-run-<time>-<id>`` directory (wandb 0.31 makes one per process), all carrying that id, so
``wandb sync`` of them all lands in one W&B run (docs/watching.md).

Both jobs that write to the run's W&B run, the train job (slurmft/job/tracking.py) and the evaluation job
(slurmft/job/evaluate.py), set it up with :func:`use_one_wandb_run` and record their attempt in ``tracker.json``
with :func:`record_wandb_run` (from rank 0): ``status`` and the report read it on a login node, so nothing here
imports wandb.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurmft.errors import RunDirError
from slurmft.rundir import RunPaths, atomic_write, read_manifest

#: What slurmft asks ``wandb.init`` to resume with when the user did not say otherwise.
WANDB_RESUME_DEFAULT = "allow"


def default_wandb_id(paths: RunPaths, created: float | None) -> str:
    """The W&B run id of a run whose environment names none: the run directory's id and its creation time.

    Why the time as well: ``RunPaths.run_id`` hashes the path only, and a run directory that was deleted and
    submitted again at the same path is a new run. With the path alone its attempts would resume the old
    W&B run, whose steps end where the old run ended, and W&B drops every step below its last one.
    """
    return f"{paths.run_id}-{int(created)}" if created else paths.run_id


def wandb_environment(environ: Mapping[str, str], run_id: str, name: str, directory: Path) -> dict[str, str]:
    """The W&B variables to set for one attempt: each of ``WANDB_RUN_ID``, ``WANDB_RESUME=allow``,
    ``WANDB_NAME`` and ``WANDB_DIR`` that ``environ`` does not set already (the user's own value wins)."""
    wanted = {"WANDB_RUN_ID": run_id, "WANDB_RESUME": WANDB_RESUME_DEFAULT, "WANDB_NAME": name,
              "WANDB_DIR": str(directory)}
    return {key: value for key, value in wanted.items() if not environ.get(key)}


def read_tracker(paths: RunPaths) -> dict[str, Any] | None:
    """``tracker.json``, or None when the run logs to no tracker (or the job has not started one yet)."""
    try:
        data = json.loads(paths.tracker.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recorded_wandb_id(paths: RunPaths) -> str | None:
    """The W&B run id an earlier attempt of this run used (kept when a later attempt's environment names none)."""
    record = read_tracker(paths) or {}
    run_id = (record.get("wandb") or {}).get("id")
    return run_id if isinstance(run_id, str) and run_id else None


def record_attempt(paths: RunPaths, run: Mapping[str, Any], attempt: Mapping[str, Any]) -> dict[str, Any]:
    """Add one attempt's W&B run to ``tracker.json`` (the newest run's id, project, URL on top; every
    attempt's directory below) and return the record. One writer: rank 0 of the one live attempt."""
    record = read_tracker(paths) or {}
    wandb = dict(record.get("wandb") or {})
    attempts = list(wandb.get("attempts") or [])
    attempts.append({**attempt, "id": run["id"], "time": round(time.time(), 3)})
    wandb.update(run)
    wandb["attempts"] = attempts
    record["wandb"] = wandb
    atomic_write(paths.tracker, json.dumps(record, indent=2) + "\n")
    return record


def use_one_wandb_run(paths: RunPaths, name: str) -> str:
    """Set this process's W&B variables the user left unset (:func:`wandb_environment`); return the W&B run id.

    The id: the user's ``WANDB_RUN_ID``, else the one an earlier attempt recorded, else the run's own.
    """
    try:
        created = read_manifest(paths).get("created")
    except RunDirError:  # a run started by hand may have no manifest: the path's id alone
        created = None
    run_id = recorded_wandb_id(paths) or default_wandb_id(paths, created)
    os.environ.update(wandb_environment(os.environ, run_id, name, paths.root))
    return os.environ["WANDB_RUN_ID"]


def record_wandb_run(paths: RunPaths, run: Any, attempt: Mapping[str, Any], first_step: int | None = None) -> bool:
    """Record wandb's live ``run`` (its id, project, entity, name, URL) in ``tracker.json`` as one attempt:
    ``attempt`` (which job), whether it is offline, its directory and, for the train job, the first step it logs.
    Returns whether the run is offline."""
    offline = run.settings.mode in ("offline", "dryrun")
    fields = {**attempt, "offline": offline, "dir": str(run.settings.sync_dir)}
    if first_step is not None:
        fields["first_step"] = first_step
    record_attempt(paths, {"id": run.id, "project": run.project, "entity": run.entity or None, "name": run.name,
                           "url": None if offline else run.url}, fields)
    return offline


def sync_command(record: Mapping[str, Any]) -> str | None:
    """The ``wandb sync`` line that uploads every offline attempt of the W&B run into that one run."""
    wandb = record.get("wandb") or {}
    dirs = [Path(a["dir"]) for a in wandb.get("attempts") or [] if a.get("offline") and a.get("dir")]
    if not dirs:
        return None
    parents = {d.parent for d in dirs}
    if len(parents) == 1:
        return f"wandb sync {parents.pop()}/offline-run-*-{wandb.get('id')}"
    return "wandb sync " + " ".join(str(d) for d in dirs)


def tracker_lines(record: Mapping[str, Any] | None) -> list[str]:
    """``tracker.json`` in words, for ``slurmft status`` and the report."""
    wandb = (record or {}).get("wandb")
    if not wandb:
        return []
    where = "/".join(str(p) for p in (wandb.get("entity"), wandb.get("project")) if p)
    attempts = wandb.get("attempts") or []
    offline = [a for a in attempts if a.get("offline")]
    head = f"W&B: run {wandb.get('id')}" + (f" in {where}" if where else "")
    if wandb.get("url"):
        head += f", {wandb['url']}"
    head += f" ({len(attempts)} attempt(s)"
    head += f", {len(offline)} offline)" if offline else ")"
    lines = [head]
    sync = sync_command(record or {})
    if sync:
        lines.append(f"  upload the offline attempts into that one run: {sync}")
    return lines
