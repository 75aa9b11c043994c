"""Another interpreter, asked from this one: where it is, and which modules it finds (nothing imported here).

The job's Python (``cluster.python``), the serve check's (``serve.python``) and the evaluation's (``eval.python``)
are checked the same way, on the login node (``validate``) and, for the last two, on the nodes by ``doctor --job``'s
probe (slurmft.job.probe): :func:`locate` finds the file (a bare name on PATH, as the shell does), then
:func:`finds_modules` runs it once with ``importlib.util.find_spec`` (milliseconds: nothing is imported there) and
reads the JSON it prints. :func:`run_json` runs any such snippet (lm-eval's task registry too). Each check words its
own problems: they name its field and its fix.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.config_paths import is_program_path

#: What :func:`locate` finds wrong with an interpreter: a bare name not on PATH, a path with no file, a file that
#: may not be run.
NOT_ON_PATH, MISSING, NOT_EXECUTABLE = "not on PATH", "missing", "not executable"

# Runs in the other interpreter, importing nothing: which modules it finds and which distributions' versions.
_FINDS = r"""
import importlib.metadata as md, importlib.util as u, json, sys
modules, dists = json.loads(sys.argv[1])
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
print(json.dumps({"modules": {m: u.find_spec(m) is not None for m in modules},
                  "versions": {d: version(d) for d in dists}}))
"""


class NoAnswer(Exception):
    """The interpreter did not answer: it did not start, ran out of time, failed (the last line of its stderr) or
    printed no JSON."""


@dataclass(frozen=True)
class Found:
    """What :func:`finds_modules` learnt: each module found or not, each distribution's version (None: absent)."""

    modules: dict[str, bool]
    versions: dict[str, str | None]


def locate(python: str) -> tuple[str, str | None]:
    """``(path, problem)``: the interpreter's file (a bare name looked up on PATH) and :data:`NOT_ON_PATH`,
    :data:`MISSING`, :data:`NOT_EXECUTABLE` or None."""
    if not is_program_path(python):
        found = shutil.which(python)
        if found is None:
            return python, NOT_ON_PATH
        python = found
    path = Path(python)
    if not path.is_file():
        return python, MISSING
    if not path.stat().st_mode & 0o111:
        return python, NOT_EXECUTABLE
    return python, None


def in_words(python: str, problem: str) -> str:
    """:func:`locate`'s problem as the head of a message: ``'python3' is not on PATH here``, ``/x/python does not
    exist on this machine``, ``/x/python is not executable``."""
    if problem == NOT_ON_PATH:
        return f"{python!r} is not on PATH here"
    if problem == MISSING:
        return f"{python} does not exist on this machine"
    return f"{python} is not executable"


def run_json(python: str, code: str, *args: str, timeout: float = 60,
             env: Mapping[str, str] | None = None) -> Any:  # noqa: ANN401 - the JSON it printed
    """Run ``code`` in ``python`` (in /, so no module of the current folder shadows its own) and return the JSON
    of the last line it prints. Raises :class:`NoAnswer` with why it gave none."""
    try:
        proc = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                              check=False, cwd="/", env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NoAnswer(f"{type(err).__name__}: {err}") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise NoAnswer((proc.stderr.strip().splitlines() or ["no output"])[-1])
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise NoAnswer(f"exit {proc.returncode}: unreadable output") from None


def finds_modules(python: str, modules: Iterable[str], versions: Iterable[str] = (), timeout: float = 60,
                  env: Mapping[str, str] | None = None) -> Found:
    """Which of ``modules`` ``python`` finds (``find_spec``: none is imported) and the installed version of each of
    the distributions ``versions``, in one child process. Raises :class:`NoAnswer`."""
    out = run_json(python, _FINDS, json.dumps([list(modules), list(versions)]), timeout=timeout, env=env)
    try:
        return Found(dict(out["modules"]), dict(out["versions"]))
    except (TypeError, KeyError, ValueError):
        raise NoAnswer("unreadable output") from None
