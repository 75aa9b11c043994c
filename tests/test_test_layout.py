"""The test tree itself: pytest imports a test module outside a package by its file name alone, so two such
files of one name (tests/test_x.py and tests/slurm/test_x.py) make collection fail with "import file
mismatch" for whichever comes second (it happened: CI of 2026-12-04)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_test_modules_outside_packages_have_unique_names() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in sorted(TESTS.rglob("test_*.py")):
        if not (path.parent / "__init__.py").exists():
            by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"rename one of each: {clashes}"
    assert "test_container.py" in by_name and "test_container_plan.py" in by_name  # the pair that clashed
