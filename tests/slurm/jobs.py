"""Helpers for tests that watch real Slurm jobs of this machine's two-node cluster: their metrics, their
checkpoints and their rank processes."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path


def metrics(run: Path) -> list[dict]:
    """Every training-step record of a run's metrics.jsonl (none yet: []); the save lines apart: :func:`saves`."""
    return [m for m in _lines(run) if m.get("event") != "save"]


def saves(run: Path) -> list[dict]:
    """The save records of a run's metrics.jsonl (step, mode, blocked_s, durable_s, bytes)."""
    return [m for m in _lines(run) if m.get("event") == "save"]


def _lines(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(what: str, predicate, timeout: float = 240, poll: float = 0.2):  # noqa: ANN001, ANN201
    """Poll ``predicate`` until it returns something true (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def complete(run: Path, step: int) -> bool:
    """checkpoint-<step> of the run has its COMPLETE marker."""
    return (run / "checkpoints" / f"checkpoint-{step}" / "COMPLETE").is_file()


def rank_pids(job_id: str) -> dict[int, int]:
    """{rank: pid} of a Slurm job's rank processes on this machine (both test nodes are here): the
    processes ``srun`` started (``python -m slurmft.job.launch``) in the job's first step."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0")
                           if b"=" in item)
        except OSError:
            continue
        if (b"slurmft.job.launch" in cmdline and environ.get(b"SLURM_JOB_ID") == job_id.encode()
                and environ.get(b"SLURM_STEP_ID") == b"0" and environ.get(b"SLURM_PROCID", b"").isdigit()):
            found[int(environ[b"SLURM_PROCID"])] = int(entry.name)
    return found


def rank_pid(job_id: str, rank: int) -> int | None:
    """PID of one rank's Python process of a Slurm job running on this machine (None: not there yet)."""
    return rank_pids(job_id).get(rank)


def signal_rank_steps(job: str) -> None:
    """What Slurm does at `--signal=USR2@lead` (no B:): the warning signal to every rank, not the batch shell."""
    subprocess.run(["scancel", "--signal=USR2", job], check=True)


def restarts(job: str) -> int:
    """The job's restart count (``Restarts=`` of ``scontrol show job``)."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return int(out.split("Restarts=")[1].split()[0])


def started_here(args: list[str]) -> dict[str, str]:
    """Run ``slurmft ARGS`` in-process, from a fixture wider than one test (it has no capsys); the jobs it started."""
    import contextlib
    import io

    from slurmft.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main(args)
        except SystemExit as exc:
            assert not exc.code, buf.getvalue()
    return started_jobs(buf.getvalue())


def started_jobs(out: str) -> dict[str, str]:
    """{kind: job id} from what submit, resume or prepare printed (``train job: 12``, ``consolidation job: 13``: each
    kind's name, slurmft.submit.console.JOB_NAMES; a sweep's array: ``train jobs: array 12 (4 points, 2 at a time)``)."""
    from slurmft.submit.console import JOB_NAMES

    kinds = {name: kind for kind, name in JOB_NAMES.items()}  # ``consolidation job: 13`` is the consolidate job
    arrays = (re.match(r"(\S+) jobs: array (\S+) \(", line) for line in out.splitlines())
    return {**{kinds.get(name, name): job for name, job in (line.split(" job: ") for line in out.splitlines()
                                                             if " job: " in line)},
            **{m.group(1): m.group(2) for m in arrays if m}}


def sacct_fields(job_ids: list[str], fields: str) -> dict[str, list[str]]:
    """{job id: [field values]} of ``sacct -X`` for ``fields`` (comma-separated, as ``-o`` takes them)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), "-o", f"JobID,{fields}"],
                         capture_output=True, text=True, check=True).stdout
    return {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines() if line.strip()}


def file_digests(directory: Path) -> dict[str, tuple[int, int, str]]:
    """{name: (size, mtime_ns, sha256)} of every file in ``directory``: unchanged means neither rewritten nor touched."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.iterdir())}


def preempted_beside_uninterrupted(slurmft, slurm_cluster, tmp_path: Path, model: Path, data: Path,  # noqa: ANN001
                                   cluster: dict | None = None, **sections: dict) -> tuple[Path, Path, dict[str, str]]:
    """Submit the same run twice (``sections`` of the config, 2 ranks on one node each, side by side), give one
    the warning signal after its step 2 and wait until it was requeued, then both trained and consolidated.
    ``cluster``: the preempted run's own cluster section (its ranks in an image: one run serves two tests).
    Returns (the preempted run, the uninterrupted run, the preempted run's jobs); the preempted one logged every
    step exactly once, in two attempts."""
    runs = {}
    for name in ("uninterrupted", "preempted"):
        (tmp_path / name).mkdir()
        own = {"cluster": cluster} if name == "preempted" and cluster else {}
        path = slurmft.write_config(tmp_path / name, model, data, **sections, **own)
        runs[name] = (tmp_path / name / "run", slurmft.submit(path))
    run, jobs = runs["preempted"]
    job = jobs["train"]
    wait_for("step 2", lambda: any(m["step"] >= 2 for m in metrics(run)))
    signal_rank_steps(job)
    wait_for("restart 1", lambda: restarts(job) >= 1, timeout=120)
    for _, started in runs.values():
        slurm_cluster.wait_state(started["train"], "COMPLETED", timeout=400)
        slurm_cluster.wait_state(started["consolidate"], "COMPLETED", timeout=240)
    steps = metrics(run)
    assert sorted(m["step"] for m in steps) == list(range(1, sections["train"]["max_steps"] + 1))
    assert {m["restart"] for m in steps} == {0, 1}  # the preemption happened between two steps it logged
    return run, runs["uninterrupted"][0], jobs
