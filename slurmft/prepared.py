"""The prepared data's record: what produced ``RUN_DIR/prepared/``, and whether it still fits the run.

The prepare job (:mod:`slurmft.job.prepare`) runs TRL's own dataset preparation once, on CPUs, and saves
the result; the train job and every requeue and resume read it instead of tokenizing again. Reading a
prepared set that no longer matches the run would train on other data than the config says, silently,
so the record names everything the result depends on and every reader compares it first:

* ``settings``: what the config says about preparation: each source (path, subset, split, weight,
  format, columns), ``data.max_seq_length``, ``packing``, ``assistant_only_loss``, ``train.seed`` and the
  ``train.sft`` keys TRL's preparation reads (:data:`PREPARE_SFT_KEYS`), and the tokenizer it names;
* ``inputs``: the files behind them: each local source's size and modification time, the SHA-256 of the
  local tokenizer's files and of a ``train.sft.chat_template_path`` template. A hub data set is matched by
  its id, subset, split and ``revision``; the prepare job also records the commit it read (``sha``, when the
  hub answers), and ``resume`` asks the hub again (:func:`hub_changes`): a new push is refused, not mixed in.
  A hub tokenizer is matched by its id and ``model.revision``.

Torch-free and datasets-free: ``validate``, ``resume`` and ``status`` on the login node read it, and so does
the job, with the same words. Not compared: ``num_proc`` (it changes how TRL groups rows into packs, not
whether the set fits the run) and the library versions, which are kept for the reader.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurmft.config_paths import local_dir
from slurmft.errors import RunDirError
from slurmft.modelinfo import tokenizer_name, tokenizer_revision
from slurmft.rundir import RunPaths, atomic_write
from slurmft.sourcefiles import files_of, is_glob, is_text

if TYPE_CHECKING:  # annotations only: `slurmft status` reads the record without importing the schema (pydantic)
    from slurmft.config import RunConfig

PREPARED_VERSION = 1
#: Seconds to wait for the hub's answer about a data set's newest commit.
HUB_TIMEOUT_S = 10.0
#: ``train.sft`` keys that TRL 1.16's preparation reads (``SFTTrainer.__init__`` and ``_prepare_dataset``);
#: the others change the training, not the data. tests/job/test_prepare.py checks this list against TRL's source.
PREPARE_SFT_KEYS = ("dataset_text_field", "truncation_mode", "packing_strategy", "shuffle_dataset",
                    "completion_only_loss", "eos_token", "chat_template_path")
#: Files of a tokenizer directory that change how text becomes tokens (hashed into the record).
TOKENIZER_GLOBS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt",
                   "*.model", "*.tiktoken", "chat_template*")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def settings(cfg: RunConfig) -> dict[str, Any]:
    """What the config says about preparation (compared as a whole, field by field)."""
    sources = [{"path": s.path, "name": s.name, "split": s.split, "weight": s.weight, "format": s.format,
                "text_field": s.text_field, "columns": dict(s.columns),
                **({"revision": s.revision} if s.revision else {}),
                # plain-text files: how they split into documents (other sources' records stay as before)
                **({"documents": s.documents} if is_text(s.path, s.format) else {})} for s in cfg.data.datasets]
    return {"sources": sources, "max_seq_length": cfg.data.max_seq_length, "packing": cfg.data.packing,
            "assistant_only_loss": cfg.data.assistant_only_loss, "seed": cfg.train.seed,
            "sft": {k: cfg.train.sft[k] for k in PREPARE_SFT_KEYS if k in cfg.train.sft},
            "tokenizer": tokenizer_name(cfg), "revision": tokenizer_revision(cfg),
            # a dpo run prepares preference pairs (TRL's DPO tokenization), not SFT's sequences; an SFT record has no
            # "method", as before DPO existed, so records written then still match
            # grpo: the prompts as they are (TRL tokenizes them at each generation)
            **({"method": cfg.method.value} if cfg.method.value != "sft" else {})}


def inputs(cfg: RunConfig) -> dict[str, Any]:
    """The files behind the settings, as they are now: sources' size and mtime, tokenizer files' hashes."""
    sources: list[dict[str, Any]] = []
    for s in cfg.data.datasets:
        path = Path(s.path).expanduser()
        if is_glob(s.path):  # a corpus of files: each one's size and time, in the order the job reads them
            sources.append({"glob": s.path, "files": [_file_entry(f) for f in files_of(s.path)]})
        elif path.is_file():
            sources.append(_file_entry(path))
        else:
            sources.append({"hub": s.path, "name": s.name, "split": s.split})
    out: dict[str, Any] = {"sources": sources}
    tok = local_dir(tokenizer_name(cfg))
    if tok is not None:
        files = sorted({p for g in TOKENIZER_GLOBS for p in tok.glob(g) if p.is_file()})
        out["tokenizer_files"] = {p.name: sha256_file(p) for p in files}
    else:
        out["tokenizer_hub"] = tokenizer_name(cfg)
    template = cfg.train.sft.get("chat_template_path")
    if template and Path(str(template)).expanduser().is_file():
        out["chat_template_sha256"] = sha256_file(Path(str(template)).expanduser())
    return out


def _file_entry(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"file": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _glob_change(i: int, was: list[dict[str, Any]], now: list[dict[str, Any]], pattern: str) -> str:
    """How the files a glob matches changed since preparation, in words."""
    old = {f["file"]: f for f in was}
    new = {f["file"]: f for f in now}
    added, gone = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    parts = [f"{len(x)} {what} (e.g. {x[0]})" for x, what in ((added, "new"), (gone, "removed"), (changed, "changed"))
             if x]
    return f"data.datasets[{i}] ({pattern}): the files it matches changed after preparation: {', '.join(parts)}"


def expected(cfg: RunConfig) -> dict[str, Any]:
    """The record's ``settings`` and ``inputs`` for ``cfg`` now."""
    return {"settings": settings(cfg), "inputs": inputs(cfg)}


