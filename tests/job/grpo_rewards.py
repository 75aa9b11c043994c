"""Reward functions of the GRPO tests (tests/job/test_grpo_cpu.py): continuous, so that a random model's
completions get different rewards within a group (non-zero advantages) and the extra column reaches them."""


def shared_letters(completions, answer, **kwargs):
    """The share of the completion's distinct letters that also occur in the row's answer."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        letters = {c for c in completion.lower() if c.isalpha()}
        scores.append(len(letters & set(expected.lower())) / len(letters) if letters else 0.0)
    return scores


def length(completions, **kwargs):
    """The completion's length in characters, scaled to about 1."""
    return [len(c) / 40 for c in completions]


def length_then_signal(completions, trainer_state, **kwargs):
    """:func:`length`; on rank 1 of a first attempt, when the generation of the step after ``GRPO_TEST_SIGNAL_AT``
    steps scores its completions, it also sends the warning signal to its own process: a signal that lands inside a
    step, at a place every run reaches the same way (test_grpo_cpu.py's preempted run)."""
    import os
    import signal

    at = os.environ.get("GRPO_TEST_SIGNAL_AT")
    if (at is not None and trainer_state.global_step == int(at) and os.environ.get("SLURM_PROCID") == "1"
            and os.environ.get("SLURM_RESTART_COUNT") == "0"):
        os.kill(os.getpid(), signal.SIGUSR2)
    return length(completions)


def length_recorded(completions, completion_ids, trainer_state, **kwargs):
    """:func:`length`; each rank also appends the completion ids it scores, with the step, to
    ``$GRPO_TEST_RECORD.rank<R>.jsonl`` (tests/job/test_grpo_vllm_cpu.py compares the rollouts of two runs)."""
    import json
    import os

    record = os.environ.get("GRPO_TEST_RECORD")
    if record:
        with open(f"{record}.rank{os.environ.get('SLURM_PROCID', '0')}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer_state.global_step, "ids": [list(c) for c in completion_ids]}) + "\n")
    return length(completions)


def length_recorded_then_signal(completions, completion_ids, trainer_state, **kwargs):
    """:func:`length_recorded` and the warning signal of :func:`length_then_signal` (tests/job/test_grpo_vllm_cpu.py's
    preempted colocate run: its completions recorded like its twin's, the signal landing inside a generation)."""
    length_then_signal(completions, trainer_state)
    return length_recorded(completions, completion_ids, trainer_state)
