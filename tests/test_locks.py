"""slurmft.locks: the staleness rule, what each mount's flock gives, and the lock itself between processes,
on this machine's disk, with flock made to fail as Lustre's ``noflock`` fails (ENOSYS) or to succeed for
everyone as a node-local flock (``localflock``, NFS ``local_lock=flock``) does across two nodes. The
"nodes" are two processes in their own UTS namespaces (``unshare --uts``, hostnames n1 and n2); the flock
behaviour is injected by replacing ``fcntl.flock`` in those processes before slurmft runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmft import locks
from slurmft.errors import LockError
from slurmft.locks import Holder, judge, parse_holder, parse_mountinfo

REPO = Path(__file__).resolve().parent.parent


def _alive(pid: int, start: int | None) -> bool:
    return pid == 1


def test_judge_stale_locks_by_host() -> None:
    here = Holder("login1", 1)
    dead = Holder("login1", 99)
    other = Holder("login2", 99)
    assert judge(here, 0, 10_000, "login1", _alive, False) is None  # alive here, however old
    assert "no longer running" in judge(dead, 10_000, 10_000, "login1", _alive, False)
    assert judge(other, 9_500, 10_000, "login1", _alive, False) is None  # another host: heartbeat fresh
    assert "no heartbeat from login2" in judge(other, 9_000, 10_000, "login1", _alive, False)
    assert judge(other, 0, 10_000, "login1", _alive, True) is None  # a held flock proves it alive
    assert judge(dead, 10_000, 10_000, "login1", _alive, True) is None
    assert judge(None, 9_995, 10_000, "login1", _alive, False) is None  # creator still writing it
    assert "without a holder" in judge(None, 9_000, 10_000, "login1", _alive, False)


def test_holder_of_either_format() -> None:
    h = parse_holder(json.dumps({"host": "n1", "pid": 5, "pid_start": 7, "uid": 1001, "user": "ann", "t": 1.0,
                                 "what": "resume"}))
    assert h == Holder("n1", 5, 7, 1001, "ann", 1.0, "resume")
    assert h.words() == "ann (uid 1001), pid 5 on host n1 (resume)"
    assert parse_holder("login-node-7 pid=4242 t=0 submit\n") == Holder("login-node-7", 4242, what="submit")
    assert parse_holder("") is None and parse_holder("garbage") is None


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /lustre/proj rw,relatime - lustre 10.0.0.1@tcp:/proj rw,flock,lazystatfs
31 22 0:41 / /lustre/scratch rw - lustre 10.0.0.1@tcp:/scratch rw,localflock
32 22 0:42 / /lustre/old rw - lustre 10.0.0.1@tcp:/old rw,noflock
33 22 0:43 / /fsx rw - lustre 10.0.0.2@tcp:/fsx rw
40 22 0:50 / /home rw - nfs4 srv:/home rw,vers=4.2,local_lock=none
41 22 0:51 / /nfs/nolock rw - nfs srv:/x rw,vers=3,nolock
42 22 0:52 / /nfs/v2 rw - nfs srv:/y rw,vers=2
43 22 0:53 / /gpfs rw - gpfs gpfs0 rw
44 22 0:54 / /with\\040blank rw - tmpfs none rw
"""


@pytest.mark.parametrize(("path", "scope"), [
    ("/lustre/proj/runs/a", "cluster"), ("/lustre/scratch/a", "node"), ("/lustre/old/a", "none"),
    ("/fsx/a", "none"),  # Lustre's default is noflock
    ("/home/ann/runs", "cluster"), ("/nfs/nolock/a", "node"), ("/tmp/x", "host"), ("/gpfs/a", "unknown"),
    ("/with blank/a", "host"),
])
def test_flock_scope_of_each_mount(path: str, scope: str) -> None:
    assert locks.flock_scope(locks.mount_of(Path(path), parse_mountinfo(MOUNTINFO))) == scope


def test_nfs2_is_refused_with_the_reason() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert "NFS version 2" in locks.excl_problem(locks.mount_of(Path("/nfs/v2/run"), mounts))
    for ok in ("/lustre/old/a", "/nfs/nolock/a", "/home/ann", "/tmp"):
        assert locks.excl_problem(locks.mount_of(Path(ok), mounts)) is None
    assert "exclusive create" in locks.guarantee(Path("/tmp"))


def test_stale_lock_of_another_host_is_cleared_after_its_heartbeat_stops(tmp_path: Path) -> None:
    lock = tmp_path / ".submit.lock"
    lock.write_text("login-node-7 pid=4242 t=0 submit\n")
    with pytest.raises(LockError, match="pid 4242 on host login-node-7"):
        locks.acquire(lock, "resume")  # fresh heartbeat: held
    old = time.time() - locks.STALE_S - 60
    os.utime(lock, (old, old))
    said: list[str] = []
    locks.acquire(lock, "resume", said.append)
    try:
        assert "no heartbeat from login-node-7" in said[0]
        assert json.loads(lock.read_text())["host"] == socket.gethostname()
    finally:
        locks.release(lock)
    assert not lock.exists() and not list(tmp_path.iterdir())


def test_heartbeat_refreshes_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locks, "HEARTBEAT_S", 0.05)
    lock = tmp_path / "l"
    locks.acquire(lock, "test")
    try:
        os.utime(lock, (0, 0))
        deadline = time.time() + 5
        while lock.stat().st_mtime < 1 and time.time() < deadline:
            time.sleep(0.02)
        assert lock.stat().st_mtime > time.time() - 10
    finally:
        locks.release(lock)


def test_an_unwritable_directory_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(LockError, match="cannot take the lock .*No such file"):
        locks.acquire(tmp_path / "missing" / "l", "resume")


# ------------------------------------------------------------------ two "nodes"
NODE = """
import errno, fcntl, json, socket, sys, time
mode, lock, log, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode == "noflock":  # Lustre mounted noflock: flock fails
    def flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    fcntl.flock = flock
elif mode == "localflock":  # a node-local flock seen from two nodes: everyone gets it
    fcntl.flock = lambda fd, op: None
from pathlib import Path
from slurmft import locks
for _ in range(rounds):
    with locks.held(Path(lock), "consolidate", wait_s=60):
        t0 = time.time()
        time.sleep(0.3)
        with open(log, "a") as f:
            f.write(json.dumps([socket.gethostname(), t0, time.time()]) + "\\n")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --uts needs root (CI runs as root)")
@pytest.mark.parametrize("mode", ["noflock", "localflock"])
def test_two_consolidations_on_two_nodes_never_both_run(mode: str, tmp_path: Path) -> None:
    from slurmft.rundir import RunPaths

    lock, log = RunPaths.consolidate_lock(tmp_path / "model"), tmp_path / "held.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen(["unshare", "--uts", "sh", "-c", f'hostname {node} && exec "$0" "$@"', sys.executable,
                               "-c", NODE, mode, str(lock), str(log), "3"], env=env) for node in ("n1", "n2")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    spans = sorted(json.loads(line) for line in log.read_text().splitlines())
    assert {h for h, _, _ in spans} == {"n1", "n2"} and len(spans) == 6
    by_time = sorted(spans, key=lambda s: s[1])
    for (_, _, end), (_, start, _) in zip(by_time, by_time[1:], strict=False):
        assert start >= end, by_time  # never two holders at once
    assert not lock.exists()
