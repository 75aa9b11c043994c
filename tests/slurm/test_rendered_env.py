"""The rendered scripts' exports reach the ranks on every node, also where sbatch runs with ``--export=NONE``.

A site (or a user's shell) may set ``SBATCH_EXPORT=NONE``; sbatch then sets ``SLURM_EXPORT_ENV=NONE`` in the job and
every ``srun`` in the script starts its tasks with Slurm's own variables only: the NCCL/EFA settings, OMP_NUM_THREADS
and MASTER_ADDR exported by the script would silently be missing on all ranks (sbatch(1), --export).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_render import GOLDEN_CFG, scripts_for

pytestmark = [pytest.mark.slurm, pytest.mark.every_slurm]  # what srun inherits from sbatch differs by version


def test_exports_reach_every_task_under_export_none(slurm_cluster, tmp_path: Path) -> None:
    train = scripts_for(GOLDEN_CFG)["train"]
    exports = [line for line in train.splitlines() if line.startswith("export ")]
    assert any(line.startswith("export NCCL_SOCKET_IFNAME=") for line in exports), exports
    # The rendered env block as it stands (its directives name the golden config's partition, absent here), then a
    # step on both nodes that prints what each task got.
    script = tmp_path / "env.sbatch"
    script.write_text("#!/bin/bash\n" + "\n".join(exports)
                      + "\nsrun --nodes=2 --ntasks-per-node=1 /usr/bin/env\n")
    out = tmp_path / "env.out"
    job = slurm_cluster.sbatch("--export=NONE", "-N2", "--ntasks-per-node=1", "-o", str(out), str(script))
    slurm_cluster.wait_state(job, "COMPLETED", timeout=30)
    seen = out.read_text().splitlines()
    assert seen.count("NCCL_SOCKET_IFNAME=^docker,lo,veth") == 2, seen
    assert seen.count("OMP_NUM_THREADS=12") == 2, seen
