"""Locks that hold on the file systems run directories live on: local disks, NFS and Lustre.

Two locks guard a run directory: the run's lock (``.submit.lock``: submit, resume, consolidate, cancel
decide and write under it) and the consolidation lock (``.model.consolidate.lock``: one export into a
model directory at a time, taken by the consolidation job on a compute node or by ``consolidate --here``).

Why not ``flock`` alone: what ``flock`` means depends on how the file system is mounted, and the same file
system is often mounted differently on login and compute nodes. On Lustre, ``-o flock`` makes it coherent
across clients, ``-o localflock`` makes it node-local (two nodes both get the lock: two consolidations ran
at once, one cleaning up the other's output) and ``noflock`` (the default) fails with ENOSYS. On NFS,
``flock`` is emulated with byte-range locks (coherent through lockd/NFSv4) unless the mount has ``nolock``
or ``local_lock=flock|all`` (node-local). Two processes that use different mechanisms on one path do not
exclude each other, so every slurmft lock is one mechanism everywhere:

* **The lock is an ``O_EXCL``-created file** holding its owner (uid, user), host, pid (with the process's
  start time, so a reused pid is not taken for the holder) and what it is for. ``O_CREAT|O_EXCL`` is atomic
  on local file systems, on Lustre (the MDS creates the name) and on NFSv3/v4 (exclusive create); it is not
  on NFSv2, and a run directory there is refused (:func:`check_lockable`).
* **A heartbeat**: the holder touches the file every :data:`HEARTBEAT_S` s from a thread (``futimens`` on
  its own descriptor, so it never refreshes someone else's lock).
* **Staleness** (:func:`judge`, pure): a holder on this host is stale when its process is gone (pid and
  start time); a holder on another host, whose processes cannot be seen from here, only when its heartbeat
  is older than :data:`STALE_S` (10 min, far above clock skew and NFS attribute caching). A stale lock is
  broken with a message (renamed aside and checked to be the one judged, so two breakers cannot remove a
  fresh lock).
* **flock as evidence, never as the lock**: the holder also ``flock``s its file where the file system lets
  it; a waiter whose ``flock`` attempt finds it held knows the holder is alive whatever its heartbeat says.
  A successful ``flock`` proves nothing (node-local flock) and a failing one (ENOSYS) changes nothing.

What holds where is in docs/watching.md ("A run directory that a team shares"); :func:`guarantee` says it
for one path. Torch-free: the consolidation job takes its lock before torch is needed, and the login side
imports this.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from slurmft.errors import LockError

#: Seconds between two heartbeats of a held lock.
HEARTBEAT_S = 30.0
#: A lock held from another host whose heartbeat is older than this is stale.
STALE_S = 600.0
#: A lock file without a readable holder (its creator died between the create and the write) is stale
#: after this many seconds; the write follows the create at once.
UNREADABLE_S = 10.0
#: Local file systems: one host sees them, so flock and O_EXCL hold for every process that can reach them.
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "zfs", "overlay", "f2fs", "ramfs",
                      "reiserfs", "jfs", "vfat", "exfat"})


# ------------------------------------------------------------------ processes
def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, /proc/PID/stat field 22); None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """True when process ``pid`` exists on this host, is not a zombie and (``start`` given) is the process
    that started then, not a later one that reuses its pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # exited in between
        return False
    if fields[0] == "Z":
        return False
    return start is None or fields[19] == str(start)


# ------------------------------------------------------------------ mounts
@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where, which file system, and its mount and super options."""

    point: str
    fstype: str
    options: frozenset[str]


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts of ``/proc/self/mountinfo`` text (``... MOUNTPOINT OPTS [optional...] - FSTYPE SOURCE SUPER``)."""
    mounts = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            continue
        point = fields[4].encode().decode("unicode_escape")  # \040 for a blank
        opts = set(fields[5].split(",")) | set((rest[2] if len(rest) > 2 else "").split(","))
        mounts.append(Mount(point, rest[0], frozenset(o for o in opts if o)))
    return mounts


def mount_of(path: Path, mounts: list[Mount] | None = None) -> Mount | None:
    """The mount that holds ``path`` (the longest mount point above it; the last one mounted wins)."""
    if mounts is None:
        try:
            mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text(errors="replace"))
        except OSError:
            return None
    target = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts:
        inside = target == m.point or target.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def flock_scope(mount: Mount | None) -> str:
    """What ``flock`` gives on this mount: ``cluster`` (coherent across nodes), ``node`` (node-local: other
    nodes do not see it), ``none`` (fails), ``host`` (a local file system) or ``unknown``."""
    if mount is None:
        return "unknown"
    fs, opts = mount.fstype, mount.options
    if fs == "lustre":
        return "cluster" if "flock" in opts else "node" if "localflock" in opts else "none"
    if fs in ("nfs", "nfs4"):
        local = any(o in opts for o in ("nolock", "local_lock=flock", "local_lock=all"))
        return "node" if local else "cluster"
    if fs in LOCAL_FS:
        return "host"
    return "unknown"