def _what(key: str) -> str:
    return {"max_seq_length": "data.max_seq_length", "packing": "data.packing", "seed": "train.seed",
            "assistant_only_loss": "data.assistant_only_loss", "tokenizer": "the tokenizer (model.tokenizer)",
            "revision": "model.revision", "sft": "train.sft (the keys TRL's preparation reads)",
            "method": "the training method (a dpo: section)"}.get(key, key)


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each way the record ``saved`` differs from ``now`` (both as :func:`expected` makes them), in words."""
    out: list[str] = []
    was, cur = saved.get("settings", {}), now["settings"]
    for key in {**was, **cur}:
        if key == "sources":
            continue
        if was.get(key) != cur.get(key):  # a key only one side has (method: dpo) differs too
            out.append(f"{_what(key)}: {was.get(key)!r} when prepared, {cur.get(key)!r} now")
    old_src, new_src = was.get("sources", []), cur["sources"]
    if len(old_src) != len(new_src):
        out.append(f"data.datasets: {len(old_src)} source(s) when prepared, {len(new_src)} now")
    else:
        for i, (a, b) in enumerate(zip(old_src, new_src, strict=True)):
            changed = [k for k in b if a.get(k) != b[k]]
            if changed:
                out.append(f"data.datasets[{i}]: {', '.join(changed)} changed ({a.get('path')} when prepared)")
    was_in, cur_in = saved.get("inputs", {}), now["inputs"]
    old_files, new_files = was_in.get("sources", []), cur_in["sources"]
    if len(old_files) == len(new_files):
        for i, (a, b) in enumerate(zip(old_files, new_files, strict=True)):
            if {k: v for k, v in a.items() if k != "sha"} == b:  # the hub commit: hub_changes(), login side only
                continue
            if "glob" in b and a.get("glob") == b["glob"]:
                out.append(_glob_change(i, a.get("files", []), b["files"], b["glob"]))
            elif "file" in b and a.get("file") == b["file"]:
                out.append(f"data.datasets[{i}] ({b['file']}): the file changed after preparation (size "
                           f"{a.get('size')} -> {b['size']} bytes, modified {_when(a.get('mtime_ns'))} -> "
                           f"{_when(b['mtime_ns'])})")
            else:
                out.append(f"data.datasets[{i}]: the source is {b.get('file') or b.get('glob') or b.get('hub')!r} "
                           f"now, {a.get('file') or a.get('glob') or a.get('hub')!r} when prepared")
    old_tok, new_tok = was_in.get("tokenizer_files"), cur_in.get("tokenizer_files")
    if old_tok != new_tok:
        if old_tok is None or new_tok is None:
            out.append("the tokenizer: a hub tokenizer on one side, a local directory on the other")
        else:
            names = sorted(n for n in set(old_tok) | set(new_tok) if old_tok.get(n) != new_tok.get(n))
            out.append(f"tokenizer file(s) changed after preparation: {', '.join(names)}")
    if was_in.get("chat_template_sha256") != cur_in.get("chat_template_sha256"):
        out.append("train.sft.chat_template_path: the template file changed after preparation")
    return out


def hub_commit(repo_id: str, revision: str | None, timeout_s: float = HUB_TIMEOUT_S) -> str:
    """The commit a hub data set's ``revision`` (None: the default branch) points at now (network)."""
    from huggingface_hub import HfApi

    return str(HfApi().dataset_info(repo_id, revision=revision, timeout=timeout_s).sha)


