"""Training data: load every source, map it to chat ``messages`` (plain text: to ``text``), mix them by weight.

Formats (``data.datasets[].format``) and their conversion live in :mod:`slurmft.formats`, shared with
the login side's checks (:mod:`slurmft.plan.checks`): what ``slurmft validate`` accepts, the job reads.

A plain-text source (``format: text``, ``.txt``/``.txt.gz`` files, one file or a glob: slurmft/sourcefiles.py) becomes
one ``text`` document per row (per file, or per blank-line-separated block: ``documents``), never a conversation.
When a run has one, every source of the mixture carries both columns (``messages`` empty on a document, ``text``
None on a conversation), so they mix by weight as before; slurmft/job/prepare.py gives each kind to TRL's own
preparation (the chat template for conversations, language modelling for text) and puts them back in this order.

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

from slurmft import chat_template, formats, sourcefiles
from slurmft.config import DataConfig, DatasetSource
from slurmft.config_paths import DATA_BUILDERS, looks_like_path
from slurmft.errors import ConfigError, JobSetupError

log = logging.getLogger("slurmft.job")

MAX_MIX_BLOWUP = 4  # a weighted mixture holds at most this many times the sources' total rows
MESSAGES = "messages"
TEXT = formats.TEXT  # a plain-text document (continued pretraining); None on a conversation's row
#: ``documents`` -> the ``sample_by`` of datasets' text builder
TEXT_SAMPLE_BY = {"file": "document", "blank_line": "paragraph"}
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


def _features(preference: bool = False, text: bool = False):
    from datasets import Features, List, Value

    turns = List({"role": Value("string"), "content": Value("string")})
    if preference:  # TRL's explicit-prompt conversational preference layout
        return Features({name: turns for name in PREFERENCE_COLUMNS})
    if text:  # a mixture holding plain text: both columns on every row
        return Features({MESSAGES: turns, TEXT: Value("string")})
    return Features({MESSAGES: turns})


def has_text(data: DataConfig) -> bool:
    """Whether a source of ``data`` is plain text (its mixture carries the ``text`` column)."""
    return any(sourcefiles.is_text(s.path, s.format) for s in data.datasets)


def _is_usable(example: dict[str, Any]) -> bool:
    return formats.is_usable(example[MESSAGES])


def detect_format(source: DatasetSource, columns: list[str], first: dict[str, Any], where: str) -> tuple[str, str]:
    """(format, column) of a source (columns already renamed), or a JobSetupError naming the columns found."""
    try:
        return formats.detect_format(source, columns, first, where)
    except ConfigError as exc:
        raise JobSetupError(str(exc)) from None


def _load_files(source: DatasetSource, files: list[Path], where: str):
    """A local source's files (one, a glob's, or the part of them a prepare array task reads), each checked first
    when they are plain text."""
    from datasets import load_dataset

    problems = sourcefiles.source_problems(source.path, source.format, where, files)
    if len(problems) == 1:
        raise JobSetupError(problems[0])
    if problems:
        raise JobSetupError(f"{where}: {len(problems)} files cannot be read as text", problems=problems)
    builder = DATA_BUILDERS.get(sourcefiles.suffix_of(files[0]))
    if builder is None:
        raise JobSetupError(f"{where}: {source.path!r} is not a .json, .jsonl, .jsonl.zst, .csv, .parquet, .txt or "
                            ".txt.gz file")
    if sourcefiles.suffix_of(files[0]) == ".jsonl.zst":  # datasets decompresses them through zstandard
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise JobSetupError(f"{where}: .jsonl.zst files need the zstandard package in the job's Python: pip "
                                "install 'slurmft[zstd]'") from None
    kwargs = {"sample_by": TEXT_SAMPLE_BY[source.documents]} if builder == "text" else {}
    return load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)


def _load_source(source: DatasetSource, where: str, files: list[Path] | None = None):
    """The source's rows as datasets reads them; ``files``: only these of its local files (a prepare array task's
    share, slurmft/job/prepare_array.py), in this order."""
    from datasets import load_dataset

    path = Path(source.path).expanduser()
    try:
        if files is not None:
            return _load_files(source, files, where)
        files = sourcefiles.files_of(source.path)
        if files:
            return _load_files(source, files, where)
        if sourcefiles.is_glob(source.path):
            raise JobSetupError(f"{where}: {source.path!r} matches no file")
        if looks_like_path(source.path) or sourcefiles.suffix_of(path) in DATA_BUILDERS:
            raise JobSetupError(f"{where}: file {source.path!r} does not exist")
        return load_dataset(source.path, source.name, split=source.split, revision=source.revision)
    except JobSetupError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise JobSetupError(f"{where}: cannot load {source.path!r} ({type(exc).__name__}: {first})") from None


def _convert(batch: dict[str, list[Any]], fmt: str, column: str, names: list[str],
             with_text: bool = False) -> dict[str, list[Any]]:
    rows = ({name: batch[name][i] for name in names} for i in range(len(batch[names[0]])))
    out: dict[str, list[Any]] = {MESSAGES: [formats.to_messages(row, fmt, column) for row in rows]}
    if with_text:
        out[TEXT] = [None] * len(out[MESSAGES])
    return out


def _convert_text(batch: dict[str, list[Any]], column: str) -> dict[str, list[Any]]:
    """Plain-text rows as documents: the column's string, without the line breaks around it."""
    texts = ["" if v is None else str(v).strip("\r\n") for v in batch[column]]
    return {MESSAGES: [[] for _ in texts], TEXT: texts}


