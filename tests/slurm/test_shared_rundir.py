"""A run directory a team shares, on the real cluster, with a second Unix user (issue 29).

User A is the test process (root, as CI runs); user B, ``slurmft-teammate`` in group ``slurmft-team``, is
created here (useradd; munge authenticates any local user) and removed at the end. B's commands run as a
real other uid: ``setpriv --reuid/--regid --init-groups`` in a private mount namespace whose /root is an
empty 0755 tmpfs with only the Python installation bound back in at its own path (the interpreter lives
under /root/.pyenv here, and /root is 0700): B sees none of A's files but those the run directory's
permissions give the group. A's run lives in a setgid group directory and is submitted with umask 002.

One run serves the first test (B's view of a live run, then two resumes at once on the dead run); the
second test starts a second cluster instance with ``PrivateData=jobs`` (cluster.sh's knob) where B cannot
see A's jobs at all, then stops its slurmdbd too.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, second_cluster
from tests.slurm.conftest import IN_ALLOCATION
from tests.slurm.jobs import started_jobs

pytestmark = pytest.mark.slurm

USER, GROUP = "slurmft-teammate", "slurmft-team"
#: Runs B's command with B's uid and groups; "$1" is a mount point outside /root for the bind, then the command.
AS_TEAMMATE = ('mount --bind "$PYROOT" "$1" && mount -t tmpfs -o mode=755 slurmft-teammate /root '
               '&& mkdir -p "$PYROOT" && mount --bind "$1" "$PYROOT" && shift '
               f'&& exec setpriv --reuid={USER} --regid={GROUP} --init-groups "$@"')


@dataclass
class Teammate:
    """User B: run ``slurmft ARGS`` as them."""

    uid: int
    gid: int
    mnt: Path
    home: Path

    def slurmft(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOME": str(self.home), "USER": "root", "LOGNAME": "root",  # $USER lies on purpose
               "PYTHONPATH": str(REPO_ROOT), "PYROOT": _python_root()}
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", AS_TEAMMATE, "as-teammate",
                               str(self.mnt), sys.executable, "-m", "slurmft.cli", *args],
                              env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _python_root() -> str:
    """The directory of this Python's installation that B must reach (pyenv's, under /root here)."""
    prefix = Path(sys.base_prefix).resolve()
    return str(prefix.parent.parent) if prefix.parent.name == "versions" else str(prefix)


def _remove_user() -> None:
    subprocess.run(["userdel", USER], capture_output=True, check=False)
    subprocess.run(["groupdel", GROUP], capture_output=True, check=False)


@pytest.fixture(scope="module")
def teammate() -> Iterator[Teammate]:
    _remove_user()  # left by an interrupted earlier run: start clean
    subprocess.run(["groupadd", GROUP], check=True, capture_output=True)
    subprocess.run(["useradd", "-M", "-N", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", "-g", GROUP, USER],
                   check=True, capture_output=True)
    base = Path(tempfile.mkdtemp(prefix="slurmft-teammate-", dir="/tmp"))
    base.chmod(0o755)
    (base / "mnt").mkdir()
    home = base / "home"
    home.mkdir()
    try:
        entry = pwd.getpwnam(USER)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        yield Teammate(entry.pw_uid, entry.pw_gid, base / "mnt", home)
    finally:
        _remove_user()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def team_dir(teammate: Teammate) -> Iterator[Path]:
    """A group directory of the team: setgid, group-writable; not under pytest's 0700 tmp."""
    d = Path(tempfile.mkdtemp(prefix="slurmft-team-", dir="/tmp"))
    os.chown(d, -1, teammate.gid)
    d.chmod(0o2775)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _submit_as_a(slurmft, tmp_path: Path, tiny_model: Path, chat_data: Path, run: Path) -> dict[str, str]:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, train={"max_steps": 400},
                                prepare=IN_ALLOCATION)  # who may see and resume a run: no data preparation in it
    old = os.umask(0o002)
    try:
        return slurmft.submit(path, f"output_dir={run}")
    finally:
        os.umask(old)


def _tagged(slurm_cluster, run: Path) -> set[str]:
    """Every job (any user, as root sees them) tagged with this run."""
    from slurmft.rundir import RunPaths

    out = slurm_cluster.slurm("squeue", "-h", "-a", "-t", "all", "-O", "JobID:20,Comment:40")
    return {line.split()[0] for line in out.splitlines() if RunPaths.of(run).job_tag in line}