Resolve = Callable[[str, str | None], str]


def pin_hub_commits(cfg: RunConfig, record_inputs: dict[str, Any], say: Callable[[str], None],
                    resolve: Resolve = hub_commit) -> list[str | None]:
    """For the prepare job: each hub source's commit now, written into ``record_inputs`` (``sha``) and returned
    (None for a local file, or where the hub cannot be asked: offline, unreachable), so that the job reads
    exactly the commit it records."""
    commits: list[str | None] = []
    for source, entry in zip(cfg.data.datasets, record_inputs["sources"], strict=True):
        commit = None
        if "hub" in entry:
            try:
                commit = resolve(source.path, source.revision)
            except Exception as exc:  # noqa: BLE001 - offline or unreachable: the data set's id is all we record
                say(f"data: cannot ask the hub which commit {source.path!r} is at ({type(exc).__name__}); a new "
                    "push will not be detected for this preparation")
            entry["sha"] = commit
        commits.append(commit)
    return commits


def hub_changes(record: dict[str, Any], resolve: Resolve = hub_commit) -> tuple[list[str], list[str]]:
    """(changes, unchecked): hub sources whose revision now points at another commit than the one prepared, in
    words; and those the hub could not be asked about. Login side only (``resume``): one call per hub source."""
    changes: list[str] = []
    unchecked: list[str] = []
    settings_sources = record.get("settings", {}).get("sources", [])
    for i, entry in enumerate(record.get("inputs", {}).get("sources", [])):
        if not entry.get("sha") or "hub" not in entry:
            continue
        revision = settings_sources[i].get("revision") if i < len(settings_sources) else None
        if revision and revision == entry["sha"]:
            continue  # pinned to that very commit: it cannot move
        try:
            now = resolve(entry["hub"], revision)
        except Exception as exc:  # noqa: BLE001
            unchecked.append(f"{entry['hub']} ({type(exc).__name__})")
            continue
        if now != entry["sha"]:
            changes.append(f"data.datasets[{i}] ({entry['hub']}): the hub has a new commit since preparation "
                           f"({entry['sha'][:12]} when prepared, {now[:12]} now)")
    return changes, unchecked


def _when(mtime_ns: object) -> str:
    import time

    if not isinstance(mtime_ns, int):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime_ns / 1e9))


