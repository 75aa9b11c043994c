"""The run directory: one class names every file the login side and the job side share.

The run directory on the shared filesystem is the single source of truth: the resolved config,
the rendered scripts, a manifest of every job id and attempt, logs, checkpoints, the final model.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import pwd
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft import locks
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
# The record a preparation writes last into ``prepared/``.
PREPARED_RECORD = "slurmft-prepared.json"


#: The ``event`` of a metrics.jsonl line that records a save (step, mode, blocked_s, durable_s, bytes), written by
#: the job's ``CompleteCheckpoints`` after the marker; every other line is a logged training step.
SAVE_EVENT = "save"


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
    def cancels(self) -> Path:
        """Who cancelled which jobs with ``slurmft cancel``, and when (JSON lines: :mod:`slurmft.cancels`)."""
        return self.root / "cancels.jsonl"

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
        """Per-step metrics (JSONL): one line per logged step, and one per complete save (:data:`SAVE_EVENT`)."""
        return self.root / "metrics.jsonl"

    @property
    def train_summary(self) -> Path:
        """One JSON line per attempt whose training loop ended (finished, or stopped by the warning signal):
        transformers' end-of-training figures of that attempt alone, and the whole run's up to then
        (slurmft/watch/run_totals.py); an attempt killed outright writes none."""
        return self.root / "train_summary.jsonl"

    @property
    def model(self) -> Path:
        """The consolidated Hugging Face model."""
        return self.root / "model"

    @property
    def reference_logps(self) -> Path:
        """``dpo.reference: precomputed``: the starting model's log-probabilities of every pair's chosen and rejected
        reply, written by the train job's first attempt before step 1 (slurmft/job/dpo_reference_logps.py)."""
        return self.root / "reference_logps.safetensors"

    @property
    def adapter(self) -> Path:
        """A LoRA run's adapter as PEFT saves it (``PeftModel.from_pretrained(base, adapter)`` loads it)."""
        return self.root / "adapter"

    @property
    def prepared(self) -> Path:
        """The prepared training data (``prepare.enabled``): TRL's tokenized, masked and packed dataset, saved by
        ``datasets.Dataset.save_to_disk``; the train job and every requeue and resume read it (slurmft/job/prepare.py)."""
        return self.root / "prepared"

    @property
    def prepared_record(self) -> Path:
        """What produced ``prepared/`` (sources, tokenizer files, settings) and what it holds; written last, inside
        it, so its presence means a complete preparation (slurmft/prepared.py)."""
        return self.prepared / PREPARED_RECORD

    def prepared_parts(self, group: str) -> Path:
        """Where the tasks of prepare array ``group`` (its job id) write their shards until the last one packs them
        into ``prepared/`` (slurmft/job/prepare_array.py); a ``.prepared.`` name, as a staging directory's."""
        return self.root / f".prepared.array-{group}"

    def prepared_staging(self, tag: str) -> Path:
        """Where a preparation writes before it replaces ``prepared/`` (same file system: a rename)."""
        return self.root / f".prepared.{tag}.tmp"

    def prepared_leftovers(self) -> list[Path]:
        """Every ``.prepared.*`` entry: the shards of a prepare array (:meth:`prepared_parts`), a staging directory
        (:meth:`prepared_staging`) or a replaced ``prepared/`` being removed. A preparation that ends normally
        removes its own; one that was killed (time limit, SIGKILL, node failure) leaves them, up to the size of the
        tokenized corpus, so the next complete preparation removes them (slurmft/job/prepare.py)."""
        return sorted(self.root.glob(".prepared.*"))

    @property
    def batches(self) -> Path:
        """Per-step digest of the sequences each optimizer step trained on (JSONL, slurmft/job/batches.py)."""
        return self.root / "batches.jsonl"

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

    @staticmethod
    def consolidate_lock(out: Path) -> Path:
        """The lock of one consolidation output directory (``model/``, ``adapter/`` or ``--out DIR``): one export
        into it at a time, the automatic job's or a manual one's, on any node (slurmft/locks.py)."""
        return out.parent / f".{out.name}.consolidate.lock"

    @property
    def folders(self) -> frozenset[str]:
        """Names of the folders slurmft makes inside a run directory (none of them holds another run)."""
        return frozenset(p.name for p in (self.scripts, self.logs, self.submitit, self.checkpoints, self.model,
                                           self.adapter, self.requeue_marker_dir, self.fsdp_report,
                                           self.tensorboard, self.wandb, self.prepared))


SWEEP_VERSION = 1