def _has_words(example: dict[str, Any]) -> bool:
    return bool(example[TEXT] and example[TEXT].strip())


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


def _keep(ds, usable, num_proc: int | None, where: str, none_left: str, dropped: str, share: bool = False):
    """The rows ``usable`` accepts; none left is an error (``none_left``; not for ``share``, a part of the source's
    files, which may hold none), the dropped ones counted in a warning."""
    before = len(ds)
    ds = ds.filter(usable, num_proc=num_proc)
    if len(ds) == 0 and not share:
        raise JobSetupError(f"{where}: {none_left}")
    if len(ds) < before:
        log.warning("%s: dropped %d of %d %s", where, before - len(ds), before, dropped)
    return ds


def load_text_source(ds, column: str, where: str, num_proc: int | None, share: bool = False):
    """A plain-text source as ``text`` documents (``messages`` empty); blank documents dropped, none left refused
    (``share``: a part of its files, which may hold none). The columns are always ``_features(text=True)``, whatever
    types datasets inferred from the files read, so a part of the files gives the rows the whole gives them."""
    ds = ds.map(_convert_text, batched=True, fn_kwargs={"column": column}, remove_columns=ds.column_names,
                features=_features(text=True), num_proc=num_proc, desc=f"{where}: text -> documents")
    ds = _keep(ds, _has_words, num_proc, where, "no text: every document is empty or blank", "blank documents", share)
    log.info("%s: %d documents (plain text: every token in the loss)", where, len(ds))
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


def load_source(source: DatasetSource, index: int, num_proc: int | None, method: str = "sft",
                with_text: bool = False, files: list[Path] | None = None):
    """One source as a ``messages``-only dataset, unusable rows dropped; for ``method`` dpo: as
    ``prompt``/``chosen``/``rejected`` conversations, refused when it is not preference data; grpo: prompts as they
    are (with the columns the rewards read), refused when they hold completions; ``with_text`` (a mixture holding
    plain text): ``messages`` and ``text`` on every row, a plain-text source as documents. ``files``: a plain-text
    source read from these of its files only (a prepare array task's share: it may hold no document)."""
    where = f"data.datasets[{index}] ({source.path})"
    share = files is not None
    if share and not sourcefiles.is_text(source.path, source.format):
        raise JobSetupError(f"{where}: only a plain-text source is read by shares of its files")
    ds = _load_source(source, where, files)
    if len(ds) == 0 and not share:
        raise JobSetupError(f"{where}: the dataset is empty")
    if source.columns:
        ds = ds.rename_columns({theirs: ours for ours, theirs in source.columns.items() if theirs in ds.column_names})
    fmt, column = detect_format(source, list(ds.column_names), ds[0] if len(ds) else {}, where)
    problem = formats.method_problem(fmt, method, list(ds.column_names), where)
    if problem:
        raise JobSetupError(problem)
    if method == "dpo":
        return load_preference_source(ds, fmt, where, num_proc)
    if method == "grpo":
        return load_prompt_source(ds, where)
    if fmt == formats.TEXT:
        return load_text_source(ds, column, where, num_proc, share)
    ds = ds.map(
        _convert,
        batched=True,
        fn_kwargs={"fmt": fmt, "column": column, "names": list(ds.column_names), "with_text": with_text},
        remove_columns=ds.column_names,
        features=_features(text=with_text),
        num_proc=num_proc,
        desc=f"{Path(source.path).name}: {fmt} -> messages",
    )
    ds = _keep(ds, _is_usable, num_proc, where,
               "no usable conversation (each needs a user turn followed by an assistant turn)",
               "rows without a usable conversation")
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


def load_mixture(data: DataConfig, seed: int, tokenizer: Any = None, method: str = "sft",
                 files: list[Path] | None = None):
    """All sources, mixed by weight into one ``messages`` dataset (checked against ``tokenizer``'s template);
    ``method`` dpo: one ``prompt``/``chosen``/``rejected`` dataset; grpo: one prompt dataset. ``files``: the one
    plain-text source's rows from these of its files only (a prepare array task's share of the files,
    slurmft/job/prepare_array.py: with one source there is no interleaving, and a document depends on its own file
    only, so the shares' rows in file order are the whole source's)."""
    from datasets import interleave_datasets

    with_text = has_text(data) and method == "sft"
    if files is not None and len(data.datasets) != 1:
        raise JobSetupError(f"data.datasets: a share of the files needs one source, not {len(data.datasets)}")
    parts = [load_source(src, i, data.num_proc, method, with_text, files) for i, src in enumerate(data.datasets)]
    if tokenizer is not None:
        for i, (src, part) in enumerate(zip(data.datasets, parts, strict=True)):
            if not sourcefiles.is_text(src.path, src.format):  # plain text meets no chat template
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
