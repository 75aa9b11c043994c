"""Helpers for the in-job tests: run directories from the tiny example, a two-rank CPU launcher.

Runs launch ``python -m torch.distributed.run --standalone --nproc_per_node 2 -m
slurmft.job.entrypoint train RUN_DIR`` with gloo on this machine, offline, with short rendezvous
and collective time-outs (see ``job_env``) so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY_EXAMPLE = REPO / "examples" / "tiny" / "run.yaml"


def write_run(run_dir: Path, model: Path, overrides: list[str] | None = None,
              edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A run directory with config.yaml made from examples/tiny/run.yaml (as submit would write it)."""
    from slurmft.config import load_config

    cfg = load_config(TINY_EXAMPLE, [f"model.name_or_path={model}", f"output_dir={run_dir}", *(overrides or [])])
    data = cfg.model_dump(mode="json")
    if edit is not None:
        edit(data)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return run_dir


@dataclass
class Launch:
    """A two-rank CPU job started in the background."""

    proc: subprocess.Popen[str]
    run_dir: Path
    log_path: Path

    def ranks(self) -> list[int]:
        """PIDs of the rank processes (the launcher's children)."""
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []

    def signal_ranks(self, sig: int = signal.SIGUSR2) -> list[int]:
        """Send ``sig`` to every rank, as Slurm does with --signal."""
        pids = self.ranks()
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def wait(self, timeout: float) -> tuple[int, str]:
        """Exit code and combined output; kills the whole job on time-out (and fails)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"job did not finish within {timeout}s (hang?); log:\n{self.log_path.read_text()[-4000:]}")
        return self.proc.returncode, self.log_path.read_text()


def launch(run_dir: Path, env: dict[str, str], nproc: int = 2, target: list[str] | None = None) -> Launch:
    """Start ``torch.distributed.run`` with ``nproc`` CPU ranks; output goes to a log file next to ``run_dir``.

    ``target`` is what torchrun runs (default: ``-m slurmft.job.entrypoint train RUN_DIR``).
    """
    log_path = run_dir.parent / f"{run_dir.name}.{int(time.time() * 1000)}.log"
    target = target or ["-m", "slurmft.job.entrypoint", "train", str(run_dir)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, text=True, cwd=str(run_dir.parent),
                                start_new_session=True)
    return Launch(proc=proc, run_dir=run_dir, log_path=log_path)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as a list of records."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