class SweepPaths:
    """The files of a sweep directory (a point's own files are its :class:`~slurmft.rundir.RunPaths`)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @property
    def record(self) -> Path:
        """``sweep.json``: points, overrides, directories, job ids."""
        return self.root / "sweep.json"

    @property
    def best(self) -> Path:
        """A link to the best point's model directory (by ``sweep.select``)."""
        return self.root / "best"

    def point(self, name: str) -> Path:
        return self.root / name


def is_sweep_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a sweep directory (it holds ``sweep.json``). A directory this user may not look into is
    not one as far as this user can tell: the command then reads it as a run and says in words what it may not read."""
    try:
        return SweepPaths(path).record.is_file()
    except PermissionError:
        return False


def read_sweep_record(paths: SweepPaths) -> dict[str, Any]:
    try:
        record = json.loads(paths.record.read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{paths.record}: not a readable sweep record ({exc.__class__.__name__})") from None
    if not isinstance(record, dict) or record.get("version") != SWEEP_VERSION:
        raise RunDirError(f"{paths.record}: not a sweep record of this slurmft (version {SWEEP_VERSION})")
    if problem := _sweep_record_problem(record):
        raise RunDirError(f"{paths.record} is corrupt: {problem} (slurmft writes name, executor, select, jobs and "
                          "points, each point with its name, dir and overrides)")
    return record


def _sweep_record_problem(record: dict[str, Any]) -> str | None:
    """What keeps ``record`` from being one ``submit/sweep.new_record`` wrote (None: nothing): said once here, not
    as a KeyError in whichever command reads the sweep."""
    for key, kind in (("name", str), ("executor", str), ("select", dict), ("jobs", list), ("points", list)):
        if not isinstance(record.get(key), kind):
            return f"{key!r} is missing or not a {kind.__name__}"
    for i, point in enumerate(record["points"]):
        if not (isinstance(point, dict) and isinstance(point.get("name"), str) and isinstance(point.get("dir"), str)
                and isinstance(point.get("overrides"), dict)):
            return f"points[{i}] is not a point (a mapping with name, dir and overrides)"
    if not all(isinstance(job, dict) for job in record["jobs"]):
        return "jobs holds something that is not a job"
    return None


def write_sweep_record(paths: SweepPaths, record: dict[str, Any]) -> None:
    atomic_write(paths.record, json.dumps(record, indent=2) + "\n")


def umask() -> int:
    """This process's umask, read without changing it: ``Umask:`` of /proc/self/status (Linux >= 4.7);
    elsewhere once, the classic way (set and restore), at the first call, before slurmft starts threads."""
    global _UMASK
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    if _UMASK is None:
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return _UMASK


_UMASK: int | None = None


def keep_previous(path: Path) -> Path | None:
    """Copy a result file a newer job is about to replace into ``previous/`` beside it, named by when it was written
    (UTC): ``slurmft eval RUN_DIR eval.limit=4 eval.compare_base=false`` replaced the run's whole evaluation, its base
    comparison with it, and nothing kept it. Returns the copy (None: there was no file)."""
    if not path.is_file():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(path.stat().st_mtime))
    dest = path.parent / "previous" / f"{path.stem}-{stamp}{path.suffix}"
    dest.parent.mkdir(exist_ok=True)
    atomic_write(dest, path.read_bytes())
    return dest


def atomic_write(path: Path, text: str | bytes, executable: bool = False) -> None:
    """Write ``text`` (or bytes) to ``path`` via a temporary file and rename (readers never see half a file).

    ``mkstemp`` makes its file 0600 whatever the umask, so a teammate could not read a manifest written
    here: the file gets ``0666 & ~umask`` (``0777`` when ``executable``), as ``open`` would give it. Its
    group is the directory's when the directory is setgid (the kernel's rule for any new file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, (0o777 if executable else 0o666) & ~umask())
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
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


def new_manifest(name: str, executor: str, run_id: str = "", objective: dict[str, Any] | None = None) -> dict[str, Any]:
    """An empty manifest for a new run.

    ``jobs`` lists every job ever submitted for the run (kind, job id, per-kind attempt number);
    ``attempts`` lists how the run was started and continued: one entry per ``submit`` or ``resume``
    with its job ids, the checkpoint it resumed from and why the previous attempt ended; ``objective``
    (``RunConfig.objective``: method and packing) what it trains by (slurmft/methods.py).
    """
    return {"version": MANIFEST_VERSION, "name": name, "executor": executor, "run_id": run_id,
            "owner": current_user().record(), "created": time.time(),
            **({"objective": objective} if objective is not None else {}), "jobs": [], "attempts": []}


