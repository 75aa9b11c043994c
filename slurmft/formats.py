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

- ``preference`` (for ``dpo:``): ``chosen`` and ``rejected`` with an explicit ``prompt`` or sharing their
  prompt as a prefix (TRL's explicit and implicit prompt), each as strings or as conversations; Anthropic-HH's
  ``\n\nHuman: ... \n\nAssistant: ...`` strings are read as turns, and a chosen conversation that holds its
  own prompt (UltraFeedback-binarized: ``prompt`` is only its first turn's text) is read as implicit.

- ``text`` (continued pretraining): ``text``, a plain-text document; never converted to messages, never templated:
  TRL tokenizes it as language modelling (the tokenizer's BOS, the text, EOS) and every token is in the loss. Only
  ``format: text`` (or a ``.txt``/``.txt.gz`` file) reads a ``text`` column so: ``auto`` keeps reading one as guanaco
  chat, and refuses one without ``### Human:`` turns, saying how to read it as plain text.
- ``prompt`` (for ``grpo:``): ``prompt`` alone, a string or a conversation (TRL's prompt-only layout); every other
  column is kept and passed to the reward functions.

``columns`` renames the user's columns to these names first (``{prompt: question}``); ``text_field``
names the one column of the single-column formats.
"""

from __future__ import annotations

import re
from typing import Any

from slurmft.config import DatasetSource
from slurmft.errors import ConfigError
from slurmft.sourcefiles import is_text

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
    "preference": ("chosen", "rejected", "prompt"),
    "text": ("text",),
    "prompt": ("prompt",),
}
PREFERENCE = "preference"
TEXT = "text"
PROMPT_ONLY = "prompt"
#: format -> its columns that may be absent (a preference row without ``prompt``: TRL's implicit prompt)
OPTIONAL_COLUMNS: dict[str, tuple[str, ...]] = {"alpaca": ("input",), "preference": ("prompt",)}
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
    given = TEXT if is_text(source.path, source.format) else source.format  # a .txt file is plain text
    if given != "auto":
        fmt = given
        needed = [_single_column(source, fmt)] if len(FORMAT_COLUMNS[fmt]) == 1 else [
            c for c in FORMAT_COLUMNS[fmt] if c not in OPTIONAL_COLUMNS.get(fmt, ())]
        absent = [c for c in needed if c not in columns]
        if absent:
            fix = ("name the column that holds it with columns: {text: YOUR_COLUMN} (or text_field)" if fmt == TEXT
                   else "set text_field to the column that holds it" if len(FORMAT_COLUMNS[fmt]) == 1 else
                   f"map yours with columns: {{{', '.join(f'{c}: YOUR_COLUMN' for c in absent)}}}")
            raise ConfigError(
                f"{where}: format {fmt!r} needs the column(s) {absent}, but the columns are {columns} ({fix})"
            )
        return fmt, needed[0]
    if {"chosen", "rejected"} <= set(columns):
        return PREFERENCE, "chosen"
    if {"instruction", "output"} <= set(columns):
        return "alpaca", "instruction"
    if {"prompt", "completion"} <= set(columns):
        return "prompt_completion", "prompt"
    if "prompt" in columns:
        return PROMPT_ONLY, "prompt"
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
    plain = (" A text column without '### Human:' turns is plain text: set format: text to train on every token of "
             "it (continued pretraining)." if "text" in columns else "")
    raise ConfigError(
        f"{where}: cannot find a conversation in the columns {columns}. Expected {EXPECTED}; "
        "set format (and columns: {ours: yours} if your columns are named differently)." + plain
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


# ----------------------------------------------------------------------------- preference data (dpo:)
HH_TURN = re.compile(r"\n\n(Human|Assistant):")
HH_ROLES = {"human": "user", "assistant": "assistant"}


def hh_to_messages(text: str) -> list[dict[str, str]]:
    """Anthropic-HH: ``\\n\\nHuman: q\\n\\nAssistant: a...``; text before the first marker is dropped."""
    parts = HH_TURN.split(text)
    return [{"role": HH_ROLES[parts[i].lower()], "content": parts[i + 1].strip()} for i in range(1, len(parts) - 1, 2)]


def _preference_turns(value: Any, role: str) -> list[dict[str, str]]:
    """A prompt, chosen or rejected value as turns: a conversation, HH turns, or one ``role`` turn of text."""
    if isinstance(value, str) and HH_TURN.search(value):
        return hh_to_messages(value)
    return [{"role": t["role"], "content": t["content"].strip()} for t in _as_turns(value, role)]


def _common_prefix(a: list[dict[str, str]], b: list[dict[str, str]]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _plain_text(value: Any) -> bool:
    return isinstance(value, str) and not HH_TURN.search(value)


def _split_text_prompt(chosen: str, rejected: str) -> dict[str, str]:
    """TRL's implicit prompt of two strings (``trl.data_utils.extract_prompt``): their common prefix, ending before
    the space where they part."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def to_preference(row: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """One (renamed) preference row as TRL's explicit-prompt conversational layout.

    ``{"prompt": [...], "chosen": [...], "rejected": [...]}``: the prompt's turns end with the last non-assistant
    turn, chosen and rejected are the replies after it. Implicit prompts (chosen and rejected conversations that
    hold the prompt) are split at the turns they share; a chosen conversation with its own user turn wins over a
    ``prompt`` column (UltraFeedback-binarized repeats the first turn's text there). Strings become one user turn
    (the prompt) and one assistant turn each, as prompt/completion SFT data does, so both go through the chat
    template. Not normalised beyond stripping: an empty reply stays empty, for :func:`preference_problem`.
    """
    if row.get("prompt") is None and _plain_text(row.get("chosen")) and _plain_text(row.get("rejected")):
        row = {**row, **_split_text_prompt(row["chosen"], row["rejected"])}
    chosen = _preference_turns(row.get("chosen"), "assistant")
    rejected = _preference_turns(row.get("rejected"), "assistant")
    if any(t["role"] != "assistant" for t in chosen) or row.get("prompt") is None:
        n = _common_prefix(chosen, rejected)
        while n and chosen[n - 1]["role"] == "assistant":  # a shared reply is part of the answer, not the prompt
            n -= 1
        return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}
    return {"prompt": _preference_turns(row.get("prompt"), "user"), "chosen": chosen, "rejected": rejected}


def preference_problem(pair: dict[str, list[dict[str, str]]]) -> str | None:
    """Why a converted preference row cannot train (None: it can)."""
    for side in ("chosen", "rejected"):
        if not any(t["content"] for t in pair[side]):
            return f"an empty {side!r}"
        if pair[side][0]["role"] != "assistant":
            return f"{side!r} does not start with an assistant reply after the prompt"
    if not any(t["content"] for t in pair["prompt"]):
        return "no prompt (no 'prompt' column, and 'chosen' and 'rejected' share no opening turns)"
    if pair["chosen"] == pair["rejected"]:
        return "'chosen' and 'rejected' are the same"
    return None


def method_problem(fmt: str, method: str, columns: list[str], where: str) -> str | None:
    """Data another method trains on (``method``: sft, dpo, grpo): the message naming the columns found, or None."""
    if method == "dpo" and fmt == TEXT:
        return (f"{where}: plain text (format text) trains by language modelling, not by preference (dpo:); remove "
                "the source or the dpo: section")
    if method == "dpo" and fmt != PREFERENCE:
        return (f"{where}: dpo: trains on preference data ('chosen' and 'rejected', with or without 'prompt'), but "
                f"the columns are {columns} ({fmt} data for supervised fine-tuning): use preference data, map yours "
                "with columns: {chosen: YOUR_COLUMN, rejected: YOUR_COLUMN}, or remove the dpo: section")
    if method == "grpo" and (fmt == "prompt_completion" or "completion" in columns):
        return (f"{where}: grpo: generates the completions itself, but the rows hold a 'completion' (the columns are "
                f"{columns}): give prompts only (a 'prompt' column, string or conversation; other columns reach the "
                "rewards), e.g. rename 'completion' to 'answer' in the file for the exact_match reward, or remove the "
                "grpo: section to fine-tune on the completions")
    if method == "grpo" and fmt != PROMPT_ONLY:
        return (f"{where}: grpo: trains on prompts (a 'prompt' column, string or conversation, TRL's prompt-only "
                f"layout), but the columns are {columns} ({fmt} data): give prompt data, map yours with columns: "
                "{prompt: YOUR_COLUMN}, or remove the grpo: section")
    if method != "grpo" and fmt == PROMPT_ONLY:
        return (f"{where}: the columns {columns} hold prompts without replies, which {method} cannot train on: add a "
                "grpo: section (online RL with rewards), or give data with replies")
    if method != "dpo" and fmt == PREFERENCE:
        return (f"{where}: the columns {columns} are preference data (chosen/rejected), which "
                f"{'supervised fine-tuning' if method == 'sft' else method} cannot train on: add a dpo: section "
                "(preference tuning), or give SFT data")
    return None


def prompt_problem(prompt: Any) -> str | None:
    """Why one GRPO prompt cannot be completed (empty, not a string or a conversation), or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "an empty prompt"
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                   for m in prompt):
        if prompt[-1].get("role") == "assistant":
            return "a prompt conversation that ends with an assistant turn (the completion is generated)"
        return None
    return "a prompt that is neither a string nor a conversation (role/content list)"
