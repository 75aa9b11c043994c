"""Login-side checks of the jobs after consolidation: their interpreters import what they need (no torch here).

vLLM and lm-eval live in interpreters of their own (``serve.python``, ``eval.python``; default the job's). One
child process per interpreter asks ``importlib.util.find_spec`` (slurmft.interpreter: milliseconds, nothing
is imported), so a missing package is refused at ``validate``/``submit`` with the fix, not found by the job after
training.
"""

from __future__ import annotations

from slurmft.config import RunConfig
from slurmft.config_model_checks import MODEL_JOB_TOOLS
from slurmft.interpreter import MISSING, NOT_ON_PATH, NoAnswer, finds_modules, in_words, locate

VLLM = MODEL_JOB_TOOLS["serve"]


def interpreter(python: str | None, cfg: RunConfig, kind: str) -> tuple[str, str]:
    """The interpreter a section runs (:meth:`RunConfig.model_job_python`) and how to name it in a message."""
    return cfg.model_job_python(kind), "" if python else " (not set: the job's Python)"


def check_serve(cfg: RunConfig) -> list[str]:
    """``serve``: its Python finds vLLM (and peft-free LoRA serving needs nothing more)."""
    if cfg.serve is None:
        return []
    python, how = interpreter(cfg.serve.python, cfg, "serve")
    path, where = locate(python)
    why = None
    if where == NOT_ON_PATH:
        why = in_words(path, where)
    elif where == MISSING:
        why = f"{in_words(path, where)} (the compute nodes need it at the same path)"
    else:
        try:  # a file that may not be run (NOT_EXECUTABLE) answers nothing either
            found = finds_modules(path, (VLLM.module,)).modules
        except NoAnswer:
            why = f"{path} does not run (or is not a Python)"
    if why:
        return [f"serve.python{how}: {why}; set serve.python to the interpreter of a venv with vLLM installed"]
    if not found[VLLM.module]:
        return [f"serve.python{how}: {python} cannot import vllm: the serve check would fail after training; install "
                f"it in its own venv ({VLLM.install}) and set serve.python to its bin/python"]
    return []
