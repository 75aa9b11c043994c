"""The wheel ships templates/ and configs/ and works outside the source tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_installed_wheel_renders_with_shipped_templates_and_profiles(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(REPO)], check=True, capture_output=True)
    target = tmp_path / "site"  # install the wheel alone into a folder that shadows the checkout
    wheel = next(wheels.glob("slurmft-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import slurmft, slurmft.resources as r;"
        "from slurmft.cli import main;"
        "assert slurmft.__file__.startswith(sys.argv[1]), slurmft.__file__;"
        "print(r.data_dir('templates')); main(['render', sys.argv[2]])"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(target), str(REPO / "tests/data/golden-2x8-aws-efa.yaml")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(str(target / "slurmft" / "templates"))
    assert "#SBATCH --nodes=2" in out.stdout and "FI_EFA_USE_HUGE_PAGE" in out.stdout