def check_run_dir(paths: RunPaths) -> None:
    """Raise the RunDirError for a RUN_DIR argument that is no directory at all: a typo, or a file given for the
    directory (each command says the same, before it reads or writes anything there)."""
    if paths.root.is_dir():
        return
    if paths.root.exists():
        raise RunDirError(f"{paths.root} is a file, not a run directory (give the directory a submit made: the run's "
                          "output_dir)")
    raise RunDirError(f"run directory {str(paths.root)!r} does not exist")


def read_manifest(paths: RunPaths) -> dict[str, Any]:
    """Read the manifest, or explain why there is none (or why we may not read it)."""
    try:
        check_run_dir(paths)
        if not paths.manifest.is_file():
            raise no_manifest(paths.root, "or its submit failed")
        manifest = json.loads(paths.manifest.read_text())
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{paths.manifest} is corrupt: {exc}") from None
    except UnicodeDecodeError as exc:  # a torn write of a disk that filled, or a file that is not ours
        raise RunDirError(f"{paths.manifest} is corrupt: not UTF-8 text (byte {exc.start})") from None
    except PermissionError:
        raise unreadable(paths) from None
    if problem := _manifest_problem(manifest):
        raise RunDirError(f"{paths.manifest} is corrupt: {problem} (slurmft writes a mapping with name, executor "
                          "and jobs, each job with its kind and job_id)")
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    """What keeps ``manifest`` from being one :func:`new_manifest` and :func:`record_job` wrote (None: nothing), so a
    hand-edited or foreign manifest.json is said once here instead of failing as a KeyError in whichever command
    reads it."""
    if not isinstance(manifest, dict):
        return f"it holds {json.dumps(manifest)[:40]}, not a mapping"
    for key in ("name", "executor"):
        if not isinstance(manifest.get(key), str):
            return f"{key!r} is missing or not a string"
    jobs = manifest.get("jobs")
    if not isinstance(jobs, list):
        return "'jobs' is missing or not a list"
    for i, job in enumerate(jobs):
        if not (isinstance(job, dict) and isinstance(job.get("kind"), str)
                and isinstance(job.get("job_id"), (str, int))):
            return f"jobs[{i}] is not a job (a mapping with kind and job_id)"
    return None


def no_manifest(root: Path, aside: str) -> RunDirError:
    """Why ``root``, a directory without ``manifest.json``, is no run directory (``aside``: what else the user may
    mean). A sweep's directory is said to be one, with its points' directories, which the command takes."""
    if is_sweep_dir(root):
        try:
            names = [str(p["name"]) for p in read_sweep_record(SweepPaths(root)).get("points", [])]
        except (RunDirError, KeyError, TypeError):
            names = []
        points = f" ({', '.join(names)})" if names else ""
        return RunDirError(f"{root} is a sweep directory (sweep.json), not a run directory: this command takes one "
                           f"point's directory, {root}/POINT{points}")
    try:
        runs = [c.name for c in sorted(root.iterdir()) if RunPaths.of(c).manifest.is_file()]
    except OSError:  # a directory we may not list: no runs to name
        runs = []
    held = (f"; it holds run directories ({', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}): "
            f"`slurmft runs {root}` lists them; give one (e.g. {root / runs[0]})") if runs else ""
    return RunDirError(f"{root} has no manifest.json: it is not a slurmft run directory ({aside}){held}")


def unreadable(paths: RunPaths) -> RunDirError:
    """The error for a run directory we may not read (a teammate's run written with umask 077, or 022 outside the
    team's group), with whose it is and the fix."""
    me = current_user()
    try:
        st = paths.root.stat()
        whose, mode, group = User.of_uid(st.st_uid), f"{stat.S_IMODE(st.st_mode):04o}", f", group {_group(st.st_gid)}"
    except OSError:
        whose, mode, group = None, "?", ""
    owner = whose.name if whose else "its owner"
    return RunDirError(
        f"you ({me.name}) may not read {paths.root} (mode {mode}, {owner}'s{group}): status, resume, cancel and the "
        "other commands read its manifest", [
            f"{owner} can let the team in: chgrp -R TEAM {paths.root} && chmod -R g+rwX {paths.root} (TEAM: a group "
            "you are in)",
            "runs submitted with umask 002 in a setgid team directory are readable and writable by the team from the "
            "start (docs/watching.md, 'A run directory that a team shares')"])


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:  # a gid without a group entry here (another site's NSS)
        return f"id {gid}"


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
    """Append one job (prepare, train or consolidate) to the manifest and return its entry, with who submitted it
    (``submitter``: this process's real uid and name; a teammate's ``resume --force`` submits under the teammate's
    uid, and under ``PrivateData=jobs`` the run's owner cannot see that job: :func:`job_submitter`)."""
    same = [j for j in manifest["jobs"] if j["kind"] == kind]
    if extra.get("task"):  # a later task of a local prepare array (slurmft/submit/arrays.py): the array's attempt
        attempt = same[-1]["attempt"] if same else 1
    else:  # an array run here counts once (its task 0), as a Slurm array's one entry does
        attempt = 1 + sum(1 for j in same if not j.get("task"))
    entry = {"kind": kind, "job_id": str(job_id), "attempt": attempt, "submitted": time.time(),
             "submitter": current_user().record(), **extra}
    manifest["jobs"].append(entry)
    return entry


