"""Login-node commands must not import the training stack (they must feel instant)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = Path(__file__).parent / "data" / "golden-2x8-aws-efa.yaml"
HEAVY = ["torch", "transformers", "accelerate", "trl", "datasets", "safetensors"]

PROBE = """
import sys
from slurmft.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
heavy = [m for m in {heavy!r} if m in sys.modules]
print("HEAVY", heavy)
"""


@pytest.mark.parametrize(
    "args",
    [["--help"], ["render", str(CONFIG)], ["validate", str(CONFIG)], ["estimate", str(CONFIG), "--json"],
     ["profiles"], ["validate", str(CONFIG), "train.sft.adam_beta2=0.95"]],
    ids=["help", "render", "validate", "estimate", "profiles", "validate-sft-keys-via-child-process"],
)
def test_login_commands_import_no_training_stack(args: list[str]) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
