"""How a job process loads its libraries (slurmft/job/entrypoint.py ``load_the_stack``): with the cyclic garbage
collector off, what the imports made frozen afterwards, the collector on again before the job's work; a second job
body in the same process (tests/job/run_many.py) freezes nothing of what the first run left.

In a fresh interpreter each (the test process has its own heap and its own collector settings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .helpers import write_run

PROBE = r"""
import gc, json, sys, weakref
from slurmft.job import entrypoint

run_dir, job, caller_disables = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if caller_disables:
    gc.disable()
before = gc.get_freeze_count()
entrypoint.load_the_stack(run_dir, job)
first = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count() - before,
         "loaded": [m for m in entrypoint.STACK[job] if m in sys.modules]}

class Cycle:
    pass

left = [Cycle() for _ in range(1000)]
for one in left:
    one.me = one  # what a finished run leaves for the collector: reference cycles
refs = [weakref.ref(one) for one in left]
del left, one
frozen = gc.get_freeze_count()
entrypoint.load_the_stack(run_dir, job)
gc.collect()
second = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count() - frozen,
          "alive": sum(ref() is not None for ref in refs)}
print(json.dumps({"first": first, "second": second}))
"""


def _probe(run_dir: Path, job: str, env: dict[str, str], caller_disables: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(run_dir), job, "1" if caller_disables else "0"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_stack_loads_with_the_collector_off_then_is_frozen_once(tiny_model: Path, job_env: dict[str, str],
                                                                    tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", tiny_model)
    got = _probe(run, "consolidate", job_env)
    first, second = got["first"], got["second"]
    assert first["enabled"] and first["loaded"] == ["slurmft.job.consolidate.job"]
    assert first["frozen"] > 100_000  # torch's and transformers' objects, frozen by the first call
    # the second call froze none of the cycles left between the calls: the collector still finds them (the frozen
    # count only falls, as frozen objects freed by their reference counts leave it)
    assert second["enabled"] and second["frozen"] <= 0 and second["alive"] == 0


def test_a_collector_the_caller_turned_off_stays_off(tiny_model: Path, job_env: dict[str, str],
                                                      tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", tiny_model)
    got = _probe(run, "consolidate", job_env, caller_disables=True)
    assert not got["first"]["enabled"] and got["first"]["frozen"] > 100_000
    assert not got["second"]["enabled"]
