"""The ``eval:`` section checked on the login node, before the evaluation job waits in the queue for nothing.

lm-eval lives in an interpreter of its own (``eval.python``, default the job's), so nothing here imports it
(nor torch): one child process of that interpreter answers everything at once (:func:`probe_eval_python`):
whether it imports lm_eval (and vllm, for ``eval.backend: vllm``), and which task names lm-eval's registry
does not know, with a did-you-mean. Building that registry reads lm-eval's ~14,000 task YAMLs: 30-37 s on a
busy 2-core machine (lm-eval 0.4.13), paid only when a task is a registry name; your own task files alone
take about 5 s (importing lm_eval's task code).

Your own task files are read here without lm-eval (slurmft.eval_tasks): missing, not YAML, no ``task:``,
``.yml``, or spread over folders. Each problem names its field (``eval.tasks[1]``, ``eval.python``) and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_paths import is_program_path
from slurmft.eval_tasks import EvalTasks, resolve_tasks

#: Seconds the probe may take (the registry alone is ~30 s; importing vllm can take a minute).
PROBE_TIMEOUT_S = 300

# Runs in the eval Python: argv = names (JSON), include path or "", "1" to import vllm, "1" for the full registry.
_PROBE = r"""
import difflib, json, sys, time
t0 = time.monotonic()
names, include, want_vllm, defaults = json.loads(sys.argv[1]), sys.argv[2] or None, sys.argv[3] == "1", sys.argv[4] == "1"
out = {}
try:
    import lm_eval
    out["lm_eval"] = getattr(lm_eval, "__version__", "?")
except Exception as err:
    out["lm_eval_error"] = f"{type(err).__name__}: {err}"
    print(json.dumps(out)); sys.exit(0)
if want_vllm:
    try:
        import vllm
        out["vllm"] = getattr(vllm, "__version__", "?")
    except Exception as err:
        out["vllm_error"] = f"{type(err).__name__}: {err}"
import logging
logging.disable(logging.WARNING)
from lm_eval.tasks import TaskManager
tm = TaskManager(include_path=include, include_defaults=defaults)
known = tm.all_tasks
out["unknown"] = {n: difflib.get_close_matches(n, known, n=3) for n in names if not tm.match_tasks([n])}
out["seconds"] = round(time.monotonic() - t0, 1)
print(json.dumps(out))
"""


def probe_eval_python(python: str, tasks: EvalTasks, vllm: bool) -> dict[str, Any]:
    """Ask ``python`` (one child process): its lm_eval version (or ``lm_eval_error``), vllm's (``vllm_error``) when
    ``vllm``, ``unknown`` {name: close matches} for the names lm-eval's registry lacks, ``seconds`` it took.
    ``{"error": ...}`` when it does not run or answer."""
    defaults = bool(tasks.registry_names)
    cmd = [python, "-c", _PROBE, json.dumps(tasks.names), tasks.include_path or "", "1" if vllm else "0",
           "1" if defaults else "0"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False, cwd="/",
                              env=_offline_env())
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    lines = proc.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    answer["wall_seconds"] = round(time.monotonic() - start, 1)
    return answer


def _offline_env() -> dict[str, str]:
    # the registry is local files: nothing to download, and a login node may have no network
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _python_problem(cfg: RunConfig) -> tuple[str, str, str | None]:
    """``(field, python, problem or None)``: the eval Python exists and is executable."""
    assert cfg.eval is not None
    field = "eval.python" if cfg.eval.python else "eval.python (not set: cluster.python's)"
    python = cfg.eval.python or cfg.cluster.job_python
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


def check_eval(cfg: RunConfig) -> list[str]:
    """Every problem of ``cfg.eval`` (none without an eval section), each naming its field and the fix."""
    if cfg.eval is None:
        return []
    tasks = resolve_tasks(cfg.eval.tasks)
    problems = list(tasks.problems)
    field, python, problem = _python_problem(cfg)
    if problem:
        return [*problems, problem]
    answer = probe_eval_python(python, tasks, vllm=cfg.eval.backend == "vllm")
    if "error" in answer:
        return [*problems, f"{field}: {python} does not run as a Python ({answer['error']}); set eval.python to "
                f"an interpreter with lm-eval installed"]
    if "lm_eval_error" in answer:
        return [*problems, f"{field}: {python} cannot import lm_eval ({answer['lm_eval_error']}); install it: "
                f"{python} -m pip install lm-eval (or set eval.python to a venv that has it)"]
    if "vllm_error" in answer:
        problems.append(f"eval.backend: vllm, but {python} cannot import vllm ({answer['vllm_error']}); "
                        f"{python} -m pip install vllm, or set eval.backend: hf (or auto)")
    for name, close in answer.get("unknown", {}).items():
        label = f"eval.tasks[{tasks.entry_of.get(name, 0)}]"
        if name in tasks.from_files:
            problems.append(f"{label}: lm-eval does not register the task {name!r} of {tasks.from_files[name]} "
                            "(its loader skipped the file: check its include: and !function files); "
                            f"{python} -m lm_eval validate --tasks {name} --include_path {tasks.include_path} "
                            "says why")
            continue
        hint = f"did you mean {' or '.join(close)}?" if close else "`lm-eval ls tasks` lists them"
        problems.append(f"{label}: {name!r} is not a task lm-eval {answer.get('lm_eval', '')} knows; {hint} "
                        "(or give your own task YAML file)")
    return problems
