"""Reading what W&B wrote offline, with wandb's own reader (tests of slurmft/job/tracking.py, on CPU and Slurm)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: W&B's own folders, pointed into the test's tmp_path (not the home directory of whoever runs the tests)
WANDB_HOME = ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")


def wandb_offline_runs(run: Path) -> list[dict]:
    """Every offline W&B run directory under ``RUN/wandb`` (oldest first: the names start with the time), read
    with wandb's own reader (``wandb leet inspect --json``, one record per line): ``{"dir", "id", "resume",
    "rows"}``, ``rows`` being the history rows in the order they were written (``id`` None: no run record,
    the W&B service was killed before it wrote one)."""
    out = []
    for folder in sorted((run / "wandb").glob("offline-run-*")):
        [log] = folder.glob("run-*.wandb")
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        heads = [r["run"] for r in records if r.get("type") == "run"]  # none: the service died before writing it
        rows = [r["history"]["item"] for r in records if r.get("type") == "history"]
        out.append({"dir": folder, "id": heads[0]["run_id"] if heads else None,
                    "resume": heads[0].get("resume", False) if heads else None, "rows": rows})
    return out
