"""Built-in GRPO reward functions: ``grpo.rewards: [{function: exact_match}, {function: think_format}]``.

Plain Python (no torch), called by TRL's ``GRPOTrainer`` as every reward is: keyword arguments ``prompts``,
``completions`` (strings, or conversations: a list with one assistant message) and each extra column of the
prompt data, one value per completion; one float per completion back. Math answers checked by symbolic equality
need ``math-verify``, which slurmft does not depend on: ship a reward of your own that imports it
(docs/grpo.md).
"""

from __future__ import annotations

import re
from typing import Any

#: DeepSeek-R1's layout: reasoning in <think>...</think>, then the answer in <answer>...</answer>
THINK_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or the content of a conversation's (last) message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return str(completion)


def _normal(text: str) -> str:
    return " ".join(text.split()).strip().lower()


def exact_match(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion's answer equals the row's ``answer`` column (case and spacing ignored), else 0.0.
    The completion's answer is the text inside ``<answer>...</answer>`` when it has one, else the whole text."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion_text(completion)
        tagged = ANSWER_TAG.search(text)
        got = tagged.group(1) if tagged else text
        scores.append(1.0 if _normal(got) == _normal(str(expected)) else 0.0)
    return scores


def think_format(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion is ``<think>...</think> <answer>...</answer>`` and nothing else, else 0.0."""
    return [1.0 if THINK_FORMAT.match(completion_text(c)) else 0.0 for c in completions]


#: the built-ins by name, and the data column each needs beside the prompt
BUILTINS = {"exact_match": ("answer",), "think_format": ()}