def _json_status(result: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    assert result.returncode == 0, result.stdout + result.stderr
    return {row["kind"]: row for row in json.loads(result.stdout)["jobs"]}


def test_a_teammate_sees_a_shared_run_cannot_resume_it_and_two_resumes_submit_one_job(
        slurm_cluster, teammate: Teammate, team_dir: Path, tmp_path: Path, tiny_model: Path, chat_data: Path,
        slurmft) -> None:
    run = team_dir / "run"
    first = _submit_as_a(slurmft, tmp_path, tiny_model, chat_data, run)
    team = grp.getgrnam(GROUP).gr_gid
    for path, mode in ((run, 0o2775), (run / "manifest.json", 0o664), (run / "config.yaml", 0o664),
                       (run / "scripts" / "train.sbatch", 0o775)):
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, team), path
    assert json.loads((run / "manifest.json").read_text())["owner"] == {"uid": 0, "user": "root"}
    slurm_cluster.wait_state(first["train"], "RUNNING", timeout=120)

    # B: status (A's jobs asked for by uid, whatever $USER says), runs, logs, report
    rows = _json_status(teammate.slurmft("status", str(run), "--json"))
    assert rows["train"]["state"] == "RUNNING" and rows["train"]["job_id"] == first["train"]
    runs = teammate.slurmft("runs", str(team_dir))
    assert runs.returncode == 0 and "training" in runs.stdout, runs.stdout + runs.stderr
    deadline = time.monotonic() + 60
    while not list((run / "logs").glob("train-*.out")) and time.monotonic() < deadline:
        time.sleep(0.5)
    logs = teammate.slurmft("logs", str(run), "--lines", "5")
    assert logs.returncode == 0, logs.stderr
    report = teammate.slurmft("report", str(run))
    assert report.returncode == 0 and (run / "report.md").stat().st_uid == teammate.uid, report.stderr

    # B's resume and cancel are refused with A's name, and submit or cancel nothing
    before = _tagged(slurm_cluster, run)
    for command in ("resume", "cancel"):
        refused = teammate.slurmft(command, str(run))
        assert refused.returncode == 2 and "is root's run (uid 0)" in refused.stderr and "--force" in refused.stderr
    forced = teammate.slurmft("resume", str(run), "--force")  # forced: the train job is live, B sees it
    assert forced.returncode == 2 and "is live" in forced.stderr, forced.stderr
    assert _tagged(slurm_cluster, run) == before
    assert slurm_cluster.squeue_state(first["train"]) == "RUNNING"

    # A cancels; two resumes at once on the dead run: exactly one new train job, every id in the manifest
    code, _, err = slurmft.cli(["cancel", str(run)])
    assert code == 0, err
    slurm_cluster.wait_state(first["train"], "CANCELLED", timeout=60)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    resumes = [subprocess.Popen([sys.executable, "-m", "slurmft.cli", "resume", str(run)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [(p.wait(timeout=240), *p.communicate()) for p in resumes]
    assert sorted(code for code, _, _ in outs) == [0, 2], outs
    refused = next(err for code, _, err in outs if code == 2)
    assert "is live" in refused and "nothing submitted" in refused, refused
    manifest = json.loads((run / "manifest.json").read_text())
    trains = [j["job_id"] for j in manifest["jobs"] if j["kind"] == "train"]
    assert len(trains) == 2 and trains[0] == first["train"]
    assert {j["job_id"] for j in manifest["jobs"]} == _tagged(slurm_cluster, run)  # every job recorded
    assert len([a for a in manifest["attempts"] if a["how"] == "resume"]) == 1
    code, _, err = slurmft.cli(["cancel", str(run)])
    assert code == 0, err


def test_a_teammate_who_may_not_read_or_write_the_run_gets_words_not_a_traceback(
        teammate: Teammate, team_dir: Path) -> None:
    """Issue 47, defect 7: A's run in the team's directory, submitted with umask 077 (the team may not read its
    manifest, or not even look in), then with 022 (the team may read, not write), and A's lock left unreadable. No
    Slurm is asked: every command stops at the run directory, in words, with the fix."""
    from slurmft.rundir import RunPaths, new_manifest, write_manifest

    run = RunPaths.of(team_dir / "run")
    run.root.mkdir()  # made by the team (2775, its group): A's umask 077 then writes a manifest only A may read
    write_manifest(run, new_manifest("it", "slurm", run.run_id))
    commands = (["status"], ["resume", "--force"], ["cancel", "--force"], ["prepare", "--force"], ["consolidate"],
                ["logs"])
    for mode, manifest_mode in ((0o2775, 0o600), (0o2700, 0o600)):
        run.root.chmod(mode)
        run.manifest.chmod(manifest_mode)
        for args in commands:
            result = teammate.slurmft(args[0], str(run.root), *args[1:])
            assert result.returncode == 2 and "Traceback" not in result.stderr, (oct(mode), args, result.stderr)
            assert f"may not read {run.root} (mode {mode:04o}, root's, group slurmft-team)" in result.stderr, (
                oct(mode), args, result.stderr)
            assert "chmod -R g+rwX" in result.stderr and "umask 002" in result.stderr
        report = teammate.slurmft("report", str(run.root))  # the report says what it could not read, where it may
        assert "Traceback" not in report.stderr, report.stderr
        if mode == 0o2775:
            assert report.returncode == 0 and f"may not read {run.root}" in (run.root / "report.md").read_text()
        else:
            assert report.returncode == 2 and f"may not read {run.root}" in report.stderr, report.stderr
    run.root.chmod(0o2775)
    run.manifest.chmod(0o664)
    run.lock.write_text(json.dumps({"host": "login-9", "pid": 4242, "what": "resume"}))  # A's, under umask 077
    run.lock.chmod(0o600)
    for args in (["resume", "--force"], ["cancel", "--force"]):
        result = teammate.slurmft(args[0], str(run.root), *args[1:])
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
        assert "is locked" in result.stderr and "may not read who holds it" in result.stderr, (args, result.stderr)
    run.lock.unlink()
    run.root.chmod(0o2755)  # umask 022: the team reads, and may not take the lock (a file in the run directory)
    for args in (["resume", "--force"], ["cancel", "--force"]):
        result = teammate.slurmft(args[0], str(run.root), *args[1:])
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
        assert "you need write access to the run directory" in result.stderr, (args, result.stderr)


def _submit_as_b(slurmft, teammate: Teammate, team_dir: Path, model: Path, data: Path) -> tuple[Path, dict[str, str]]:  # noqa: ANN001
    """B submits a run of their own (its model and data copied where B may read them), with umask 002. B's job
    itself cannot start Python: the interpreter lives under /root (0700), which only B's commands get bound in
    (AS_TEAMMATE); so it fails at once: a run whose train job died, for A to resume."""
    inputs = team_dir / "inputs"
    shutil.copytree(model, inputs / "model")
    shutil.copyfile(data, inputs / data.name)
    (team_dir / "b").mkdir()
    (team_dir / "b").chmod(0o2775)
    path = slurmft.write_config(team_dir / "b", inputs / "model", inputs / data.name, train={"max_steps": 400},
                                prepare=IN_ALLOCATION)  # a train job that dies at start: no data preparation
    old = os.umask(0o002)
    try:
        submitted = teammate.slurmft("submit", str(path), timeout=240)
    finally:
        os.umask(old)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return team_dir / "b" / "run", started_jobs(submitted.stdout)


@pytest.fixture
def private_cluster(slurm_cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A second cluster (own directory, port +200) with PrivateData=jobs; its directory. SLURM_CONF points there."""
    with second_cluster("private", 200, {"SLURMFT_CLUSTER_PRIVATE_DATA": "jobs"}) as base:
        monkeypatch.setenv("SLURM_CONF", str(base / "cluster" / "etc" / "slurm.conf"))
        yield base / "cluster"


def test_a_teammate_who_cannot_see_the_jobs_cannot_tell_and_submits_nothing(
        private_cluster: Path, slurm_cluster, teammate: Teammate, team_dir: Path, tmp_path: Path,
        tiny_model: Path, chat_data: Path, slurmft) -> None:
    run = team_dir / "run"
    first = _submit_as_a(slurmft, tmp_path, tiny_model, chat_data, run)
    squeue_as_root = ["squeue", "-h", "-a", "-t", "all", "-o", "%A"]
    jobs = set(subprocess.run(squeue_as_root, capture_output=True, text=True, check=True).stdout.split())
    assert jobs == set(first.values())
    try:
        for dbd in ("up", "stopped"):
            rows = _json_status(teammate.slurmft("status", str(run), "--json"))
            assert rows["train"]["state"] == "HIDDEN" and "PrivateData=jobs" in rows["train"]["words"], (dbd, rows)
            refused = teammate.slurmft("resume", str(run))
            assert refused.returncode == 2 and "root's run" in refused.stderr, refused.stderr
            forced = teammate.slurmft("resume", str(run), "--force")
            assert forced.returncode == 2 and "cannot tell whether" in forced.stderr, (dbd, forced.stderr)
            assert "nothing is submitted" in forced.stderr
            after = set(subprocess.run(squeue_as_root, capture_output=True, text=True, check=True).stdout.split())
            assert after == jobs, dbd  # nothing submitted
            if dbd == "up":  # then slurmdbd goes down: still nothing B can see, still nothing submitted
                pid = int((private_cluster / "run" / "slurmdbd.pid").read_text().strip())
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 20
                while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert not Path(f"/proc/{pid}").exists()
        own = slurmft.status_json(run)  # A, slurmdbd down: squeue still shows A its own job as live
        assert own["train"]["state"] in ("PENDING", "RUNNING", "CONFIGURING"), own
        code, _, err = slurmft.cli(["cancel", str(run)])
        assert code == 0, err

        # issue 47, defects 1 and 2 (slurmdbd still down): B owns a run; its train job died; A, who looks after it
        # too, resumes it with --force, so the new train job is A's (root's here). B must see that job as alive:
        # B's resume and prepare refuse and submit nothing, and B's cancel names its owner.
        b_run, b_jobs = _submit_as_b(slurmft, teammate, team_dir, tiny_model, chat_data)
        slurm_cluster.wait_state(b_jobs["train"], "FAILED", timeout=120)  # B's own job cannot start Python (below)
        old = os.umask(0o002)
        try:
            code, out, err = slurmft.cli(["resume", str(b_run), "--force"])
        finally:
            os.umask(old)
        assert code == 0, err
        theirs = started_jobs(out)
        slurm_cluster.wait_state(theirs["train"], "RUNNING", timeout=120)
        before = set(subprocess.run(squeue_as_root, capture_output=True, text=True, check=True).stdout.split())
        for command in ("resume", "prepare"):  # consolidate asks the same once a checkpoint exists (test_resume.py)
            refused = teammate.slurmft(command, str(b_run))
            assert refused.returncode == 2 and "cannot tell whether" in refused.stderr, (command, refused.stdout,
                                                                                        refused.stderr)
            assert f"train job {theirs['train']}: cannot tell: root submitted it" in refused.stderr, refused.stderr
        after = set(subprocess.run(squeue_as_root, capture_output=True, text=True, check=True).stdout.split())
        assert after == before  # no second train job into the same checkpoints, no prepare job, no consolidation
        manifest = json.loads((b_run / "manifest.json").read_text())
        by_id = {j["job_id"]: j for j in manifest["jobs"]}
        assert by_id[b_jobs["train"]]["submitter"] == {"uid": teammate.uid, "user": USER}
        assert by_id[theirs["train"]]["submitter"] == {"uid": 0, "user": "root"}
        rows = {r["job_id"]: r for r in json.loads(teammate.slurmft("status", str(b_run), "--json").stdout)["jobs"]}
        assert rows[theirs["train"]]["state"] == "HIDDEN" and rows[b_jobs["train"]]["state"] == "FAILED", rows
        cancel = teammate.slurmft("cancel", str(b_run))
        assert cancel.returncode == 0, cancel.stderr
        assert f"not cancelled: train job {theirs['train']} is root's (submitted by root)" in cancel.stderr, cancel.stderr
        assert slurm_cluster.squeue_state(theirs["train"]) == "RUNNING"  # Slurm refused B: it is root's
    finally:
        slurmft.cli(["cancel", str(run)])
        if (team_dir / "b" / "run" / "manifest.json").is_file():
            slurmft.cli(["cancel", str(team_dir / "b" / "run"), "--force"])
