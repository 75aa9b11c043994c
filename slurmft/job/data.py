"""Training data: load every source, map it to chat ``messages``, mix them by weight.

Formats (``data.datasets[].format``) and their conversion live in :mod:`slurmft.formats`, shared with
the login side's checks (:mod:`slurmft.plan.checks`): what ``slurmft validate`` accepts, the job reads.

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
from pathlib import Path
from typing import Any

from slurmft import chat_template, formats
from slurmft.config import DataConfig, DatasetSource
from slurmft.config_paths import DATA_BUILDERS, looks_like_path
from slurmft.errors import ConfigError, JobSetupError

log = logging.getLogger("slurmft.job")

MAX_MIX_BLOWUP = 4  # a weighted mixture holds at most this many times the sources' total rows
MESSAGES = "messages"
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


def _features(preference: bool = False):
    from datasets import Features, List, Value

    turns = List({"role": Value("string"), "content": Value("string")})
    if preference:  # TRL's explicit-prompt conversational preference layout
        return Features({name: turns for name in PREFERENCE_COLUMNS})
    return Features({MESSAGES: turns})


def _is_usable(example: dict[str, Any]) -> bool:
    return formats.is_usable(example[MESSAGES])


def detect_format(source: DatasetSource, columns: list[str], first: dict[str, Any], where: str) -> tuple[str, str]:
    """(format, column) of a source (columns already renamed), or a JobSetupError naming the columns found."""
    try:
        return formats.detect_format(source, columns, first, where)
    except ConfigError as exc:
        raise JobSetupError(str(exc)) from None


def _load_source(source: DatasetSource, where: str):
    from datasets import load_dataset

    path = Path(source.path).expanduser()
    try:
        if path.exists():
            builder = DATA_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise JobSetupError(f"{where}: {source.path!r} is not a .json, .jsonl, .csv or .parquet file")
            return load_dataset(builder, data_files=str(path), split="train")
        if looks_like_path(source.path) or path.suffix.lower() in DATA_BUILDERS:
            raise JobSetupError(f"{where}: file {source.path!r} does not exist")
        return load_dataset(source.path, source.name, split=source.split, revision=source.revision)
    except JobSetupError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise JobSetupError(f"{where}: cannot load {source.path!r} ({type(exc).__name__}: {first})") from None


def _convert(batch: dict[str, list[Any]], fmt: str, column: str, names: list[str]) -> dict[str, list[Any]]:
    rows = ({name: batch[name][i] for name in names} for i in range(len(batch[names[0]])))
    return {MESSAGES: [formats.to_messages(row, fmt, column) for row in rows]}


def _convert_preference(batch: dict[str, list[Any]], names: list[str]) -> dict[str, list[Any]]:
    rows = ({name: batch[name][i] for name in names} for i in range(len(batch[names[0]])))
    pairs = [formats.to_preference(row) for row in rows]
    return {name: [pair[name] for pair in pairs] for name in PREFERENCE_COLUMNS}


def _has_problem(pair: dict[str, Any]) -> bool:
    return formats.preference_problem(pair) is not None


def load_preference_source(ds, fmt: str, where: str, num_proc: int | None):
    """A preference source as TRL's explicit-prompt conversations; a row that cannot train is an error, not dropped
    (``slurmft validate`` refuses it on the first rows; here every row is checked)."""
    names = list(ds.column_names)
    ds = ds.map(_convert_preference, batched=True, fn_kwargs={"names": names}, remove_columns=names,
                features=_features(preference=True), num_proc=num_proc, desc=f"{where}: {fmt} -> prompt/chosen/rejected")
    bad = ds.filter(_has_problem, num_proc=num_proc)
    if len(bad):
        raise JobSetupError(f"{where}: {len(bad)} of {len(ds)} preference rows cannot train, e.g. one with "
                            f"{formats.preference_problem(bad[0])} (DPO needs a prompt and a non-empty chosen and "
                            "rejected reply each): fix or remove them")
    log.info("%s: %d preference pairs", where, len(ds))
    return ds


def load_prompt_source(ds, where: str):
    """A GRPO prompt source as it is: ``prompt`` (string or conversation) and the columns the rewards read; a row
    that cannot be completed is an error (``slurmft validate`` refuses it on the rows it reads)."""
    for i, prompt in enumerate(ds["prompt"]):
        why = formats.prompt_problem(prompt)
        if why:
            raise JobSetupError(f"{where}: row {i} has {why}; fix or remove it")
    log.info("%s: %d prompts (extra columns for the rewards: %s)", where, len(ds),
             ", ".join(c for c in ds.column_names if c != "prompt") or "none")
    return ds


def load_source(source: DatasetSource, index: int, num_proc: int | None, method: str = "sft"):
    """One source as a ``messages``-only dataset, unusable rows dropped; for ``method`` dpo: as
    ``prompt``/``chosen``/``rejected`` conversations, refused when it is not preference data; grpo: prompts as they
    are (with the columns the rewards read), refused when they hold completions."""
    where = f"data.datasets[{index}] ({source.path})"
    ds = _load_source(source, where)
    if len(ds) == 0:
        raise JobSetupError(f"{where}: the dataset is empty")
    if source.columns:
        ds = ds.rename_columns({theirs: ours for ours, theirs in source.columns.items() if theirs in ds.column_names})
    fmt, column = detect_format(source, list(ds.column_names), ds[0], where)
    problem = formats.method_problem(fmt, method, list(ds.column_names), where)
    if problem:
        raise JobSetupError(problem)
    if method == "dpo":
        return load_preference_source(ds, fmt, where, num_proc)
    if method == "grpo":
        return load_prompt_source(ds, where)
    ds = ds.map(
        _convert,
        batched=True,
        fn_kwargs={"fmt": fmt, "column": column, "names": list(ds.column_names)},
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
        row = ds[i]
        try:
            if MESSAGES in row:
                tokenizer.apply_chat_template(row[MESSAGES], tokenize=False)
            elif "chosen" not in row:  # a GRPO prompt: rendered for generation when it is a conversation
                if isinstance(row["prompt"], list):
                    tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            else:  # a preference pair: TRL renders the prompt alone, then with each reply
                tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
                for side in ("chosen", "rejected"):
                    tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=False)
        except Exception as exc:
            raise JobSetupError(chat_template.cannot_render_message(where, i, exc)) from None


def load_mixture(data: DataConfig, seed: int, tokenizer: Any = None, method: str = "sft"):
    """All sources, mixed by weight into one ``messages`` dataset (checked against ``tokenizer``'s template);
    ``method`` dpo: one ``prompt``/``chosen``/``rejected`` dataset; grpo: one prompt dataset."""
    from datasets import interleave_datasets

    parts = [load_source(src, i, data.num_proc, method) for i, src in enumerate(data.datasets)]
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
