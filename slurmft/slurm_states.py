"""Every state Slurm reports for a job, which of them are still live, and each in words: one home.

``status``, ``progress``, ``runs``, ``resume`` and ``cancel`` all ask the same two questions of a job's
state word: *can this job still run (or run again) on its own?* and *how do I say it?* Two copies of the
answer drifted once: a live set without ``SUSPENDED`` let ``slurmft resume`` submit a second train job
into the checkpoints of a suspended one (``scontrol suspend``, PreemptMode=SUSPEND) while ``slurmft
runs`` called it "training". So the states, the live set and the words live here, torch-free, and
every command imports them.

The states are those of ``man squeue`` and ``man sacct``, section "JOB STATE CODES", of Slurm 22.05.8
(the test cluster), plus two of ours: ``KILLED`` (a process started here is gone without a recorded
state) and ``UNKNOWN`` (neither squeue nor sacct knows the job). A word Slurm prints that is not in
this list (a newer Slurm) does not crash anything: :func:`parse` returns None and :func:`is_live`
counts it as live, because treating a job we do not understand as dead is how a second train job gets
submitted beside it; refusing is the safe side.
"""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    """A job state as Slurm names it (``squeue -O State``, the first word of ``sacct -o State``)."""

    # still holds, or may again get, an allocation
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    COMPLETING = "COMPLETING"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    RESIZING = "RESIZING"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    REVOKED = "REVOKED"
    # ended
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    BOOT_FAIL = "BOOT_FAIL"
    DEADLINE = "DEADLINE"
    # ours
    KILLED = "KILLED"  # a local job whose process is gone without a recorded state
    UNKNOWN = "UNKNOWN"  # neither squeue nor sacct knows the job
    HIDDEN = "HIDDEN"  # cannot tell: another user's job Slurm does not show us, or a process on another host


#: States of a job that holds an allocation or may get one again without anyone submitting it:
#: queued, starting, running, paused, finishing, requeued or held. ``SPECIAL_EXIT`` is a requeued job
#: held in a special state (``scontrol release`` starts it again) and ``REVOKED`` a federation sibling
#: removed because *another* cluster started the job: both can still train into the run's checkpoints.
LIVE = frozenset({
    State.PENDING, State.CONFIGURING, State.RUNNING, State.SUSPENDED, State.STOPPED, State.COMPLETING,
    State.SIGNALING, State.STAGE_OUT, State.RESIZING, State.REQUEUED, State.REQUEUE_HOLD, State.REQUEUE_FED,
    State.RESV_DEL_HOLD, State.SPECIAL_EXIT, State.REVOKED,
})
#: Live states that hold an allocation now (its processes exist, maybe paused).
ALLOCATED = frozenset({
    State.CONFIGURING, State.RUNNING, State.SUSPENDED, State.STOPPED, State.COMPLETING, State.SIGNALING,
    State.STAGE_OUT, State.RESIZING,
})
#: Live states of a job that waits to start (again).
WAITING = LIVE - ALLOCATED
#: States of a job that will not run again by itself; ``UNKNOWN`` and ``KILLED`` included.
ENDED = frozenset(State) - LIVE - {State.HIDDEN}
#: "Cannot tell": neither live nor ended. Slurm shows a user only their own jobs under ``PrivateData=jobs``
#: (squeue and sacct answer, with nothing), and a pid recorded on another host cannot be looked at from here.
#: Such a job is never taken for ended (a second train job would start beside it), nor cancelled.
UNSEEN = frozenset({State.HIDDEN})

#: Each state in words, the one table every command builds on (commands add what to do next).
WORDS: dict[State, str] = {
    State.PENDING: "waiting in the queue",
    State.CONFIGURING: "starting (Slurm is readying its nodes)",
    State.RUNNING: "running",
    State.SUSPENDED: "suspended (paused with its allocation kept; no progress until it is resumed)",
    State.STOPPED: "stopped (paused by SIGSTOP with its allocation kept)",
    State.COMPLETING: "finishing (Slurm is ending its processes)",
    State.SIGNALING: "being signalled",
    State.STAGE_OUT: "staging out files",
    State.RESIZING: "changing size",
    State.REQUEUED: "requeued; will start again under the same job id",
    State.REQUEUE_HOLD: "requeued and held",
    State.REQUEUE_FED: "being requeued by the federation",
    State.RESV_DEL_HOLD: "held (its reservation was deleted)",
    State.SPECIAL_EXIT: "requeued and held in a special state (special exit)",
    State.REVOKED: "revoked here: another cluster of the federation started it",
    State.COMPLETED: "completed",
    State.FAILED: "failed",
    State.CANCELLED: "cancelled",
    State.TIMEOUT: "hit its time limit",
    State.PREEMPTED: "preempted",
    State.NODE_FAIL: "a node failed",
    State.OUT_OF_MEMORY: "ran out of memory",
    State.BOOT_FAIL: "a node failed to boot",
    State.DEADLINE: "reached its deadline",
    State.KILLED: "ended without recording a state (killed, or the machine went down)",
    State.UNKNOWN: "unknown (Slurm no longer knows this job)",
    State.HIDDEN: "cannot tell (not visible from here)",
}

#: What releases a held job (``{job}`` is its id).
RELEASE_HINT = "`scontrol release {job}` lets it start again"
#: What continues or ends a paused job (``{job}``: its id, ``{run}``: the run directory).
PAUSED_HINT = "an administrator's `scontrol resume {job}` continues it; `slurmft cancel {run}` ends it"


def parse(word: str | None) -> State | None:
    """The state of a word Slurm printed (``CANCELLED by 0`` -> CANCELLED; ``""`` -> UNKNOWN); None for a
    word this Slurm list does not have."""
    text = (word or "").strip()
    if not text:
        return State.UNKNOWN
    head = text.split()[0].upper()
    try:
        return State(head)
    except ValueError:
        return None


def is_live(word: str | None) -> bool:
    """The job may still run (or run again) by itself; a word we do not know counts as live (refuse
    rather than start a second job beside one we do not understand)."""
    state = parse(word)
    return state is None or state in LIVE


def is_unseen(word: str | None) -> bool:
    """Whether the job is one we cannot see (:data:`UNSEEN`): neither live nor ended as far as we know."""
    return parse(word) in UNSEEN


def is_waiting(word: str | None) -> bool:
    """The job waits to start (again): queued, requeued or held."""
    return parse(word) in WAITING


def is_allocated(word: str | None) -> bool:
    """The job holds an allocation now (running, starting, paused or finishing); an unknown word counts."""
    state = parse(word)
    return state is None or state in ALLOCATED


def words(word: str | None) -> str:
    """The state in words, from :data:`WORDS`; a word we do not know is kept and said to count as live."""
    state = parse(word)
    if state is None:
        return f"{(word or '').strip().lower()} (a Slurm state slurmft does not know; counted as live)"
    return WORDS[state]
