"""A bench script (bench/NAME.py) imported as a module, so the tests can call its pure parts: ``from bench_module
import load_bench`` (tests/ is on pytest's path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py, executed once and registered under ``name`` (a bench imports its neighbours by name)."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(BENCH / f"{name}.py"):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