#: a prepare array task's shard record, written last inside its shard: its presence means the shard is complete
SHARD_RECORD = "shard.json"
#: the record's ``layout`` when ``prepared/`` holds a prepare array's unpacked shards as its own files (no concatenated
#: copy): ``shard_files`` (datasets' saved sets, in task order) and ``order`` (None, or the file of the row order the
#: trainer reads: TRL's shuffle as indices); slurmft.job.prepare.read_prepared reads both layouts
SHARDS_LAYOUT = "shards"
#: the row order of a ``shards`` layout (an int64 .npy of indices into the shards' concatenation)
ORDER_FILE = "order.npy"
#: the record's ``layout`` when a prepare array's packed set is its shards and the packing plan over them (no packed
#: rows written): ``shard_files`` as for ``shards``, ``plan`` (the directory of the plan's arrays: each piece's row of
#: the shards' concatenation, start and stop, each packed row's first piece, and the packed rows' order when TRL
#: shuffles them) and ``packing_strategy``; the train job gathers each packed row when it reads it
PLAN_LAYOUT = "plan"
#: the directory of a ``plan`` layout's arrays (slurmft.job.packing.Plan.save)
PLAN_DIR = "plan"
#: the layouts this slurmft reads (none: ``prepared/`` is one saved data set)
LAYOUTS = (SHARDS_LAYOUT, PLAN_LAYOUT)
#: the record version of a ``plan`` layout: a slurmft older than the layout reads only version 1, so it finds no complete
#: preparation there (and prepares again) instead of opening the plan's directory as a saved data set
PLAN_RECORD_VERSION = 2


def shard_dir(parts: Path, task: int) -> Path:
    """Task ``task``'s shard in a prepare array's directory (:meth:`RunPaths.prepared_parts`)."""
    return parts / f"shard-{task:05d}"


def shard_records(parts: Path, tasks: int) -> list[dict[str, Any] | None]:
    """Each prepare array task's shard record (slurmft/job/prepare_array.py), None where that shard is not complete
    (yet): the packing task and ``status`` read them."""
    out: list[dict[str, Any] | None] = []
    for k in range(tasks):
        try:
            out.append(json.loads((shard_dir(parts, k) / SHARD_RECORD).read_text()))
        except (OSError, ValueError):
            out.append(None)
    return out


def array_progress(parts: Path, tasks: int) -> str:
    """A prepare array's total so far: ``2 of 4 tasks done: 25,000,000 tokens (1,200,000 tokens/s together)``."""
    done = [r for r in shard_records(parts, tasks) if r]
    tokens = sum(int(r.get("tokens", 0)) for r in done)
    rate = sum(int(r.get("tokens_per_s", 0)) for r in done)
    return f"{len(done)} of {tasks} tasks done: {tokens:,} tokens" + (f" ({rate:,} tokens/s together)" if done else "")


def read_record(paths: RunPaths) -> dict[str, Any] | None:
    """The record of ``prepared/``, or None when there is no complete preparation."""
    try:
        record = json.loads(paths.prepared_record.read_text())
    except (OSError, ValueError):
        return None
    readable = (PREPARED_VERSION, PLAN_RECORD_VERSION)
    return record if isinstance(record, dict) and record.get("version") in readable else None


def write_record(path: Path, record: dict[str, Any]) -> None:
    atomic_write(path, json.dumps({"version": PREPARED_VERSION, **record}, indent=2) + "\n")


def refusal(paths: RunPaths, problems: list[str]) -> RunDirError:
    """The prepared data does not fit the run: never reused, never rebuilt behind the user's back."""
    return RunDirError(
        f"the prepared data in {paths.prepared} does not match the run's config, so it is not used",
        [*problems, f"prepare it again: slurmft prepare {paths.root} (then `slurmft resume {paths.root}`)"])


def check(paths: RunPaths, cfg: RunConfig) -> dict[str, Any] | None:
    """The record when ``prepared/`` matches ``cfg``; None when there is no complete preparation; a
    :class:`RunDirError` naming each difference and the fix when it does not match."""
    record = read_record(paths)
    if record is None:
        return None
    if record.get("layout") not in (None, *LAYOUTS):
        raise RunDirError(f"{paths.prepared} was written by a newer slurmft (layout {record.get('layout')!r}; this one "
                          f"reads {', '.join(LAYOUTS)} and a saved data set)",
                          [f"use the slurmft that prepared it, or prepare it again: slurmft prepare {paths.root}"])
    problems = differences(record, expected(cfg))
    if problems:
        raise refusal(paths, problems)
    return record


