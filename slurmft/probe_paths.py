"""Where one ``slurmft doctor --job`` probe keeps its files: its script, its log, each rank's report and the
tokens the nodes write into the directories whose sharing it checks. Shared by the login side that submits and reads
the probe (slurmft/submit/probe.py, slurmft/plan/render.py) and the job side that writes it (slurmft/job/probe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProbePaths:
    """Every path of one ``slurmft doctor --job`` probe: its own directory (not a run directory: a probe must
    not leave files in an output_dir that ``submit`` then refuses as foreign), and the token files the
    nodes write into the directories whose sharing is checked."""

    root: Path

    @property
    def script(self) -> Path:
        return self.root / "probe.sbatch"

    @property
    def log(self) -> Path:
        return self.root / "probe.log"

    def ready(self, rank: int) -> Path:
        """Written by a rank once its checks ran and its signal handler is in place."""
        return self.root / f"ready-{rank}"

    def rank_report(self, rank: int) -> Path:
        return self.root / f"rank-{rank}.json"

    def tool_report(self, kind: str, node: str) -> Path:
        """What ``serve.python`` / ``eval.python`` is on ``node`` where that job runs in a place of its own
        (``serve.container``, ``eval.container``): written by the probe's step there."""
        return self.root / f"tool-{kind}-{node}.json"

    def tool_reports(self, kind: str) -> dict[str, Path]:
        """node -> its :meth:`tool_report` for ``kind``, as written."""
        prefix = f"tool-{kind}-"
        return {p.name[len(prefix):-len(".json")]: p for p in sorted(self.root.glob(f"{prefix}*.json"))}

    @property
    def batch_report(self) -> Path:
        """What the batch shell's side found (scontrol, the time limit it set)."""
        return self.root / "batch.json"

    @property
    def batch_signal(self) -> Path:
        """Touched by the batch shell's trap when the warning signal reached it."""
        return self.root / "batch-signal"

    @staticmethod
    def token(directory: Path, job_id: str, node: str) -> Path:
        """The file a node writes into ``directory`` (the run dir's, HF_HOME) and every other node reads."""
        return directory / f".slurmft-doctor-{job_id}-{node}"
