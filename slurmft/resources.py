"""Where the shipped data (templates/, configs/) lives: the source tree, or inside the wheel."""

from __future__ import annotations

from functools import cache
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


@cache
def data_dir(kind: str) -> Path:
    """Directory of ``templates`` or ``configs``: at the top of a checkout, else the wheel's copy.

    The wheel maps the top-level folders into the package (``slurmft/templates``, ``slurmft/configs``;
    see pyproject.toml), so an installed slurmft finds them next to its modules.
    """
    for candidate in (_PACKAGE.parent / kind, _PACKAGE / kind):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"slurmft's {kind}/ directory is missing (looked in {_PACKAGE.parent} and {_PACKAGE})")
