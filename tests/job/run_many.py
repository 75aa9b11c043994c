"""Train several run directories one after another in the same ranks (one start-up for all of them).

Started once per rank with the variables srun sets (tests/job/helpers.py ``launch_like_srun`` with
``program=[this file], args=[RUN_DIR, ...]``). Each run is ``slurmft.job.entrypoint.run_train`` as a
job runs it, its process group set up and torn down per run, each on its own rendezvous port
(MASTER_PORT + its index: a torchrun agent's store, reused for a third process group, hung in
``init_process_group``). The imports (torch, transformers, TRL: most of a tiny run's minute on a
loaded CPU) are paid once. A run that fails leaves ``RUN_DIR.failed.rank<R>`` with its error on each rank and the next run starts.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from slurmft.job.entrypoint import run_train


def main(run_dirs: list[str]) -> int:
    failed = 0
    base = int(os.environ["MASTER_PORT"])
    for index, run_dir in enumerate(run_dirs):
        os.environ["MASTER_PORT"] = str(base + index)
        try:
            run_train(run_dir)
        except BaseException as exc:  # noqa: BLE001 - SystemExit(2) for a setup error too: record it, go on
            failed += 1
            rank = os.environ.get("RANK", "0")
            text = f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            Path(f"{run_dir}.failed.rank{rank}").write_text(text)
            sys.stderr.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
