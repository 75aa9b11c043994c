"""slurmft.job.requeue.decide: requeue or not, from the marker, the exit code and what Slurm says (pure)."""

from __future__ import annotations

import pytest

from slurmft.job.requeue import EXIT_REQUEUE_REFUSED, Action, Ending, JobView, decide

SAVED = {"step": 12, "saved": True}


@pytest.mark.parametrize(
    ("marker", "exit_code", "restart", "max_requeues", "expected"),
    [
        (None, 0, 0, 5, (Action.EXIT, 0)),  # finished normally
        (None, 1, 0, 5, (Action.EXIT, 1)),  # failed: the failure stands
        (SAVED, 0, 0, 5, (Action.REQUEUE, 0)),  # saved after the warning signal: requeue
        ({"step": 3, "saved": False}, 0, 0, 5, (Action.REQUEUE, 0)),  # stopped during start-up: requeue
        (SAVED, 0, 5, 5, (Action.EXIT, EXIT_REQUEUE_REFUSED)),  # out of requeues: fail, no consolidation
        (SAVED, 137, 0, 5, (Action.EXIT, 137)),  # a rank died after the marker: never requeue a broken run
    ],
)
def test_requeue_decision_after_the_warning_signal(marker: dict | None, exit_code: int, restart: int,
                                                   max_requeues: int, expected: tuple[Action, int]) -> None:
    decision = decide(marker, exit_code, restart, max_requeues)
    assert (decision.action, decision.code) == expected


# What `scontrol show job` printed from inside the batch script after srun returned, per ending
# (docs/design-notes.md, "How jobs really end"), trimmed to one line of the real output.
SHOW_JOB = "JobId=7 JobName=it-train UserId=root(0) Priority=1 JobState={state} Reason={reason} Dependency=(null) Requeue=1 Restarts={restarts} BatchFlag=1"


@pytest.mark.parametrize(
    ("state", "reason", "restarts", "restart", "ending", "action"),
    [
        ("COMPLETING", "TimeLimit", 0, 0, Ending.TIME_LIMIT, Action.REQUEUE),  # time limit: we requeue
        ("COMPLETING", "TimeLimit", 2, 2, Ending.TIME_LIMIT, Action.REQUEUE),
        ("COMPLETING", "None", 1, 0, Ending.SLURM_REQUEUE, Action.EXIT),  # scontrol requeue / preemption
        ("COMPLETING", "None", 3, 2, Ending.SLURM_REQUEUE, Action.EXIT),
        ("COMPLETING", "None", 0, 0, Ending.CANCELLED, Action.EXIT),  # scancel: never requeue
        ("COMPLETING", "None", 2, 2, Ending.CANCELLED, Action.EXIT),
        ("CANCELLED", "None", 0, 0, Ending.CANCELLED, Action.EXIT),
    ],
)
def test_requeue_decision_after_sigterm_asks_slurm_why(state: str, reason: str, restarts: int, restart: int,
                                                       ending: Ending, action: Action) -> None:
    view = JobView.parse(SHOW_JOB.format(state=state, reason=reason, restarts=restarts))
    assert view == JobView(state, reason, restarts)
    decision = decide(SAVED, 0, restart, 5, "TERM", view)
    assert (decision.ending, decision.action) == (ending, action)
    assert decision.code == 0 and "step 12" in decision.message
    assert decide(SAVED, 0, restart, 5, "", view).ending == Ending.WARNING  # no SIGTERM here: the warning signal


def test_requeue_decision_sigterm_without_slurm_view_does_not_requeue() -> None:
    assert JobView.parse("slurm_load_jobs error: Invalid job id specified") is None
    decision = decide(SAVED, 0, 0, 5, "TERM", None)
    assert (decision.action, decision.ending) == (Action.EXIT, Ending.UNKNOWN_TERM)
    assert "slurmft resume" in decision.message
    time_limit = JobView("COMPLETING", "TimeLimit", 5)
    assert decide(SAVED, 0, 5, 5, "TERM", time_limit).code == EXIT_REQUEUE_REFUSED  # the budget holds here too
