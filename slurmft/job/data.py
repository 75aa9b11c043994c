"""Training data: load every source, map it to chat ``messages``, mix them by weight.

Formats (``data.datasets[].format``; ``auto`` detects from the columns and the first record):

- ``messages``: a list of ``{"role", "content"}`` dicts (TRL's conversational format) — kept as is;
- ``lima``: ``conversations``, a list of strings alternating user / assistant (GAIR/lima);
- ShareGPT ``conversations`` with ``{"from", "value"}`` dicts — converted by TRL's
  ``maybe_convert_to_chatml``, then ShareGPT's roles (``human``, ``gpt``) renamed to chat roles;
- ``guanaco``: ``text`` holding ``### Human: ... ### Assistant: ...`` turns
  (timdettmers/openassistant-guanaco).

Everything after that is TRL's: ``SFTTrainer`` applies the tokenizer's chat template, builds the
assistant-token mask (``assistant_only_loss``), and packs to ``max_seq_length``. Sources are mixed
with ``datasets.interleave_datasets`` (probabilities = normalised weights, seeded,
``all_exhausted``: nothing is dropped, smaller sources repeat as their weight demands). A large
source with a tiny weight would make the others repeat until it is exhausted (10k rows at 0.01 +
100 rows at 0.99 gave a million rows, all tokenized on rank 0), so the mixture is cut at
``MAX_MIX_BLOWUP`` times the sources' total, with a warning; the cut keeps the start of the
interleaved order, so the proportions stay the weights.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from slurmft.config import DataConfig, DatasetSource
from slurmft.errors import JobSetupError

log = logging.getLogger("slurmft.job")

MAX_MIX_BLOWUP = 4  # a weighted mixture holds at most this many times the sources' total rows
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
GUANACO_TURN = re.compile(r"###\s*(Human|Assistant)\s*:", re.IGNORECASE)
GUANACO_ROLES = {"human": "user", "assistant": "assistant"}
MESSAGES = "messages"


def _features():
    from datasets import Features, List, Value

    return Features({MESSAGES: List({"role": Value("string"), "content": Value("string")})})


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


def normalize(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Merge consecutive turns of one role, drop empty turns and trailing turns after the last reply.

    Strict templates (Llama-2's) raise on roles that do not alternate; a turn nobody answers trains nothing.
    """
    out: list[dict[str, str]] = []
    for m in messages:
        content = (m.get("content") or "").strip()
        if not content:
            continue
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append({"role": m["role"], "content": content})
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out


def _is_usable(example: dict[str, Any]) -> bool:
    """A conversation that opens with a user (or system) turn and has a reply."""
    messages = example[MESSAGES]
    return bool(messages) and messages[0]["role"] != "assistant" and messages[-1]["role"] == "assistant"


def detect_format(source: DatasetSource, columns: list[str], first: dict[str, Any], where: str) -> tuple[str, str]:
    """(format, column) of a source, or a JobSetupError naming the columns found."""
    if source.format != "auto":
        default = {"messages": "messages", "lima": "conversations", "guanaco": "text"}[source.format]
        column = source.text_field or default
        if column not in columns:
            raise JobSetupError(
                f"{where}: format {source.format!r} needs a column {column!r}, but the columns are {columns} "
                "(set text_field to the column that holds it)"
            )
        return source.format, column
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
    raise JobSetupError(
        f"{where}: cannot find a conversation in the columns {columns}. Expected 'messages' (role/content list), "
        "'conversations' (LIMA: list of strings; ShareGPT: from/value dicts) or 'text' with '### Human:' / "
        "'### Assistant:' turns; set format and text_field if yours is named differently"
    )


def _load_source(source: DatasetSource, where: str):
    from datasets import load_dataset

    path = Path(source.path).expanduser()
    try:
        if path.exists():
            builder = LOCAL_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise JobSetupError(f"{where}: {source.path!r} is not a .json, .jsonl or .parquet file")
            return load_dataset(builder, data_files=str(path), split="train")
        if source.path.startswith(("/", "./", "../", "~")) or path.suffix.lower() in LOCAL_BUILDERS:
            raise JobSetupError(f"{where}: file {source.path!r} does not exist")
        return load_dataset(source.path, source.name, split=source.split)
    except JobSetupError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise JobSetupError(f"{where}: cannot load {source.path!r} ({type(exc).__name__}: {first})") from None


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


