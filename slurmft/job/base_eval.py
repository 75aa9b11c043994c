"""The base model's scores of a sweep, computed once and reused by every point whose base evaluation is identical.

With ``eval.compare_base`` each point's evaluation job scores the base model too: in a sweep that varies no
``model.*`` and no ``eval.*`` that is the same lm-eval run N times (on a real cluster N GPU jobs of a 7B+ base).
The first point to score it keeps the result in ``SWEEP_DIR/base-eval/<key>/record.json``; a later point whose key
is the same reads the scores from there instead of running lm-eval.

The key is a digest of what determines the base's score, taken from what the job really hands lm-eval (not from a
list of settings that could drift from it): the base's command line (``lm_eval_command``'s: interpreter, backend,
model arguments (model, revision, tokenizer, dtype, ...), tasks, few-shot, limit, batch size, device) with its
output path left out; the folder it runs in and the content of every file there (the task files and the data they
name); the environment it runs with; lm-eval's version in that interpreter; the runner script's content; and, for
the base model and tokenizer, what changes when their files do (a local directory: each file's size and mtime;
a Hub id: the commit the cache's ref points to). lm-eval's own seeds are its defaults, the same for one version.

The record is written whole to a temporary file, then hard-linked to its name (a reader sees a whole record or
none, and a link never replaces a file). Two points of an array may both find no record and both score the base:
the first link stays, the second point's is dropped, and both points' summaries hold the base's scores. A run alone (no sweep.json beside it)
never reads or writes one: it scores its base as it always did.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from slurmft.interpreter import NoAnswer, finds_modules
from slurmft.modelinfo import hub_cache_dir
from slurmft.prepared import sha256_file
from slurmft.rundir import atomic_write, sweep_root

#: The sweep directory's folder of base scores, one subfolder per key.
BASE_EVAL_DIR = "base-eval"
#: The record in a key's folder.
RECORD = "record.json"
#: Seconds ``<eval python>`` may take to say lm-eval's version.
VERSION_PROBE_S = 120
#: Folders of a task folder left out of its fingerprint (caches, not task content).
_SKIPPED_DIRS = {"__pycache__", ".git"}


def lm_eval_version(python: str) -> str | None:
    """lm-eval's installed version in ``python`` (its package metadata: lm_eval itself is not imported), or None."""
    try:
        return finds_modules(python, (), ("lm_eval",), timeout=VERSION_PROBE_S).versions.get("lm_eval")
    except NoAnswer:
        return None


def _files(folder: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        out += [Path(dirpath) / name for name in sorted(filenames)]
    return out


def folder_content(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder``: a task file's or its data's edit changes it."""
    return {str(p.relative_to(folder)): sha256_file(p) for p in _files(folder) if p.is_file()}


def model_state(name: str | None, revision: str | None) -> Any:  # noqa: ANN401 - JSON
    """What changes when the model (or tokenizer) ``name`` changes: a local directory's files' sizes and mtimes (not
    their content: a 7B model's hash would take minutes), a local file's; a Hub id's commit in the cache (refs/
    REVISION, default main), or None where the cache has none (the id and revision are in the command already)."""
    if not name:
        return None
    path = Path(name)
    if path.is_dir():
        return {str(p.relative_to(path)): [p.stat().st_size, p.stat().st_mtime_ns] for p in _files(path)
                if p.is_file()}
    if path.is_file():
        return [path.stat().st_size, path.stat().st_mtime_ns]
    ref = hub_cache_dir() / f"models--{name.replace('/', '--')}" / "refs" / (revision or "main")
    try:
        return {"hub_commit": ref.read_text().strip()}
    except OSError:
        return None


def base_inputs(cmd: list[str], out: Path, include_path: str | None, env: dict[str, str], python: str,
                base_args: dict[str, Any], runner: Path) -> dict[str, Any]:
    """Everything the base's lm-eval run depends on (the module's docstring says why each), as JSON."""
    command = ["<output_path>" if arg == str(out) else arg for arg in cmd]
    return {
        "command": command,
        "cwd": include_path,  # a registry-only evaluation runs in RUN_DIR/eval, which no task reads
        "task_files": folder_content(Path(include_path)) if include_path else {},
        "env": env,
        "lm_eval_version": lm_eval_version(python),
        "runner": sha256_file(runner),
        "model": model_state(base_args.get("pretrained"), base_args.get("revision")),
        "tokenizer": model_state(base_args.get("tokenizer"), base_args.get("revision")),
    }


def base_key(inputs: dict[str, Any]) -> str:
    """The digest of :func:`base_inputs` (16 hex digits: a folder name)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def records_dir(run_dir: Path) -> Path | None:
    """``SWEEP_DIR/base-eval`` of a sweep point, or None for a run alone (no reuse)."""
    root = sweep_root(run_dir)
    if root is None or root == Path(run_dir).resolve():
        return None
    return root / BASE_EVAL_DIR


def read_record(path: Path, key: str) -> dict[str, Any] | None:
    """The record at ``path`` when it is a whole one of ``key`` with lm-eval's results, else None (score again)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("key") == key and isinstance(record.get("results"), dict)
    return record if ok else None


def keep_record(path: Path, key: str, inputs: dict[str, Any], point: str, seconds: float,
                results: dict[str, Any]) -> bool:
    """Write the record of a base scored by ``point`` (lm-eval's results JSON in it), unless one is there already
    (another point scored it at the same time: the first is kept). Returns whether this one was written."""
    if read_record(path, key) is not None:
        return False
    record = {"key": key, "point": point, "scored_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": seconds,
              "inputs": inputs, "results": results}
    whole = path.with_name(f".{RECORD}.{os.getpid()}.new")
    atomic_write(whole, json.dumps(record, indent=2) + "\n")
    try:
        os.link(whole, path)  # never replaces: of two points writing at once, the first's record stays
    except FileExistsError:
        return False
    finally:
        whole.unlink(missing_ok=True)
    return True
