"""Record layouts of training data, and their conversion to chat ``messages``: plain Python, no torch.

The login side (``slurmft validate``/``submit``, via :mod:`slurmft.plan.checks`) and the job
(:mod:`slurmft.job.data`) call the same functions on the same rows, so a file that validates is a
file the job can read, and a file the job would refuse is refused before the queue wait.

Formats (``data.datasets[].format``; ``auto`` detects from the columns and the first record):

- ``messages``: a list of ``{"role", "content"}`` dicts (TRL's conversational format);
- ``sharegpt``: ``conversations``, a list of ``{"from", "value"}`` dicts (``human``/``gpt`` roles);
- ``lima``: ``conversations``, a list of strings alternating user / assistant (GAIR/lima);
- ``guanaco``: ``text`` holding ``### Human: ... ### Assistant: ...`` turns;
- ``alpaca``: ``instruction``, optional ``input``, ``output`` (the instruction and the input form
  the user turn, separated by a blank line);
- ``prompt_completion``: ``prompt`` and ``completion``, strings or lists of messages (TRL's layout).

``columns`` renames the user's columns to these names first (``{prompt: question}``); ``text_field``
names the one column of the single-column formats.
"""

from __future__ import annotations

import re
from typing import Any

from slurmft.config import DatasetSource
from slurmft.errors import ConfigError

GUANACO_TURN = re.compile(r"###\s*(Human|Assistant)\s*:", re.IGNORECASE)
GUANACO_ROLES = {"human": "user", "assistant": "assistant"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}

#: format -> the columns it reads (after ``columns`` renaming); the first is required unless noted below
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "lima": ("conversations",),
    "guanaco": ("text",),
    "alpaca": ("instruction", "output", "input"),
    "prompt_completion": ("prompt", "completion"),
}
OPTIONAL_COLUMNS = {"input"}
EXPECTED = (
    "'messages' (role/content list), 'conversations' (ShareGPT from/value dicts, or LIMA strings), 'text' with "
    "'### Human:' / '### Assistant:' turns, 'instruction'/'input'/'output' (Alpaca) or 'prompt'/'completion'"
)


