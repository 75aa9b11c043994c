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
from collections.abc import Callable

from slurmft.config import RunConfig
from slurmft.config_model_checks import MODEL_JOB_TOOLS
from slurmft.eval_tasks import resolve_tasks
from slurmft.interpreter import NOT_EXECUTABLE, NoAnswer, finds_modules, in_words, locate, run_json
from slurmft.modelinfo import cache_dir
from slurmft.rundir import atomic_write

#: Seconds the probe may take (the registry alone is ~30 s).
PROBE_TIMEOUT_S = 300

# Runs in the eval Python: every task name lm-eval's registry knows (its built-in tasks).
_REGISTRY = r"""
import json, logging
logging.disable(logging.WARNING)
from lm_eval.tasks import TaskManager
print(json.dumps(sorted(TaskManager().all_tasks)))
"""


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
    try:
        names = run_json(python, _REGISTRY, timeout=PROBE_TIMEOUT_S, env=_offline_env())
    except NoAnswer as err:
        return str(err)
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
    python = cfg.model_job_python("eval", cfg.cluster.job_python)  # on the host (check_model_job: in an image)
    fix = f"set eval.python to the interpreter of a venv with lm-eval ({MODEL_JOB_TOOLS['eval'].install})"
    python, where = locate(python)
    if where is None:
        return field, python, None
    chmod = "chmod +x it or " if where == NOT_EXECUTABLE else ""
    return field, python, f"{field}: {in_words(python, where)}; {chmod}{fix}"


def check_eval(cfg: RunConfig, say: Callable[[str], None] | None = None, own: dict[str, str] | None = None) -> list[str]:
    """Every problem of ``cfg.eval`` (none without an eval section), each naming its field and the fix. Task files
    are read here; task names are looked up in lm-eval's registry (:func:`registry_names`, cached). ``own``: the
    tasks of the run's own task files (name -> file; `slurmft eval RUN_DIR --tasks NAME`): a misspelt one was offered
    lm-eval's registry's nearest names only ("tiny_choise": "did you mean multiple_choice?")."""
    if cfg.eval is None:
        return []
    tasks = resolve_tasks(cfg.eval.tasks)
    problems = list(tasks.problems)
    field, python, problem = _python_problem(cfg)
    if problem:
        return [*problems, problem]
    try:
        found = finds_modules(python, ("lm_eval", "vllm"), versions=("lm_eval",), timeout=PROBE_TIMEOUT_S,
                              env=_offline_env())
    except NoAnswer as err:
        return [*problems, f"{field}: {python} does not run as a Python ({err}); set eval.python to "
                f"an interpreter with lm-eval installed"]
    version = found.versions["lm_eval"]
    if not found.modules["lm_eval"]:
        return [*problems, f"{field}: {python} cannot import lm_eval; install it: {python} -m pip install lm-eval "
                "(or set eval.python to a venv that has it)"]
    if cfg.eval.backend == "vllm" and not found.modules["vllm"]:
        problems.append(f"eval.backend: vllm, but {python} cannot import vllm; {python} -m pip install vllm, or set "
                        "eval.backend: hf (or auto)")
    if not tasks.registry_names:
        return problems
    known = registry_names(python, str(version), say)
    if isinstance(known, str):
        return [*problems, f"{field}: {python} could not list lm-eval's tasks ({known})"]
    registered = set(known)
    for name in tasks.registry_names:
        if name in registered:
            continue
        mine = difflib.get_close_matches(name, list(own or {}), n=1)
        close = difflib.get_close_matches(name, known, n=3)
        hint = (f"did you mean {mine[0]}, this run's task ({(own or {})[mine[0]]})?" if mine
                else f"did you mean {' or '.join(close)}?" if close else "`lm-eval ls tasks` lists them")
        problems.append(f"eval.tasks[{tasks.entry_of.get(name, 0)}]: {name!r} is not a task lm-eval "
                        f"{version} knows; {hint} (or give your own task YAML file)")
    return problems
