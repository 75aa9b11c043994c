"""Find and tail a run's log files, and the end of every point's of a sweep."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft import locks
from slurmft.errors import RunDirError
from slurmft.rundir import RunPaths, array_tasks, latest_jobs, read_manifest

#: Why a run may have no job of a kind, and what makes one.
_NO_JOB_WHY = {
    "consolidate": "consolidate.enabled was false, or training has not finished: `slurmft consolidate RUN_DIR` submits "
                   "one",
    "prepare": "prepare.enabled was false, or the data was prepared before the submit",
    "serve": "its config has no serve: section, or consolidation has not finished: `slurmft serve RUN_DIR "
             "[serve.KEY=VALUE ...]` submits one",
    "eval": "its config has no eval: section, or consolidation has not finished: `slurmft eval RUN_DIR "
            "[eval.tasks=[...] ...]` submits one",
}


def _no_job(paths: RunPaths, kind: str) -> RunDirError:
    """The error for ``logs --job KIND`` on a run that never had such a job, with why that may be."""
    why = _NO_JOB_WHY.get(kind, "it has not been submitted")
    return RunDirError(f"run {paths.root} has no {kind} job ({why})")


def newest_job(paths: RunPaths, kind: str) -> dict[str, Any]:
    """The manifest's newest job of ``kind``, or the error saying why the run has none."""
    job = latest_jobs(read_manifest(paths)).get(kind)
    if job is None:
        raise _no_job(paths, kind)
    return job


class UnknownJobId(RunDirError):
    """``logs --job-id ID`` of an id the run's manifest does not record (the message names those it does)."""


def job_with_id(paths: RunPaths, job_id: str) -> dict[str, Any]:
    """The manifest's job with this id, of whatever kind (``logs --job-id``: an older consolidation a later one
    superseded, the first of two evaluations), or the error naming the run's ids, by kind."""
    jobs = read_manifest(paths).get("jobs", [])
    job = next((j for j in jobs if str(j["job_id"]) == job_id), None)
    if job is None:
        ids: dict[str, list[str]] = {}
        for j in jobs:
            ids.setdefault(j["kind"], []).append(str(j["job_id"]))
        have = "; ".join(f"{kind} {', '.join(these)}" for kind, these in ids.items()) or "none yet"
        raise UnknownJobId(f"run {paths.root} has no job {job_id}; its jobs: {have} (`slurmft status {paths.root}` "
                           "lists them)")
    return job


def the_job(paths: RunPaths, kind: str, job_id: str | None = None) -> dict[str, Any]:
    """The job ``logs`` reads: the one with ``job_id`` when given, else the newest of ``kind``."""
    return newest_job(paths, kind) if job_id is None else job_with_id(paths, job_id)


def job_outputs(paths: RunPaths, job: dict[str, Any]) -> list[Path]:
    """Where one job of the manifest writes its stdout: a local process's one file per rank (submitit's
    ``submitit/ID_RANK_log.out``, recorded as ``logs``), a Slurm job's one file (``logs/KIND-ID.out``, recorded as
    ``log``; an adopted job has no record of it and wrote there too). A job run in a terminal (``--here``) wrote to
    that terminal, to no file: the error says so (it was a KeyError)."""
    if job.get("here"):
        from slurmft.watch.status import here_words

        raise RunDirError(f"{job['kind']} job {job['job_id']} of {paths.root} {here_words(job['kind'])}: what it "
                          f"printed there is its log; its result: `slurmft status {paths.root}`")
    return [Path(p) for p in job.get("logs", [])] or [Path(job.get("log") or paths.log_file(job["kind"],
                                                                                             str(job["job_id"])))]


def followed_jobs(paths: RunPaths, kind: str, job_id: str | None = None) -> list[dict[str, Any]]:
    """The jobs whose logs ``logs`` shows: the job ``job_id`` alone (one task of a local array too), else the newest
    job of ``kind``, and when that is a task of a local prepare array (the local executor runs the tasks one after
    another, each a job of its own), every task of that array recorded so far: ``logs --job prepare`` showed the newest
    task alone, and ``-f`` never came to task 2."""
    job = the_job(paths, kind, job_id)
    return [job] if job_id is not None else array_tasks(read_manifest(paths), job)


