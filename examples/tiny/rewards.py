"""A reward of the user's own for the tiny GRPO example (grpo.yaml: ``./rewards.py:mentions_number``)."""

import re


def mentions_number(completions, **kwargs):
    """1.0 when the completion contains a number (the tiny data's answers all do), else 0.0."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if re.search(r"\d", t) else 0.0 for t in texts]
