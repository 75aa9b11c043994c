"""A test session never stops a cluster that another process may be using (tests/conftest.py, issue 35).

The failure this guards against: ``slurm_cluster``'s teardown ran ``cluster.sh down`` when a worker's
parameter changed from 22.05 to 24.11, while the other xdist worker still had 22.05 tests running
(``Unable to contact slurm controller``, ``timed out waiting for restart 1``). Here a second pytest run,
nested in this test, makes both of its workers use both clusters at once (``--dist each``: every test on
every worker, 22.05 then 24.11), while this process holds the clusters too; afterwards both clusters
must still be up, because neither run started them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CLUSTER_SH, REPO_ROOT, SLURM_VERSIONS, ensure_cluster, suite_env

pytestmark = pytest.mark.slurm

# A fast 22.05-only test and one that runs on both versions (each worker switches from 22.05 to 24.11).
NESTED = ["tests/slurm/test_cluster.py", "-k", "two_nodes_with_eight_gpus or requeue_keeps_job_id"]


def _stopped_daemons(suite: str) -> list[str]:
    """The daemons ``cluster.sh status`` finds stopped: what ``cluster.sh down`` leaves behind. (Not its health:
    its nodes' states move with the jobs the other worker's tests run; CI56 saw 24.11 "not healthy" for a moment
    after the nested run while its daemons ran on.)"""
    status = subprocess.run(["bash", str(CLUSTER_SH), "status"], capture_output=True, text=True, timeout=60,
                            check=False, env=suite_env(suite))
    return [line.split()[0] for line in status.stdout.splitlines() if line.rstrip().endswith(" stopped")]


def test_a_nested_run_on_two_workers_leaves_both_clusters_up(slurm_cluster, tmp_path: Path) -> None:
    for suite in SLURM_VERSIONS.values():
        ensure_cluster(suite)  # 24.11 too: this run, not the nested one, owns what it starts
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "each", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "nested"), *NESTED],
        capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )
    out = proc.stdout + proc.stderr
    down = {suite: stopped for suite in SLURM_VERSIONS.values() if (stopped := _stopped_daemons(suite))}
    assert down == {}, f"the nested run stopped {down}, which it had not started:\n{out[-2000:]}"
    # both workers really used both clusters, side by side
    assert "Slurm clusters used by: bookworm: gw0, gw1; trixie: gw0, gw1" in out, out[-2000:]
    assert proc.returncode == 0, out[-4000:]
    assert "6 passed" in out, out[-2000:]  # 3 tests on each of the 2 workers
