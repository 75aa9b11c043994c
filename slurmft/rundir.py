"""The run directory: one class names every file the login side and the job side share.

The run directory on the shared filesystem is the single source of truth: the resolved config,
the rendered scripts, a manifest of every job id and attempt, logs, checkpoints, the final model.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.errors import RunDirError

MANIFEST_VERSION = 2
# Every job slurmft submits carries ``--comment=slurmft:<run id>``, so a job that a killed submit
# never wrote into the manifest can still be found (and adopted) with one squeue query.
JOB_TAG_PREFIX = "slurmft:"
# What consolidation writes last into the model directory: its presence means a complete export.
MODEL_INDEX = "model.safetensors.index.json"
# What consolidation writes into the adapter directory of a LoRA run (PEFT's file names).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


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
    def run_id(self) -> str:
        """Stable id of this run directory (a hash of its absolute path): tags every job of the run."""
        return hashlib.sha256(str(self.root).encode()).hexdigest()[:12]

    @property
    def job_tag(self) -> str:
        """The ``--comment`` every job of this run carries."""
        return JOB_TAG_PREFIX + self.run_id

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
    def adapter(self) -> Path:
        """A LoRA run's adapter as PEFT saves it (``PeftModel.from_pretrained(base, adapter)`` loads it)."""
        return self.root / "adapter"

    @property
    def plan(self) -> Path:
        """``train.epochs``: the steps computed from the packed data at the first start (kept across restarts)."""
        return self.root / "plan.json"

    @property
    def requeue_marker_dir(self) -> Path:
        """Markers left by the ranks to ask the batch script for a requeue."""
        return self.root / "requeue"

    def requeue_marker(self, job_id: str, restart: int) -> Path:
        """``requeue/<job>-<restart>``: the ranks of this job at this restart stopped for a signal."""
        return self.requeue_marker_dir / f"{job_id}-{restart}"

    @staticmethod
    def requeue_marker_key(name: str) -> tuple[str, int] | None:
        """(job id, restart) of a marker file name written by :meth:`requeue_marker`, else None."""
        job, sep, restart = name.rpartition("-")
        if not sep or not job or not restart.isdigit() or name.startswith("."):
            return None
        return job, int(restart)

    @property
    def fsdp_report(self) -> Path:
        """``rank<r>.json`` per rank: the FSDP layout the job really ran (mesh, shards, gradient bytes)."""
        return self.root / "fsdp_report"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files (``train.report_to: [tensorboard]``), one directory for every attempt."""
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        """What W&B writes when ``WANDB_DIR`` is the run directory (slurmft's default): ``offline-run-<time>-<id>/``
        (or ``run-<time>-<id>/`` online), one per attempt, all carrying the run's one W&B id (slurmft/trackers.py)."""
        return self.root / "wandb"

    @property
    def tracker(self) -> Path:
        """The experiment-tracker run this run logs to (``train.report_to: [wandb]``): its id, project, URL and
        each attempt's W&B directory, written by the job's rank 0 (slurmft/trackers.py); ``status`` shows it."""
        return self.root / "tracker.json"

    @property
    def report(self) -> Path:
        """The run report written by consolidation (``slurmft report`` rewrites it)."""
        return self.root / "report.md"

    @property
    def loss_plot(self) -> Path:
        """Loss and learning rate by step, drawn beside the report (``slurmft plot``)."""
        return self.root / "loss.png"

    @property
    def folders(self) -> frozenset[str]:
        """Names of the folders slurmft makes inside a run directory (none of them holds another run)."""
        return frozenset(p.name for p in (self.scripts, self.logs, self.submitit, self.checkpoints, self.model,
                                           self.adapter, self.requeue_marker_dir, self.fsdp_report,
                                           self.tensorboard, self.wandb))


@dataclass(frozen=True)
class ProbePaths:
    """Every path of one ``slurmft doctor --job`` probe: its own directory (not a run directory: a probe must
    not leave files in an output_dir that ``submit`` then refuses as foreign), and the token files the
    nodes write into the directories whose sharing is checked."""

    root: Path

    @property
    def script(self) -> Path:
        return self.root / "probe.sbatch"

    @property
    def log(self) -> Path:
        return self.root / "probe.log"

    def ready(self, rank: int) -> Path:
        """Written by a rank once its checks ran and its signal handler is in place."""
        return self.root / f"ready-{rank}"

    def rank_report(self, rank: int) -> Path:
        return self.root / f"rank-{rank}.json"

    @property
    def batch_report(self) -> Path:
        """What the batch shell's side found (scontrol, the time limit it set)."""
        return self.root / "batch.json"

    @property
    def batch_signal(self) -> Path:
        """Touched by the batch shell's trap when the warning signal reached it."""
        return self.root / "batch-signal"

    @staticmethod
    def token(directory: Path, job_id: str, node: str) -> Path:
        """The file a node writes into ``directory`` (the run dir's, HF_HOME) and every other node reads."""
        return directory / f".slurmft-doctor-{job_id}-{node}"


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


def planned_max_steps(paths: RunPaths, max_steps: int | None, epochs: float | None) -> int | None:
    """``train.max_steps``, or for ``train.epochs`` the steps the job recorded at its first start (None before)."""
    if epochs is None:
        return max_steps
    try:
        return int(json.loads(paths.plan.read_text())["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def new_manifest(name: str, executor: str, run_id: str = "") -> dict[str, Any]:
    """An empty manifest for a new run.

    ``jobs`` lists every job ever submitted for the run (kind, job id, per-kind attempt number);
    ``attempts`` lists how the run was started and continued: one entry per ``submit`` or ``resume``
    with its job ids, the checkpoint it resumed from and why the previous attempt ended.
    """
    return {"version": MANIFEST_VERSION, "name": name, "executor": executor, "run_id": run_id,
            "created": time.time(), "jobs": [], "attempts": []}


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


def start_attempt(manifest: dict[str, Any], how: str, **extra: Any) -> dict[str, Any]:
    """Append a run attempt (``submit``, ``resume``) to the manifest and return it (filled in by dispatch)."""
    attempts = manifest.setdefault("attempts", [])
    entry = {"attempt": len(attempts) + 1, "how": how, "time": time.time(), "train_job": None,
             "consolidate_job": None, **extra}
    attempts.append(entry)
    return entry


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


def pid_alive(pid: int) -> bool:
    """True when process ``pid`` exists on this host and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # exited in between
        return False


def _lock_owner(paths: RunPaths) -> tuple[str, int | None, str]:
    """(host, pid, raw text) of the process that holds the submit lock."""
    try:
        text = paths.lock.read_text().strip()
    except OSError:
        return "", None, ""
    host, _, rest = text.partition(" ")
    pid = None
    for word in rest.split():
        if word.startswith("pid=") and word[4:].isdigit():
            pid = int(word[4:])
    return host, pid, text


def acquire_lock(paths: RunPaths, what: str, say: Callable[[str], None] | None = None) -> None:
    """Take ``.submit.lock`` (one writer of the run directory at a time).

    A lock left by a dead process on this host is cleared with a message; one held by a live process,
    or by another host (whose processes we cannot see), is refused with its owner and how to clear it.
    """
    for _ in range(2):
        try:
            fd = os.open(paths.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            host, pid, text = _lock_owner(paths)
            if host == socket.gethostname() and pid is not None and not pid_alive(pid):
                paths.lock.unlink(missing_ok=True)
                if say:
                    say(f"cleared a stale lock {paths.lock} left by pid {pid} on this host (no longer running)")
                continue
            owner = f"pid {pid} on host {host}" if host and pid is not None else f"an unknown process ({text!r})"
            fix = ("wait for it, or stop it, then retry" if host == socket.gethostname() else
                   f"if no slurmft command runs there any more, remove {paths.lock} and retry")
            raise RunDirError(f"{paths.root} is locked by {owner} (another slurmft command is writing it); "
                              f"cannot {what} now: {fix}") from None
        os.write(fd, f"{socket.gethostname()} pid={os.getpid()} t={int(time.time())} {what}\n".encode())
        os.close(fd)
        return
    raise RunDirError(f"could not take the lock {paths.lock}: it keeps reappearing")


def release_lock(paths: RunPaths) -> None:
    """Drop the lock taken by :func:`acquire_lock` in this process."""
    host, pid, _ = _lock_owner(paths)
    if pid == os.getpid() and host == socket.gethostname():
        paths.lock.unlink(missing_ok=True)
