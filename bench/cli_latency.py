"""CLI latency: median wall time of `slurmft --help`, `render` and `estimate` against `python -c pass`.

Run: python bench/cli_latency.py [--repeat 15] [--quick]
All commands run in the same invocation, interleaved, so the ratios compare like with like.
It also checks (python -X importtime) that `render` and `estimate` import neither torch nor
transformers.

Targets (exit 1 when missed): no heavy import in `render` or `estimate`, and every slurmft command's
median at most ``TARGET_RATIO`` times `python -c pass` (a ratio, so a busy machine slows both sides;
importing torch alone takes more than that here, so a login-side command that started importing it
would miss). ``--quick`` (3 runs) is what the test suite runs.
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
ESTIMATE_CONFIG = HERE.parent / "examples" / "llama2-70b-lima-guanaco.yaml"
HEAVY = ("torch", "transformers", "accelerate", "trl", "datasets")
TARGET_RATIO = 12.0  # per slurmft command: median wall / median of `python -c pass`


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="3 runs each (the test suite's mode)")
    args = ap.parse_args(argv)
    repeat = 3 if args.quick else args.repeat
    with tempfile.TemporaryDirectory() as out:
        cli = [sys.executable, "-m", "slurmft.cli"]
        cmds = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "slurmft --help": [*cli, "--help"],
            "slurmft render": [*cli, "render", str(CONFIG), "--out", out],
            "slurmft estimate": [*cli, "estimate", str(ESTIMATE_CONFIG)],
        }
        times: dict[str, list[float]] = {k: [] for k in cmds}
        for cmd in cmds.values():  # warm the page cache
            wall(cmd)
        for _ in range(repeat):
            for name, cmd in cmds.items():
                times[name].append(wall(cmd))
        heavy = {name: heavy_imports(cmds[name][1:]) for name in ("slurmft render", "slurmft estimate")}
    base = statistics.median(times["python -c pass"])
    print("| command | median wall (ms) | ratio to `python -c pass` |\n|---|---|---|")
    slow = []
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| `{name}` | {med * 1000:.0f} | {med / base:.1f}x |")
        if name.startswith("slurmft") and med > TARGET_RATIO * base:
            slow.append(f"{name} {med / base:.1f}x")
    print(f"\n{repeat} interleaved runs each; heavy modules imported: "
          + "; ".join(f"`{k}` {v or 'none'}" for k, v in heavy.items()))
    missed = slow + [f"{k} imports {', '.join(v)}" for k, v in heavy.items() if v]
    print(f"targets (each slurmft command <= {TARGET_RATIO:g}x `python -c pass`, no torch/transformers in render and "
          f"estimate): {'met' if not missed else 'MISSED: ' + '; '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
