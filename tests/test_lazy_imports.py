"""Login-node commands must not import the training stack (they must feel instant)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = Path(__file__).parent / "data" / "golden-2x8-aws-efa.yaml"
HEAVY = ["torch", "transformers", "accelerate", "trl", "datasets", "safetensors", "wandb"]

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


def test_watching_commands_import_no_training_stack(tmp_path: Path) -> None:
    """runs, plot (with matplotlib installed), report and logs --rank read the run directory only."""
    from runfixture import preempted_run

    run = preempted_run(tmp_path)
    for args in (["runs", str(tmp_path)], ["plot", str(run)], ["report", str(run)],
                 ["logs", str(run), "--rank", "0"]):
        out = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], capture_output=True,
                             text=True, env={**os.environ, "PATH": "/nonexistent"})  # no Slurm to ask
        assert out.returncode == 0, (args, out.stderr)
        assert "HEAVY []" in out.stdout, (args, out.stdout[-500:])
    assert (run / "loss.png").stat().st_size > 0 and (run / "report.md").is_file()


def test_watching_commands_do_not_build_the_config_schema(tmp_path: Path) -> None:
    """status, runs, plot and report read the run directory's files, not a RunConfig: neither the schema nor
    pydantic is imported (building its 20 models was most of `slurmft status`'s time)."""
    from runfixture import preempted_run

    run = preempted_run(tmp_path)
    schema = ["pydantic", "slurmft.config"]
    for args in (["status", str(run)], ["runs", str(tmp_path)], ["plot", str(run)], ["report", str(run)]):
        out = subprocess.run([sys.executable, "-c", PROBE.format(heavy=schema), *args], capture_output=True,
                             text=True, env={**os.environ, "PATH": "/nonexistent"})  # no Slurm to ask
        assert out.returncode == 0, (args, out.stderr)
        assert "HEAVY []" in out.stdout, (args, out.stdout[-500:])


def test_doctor_imports_no_training_stack_and_answers_without_slurm() -> None:
    """doctor (login side) with no Slurm on PATH: problems in words, exit 1, never a traceback or torch."""
    probe = PROBE.replace("assert not exc.code, exc.code", "assert exc.code == 1, exc.code")
    out = subprocess.run([sys.executable, "-c", probe.format(heavy=HEAVY), "doctor", str(CONFIG)], capture_output=True,
                         text=True, env={**os.environ, "PATH": "/nonexistent"})
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
    assert "problem  slurm: scontrol show config failed: scontrol is not on PATH" in out.stdout
    assert "Traceback" not in out.stderr


def test_doctor_job_renders_its_probe_without_the_training_stack(tmp_path: Path) -> None:
    """doctor --job renders the probe and calls sbatch (missing here: a problem line), all without torch."""
    probe = PROBE.replace("assert not exc.code, exc.code", "assert exc.code == 1, exc.code")
    out = subprocess.run([sys.executable, "-c", probe.format(heavy=HEAVY), "doctor", "--job", str(CONFIG)],
                         capture_output=True, text=True, env={**os.environ, "PATH": "/nonexistent", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
    assert "problem  probe: sbatch refused the probe job: sbatch is not on PATH" in out.stdout
    assert len(list(tmp_path.glob(".cache/slurmft/doctor/golden-2x8-*/probe.sbatch"))) == 1  # kept for a look
