"""Which values of run.yaml are local paths, and making the relative ones absolute.

A relative path is relative to where it was written: the run.yaml's folder for a value in the file, the
current directory for a ``key=value`` on the command line (:func:`absolutize`, called by
:func:`slurmft.config_loading.load_config`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: Local data file suffix -> the ``datasets`` builder the job reads it with.
DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
DATA_SUFFIXES = tuple(DATA_BUILDERS)


def _path_kind(loc: str) -> str:
    """How a path field is told apart from a name: always a path, a path when it looks like one, ..."""
    if loc in ("output_dir", "train.sft.chat_template_path"):
        return "path"
    if loc == "cluster.profile":
        return "profile"
    if loc == "cluster.python":
        return "program"
    if loc == "cluster.container.image":
        return "image"
    return "path-or-hub-id"  # model.name_or_path, model.tokenizer, data.datasets[i].path


def looks_like_path(value: str) -> bool:
    """A value written as a local path (not a hub id like org/name)."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..")


def _resolve_one(value: str, kind: str, base: Path) -> str:
    expanded = Path(os.path.expanduser(value))
    if expanded.is_absolute():
        return str(expanded)
    local = str((base / expanded).resolve())
    if kind == "path":
        return local
    if kind == "profile":
        return local if ("/" in value or value.endswith((".yaml", ".yml"))) else value
    if kind == "program":
        return local if "/" in value else value  # a bare name is looked up on the job's PATH
    if kind == "image":  # a file or directory here, or a registry reference (docker://..., nvcr.io#..., localhost/x:1)
        return local if looks_like_path(value) or (base / expanded).exists() else value
    if looks_like_path(value) or value.endswith(DATA_SUFFIXES) or (base / expanded).exists():
        return local
    return value  # a hub id


def _path_fields(data: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(dotted location, the mapping holding it, key) for every path-valued field present in raw data."""
    found: list[tuple[str, dict[str, Any], str]] = []

    def take(loc: str, holder: Any, key: str) -> None:
        if isinstance(holder, dict) and isinstance(holder.get(key), str) and holder[key]:
            found.append((loc, holder, key))

    take("output_dir", data, "output_dir")
    cluster, model, dat, train = (data.get(k) if isinstance(data.get(k), dict) else {} for k in
                                  ("cluster", "model", "data", "train"))
    take("cluster.profile", cluster, "profile")
    take("cluster.python", cluster, "python")
    if isinstance(cluster.get("container"), dict):
        take("cluster.container.image", cluster["container"], "image")
    take("model.name_or_path", model, "name_or_path")
    take("model.tokenizer", model, "tokenizer")
    if isinstance(train.get("sft"), dict):
        take("train.sft.chat_template_path", train["sft"], "chat_template_path")
    datasets = dat.get("datasets")
    for i, ds in enumerate(datasets if isinstance(datasets, list) else []):
        take(f"data.datasets[{i}].path", ds, "path")
    return found


def absolutize(data: dict[str, Any], base: Path, only: str | None = None) -> None:
    """Make the relative paths in raw config ``data`` absolute against ``base`` (only those under ``only``)."""
    for loc, holder, key in _path_fields(data):
        if only is None or loc == only or loc.startswith((only + ".", only + "[")):
            holder[key] = _resolve_one(holder[key], _path_kind(loc), base)