def excl_problem(mount: Mount | None) -> str | None:
    """Why an ``O_EXCL`` create is not atomic on this mount (NFSv2), else None."""
    if mount and mount.fstype == "nfs" and ({"vers=2", "nfsvers=2"} & mount.options):
        return (f"{mount.point} is NFS version 2, where an exclusive create is not atomic: two slurmft commands "
                "could both take the lock. Mount it with NFSv3 or v4 (vers=3|4), or use another directory")
    return None


def guarantee(path: Path) -> str:
    """What the lock at ``path`` guarantees there, in words (``slurmft doctor`` and messages)."""
    mount = mount_of(path)
    problem = excl_problem(mount)
    if problem:
        return "no safe lock: " + problem
    where = f"{mount.fstype} at {mount.point}" if mount else "an unknown file system"
    flock = {"cluster": "flock is coherent across nodes too", "node": "flock is node-local here (not used)",
             "none": "flock does not work here (not needed)", "host": "a local disk (one host)",
             "unknown": "flock's reach unknown (not needed)"}[flock_scope(mount)]
    return (f"{where}: exclusive create with owner and heartbeat, one holder across every host that mounts it; "
            f"{flock}")


def check_lockable(directory: Path) -> None:
    """Refuse a directory where no lock can be taken safely, with the reason."""
    problem = excl_problem(mount_of(directory))
    if problem:
        raise LockError(f"cannot lock {directory} safely: {problem}")


# ------------------------------------------------------------------ the holder and the decision
@dataclass(frozen=True)
class Holder:
    """What a lock file says of the process that holds it."""

    host: str
    pid: int | None
    pid_start: int | None = None
    uid: int | None = None
    user: str = ""
    since: float | None = None
    what: str = ""

    def words(self) -> str:
        who = f"{self.user} (uid {self.uid}), " if self.user else ""
        doing = f" ({self.what})" if self.what else ""
        return f"{who}pid {self.pid} on host {self.host}{doing}"


def parse_holder(text: str) -> Holder | None:
    """The holder of a lock file's text: JSON, or the ``HOST pid=N t=T WHAT`` line of slurmft <= 0.3."""
    try:
        data = json.loads(text)
        return Holder(str(data["host"]), int(data["pid"]), data.get("pid_start"), data.get("uid"),
                      str(data.get("user", "")), data.get("t"), str(data.get("what", "")))
    except (ValueError, KeyError, TypeError):
        pass
    host, _, rest = text.strip().partition(" ")
    pid = next((int(w[4:]) for w in rest.split() if w.startswith("pid=") and w[4:].isdigit()), None)
    return Holder(host, pid, what=rest.split()[-1] if rest.split() else "") if host and pid is not None else None


def judge(holder: Holder | None, heartbeat: float, now: float, here: str, alive: Callable[[int, int | None], bool],
          flock_held: bool, stale_s: float = STALE_S) -> str | None:
    """Why the lock is stale (the reason, in words), or None while its holder may be alive.

    ``heartbeat``: the lock file's mtime; ``flock_held``: a flock attempt found the file locked (its holder
    is alive, whatever else)."""
    if flock_held:
        return None
    age = now - heartbeat
    if holder is None or holder.pid is None:
        return f"a lock without a holder, {age:.0f} s old" if age > UNREADABLE_S else None
    if holder.host == here:
        return None if alive(holder.pid, holder.pid_start) else f"pid {holder.pid} is no longer running on {here}"
    if age > stale_s:
        return f"no heartbeat from {holder.host} for {age:.0f} s (stale after {stale_s:.0f} s)"
    return None


# ------------------------------------------------------------------ taking and dropping it
@dataclass
class _Held:
    fd: int
    stop: threading.Event
    thread: threading.Thread


_HELD: dict[str, _Held] = {}


def _record(what: str) -> str:
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid {uid}"
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start(os.getpid()),
                       "uid": uid, "user": user, "t": time.time(), "what": what}) + "\n"


