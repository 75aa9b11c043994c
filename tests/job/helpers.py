"""Helpers for the in-job tests: run directories from the tiny example, a two-rank CPU launcher.

Runs launch ``python -m torch.distributed.run --standalone --nproc_per_node 2 -m
slurmft.job.entrypoint train RUN_DIR`` with gloo on this machine, offline, with short rendezvous
and collective time-outs (see ``job_env``) so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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

from slurmft.job.rendezvous import free_port

REPO = Path(__file__).resolve().parents[2]
TINY_EXAMPLE = REPO / "examples" / "tiny" / "run.yaml"
TINY_DATA = REPO / "examples" / "tiny" / "data"


def preference_data(path: Path) -> Path:
    """The tiny DPO example's pairs (examples/tiny/data/pairs.jsonl: explicit-prompt strings, each a lima
    conversation's first answer chosen and another row's rejected), copied to ``path``."""
    shutil.copyfile(TINY_DATA / "pairs.jsonl", path)
    return path


def write_run(run_dir: Path, model: Path, overrides: list[str] | None = None,
              edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A run directory with config.yaml made from examples/tiny/run.yaml (as submit would write it)."""
    from slurmft.config_loading import load_config

    # prepare off unless an override turns it on: these runs start the entrypoint directly, with no prepare step
    cfg = load_config(TINY_EXAMPLE, ["prepare.enabled=false", f"model.name_or_path={model}", f"output_dir={run_dir}",
                                     *(overrides or [])])
    data = cfg.model_dump(mode="json")
    if edit is not None:
        edit(data)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return run_dir


@dataclass
class Launch:
    """A multi-rank CPU job started in the background (torchrun, or one process per rank like srun)."""

    procs: list[subprocess.Popen[str]]
    run_dir: Path
    log_path: Path
    torchrun: bool

    def ranks(self) -> list[int]:
        """PIDs of the rank processes."""
        if not self.torchrun:
            return [p.pid for p in self.procs if p.poll() is None]
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.procs[0].pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []

    def running(self) -> bool:
        """True while any process of the job is alive."""
        return any(p.poll() is None for p in self.procs)

    def signal_ranks(self, sig: int = signal.SIGUSR2) -> list[int]:
        """Send ``sig`` to every rank, as Slurm does with --signal."""
        pids = self.ranks()
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def wait(self, timeout: float) -> tuple[int, str]:
        """First non-zero exit code (else 0) and combined output; kills the job on time-out (and fails)."""
        deadline = time.time() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in self.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            pytest.fail(f"job did not finish within {timeout}s (hang?); log:\n{self.log_path.read_text()[-4000:]}")
        codes = [p.returncode for p in self.procs]
        return next((c for c in codes if c != 0), 0), self.log_path.read_text()


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
    return Launch(procs=[proc], run_dir=run_dir, log_path=log_path, torchrun=True)


def launch_like_srun(run_dir: Path, env: dict[str, str], ntasks: int = 2, job_id: str = "4242", restart: int = 0,
                     ranks: list[int] | None = None, port: int | None = None, nodes: int = 1,
                     program: list[str] | None = None, args: list[str] | None = None,
                     python: str | None = None) -> Launch:
    """One ``python -m slurmft.job.entrypoint train RUN_DIR`` per rank with the variables srun sets.

    This is the path a real Slurm job takes (our own rendezvous store, no torchrun agent).
    ``ranks`` starts only some of them (to test a rank that never shows up). ``nodes`` pretends the
    ranks are spread over that many nodes, block-distributed as srun does (all on this machine).
    ``program`` replaces ``-m slurmft.job.entrypoint`` (a script taking the same arguments), ``args``
    replaces its arguments ``train RUN_DIR``; ``python`` the interpreter (default: this one).
    """
    per_node = ntasks // nodes
    log_path = run_dir.parent / f"{run_dir.name}.{int(time.time() * 1000)}.log"
    port = port or free_port()
    procs = []
    with open(log_path, "w") as out:
        for rank in ranks if ranks is not None else range(ntasks):
            rank_env = {**env, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks),
                        "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
                        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NTASKS_PER_NODE": str(per_node),
                        "SLURM_JOB_ID": job_id, "SLURM_RESTART_COUNT": str(restart),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            cmd = [python or sys.executable, *(program or ["-m", "slurmft.job.entrypoint"]), *(args or ["train", str(run_dir)])]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=rank_env, text=True,
                                          cwd=str(run_dir.parent), start_new_session=True))
    return Launch(procs=procs, run_dir=run_dir, log_path=log_path, torchrun=False)


def _metrics_lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's training steps as a list of records (the save records apart: :func:`read_saves`)."""
    return [m for m in _metrics_lines(run_dir) if m.get("event") != "save"]


def read_saves(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's save records (step, mode, blocked_s, durable_s, bytes), in order."""
    return [m for m in _metrics_lines(run_dir) if m.get("event") == "save"]
