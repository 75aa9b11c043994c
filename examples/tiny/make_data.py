"""Generate the tiny example's chat data, deterministically (``python examples/tiny/make_data.py``).

Two files in the two layouts slurmft reads besides ``messages``:

- ``data/lima.jsonl``: LIMA style, ``{"conversations": [user, assistant, user, assistant, ...]}``;
- ``data/guanaco.jsonl``: openassistant-guanaco style, ``{"text": "### Human: ...### Assistant: ..."}``.

Simple arithmetic, counting and greeting questions with templated answers, so a 5M-parameter model's
loss drops visibly within a few dozen steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Oscar"]
N_EXAMPLES = 400


def qa(rng: random.Random) -> tuple[str, str]:
    """One question and its answer."""
    kind = rng.choice(["plus", "minus", "times", "next", "hello", "compare"])
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    if kind == "plus":
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == "minus":
        a, b = max(a, b), min(a, b)
        return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."
    if kind == "times":
        a, b = a % 13, b % 13
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if kind == "next":
        return f"Which number comes after {a}?", f"The number after {a} is {a + 1}."
    if kind == "hello":
        name = rng.choice(NAMES)
        return f"Say hello to {name}.", f"Hello, {name}! Nice to meet you."
    bigger = "Yes" if a > b else "No"
    return f"Is {a} larger than {b}?", f"{bigger}, {a} is {'larger' if a > b else 'not larger'} than {b}."


def conversation(rng: random.Random) -> list[str]:
    """One to three question/answer turns."""
    turns: list[str] = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        turns.extend(qa(rng))
    return turns


def main() -> None:
    out = Path(__file__).resolve().parent / "data"
    out.mkdir(exist_ok=True)
    rng = random.Random(1234)
    with open(out / "lima.jsonl", "w") as f:
        for _ in range(N_EXAMPLES):
            f.write(json.dumps({"conversations": conversation(rng)}) + "\n")
    with open(out / "guanaco.jsonl", "w") as f:
        for _ in range(N_EXAMPLES):
            turns = conversation(rng)
            text = "".join(
                f"### Human: {turns[i]}### Assistant: {turns[i + 1]}" for i in range(0, len(turns), 2)
            )
            f.write(json.dumps({"text": text}) + "\n")
    print(f"wrote {N_EXAMPLES} examples each to {out}/lima.jsonl and {out}/guanaco.jsonl")


if __name__ == "__main__":
    main()
