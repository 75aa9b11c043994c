"""The one adapter to Slurm's commands: every ``squeue``, ``sacct``, ``scancel`` and ``scontrol`` slurmft
runs, and whether ``sbatch`` is here (submitit keeps all of its Slurm knowledge in ``slurm/slurm.py``;
this is ours). The sbatch call of a run's jobs stays submitit's; only ``slurmft doctor --job``'s probe,
which has no submitit pickle, is submitted here (:func:`sbatch_script`). ``slurmft doctor`` also reads the
cluster's settings here (``scontrol show config``/``partition``, ``sinfo``, :func:`cluster_facts`), with
parsers tested on recorded output of two Slurm versions.

Why one place: each call used to carry its own time-out, its own error handling and its own idea of
the output. The output is the subtle part. Slurm's commands read the user's environment:
``SQUEUE_PARTITION`` (or ``SQUEUE_ACCOUNT``, ``SQUEUE_QOS``, ``SQUEUE_NAMES``...) silently filters what
``squeue`` lists, so a run's live jobs vanish and look dead (checked on 22.05: ``SQUEUE_PARTITION=nope``
hides every job even with an explicit ``-t all -u USER``); ``SLURM_TIME_FORMAT`` rewrites ``sacct``'s
Start/End (``relative`` -> ``00:54:17``, ``%s`` -> epoch seconds); ``SQUEUE_SORT`` reorders; and
``SCANCEL_*`` turns ``scancel JOB`` into something else (``SCANCEL_INTERACTIVE`` asks on the terminal,
``SCANCEL_BATCH`` signals only the batch shell, ``SCANCEL_STATE``/``SCANCEL_USER`` filter what is
cancelled). So every child gets :func:`child_env`: the variables that change *what is printed or
acted on* are removed; the ones that say *which cluster* (``SLURM_CONF``, ``SLURM_CLUSTERS``) stay,
because the user's jobs live there. (``SQUEUE_FORMAT``/``SQUEUE_FORMAT2``/``SACCT_FORMAT`` lose to
our explicit ``-O``/``-o`` on 22.05; they are removed anyway.) And every query asks for whole values
with an explicit delimiter, :data:`SEP`: ``squeue -O Field:SEP`` (no size: no 20-character cut,
checked on 22.05) and ``sacct -P --delimiter=SEP``; never the default columns.

Slurm versions: the oldest supported is 22.05 (Debian 12's 22.05.8); CI runs the real-cluster tests on
it and on 24.11 (Debian 13's 24.11.5), and tests/test_slurm.py parses output recorded from both
(tests/data/slurm/). What changed between them, and how this adapter stays out of its way:

- ``squeue -O`` and ``sacct -P`` columns, states and exit codes (``<exit>:<signal>``, e.g. ``3:0``,
  ``0:15``) print the same on 22.05 and 24.11 (recorded); slurmft never uses squeue's ``%s`` (gone in
  23.02) nor the JSON output (job states became lists in 23.11, ``nodes`` an object in 24.05).
- ``scontrol show job``: :func:`parse_show` takes a value up to the next blank, so 25.11 dropping the
  space after ``Comment=`` changes nothing; slurmft reads the comment from squeue anyway.
- A job that is gone: 26.05 prints "Job ... not found" on stderr, older versions "Invalid job id" on
  stderr (22.05, 24.11, recorded); either way the call fails and :attr:`Answer.problem` carries stderr
  before stdout.
- The requeue delay: how long a requeued job waits before it may start again is ``requeue_delay`` in
  SchedulerParameters on 25.11, and ``cred_expire`` (AuthInfo, default 120 s) before it; ``slurmft
  doctor`` reads whichever ``scontrol show config`` has (:func:`parse_config`, :func:`option`;
  slurmft/plan/doctor.py ``check_requeue_delay``).
- The job environment: ``SLURM_JOB_START_TIME`` exists only from 23.02 on (set on 24.11, absent on
  22.05), so nothing of slurmft reads it. From 23.11 sbatch also exports ``SLURM_TRES_PER_TASK=cpu=N``
  beside ``SLURM_CPUS_PER_TASK=N``, and a plain ``srun`` whose environment has them disagree stops
  ("fatal: cpus-per-task set by two different environment variables", measured on 24.11 with
  ``SLURM_CPUS_PER_TASK=3`` in a ``--cpus-per-task=2`` job). The rendered ``srun`` lines pass
  ``--cpus-per-task`` themselves (slurmft/plan/render.py), and the option wins over both variables:
  the same job's ``srun --cpus-per-task=2`` exited 0.

One time-out policy: :data:`TIMEOUT_S` for every call, except the ``scontrol`` calls the batch shell
makes after ``srun`` returned (:data:`BATCH_TIMEOUT_S`), when the job is already inside KillWait or
past its time limit and a hung controller must not eat the rest. A command that is missing, hangs or
fails gives an :class:`Answer` that says which, never a traceback.

Torch-free and import-light: ``slurmft.job.requeue`` and ``slurmft.job.rendezvous`` use it from the
batch shell before anything heavy is imported.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from slurmft.errors import SubmissionError

#: Seconds any Slurm command may take (a busy slurmctld answers slowly; a dead one never).
TIMEOUT_S = 60
#: Seconds for the batch shell's ``scontrol show job`` / ``scontrol requeue`` after ``srun`` returned.
BATCH_TIMEOUT_S = 20

#: Environment variables that change what Slurm's commands print or act on (prefixes, then names).
STRIPPED_PREFIXES = ("SQUEUE_", "SACCT_", "SCANCEL_", "SCONTROL_")
STRIPPED_NAMES = frozenset({"SLURM_TIME_FORMAT", "SLURM_BITSTR_LEN", "SLURM_TOPO_LEN"})

#: Field delimiter of every query: ASCII unit separator. ``|`` is not enough: a job name or comment may
#: hold one (``-J 'a|b'`` shifted the comment, so the run's tag no longer matched; checked on 22.05).
SEP = "\x1f"
#: ``JobArrayID``: a job's id, an array task's as ``<array>_<task>`` (what sbatch's answer and a sweep point's manifest
#: name it; ``JobID`` would print the task's own number) and the array's pending tasks as ``<array>_[1-3%2]``.
SQUEUE_FIELDS = ("JobArrayID", "State", "Reason", "TimeUsed", "RestartCnt", "Name", "Comment")
SQUEUE_KEYS = ("job_id", "state", "reason", "elapsed", "restarts", "name", "comment")
SACCT_FIELDS = ("JobID", "State", "Elapsed", "ExitCode", "Start", "End")


class SlurmCallError(RuntimeError):
    """A Slurm command that had to answer did not (missing, hung, failed); the message says which."""


@dataclass(frozen=True)
class Answer:
    """What one Slurm command did: ``ok`` with its ``stdout``, or ``problem`` in words."""

    ok: bool
    stdout: str = ""
    stderr: str = ""
    problem: str = ""
    code: int | None = None  # the exit status; None when the command did not run or did not finish


def child_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: ours) without the variables that change Slurm's output or targets."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not (k.startswith(STRIPPED_PREFIXES) or k in STRIPPED_NAMES)}


def available(command: str) -> bool:
    """``command`` (``sbatch``, ``squeue``...) is on PATH."""
    return shutil.which(command) is not None


def call(args: list[str], timeout: float = TIMEOUT_S) -> Answer:
    """Run one Slurm command with :func:`child_env` and a time-out."""
    if not available(args[0]):
        return Answer(False, problem=f"{args[0]} is not on PATH")
    try:
        out = subprocess.run(args, capture_output=True, timeout=timeout, env=child_env(), check=False)
    except subprocess.TimeoutExpired:
        return Answer(False, problem=f"{' '.join(args)} did not answer within {timeout:g} s")
    except OSError as exc:
        return Answer(False, problem=f"could not run {args[0]}: {exc}")
    stdout, stderr = decode(out.stdout), decode(out.stderr)
    if out.returncode != 0:
        detail = stderr.strip() or stdout.strip()[:200] or f"exit {out.returncode}"
        return Answer(False, stdout, stderr, detail, out.returncode)
    return Answer(True, stdout, stderr, code=0)


def decode(data: bytes) -> str:
    """Slurm's output as text: UTF-8, a byte that is not (a job name or comment in Latin-1) replaced, so one
    odd job never breaks every status-type command."""
    return data.decode("utf-8", errors="replace")


# ------------------------------------------------------------------ squeue / sacct
def squeue_args() -> list[str]:
    """Every job slurmctld still knows that this user may see (queued, running, recently finished; every user's,
    every partition's: ``--all``), whole values, :data:`SEP` after each. No ``--user``: a run's jobs are not all
    its owner's (a teammate's ``resume --force`` submits under the teammate's uid), and a filter on the owner
    hid the teammate's live train job, which then looked ended (issue 47). No ``--jobs`` either: squeue with
    one id it has forgotten fails ("Invalid job id specified", exit 1, on 22.05.8 and 24.11.5) where several
    such ids print nothing, and a run's tagged jobs that no manifest recorded are found by their comment, which
    squeue cannot filter on. Where Slurm hides other users' jobs (``PrivateData=jobs``) they are simply absent,
    not an error: the caller decides what an absent job means (slurmft/watch/status.py)."""
    return ["squeue", "-h", "--all", "-t", "all", "-O", ",".join(f"{f}:{SEP}" for f in SQUEUE_FIELDS)]


def parse_squeue(text: str) -> dict[str, dict[str, str]]:
    """``{job id: {job_id, state, reason, elapsed, restarts, name, comment}}`` from :func:`squeue_args`
    output; other lines (a ``CLUSTER:`` header) are skipped."""
    info = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.rstrip("\n").removesuffix(SEP).split(SEP, len(SQUEUE_FIELDS) - 1)]
        if len(parts) == len(SQUEUE_FIELDS):
            row = dict(zip(SQUEUE_KEYS, parts, strict=True))
            for job_id in array_tasks(row["job_id"]):
                info[job_id] = {**row, "job_id": job_id}
    return info


_PENDING_TASKS = re.compile(r"^(\d+)_\[([\d,-]+)(?:%\d+)?\]$")


def array_tasks(job_id: str) -> list[str]:
    """``7_[1-3,5%2]`` (an array's tasks still pending as one record) -> 7_1, 7_2, 7_3, 7_5; any other id itself."""
    m = _PENDING_TASKS.match(job_id)
    if not m:
        return [job_id]
    tasks: list[str] = []
    for part in m.group(2).split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (last.isdigit() or not last):
            tasks += [f"{m.group(1)}_{i}" for i in range(int(first), int(last or first) + 1)]
    return tasks or [job_id]


def squeue_jobs() -> dict[str, dict[str, str]] | None:
    """Every job slurmctld still knows that we may see (:func:`squeue_args`), one call; None when squeue is
    missing, hangs or fails."""
    answer = call(squeue_args())
    return parse_squeue(answer.stdout) if answer.ok else None


def sacct_args(job_ids: list[str]) -> list[str]:
    """Allocation lines only, :data:`SEP`-separated whole values, whoever submitted the jobs (``--allusers``: a
    run's jobs may be a teammate's; where PrivateData=jobs hides them, sacct shows only our own)."""
    return ["sacct", "-n", "-X", "-P", "--allusers", f"--delimiter={SEP}", "-j", ",".join(job_ids), "-o",
            ",".join(SACCT_FIELDS)]


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """``{job id: {state, elapsed, exit_code, start, end}}`` from :func:`sacct_args` output; the state is
    its first word (``CANCELLED by 0`` -> ``CANCELLED``)."""
    info = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(SEP)]  # not line.strip(): Python counts SEP as blank
        if len(parts) == len(SACCT_FIELDS) and parts[1]:
            row = {"state": parts[1].split()[0], "elapsed": parts[2], "exit_code": parts[3], "start": parts[4],
                   "end": parts[5]}
            tasks = array_tasks(parts[0])
            if tasks == [parts[0]]:
                info[parts[0]] = row
            for task in tasks:  # an array's tasks that never started: one record, ``7_[0-3%2]``
                info.setdefault(task, dict(row))
    return info


def sacct_jobs(job_ids: list[str]) -> dict[str, dict[str, str]] | None:
    """Final state, exit code, start and end from accounting, one call; None when sacct does not answer."""
    if not job_ids:
        return {}
    # an array task that never started has no line of its own: the array's record (asked by the array's id) has it
    arrays = [j.split("_", 1)[0] for j in job_ids if "_" in j]
    answer = call(sacct_args(list(dict.fromkeys([*job_ids, *arrays]))))
    if not answer.ok:
        return None
    info = parse_sacct(answer.stdout)
    for task in job_ids:  # an array cancelled before any task was split off: one record, the array's bare id
        base = task.split("_", 1)[0]
        if "_" in task and task not in info and base in info:
            info[task] = dict(info[base])
    return info


# ------------------------------------------------------------------ scancel
def scancel(job_ids: list[str]) -> None:
    """``scancel`` these jobs (a suspended one too: Slurm 22.05 ends it CANCELLED), or raise a
    SubmissionError saying why not (missing, hung, refused)."""
    answer = call(["scancel", *job_ids])
    if answer.ok:
        return
    if answer.code is not None:
        raise SubmissionError(f"scancel {' '.join(job_ids)} failed: {answer.problem}")
    raise SubmissionError(f"could not run scancel {' '.join(job_ids)}: {answer.problem}")


def try_scancel(job_ids: list[str]) -> bool:
    """``scancel``, True when it worked (for clean-up paths that report, not raise)."""
    return scancel_answer(job_ids).ok


def scancel_answer(job_ids: list[str]) -> Answer:
    """``scancel`` and what it said: for a job another user submitted, which Slurm cancels only for an operator
    or a coordinator ("Access/permission denied" otherwise), the caller reports the refusal."""
    return call(["scancel", *job_ids])


#: sbatch refusals a run config causes (lower-case words of Slurm's message), each with the field that fixes it.
REFUSAL_FIXES = {
    "invalid account": "set cluster.account to an account you may use (`sacctmgr show assoc user=$USER`)",
    "time limit": "set cluster.time within the partition's MaxTime (`scontrol show partition`)",
    "qos": "set cluster.qos to one your account may use (`sacctmgr show assoc user=$USER`)",
    "node configuration is not available": "ask for what the partition's nodes have: resources.gpus_per_node, "
                                           "resources.cpus_per_task, resources.mem, cluster.constraint (`sinfo -N -l`)",
}
DOCTOR_HINT = "`slurmft doctor run.yaml` checks the partition, time limit, GPUs and memory against the cluster first"


def refusal_fixes(message: str) -> list[str]:
    """The fix for an sbatch refusal of a slurmft job, by the field of ``run.yaml`` that caused it (sbatch says only
    "invalid partition specified: gpu"); a partition that does not exist is answered with the ones that do."""
    text = message.lower()
    if "invalid partition" in text:
        parts = call(["scontrol", "show", "partition"])
        names = ", ".join(parse_partitions(parts.stdout)) if parts.ok else ""
        return [f"set cluster.partition to one of: {names}" if names else
                "set cluster.partition to a partition of this cluster (`sinfo -s`)", DOCTOR_HINT]
    fixes = [fix for words, fix in REFUSAL_FIXES.items() if words in text]
    return [*fixes, DOCTOR_HINT] if fixes else []


def refused(what: str, exc: BaseException) -> SubmissionError:
    """The error for sbatch's refusal of ``what`` (submitit's exception), with :func:`refusal_fixes`."""
    return SubmissionError(f"sbatch refused the {what} ({str(exc).strip()})", refusal_fixes(str(exc)))


@contextlib.contextmanager
def refusal_said_once() -> Iterator[None]:
    """Around submitit's sbatch call: submitit prints sbatch's stderr when sbatch refuses a job, then raises it
    (``FailedJobError``), which slurmft says inside its own error with the field that fixes it (:func:`refused`), so
    the user read the refusal twice, the first copy above the error. That print is dropped; anything else written to
    stderr meanwhile (a warning) is passed on."""
    from submitit.core.utils import FailedJobError

    said, printed = io.StringIO(), ""
    try:
        with contextlib.redirect_stderr(said):
            yield
    except FailedJobError as exc:
        printed = f"{exc}\n"  # submitit's print(stderr, file=sys.stderr); the exception holds the same text
        raise
    finally:
        sys.stderr.write(said.getvalue().replace(printed, "", 1))


# ------------------------------------------------------------------ scontrol
def parse_show(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of ``scontrol show job|node`` text (the first of a repeated key wins; a value
    runs to the next blank, which is how scontrol prints the fields we read)."""
    fields: dict[str, str] = {}
    for key, value in re.findall(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=(\S*)", text):
        fields.setdefault(key, value)
    return fields


def show_job(job_id: str, timeout: float = TIMEOUT_S) -> Answer:
    """``scontrol show job JOB``."""
    return call(["scontrol", "show", "job", job_id], timeout=timeout)


def requeue(job_id: str, timeout: float = TIMEOUT_S) -> Answer:
    """``scontrol requeue JOB`` (one try; the caller decides about retries)."""
    return call(["scontrol", "requeue", job_id], timeout=timeout)


def set_time_limit(job_id: str, minutes: int, timeout: float = TIMEOUT_S) -> Answer:
    """``scontrol update JobId=JOB TimeLimit=MINUTES`` (a user may lower the limit of their own job; the
    doctor's probe does, to bring its warning signal forward)."""
    return call(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}"], timeout=timeout)


def sbatch_script(script: str) -> Answer:
    """``sbatch --parsable SCRIPT``: the doctor's probe job only. A run's jobs are submitted through
    submitit (slurmft.submit.dispatch), which pairs each job with its pickled callable; the probe has
    none. ``stdout`` holds ``JOBID[;CLUSTER]``."""
    return call(["sbatch", "--parsable", script])


def own_job_id(environ: Mapping[str, str]) -> str:
    """This job's id as slurmft records it, from inside the job: an array task's as ``<array>_<task>`` (what sbatch
    answered and a sweep point's manifest says; ``scontrol`` takes it for that task alone), else ``SLURM_JOB_ID``.
    The ranks' requeue markers and metrics and the batch shell's requeue decision all name the job so."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else environ.get("SLURM_JOB_ID", "")


def task_count(job: dict[str, Any]) -> int:
    """How many tasks a Slurm job of the manifest has: a prepare array's count (recorded by the array's id, its
    tasks ``<id>_<k>``), 1 for any other job. An evaluation run with ``slurmft eval --tasks`` records its lm-eval
    task names under the same key, a list: that job is one task (counting the list crashed ``status``)."""
    tasks = job.get("tasks", 1)
    if "pid" in job or job.get("kind") != "prepare" or not isinstance(tasks, int) or isinstance(tasks, bool):
        return 1
    return max(1, tasks)


def sbatch_array(script: str, dependency: str | None = None) -> Answer:
    """``sbatch --parsable [--dependency=DEP --kill-on-invalid-dep=yes] SCRIPT``: a sweep's array job
    (slurmft/submit/sweep.py), whose tasks' pickles are written once its id is known (submitit's job processing
    waits for them). ``stdout`` holds ``JOBID[;CLUSTER]``."""
    dep = [f"--dependency={dependency}", "--kill-on-invalid-dep=yes"] if dependency else []
    return call(["sbatch", "--parsable", *dep, script])


def hostnames(nodelist: str) -> list[str]:
    """Host names of a Slurm node list (``n[1-2]`` -> n1, n2); raises SlurmCallError when scontrol fails."""
    answer = call(["scontrol", "show", "hostnames", nodelist])
    if not answer.ok:
        raise SlurmCallError(f"scontrol show hostnames {nodelist}: {answer.problem}")
    names = answer.stdout.split()
    if not names:
        raise SlurmCallError(f"scontrol show hostnames {nodelist} printed no host")
    return names


def node_addr(node: str) -> str | None:
    """The NodeAddr Slurm itself uses to reach ``node``; None when scontrol does not say."""
    answer = call(["scontrol", "show", "node", node])
    if not answer.ok:
        return None
    return parse_show(answer.stdout).get("NodeAddr") or None


# ------------------------------------------------------------------ the cluster's settings (slurmft doctor)
#: What a Slurm field prints when it is unset.
UNSET = frozenset({"", "(null)", "N/A", "NONE", "none"})


def parse_config(text: str) -> dict[str, str]:
    """``{key: value}`` of ``scontrol show config`` (``Key   = Value`` lines). The first of a repeated key
    wins: the plugin sections printed after the main block (``Cgroup Support Configuration:``...) reuse
    names. Lines without `` = `` (headers, ``Slurmctld(primary) at host is UP``) are skipped."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        key = key.strip()
        if sep and key and " " not in key:
            fields.setdefault(key, value.strip())
    return fields


def parse_partitions(text: str) -> dict[str, dict[str, str]]:
    """``{partition: {field: value}}`` of ``scontrol show partition`` (each record opens with PartitionName=)."""
    out: dict[str, dict[str, str]] = {}
    for record in re.split(r"(?m)^(?=PartitionName=)", text):
        fields = parse_show(record)
        if fields.get("PartitionName"):
            out[fields["PartitionName"]] = fields
    return out


def parse_gres_gpus(text: str) -> list[int]:
    """GPUs per node of each node configuration ``sinfo -o %G`` prints (``gpu:8``, ``gpu:h100:8(S:0-1)``,
    ``gpu:a100:4,gpu:v100:2`` -> 6); a configuration without GPUs counts 0."""
    counts = []
    for line in text.splitlines():
        line = line.strip()
        if line:
            counts.append(sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)", line)))
    return counts


def parse_node_memory(text: str) -> list[int]:
    """Megabytes per node of each node configuration ``sinfo -o %m`` prints (``128000``; ``128000+`` where a
    line groups nodes of that much and more: the smallest is what a job can count on)."""
    return [int(m.group(1)) for line in text.splitlines() if (m := re.match(r"\s*(\d+)", line))]


def seconds(value: str | None) -> int | None:
    """``30 sec`` / ``30`` -> 30; None for anything else (unset, ``INFINITE``)."""
    match = re.fullmatch(r"\s*(\d+)(?:\s*sec)?\s*", value or "")
    return int(match.group(1)) if match else None


def option(values: str | None, name: str) -> str | None:
    """One ``name=value`` (or bare ``name``: ``""``) of a comma-separated parameter list such as
    SchedulerParameters or AuthInfo; None when absent."""
    for item in (values or "").split(","):
        key, _, val = item.strip().partition("=")
        if key.lower() == name.lower():
            return val
    return None


@dataclass(frozen=True)
class ClusterFacts:
    """What the login node can learn of the cluster in a few seconds. A field is None when Slurm did not
    answer; the matching ``*_problem`` says why."""

    client_version: str | None
    config: dict[str, str] | None
    config_problem: str
    partitions: dict[str, dict[str, str]] | None
    partitions_problem: str
    partition: str | None  # the run's (cluster.partition) or the cluster's default one
    gpus_per_node: list[int] | None  # one count per node configuration of that partition
    accounting_problem: str | None  # None: sacct answered
    node_memory_mb: list[int] | None = None  # RealMemory (MB) of each node configuration of that partition


def cluster_facts(partition: str | None) -> ClusterFacts:
    """Ask scontrol, sinfo and sacct; never raise (a missing or failing command becomes a ``*_problem``)."""
    version = call(["scontrol", "--version"])
    config = call(["scontrol", "show", "config"])
    parts = call(["scontrol", "show", "partition"])
    partitions = parse_partitions(parts.stdout) if parts.ok else None
    if partition is None and partitions:
        partition = next((n for n, f in partitions.items() if f.get("Default") == "YES"), None)
    gpus = memory = None
    if partition and partitions and partition in partitions:
        gres = call(["sinfo", "-h", "-p", partition, "-o", "%G"])
        gpus = parse_gres_gpus(gres.stdout) if gres.ok else None
        mem = call(["sinfo", "-h", "-p", partition, "-o", "%m"])
        memory = parse_node_memory(mem.stdout) if mem.ok else None
    acct = call(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"])
    return ClusterFacts(
        client_version=version.stdout.split()[-1] if version.ok and version.stdout.split() else None,
        config=parse_config(config.stdout) if config.ok else None,
        config_problem=config.problem,
        partitions=partitions,
        partitions_problem=parts.problem,
        partition=partition,
        gpus_per_node=gpus,
        accounting_problem=None if acct.ok else acct.problem,
        node_memory_mb=memory,
    )
