"""Find and tail a run's log files."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from slurmft.errors import RunDirError
from slurmft.rundir import RunPaths, latest_jobs, read_manifest


def log_files(run_dir: Path, kind: str) -> list[Path]:
    """Log files of the newest job of ``kind`` (one per rank for local runs, one for Slurm)."""
    paths = RunPaths.of(run_dir)
    job = latest_jobs(read_manifest(paths)).get(kind)
    if job is None:
        raise RunDirError(f"run {paths.root} has no {kind} job (was consolidation disabled?)")
    files = [Path(p) for p in job.get("logs", [])] or [Path(job["log"])]
    return [f for out in files for f in (out, *_stderr_of(out))]


def _stderr_of(out: Path) -> list[Path]:
    """The stderr file written next to a stdout log (submitit's local executor: ``*_log.out`` + ``*_log.err``).

    Every ``[slurmft rank0 ...]`` line and every traceback of a local run is in the ``.err`` file;
    Slurm jobs write both streams into one file, so there is nothing to add for them.
    """
    if out.suffix != ".out":
        return []
    err = out.with_suffix(".err")
    return [err] if out.name.endswith("_log.out") or err.exists() else []


def tail(files: list[Path], lines: int, follow: bool, echo: Callable[[str], None]) -> None:
    """Print the last ``lines`` lines of each file, then (with ``follow``) what is appended."""
    offsets: dict[Path, int] = {}
    for f in files:
        if not f.exists():
            echo(f"(no log yet: {f} — the job may still be pending)")
            offsets[f] = 0
            continue
        data = f.read_bytes()
        offsets[f] = len(data)
        if len(files) > 1:
            echo(f"==> {f} <==")
        for line in data.decode(errors="replace").splitlines()[-lines:]:
            echo(line)
    while follow:
        time.sleep(0.5)
        for f in files:
            if not f.exists():
                continue
            size = f.stat().st_size
            if size > offsets[f]:
                with open(f, "rb") as fh:
                    fh.seek(offsets[f])
                    chunk = fh.read()
                offsets[f] = size
                for line in chunk.decode(errors="replace").splitlines():
                    echo(line)
