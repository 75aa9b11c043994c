"""Generate the tiny example's chat data, deterministically (``python examples/tiny/make_data.py``).

Two files in the two layouts slurmft reads besides ``messages``:

- ``data/lima.jsonl``: LIMA style, ``{"conversations": [user, assistant, user, assistant, ...]}``;
- ``data/guanaco.jsonl``: openassistant-guanaco style, ``{"text": "### Human: ...### Assistant: ..."}``;

and the preference pairs of the tiny DPO example (``dpo.yaml``), made from ``lima.jsonl``:

- ``data/choices.jsonl``: the tiny evaluation task's multiple-choice questions (``tasks/tiny_choice.yaml``,
  ``serve-eval.yaml``);
- ``data/pairs.jsonl``: TRL's explicit-prompt layout, ``{"prompt": ..., "chosen": ..., "rejected": ...}``: a
  conversation's first question, its own answer chosen, the answer of the conversation 7 rows on rejected;

and the prompts of the tiny GRPO example (``grpo.yaml``), made from ``lima.jsonl``:

- ``data/prompts.jsonl``: TRL's prompt-only layout, ``{"prompt": ..., "answer": ...}``: a conversation's first
  question and its answer (the ``answer`` column reaches the rewards: the built-in ``exact_match`` reads it);

and the plain-text corpus of the tiny continued-pretraining example (``text.yaml``, docs/text.md):

- ``data/corpus/notes-0K.txt``: six files of documents between blank lines, each document a few answers' sentences
  (no chat template, every token in the loss).

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


N_PAIRS = 64  # from the first lima conversations (a pair whose two answers are equal is left out)


def pairs(conversations: list[list[str]]) -> list[dict[str, str]]:
    """Preference pairs: each conversation's first question and answer, another conversation's answer rejected."""
    out = [{"prompt": c[0], "chosen": c[1], "rejected": conversations[(i + 7) % len(conversations)][1]}
           for i, c in enumerate(conversations[:N_PAIRS])]
    return [p for p in out if p["chosen"] != p["rejected"]]


N_PROMPTS = 32  # prompts of the tiny GRPO example


def prompts(conversations: list[list[str]]) -> list[dict[str, str]]:
    """GRPO prompts: each conversation's first question, its answer as the reward's reference."""
    return [{"prompt": c[0], "answer": c[1]} for c in conversations[:N_PROMPTS]]


N_CHOICES = 32  # multiple-choice questions of the tiny evaluation task (tasks/tiny_choice.yaml)


def choices(rng: random.Random) -> list[dict[str, object]]:
    """The tiny lm-eval task's rows: a fresh question, its answer among three answers to other kinds of question
    (a model tuned on the chat data learns which kind of answer follows which question; the base has not)."""
    rows = []
    while len(rows) < N_CHOICES:
        question, answer = qa(rng)
        wrong: list[str] = []
        while len(wrong) < 3:
            q, a = qa(rng)
            if q.split()[:2] != question.split()[:2] and a not in wrong:
                wrong.append(a)
        label = rng.randrange(4)
        options = wrong[:label] + [answer] + wrong[label:]
        rows.append({"question": question, "choices": options, "label": label})
    return rows


N_CORPUS_FILES, N_DOCUMENTS = 6, 40  # the plain-text corpus: files, and documents per file


def corpus_file(rng: random.Random) -> str:
    """One corpus file: documents of two to six answers' sentences, separated by blank lines."""
    documents = [" ".join(qa(rng)[1] for _ in range(rng.randint(2, 6))) for _ in range(N_DOCUMENTS)]
    return "\n\n".join(documents) + "\n"


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
    lima = [json.loads(line)["conversations"] for line in (out / "lima.jsonl").read_text().splitlines()]
    preference = pairs(lima)
    with open(out / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in preference)
    with open(out / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in prompts(lima))
    with open(out / "choices.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in choices(random.Random(99)))
    (out / "corpus").mkdir(exist_ok=True)
    text_rng = random.Random(4321)
    for k in range(N_CORPUS_FILES):
        (out / "corpus" / f"notes-{k:02d}.txt").write_text(corpus_file(text_rng))
    print(f"wrote {N_EXAMPLES} examples each to {out}/lima.jsonl and {out}/guanaco.jsonl, "
          f"{len(preference)} preference pairs to {out}/pairs.jsonl, {N_CHOICES} evaluation questions to "
          f"{out}/choices.jsonl, {N_CORPUS_FILES} files of {N_DOCUMENTS} documents to {out}/corpus/")


if __name__ == "__main__":
    main()
