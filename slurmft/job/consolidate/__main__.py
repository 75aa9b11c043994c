"""By hand: ``python -m slurmft.job.consolidate RUN_DIR [--checkpoint DIR] [--out DIR]``.

On any machine that sees the run directory and has the training stack (CPU is enough): the progress lines,
then the summary as JSON; a slurmft error (a torn checkpoint, a mismatch, a full disk) prints its problems
and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from slurmft.errors import SlurmftError
from slurmft.job.consolidate.job import consolidate_run


def main(argv: list[str] | None = None) -> int:
    """``python -m slurmft.job.consolidate RUN_DIR [--checkpoint DIR] [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog="python -m slurmft.job.consolidate",
        description="Stream a run's sharded checkpoint into a Hugging Face model directory.",
    )
    parser.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/)")
    parser.add_argument(
        "--checkpoint", help="checkpoint directory or name like checkpoint-500 (default: newest complete)"
    )
    parser.add_argument("--out", help="output directory (default: RUN_DIR/model)")
    args = parser.parse_args(argv)
    try:
        summary = consolidate_run(args.run_dir, checkpoint=args.checkpoint, out=args.out)
    except SlurmftError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
