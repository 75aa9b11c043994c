"""Job state for a run directory: squeue for live jobs, sacct for finished ones, said in words."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from slurmft import cancels, locks, slurm
from slurmft.errors import RunDirError
from slurmft.rundir import (
    JOB_TAG_PREFIX,
    RunPaths,
    User,
    current_user,
    job_submitter,
    process_here,
    read_manifest,
    run_owner,
    write_manifest,
)
from slurmft.slurm_states import (
    ENDED,
    PAUSED_HINT,
    RELEASE_HINT,
    UNSEEN,
    State,
    is_live,
    is_unseen,
    is_waiting,
    parse,
    words,
)
from slurmft.units import fmt_duration, slurm_time_seconds

REASON_WORDS = {
    "Dependency": "waiting for the {waits_on} job to finish successfully",
    "DependencyNeverSatisfied": "will never start: the train job did not succeed; Slurm cancels this job "
    "(--kill-on-invalid-dep; `slurmft resume {run}` cancels it if it is still queued, continues training from the "
    "newest complete checkpoint and chains a new consolidation)",
    "BeginTime": "requeued; waiting for its earliest start time",
    "Priority": "waiting in the queue (priority)",
    "Resources": "waiting for free nodes",
    "JobHeldAdmin": "held by an administrator",
    "JobHeldUser": "held (scontrol release to continue)",
}
# Train-job endings that `slurmft resume` continues from the newest complete checkpoint.
RESUMABLE_ENDINGS = frozenset({State.FAILED, State.CANCELLED, State.TIMEOUT, State.PREEMPTED, State.NODE_FAIL,
                               State.OUT_OF_MEMORY, State.BOOT_FAIL, State.DEADLINE, State.UNKNOWN, State.KILLED})
SQUEUE_SILENT = "squeue did not answer (is SLURM_CONF right? is slurmctld up?)"
#: The kinds of job a run has, in the order they run.
KINDS = ("prepare", "train", "consolidate", "serve", "eval")
#: The jobs after consolidation: the command that runs one again.
MODEL_JOB_COMMANDS = {"serve": "slurmft serve", "eval": "slurmft eval"}


#: What a job that another user (``{submitter}``) submitted and Slurm does not show us means, with the fix.
HIDDEN_WORDS = ("cannot tell: {submitter} submitted it and Slurm shows you none of {submitter}'s jobs here "
                "(PrivateData=jobs hides other users' jobs, or slurmdbd is down), so it may still run; ask {submitter}, "
                "run the command as {submitter}, or ask an administrator to let your account see the team's jobs")
#: What a process recorded on another host (``{host}``) means here.
ELSEWHERE_WORDS = "unknown (running on {host}?): a process there cannot be seen from here; look on {host}"


def unseen_means_hidden(submitter: User, me: User) -> bool:
    """A job that neither squeue nor sacct shows us is hidden, not gone, when another user submitted it (root sees
    every job; squeue always shows us our own). Asked per job: a teammate's ``resume --force`` submits into the
    owner's run under the teammate's uid, and the owner must not take that job for ended (issue 47)."""
    return submitter.uid != me.uid and me.uid != 0


@dataclass
class SlurmView:
    """What one ``squeue`` and one ``sacct`` call say about a run's jobs."""

    queued: dict[str, dict[str, str]] = field(default_factory=dict)
    acct: dict[str, dict[str, str]] = field(default_factory=dict)
    tagged: dict[str, dict[str, str]] = field(default_factory=dict)  # jobs carrying the run's tag
    problems: list[str] = field(default_factory=list)
    squeue_answered: bool = True


