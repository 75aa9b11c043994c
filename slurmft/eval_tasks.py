"""``eval.tasks`` read: which entries are lm-eval registry names and which are your own task YAML files.

Shared by the evaluation job (slurmft.job.evaluate, which passes the files' folder as lm-eval's
``--include_path`` and their ``task:`` names as ``--tasks``) and the login-side checks
(slurmft.plan.eval_checks, which report a file that is missing, does not parse or names no task).
Stdlib and PyYAML only: lm-eval runs in an interpreter of its own and is never imported here.

lm-eval's YAMLs use tags of their own (``!function utils.process_docs``); the reader here accepts any tag
and keeps its text, since only ``task:``/``group:`` matter. lm-eval indexes ``*.yaml`` files only (not
``.yml``), and its command line takes one ``--include_path``: both are problems here, named with the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slurmft.config_paths import absolutize, is_task_path


class _AnyTagLoader(yaml.SafeLoader):
    """A safe loader that reads an unknown tag (``!function utils.f``) as its plain value."""


def _any_tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:  # noqa: ANN401 - YAML's value
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_scalar(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_mapping(node)  # type: ignore[arg-type]


_AnyTagLoader.add_multi_constructor("!", _any_tag)


def read_task_yaml(path: Path) -> dict[str, Any]:
    """One lm-eval task YAML as a mapping; raises ``ValueError`` naming what is wrong."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_AnyTagLoader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as err:
        raise ValueError(f"does not parse as YAML ({' '.join(str(err).split())})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot be read ({err})") from None
    if not isinstance(data, dict):
        raise ValueError("is not a YAML mapping (an lm-eval task file is one)")
    return data


def task_name(data: dict[str, Any]) -> str | None:
    """The name lm-eval registers a task file under: ``task:`` (a string), or a group file's ``group:`` (whose
    ``task:`` is the list of its members)."""
    task = data.get("task")
    if isinstance(task, str) and task:
        return task
    group = data.get("group")
    if isinstance(task, list) and isinstance(group, str) and group:
        return group
    return None


def declared_metrics(path: str) -> list[str]:
    """The metric names a task file's ``metric_list`` declares (empty when it declares none: lm-eval's defaults for
    its output type, or a file that does not read)."""
    try:
        entries = read_task_yaml(Path(path)).get("metric_list")
    except ValueError:
        return []
    return [e["metric"] for e in entries or [] if isinstance(e, dict) and isinstance(e.get("metric"), str)] \
        if isinstance(entries, list) else []


@dataclass
class EvalTasks:
    """``eval.tasks`` resolved: the names for lm-eval's ``--tasks`` in the config's order, the one folder for
    ``--include_path`` (None when every task is a registry name), which names came from files, the problems."""

    names: list[str] = field(default_factory=list)
    include_path: str | None = None
    from_files: dict[str, str] = field(default_factory=dict)  # name -> the file it came from
    entry_of: dict[str, int] = field(default_factory=dict)  # name -> its index in eval.tasks
    problems: list[str] = field(default_factory=list)

    @property
    def registry_names(self) -> list[str]:
        """The names lm-eval's own registry must know."""
        return [n for n in self.names if n not in self.from_files]


def _names_in_file(path: Path, tasks: EvalTasks, label: str) -> list[str]:
    if path.suffix != ".yaml":
        tasks.problems.append(f"{label}: {path} ends in {path.suffix or 'no suffix'}, but lm-eval only reads *.yaml "
                              "task files; rename it to end in .yaml")
        return []
    try:
        data = read_task_yaml(path)
    except ValueError as err:
        tasks.problems.append(f"{label}: {path} {err}; fix the file (an lm-eval task YAML)")
        return []
    name = task_name(data)
    if name is None:
        tasks.problems.append(f"{label}: {path} has no task: key (the task's name lm-eval registers); add "
                              "'task: <name>'")
        return []
    return [name]


def tasks_override(tasks: str | list[str]) -> str:
    """``--tasks a,b`` (comma-separated), or the task list a queued job of an earlier release carries, as the override
    it stands for: ``eval.tasks=["a", "b"]``."""
    names = tasks.split(",") if isinstance(tasks, str) else tasks
    return f"eval.tasks={json.dumps([t.strip() for t in names if t.strip()])}"


def own_task_files(override: str, own: dict[str, str]) -> str:
    """An ``eval.tasks=[...]`` override (resolved: JSON) with each name of one of the run's own task files (``own``:
    name -> file, :attr:`EvalTasks.from_files` of config.yaml's eval.tasks) read as that file. `slurmft eval RUN_DIR
    --tasks tiny_choice`, the name status shows the scores under, was refused as "not a task lm-eval knows; did you
    mean multiple_choice?": lm-eval only finds a file's task with the file's folder as its include path."""
    key, _, value = override.partition("=")
    if key != "eval.tasks" or not own:
        return override
    tasks = json.loads(value)
    if not isinstance(tasks, list):
        return override
    named = [own.get(t, t) if isinstance(t, str) and not is_task_path(t) else t for t in tasks]
    return override if named == tasks else f"eval.tasks={json.dumps(named)}"


def queued_task_list(args: list[str] | None) -> list[str] | None:
    """The evaluation job's argument as overrides: an eval job ``slurmft eval RUN_DIR --tasks a,b`` queued before
    7ee2498 (its pickle, run by the release installed when it starts) carries the task names themselves, where a job
    queued since carries overrides. Every override has an '=' (KEY=VALUE) and no task name or file does, so a list
    without one is read as the override ``--tasks`` stands for now, a relative task file made absolute against the
    job's working directory (where that release read it; the command line now does so before submitting)."""
    if args and not any("=" in a for a in args):
        given = {"eval": {"tasks": list(args)}}
        absolutize(given, Path.cwd(), "eval")
        return [tasks_override(given["eval"]["tasks"])]
    return args


def resolve_tasks(entries: list[str], field_name: str = "eval.tasks") -> EvalTasks:
    """Read every file or folder entry of ``eval.tasks`` (absolute paths: the config loader made them so);
    registry names pass through. A folder contributes the tasks of its ``*.yaml`` files, as lm-eval reads one."""
    tasks = EvalTasks()
    folders: list[Path] = []
    for i, entry in enumerate(entries):
        label = f"{field_name}[{i}]"
        if not is_task_path(entry):
            if entry not in tasks.names:
                tasks.names.append(entry)
            tasks.entry_of.setdefault(entry, i)
            continue
        path = Path(entry).expanduser()
        if path.is_dir():
            folder, files = path, sorted(path.glob("*.yaml"))
            if not files:
                tasks.problems.append(f"{label}: the folder {path} holds no *.yaml task file; add one or name the "
                                      "task files themselves")
        elif path.is_file():
            folder, files = path.parent, [path]
        else:
            tasks.problems.append(f"{label}: {path} does not exist; give an existing task YAML (or folder of them), "
                                  "or an lm-eval task name")
            continue
        folders.append(folder.resolve())
        for file in files:
            for name in _names_in_file(file, tasks, label):
                if name not in tasks.names:
                    tasks.names.append(name)
                tasks.from_files.setdefault(name, str(file))
                tasks.entry_of.setdefault(name, i)
    distinct = list(dict.fromkeys(folders))
    if len(distinct) > 1:
        tasks.problems.append(
            f"{field_name}: task files in {len(distinct)} folders ({', '.join(map(str, distinct))}), but lm-eval's "
            "--include_path takes one; put the task files (and the files they use) into one folder")
    if distinct:
        tasks.include_path = str(distinct[0])
    return tasks
