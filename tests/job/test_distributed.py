"""Which GPU a rank takes (slurmft.job.distributed.choose_gpu), and how a bad one ends the job.

One rule: the train script runs ``srun --gpu-bind=none`` (every rank sees its node's GPUs and takes
cuda:LOCAL_RANK); a site that binds one GPU per task anyway leaves one visible, and the rank takes
it. The choice is a pure function of (visible devices, local rank, environment), tested directly.
No GPU exists here, so the end-to-end test pretends CUDA devices exist (tests/job/fake_gpus.py):
a rank that finds no device for itself must stop every rank with the same error, not leave rank 0
to report a rendezvous time-out.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from slurmft.errors import JobSetupError
from slurmft.job.distributed import choose_gpu

from .helpers import REPO, launch_like_srun, write_run


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [
    (8, 0, 0), (8, 5, 5), (8, 7, 7),  # --gpu-bind=none: all of the node's GPUs, cuda:LOCAL_RANK
    (1, 0, 0), (1, 5, 0), (1, 7, 0),  # the site bound one GPU per task anyway: the only one, cuda:0
    (4, 3, 3),                        # fewer tasks than GPUs on the node: still cuda:LOCAL_RANK
])
def test_the_rule(visible: int, local_rank: int, expected: int) -> None:
    assert choose_gpu(visible, local_rank, rank=8 + local_rank, environ={}) == expected


def test_too_few_visible_gpus_names_rank_and_environment() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_LOCALID": "5"}
    with pytest.raises(JobSetupError) as err:
        choose_gpu(2, 5, rank=13, environ=env)
    msg = err.value.render()
    assert "rank 13" in msg and "LOCAL_RANK 5" in msg and "sees 2 GPU(s)" in msg
    assert "CUDA_VISIBLE_DEVICES=2,3" in msg and "SLURM_LOCALID=5" in msg
    assert "--gpu-bind=none" in msg and "resources.tasks_per_node" in msg  # the fix
    with pytest.raises(JobSetupError, match=r"CUDA_VISIBLE_DEVICES=<unset>, SLURM_LOCALID=<unset>"):
        choose_gpu(0, 0, rank=0, environ={})


def test_gloo_binds_to_the_interface_towards_master_addr_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmft.job import distributed
    from slurmft.job.rendezvous import JobEnv

    env = JobEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": "29555"})
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    distributed._gloo_interface(env)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # a profile's or cluster.env's value wins
    distributed._gloo_interface(env)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


@pytest.mark.train
def test_a_rank_without_a_gpu_stops_every_rank_with_that_error(tiny_model: Path, job_env: dict[str, str],
                                                               tmp_path: Path) -> None:
    """3 ranks on a node where each sees 2 GPUs: rank 2 has none; all three exit 2 with its error, promptly."""
    run = write_run(tmp_path / "run", tiny_model, ["resources.tasks_per_node=3"])
    env = {**job_env, "SLURMFT_FAKE_GPU_COUNT": "2", "CUDA_VISIBLE_DEVICES": "0,1", "SLURMFT_RENDEZVOUS_TIMEOUT": "60"}
    t0 = time.time()
    job = launch_like_srun(run, env, ntasks=3, program=[str(REPO / "tests" / "job" / "fake_gpus.py")])
    rc, out = job.wait(timeout=120)
    assert time.time() - t0 < 50, out[-3000:]  # well before the 60 s rendezvous time-out
    assert [p.returncode for p in job.procs] == [2, 2, 2], out[-3000:]
    assert "rendezvous failed" not in out, out[-3000:]
    for rank in range(3):
        assert re.search(rf"slurmft rank {rank}: setup error: rank 2 has LOCAL_RANK 2 but sees 2 GPU\(s\) "
                         r"\(CUDA_VISIBLE_DEVICES=0,1, SLURM_LOCALID=2\)", out), out[-3000:]