def slurm_view(manifest: dict[str, Any], job_tags: set[str] | frozenset[str] = frozenset()) -> SlurmView:
    """One squeue (every job we may see, whoever submitted it: the run's job ids, and tagged jobs the manifest
    missed) and one sacct."""
    view = SlurmView()
    known = {j["job_id"] for j in manifest.get("jobs", []) if "pid" not in j}  # not the processes run here
    known |= {f"{j['job_id']}_{k}" for j in manifest.get("jobs", []) for k in range(slurm.task_count(j))
              if slurm.task_count(j) > 1}  # a prepare array's tasks
    queued = slurm.squeue_jobs()
    if queued is None:
        view.problems.append(SQUEUE_SILENT)
        view.squeue_answered = False
        queued = {}
    ours = {jid for jid, row in queued.items() if row["comment"] in job_tags}
    view.queued = {jid: row for jid, row in queued.items() if jid in known or jid in ours}
    view.tagged = {jid: view.queued[jid] for jid in ours - known}
    acct = slurm.sacct_jobs(sorted(known | set(view.tagged)))
    if acct is None:
        view.problems.append("sacct did not answer (accounting off or slurmdbd down): states of finished jobs "
                             "are unknown")
        acct = {}
    view.acct = acct
    for job in manifest.get("jobs", []):
        if slurm.task_count(job) > 1:  # a prepare array, recorded by the array's id
            tasks = [f"{job['job_id']}_{k}" for k in range(slurm.task_count(job))]
            fold_array(view, job["job_id"], [queued.get(t) for t in tasks], [acct.get(t) for t in tasks])
    return view


def fold_array(view: SlurmView, array: str, queued: list[dict[str, str] | None],
               acct: list[dict[str, str] | None]) -> None:
    """An array's tasks as one job of the run (the train job waits for them all: ``afterok:<array>``): live while a
    task is (a running one shown first), else COMPLETED when every task completed, else the first other ending."""
    live = [q for q in queued if q]
    if live:
        view.queued[array] = next((q for q in live if q["state"] == State.RUNNING.value), live[0])
        return
    ended = [a for a in acct if a]
    if ended and len(ended) == len(acct):
        view.acct[array] = next((a for a in ended if a["state"] != State.COMPLETED.value), ended[-1])


