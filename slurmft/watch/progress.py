"""Where a run stands, read from its run directory alone: progress, checkpoint, attempts, model.

``metrics.jsonl`` (one JSON line per logged step, written by rank 0's ``MetricsLog``), the
checkpoint directories, the requeue markers and the manifest already hold everything a user asks
("which step, what loss, when will it end, what would it resume from, how often was it preempted"),
so these are pure functions of those files plus, for the attempts, the job rows
``slurmft.watch.status.job_rows`` made from one ``squeue`` and one ``sacct`` call. Nothing here calls
Slurm or imports torch: ``status``, ``runs``, ``plot`` and the report share it on a login node.

A file being written while we read it is normal (the job appends as we look), so a partial last
line or a garbage line is skipped and said in words, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml

from slurmft import cancels, slurm
from slurmft.checkpoints import COMPLETE_MARKER, latest_complete, step_of
from slurmft.dpoopts import PREFERENCE_METRICS
from slurmft.grpoopts import GRPO_METRICS, REWARD_METRIC
from slurmft.rundir import SAVE_EVENT, RunPaths, planned_max_steps
from slurmft.slurm_states import State, is_live, is_unseen, parse, words
from slurmft.trackers import read_tracker, tracker_lines
from slurmft.units import binary_bytes, fmt_duration
from slurmft.watch.results import adapter_info, lora_info, lora_words, merge_setting, model_info, model_lines

# How many of the newest records the rate (steps/s, tokens/s) is measured over.
RECENT = 20

# How an attempt ended, in words (the ``reason`` of an attempt row).
PREEMPTED_REQUEUED = "preempted (warning signal), requeued"
REQUEUED_BY_SLURM = "requeued by Slurm (preempted or node failure; resumed from the last periodic checkpoint)"
REQUEUE_REFUSED = "preempted (warning signal), not requeued: preemption.max_requeues reached"
STARTUP_REQUEUED = "stopped during start-up (no save), requeued"
TIME_LIMIT_REQUEUED = "time limit: saved, requeued"
SLURM_REQUEUED_SAVED = "saved, then requeued by Slurm (scontrol requeue or preemption)"
CANCELLED_SAVED = "cancelled (scancel) after saving"
RESUME_FROM_SAVE = "; `slurmft resume` continues from that step"  # said until a later resume has done so
RESUMED_BY_HAND = "resumed by hand"


@dataclass
class Metrics:
    """The readable records of ``metrics.jsonl`` (file order) and what was wrong with the rest."""

    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)  # ``"event": "save"`` lines: one per complete save


def read_metrics(path: Path) -> Metrics:
    """Records with an integer ``step`` (saves apart); a missing file, a partial last line or a garbage line is a
    problem."""
    out = Metrics()
    try:
        text = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        out.problems.append(f"no {path.name} yet (no step logged: the job has not reached its first step)")
        return out
    except OSError as exc:
        out.problems.append(f"cannot read {path}: {exc.strerror}")
        return out
    lines = text.split("\n")
    partial = lines.pop() if lines else ""  # after the last newline: a line still being written
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            (out.saves if rec.get("event") == SAVE_EVENT else out.records).append(rec)
        else:
            bad += 1
    if partial.strip():
        try:
            rec = json.loads(partial)
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                (out.saves if rec.get("event") == SAVE_EVENT else out.records).append(rec)
        except ValueError:
            out.problems.append(f"{path.name}: the last line is incomplete (being written), skipped")
    if bad:
        out.problems.append(f"{path.name}: {bad} unreadable line(s) skipped")
    return out


def max_steps_of(paths: RunPaths) -> int | None:
    """``train.max_steps`` of the run's resolved config (or the steps planned for ``train.epochs``), or None
    when it cannot be read (raw YAML on purpose: ``runs`` and ``status`` still show a run whose config.yaml
    no longer validates)."""
    try:
        train = (yaml.safe_load(paths.config.read_text()) or {}).get("train", {})
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    value = planned_max_steps(paths, train.get("max_steps"), train.get("epochs"))
    return value if isinstance(value, int) else None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _segment_key(rec: dict[str, Any]) -> tuple[str, int]:
    return str(rec.get("job_id", "")), int(rec.get("restart") or 0)


def mean_tokens_per_s(records: list[dict[str, Any]]) -> float | None:
    """The tokens per second of ``records`` together: the tokens they trained over the seconds it took, each record's
    ``tokens_per_s`` weighed by the ``interval_s`` it was measured over. A plain mean of the rates counts a quick
    GRPO step that reuses buffered completions as much as the slow one that generated them, so it overstates the
    throughput. Records without ``interval_s`` (written by an older slurmft) are averaged plainly. None: no rate."""
    rated = [(v, _num(r.get("interval_s"))) for r in records if (v := _num(r.get("tokens_per_s"))) is not None]
    if not rated:
        return None
    if all(w is not None and w > 0 for _, w in rated):
        return sum(v * w for v, w in rated) / sum(w for _, w in rated)  # type: ignore[operator, misc]
    return sum(v for v, _ in rated) / len(rated)


def rate(records: list[dict[str, Any]], recent: int = RECENT) -> tuple[float | None, float | None]:
    """(steps/s, tokens/s) over the newest ``recent`` records of the newest attempt.

    Only records of the attempt that logged last count: the gap between two attempts is queue
    time, not training speed, and the ETA is about the attempt that is running.
    """
    if not records:
        return None, None
    key = _segment_key(records[-1])
    tail: list[dict[str, Any]] = []
    for rec in reversed(records):
        if _segment_key(rec) != key or len(tail) >= recent:
            break
        tail.append(rec)
    tail.reverse()
    tokens_per_s = mean_tokens_per_s(tail)
    t0, t1 = _num(tail[0].get("time")), _num(tail[-1].get("time"))
    steps = tail[-1]["step"] - tail[0]["step"]
    if t0 is None or t1 is None or t1 <= t0 or steps <= 0:
        return None, tokens_per_s
    return steps / (t1 - t0), tokens_per_s


def progress(paths: RunPaths, cfg_max_steps: int | None) -> dict[str, Any]:
    """``{step, max_steps, loss, tokens_per_s, eta_s, problem}`` from ``metrics.jsonl``.

    ``eta_s`` is at the recent rate (see :func:`rate`); ``problem`` says in words why a field is
    None (no metrics yet, unreadable lines), else it is None.
    """
    return progress_of(read_metrics(paths.metrics), cfg_max_steps)


def progress_of(metrics: Metrics, max_steps: int | None) -> dict[str, Any]:
    """:func:`progress` over already-read metrics."""
    out: dict[str, Any] = {"step": None, "max_steps": max_steps, "loss": None, "tokens_per_s": None,
                           "eta_s": None, "preference": None, "rollouts": None, "problem": "; ".join(metrics.problems) or None}
    if not metrics.records:
        return out
    last = metrics.records[-1]
    steps_per_s, tokens_per_s = rate(metrics.records)
    out.update(step=last["step"], loss=_num(last.get("loss")),
               tokens_per_s=round(tokens_per_s, 2) if tokens_per_s is not None else None,
               preference=preference_of(last), rollouts=rollouts_of(metrics.records))
    if max_steps is not None and last["step"] >= max_steps:
        out["eta_s"] = 0.0
    elif max_steps is not None and steps_per_s:
        out["eta_s"] = round((max_steps - last["step"]) / steps_per_s, 1)
    return out


def preference_of(record: dict[str, Any]) -> dict[str, float] | None:
    """A DPO step's own metrics (TRL's names, slurmft/dpoopts.py), or None for an SFT step."""
    found = {name: record[name] for name in PREFERENCE_METRICS if isinstance(record.get(name), (int, float))}
    return found or None


def rollouts_of(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """A GRPO run's rollout metrics (TRL's names, slurmft/grpoopts.py): the reward, its spread, each function's mean
    and the completion length of the last step that generated (TRL logs them there only; ``step``), the KL of the
    last step; None for other runs."""
    scored = next((r for r in reversed(records) if isinstance(r.get("reward"), (int, float))), None)
    if scored is None:
        return None
    found = {k: v for k, v in scored.items()
             if (k in GRPO_METRICS or REWARD_METRIC.match(k)) and isinstance(v, (int, float))}
    found.pop("kl", None)
    if isinstance(records[-1].get("kl"), (int, float)):
        found["kl"] = records[-1]["kl"]
    return {**found, "step": scored["step"]}


def rollouts_words(values: dict[str, float]) -> str:
    """``reward 0.7573 ± 0.0669 (exact_match 0.5000, format 0.2500) at step 3, KL 0.0095, completions 8.0 tokens``."""
    per = [f"{k.split('/')[1]} {v:.4f}" for k, v in values.items() if REWARD_METRIC.match(k)]
    spread = f" ± {values['reward_std']:.4f}" if "reward_std" in values else ""
    parts = [f"reward {values['reward']:.4f}{spread}" + (f" ({', '.join(per)})" if per else "")
             + f" at step {values['step']:g}"]
    if "kl" in values:
        parts.append(f"KL {values['kl']:.4f}")
    if "completions/mean_length" in values:
        parts.append(f"completions {values['completions/mean_length']:.1f} tokens")
    return ", ".join(parts)


def preference_words(values: dict[str, float]) -> str:
    """``reward margin 0.0123, accuracy 0.62 (rewards: chosen -0.0100, rejected -0.0223)``, with what there is."""
    parts = []
    if "rewards/margins" in values:
        parts.append(f"reward margin {values['rewards/margins']:.4f}")
    if "rewards/accuracies" in values:
        parts.append(f"accuracy {values['rewards/accuracies']:.2f}")
    sides = [f"{side} {values[f'rewards/{side}']:.4f}" for side in ("chosen", "rejected") if f"rewards/{side}" in values]
    return ", ".join(parts) + (f" (rewards: {', '.join(sides)})" if sides else "")


def dir_bytes(path: Path) -> int:
    """Bytes of every regular file under ``path`` (``st_size``; symlinks not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # pruned while we walk
                continue
            total += st.st_size
    return total


def saves_info(saves: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's complete saves (metrics.jsonl's save lines, every attempt): how many of each mode, how long
    training waited per save and how long a save took to become durable (means), and the newest; None: none yet."""
    if not saves:
        return None

    def mean(mode: str, key: str) -> float | None:
        values = [v for r in saves if r.get("mode") == mode and (v := _num(r.get(key))) is not None]
        return round(sum(values) / len(values), 3) if values else None

    last = saves[-1]
    return {"count": len(saves),
            "by_mode": {m: {"count": sum(r.get("mode") == m for r in saves), "blocked_s": mean(m, "blocked_s"),
                            "durable_s": mean(m, "durable_s")}
                        for m in ("async", "sync") if any(r.get("mode") == m for r in saves)},
            "last": {k: last.get(k) for k in ("step", "mode", "blocked_s", "durable_s", "bytes")}}


def saves_line(info: dict[str, Any] | None) -> str | None:
    """:func:`saves_info` in words: ``saves: 3 async (training waited 0.12 s each, durable after 1.9 s), ...``."""
    if not info:
        return None
    parts = []
    for mode, m in info["by_mode"].items():
        waited = f"training waited {m['blocked_s']:.2f} s" if m["blocked_s"] is not None else "-"
        durable = f", durable after {m['durable_s']:.2f} s" if m["durable_s"] is not None else ""
        parts.append(f"{m['count']} {'asynchronous' if mode == 'async' else 'synchronous'} ({waited}{durable}, mean)")
    last = info["last"]
    size = f", {binary_bytes(last['bytes'])}" if isinstance(last.get("bytes"), int) else ""
    return f"saves: {', '.join(parts)}; newest checkpoint-{last['step']} ({last['mode']}{size})"


def checkpoint_info(paths: RunPaths, now: float | None = None) -> dict[str, Any] | None:
    """``{step, path, age_s, bytes}`` of the newest complete checkpoint (what a resume starts from), or None."""
    ckpt = latest_complete(paths.checkpoints)
    if ckpt is None:
        return None
    try:
        saved = (ckpt / COMPLETE_MARKER).stat().st_mtime
    except OSError:  # pruned between the listing and now
        return None
    now = time.time() if now is None else now
    return {"step": step_of(ckpt), "path": str(ckpt), "age_s": round(max(0.0, now - saved), 1),
            "bytes": dir_bytes(ckpt)}


def requeue_markers(paths: RunPaths) -> dict[tuple[str, int], dict[str, Any]]:
    """Requeue markers ``requeue/<job>-<restart>`` as {(job id, restart): their JSON (step, t)}."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    if not paths.requeue_marker_dir.is_dir():
        return out
    for marker in paths.requeue_marker_dir.iterdir():
        key = RunPaths.requeue_marker_key(marker.name)
        if key is None:
            continue
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            info = {}
        out[key] = info if isinstance(info, dict) else {}
    return out


@dataclass
class Segment:
    """Consecutive metrics records of one (job id, restart)."""

    job_id: str
    restart: int
    records: list[dict[str, Any]]

    @property
    def first_step(self) -> int:
        return self.records[0]["step"]

    @property
    def last_step(self) -> int:
        return max(r["step"] for r in self.records)


def segments(records: Iterable[dict[str, Any]]) -> list[Segment]:
    """Split records (file order) where the (job id, restart) changes: one segment per attempt that logged."""
    out: list[Segment] = []
    for rec in records:
        job, restart = _segment_key(rec)
        if out and (out[-1].job_id, out[-1].restart) == (job, restart):
            out[-1].records.append(rec)
        else:
            out.append(Segment(job, restart, [rec]))
    return out


def allocation_words(row: dict[str, Any]) -> str:
    """`` on 2 nodes x 8 ranks`` for an attempt row that knows its allocation, else ``""``; a GRPO vLLM server's
    nodes (``server_nodes``) are not training ranks: `` on 2 training nodes x 8 ranks + 1 vLLM server node``."""
    nodes, ranks, served = row.get("nodes"), row.get("ranks_per_node"), row.get("server_nodes") or 0
    if not isinstance(nodes, int) or not isinstance(ranks, int) or not isinstance(served, int):
        return ""
    train = nodes - served
    words = f" on {train} {'training ' if served else ''}node{'s' if train != 1 else ''} x {ranks} " \
            f"rank{'s' if ranks != 1 else ''}"
    return words + (f" + {served} vLLM server node{'s' if served != 1 else ''}" if served else "")


def attempts(manifest: dict[str, Any], metrics_records: list[dict[str, Any]], slurm_rows: list[dict[str, Any]],
             markers: dict[tuple[str, int], dict[str, Any]] | None = None,
             max_steps: int | None = None, cancelled: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per (train job id, Slurm restart), oldest first, saying how each attempt ended.

    Rows: ``{job_id, restart, how, state, reason, start, end, first_step, last_step, resumed_from_step,
    nodes, ranks_per_node}`` (the last two from the manifest's attempt, None in manifests from before them).
    ``how`` is where the attempt came from: ``submit``, ``requeue`` (Slurm restarted the same job id)
    or ``resume`` (``slurmft resume``). ``start``/``end`` are the times (unix) of its first and last
    logged step (the requeue marker's time when later); None when it logged nothing.
    ``resumed_from_step`` is the checkpoint step it started from: the requeue marker's step or the
    manifest's ``resumed_from_step`` when known, else the step before its first logged step.
    ``markers`` are :func:`requeue_markers` (a marker means "saved after a warning signal"); with
    ``max_steps``, an attempt whose Slurm state is unknown but that logged the last step is completed.
    ``cancelled`` (:func:`slurmft.cancels.read`) names who cancelled a job with ``slurmft cancel``, so the attempt
    it ended says so as the job's line does, not "scancel".
    """
    markers = markers or {}
    rows_by_id = {r["job_id"]: r for r in slurm_rows if r.get("kind") == "train"}
    train_jobs = [j for j in manifest.get("jobs", []) if j.get("kind") == "train"]
    by_job_attempt = {str(a.get("train_job")): a for a in manifest.get("attempts", []) or []
                      if isinstance(a, dict)}
    segs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rec in metrics_records:
        segs.setdefault(_segment_key(rec), []).append(rec)

    out: list[dict[str, Any]] = []
    for index, job in enumerate(train_jobs):
        jid = str(job["job_id"])
        row = rows_by_id.get(jid, {})
        restarts = {0} | {r for j, r in segs if j == jid} | {r for j, r in markers if j == jid}
        restarts |= set(range(int(row.get("restarts") or 0) + 1))
        last_restart = max(restarts)
        later_job = index + 1 < len(train_jobs)
        record = by_job_attempt.get(jid, {})
        for restart in sorted(restarts):
            recs = segs.get((jid, restart), [])
            marker = markers.get((jid, restart))
            first = recs[0]["step"] if recs else None
            last = max(r["step"] for r in recs) if recs else None
            times = [t for t in (_num(r.get("time")) for r in recs) if t is not None]
            end = max(times) if times else None
            if marker and _num(marker.get("t")) is not None:
                end = max(end or 0.0, float(marker["t"]))
            resumed = record.get("how") == "resume" or (index > 0 and not record)  # old manifests: no attempts
            how = "requeue" if restart > 0 else ("resume" if resumed else "submit")
            resumed_from = _resumed_from(jid, restart, how, record, markers, first)
            live = False
            if restart < last_restart:
                state = "REQUEUED"
                reason = _requeued_words(marker)
            else:
                state = _final_state(job, row, manifest, jid, later_job)
                if state in ("", "UNKNOWN") and max_steps is not None and last is not None and last >= max_steps:
                    state = "COMPLETED"
                reason = _ended_words(state, marker is not None, marker, (cancelled or {}).get(jid), later_job)
                live = is_live(state)
                if parse(state) == State.PENDING and row.get("reason") and row.get("words"):
                    reason = row["words"]  # why it waits, as its job's line says: on its prepare job, not "the queue"
                if later_job:
                    reason = f"{reason}, {RESUMED_BY_HAND}" if reason else RESUMED_BY_HAND
            out.append({"job_id": jid, "restart": restart, "how": how, "state": state or "UNKNOWN",
                        "reason": reason, "start": min(times) if times else None,
                        "end": None if live else end,
                        "first_step": first, "last_step": last, "resumed_from_step": resumed_from,
                        "nodes": record.get("nodes"), "ranks_per_node": record.get("ranks_per_node"),
                        "server_nodes": record.get("server_nodes")})
    return out


def attempt_line(k: int, a: dict[str, Any]) -> str:
    """One attempt in ``status``'s words. An attempt that has not logged a step leaves out what it does not have: it
    said ``(submit, from step -): no step on 1 node x 2 ranks, - .. -: waiting in the queue``."""
    fmt = "%m-%d %H:%M:%S"
    since = f", from step {a['resumed_from_step']}" if a["resumed_from_step"] is not None else ""
    if a["first_step"] is not None:
        steps = f"steps {a['first_step']}-{a['last_step']}"
    else:
        steps = "no step yet" if is_live(a["state"]) else "no step"
    start = time.strftime(fmt, time.localtime(a["start"])) if a["start"] else "-"
    end = time.strftime(fmt, time.localtime(a["end"])) if a["end"] else "-"
    when = f", {start} .. {end}" if a["start"] or a["end"] else ""
    return (f"  {k}. job {a['job_id']} restart {a['restart']} ({a['how']}{since}): {steps}{allocation_words(a)}{when}: "
            f"{a['reason']}")


def _resumed_from(jid: str, restart: int, how: str, record: dict[str, Any],
                  markers: dict[tuple[str, int], dict[str, Any]], first: int | None) -> int | None:
    if restart > 0 and isinstance(markers.get((jid, restart - 1), {}).get("step"), int):
        return markers[(jid, restart - 1)]["step"]
    if how == "resume" and isinstance(record.get("resumed_from_step"), int):
        return record["resumed_from_step"]
    if first is not None:
        return first - 1
    return None


def _final_state(job: dict[str, Any], row: dict[str, Any], manifest: dict[str, Any], jid: str,
                 later_job: bool) -> str:
    """The state a job ended in (or is in): Slurm's row, else what a later resume recorded, else the manifest."""
    state = str(row.get("state") or "")
    if state and state != "UNKNOWN":
        return state
    if later_job:
        for attempt in manifest.get("attempts", []) or []:
            prev = attempt.get("previous") if isinstance(attempt, dict) else None
            if isinstance(prev, dict) and str(prev.get("job_id")) == jid and prev.get("state"):
                return str(prev["state"]).split()[0]
    return str(job.get("state") or state or "UNKNOWN")


def _requeued_words(marker: dict[str, Any] | None) -> str:
    """Why an attempt was followed by a restart of the same job id, from the ranks' stop marker
    (``saved``) and the batch script's decision (``ended``, slurmft/job/requeue.py)."""
    if marker is None:
        return REQUEUED_BY_SLURM
    if marker.get("saved") is False:
        return STARTUP_REQUEUED
    return {"slurm_requeue": SLURM_REQUEUED_SAVED, "time_limit": TIME_LIMIT_REQUEUED}.get(
        str(marker.get("ended")), PREEMPTED_REQUEUED)


def _ended_words(state: str, saved_for_requeue: bool, marker: dict[str, Any] | None = None,
                 cancel: dict[str, Any] | None = None, resumed: bool = False) -> str:
    """How an attempt ended. ``resumed``: a later train job continued the run, so an attempt cancelled after its
    save no longer says to run `slurmft resume` (it said so beside "resumed by hand")."""
    if marker is not None and state == "CANCELLED" and marker.get("ended") == "cancelled" and marker.get("saved"):
        said = CANCELLED_SAVED.replace("cancelled (scancel)", cancels.words(cancel)) if cancel else CANCELLED_SAVED
        return said if resumed else said + RESUME_FROM_SAVE
    if saved_for_requeue and parse(state) == State.FAILED:
        return REQUEUE_REFUSED
    return words(state)


def lost_to_preemption(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the restarts cost: steps computed twice and the time between attempts.

    For each attempt after the first: recomputed steps = the previous attempt's last step minus the
    step this attempt resumed from (0 after a warning-signal save, the steps since the last periodic
    checkpoint after a hard kill), costed at the previous attempt's own seconds per step; the gap =
    this attempt's first step time minus the previous attempt's end (queue wait plus start-up).
    """
    recomputed_steps, recomputed_s, gap_s = 0, 0.0, 0.0
    per_boundary = []
    logged = [r for r in rows if r["first_step"] is not None]
    for prev, cur in pairwise(logged):
        steps = max(0, prev["last_step"] - (cur["resumed_from_step"] if cur["resumed_from_step"] is not None
                                            else cur["first_step"] - 1))
        span = prev["last_step"] - prev["first_step"]
        sec_per_step = (prev["end"] - prev["start"]) / span if span > 0 and prev["end"] and prev["start"] else None
        cost = steps * sec_per_step if sec_per_step else 0.0
        gap = max(0.0, cur["start"] - prev["end"]) if cur["start"] and prev["end"] else 0.0
        recomputed_steps += steps
        recomputed_s += cost
        gap_s += gap
        per_boundary.append({"job_id": cur["job_id"], "restart": cur["restart"], "recomputed_steps": steps,
                             "recomputed_s": round(cost, 1), "gap_s": round(gap, 1)})
    return {"recomputed_steps": recomputed_steps, "recomputed_s": round(recomputed_s, 1),
            "gap_s": round(gap_s, 1), "total_s": round(recomputed_s + gap_s, 1), "boundaries": per_boundary}


# One progress line of ``datasets`` (tqdm) in the prepare job's log: ``Tokenizing train dataset (num_proc=8):
# 45%|####5     | 450/1000 [00:01<00:02, 536.19 examples/s]`` (lines end in ``\r``; TQDM_MININTERVAL apart).
PROGRESS_RE = re.compile(r"(?P<desc>[^\r\n|]+?):\s+\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+) "
                         r"\[(?P<elapsed>[\d:]+)<(?P<eta>[\d:?]+), *(?P<rate>[^\]]+)\]")


def last_progress(log_text: str) -> str | None:
    """The newest progress line of a prepare job's log, in words (rows done, rows/s, ETA), or None."""
    found = None
    for found in PROGRESS_RE.finditer(log_text):  # noqa: B007 - the last one is kept
        pass
    if found is None:
        return None
    return (f"{found['desc'].strip()}: {int(found['n']):,}/{int(found['total']):,} rows, {found['rate'].strip()}, "
            f"ETA {found['eta']}")


def log_progress(log: Path) -> str | None:
    """The newest progress line of a prepare job's log (:func:`last_progress`) from the end of its file and, for a
    local job's ``<id>_0_log.out``, of the ``.err`` beside it, where submitit puts the job's stderr and so datasets'
    progress bars (reading the ``.out`` alone, ``status`` of a local run never showed one)."""
    text = ""
    for path in (log, log.with_suffix(".err")) if log.name.endswith("_log.out") else (log,):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 65536))
                text += f.read().decode(errors="replace") + "\n"
        except OSError:
            continue
    return last_progress(text)


def prepare_info(paths: RunPaths, manifest: dict[str, Any], slurm_rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``prepared/``'s counts (:func:`slurmft.prepared.summary_line`), and while the newest prepare job is live, its
    newest progress line; None for a run without either."""
    from slurmft import prepared

    out: dict[str, Any] = {}
    record = prepared.read_record(paths)
    if record is not None:
        out.update(summary=prepared.summary_line(record), result=record.get("result"))
    rows = [r for r in slurm_rows if r["kind"] == "prepare"]
    jobs = {j["job_id"]: j for j in manifest.get("jobs", []) if j["kind"] == "prepare"}
    if rows and is_live(rows[-1]["state"]):
        job = jobs.get(rows[-1]["job_id"], {})
        log = Path(job.get("log") or (job.get("logs") or [""])[0] or paths.log_file("prepare", rows[-1]["job_id"]))
        out["running"] = {"job_id": rows[-1]["job_id"], "progress": log_progress(log)}
        if slurm.task_count(job) > 1:  # a prepare array: its shards so far, and the total
            out["running"]["array"] = prepared.array_progress(paths.prepared_parts(job["job_id"]), slurm.task_count(job))
    return out or None


def overview(paths: RunPaths, manifest: dict[str, Any], slurm_rows: list[dict[str, Any]],
             max_steps: int | None = None) -> dict[str, Any]:
    """What ``slurmft status --json`` adds beside ``jobs``: ``{progress, checkpoint, attempts, model, lost, tracker,
    lora, saves}`` (``tracker``: ``tracker.json``, the W&B run every attempt logs to, or None; ``lora``: :func:`lora_info`;
    ``saves``: :func:`saves_info`).

    ``slurm_rows`` are :func:`slurmft.watch.status.job_rows` of ``manifest`` (no Slurm call here);
    ``max_steps`` defaults to the run config's ``train.max_steps``.
    """
    max_steps = max_steps_of(paths) if max_steps is None else max_steps
    metrics = read_metrics(paths.metrics)
    rows = attempts(manifest, metrics.records, slurm_rows, markers=requeue_markers(paths), max_steps=max_steps,
                    cancelled=cancels.read(paths))
    prog = progress_of(metrics, max_steps)
    if prog["eta_s"] and not training_may_go_on(slurm_rows):
        prog["eta_s"] = None  # a cancelled or failed run goes on only when `slurmft resume` continues it
    return {"progress": prog, "checkpoint": checkpoint_info(paths), "attempts": rows,
            "model": model_info(paths), "lost": lost_to_preemption(rows), "tracker": read_tracker(paths),
            "adapter": adapter_info(paths),
            "merge": merge_setting(paths),
            "lora": lora_info(paths), "saves": saves_info(metrics.saves),
            "prepared": prepare_info(paths, manifest, slurm_rows)}


def training_may_go_on(slurm_rows: list[dict[str, Any]]) -> bool:
    """Whether a train job of the run may still run by itself (or is one we cannot see): only then has the run an
    ETA. A run cancelled at step 12 of 80 said "ETA 51s" at the rate of its dead attempt."""
    return any(r["kind"] == "train" and (is_live(r["state"]) or is_unseen(r["state"])) for r in slurm_rows)


def overview_lines(ov: dict[str, Any]) -> list[str]:
    """:func:`overview` in words, for ``slurmft status`` without ``--json``."""
    p, ck = ov["progress"], ov["checkpoint"]
    if p["step"] is None:
        lines = [f"progress: {p['problem'] or 'no step logged yet'}"]
    else:
        loss = f"{p['loss']:.4f}" if p["loss"] is not None else "-"
        tps = f", {p['tokens_per_s']:.0f} tokens/s" if p["tokens_per_s"] is not None else ""
        eta = f", ETA {fmt_duration(p['eta_s'])}" if p["eta_s"] else (", done" if p["eta_s"] == 0 else "")
        lines = [f"progress: step {p['step']}/{p['max_steps'] or '?'}, loss {loss}{tps}{eta}"]
        if p.get("preference"):
            lines.append(f"  DPO: {preference_words(p['preference'])}")
        if p.get("rollouts"):
            lines.append(f"  GRPO: {rollouts_words(p['rollouts'])}")
        if p["problem"]:
            lines.append(f"  note: {p['problem']}")
    if ov.get("lora"):
        lines.append(f"method: {lora_words(ov['lora'])}")
    prep = ov.get("prepared") or {}
    if prep.get("running"):
        lines.append(f"preparing (job {prep['running']['job_id']}): {prep['running']['progress'] or 'starting'}")
        if prep["running"].get("array"):
            lines.append(f"prepare array {prep['running']['job_id']}: {prep['running']['array']}")
    if prep.get("summary"):
        lines.append(f"prepared data: {prep['summary']}")
    lines.append(f"checkpoint: step {ck['step']}, {fmt_duration(ck['age_s'])} old, {binary_bytes(ck['bytes'])} "
                 f"({ck['path']})" + (" (adapters and their optimizer state only)" if ov.get("lora") else "")
                 if ck else "checkpoint: none complete yet")
    if line := saves_line(ov.get("saves")):
        lines.append(line)
    lines.append("attempts:")
    lines += [attempt_line(k, a) for k, a in enumerate(ov["attempts"], start=1)]
    lost = ov.get("lost") or {}
    if lost.get("boundaries"):
        lines.append(f"lost to restarts: {lost['recomputed_steps']} step(s) again, "
                     f"{fmt_duration(lost['gap_s'])} between attempts")
    return lines + model_lines(ov.get("adapter"), ov["model"], ov.get("merge")) + tracker_lines(ov.get("tracker"))
