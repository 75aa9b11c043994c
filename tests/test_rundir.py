"""slurmft.rundir.RunPaths: every name inside a run directory, written once and read back the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import cli

from slurmft.rundir import RunPaths
from slurmft.watch.runs import SKIP


def test_requeue_marker_name_round_trips(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    marker = paths.requeue_marker("4242", 3)
    assert marker.parent == paths.requeue_marker_dir
    assert RunPaths.requeue_marker_key(marker.name) == ("4242", 3)
    assert RunPaths.requeue_marker_key("local-123-0") == ("local-123", 0)  # a job id may hold a dash
    for bad in (".4242-3.tmp", "4242", "4242-x", "-3"):
        assert RunPaths.requeue_marker_key(bad) is None, bad


def test_runs_skips_every_folder_slurmft_makes(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path)
    made = {paths.scripts, paths.logs, paths.submitit, paths.checkpoints, paths.model, paths.adapter,
            paths.requeue_marker_dir,
            paths.fsdp_report, paths.tensorboard, paths.wandb, paths.prepared}
    assert {p.parent for p in made} == {paths.root}
    assert {p.name for p in made} == paths.folders <= SKIP
    assert {paths.report.parent, paths.loss_plot.parent, paths.tracker.parent} == {paths.root}


# ------------------------------------------------------------------ files a team can read
def test_atomic_write_follows_the_umask_and_the_directory_group(tmp_path: Path) -> None:
    import grp
    import os
    import stat

    from slurmft.rundir import atomic_write, umask

    group = grp.getgrnam("nogroup").gr_gid if os.geteuid() == 0 else os.getgid()
    shared = tmp_path / "team"
    shared.mkdir()
    os.chown(shared, -1, group)
    shared.chmod(0o2775)  # a group directory, setgid: new files and folders take its group
    old = os.umask(0o002)
    try:
        assert umask() == 0o002
        atomic_write(shared / "run" / "manifest.json", "{}\n")
        atomic_write(shared / "run" / "scripts" / "train.sbatch", "#!/bin/bash\n", executable=True)
    finally:
        os.umask(old)
    for path, mode in ((shared / "run", 0o2775), (shared / "run" / "manifest.json", 0o664),
                       (shared / "run" / "scripts" / "train.sbatch", 0o775)):
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, group), path
    atomic_write(tmp_path / "private", "x")  # umask 022 (pytest's): 0644, not mkstemp's 0600
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o666 & ~old


def test_the_manifest_records_its_owner_and_old_ones_fall_back_to_the_file(tmp_path: Path) -> None:
    import os

    import pytest

    from slurmft.errors import RunDirError
    from slurmft.rundir import check_owner, current_user, new_manifest, run_owner, write_manifest

    paths = RunPaths.of(tmp_path)
    manifest = new_manifest("x", "slurm")
    assert manifest["owner"] == {"uid": os.getuid(), "user": current_user().name}
    write_manifest(paths, manifest)
    assert run_owner(paths, manifest).uid == os.getuid()
    check_owner(paths, manifest, "resume", force=False)  # our own: fine
    old = {k: v for k, v in manifest.items() if k != "owner"}  # written before owners were recorded
    assert run_owner(paths, old).uid == paths.manifest.stat().st_uid
    theirs = {**manifest, "owner": {"uid": 4242, "user": "ann"}}
    with pytest.raises(RunDirError, match="is ann's run .*refusing to resume it; ask ann, or pass --force"):
        check_owner(paths, theirs, "resume", force=False)
    check_owner(paths, theirs, "resume", force=True)


def test_a_pid_carries_its_host_and_start(tmp_path: Path) -> None:
    import os
    import socket

    from slurmft.rundir import process_here, process_record

    me = process_record(os.getpid())
    assert me["host"] == socket.gethostname() and isinstance(me["pid_start"], int)
    assert process_here(me) == (True, socket.gethostname())
    assert process_here({**me, "pid_start": me["pid_start"] + 1})[0] is False  # the pid reused by another process
    assert process_here({"pid": os.getpid()}) == (True, socket.gethostname())  # an old manifest: this host's
    assert process_here({**me, "host": "login-9"}) == (None, "login-9")  # another host: cannot tell


@pytest.mark.parametrize("content", [b"[]", b"null", b"\xff\xfe", b'{"version": 2}',
                                     b'{"name": "x", "executor": "local", "jobs": [{"x": 1}]}'])
def test_a_manifest_of_the_wrong_shape_is_said_by_every_command(
        content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-edited, foreign or torn manifest.json: each command that reads it exits 2 with "is corrupt", never a
    KeyError/AttributeError/UnicodeDecodeError traceback."""
    (tmp_path / "manifest.json").write_bytes(content)
    for command in ("status", "logs", "cancel", "resume", "consolidate"):
        code, _, err = cli([command, str(tmp_path)], capsys)
        assert code == 2 and "manifest.json is corrupt" in err and "Traceback" not in err, (command, err)


@pytest.mark.parametrize("record", [{"version": 1}, {"version": 1, "name": "s", "executor": "local", "select": {},
                                                     "jobs": [], "points": [{"name": "p"}]}])
def test_a_sweep_record_of_the_wrong_shape_is_said_by_every_command(
        record: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """sweep.json of this version but missing what submit wrote: 'is corrupt' and exit 2, not a KeyError."""
    import json

    (tmp_path / "sweep.json").write_text(json.dumps(record))
    for command in ("status", "logs", "plot", "report", "cancel", "resume", "consolidate"):
        code, _, err = cli([command, str(tmp_path)], capsys)
        assert code == 2 and "sweep.json is corrupt" in err and "Traceback" not in err, (command, err)
