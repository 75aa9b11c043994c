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
