"""What the local executor prints while a run's train job runs here: one line per step and per complete save that
rank 0 appends to ``metrics.jsonl``, each once and in order (``slurmft.submit.dispatch._wait_local`` waits on the
job and says them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurmft.rundir import SAVE_EVENT
from slurmft.units import binary_bytes


class MetricsFollower:
    """Every step rank 0 appends to ``metrics.jsonl``, one line each, in order (a console that printed
    only the newest record each second dropped the steps logged in between)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new_lines(self) -> list[str]:
        """One line per record completed since the last call; a partly written last line waits."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        lines = []
        for raw in complete.decode(errors="replace").splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == SAVE_EVENT:
                lines.append(save_line(rec))
            elif isinstance(rec, dict) and "step" in rec:
                lines.append(step_line(rec))
        return lines


def save_line(rec: dict[str, Any]) -> str:
    """``saved checkpoint-6 (async: training waited 0.12 s, durable after 0.9 s, 64.0 MiB)``: a save line of
    metrics.jsonl (written once the checkpoint is complete), not a step of its own."""
    how = [f"training waited {rec['blocked_s']:.2f} s" if isinstance(rec.get("blocked_s"), int | float) else "",
           f"durable after {rec['durable_s']:.1f} s" if isinstance(rec.get("durable_s"), int | float) else "",
           binary_bytes(rec["bytes"]) if isinstance(rec.get("bytes"), int) else ""]
    detail = ", ".join(part for part in how if part)
    mode = f"{rec['mode']}: " if rec.get("mode") and detail else str(rec.get("mode") or "")
    return f"saved checkpoint-{rec.get('step')}" + (f" ({mode}{detail})" if mode or detail else "")


def step_line(rec: dict[str, Any]) -> str:
    """``step 7 loss=2.31 learning_rate=1e-05 ...``: what the local console prints for one step."""
    parts = [f"step {rec.get('step')}"]
    for key in ("loss", "learning_rate", "grad_norm", "tokens_per_s", "reward", "reward_std"):  # reward: GRPO's
        if isinstance(rec.get(key), int | float):
            parts.append(f"{key}={rec[key]:.4g}")
    return " ".join(parts)
