"""The run directory: one class names every file the login side and the job side share.

The run directory on the shared filesystem is the single source of truth: the resolved config,
the rendered scripts, a manifest of every job id and attempt, logs, checkpoints, the final model.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.errors import RunDirError

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class RunPaths:
    """Every path inside a run directory."""

    root: Path

    @classmethod
    def of(cls, root: str | os.PathLike[str]) -> RunPaths:
        """RunPaths for an absolute run directory."""
        return cls(Path(root).expanduser().resolve())

    @property
    def config(self) -> Path:
        """The resolved run config the job reads."""
        return self.root / "config.yaml"

    @property
    def manifest(self) -> Path:
        """JSON record of every job, attempt and dependency."""
        return self.root / "manifest.json"

    @property
    def lock(self) -> Path:
        """Held while a submit writes the run directory."""
        return self.root / ".submit.lock"

    @property
    def scripts(self) -> Path:
        """Rendered sbatch scripts."""
        return self.root / "scripts"

    def script(self, job: str) -> Path:
        """Rendered script of ``train`` or ``consolidate``."""
        return self.scripts / f"{job}.sbatch"

    @property
    def logs(self) -> Path:
        """Job logs (one file per job id and kind)."""
        return self.root / "logs"

    def log_pattern(self, job: str) -> Path:
        """Slurm ``--output`` pattern of a job kind (%j = job id)."""
        return self.logs / f"{job}-%j.out"

    def log_file(self, job: str, job_id: str) -> Path:
        """The log file of one job."""
        return self.logs / f"{job}-{job_id}.out"

    @property
    def submitit(self) -> Path:
        """submitit's folder: pickled callables and results."""
        return self.root / "submitit"

    @property
    def checkpoints(self) -> Path:
        """Sharded DCP checkpoints (``checkpoint-<step>/``)."""
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        """Per-step metrics (JSONL)."""
        return self.root / "metrics.jsonl"

    @property
    def model(self) -> Path:
        """The consolidated Hugging Face model."""
        return self.root / "model"

    @property
    def requeue_marker_dir(self) -> Path:
        """Markers left by the ranks to ask the batch script for a requeue."""
        return self.root / "requeue"


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file and rename (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_manifest(name: str, executor: str) -> dict[str, Any]:
    """An empty manifest for a new run."""
    return {"version": MANIFEST_VERSION, "name": name, "executor": executor, "created": time.time(), "jobs": []}


def read_manifest(paths: RunPaths) -> dict[str, Any]:
    """Read the manifest, or explain why there is none."""
    if not paths.root.is_dir():
        raise RunDirError(f"run directory {str(paths.root)!r} does not exist")
    if not paths.manifest.is_file():
        raise RunDirError(
            f"{paths.root} has no manifest.json: it is not a slurmft run directory (or its submit failed)"
        )
    try:
        return json.loads(paths.manifest.read_text())
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{paths.manifest} is corrupt: {exc}") from None


def write_manifest(paths: RunPaths, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically."""
    atomic_write(paths.manifest, json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def record_job(manifest: dict[str, Any], kind: str, job_id: str, **extra: Any) -> dict[str, Any]:
    """Append one job (train or consolidate) to the manifest and return its entry."""
    attempt = 1 + sum(1 for j in manifest["jobs"] if j["kind"] == kind)
    entry = {"kind": kind, "job_id": str(job_id), "attempt": attempt, "submitted": time.time(), **extra}
    manifest["jobs"].append(entry)
    return entry


def latest_jobs(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The newest job of each kind."""
    out: dict[str, dict[str, Any]] = {}
    for job in manifest.get("jobs", []):
        out[job["kind"]] = job
    return out
