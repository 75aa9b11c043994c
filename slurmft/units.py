"""Bytes, sizes and durations in words, and this process's peak memory: one home for each.

Why one module: the same facts were written two or three times (the estimate's table, the
consolidation log and ``slurmft status`` each had a byte formatter; the config and consolidation
each parsed ``max_shard_size``; the trainer and consolidation each read the peak RSS), and copies
drift. The formatters below are *not* one function with options: each prints what a user already
reads today (a golden table, a log line, a status screen), so each keeps its own, named for its
output. Standard library only: the login side and the job side both import it, before torch.
"""

from __future__ import annotations

import re
import resource
import time
from pathlib import Path

GB = 10**9
GiB = 2**30
MiB = 2**20

#: A size as transformers' ``max_shard_size`` writes it: decimal units, binary ones with KiB/MiB/GiB/TiB.
SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2**31 (surrounding blanks ignored); ValueError otherwise.

    Slurm's memory suffixes (``64G``, ``500M``) are not sizes here: ``--mem`` is validated as a Slurm
    word by the config and passed to Slurm as written.
    """
    m = SIZE_RE.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a size like 5GB or 500MB")
    size = int(float(m.group(1)) * SIZE_UNITS[m.group(2)])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def decimal_gb(n: float) -> str:
    """Memory plans (``slurmft estimate``, the fit table): ``512 MB``, ``12.3 GB``, ``1.23 TB``.

    Decimal units, never below MB (``0`` is ``0 MB``), thousands separated by commas.
    """
    n = float(n)
    if abs(n) >= 10**12:
        return f"{n / 10**12:,.2f} TB"
    if abs(n) >= GB:
        return f"{n / GB:,.1f} GB"
    return f"{n / 10**6:,.0f} MB"


def decimal_bytes(n: float) -> str:
    """Log lines and errors of consolidation: ``512 B``, ``1.50 KB`` … ``5.00 GB``, ``1.20 TB``.

    Decimal units like ``max_shard_size``, two decimals from KB up.
    """
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def binary_bytes(n: float | None) -> str:
    """``slurmft status`` and the report: ``512 B``, ``1.0 KiB`` … ``1.0 GiB``, ``2.5 TiB``; ``-`` for None.

    Binary units (what ``du -h`` shows for a checkpoint), one decimal from KiB up.
    """
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # not reached: the loop returns at TiB


def slurm_time_seconds(slurm_time: str) -> int:
    """Seconds in a Slurm time limit or elapsed time (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); here, not in config_values,
    so that the watching commands read squeue's elapsed times without the config schema (pydantic)."""
    days, _, rest = slurm_time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        h, (m, s) = 0, (parts + [0])[:2]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def fmt_duration(seconds: float | None) -> str:
    """How long something took or will take: ``1h02m``, ``3m05s``, ``12s`` (rounded); ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def fmt_time(t: float | None) -> str:
    """Local wall-clock time of a unix timestamp; ``-`` for None."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def fmt_age(seconds: float | None) -> str:
    """How long ago, in its largest whole unit: ``42s``, ``5m``, ``3h``, ``2d`` (floored, never negative);
    ``-`` for None. Coarser than :func:`fmt_duration` on purpose: a column of ages in ``slurmft runs``."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory (``VmHWM``; ``ru_maxrss`` where /proc is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
