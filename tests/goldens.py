"""Rendered scripts against the checked-in ones in tests/golden/ (``SLURMFT_UPDATE_GOLDEN=1`` rewrites them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def assert_matches_golden(text: str, golden: Path) -> None:
    if os.environ.get("SLURMFT_UPDATE_GOLDEN"):
        changed = not golden.exists() or golden.read_text() != text
        golden.write_text(text)
        # A run that rewrites the golden file proves nothing about it: fail, so it cannot pass CI.
        pytest.fail(f"SLURMFT_UPDATE_GOLDEN is set: wrote {golden} ({'changed' if changed else 'unchanged'}); "
                    "review the diff, then run again without it")
    assert text == golden.read_text(), f"rendered text differs from {golden} (SLURMFT_UPDATE_GOLDEN=1 to refresh)"
