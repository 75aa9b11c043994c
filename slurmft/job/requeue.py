"""Preemption, last step: run by the batch script after ``srun`` returned (never by the ranks).

Requeuing from inside Python while the step is still exiting cancels it (docs/design-notes.md), so the
ranks only leave a marker (``<run>/requeue/<job>-<restart>``) and this module, in the batch shell,
calls ``scontrol requeue`` — same job id, so the ``afterok`` consolidation job stays valid.
Its exit status becomes the job's: the srun status, or 3 when the run stopped for a requeue that
is no longer allowed (so the consolidation job does not run on a half-trained model).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from slurmft.rundir import RunPaths

EXIT_REQUEUE_REFUSED = 3


def decide(run_dir: Path, exit_code: int, job_id: str, restart: int) -> tuple[str, int]:
    """What to do after srun: ('exit', code) or ('requeue', 0)."""
    paths = RunPaths.of(run_dir)
    marker = paths.requeue_marker_dir / f"{job_id}-{restart}"
    if not marker.exists():
        return "exit", exit_code
    if exit_code != 0:
        return "exit", exit_code
    max_requeues = int(yaml.safe_load(paths.config.read_text())["preemption"]["max_requeues"])
    if restart >= max_requeues:
        return "exit", EXIT_REQUEUE_REFUSED
    return "requeue", 0


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m slurmft.job.requeue RUN_DIR --exit-code N``."""
    ap = argparse.ArgumentParser(prog="python -m slurmft.job.requeue")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--exit-code", type=int, required=True)
    args = ap.parse_args(argv)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    action, code = decide(args.run_dir, args.exit_code, job_id, restart)
    if action == "exit":
        if code == EXIT_REQUEUE_REFUSED:
            print(f"[slurmft] ranks saved after a warning signal, but the job was already requeued {restart} "
                  "time(s) (preemption.max_requeues); the job fails so the consolidation job does not run on "
                  f"a half-trained model. The newest complete checkpoint is kept in {args.run_dir}/checkpoints.",
                  flush=True)
        return code
    print(f"[slurmft] {time.strftime('%H:%M:%S')} requeueing job {job_id} (restart {restart} -> {restart + 1})",
          flush=True)
    out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"[slurmft] scontrol requeue failed: {out.stderr.strip()}", flush=True)
        return EXIT_REQUEUE_REFUSED
    time.sleep(300)  # the requeue ends this batch shell; never fall through to 'exit' meanwhile
    return 0


if __name__ == "__main__":
    sys.exit(main())