def counted(cfg: RunConfig) -> dict[str, Any] | None:
    """What ``output_dir/prepared/`` holds when it matches ``cfg`` (the record's ``result``: ``sequences``, ``tokens``,
    ``loss_tokens``, ...): the exact counts the job trains on. None without a matching preparation (a stale one is
    reported by ``validate`` on its own line)."""
    try:
        record = check(RunPaths.of(cfg.output_dir), cfg)
    except RunDirError:
        return None
    result = (record or {}).get("result", {})
    count = result.get("sequences")
    return result if isinstance(count, int) and count > 0 else None


def sequences(cfg: RunConfig) -> int | None:
    """The packed sequences (rows when not packing) of a matching preparation (:func:`counted`), else None."""
    result = counted(cfg)
    return result["sequences"] if result else None


def row_words(settings: dict[str, Any]) -> str:
    """What the rows of a preparation with these ``settings`` (its record's) are, in words: the summary line and the
    prepare job's log both say them, so a plain-text corpus is never called conversations."""
    sources = [s for s in settings.get("sources") or [] if isinstance(s, dict)]
    text = sum("documents" in s for s in sources)  # a plain-text source's settings say how it splits into documents
    return ("preference pairs" if settings.get("method") == "dpo" else "prompts" if settings.get("method") == "grpo"
            else "documents" if text and text == len(sources) else "documents and conversations" if text
            else "conversations")


def summary_line(record: dict[str, Any]) -> str:
    """``1,000 conversations -> 120 sequences of <= 512 tokens, 51,234 tokens (83% of the packed slots), 12.3 s``
    (``documents`` for plain text, ``preference pairs`` for DPO: what the rows are)."""
    r = record.get("result", {})
    if not r:
        return "prepared (no counts recorded)"
    fill = r.get("fill")
    if record.get("settings", {}).get("method") == "grpo":  # prompts kept as they are (TRL tokenizes per generation)
        took = f", prepared in {r['seconds']:.1f} s" if isinstance(r.get("seconds"), int | float) else ""
        return f"{r.get('sequences', 0):,} prompts (not tokenized: GRPO renders them at every generation){took}"
    settings = record.get("settings", {})
    rows = row_words(settings)
    made = (f"(each a chosen and a rejected sequence of <= {settings.get('max_seq_length')} tokens)"
            if settings.get("method") == "dpo" else  # a pair is one row of the data set, scored as two sequences
            f"-> {r.get('sequences', 0):,} sequences of <= {settings.get('max_seq_length')} tokens")
    parts = [f"{r.get('conversations', 0):,} {rows} {made}", f"{r.get('tokens', 0):,} tokens"]
    if isinstance(r.get("loss_tokens"), int):
        parts.append(f"{r['loss_tokens']:,} in the loss")
    if isinstance(fill, int | float) and record.get("settings", {}).get("packing"):
        parts.append(f"packing fills {100 * fill:.0f}% of the slots")
    if isinstance(r.get("seconds"), int | float):
        parts.append(f"prepared in {r['seconds']:.1f} s")
    return ", ".join(parts)


def needed(paths: RunPaths, cfg: RunConfig) -> bool:
    """Whether this attempt needs a prepare job: ``prepare.enabled`` and no complete ``prepared/``. One that
    does not match ``cfg`` is refused (:func:`check`): the fix is ``slurmft prepare``."""
    return cfg.prepare.enabled and check(paths, cfg) is None


def needed_for_new_run(paths: RunPaths, cfg: RunConfig, say: Callable[[str], None]) -> bool:
    """:func:`needed` for a new run: a ``prepared/`` left by ``slurmft prepare run.yaml --here`` that does not
    match is prepared again by the prepare job (no training has read it), and said so; one that matches is reused,
    and said so too (else the submit's output would just lack its prepare job, without a word why)."""
    try:
        need = needed(paths, cfg)
    except RunDirError as exc:
        say(f"note: {exc.problems[0] if exc.problems else exc}; the prepare job prepares the data again")
        return True
    if not need and cfg.prepare.enabled and (record := check(paths, cfg)) is not None:  # said: no prepare job runs
        say(f"prepared data reused (no prepare job): {summary_line(record)}")
    return need
