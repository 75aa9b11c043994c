"""slurmft.slurm_states: every state Slurm 22.05 lists (`man squeue`, JOB STATE CODES) parses, the live
set holds every state of a job that may still run, each state has its one wording, and a word slurmft
does not know counts as live."""

from __future__ import annotations

import pytest

from slurmft import slurm_states as ss
from slurmft.slurm_states import State, is_allocated, is_live, parse, words

# `man squeue` / `man sacct` of Slurm 22.05.8, section JOB STATE CODES.
MAN_SQUEUE_22_05 = ["BOOT_FAIL", "CANCELLED", "COMPLETED", "CONFIGURING", "COMPLETING", "DEADLINE", "FAILED",
                    "NODE_FAIL", "OUT_OF_MEMORY", "PENDING", "PREEMPTED", "RUNNING", "RESV_DEL_HOLD", "REQUEUE_FED",
                    "REQUEUE_HOLD", "REQUEUED", "RESIZING", "REVOKED", "SIGNALING", "SPECIAL_EXIT", "STAGE_OUT",
                    "STOPPED", "SUSPENDED", "TIMEOUT"]


def test_every_state_of_the_man_page_parses() -> None:
    assert {parse(w) for w in MAN_SQUEUE_22_05} == set(State) - {State.KILLED, State.UNKNOWN, State.HIDDEN}


@pytest.mark.parametrize("word", ["PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "STOPPED", "COMPLETING",
                                  "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT",
                                  "SPECIAL_EXIT", "RESV_DEL_HOLD"])
def test_states_of_a_job_that_may_still_run_are_live(word: str) -> None:
    assert is_live(word) and parse(word) in ss.LIVE


@pytest.mark.parametrize("word", ["COMPLETED", "FAILED", "CANCELLED", "CANCELLED by 0", "TIMEOUT", "PREEMPTED",
                                  "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "KILLED", "UNKNOWN", ""])
def test_ended_states_are_not_live(word: str) -> None:
    assert not is_live(word) and parse(word) in ss.ENDED


def test_the_sets_split_every_state_once() -> None:
    assert set(State) == ss.LIVE | ss.ENDED | ss.UNSEEN and not ss.LIVE & ss.ENDED
    assert not ss.UNSEEN & (ss.LIVE | ss.ENDED)  # cannot tell: neither live nor ended
    assert ss.LIVE == ss.ALLOCATED | ss.WAITING and not ss.ALLOCATED & ss.WAITING
    assert State.SUSPENDED in ss.ALLOCATED and State.REQUEUE_HOLD in ss.WAITING


def test_an_unknown_word_does_not_crash_and_counts_as_live() -> None:
    assert parse("FROBNICATED") is None
    assert is_live("FROBNICATED") and is_allocated("FROBNICATED")  # refuse rather than submit beside it
    assert words("FROBNICATED") == "frobnicated (a Slurm state slurmft does not know; counted as live)"


def test_one_wording_per_state() -> None:
    assert set(ss.WORDS) == set(State) and len(set(ss.WORDS.values())) == len(ss.WORDS)
    assert words("TIMEOUT") == "hit its time limit" and words("CANCELLED by 0") == "cancelled"
    assert words("SUSPENDED").startswith("suspended")
    assert parse("suspended") == State.SUSPENDED  # case does not matter