def _flock_held(path: Path) -> bool:
    """True only when another process demonstrably holds the file's flock (EWOULDBLOCK)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # ENOSYS (Lustre noflock), ENOLCK (NFS without lockd): no evidence either way
        return False
    finally:
        os.close(fd)
    return False


def _heartbeat(fd: int, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            os.utime(fd)


def _break(path: Path, seen: os.stat_result) -> bool:
    """Remove the stale lock ``seen`` at ``path``; False when it was replaced meanwhile (left in place)."""
    aside = path.with_name(f"{path.name}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True  # someone else broke it first
    now = os.stat(aside)
    if (now.st_ino, now.st_mtime_ns) == (seen.st_ino, seen.st_mtime_ns):
        aside.unlink(missing_ok=True)
        return True
    with contextlib.suppress(OSError):  # a fresh lock taken in between: put it back unless yet another exists
        os.link(aside, path)
    aside.unlink(missing_ok=True)
    return False


def acquire(path: Path, what: str, say: Callable[[str], None] | None = None, wait_s: float = 0.0,
            holder: str = "") -> None:
    """Take the lock at ``path`` (see the module docstring), waiting up to ``wait_s`` for a live holder;
    raise :class:`LockError` naming the holder and the fix, or why the directory cannot be locked."""
    check_lockable(path.parent)
    deadline = time.monotonic() + wait_s
    text = _record(what)
    target = holder or str(path.parent)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            try:
                seen, raw, held, stale = _look(path)
            except FileNotFoundError:
                continue  # released in between
            except PermissionError:  # a holder whose umask leaves its lock unreadable to us (077)
                raise LockError(f"{target} is locked ({path} exists, and you may not read who holds it); cannot "
                                f"{what} now: wait for it, or ask the run's owner (the team needs read access to "
                                "the run directory: umask 002)") from None
            if stale:
                if _break(path, seen) and say:
                    say(f"cleared a stale lock {path} ({stale})")
                continue
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            owner = held.words() if held else f"an unknown process ({raw.strip()[:80]!r})"
            fix = ("wait for it, or stop it, then retry" if held and held.host == socket.gethostname() else
                   f"wait for it; if no slurmft command runs there any more, the lock is cleared by itself "
                   f"{STALE_S / 60:.0f} min after its last heartbeat (or remove {path} and retry)")
            raise LockError(f"{target} is locked by {owner}; cannot {what} now: {fix}") from None
        except OSError as exc:
            raise LockError(f"cannot take the lock {path}: {exc.strerror or exc}"
                            + ("; you need write access to the run directory (its group, umask 002)"
                               if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else "")) from None
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
            with contextlib.suppress(OSError):  # evidence for waiters only; ENOSYS on Lustre noflock
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        stop = threading.Event()
        thread = threading.Thread(target=_heartbeat, args=(fd, stop), name=f"slurmft-lock-{path.name}", daemon=True)
        thread.start()
        _HELD[str(path)] = _Held(fd, stop, thread)
        return


def release(path: Path) -> None:
    """Drop the lock at ``path`` taken by :func:`acquire` in this process (nothing if it is not ours)."""
    held = _HELD.pop(str(path), None)
    if held is None:
        return
    held.stop.set()
    try:
        mine, there = os.fstat(held.fd), os.stat(path)
        if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
            path.unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        os.close(held.fd)


def live_holder(path: Path) -> Holder | None:
    """Who holds the lock at ``path`` while they may still be alive (:func:`judge`), without taking it: None when it
    is free or stale. For a command that only reads (``status`` of a local sweep whose ``submit`` still runs its
    points one after another); a lock we may not read, or one whose holder it does not name yet, counts as held."""
    try:
        _, _, holder, stale = _look(path)
    except FileNotFoundError:
        return None
    except OSError:
        return Holder("", None)
    return None if stale else holder or Holder("", None)


def _look(path: Path) -> tuple[os.stat_result, str, Holder | None, str | None]:
    """The lock file's stat and text, its holder, and why it is stale (None: the holder may be alive); an OSError
    (gone, unreadable) passes through."""
    seen, raw = os.stat(path), path.read_text(errors="replace")
    holder = parse_holder(raw)
    return seen, raw, holder, judge(holder, seen.st_mtime, time.time(), socket.gethostname(), pid_alive,
                                    _flock_held(path))


def holds(path: Path) -> bool:
    """This process holds the lock at ``path``."""
    return str(path) in _HELD


@contextlib.contextmanager
def held(path: Path, what: str, say: Callable[[str], None] | None = None, wait_s: float = 0.0) -> Iterator[None]:
    """``with held(path, what):`` the lock for the block."""
    acquire(path, what, say, wait_s)
    try:
        yield
    finally:
        release(path)

