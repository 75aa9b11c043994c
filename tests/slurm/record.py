"""Record what Slurm prints for the queries slurmft's adapter makes, for the parser tests in
tests/test_slurm.py (they need no cluster). Against the test cluster of the current environment:

    eval "$(bash tests/slurm/cluster.sh env)"                          # 22.05
    eval "$(SLURMFT_CLUSTER_SUITE=trixie bash tests/slurm/cluster.sh env)"   # 24.11
    python tests/slurm/record.py

writes tests/data/slurm/<version>/: squeue.txt and sacct.txt (slurmft.slurm's own queries),
show-job-requeued.txt, show-job-pending.txt, show-job-gone.txt (a job id slurmctld does not know:
exit status, stdout, stderr), show-config.txt and version.txt. The jobs: ``rec`` (name and
comment with a "|", requeued once by ``scontrol requeue``, running), ``dep`` (pending on it), ``exit3``
(failed with exit code 3) and ``term`` (its batch shell killed by SIGTERM)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from slurmft import slurm

DATA = Path(__file__).resolve().parents[1] / "data" / "slurm"


def run(*args: str) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, check=True, timeout=60, env=slurm.child_env())
    return out.stdout


def sbatch(*args: str) -> str:
    return run("sbatch", "--parsable", "-o", "/dev/null", *args).strip().split(";")[0]


def wait(job: str, what: str, done) -> dict[str, str]:  # noqa: ANN001
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        fields = slurm.parse_show(run("scontrol", "show", "job", job))
        if done(fields):
            return fields
        time.sleep(0.5)
    sys.exit(f"job {job} never {what}")


def main() -> None:
    version = run("sinfo", "--version").split()[-1]
    out = DATA / version.rsplit(".", 1)[0]
    out.mkdir(parents=True, exist_ok=True)
    rec = sbatch("-J", "rec|name", "--comment", "slurmft-run:rec|x", "--requeue", "--wrap", "sleep 300")
    wait(rec, "ran", lambda f: f["JobState"] == "RUNNING")
    run("scontrol", "requeue", rec)
    wait(rec, "ran again", lambda f: f["JobState"] == "RUNNING" and f["Restarts"] == "1")
    dep = sbatch("-J", "dep", f"--dependency=afterok:{rec}", "--wrap", "true")
    exit3 = sbatch("-J", "exit3", "--wrap", "exit 3")
    term = sbatch("-J", "term", "--wrap", "kill -TERM $$")
    for job in (exit3, term):
        wait(job, "ended", lambda f: f["JobState"] == "FAILED")
    jobs = [rec, dep, exit3, term]
    deadline = time.monotonic() + 60  # accounting lags slurmctld a little
    while len(slurm.parse_sacct(run(*slurm.sacct_args(jobs)))) < len(jobs) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)
    (out / "version.txt").write_text(run("sinfo", "--version"))
    (out / "jobs.txt").write_text(" ".join(jobs) + "\n")
    (out / "squeue.txt").write_text(run(*slurm.squeue_args()))
    (out / "sacct.txt").write_text(run(*slurm.sacct_args(jobs)))
    (out / "show-job-requeued.txt").write_text(run("scontrol", "show", "job", rec))
    (out / "show-job-pending.txt").write_text(run("scontrol", "show", "job", dep))
    (out / "show-config.txt").write_text(run("scontrol", "show", "config"))
    gone = subprocess.run(["scontrol", "show", "job", "999999"], capture_output=True, text=True, check=False,
                          timeout=60, env=slurm.child_env())
    (out / "show-job-gone.txt").write_text(f"exit {gone.returncode}\nstdout: {gone.stdout}\nstderr: {gone.stderr}")
    run("scancel", rec, dep)
    print(f"recorded Slurm {version} into {out}")


if __name__ == "__main__":
    main()
