"""CLI latency: median wall time of `slurmft --help`, `render` and `estimate` against `python -c pass`.

Run: python bench/cli_latency.py [--repeat 15] [--quick]
All commands run in the same invocation, interleaved, so the ratios compare like with like.
It also checks (python -X importtime) that `render` and `estimate` import neither torch nor
transformers.

Targets (exit 1 when missed): no heavy import in `render` or `estimate`, and every slurmft command's
median at most ``TARGET_RATIO`` times `python -c pass` (a ratio, so a busy machine slows both sides;
importing torch alone takes more than that here, so a login-side command that started importing it
would miss). ``--quick`` (3 runs) is what the test suite runs, beside training jobs on the same cores: there
the wall times measure the machine's other work as much as the command (13.2x once, for 8.7x on the quiet
machine), so ``--quick`` holds each command's CPU time (user + sys, which waiting for a core does not add to)
to ``QUICK_CPU_RATIO`` instead. CPU time is not immune to the load either (the two cores here share caches, and
a core's sibling at work slows it: ``slurmft estimate`` measured 8.5x on the quiet machine and 12.3x beside the
test suite's training jobs), so that bound is looser than the target; it still catches a login command that
imports torch (~75x alone). Both ratios are printed.

The commands run on slurmft's cached bytecode, as a user's second command does: the package they import is
byte-compiled first. Where ``PYTHONDONTWRITEBYTECODE=1`` (this machine's default) no run writes it, and every run
compiled each module changed since the cache was last written again (estimate: ~100 ms more, a third of its time).
"""

from __future__ import annotations

import argparse
import compileall
import os
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
QUICK_CPU_RATIO = 16.0  # --quick, beside other work: median CPU time / that of `python -c pass`


def wall(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + sys) of one run of ``cmd``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise subprocess.CalledProcessError(code, cmd)
    return elapsed, usage.ru_utime + usage.ru_stime


def compile_package() -> Path:
    """Byte-compile the slurmft that ``python -m slurmft.cli`` imports from here (the working directory first, as
    ``-m`` finds it); returns its directory."""
    found = subprocess.run([sys.executable, "-c", "import slurmft; print(slurmft.__file__)"], capture_output=True,
                           text=True, check=True).stdout.strip()
    package = Path(found).parent
    compileall.compile_dir(package, quiet=1)
    return package


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
    print(f"byte-compiled {compile_package()} first (a user's second command)")
    with tempfile.TemporaryDirectory() as out:
        cli = [sys.executable, "-m", "slurmft.cli"]
        cmds = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "slurmft --help": [*cli, "--help"],
            "slurmft render": [*cli, "render", str(CONFIG), "--out", out],
            "slurmft estimate": [*cli, "estimate", str(ESTIMATE_CONFIG)],
        }
        times: dict[str, list[float]] = {k: [] for k in cmds}
        cpu: dict[str, list[float]] = {k: [] for k in cmds}
        for cmd in cmds.values():  # warm the page cache
            wall(cmd)
        for _ in range(repeat):
            for name, cmd in cmds.items():
                elapsed, used = wall(cmd)
                times[name].append(elapsed)
                cpu[name].append(used)
        heavy = {name: heavy_imports(cmds[name][1:]) for name in ("slurmft render", "slurmft estimate")}
    base, cpu_base = statistics.median(times["python -c pass"]), statistics.median(cpu["python -c pass"])
    print("| command | median wall (ms) | ratio to `python -c pass` |\n|---|---|---|")
    slow, cpu_ratios = [], []
    bound = QUICK_CPU_RATIO if args.quick else TARGET_RATIO  # CPU time with --quick, wall time without
    for name, ts in times.items():
        med, cpu_ratio = statistics.median(ts), statistics.median(cpu[name]) / cpu_base
        print(f"| `{name}` | {med * 1000:.0f} | {med / base:.1f}x |")
        ratio = cpu_ratio if args.quick else med / base
        if name.startswith("slurmft"):
            cpu_ratios.append(f"`{name}` {cpu_ratio:.1f}x")
            if ratio > bound:
                slow.append(f"{name} {ratio:.1f}x")
    print(f"\n{repeat} interleaved runs each; CPU time (user + sys) to `python -c pass`'s: {'; '.join(cpu_ratios)}"
          f"{' (the ratio --quick holds to the target)' if args.quick else ''}; heavy modules imported: "
          + "; ".join(f"`{k}` {v or 'none'}" for k, v in heavy.items()))
    missed = slow + [f"{k} imports {', '.join(v)}" for k, v in heavy.items() if v]
    print(f"targets (each slurmft command <= {bound:g}x `python -c pass`{' in CPU time' if args.quick else ''}, "
          "no torch/transformers in render and "
          f"estimate): {'met' if not missed else 'MISSED: ' + '; '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
