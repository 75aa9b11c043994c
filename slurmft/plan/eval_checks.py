"""The ``eval:`` section checked on the login node, before the evaluation job waits in the queue for nothing.

lm-eval lives in an interpreter of its own (``eval.python``, default the job's), so nothing here imports it
(nor torch): a child process of that interpreter says whether it finds lm_eval (and vllm, for ``eval.backend:
vllm``) without importing them (~0.1 s), and task names are looked up in lm-eval's registry with a did-you-mean.
Listing that registry reads lm-eval's ~14,000 task YAMLs (30-37 s on a busy 2-core machine, lm-eval 0.4.13): it
is done once per interpreter and lm-eval version and cached (:func:`registry_names`), and only when a task is a
registry name.

Your own task files are read here without lm-eval (slurmft.eval_tasks): missing, not YAML, no ``task:``,
``.yml``, or spread over folders. Each problem names its field (``eval.tasks[1]``, ``eval.python``) and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_paths import is_program_path
from slurmft.eval_tasks import resolve_tasks
from slurmft.modelinfo import cache_dir
from slurmft.rundir import atomic_write

#: Seconds the probe may take (the registry alone is ~30 s).
PROBE_TIMEOUT_S = 300

# Runs in the eval Python, importing nothing: which of lm_eval and vllm it finds, and lm-eval's installed version.
_FINDS = r"""
import importlib.metadata as md, importlib.util as u, json
out = {m: u.find_spec(m) is not None for m in ("lm_eval", "vllm")}
try:
    out["lm_eval_version"] = md.version("lm_eval")
except md.PackageNotFoundError:
    out["lm_eval_version"] = None
print(json.dumps(out))
"""

# Runs in the eval Python: every task name lm-eval's registry knows (its built-in tasks).
_REGISTRY = r"""
import json, logging
logging.disable(logging.WARNING)
from lm_eval.tasks import TaskManager
print(json.dumps(sorted(TaskManager().all_tasks)))
"""


def _run(python: str, code: str) -> Any:
    """The JSON a child process of ``python`` prints last, or ``{"error": ...}``."""
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              check=False, cwd="/", env=_offline_env())
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": (proc.stderr.strip().splitlines()
                                                                                       or ["no output"])[-1]}
    except ValueError:
        return {"error": f"exit {proc.returncode}: unreadable output"}


def registry_names(python: str, version: str, say: Callable[[str], None] | None = None) -> list[str] | str:
    """lm-eval's registered task names, listed once per interpreter and lm-eval version (reading its ~14,000 task
    files takes 30-37 s) and cached; a message when they cannot be listed."""
    key = hashlib.sha256(f"{os.path.realpath(python)} {version}".encode()).hexdigest()[:16]
    cache = cache_dir() / f"lm-eval-tasks-{version}-{key}.json"
    try:
        return list(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    if say is not None:
        say(f"listing lm-eval {version}'s task registry once (about half a minute; cached in {cache.parent})")
    names = _run(python, _REGISTRY)
    if not isinstance(names, list):
        return str(names.get("error") if isinstance(names, dict) else names)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cache, json.dumps(names))
    except OSError:
        pass  # no cache: the next validate lists them again
    return names


def _offline_env() -> dict[str, str]:
    # the registry is local files: nothing to download, and a login node may have no network
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _python_problem(cfg: RunConfig) -> tuple[str, str, str | None]:
    """``(field, python, problem or None)``: the eval Python exists and is executable."""
    assert cfg.eval is not None
    field = "eval.python" if cfg.eval.python else "eval.python (not set: cluster.python's)"
    python = cfg.model_job_python("eval")
    fix = ("set eval.python to the interpreter of a venv with lm-eval (python -m venv /shared/venvs/eval && "
           "/shared/venvs/eval/bin/pip install lm-eval)")
    if not is_program_path(python):
        found = shutil.which(python)
        if found is None:
            return field, python, f"{field}: {python!r} is not on PATH here; {fix}"
        python = found
    path = Path(python)
    if not path.is_file():
        return field, python, f"{field}: {python} does not exist on this machine; {fix}"
    if not path.stat().st_mode & 0o111:
        return field, python, f"{field}: {python} is not executable; chmod +x it or {fix}"
    return field, python, None


def check_eval(cfg: RunConfig, say: Callable[[str], None] | None = None) -> list[str]:
    """Every problem of ``cfg.eval`` (none without an eval section), each naming its field and the fix. Task files
    are read here; task names are looked up in lm-eval's registry (:func:`registry_names`, cached)."""
    if cfg.eval is None:
        return []
    tasks = resolve_tasks(cfg.eval.tasks)
    problems = list(tasks.problems)
    field, python, problem = _python_problem(cfg)
    if problem:
        return [*problems, problem]
    found = _run(python, _FINDS)
    if "error" in found:
        return [*problems, f"{field}: {python} does not run as a Python ({found['error']}); set eval.python to "
                f"an interpreter with lm-eval installed"]
    if not found["lm_eval"]:
        return [*problems, f"{field}: {python} cannot import lm_eval; install it: {python} -m pip install lm-eval "
                "(or set eval.python to a venv that has it)"]
    if cfg.eval.backend == "vllm" and not found["vllm"]:
        problems.append(f"eval.backend: vllm, but {python} cannot import vllm; {python} -m pip install vllm, or set "
                        "eval.backend: hf (or auto)")
    if not tasks.registry_names:
        return problems
    known = registry_names(python, str(found["lm_eval_version"]), say)
    if isinstance(known, str):
        return [*problems, f"{field}: {python} could not list lm-eval's tasks ({known})"]
    registered = set(known)
    for name in tasks.registry_names:
        if name in registered:
            continue
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else "`lm-eval ls tasks` lists them"
        problems.append(f"eval.tasks[{tasks.entry_of.get(name, 0)}]: {name!r} is not a task lm-eval "
                        f"{found['lm_eval_version']} knows; {hint} (or give your own task YAML file)")
    return problems