def log_files(run_dir: Path, kind: str, job_id: str | None = None) -> list[Path]:
    """Log files of the newest job of ``kind`` (every task of a local prepare array: :func:`followed_jobs`), or of
    the job ``job_id`` (one per rank for local runs, one for Slurm; a local run's stderr files beside its stdout
    files)."""
    paths = RunPaths.of(run_dir)
    return [f for job in followed_jobs(paths, kind, job_id) for out in job_outputs(paths, job)
            for f in (out, *_stderr_of(out))]


def sweep_log_lines(root: Path, kind: str, lines: int) -> list[str]:
    """``slurmft logs SWEEP_DIR``: the last ``lines`` lines of each point's newest ``kind`` log (as ``slurmft logs
    POINT_DIR`` would show them), each under a line naming the point, its job and its file; a log several points
    share (the sweep's one prepare job) is shown once. A point without such a job, or whose directory cannot be
    read, is said in its header line: one point's problem does not hide the others' logs."""
    from slurmft.rundir import SweepPaths, read_sweep_record

    out: list[str] = []
    shown: dict[tuple[Path, ...], str] = {}
    for point in read_sweep_record(SweepPaths(root))["points"]:
        head = f"==> point {point['name']}"
        try:
            job = latest_jobs(read_manifest(RunPaths.of(point["dir"]))).get(kind)
            files = log_files(Path(point["dir"]), kind) if job is not None else []
        except RunDirError as exc:
            out.append(f"{head}: {exc} <==")
            continue
        if job is None:  # e.g. no prepare job of its own: it reads another point's prepared set
            out.append(f"{head}: no {kind} job <==")
            continue
        head += f": {kind} job {job['job_id']}"
        if tuple(files) in shown:
            out.append(f"{head}: the log shown for point {shown[tuple(files)]} <==")
            continue
        shown[tuple(files)] = point["name"]
        out.append(f"{head}{f': {files[0]}' if len(files) == 1 else ''} <==")
        for f in files:
            if not f.exists():
                out.append(f"(no log yet: {f} — the job may still be pending)")
                continue
            if len(files) > 1:
                out.append(f"--- {f} ---")
            out.extend(_read_lines(f)[-lines:])
    return out


def _stderr_of(out: Path) -> list[Path]:
    """The stderr file written next to a stdout log (submitit's local executor: ``*_log.out`` + ``*_log.err``).

    Every ``[slurmft rank0 ...]`` line and every traceback of a local run is in the ``.err`` file;
    Slurm jobs write both streams into one file, so there is nothing to add for them.
    """
    if out.suffix != ".out":
        return []
    err = out.with_suffix(".err")
    return [err] if out.name.endswith("_log.out") or err.exists() else []


#: How often ``logs -f`` asks whether the followed job has ended (one squeue and one sacct call for a Slurm run).
ENDED_POLL_S = 10.0


def ended_words(run_dir: Path, kind: str, job_id: str | None = None) -> Callable[[], str | None]:
    """For ``logs -f``: a function that says what became of the newest ``kind`` job (or the job ``job_id``) once it
    has ended for good, and None while it may still write to its log (queued, running, requeued, finishing), while we
    cannot see it, and while squeue does not answer (a live job would look ended). Without it ``-f`` waited on a
    finished job's log for ever. A local prepare array (:func:`followed_jobs`) ends with its last task, or with a
    task that did not complete (the submit that runs them stops there), or when that submit is gone."""
    from slurmft.slurm_states import is_live, is_unseen
    from slurmft.watch.status import run_state

    paths = RunPaths.of(run_dir)
    followed_jobs(paths, kind, job_id)  # the error now, when the run has no such job

    def check() -> str | None:
        job = followed_jobs(paths, kind, job_id)[-1]  # a local array's newest task: a later task is recorded later
        state = run_state(paths, adopt=False)
        row = next((r for r in state.rows if str(r["job_id"]) == str(job["job_id"])), None)
        if row is None or not state.squeue_answered or is_live(row["state"]) or is_unseen(row["state"]):
            return None
        task = job.get("task")
        if task is not None and task + 1 < job.get("tasks", 0) and row["state"] == "COMPLETED" and \
                locks.live_holder(paths.lock) is not None:  # the submit that runs the array starts the next task
            return None
        # a job after it that still runs or waits (the consolidation, the serve check, the evaluation): where to look
        later = next((r for r in state.rows[state.rows.index(row) + 1:] if is_live(r["state"])), None)
        nxt = (f"; next: {later['kind']} job {later['job_id']}, {later['words']}: `slurmft logs {paths.root} --job "
               f"{later['kind']} -f`" if later else "")
        what = (f"{kind} job {job['job_id']}" if task is None else
                f"{kind} task {task + 1} of {job.get('tasks')} (job {job['job_id']}) of the local array")
        return (f"[slurmft logs] {what} has ended: {row['words']}{nxt} (the whole run: `slurmft status "
                f"{paths.root}`)")

    return check


