"""Reading what the trackers wrote: W&B offline runs with wandb's own reader, TensorBoard event files with
tensorboardX's protocol buffers (tests of slurmft/job/tracking.py and of report_to, on CPU and Slurm)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

#: W&B's own folders, pointed into the test's tmp_path (not the home directory of whoever runs the tests)
WANDB_HOME = ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")


def wandb_offline_runs(run: Path) -> list[dict]:
    """Every offline W&B run directory under ``RUN/wandb`` (oldest first: the names start with the time), read
    with wandb's own reader (``wandb leet inspect --json``, one record per line): ``{"dir", "id", "resume",
    "rows", "summary"}``, ``rows`` being the history rows in the order they were written, ``summary`` the run
    summary as that attempt left it (its updates in order; ``id`` None: no run record, the W&B service was killed
    before it wrote one)."""
    out = []
    for folder in sorted((run / "wandb").glob("offline-run-*")):
        [log] = folder.glob("run-*.wandb")
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        heads = [r["run"] for r in records if r.get("type") == "run"]  # none: the service died before writing it
        rows = [r["history"]["item"] for r in records if r.get("type") == "history"]
        summary: dict = {}
        for r in records:
            if r.get("type") == "summary":
                summary.update(r["summary"].get("update", {}))
        out.append({"dir": folder, "id": heads[0]["run_id"] if heads else None,
                    "resume": heads[0].get("resume", False) if heads else None, "rows": rows, "summary": summary})
    return out


def tensorboard_steps(folder: Path, tag: str = "train/loss") -> list[list[int]]:
    """The steps of one scalar in each TensorBoard event file of ``folder`` (oldest file first: the names
    carry their creation time). An event file is a TFRecord stream: length (8 bytes), its CRC (4), the
    serialized ``Event``, its CRC (4)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, pos, steps = path.read_bytes(), 0, []
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            steps += [event.step for value in event.summary.value if value.tag == tag]
        out.append(steps)
    return out
