"""Run the slurmft CLI in-process, as a user would from a shell: (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest

from slurmft.cli import main


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one CLI call."""
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err
