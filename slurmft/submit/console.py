"""What the local executor prints while a run's jobs run here: each job's name (:data:`JOB_NAMES`), one line per step
and per complete save that rank 0 appends to ``metrics.jsonl``, each once and in order, a prepare job's progress line,
and how each job ended (:func:`wait_local` waits on the job and says them)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft import cancels
from slurmft.errors import Cancelled, RunDirError, SubmissionError
from slurmft.rundir import SAVE_EVENT, RunPaths, array_tasks, read_manifest, write_manifest
from slurmft.units import binary_bytes

#: What a job of each kind is called in what submit, resume and the other commands that start jobs say (one name per
#: kind: a local submit said "consolidation job J started" then "consolidate job J completed"). The kind itself
#: (``--job consolidate``, status's table) stays the key users type.
JOB_NAMES = {"prepare": "prepare", "train": "train", "consolidate": "consolidation", "serve": "serve check",
             "eval": "evaluation"}


class MetricsFollower:
    """Every step rank 0 appends to ``metrics.jsonl``, one line each, in order (a console that printed
    only the newest record each second dropped the steps logged in between)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_lines(self) -> list[str]:
        """One line per record completed since the last call; a partly written last line waits."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        lines = []
        for raw in complete.decode(errors="replace").splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == SAVE_EVENT:
                lines.append(save_line(rec))
            elif isinstance(rec, dict) and "step" in rec:
                lines.append(step_line(rec))
        return lines


def save_line(rec: dict[str, Any]) -> str:
    """``saved checkpoint-6 (async: training waited 0.12 s, durable after 0.9 s, 64.0 MiB)``: a save line of
    metrics.jsonl (written once the checkpoint is complete), not a step of its own."""
    how = [f"training waited {rec['blocked_s']:.2f} s" if isinstance(rec.get("blocked_s"), int | float) else "",
           f"durable after {rec['durable_s']:.1f} s" if isinstance(rec.get("durable_s"), int | float) else "",
           binary_bytes(rec["bytes"]) if isinstance(rec.get("bytes"), int) else ""]
    detail = ", ".join(part for part in how if part)
    mode = f"{rec['mode']}: " if rec.get("mode") and detail else str(rec.get("mode") or "")
    return f"saved checkpoint-{rec.get('step')}" + (f" ({mode}{detail})" if mode or detail else "")


def step_line(rec: dict[str, Any]) -> str:
    """``step 7 loss=2.31 learning_rate=1e-05 ...``: what the local console prints for one step."""
    parts = [f"step {rec.get('step')}"]
    for key in ("loss", "learning_rate", "grad_norm", "tokens_per_s", "reward", "reward_std"):  # reward: GRPO's
        if isinstance(rec.get(key), int | float):
            parts.append(f"{key}={rec[key]:.4g}")
    return " ".join(parts)


#: How often a local prepare job's newest progress line (datasets' rows/s and ETA) is said while it runs: a corpus
#: takes minutes to hours, and its bars go to the job's log, not to the terminal that waits.
PREPARE_PROGRESS_EVERY_S = 30.0


def job_lines(run_dir: Path, executor: str, jobs: dict[str, str]) -> list[str]:
    """Submit's and resume's closing lines, one per job they started (``consolidation job: 13``)."""
    return [f"{JOB_NAMES[kind]} job: {job_ids_words(run_dir, job_id) if executor == 'local' else job_id}"
            for kind, job_id in jobs.items()]


def job_ids_words(run_dir: Path, job_id: str) -> str:
    """What submit's closing lines say of a local job: its id, or all its tasks' ids when it is the last task of a
    local prepare array (it said only the last one's, as if task 1 had not run)."""
    try:
        manifest = read_manifest(RunPaths.of(run_dir))
    except RunDirError:
        return job_id
    job = next((j for j in reversed(manifest.get("jobs", [])) if str(j["job_id"]) == str(job_id)), None)
    tasks = array_tasks(manifest, job) if job is not None else []
    if len(tasks) < 2:
        return job_id
    return (f"{', '.join(str(t['job_id']) for t in tasks)} (the {len(tasks)} tasks of its array, run here one after "
            "another)")


def wait_local(job: Any, kind: str, paths: RunPaths, manifest: dict[str, Any], say: Callable[[str], None],
               what: str | None = None) -> None:
    """Wait for a local job, showing progress from metrics.jsonl (a prepare job: its log's progress line, every
    :data:`PREPARE_PROGRESS_EVERY_S`); record its final state. ``what`` names it in what is said (default: its kind's
    name, :data:`JOB_NAMES`, and its id; a task of a local array: the task)."""
    from slurmft.watch.progress import log_progress

    what = what or f"{JOB_NAMES[kind]} job {job.job_id}"
    t0 = shown_at = time.time()
    steps = MetricsFollower(paths.metrics)
    logs, shown = manifest["jobs"][-1].get("logs") or [], None
    try:
        while not job.done():
            time.sleep(1.0)
            if kind == "train":
                for line in steps.new_lines():
                    say(f"  {line}")
            elif kind == "prepare" and logs and time.time() - shown_at >= PREPARE_PROGRESS_EVERY_S:
                shown_at, line = time.time(), log_progress(Path(logs[0]))
                if line and line != shown:
                    say(f"  {line}")
                    shown = line
        if kind == "train":
            for line in steps.new_lines():  # the steps logged in the last second
                say(f"  {line}")
    except KeyboardInterrupt:  # the local job would outlive us: stop it, and say where it stood
        job.cancel(check=False)
        manifest["jobs"][-1]["state"] = "CANCELLED"
        write_manifest(paths, manifest)
        say(f"{what} cancelled (Ctrl-C); complete checkpoints stay in {paths.checkpoints}")
        raise
    by = cancels.read(paths).get(str(job.job_id))  # `slurmft cancel` wrote it before its signal
    if by:  # not job.results(): it waits 15 s for the result a cancelled job never writes
        manifest["jobs"][-1]["state"] = "CANCELLED"
        write_manifest(paths, manifest)
        raise Cancelled(f"{what} {cancels.words(by)}; complete checkpoints stay in "
                        f"{paths.checkpoints}: `slurmft resume {paths.root}` continues")
    state = "COMPLETED"
    try:
        job.results()
    except Exception as exc:  # noqa: BLE001 - the job's own log says why; show its end
        state = "FAILED"
        manifest["jobs"][-1]["state"] = state
        write_manifest(paths, manifest)
        logs = manifest["jobs"][-1].get("logs", [])
        tail = log_tail(logs) or str(exc).strip().splitlines()[-1:]  # no log: what submitit reported
        raise SubmissionError(
            f"{what} failed after {time.time() - t0:.0f}s; the end of its log:",
            tail + [f"logs: {', '.join(logs)}"],
        ) from None
    manifest["jobs"][-1]["state"] = state
    manifest["jobs"][-1]["elapsed_s"] = round(time.time() - t0, 1)
    write_manifest(paths, manifest)
    say(f"{what} {state.lower()} in {time.time() - t0:.0f}s")


def log_tail(logs: list[str], lines: int = 8) -> list[str]:
    """Last lines of the first rank's stderr (submitit keeps .err next to .out), else its stdout."""
    for log in logs:
        for path in (Path(log).with_suffix(".err"), Path(log)):
            if path.is_file():
                text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
                if text:
                    return text[-lines:]
    return []