def adopt_tagged(manifest: dict[str, Any], view: SlurmView) -> list[dict[str, Any]]:
    """Add to the manifest the jobs that carry this run's tag but that no submit recorded (a submit killed
    between sbatch and the manifest write); returns the adopted entries (the caller writes the manifest)."""
    from slurmft.rundir import record_job

    adopted = []
    for jid, row in sorted(view.tagged.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        kind = next((k for k in ("consolidate", "prepare", "serve", "eval") if row["name"].endswith(f"-{k}")), "train")
        # who submitted it is not known (squeue's answer does not say): job_submitter falls back to the owner
        adopted.append(record_job(manifest, kind, jid, adopted=True, job_name=row["name"], submitter=None))
    return adopted


def job_rows(manifest: dict[str, Any], run_dir: str = "RUN_DIR", view: SlurmView | None = None,
             owner: User | None = None, me: User | None = None,
             cancelled: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per job of the run (oldest first), with state and what it means in words. A job another user
    submitted that Slurm does not show us, and a process recorded on another host, are ``HIDDEN`` (cannot tell),
    never UNKNOWN (which counts as ended). ``cancelled``: the jobs ``slurmft cancel`` cancelled
    (:func:`slurmft.cancels.read`), said so (``cancelled_by``); a process of them gone without a recorded state is
    CANCELLED."""
    jobs = manifest.get("jobs", [])
    cancelled = cancelled or {}
    rows: list[dict[str, Any]] = []
    newest_train = next((j["job_id"] for j in reversed(jobs) if j["kind"] == "train"), None)
    newest = {j["kind"]: j["job_id"] for j in jobs}  # of each kind: an older failed one's redo is behind it
    me = me or current_user()
    owner = owner or me
    if view is None:
        view = SlurmView() if manifest.get("executor") == "local" else slurm_view(manifest)
    for job in jobs:  # what the manifest says of the job first, then its state, then the words
        jid, base, submitter = job["job_id"], _base(job), job_submitter(job, owner)
        if "pid" in job:  # a process: a local run, or `slurmft consolidate --here`
            alive, host = process_here(job)
            state = job.get("state") or (State.HIDDEN.value if alive is None else State.RUNNING.value if alive
                                         else State.CANCELLED.value if jid in cancelled else State.KILLED.value)
            took = job.get("elapsed_s")  # written when the process ends; while it runs, the time since its start
            if took is None and state == State.RUNNING.value and isinstance(job.get("submitted"), int | float):
                took = max(0.0, time.time() - job["submitted"])
            row = {**base, "state": state, "reason": "", "elapsed": elapsed_words(took), "exit_code": "",
                   "restarts": 0, "start": "", "end": "", "host": host}
            unseen = ELSEWHERE_WORDS.format(host=host)
        else:
            q, a = view.queued.get(jid), view.acct.get(jid)
            if q:  # slurmctld is current; accounting may lag by a second. Its reason "None" (running) is no reason
                state, reason, elapsed = q["state"], "" if q["reason"] == "None" else q["reason"], q["elapsed"]
            elif a:
                state, reason, elapsed = a["state"], "", a["elapsed"]
            else:
                state, reason, elapsed = missing_state(submitter, me), "", ""
            restarts = q["restarts"] if q and q["restarts"].isdigit() else "0"
            row = {**base, "state": state, "reason": reason, "elapsed": elapsed_words(elapsed),
                   "exit_code": (a or {}).get("exit_code", ""), "restarts": int(restarts),
                   "start": (a or {}).get("start", ""), "end": (a or {}).get("end", "")}
            unseen = HIDDEN_WORDS.format(submitter=submitter.name)
        if jid in cancelled and parse(state) == State.CANCELLED:  # (a job that completed as cancel came: not so)
            row["cancelled_by"] = cancels.words(cancelled[jid])
        row["words"] = describe(state, row["reason"], run_dir, job["kind"], jid == newest_train, jid, unseen,
                                row.get("cancelled_by", ""), superseded=jid != newest[job["kind"]],
                                here=bool(job.get("here")))
        rows.append(row)
    explain_dependency_failures(rows, jobs, run_dir)
    return rows


def elapsed_words(elapsed: str | float | None) -> str:
    """A job's elapsed time in one format (:func:`slurmft.units.fmt_duration`: ``8s``, ``3m05s``, ``1h02m``) whoever
    measured it: squeue says ``0:08``, sacct ``00:00:08`` (``1-02:03:04`` past a day), a local process's record
    ``8.3`` seconds; the column mixed them. Empty when unknown."""
    if elapsed is None or elapsed == "":
        return ""
    if isinstance(elapsed, int | float):
        return fmt_duration(elapsed)
    try:
        return fmt_duration(slurm_time_seconds(elapsed))
    except ValueError:  # not a time Slurm writes: shown as it came
        return elapsed


def missing_state(submitter: User, me: User) -> str:
    """The state of a Slurm job that neither squeue nor sacct shows us: HIDDEN (cannot tell) when another user
    submitted it, else UNKNOWN (ended: squeue always shows us our own live jobs)."""
    return State.HIDDEN.value if unseen_means_hidden(submitter, me) else State.UNKNOWN.value


def _base(job: dict[str, Any]) -> dict[str, Any]:
    base = {"kind": job["kind"], "job_id": job["job_id"], "attempt": job.get("attempt", 1)}
    if "task" in job:  # a task of a prepare array run here, one local job each: said as the task, not as an attempt
        base.update(task=job["task"], tasks=job.get("tasks"))
    for key in ("submitter", "dependency"):
        if job.get(key):
            base[key] = job[key]
    if job.get("adopted"):
        base["adopted"] = True
    return base


# What a pending job whose dependency can never be satisfied means, by the kind of job the one it waits on is: a
# train job waits on the prepare job (prepare.enabled), a serve check or evaluation on the consolidation.
NEVER_SATISFIED_WORDS = {
    "train": "will never start: the prepare job did not succeed; Slurm cancels this job "
    "(--kill-on-invalid-dep); see `slurmft logs {run} --job prepare`, fix the data, then `slurmft resume {run}`",
    "serve": "will never start: the consolidation job did not succeed; Slurm cancels this job "
    "(--kill-on-invalid-dep); see `slurmft logs {run} --job consolidate`, then `slurmft consolidate {run}` and "
    "`slurmft serve {run}`",
    "eval": "will never start: the consolidation job did not succeed; Slurm cancels this job "
    "(--kill-on-invalid-dep); see `slurmft logs {run} --job consolidate`, then `slurmft consolidate {run}` and "
    "`slurmft eval {run}`",
}


def _never_started(waited_on: str, job: str, by: str = "") -> str:
    """Why a dependent job was cancelled before it started: the job it waited on (``afterok``) did not succeed, and
    Slurm cancelled it; or ``by``, ``slurmft cancel`` (:func:`slurmft.cancels.words`), cancelled both."""
    if by:
        return f"{by} before it started (it waited on {waited_on} job {job})"
    return f"cancelled by Slurm before it started: {waited_on} job {job} did not succeed (DependencyNeverSatisfied)"


def prepare_failed_words(prepare_job: str, run_dir: str, by: str = "", redone: bool = False) -> str:
    """A train job cancelled before it started because its prepare job did not succeed (``by``: the user cancelled
    both, the data is not at fault). ``redone``: a later prepare job is in the run (`slurmft prepare RUN_DIR`), so
    ``--job prepare`` would show that one's log, not the failed one's."""
    log = logs_command(run_dir, "prepare", prepare_job, superseded=redone)
    fix = "" if by else f"see `{log}`, fix the data, then "
    return (f"{_never_started('prepare', prepare_job, by)}; {fix}`slurmft resume {run_dir}` (it prepares again and "
            "chains the train job)")


def train_failed_words(train_job: str, run_dir: str, by: str = "", redone: bool = False) -> str:
    """A consolidation job cancelled before it started because its train job did not succeed. ``redone``: a later
    train job is in the run (a resume that chained no consolidation): the resume is history."""
    if redone:
        return f"{_never_started('train', train_job, by)}; a later `slurmft resume` continued the run"
    return (f"{_never_started('train', train_job, by)}; `slurmft resume {run_dir}` continues training from the newest "
            "complete checkpoint and chains a new consolidation")


def consolidation_failed_words(consolidate_job: str, run_dir: str, by: str = "", redone: bool = False) -> str:
    """A serve check or evaluation job cancelled before it started because its consolidation did not succeed.
    ``redone``: a later consolidation is in the run (`slurmft consolidate RUN_DIR`): only the serve/eval is left."""
    again = ("a later consolidation job of the run follows it: once it has succeeded, " if redone
             else f"`slurmft consolidate {run_dir}`, then ")
    return (f"{_never_started('consolidation', consolidate_job, by)}; {again}`slurmft serve {run_dir}` / "
            f"`slurmft eval {run_dir}`")


def describe(state: str, reason: str, run_dir: str = "RUN_DIR", kind: str = "", newest_train: bool = False,
             job_id: str = "JOB", unseen: str = "", by: str = "", superseded: bool = False, here: bool = False) -> str:
    """The state in words a user can act on: :data:`slurmft.slurm_states.WORDS`, plus what to do next. ``unseen``:
    what to say instead of a state we cannot see (:data:`slurmft.slurm_states.UNSEEN`): who submitted the job, or
    where its process runs. ``by``: who cancelled it (:func:`slurmft.cancels.words`), said for "cancelled".
    ``superseded``: a later job of the same kind is in the run (a consolidation, serve check or evaluation run
    again): an ended one no longer says to run it again. ``here``: it ran with ``--here`` and has no log file: where
    its output went is said instead of a ``slurmft logs`` command that would only say so."""
    known = parse(state)
    if known in UNSEEN and unseen:
        return unseen
    if known == State.PENDING and reason == NEVER_SATISFIED and kind in NEVER_SATISFIED_WORDS:
        return NEVER_SATISFIED_WORDS[kind].format(run=run_dir)
    if known == State.PENDING and REASON_WORDS.get(reason):
        # a dependent job waits on the job before it: a serve check on the consolidation, not on the train job
        return REASON_WORDS[reason].format(run=run_dir, waits_on=WAITS_ON.get(kind, "train"))
    text = by if known == State.CANCELLED and by else words(state)
    log = logs_command(run_dir, kind, job_id, superseded)
    why = f"it {here_words(kind)}: what it printed there says why" if here else f"see why with `{log}`"
    if known == State.FAILED and (superseded or kind not in MODEL_JOB_COMMANDS and kind != "prepare"):
        text += f"; {why}" if here else f" (see `{log}`)"  # the newest serve, eval and prepare jobs name it below
    elif known == State.UNKNOWN:
        text += ("; neither squeue nor sacct has it (another cluster or SLURM_CONF? accounting off and the job "
                 "older than MinJobAge?)")
    elif known in (State.SUSPENDED, State.STOPPED):
        text += "; " + PAUSED_HINT.format(job=job_id, run=run_dir)
    elif known in (State.REQUEUE_HOLD, State.SPECIAL_EXIT, State.RESV_DEL_HOLD):
        text += "; " + RELEASE_HINT.format(job=job_id)
    if kind == "train" and known in RESUMABLE_ENDINGS:
        text += (f"; continue from the newest complete checkpoint with `slurmft resume {run_dir}`" if newest_train
                 else "; a later `slurmft resume` continued the run")
    elif kind in ("consolidate", "prepare", *MODEL_JOB_COMMANDS) and superseded and known in RESUMABLE_ENDINGS:
        text += f"; a later {kind} job of the run follows it"
    elif kind == "consolidate" and known in RESUMABLE_ENDINGS - {State.UNKNOWN}:
        text += f"; redo it with `slurmft consolidate {run_dir}`"
    elif kind in MODEL_JOB_COMMANDS and known in RESUMABLE_ENDINGS - {State.UNKNOWN}:
        text += f"; the model stays; {why}; run it again with `{MODEL_JOB_COMMANDS[kind]} {run_dir}`"
    elif kind == "prepare" and known in RESUMABLE_ENDINGS - {State.UNKNOWN}:
        fix = f"{why}; fix that" if here else f"fix what its log says (`{log}`)"
        text += f"; no train job starts without it: {fix}, then `slurmft resume {run_dir}` (or `slurmft prepare {run_dir}`)"
    return text


def here_words(kind: str) -> str:
    """Where a job run with ``--here`` (``slurmft consolidate/prepare/serve/eval RUN_DIR --here``) printed: the terminal
    that ran it; it keeps no log file, so neither ``status`` nor ``logs`` may name a ``slurmft logs`` command for it."""
    return f"ran in the terminal that started it (`slurmft {kind} --here`), which keeps no log file"


def logs_command(run_dir: str, kind: str, job_id: str, superseded: bool = False) -> str:
    """The command that shows this job's log. ``slurmft logs RUN_DIR`` alone shows the newest train job's, ``--job
    KIND`` the newest of a kind; an older one (``superseded``: a failed consolidation redone since) only by its id."""
    if superseded:
        return f"slurmft logs {run_dir} --job-id {job_id}"
    return f"slurmft logs {run_dir}{f' --job {kind}' if kind and kind != 'train' else ''}"


#: How a job that Slurm cancelled before it started, because the job it waited on did not succeed, is said.
NEVER_STARTED_WORDS = {"train": prepare_failed_words, "consolidate": train_failed_words,
                       "serve": consolidation_failed_words, "eval": consolidation_failed_words}
#: The kind of job each dependent kind waits on (``afterok``), in the words a superseded one is said with.
WAITS_ON = {"train": "prepare", "consolidate": "train", "serve": "consolidation", "eval": "consolidation"}


def explain_dependency_failures(rows: list[dict[str, Any]], jobs: list[dict[str, Any]], run_dir: str) -> None:
    """A train job cancelled before it started whose prepare job failed, a consolidation job cancelled before it
    started whose train job failed (or was cancelled): say so (its own state says only CANCELLED). Slurm cancels
    them (--kill-on-invalid-dep=yes on every dependent job), unless ``slurmft cancel`` did first (the row's
    ``cancelled_by``: a consolidation pending on its train job is live, so cancel cancels both)."""
    by_id = {r["job_id"]: r for r in rows}
    position = {j["job_id"]: i for i, j in enumerate(jobs)}
    for k, (job, row) in enumerate(zip(jobs, rows, strict=True)):
        dep = str(job.get("dependency") or "")
        if job["kind"] not in NEVER_STARTED_WORDS or not dep.startswith("afterok:"):
            continue
        first = by_id.get(dep.removeprefix("afterok:"))
        # a Start equal to the End is no start (_started): the status after `slurmft cancel` said "redo it with
        # `slurmft consolidate`" of a consolidation that had waited on the cancelled train job
        started = _started(row)
        by = row.get("cancelled_by", "")
        # a serve check or evaluation whose consolidation never ran, its train job unfinished: `slurmft consolidate`
        # would export a part-trained checkpoint; the resume chains a new consolidation and this job
        untrained = (first is not None and job["kind"] in MODEL_JOB_COMMANDS and not _started(first)
                     and not _trained(jobs[position[first["job_id"]]], by_id))
        if first and parse(row["state"]) == State.CANCELLED and not started and is_live(first["state"]):
            # `slurmft cancel`/scancel while the job it waits on still ends (COMPLETING): "redo it with `slurmft
            # consolidate`" would export a half-trained model; what to run depends on how that job ends
            row["words"] = (f"{by or 'cancelled'} before it started; {WAITS_ON[job['kind']]} job {first['job_id']} "
                            f"has not ended yet, it is {words(first['state'])}; `slurmft status {run_dir}` says what to "
                            "run once it has")
        elif untrained and parse(row["state"]) == State.PENDING and row.get("reason") == NEVER_SATISFIED:
            # until Slurm cancels it, as for the cancelled one below
            row["words"] = (f"will never start: its consolidation job {first['job_id']} never ran (its train job did "
                            f"not finish); Slurm cancels this job (--kill-on-invalid-dep); `slurmft resume {run_dir}` "
                            f"continues training and chains a new consolidation and {job['kind']} job")
        elif (first and parse(row["state"]) == State.CANCELLED and not started
                and parse(first["state"]) in RESUMABLE_ENDINGS - {State.UNKNOWN}):
            later = next((j["job_id"] for j in jobs[k + 1:] if j["kind"] == job["kind"]), None)
            # once a later job of its kind took its place (a resume, a consolidate), the command to run is history
            # and once the job it waited on was run again (`slurmft prepare`, `resume`, `consolidate`), its words
            # name the failed one's log by id and no longer say to run it again
            redone = any(j["kind"] == first["kind"] for j in jobs[position[first["job_id"]] + 1:])
            if later:
                row["words"] = (f"{_never_started(WAITS_ON[job['kind']], first['job_id'], by)}; {job['kind']} job "
                                f"{later} took its place")
            elif untrained and not redone:
                row["words"] = (f"{_never_started(WAITS_ON[job['kind']], first['job_id'], by)}, which never ran "
                                f"(its train job did not finish); `slurmft resume {run_dir}` continues training and "
                                f"chains a new consolidation and {job['kind']} job")
            else:
                row["words"] = NEVER_STARTED_WORDS[job["kind"]](first["job_id"], run_dir, by, redone)


def _trained(consolidation: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> bool:
    """Whether the train job a consolidation job waited on (``afterok``) completed: a consolidation cancelled before
    it started is then redone with `slurmft consolidate`, else by `slurmft resume`."""
    train = by_id.get(str(consolidation.get("dependency") or "").removeprefix("afterok:"))
    return train is not None and parse(train["state"]) == State.COMPLETED


def _started(row: dict[str, Any]) -> bool:
    """Whether a job row's job ever started. Slurm 22.05 gives a pending job that scancel cancelled the cancel's time
    as its Start, and its End: a Start equal to the End is no start."""
    return row.get("start") not in ("", "None", "Unknown", None, row.get("end"))


#: Why a pending job waits on a dependency that can never be satisfied (Slurm cancels slurmft's such jobs: every
#: dependent job is submitted with --kill-on-invalid-dep=yes).
NEVER_SATISFIED = "DependencyNeverSatisfied"


@dataclass
class RunState:
    """A run directory as the login side sees it: manifest, one row per job, and what could not be asked.

    It is also the one answer to "is this run live" (issue 47: resume had one copy, ``slurmft prepare`` a weaker
    second): :meth:`may_run` says which jobs may still run by themselves, :meth:`unseen` which ones we cannot
    judge, and :meth:`check_quiet` refuses a command that would change what such a job reads or writes; resume,
    prepare and consolidate ask it, and cancel cancels what :meth:`live` lists."""

    paths: RunPaths
    manifest: dict[str, Any]
    rows: list[dict[str, Any]]
    adopted: list[dict[str, Any]]
    problems: list[str]
    squeue_answered: bool = True  # False: a job squeue would list may look unknown (or finished) here
    owner: User | None = None

    def unseen(self, kinds: Collection[str] = KINDS) -> list[dict[str, Any]]:
        """Rows we cannot tell about (another user's job Slurm hides, a process on another host)."""
        return [r for r in self.rows if is_unseen(r["state"]) and r["kind"] in kinds]

    def live(self, include_completing: bool = True) -> list[str]:
        """Job ids still in the queue or running: queued, starting, running, suspended, requeued, held (and,
        optionally, completing); a state word slurmft does not know counts as live. What ``cancel`` cancels: a job
        that waits on a dependency that can never be satisfied is still in the queue."""
        return [r["job_id"] for r in self.rows
                if is_live(r["state"]) and (include_completing or parse(r["state"]) != State.COMPLETING)]

    def never_runs(self, row: dict[str, Any]) -> bool:
        """A waiting job that will never start: Slurm says its dependency can never be satisfied, or the job it
        waits on (``afterok``, the manifest's record) ended without success."""
        if not is_waiting(row["state"]):
            return False
        if row.get("reason") == NEVER_SATISFIED:
            return True
        dep = str(row.get("dependency") or "")
        if not dep.startswith("afterok:"):
            return False
        first = next((r for r in self.rows if r["job_id"] == dep.removeprefix("afterok:")), None)
        return first is not None and parse(first["state"]) in ENDED and parse(first["state"]) != State.COMPLETED

    def may_run(self, kinds: Collection[str] = KINDS) -> list[dict[str, Any]]:
        """Rows of ``kinds`` whose job may still run (or run again) by itself: live, and not :meth:`never_runs`."""
        return [r for r in self.rows if r["kind"] in kinds and is_live(r["state"]) and not self.never_runs(r)]

    def check_quiet(self, kinds: Collection[str], refused: str) -> None:
        """Refuse (RunDirError; the caller has changed nothing) while a job of ``kinds`` may still run, while one of
        them cannot be seen (another user's job Slurm hides, a process on another host: never taken for ended), and
        while squeue does not answer (a live job would look ended). ``refused``: what is not done, in words."""
        root = self.paths.root
        live = self.may_run(kinds)
        waiting_on = {r["job_id"] for r in live}  # a job chained to one of these is said through it
        live = [r for r in live if str(r.get("dependency") or "").removeprefix("afterok:") not in waiting_on]
        if live:
            jobs = " and ".join(f"{kind} job(s) {', '.join(r['job_id'] for r in live if r['kind'] == kind)}"
                                for kind in KINDS if any(r["kind"] == kind for r in live))
            how = ". ".join(f"Job {r['job_id']}: {describe(r['state'], r['reason'], str(root), r['kind'], False, r['job_id'])}"
                            for r in live)
            raise RunDirError(f"{root} is live: {jobs} still queued or running; {refused}, nothing submitted (follow "
                              f"it with `slurmft status`, or `slurmft cancel` it first). {how}")
        unseen = self.unseen(kinds)
        if unseen:
            raise RunDirError(f"cannot tell whether {root} still runs, so nothing is submitted: "
                              + "; ".join(f"{r['kind']} job {r['job_id']}: {r['words']}" for r in unseen))
        if not self.squeue_answered and self.manifest.get("executor") != "local":
            rows = [r for r in self.rows if r["kind"] in kinds]
            asked = " and ".join(f"{kind} job(s) {', '.join(r['job_id'] for r in rows if r['kind'] == kind)}"
                                 for kind in KINDS if any(r["kind"] == kind for r in rows)) or "job(s) (none recorded)"
            raise RunDirError(f"{SQUEUE_SILENT}: cannot tell whether {asked} of {root} still run, so nothing is "
                              "submitted; try again when squeue answers")


def run_state(paths: RunPaths, adopt: bool = True) -> RunState:
    """Read the manifest and ask Slurm once; jobs tagged with the run but missing from the manifest are
    adopted into it (written back unless another command holds the run's lock)."""
    manifest = read_manifest(paths)
    owner, me = run_owner(paths, manifest), current_user()
    adopted: list[dict[str, Any]] = []
    problems: list[str] = []
    view = None
    if manifest.get("executor") != "local":
        tags = {paths.job_tag} | ({JOB_TAG_PREFIX + manifest["run_id"]} if manifest.get("run_id") else set())
        view = slurm_view(manifest, tags)
        problems = view.problems
        if adopt and view.tagged:
            adopted = adopt_tagged(manifest, view)
            # under the run's lock, that holder writes; one that does not hold it leaves the manifest alone
            if locks.holds(paths.lock) or not paths.lock.exists():
                try:
                    write_manifest(paths, manifest)
                except OSError as exc:  # a teammate without write access still gets the status
                    problems.append(f"could not record the adopted job(s) in {paths.manifest}: {exc.strerror}")
    rows = job_rows(manifest, str(paths.root), view, owner, me, cancels.read(paths))
    return RunState(paths, manifest, rows, adopted, problems, view.squeue_answered if view else True, owner)
