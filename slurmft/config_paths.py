"""Which values of run.yaml are local paths, and making them absolute: the one home of "does this look like a path".

A path field holds a local path or a name that something else resolves: a hub id (``org/name``), a
registry reference (``nvcr.io#nvidia/pytorch:24.05-py3``), a shipped cluster profile's name, a program on
the job's PATH. Each way of telling them apart is written once, here, and the config's reader, ``validate``,
the render and the job ask the same function:

- :func:`looks_like_path`: written as a local path (``/``, ``./``, ``../``, ``~``, ``.`` or ``..``). A hub id
  or a registry reference never starts that way, so this alone decides when the value does not exist.
- :func:`is_local`: meant as a local path: written as one, or naming something that exists here.
- :func:`is_profile_file`: ``cluster.profile`` names a file (a slash or a .yaml/.yml suffix), not a shipped profile.
- :func:`is_task_path`: an ``eval.tasks`` entry names a task file or folder (the same rule, or it exists here), not a
  task in lm-eval's registry.
- :func:`is_program_path`: ``cluster.python`` is a path when it has a slash; a bare name is looked up on PATH,
  as the shell does, so ``python3`` stays a name even when a file of that name lies here.
- :func:`local_dir`: an existing local directory (``~`` expanded), whatever the value looks like.

Not here, because it means something else: an *absolute* path (``startswith("/")``), which the mounts, HF_HOME
and the image's working directory need (a relative path means nothing on another node or in an image).

A relative path is relative to where it was written: the run.yaml's folder for a value in the file, the
current directory for a ``key=value`` on the command line (:func:`absolutize`, called by
:func:`slurmft.config_loading.load_config`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: Local data file suffix (slurmft.sourcefiles.suffix_of) -> the ``datasets`` builder the job reads it with.
DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".jsonl.zst": "json", ".csv": "csv", ".parquet": "parquet",
                 ".txt": "text", ".txt.gz": "text"}
DATA_SUFFIXES = tuple(DATA_BUILDERS)


def looks_like_path(value: str) -> bool:
    """A value written as a local path (not a hub id like org/name)."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..")


def is_local(value: str, base: Path | None = None) -> bool:
    """A value meant as a local path: it looks like one, or it exists here (relative to ``base``; default: the
    current directory)."""
    return looks_like_path(value) or ((base or Path()) / value).exists()


def is_profile_file(value: str) -> bool:
    """``cluster.profile`` names a profile file (it has a slash or ends in .yaml/.yml), not a shipped profile's name
    (configs/clusters/NAME.yaml)."""
    return "/" in value or value.endswith((".yaml", ".yml"))


def is_task_path(task: str) -> bool:
    """An ``eval.tasks`` entry given as a file or directory (a slash or a .yaml/.yml suffix, as
    :func:`is_profile_file`, or it exists here), not a name in lm-eval's registry."""
    return is_profile_file(task) or Path(task).expanduser().exists()


def is_program_path(value: str) -> bool:
    """``cluster.python`` names a file (it has a slash); a bare name is looked up on the job's PATH."""
    return "/" in value


def local_dir(value: str) -> Path | None:
    """The existing local directory ``value`` names (``~`` expanded), else None (a hub id, a file, nothing)."""
    path = Path(value).expanduser()
    return path if path.is_dir() else None


def _path_kind(loc: str) -> str:
    """How a path field is told apart from a name: always a path, a path when it looks like one, ..."""
    if loc in ("output_dir", "train.sft.chat_template_path"):
        return "path"
    if loc == "cluster.profile":
        return "profile"
    if loc in ("cluster.python", "serve.python", "eval.python"):
        return "program"
    if loc.startswith("eval.tasks["):
        return "task"
    if loc in ("cluster.container.image", "serve.container.image", "eval.container.image"):
        return "image"
    if loc.startswith("grpo.rewards["):
        return "reward"
    return "path-or-hub-id"  # model.name_or_path, model.tokenizer, data.datasets[i].path


def _resolve_one(value: str, kind: str, base: Path) -> str:
    if kind == "reward":  # file.py:function: the file part is a path; module:function is a name
        file, sep, function = value.rpartition(":")
        return _resolve_one(file, "path", base) + sep + function if file.endswith(".py") else value
    expanded = Path(os.path.expanduser(value))
    if expanded.is_absolute():
        return str(expanded)
    local = str((base / expanded).resolve())
    if kind == "path":
        return local
    if kind == "profile":
        return local if is_profile_file(value) else value
    if kind == "program":
        return local if is_program_path(value) else value
    if kind == "task":  # a task file or directory here, or a name in lm-eval's registry
        return local if is_local(value, base) or value.endswith((".yaml", ".yml")) else value
    if kind == "image":  # a file or directory here, or a registry reference (docker://..., nvcr.io#..., localhost/x:1)
        return local if is_local(value, base) else value
    if is_local(value, base) or value.endswith(DATA_SUFFIXES):  # a data file that is not there yet is still a file
        return local
    return value  # a hub id


def _path_fields(data: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted location, the mapping or list holding it, key or index) for every path-valued field present in raw
    data."""
    found: list[tuple[str, Any, Any]] = []

    def take(loc: str, holder: Any, key: str) -> None:
        if isinstance(holder, dict) and isinstance(holder.get(key), str) and holder[key]:
            found.append((loc, holder, key))

    take("output_dir", data, "output_dir")
    cluster, model, dat, train, serve, evaluation, grpo = (
        data.get(k) if isinstance(data.get(k), dict) else {} for k in
        ("cluster", "model", "data", "train", "serve", "eval", "grpo"))
    take("cluster.profile", cluster, "profile")
    take("cluster.python", cluster, "python")
    if isinstance(cluster.get("container"), dict):
        take("cluster.container.image", cluster["container"], "image")
    take("model.name_or_path", model, "name_or_path")
    take("model.tokenizer", model, "tokenizer")
    if isinstance(train.get("sft"), dict):
        take("train.sft.chat_template_path", train["sft"], "chat_template_path")
    take("serve.python", serve, "python")
    take("eval.python", evaluation, "python")
    for name, section in (("serve", serve), ("eval", evaluation)):
        if isinstance(section.get("container"), dict):
            take(f"{name}.container.image", section["container"], "image")
    tasks = evaluation.get("tasks")
    for i, task in enumerate(tasks if isinstance(tasks, list) else []):
        if isinstance(task, str) and task:
            found.append((f"eval.tasks[{i}]", tasks, i))
    datasets = dat.get("datasets")
    for i, ds in enumerate(datasets if isinstance(datasets, list) else []):
        take(f"data.datasets[{i}].path", ds, "path")
    rewards = grpo.get("rewards")
    for i, reward in enumerate(rewards if isinstance(rewards, list) else []):
        take(f"grpo.rewards[{i}].function", reward, "function")
    return found


def absolutize(data: dict[str, Any], base: Path, only: str | None = None) -> None:
    """Make the relative paths in raw config ``data`` absolute against ``base`` (only those under ``only``)."""
    for loc, holder, key in _path_fields(data):
        if only is None or loc == only or loc.startswith((only + ".", only + "[")):
            holder[key] = _resolve_one(holder[key], _path_kind(loc), base)
