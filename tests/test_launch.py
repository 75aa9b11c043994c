"""The launcher srun starts (slurmft/job/launch.py): from its first statement to its exit the warning
signal and SIGTERM only raise the flag, and submitit's job processing never installs its own handlers.

A real submitit job pickle is processed in a real child process with a Slurm-like environment; the
pickled function signals its own process (USR2, then TERM) and reports what happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
from submitit.core.utils import DelayedSubmission, JobPaths

REPO = Path(__file__).resolve().parents[1]


def _signal_myself() -> dict[str, object]:
    """Runs inside the launched job: what submitit would have replaced, then two signals."""
    import os
    import signal
    import time

    from slurmft.job import preemption

    before = preemption.installed("USR2")
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # handlers run between bytecodes; give them a moment
    return {"installed": before, "requested": preemption.requested(), "first": preemption.received(),
            "still_installed": preemption.installed("USR2")}


def _run_job(tmp_path: Path, module: str) -> tuple[subprocess.CompletedProcess, Path]:
    folder = tmp_path / "submitit"
    paths = JobPaths(folder, job_id="4242", task_id=0)
    paths.folder.mkdir(parents=True)
    DelayedSubmission(_signal_myself).dump(paths.submitted_pickle)
    env = {**os.environ, "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
           "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "n1", "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-u", "-m", module, *(["--signal=USR2"] if module == "slurmft.job.launch" else []),
           str(folder)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return proc, paths.result_pickle


def test_launcher_keeps_flag_only_handlers_through_submitit(tmp_path: Path) -> None:
    proc, result = _run_job(tmp_path, "slurmft.job.launch")
    assert proc.returncode == 0, proc.stderr
    status, value = cloudpickle.loads(result.read_bytes())
    assert status == "success", value
    assert value == {"installed": True, "requested": True, "first": "SIGUSR2", "still_installed": True}
    assert "Bypassing signal" not in proc.stderr and "scontrol requeue" not in proc.stderr


def test_plain_submitit_is_what_the_launcher_prevents(tmp_path: Path) -> None:
    """Control: with submitit's own entry point the same job is not protected (so the test above can fail)."""
    proc, result = _run_job(tmp_path, "submitit.core._submit")
    # submitit's own USR2 handler runs inside the step (requeue or give up) and the job fails
    assert proc.returncode != 0 and "Caught signal SIGUSR2" in proc.stderr
    assert cloudpickle.loads(result.read_bytes())[0] == "error"


@pytest.mark.parametrize("name", ["USR2", "USR1", "TERM"])
def test_launcher_handlers_cover_the_warning_signal_and_term(name: str) -> None:
    from slurmft.job import preemption

    old = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    try:
        preemption.install(name)
        assert preemption.installed(name)
        assert signal.getsignal(signal.SIGTERM) is signal.getsignal(getattr(signal, f"SIG{name}"))
        preemption.install(name, term=False)  # the local executor: SIGTERM is left as it was
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
