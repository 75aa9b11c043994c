"""Train several run directories one after another in the same ranks (one start-up for all of them).

Started once per rank with the variables srun sets (tests/job/helpers.py ``launch_like_srun`` with
``program=[this file], args=[RUN_DIR, ...]``). Each run is ``slurmft.job.entrypoint.run_train`` as a
job runs it, its process group set up and torn down per run, each on a fresh rendezvous port that rank 0
picks and leaves in ``RUN_DIR.port`` for the others (a torchrun agent's store, reused for a third process
group, hung in ``init_process_group``; fixed ports next to the first one collided with gloo's own
connections). The imports (torch, transformers, TRL: most of a tiny run's minute on a loaded CPU) are
paid once. A run that fails leaves ``RUN_DIR.failed.rank<R>`` with its error on each rank (a setup error as
the job prints it, then the exception) and the next run starts.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from slurmft.job import preemption
from slurmft.job.entrypoint import run_train
from slurmft.job.rendezvous import free_port
from slurmft.job.unused_packages import OPT_OUT

# One process trains every run, and the first run's job would keep out what a later one needs (peft for a LoRA
# run after a full one): the libraries import everything installed, as before slurmft.job.unused_packages.
os.environ[OPT_OUT] = "1"


class _Said:
    """sys.stderr, remembering what was written through it."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.parts = stream, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.stream.write(text)

    def text(self) -> str:
        return "".join(self.parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _port(run_dir: str, rank: str) -> str:
    """Rank 0: a port nobody listens on, written to RUN_DIR.port; the others: read it from there."""
    path = Path(run_dir + ".port")
    if rank == "0":
        port = str(free_port())
        path.with_suffix(".tmp").write_text(port)
        path.with_suffix(".tmp").rename(path)
        return port
    deadline = time.monotonic() + 300
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no {path} in 300 s")
        time.sleep(0.05)
    return path.read_text()


#: An argument ``call:MODULE:FUNCTION:ARG:...:WHERE`` runs ``MODULE.FUNCTION(ARG, ..., WHERE)`` in the ranks instead
#: of a run (a check that needs the process group, e.g. tests/job/adapter_survival.py); its port file is named
#: after WHERE, the function and the last segment of the first ARG, its failure files after WHERE.
CALL = "call:"
#: An argument ``requeued:RUN_DIR`` trains RUN_DIR's next attempt in these processes: ``SLURM_RESTART_COUNT=1``
#: and the warning signal's flag lowered (what a requeued job's fresh processes start with), the start-up spared.
#: Everything else is a run's own (process group, trainer, vLLM engine: built again by ``run_train``).
REQUEUED = "requeued:"


def _one(item: str) -> str:
    """Run one item (a run directory, or a ``call:``); returns the path its port and failure files are named by."""
    if item.startswith(REQUEUED):
        item = item[len(REQUEUED):]
        os.environ["MASTER_PORT"] = _port(item + ".requeued", RANK)
        before = os.environ.get("SLURM_RESTART_COUNT", "0")
        os.environ["SLURM_RESTART_COUNT"] = str(int(before) + 1)
        preemption._state.update(flag=False, signum=0, at=0.0)  # a fresh process's: no signal yet
        try:
            run_train(item)
        finally:
            os.environ["SLURM_RESTART_COUNT"] = before
        return item
    if not item.startswith(CALL):
        os.environ["MASTER_PORT"] = _port(item, RANK)
        run_train(item)
        return item
    module, function, *args = item[len(CALL):].split(":")
    os.environ["MASTER_PORT"] = _port(f"{args[-1]}.{function}.{Path(args[0]).name}", RANK)
    getattr(importlib.import_module(module), function)(*args)
    return item


RANK = os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0"))


def main(items: list[str]) -> int:
    failed = 0
    for item in items:
        said = _Said(sys.stderr)
        sys.stderr = said  # what run_train prints itself (a setup error) goes into RUN_DIR.failed.rank<R> too
        try:
            _one(item)
        except BaseException as exc:  # noqa: BLE001 - SystemExit(2) for a setup error too: record it, go on
            failed += 1
            text = f"{said.text()}rank {RANK}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            where = (item.rsplit(":", 1)[-1] + ".call" if item.startswith(CALL) else item.removeprefix(REQUEUED))
            Path(f"{where}.failed.rank{RANK}").write_text(text)
            sys.stderr.write(text)
        finally:
            sys.stderr = said.stream
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
