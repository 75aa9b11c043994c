"""``slurmft runs [DIR]``: every run directory under DIR, one line each.

A user with twenty runs wants "which are still going, which died, how far is each" at a glance.
Each run's own files say step, loss and age; the state of Slurm runs takes one ``squeue`` call
for the job ids of all runs together (and at most one ``sacct`` for those squeue no longer
knows), never one call per run: on a busy controller N calls are N slow answers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft import cancels, slurm
from slurmft.eval_results import headline_score, read_summary
from slurmft.rundir import RunPaths, current_user, job_submitter, read_manifest, run_owner
from slurmft.slurm_states import State, is_allocated, is_live, parse
from slurmft.units import fmt_age
from slurmft.watch.progress import max_steps_of, read_metrics, rollouts_of
from slurmft.watch.results import result_info
from slurmft.watch.status import missing_state

MAX_DEPTH = 3
# A live train job's state in one word (any other live state: "training").
TRAIN_WORD = {State.PENDING: "queued", State.CONFIGURING: "starting", State.REQUEUED: "requeued",
              State.REQUEUE_FED: "requeued", State.REQUEUE_HOLD: "held", State.SPECIAL_EXIT: "held",
              State.RESV_DEL_HOLD: "held", State.SUSPENDED: "suspended", State.STOPPED: "suspended"}
# A prepare job that ended so (its train job then never starts).
PREPARE_FAILED = frozenset({State.FAILED, State.TIMEOUT, State.NODE_FAIL, State.OUT_OF_MEMORY,
                            State.BOOT_FAIL, State.PREEMPTED, State.DEADLINE})
#: A run directory whose manifest holds no job yet: a sweep's point its local sweep has not run.
NOT_STARTED = "not started"
# Folders inside a run directory that never hold another run (and can be large).
SKIP = RunPaths(Path(".")).folders | {"__pycache__", "node_modules"}


def find_runs(root: Path, max_depth: int = MAX_DEPTH) -> list[Path]:
    """Directories under ``root`` (itself included) that hold a ``manifest.json``, sorted by path."""
    found: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        if (d / "manifest.json").is_file():
            found.append(d)
            return  # a run directory's own folders are not searched
        if depth >= max_depth:
            return
        try:
            children = sorted(c for c in d.iterdir() if c.is_dir() and not c.is_symlink())
        except OSError:
            return
        for c in children:
            if c.name not in SKIP and not c.name.startswith("."):
                walk(c, depth + 1)

    walk(root, 0)
    return found


def run_word(jobs: list[dict[str, Any]], has_model: bool) -> str:
    """The run's state in one word from its jobs' ``{kind, state, reason}`` (newest last).

    A live prepare job says the data is being prepared (a failed one, that it failed); a live train job says
    where training is; a live consolidation job says the run is being
    consolidated (or stuck behind a failed train job); otherwise the model's presence or the newest
    train job's end.
    """
    train = [j for j in jobs if j["kind"] == "train"]
    cons = [j for j in jobs if j["kind"] == "consolidate"]
    prep = [j for j in jobs if j["kind"] == "prepare"]
    t = train[-1] if train else None
    if prep and is_live(prep[-1]["state"]):  # the train job, if any, waits on it
        return "preparing" if is_allocated(prep[-1]["state"]) else "prepare queued"
    if prep and parse(prep[-1]["state"]) in PREPARE_FAILED and (t is None or parse(t["state"]) == State.CANCELLED):
        return "prepare failed"
    if t and is_live(t["state"]):
        return TRAIN_WORD.get(parse(t["state"]) or State.RUNNING, "training")
    if cons and is_live(cons[-1]["state"]):
        if cons[-1].get("reason") == "DependencyNeverSatisfied":
            return "stuck"
        if parse(cons[-1]["state"]) in (State.SUSPENDED, State.STOPPED):
            return "consolidation suspended"
        return "consolidating" if is_allocated(cons[-1]["state"]) else "consolidation queued"
    after = [j for j in jobs if j["kind"] in ("serve", "eval")]
    live = [j["kind"] for j in after if is_live(j["state"])]  # which: an evaluation takes minutes, a serve check less
    if has_model and live:
        return "evaluating" if live[-1] == "eval" else "serve check"
    failed = [j["kind"] for j in after[-2:] if parse(j["state"]) in PREPARE_FAILED]
    if has_model and failed:
        return "done (the evaluation failed)" if failed[-1] == "eval" else "done (the serve check failed)"
    if has_model:
        return "done"
    if not jobs:  # a sweep's point the local sweep never reached (killed, or still on an earlier point)
        return NOT_STARTED
    if t is None:  # `slurmft prepare run.yaml`, or a local sweep's point stopped during its preparation
        return _ended(prep[-1]["state"], "prepared", "prepare ") if prep else "unknown"
    return _ended(t["state"], "trained")


def _ended(state: str, completed: str, what: str = "") -> str:
    """The word for a run whose newest job (of kind ``what``) ended in ``state``: ``completed`` when it completed."""
    return {"COMPLETED": completed, "UNKNOWN": "unknown", "HIDDEN": "cannot tell"}.get(state, what + state.lower())


def run_lines(root: Path, now: float | None = None,
              query: Callable[[list[str]], dict[str, dict[str, str]]] | None = None) -> list[dict[str, Any]]:
    """One row per run under ``root``: {path, name, state, step, max_steps, loss, age_s, problem}.

    ``query`` maps Slurm job ids to {state, reason} (default: one squeue call, then one sacct call
    for the ids squeue no longer knows).
    """
    now = time.time() if now is None else now
    runs = []
    for d in find_runs(root):
        paths = RunPaths.of(d)
        try:
            manifest = read_manifest(paths)
        except Exception as exc:  # noqa: BLE001 - one broken run must not hide the others
            runs.append((paths, None, str(exc)))
            continue
        runs.append((paths, manifest, None))
    slurm_ids = [str(j["job_id"]) for _, m, _ in runs if m and m.get("executor") != "local"
                 for j in m.get("jobs", [])]
    owners = {str(p.root): run_owner(p, m) for p, m, _ in runs if m}
    states = (query or slurm_states)(slurm_ids) if slurm_ids else {}
    me = current_user()
    rows = []
    for paths, manifest, problem in runs:
        metrics = read_metrics(paths.metrics)
        last = metrics.records[-1] if metrics.records else {}
        if manifest and manifest.get("executor") == "local":  # the manifest (and pids) alone, no Slurm
            from slurmft.watch.status import job_rows

            jobs = [{"kind": r["kind"], "state": r["state"], "reason": ""}
                    for r in job_rows(manifest, cancelled=cancels.read(paths))]
        else:
            owner = owners.get(str(paths.root), me)
            jobs = [{"kind": j["kind"], **states.get(str(j["job_id"]), {
                "state": missing_state(job_submitter(j, owner), me), "reason": ""})}
                    for j in (manifest or {}).get("jobs", [])]
        t_last = last.get("time") if isinstance(last.get("time"), (int, float)) else None
        if t_last is None:
            try:
                t_last = os.stat(paths.metrics if paths.metrics.exists() else paths.manifest).st_mtime
            except OSError:
                t_last = None
        rows.append({"path": str(paths.root), "name": (manifest or {}).get("name", paths.root.name),
                     "state": "broken" if manifest is None else run_word(jobs, result_info(paths) is not None),
                     "step": last.get("step"), "max_steps": max_steps_of(paths), "loss": last.get("loss"),
                     "age_s": round(now - t_last, 1) if t_last else None, "problem": problem,
                     "score": headline_score(read_summary(paths.root) or {}) or reward_score(metrics.records)})
    return rows


def reward_score(records: list[dict[str, Any]]) -> tuple[str, float] | None:
    """``("reward", mean reward of the last rollouts)`` for a GRPO run (its loss, advantage-weighted, is near 0 whatever
    the rewards, so the score column is what says how it goes), None for any other run; an evaluation's score
    comes first where the run has one."""
    rollouts = rollouts_of(records)
    return ("reward", float(rollouts["reward"])) if rollouts else None


def slurm_states(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """{job id: {state, reason}}: one squeue call (every job we may see, whoever submitted it), one sacct call for
    the ones squeue has forgotten."""
    queued = slurm.squeue_jobs() or {}
    out = {jid: {"state": queued[jid]["state"], "reason": queued[jid]["reason"]} for jid in job_ids if jid in queued}
    missing = [j for j in job_ids if j not in out]
    if missing:
        out.update({jid: {"state": i["state"], "reason": ""} for jid, i in (slurm.sacct_jobs(missing) or {}).items()})
    return out


def format_rows(rows: list[dict[str, Any]], root: Path) -> list[str]:
    """Aligned text lines: name, state, step/max, last loss, age, path relative to ``root``."""
    table = [("run", "state", "step", "loss", "score", "age", "dir")]
    for r in rows:
        step = f"{'-' if r['step'] is None else r['step']}/{'?' if r['max_steps'] is None else r['max_steps']}"
        loss = f"{r['loss']:.4f}" if isinstance(r["loss"], (int, float)) else "-"
        try:
            rel = os.path.relpath(r["path"], root)
        except ValueError:
            rel = r["path"]
        score = r.get("score")
        shown = f"{score[1]:.4g} ({score[0]})" if score else "-"
        table.append((r["name"], r["state"], step, loss, shown, fmt_age(r["age_s"]), rel))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in table]
