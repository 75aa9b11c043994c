"""The sweep's lock (rundir.sweep_locked): `resume SWEEP_DIR`, `resume POINT_DIR` and `consolidate SWEEP_DIR` take
turns, so two of them never both submit for one point. A holder in another process makes each of them wait, then
refuse in words, with nothing written."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import cli

from slurmft import rundir
from slurmft.rundir import RunPaths, SweepPaths, new_manifest, sweep_locked, sweep_root, write_manifest
from slurmft.submit import resume


def _sweep(tmp_path: Path) -> tuple[Path, Path]:
    """A sweep directory with one point whose manifest says it was submitted (nothing else is read before the
    lock)."""
    root = tmp_path / "sw"
    point = root / "seed-1"
    point.mkdir(parents=True)
    write_manifest(RunPaths.of(point), new_manifest("sw-seed-1", "slurm"))
    rundir.write_sweep_record(SweepPaths(root), {
        "version": rundir.SWEEP_VERSION, "name": "sw", "executor": "slurm", "select": {"metric": "loss", "mode": "min"},
        "points": [{"index": 0, "name": point.name, "dir": str(point), "overrides": {"train.seed": 1}}], "jobs": []})
    return root, point


def test_a_point_belongs_to_its_sweep(tmp_path: Path) -> None:
    root, point = _sweep(tmp_path)
    assert sweep_root(point) == root.resolve() and sweep_root(root) == root.resolve()
    assert sweep_root(tmp_path) is None
    with sweep_locked(point, "resume"):  # this process holds it: a sweep's resume resumes its points under it
        assert RunPaths.of(root).lock.is_file()
        with sweep_locked(root, "resume"):
            pass
        assert RunPaths.of(root).lock.is_file()
    assert not RunPaths.of(root).lock.exists()


def test_resume_and_consolidate_wait_for_the_sweeps_lock(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    root, point = _sweep(tmp_path)
    monkeypatch.setattr(resume, "LOCK_WAIT_S", 0.5)
    monkeypatch.setattr(rundir, "COMMAND_LOCK_WAIT_S", 0.5)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from slurmft import locks; locks.acquire(Path(sys.argv[1]), 'resume'); "
                               "print('held', flush=True); time.sleep(60)", str(RunPaths.of(root).lock)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = (point / "manifest.json").read_text(), (root / "sweep.json").read_text()
        for args, what in ((["resume", str(point)], "resume"), (["resume", str(root)], "resume"),
                           (["consolidate", str(root)], "consolidate")):
            t0 = time.monotonic()
            code, _, err = cli(args, capsys)
            assert code == 2, err
            assert f"{root.resolve()} is locked by " in err and f"cannot {what} now" in err, err
            assert time.monotonic() - t0 >= 0.5  # it waited for the holder first
        assert ((point / "manifest.json").read_text(), (root / "sweep.json").read_text()) == before
        assert not RunPaths.of(point).lock.exists()  # the point's own lock was never taken
    finally:
        holder.kill()
        holder.wait()