def rename(row: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    """A row with the user's column names replaced by the format's (``columns`` maps ours -> theirs)."""
    if not columns:
        return row
    theirs = {v: k for k, v in columns.items()}
    return {theirs.get(k, k): v for k, v in row.items()}


def _single_column(source: DatasetSource, fmt: str) -> str:
    return source.text_field or FORMAT_COLUMNS[fmt][0]


def detect_format(source: DatasetSource, columns: list[str], first: dict[str, Any], where: str) -> tuple[str, str]:
    """(format, main column) of a source from its (renamed) columns and first row; ConfigError otherwise.

    ``columns`` and ``first`` are after :func:`rename`. The message names the columns found and the fix.
    """
    missing_mapped = [f"{ours} -> {theirs!r}" for ours, theirs in source.columns.items() if ours not in columns]
    if missing_mapped:
        raise ConfigError(f"{where}: columns maps {', '.join(missing_mapped)}, but the columns are {columns}")
    if source.format != "auto":
        fmt = source.format
        needed = [_single_column(source, fmt)] if len(FORMAT_COLUMNS[fmt]) == 1 else [
            c for c in FORMAT_COLUMNS[fmt] if c not in OPTIONAL_COLUMNS]
        absent = [c for c in needed if c not in columns]
        if absent:
            fix = ("set text_field to the column that holds it" if len(FORMAT_COLUMNS[fmt]) == 1 else
                   f"map yours with columns: {{{', '.join(f'{c}: YOUR_COLUMN' for c in absent)}}}")
            raise ConfigError(
                f"{where}: format {fmt!r} needs the column(s) {absent}, but the columns are {columns} ({fix})"
            )
        return fmt, needed[0]
    if {"instruction", "output"} <= set(columns):
        return "alpaca", "instruction"
    if {"prompt", "completion"} <= set(columns):
        return "prompt_completion", "prompt"
    candidates = [source.text_field] if source.text_field else ["messages", "conversations", "text"]
    for column in candidates:
        if column not in columns:
            continue
        value = first.get(column)
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            if {"role", "content"} <= set(value[0]):
                return "messages", column
            if {"from", "value"} <= set(value[0]):
                return "sharegpt", column
        if isinstance(value, list) and value and all(isinstance(m, str) for m in value):
            return "lima", column
        if isinstance(value, str) and GUANACO_TURN.search(value):
            return "guanaco", column
    raise ConfigError(
        f"{where}: cannot find a conversation in the columns {columns}. Expected {EXPECTED}; "
        "set format (and columns: {ours: yours} if your columns are named differently)"
    )


def lima_to_messages(turns: list[str]) -> list[dict[str, str]]:
    """LIMA: strings alternating user, assistant, user, ..."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": str(t).strip()} for i, t in enumerate(turns)]


def guanaco_to_messages(text: str) -> list[dict[str, str]]:
    """Guanaco: ``### Human: q### Assistant: a### Human: ...``; text before the first marker is dropped."""
    parts = GUANACO_TURN.split(text)
    messages = []
    for i in range(1, len(parts) - 1, 2):
        content = parts[i + 1].strip()
        if content:
            messages.append({"role": GUANACO_ROLES[parts[i].lower()], "content": content})
    return messages


def sharegpt_to_messages(turns: list[dict[str, Any]]) -> list[dict[str, str]]:
    """ShareGPT: ``{"from": "human"|"gpt"|..., "value": ...}`` turns."""
    return [{"role": SHAREGPT_ROLES.get(str(t.get("from", "")).lower(), str(t.get("from", ""))),
             "content": str(t.get("value") or "")} for t in turns if isinstance(t, dict)]


def alpaca_to_messages(instruction: Any, input_: Any, output: Any) -> list[dict[str, str]]:
    """Alpaca: the instruction (and the input, after a blank line) is the user turn, the output the reply."""
    user = "\n\n".join(str(x).strip() for x in (instruction, input_) if x is not None and str(x).strip())
    return [{"role": "user", "content": user}, {"role": "assistant", "content": str(output or "")}]


def _as_turns(value: Any, role: str) -> list[dict[str, str]]:
    if isinstance(value, list):
        return [{"role": str(m.get("role", role)), "content": str(m.get("content") or "")}
                for m in value if isinstance(m, dict)]
    return [{"role": role, "content": str(value or "")}]


def prompt_completion_to_messages(prompt: Any, completion: Any) -> list[dict[str, str]]:
    """Prompt/completion: strings (one user turn, one reply) or TRL's conversational lists."""
    return _as_turns(prompt, "user") + _as_turns(completion, "assistant")


def to_messages(row: dict[str, Any], fmt: str, column: str) -> list[dict[str, str]]:
    """One (renamed) row as chat messages, normalised (see :func:`normalize`)."""
    value = row.get(column)
    if fmt == "lima":
        out = lima_to_messages(value or [])
    elif fmt == "guanaco":
        out = guanaco_to_messages(value or "")
    elif fmt == "sharegpt":
        out = sharegpt_to_messages(value or [])
    elif fmt == "alpaca":
        out = alpaca_to_messages(row.get("instruction"), row.get("input"), row.get("output"))
    elif fmt == "prompt_completion":
        out = prompt_completion_to_messages(row.get("prompt"), row.get("completion"))
    else:
        out = [{"role": str(m.get("role")), "content": m.get("content")} for m in value or [] if isinstance(m, dict)]
    return normalize(out)


def normalize(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Merge consecutive turns of one role, drop empty turns and trailing turns after the last reply.

    Strict templates (Llama-2's) raise on roles that do not alternate; a turn nobody answers trains nothing.
    """
    out: list[dict[str, str]] = []
    for m in messages:
        content = str(m.get("content") or "").strip()
        if not content:
            continue
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append({"role": m["role"], "content": content})
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out


def is_usable(messages: list[dict[str, str]]) -> bool:
    """A conversation that opens with a user (or system) turn and has a reply."""
    return bool(messages) and messages[0]["role"] != "assistant" and messages[-1]["role"] == "assistant"
