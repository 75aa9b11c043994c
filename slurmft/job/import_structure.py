"""transformers' import structure, read from its model files once per installation instead of at every process start.

``import transformers`` builds the table its lazy module serves names from by opening every file under
``transformers/models`` (~3,300 on transformers 5.24) and reading each one's ``__all__``, twice (once for
``transformers``, once for ``transformers.models``): ~0.9 s each on the test machine, ~1.8 s of the ~13 s a
rank spends importing, paid by every rank at every start, requeue and resume. On a cluster that is also
512 ranks opening the same 3,300 files on the shared file system at once.

:func:`install`, called before the stack loads (slurmft/job/entrypoint.py), wraps transformers'
``define_import_structure`` as its module finishes loading: the first process computes the table as
transformers does and stores it as JSON in the cache directory; later processes read it (~2 ms). The key
is the transformers version and the models directory's listing: each model directory's modification time
(which changes when a file is added, removed or renamed in it: what Python's own import system watches in a
directory). An in-place edit of an installed model file that changes its ``__all__`` is not seen: set
``SLURMFT_IMPORT_STRUCTURE_CACHE=0`` (as for any transformers source tree you edit).

Nothing here may fail a job: an unreadable, unwritable or damaged cache means transformers computes the
table itself, as without this module. tests/test_import_structure.py checks that the cached table equals
transformers' own and that a process using it imports and builds models.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from slurmft.modelinfo import cache_dir  # where the tables are kept (SLURMFT_CACHE_DIR moves it)

#: ``0`` (or ``false``/``no``/``off``) in a job's environment: transformers computes its table as it would.
ENV = "SLURMFT_IMPORT_STRUCTURE_CACHE"
MODULE = "transformers.utils.import_utils"

#: What :func:`install` found: "not installed", "off", "already imported" or "installed".
outcome: str = "not installed"
#: One entry per models-directory table transformers asked for: "read", "computed" or "computed (not saved: ...)".
tables: list[str] = []

Structure = dict[frozenset[str], dict[str, set[str]]]


def enabled() -> bool:
    """False when the job's environment turned the cache off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def install(directory: Path | None = None) -> bool:
    """Have transformers' import structure come from the cache in this process; True when the hook is in place.

    A no-op (False) when transformers is imported already or the cache is off."""
    global outcome
    if not enabled():
        outcome = "off"
        return False
    if "transformers" in sys.modules:
        outcome = "already imported"
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(directory or cache_dir()))
    outcome = "installed"
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """Finds transformers' ``import_utils`` as the other finders do and wraps its table builder once it ran."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.done = False  # it stays in sys.meta_path (removing it while the import system iterates would skip a finder)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE or self.done:
            return None
        self.done = True
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, directory = spec.loader, self.directory
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            original = getattr(module, "define_import_structure", None)
            if callable(original):
                module.define_import_structure = _cached(original, directory, getattr(module, "__file__", "") or "")

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _cached(define: Callable[..., Structure], directory: Path, import_utils_file: str) -> Callable[..., Structure]:
    """``define_import_structure`` with the models directory's table read from (or written to) ``directory``."""
    models = Path(import_utils_file).resolve().parent.parent / "models"
    key = functools.cache(lambda: _installation_key(models))  # both tables of an import: one listing, one lookup

    def define_import_structure(module_path: str | os.PathLike[str], prefix: str | None = None) -> Structure:
        path = Path(module_path)
        if (path.parent if path.name == "__init__.py" else path).resolve() != models:
            return define(module_path, prefix)  # one model's own directory: a few files, cheap
        installation = key()
        file = None if installation is None else directory / _table_name(installation, prefix)
        if file is not None:
            table = _read(file)
            if table is not None:
                tables.append("read")
                return table
        table = define(module_path, prefix)
        tables.append("computed" if file is None else _write(file, table))
        return table

    define_import_structure.__wrapped__ = define  # type: ignore[attr-defined]
    return define_import_structure


def _installation_key(models: Path) -> str | None:
    """What names this transformers installation's tables (None when its models directory cannot be listed)."""
    try:
        listing = sorted((entry.name, entry.stat().st_mtime_ns) for entry in os.scandir(models))
        package = (models.parent / "__init__.py").stat().st_mtime_ns
    except OSError:
        return None
    key = hashlib.sha256(json.dumps([str(models), package, _transformers_version(), listing]).encode()).hexdigest()
    return key[:24]


def _table_name(installation: str, prefix: str | None) -> str:
    """The cache file of one table (transformers asks for the models directory's with and without a prefix)."""
    return f"transformers-import-structure-{prefix or 'none'}-{installation}.json"


def _transformers_version() -> str:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # noqa: BLE001  # metadata missing (a source tree on PYTHONPATH): the listing still keys it
        return "unknown"


def _read(file: Path) -> Structure | None:
    try:
        rows = json.loads(file.read_text())
        return {frozenset(backends): {module: set(names) for module, names in modules.items()}
                for backends, modules in rows}
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # absent, half-written by an older version, damaged: transformers computes it


def _write(file: Path, table: Structure) -> str:
    """Store ``table`` atomically (ranks starting together may write it at once); returns the outcome."""
    try:
        rows: list[Any] = [[sorted(backends), {module: sorted(names) for module, names in modules.items()}]
                           for backends, modules in table.items()]
        if not all(isinstance(b, str) for backends, _ in rows for b in backends):
            return "computed (not saved: a backend that is not a name)"
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name + ".")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(rows, out)
            os.replace(tmp, file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except (OSError, TypeError, ValueError) as exc:
        return f"computed (not saved: {type(exc).__name__})"
    return "computed"
