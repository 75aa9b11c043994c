"""Where the shipped data (templates/, configs/) lives: the source tree, or inside the wheel."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def data_dir(kind: str) -> Path:
    """Directory of ``templates`` or ``configs``: next to the package in a checkout, else the wheel's copy."""
    repo = Path(__file__).resolve().parent.parent / kind
    if repo.is_dir():
        return repo
    import importlib.resources

    return Path(str(importlib.resources.files(f"slurmft.{kind}")))