def job_now(run_dir: Path, kind: str, job_id: str | None = None) -> Callable[[], str | None]:
    """For a log not written yet: a function that says what the job is doing, as ``status`` says it (``train job 11:
    waiting for the prepare job to finish successfully``); None where the run's state cannot be read. ``logs -f`` on
    a job queued behind its prepare job said only "the job may still be pending", then nothing while it waited."""
    from slurmft.watch.status import run_state

    def words_now() -> str | None:
        paths = RunPaths.of(run_dir)
        try:
            job = str(the_job(paths, kind, job_id)["job_id"])
            row = next((r for r in run_state(paths, adopt=False).rows if str(r["job_id"]) == job), None)
        except (RunDirError, OSError):
            return None
        return f"{row['kind']} job {job}: {row['words']}" if row and row.get("words") else None

    return words_now


def tail(files: list[Path], lines: int, follow: bool, echo: Callable[[str], None],
         ended: Callable[[], str | None] | None = None, poll_s: float = ENDED_POLL_S,
         why_no_log: Callable[[], str | None] | None = None, more: Callable[[], list[Path]] | None = None) -> None:
    """Print the last ``lines`` lines of each file, then (with ``follow``) what is appended, until ``ended`` (asked
    every ``poll_s`` seconds) says the job has ended: then the rest of its log and those words. ``why_no_log``
    (:func:`job_now`): what the job does while its log is not there yet. ``more`` (asked as often) gives the files as
    they are now: a file that joined them (a local array's next task) is shown whole, under its name."""
    offsets: dict[Path, int] = {}
    for f in files:
        if not f.exists():
            why = why_no_log() if why_no_log else None
            echo(f"(no log yet: {f} — {why or 'the job may still be pending'})")
            offsets[f] = 0
            continue
        data = f.read_bytes()
        offsets[f] = len(data)
        if len(files) > 1:
            echo(f"==> {f} <==")
        for line in data.decode(errors="replace").splitlines()[-lines:]:
            echo(line)
    asked = time.monotonic()
    message = ended() if follow and ended else None
    while follow:
        fresh = message is not None
        if message is None:
            time.sleep(0.5)
            if ended and time.monotonic() - asked >= poll_s:
                asked, message, fresh = time.monotonic(), ended(), True
        if more and fresh:  # the files now, as often as ``ended`` is asked and once more after it said the end
            for f in more():
                if f not in offsets:
                    echo(f"==> {f} <==")
                    files, offsets[f] = [*files, f], 0
        for f in files:
            if not f.exists():
                continue
            size = f.stat().st_size
            if size > offsets[f]:
                with open(f, "rb") as fh:
                    fh.seek(offsets[f])
                    chunk = fh.read()
                offsets[f] = size
                for line in chunk.decode(errors="replace").splitlines():
                    echo(line)
        if message is not None:  # the log is read to its end after the job ended
            echo(message)
            return


# --- one rank, one attempt -------------------------------------------------------------------------
# The batch script prints this line at every start of the train job (templates/partials/rendezvous.j2);
# a requeued job appends to the same log file, so these lines are where one attempt ends and the next begins.
ATTEMPT_HEADER = re.compile(r"^\[slurmft\] job=(?P<job>\S+) restart=(?P<restart>\d+)(?: nodes=(?P<nodes>\S+))?")
# srun --label prefixes each task's line with its global rank, right-aligned: " 0: ", "12: ".
RANK_LABEL = re.compile(r"^\s*(?P<rank>\d+): ")


@dataclass
class LogAttempt:
    """The lines of one attempt of one job: a run's K-th attempt is the K-th of these, in order."""

    job_id: str
    restart: int | None
    files: list[Path]
    lines: list[str] = field(default_factory=list)
    nodes: str | None = None
    per_rank_files: bool = False  # local runs: file i holds rank i (no labels)
    job: str = ""  # the manifest's id of its job (an array task's ``123_4``; ``job_id`` is what its log says)