def _convert(batch: dict[str, list[Any]], fmt: str, column: str) -> dict[str, list[Any]]:
    from trl.data_utils import maybe_convert_to_chatml

    out = []
    for value in batch[column]:
        if fmt == "lima":
            out.append(lima_to_messages(value or []))
        elif fmt == "guanaco":
            out.append(guanaco_to_messages(value or ""))
        elif fmt == "sharegpt":
            chat = maybe_convert_to_chatml({"conversations": value or []})["messages"]
            out.append([{"role": SHAREGPT_ROLES.get(str(m["role"]).lower(), m["role"]), "content": m["content"]}
                        for m in chat])
        else:
            out.append([{"role": m["role"], "content": m["content"]} for m in value or []])
    return {MESSAGES: [normalize(m) for m in out]}


def load_source(source: DatasetSource, index: int, num_proc: int | None):
    """One source as a ``messages``-only dataset, unusable rows dropped."""
    where = f"data.datasets[{index}] ({source.path})"
    ds = _load_source(source, where)
    if len(ds) == 0:
        raise JobSetupError(f"{where}: the dataset is empty")
    fmt, column = detect_format(source, list(ds.column_names), ds[0], where)
    ds = ds.map(
        _convert,
        batched=True,
        fn_kwargs={"fmt": fmt, "column": column},
        remove_columns=ds.column_names,
        features=_features(),
        num_proc=num_proc,
        desc=f"{Path(source.path).name}: {fmt} -> messages",
    )
    before = len(ds)
    ds = ds.filter(_is_usable, num_proc=num_proc)
    if len(ds) == 0:
        raise JobSetupError(f"{where}: no usable conversation (each needs a user turn followed by an assistant turn)")
    if len(ds) < before:
        log.warning("%s: dropped %d of %d rows without a usable conversation", where, before - len(ds), before)
    log.info("%s: %d conversations (%s)", where, len(ds), fmt)
    return ds


def check_template(ds, tokenizer, where: str, n: int = 16) -> None:
    """Render the first conversations with the chat template now, not deep inside TRL's preprocessing."""
    for i in range(min(n, len(ds))):
        try:
            tokenizer.apply_chat_template(ds[i][MESSAGES], tokenize=False)
        except Exception as exc:
            raise JobSetupError(
                f"{where}: the chat template cannot render conversation {i} ({type(exc).__name__}: {exc}); "
                "use a tokenizer/template that accepts these roles (train.sft.chat_template_path)"
            ) from None


def load_mixture(data: DataConfig, seed: int, tokenizer: Any = None):
    """All sources, mixed by weight into one ``messages`` dataset (checked against ``tokenizer``'s template)."""
    from datasets import interleave_datasets

    parts = [load_source(src, i, data.num_proc) for i, src in enumerate(data.datasets)]
    if tokenizer is not None:
        for i, (src, part) in enumerate(zip(data.datasets, parts, strict=True)):
            check_template(part, tokenizer, f"data.datasets[{i}] ({src.path})")
    if len(parts) == 1:
        return parts[0]
    total = sum(src.weight for src in data.datasets)
    probabilities = [src.weight / total for src in data.datasets]
    mixed = interleave_datasets(parts, probabilities=probabilities, seed=seed, stopping_strategy="all_exhausted")
    cap = MAX_MIX_BLOWUP * sum(len(part) for part in parts)
    if len(mixed) > cap:
        log.warning("the weights would repeat the sources to %d conversations; cut to %d (%dx their total) — a "
                    "source with a small weight and many rows is only partly used", len(mixed), cap, MAX_MIX_BLOWUP)
        mixed = mixed.select(range(cap))
    log.info("mixed %d sources with probabilities %s: %d conversations", len(parts),
             [round(p, 3) for p in probabilities], len(mixed))
    return mixed