def array_tasks(manifest: dict[str, Any], job: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded tasks of the local prepare array ``job`` is a task of, task 0 first (slurmft/submit/arrays.py
    records each task as a job of its own, ``task=k, tasks=N``, one after another; a later one is recorded once the
    one before has ended), or ``[job]`` for any other job (a Slurm array is one entry already)."""
    if "task" not in job:
        return [job]
    same = [j for j in manifest.get("jobs", []) if j["kind"] == job["kind"]]
    at = next(i for i, j in enumerate(same) if j is job or j["job_id"] == job["job_id"])
    first = at - int(job["task"])
    tasks = same[first:at + 1]
    for j in same[at + 1:]:  # tasks recorded after ``job`` (it may be an older task of the array)
        if j.get("task") != len(tasks) or j.get("tasks") != job.get("tasks"):
            break
        tasks.append(j)
    return tasks


def latest_jobs(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The newest job of each kind."""
    out: dict[str, dict[str, Any]] = {}
    for job in manifest.get("jobs", []):
        out[job["kind"]] = job
    return out


@dataclass(frozen=True)
class User:
    """A Unix user: the uid decides, the name is for messages."""

    uid: int
    name: str

    def record(self) -> dict[str, Any]:
        return {"uid": self.uid, "user": self.name}

    @classmethod
    def of_uid(cls, uid: int) -> User:
        try:
            return cls(uid, pwd.getpwuid(uid).pw_name)
        except KeyError:  # a uid without a passwd entry here (another site's NSS)
            return cls(uid, f"uid {uid}")


def current_user() -> User:
    """Who runs this command: the real uid (``$USER``/``$LOGNAME`` are whatever the environment says)."""
    return User.of_uid(os.getuid())


def run_owner(paths: RunPaths, manifest: dict[str, Any]) -> User:
    """Who owns the run: the manifest's ``owner``; for a manifest written before it was recorded, the
    owner of ``manifest.json`` itself."""
    owner = manifest.get("owner")
    if isinstance(owner, dict) and isinstance(owner.get("uid"), int):
        return User(owner["uid"], str(owner.get("user") or f"uid {owner['uid']}"))
    try:
        return User.of_uid(paths.manifest.stat().st_uid)
    except OSError:
        return current_user()


def job_submitter(job: dict[str, Any], owner: User) -> User:
    """Who submitted a job of the manifest: its ``submitter``; for an entry written before that was recorded (or a
    tagged job a killed submit never recorded, adopted later), the run's owner."""
    who = job.get("submitter")
    if isinstance(who, dict) and isinstance(who.get("uid"), int):
        return User(who["uid"], str(who.get("user") or f"uid {who['uid']}"))
    return owner


def check_owner(paths: RunPaths, manifest: dict[str, Any], what: str, force: bool) -> None:
    """Refuse to ``what`` (cancel, resume) another user's run unless ``force``."""
    owner, me = run_owner(paths, manifest), current_user()
    if owner.uid == me.uid or force:
        return
    raise RunDirError(f"{paths.root} is {owner.name}'s run (uid {owner.uid}), not yours ({me.name}): refusing to "
                      f"{what} it; ask {owner.name}, or pass --force if you look after it together")


def this_host() -> str:
    return socket.gethostname()


def process_record(pid: int) -> dict[str, Any]:
    """What the manifest records of a process started here: its pid, this host, and its start time (so a
    later pid reuse is not taken for it)."""
    record: dict[str, Any] = {"pid": pid, "host": this_host()}
    started = locks.process_start(pid)
    if started is not None:
        record["pid_start"] = started
    return record


def process_here(job: dict[str, Any]) -> tuple[bool | None, str]:
    """(alive, host) of a job entry recorded with a pid: True/False on the host that started it, None on
    another host (its processes cannot be seen from here). A manifest entry without ``host`` (written
    before hosts were recorded) counts as this host's, as it always did."""
    host = str(job.get("host") or this_host())
    if host != this_host():
        return None, host
    return locks.pid_alive(int(job["pid"]), job.get("pid_start")), host


pid_alive = locks.pid_alive


def acquire_lock(paths: RunPaths, what: str, say: Callable[[str], None] | None = None,
                 wait_s: float = 0.0) -> None:
    """Take the run's lock, ``.submit.lock`` (one writer of the run directory at a time; see
    :mod:`slurmft.locks` for what it guarantees on which file system). A lock left by a dead process is
    cleared with a message; one held by a live process is waited for up to ``wait_s``, then refused with its
    owner and how to clear it."""
    locks.acquire(paths.lock, what, say, wait_s=wait_s, holder=f"{paths.root}")


def release_lock(paths: RunPaths) -> None:
    """Drop the lock taken by :func:`acquire_lock` in this process."""
    locks.release(paths.lock)


#: Seconds a command that changes a run directory (consolidate, prepare, cancel) waits for another one holding the
#: run's lock before it refuses.
COMMAND_LOCK_WAIT_S = 60.0


@contextlib.contextmanager
def locked(paths: RunPaths, what: str, say: Callable[[str], None] | None = None,
           check: Callable[[], None] | None = None) -> Iterator[dict[str, Any]]:
    """The run's lock held for ``what`` (another command holding it is waited for up to
    :data:`COMMAND_LOCK_WAIT_S`), ``check`` run under it (a command's refusal while a job it would disturb may still
    run), and the manifest as it is then: what a command that adds to the manifest changes, before the lock is
    released."""
    with locks.held(paths.lock, what, say, wait_s=COMMAND_LOCK_WAIT_S):
        if check is not None:
            check()
        yield read_manifest(paths)


def sweep_root(run_dir: str | os.PathLike[str]) -> Path | None:
    """The sweep directory ``run_dir`` is, or is a point of (its parent holds sweep.json); None for a run alone."""
    path = Path(run_dir).resolve()
    return next((p for p in (path, path.parent) if is_sweep_dir(p)), None)


@contextlib.contextmanager
def sweep_locked(run_dir: str | os.PathLike[str], what: str, say: Callable[[str], None] | None = None,
                 wait_s: float | None = None) -> Iterator[None]:
    """The lock of the sweep ``run_dir`` is or belongs to (the sweep directory's ``.submit.lock``, which its
    ``submit`` holds), for the block: ``resume SWEEP_DIR`` and ``resume POINT_DIR`` (``consolidate`` too) decide and
    submit one at a time, so two of them never both submit for one point, and sweep.json is read and written by one.
    Taken before a point's own lock (always in this order: no two commands wait on each other); another holder is
    waited for up to ``wait_s`` (default :data:`COMMAND_LOCK_WAIT_S`). Nothing for a run alone, nor when this process holds it already (a sweep's resume
    resumes its points)."""
    root = sweep_root(run_dir)
    paths = RunPaths.of(root) if root is not None else None
    if paths is None or locks.holds(paths.lock):
        yield
        return
    with locks.held(paths.lock, what, say, wait_s=COMMAND_LOCK_WAIT_S if wait_s is None else wait_s):
        yield


@contextlib.contextmanager
def recorded_here(paths: RunPaths, kind: str, say: Callable[[str], None] | None = None,
                  check: Callable[[], None] | None = None, **fields: Any) -> Iterator[dict[str, Any]]:
    """A job of ``kind`` run in this process (``slurmft consolidate --here``, ``slurmft prepare --here``), in the
    manifest as ``here-PID-TIME`` with the process's record and ``fields``: written under the run's lock (after
    ``check``, also under it), then its end, COMPLETED or FAILED (an exception, re-raised), and its seconds, written
    under the lock again into the manifest as it is then. Yields the entry."""
    with locked(paths, kind, say, check) as manifest:
        entry = record_job(manifest, kind, f"here-{os.getpid()}-{int(time.time())}", here=True,
                           **process_record(os.getpid()), **fields)
        write_manifest(paths, manifest)
    t0 = time.time()
    try:
        yield entry
        entry["state"] = "COMPLETED"
    except BaseException:
        entry["state"] = "FAILED"
        raise
    finally:
        entry["elapsed_s"] = round(time.time() - t0, 1)
        with locked(paths, kind) as manifest:
            for job in manifest["jobs"]:
                if job["job_id"] == entry["job_id"]:
                    job.update(entry)
            write_manifest(paths, manifest)