def split_attempts(lines: list[str], job_id: str) -> list[LogAttempt]:
    """Cut one job's log where the batch script announced a (re)start; lines before the first header
    (if any) go with the first attempt."""
    out: list[LogAttempt] = []
    for line in lines:
        m = ATTEMPT_HEADER.match(line)
        if m:
            out.append(LogAttempt(m["job"], int(m["restart"]), [], [line], m["nodes"]))
        elif out:
            out[-1].lines.append(line)
        else:
            out.append(LogAttempt(job_id, None, [], [line]))
    if len(out) > 1 and out[0].restart is None and not any(s.strip() for s in out[0].lines):
        out.pop(0)
    return out or [LogAttempt(job_id, 0, [])]


def rank_lines(lines: list[str], rank: int) -> list[str]:
    """The lines srun labelled with ``rank``, plus the batch script's attempt headers (for orientation)."""
    out = []
    for line in lines:
        m = RANK_LABEL.match(line)
        if (m and int(m["rank"]) == rank) or ATTEMPT_HEADER.match(line):
            out.append(line)
    return out


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def log_attempts(run_dir: Path, kind: str = "train") -> list[LogAttempt]:
    """Every attempt of every ``kind`` job of the run, oldest first (what ``--attempt K`` counts).

    Slurm runs: one log per job id, cut at the batch script's ``[slurmft] job=... restart=...`` lines.
    Local runs: one attempt per job, one file per rank (stdout; stderr beside it as ``.err``).
    A job run in a terminal (``--here``): one attempt, one line saying where its output went.
    """
    paths = RunPaths.of(run_dir)
    manifest = read_manifest(paths)
    out: list[LogAttempt] = []
    for job in manifest.get("jobs", []):
        if job.get("kind") != kind:
            continue
        jid = str(job["job_id"])
        try:
            files = job_outputs(paths, job)
        except RunDirError as exc:  # --here: no file; it still counts as an attempt
            out.append(LogAttempt(jid, None, [], [f"({exc})"], job=jid))
            continue
        if job.get("logs"):  # local: per-rank files
            out.append(LogAttempt(jid, 0, files, per_rank_files=True, job=jid))
            continue
        for attempt in split_attempts(_read_lines(files[0]), jid):
            attempt.files, attempt.job = files, jid
            out.append(attempt)
    if not out:
        raise _no_job(paths, kind)
    return out


def select_lines(run_dir: Path, kind: str = "train", rank: int | None = None,
                 attempt: int | None = None, job_id: str | None = None) -> list[str]:
    """The log lines of one attempt (1 = the first; default: all) and/or one rank (default: all), of the run's
    ``kind`` jobs or of the one job ``job_id`` (its attempts keep their numbers among the run's)."""
    if job_id is not None:
        kind = the_job(RunPaths.of(run_dir), kind, job_id)["kind"]
    every = log_attempts(run_dir, kind)
    found = [(k, a) for k, a in enumerate(every, start=1) if job_id is None or a.job == job_id]
    if attempt is not None:
        ks = [k for k, _ in found]
        if attempt not in ks:
            whose = f"job {job_id}'s: {_span(ks)}" if job_id is not None else f"1..{len(every)}"
            raise RunDirError(f"--attempt {attempt}: the run has {len(every)} {kind} attempt(s) in its logs ({whose})")
        found = [found[ks.index(attempt)]]
    out: list[str] = []
    for k, att in found:
        if len(every) > 1 or attempt is not None:
            restart = "" if att.restart is None else f" restart {att.restart}"
            out.append(f"==> attempt {k}: job {att.job_id}{restart} <==")
        if att.per_rank_files:
            ranks = range(len(att.files)) if rank is None else [rank]
            for r in ranks:
                if r >= len(att.files):
                    raise RunDirError(f"--rank {r}: job {att.job_id} ran {len(att.files)} rank(s) "
                                      f"(0..{len(att.files) - 1})")
                for f in (att.files[r], att.files[r].with_suffix(".err")):
                    if f.exists():
                        if rank is None or f.suffix == ".err":
                            out.append(f"--- rank {r}: {f} ---")
                        out.extend(_read_lines(f))
            continue
        if att.files and not att.files[0].exists():
            out.append(f"(no log yet: {att.files[0]} — the job may still be pending)")
        out.extend(rank_lines(att.lines, rank) if rank is not None and att.files else att.lines)
    return out


def _span(numbers: list[int]) -> str:
    """``attempt 4`` or ``attempts 4..6``: the run-wide numbers of one job's attempts (consecutive: a job's attempts
    follow each other)."""
    return f"attempt {numbers[0]}" if len(numbers) == 1 else f"attempts {numbers[0]}..{numbers[-1]}"
