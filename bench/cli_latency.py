"""CLI latency: median wall time of `slurmft --help` and `slurmft render` against `python -c pass`.

Run: python bench/cli_latency.py [--repeat 15]
All three commands run in the same invocation, interleaved, so the ratios compare like with like.
It also checks (python -X importtime) that `render` imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "tests" / "data" / "golden-2x8-aws-efa.yaml"
HEAVY = ("torch", "transformers", "accelerate", "trl", "datasets")


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def heavy_imports(cmd: list[str]) -> list[str]:
    """Top-level packages of HEAVY that `python -X importtime` shows the command importing."""
    out = subprocess.run([sys.executable, "-X", "importtime", *cmd], capture_output=True, text=True, check=True)
    found = set()
    for line in out.stderr.splitlines():
        name = line.rsplit("|", 1)[-1].strip()
        if name.split(".")[0] in HEAVY:
            found.add(name.split(".")[0])
    return sorted(found)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cmds = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "slurmft --help": [sys.executable, "-m", "slurmft.cli", "--help"],
            "slurmft render": [sys.executable, "-m", "slurmft.cli", "render", str(CONFIG), "--out", out],
        }
        times: dict[str, list[float]] = {k: [] for k in cmds}
        for cmd in cmds.values():  # warm the page cache
            wall(cmd)
        for _ in range(args.repeat):
            for name, cmd in cmds.items():
                times[name].append(wall(cmd))
        heavy = heavy_imports(["-m", "slurmft.cli", "render", str(CONFIG), "--out", out])
    base = statistics.median(times["python -c pass"])
    print("| command | median wall (ms) | ratio to `python -c pass` |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| `{name}` | {med * 1000:.0f} | {med / base:.1f}x |")
    print(f"\n{args.repeat} interleaved runs each; heavy modules imported by `render`: {heavy or 'none'}")
    return 1 if heavy else 0


if __name__ == "__main__":
    sys.exit(main())
