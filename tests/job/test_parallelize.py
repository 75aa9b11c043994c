"""HSDP's device mesh from the job's environment (no processes). Which rows each rank loads under a 2-D
mesh: tests/job/test_weights.py::test_each_rank_holds_its_slice_on_1d_and_hsdp_meshes.

The two-node run itself (mesh, placements, losses equal to plain FSDP, checkpoint, resume and
consolidation) is tests/slurm/test_hsdp.py, on the real cluster.
"""

from __future__ import annotations

import pytest

from slurmft.errors import JobSetupError
from slurmft.job.parallelize import HSDP_DIM_NAMES, mesh_layout
from slurmft.job.rendezvous import JobEnv


def env(rank: int, world: int = 4, nodes: int = 2, per_node: int = 2, node: int | None = None,
        local: int | None = None) -> JobEnv:
    return JobEnv(rank=rank, world_size=world, local_rank=rank % per_node if local is None else local,
                  local_world_size=per_node, node_rank=rank // per_node if node is None else node, num_nodes=nodes,
                  job_id="1", restart_count=0, master_addr="127.0.0.1", master_port=1, launcher="slurm")


def test_hsdp_mesh_is_nodes_by_ranks_per_node() -> None:
    for rank in range(4):
        assert mesh_layout(True, env(rank)) == ((2, 2), HSDP_DIM_NAMES)
    assert mesh_layout(True, env(5, world=16, per_node=8)) == ((2, 8), ("replicate", "shard"))


def test_plain_fsdp_and_one_node_use_the_1d_mesh() -> None:
    assert mesh_layout(False, env(1)) == ((4,), None)
    assert mesh_layout(True, env(1, nodes=1, per_node=4)) == ((4,), None)  # one replica: plain FSDP


def test_uneven_ranks_per_node_are_refused_naming_the_field() -> None:
    with pytest.raises(JobSetupError, match=r"fsdp\.replicate_across_nodes: the job has 5 ranks on 2 nodes"):
        mesh_layout(True, env(0, world=5))


def test_ranks_not_numbered_node_by_node_are_refused() -> None:
    # a cyclic distribution: rank 1 is local rank 0 of node 1, so mesh row 0 (ranks 0, 1) would span two nodes
    with pytest.raises(JobSetupError, match="block distribution") as err:
        mesh_layout(True, env(1, node=1, local=0))
    assert "fsdp.replicate_across_nodes=false" in str(err.value)
