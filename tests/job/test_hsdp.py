"""HSDP's device mesh from the job's environment, and which rows each rank loads under it (no processes).

The two-node run itself (mesh, placements, losses equal to plain FSDP, checkpoint, resume and
consolidation) is tests/slurm/test_hsdp.py, on the real cluster.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slurmft.errors import JobSetupError
from slurmft.job.loading import HSDP_DIM_NAMES, _row_chunks, mesh_layout
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


def _dtensor_like(mesh_shape: tuple[int, ...], placements: tuple) -> SimpleNamespace:
    import torch

    world = 1
    for n in mesh_shape:
        world *= n
    return SimpleNamespace(device_mesh=SimpleNamespace(mesh=torch.arange(world).reshape(mesh_shape)),
                           placements=placements)


def test_row_chunks_follow_the_shard_coordinate() -> None:
    from torch.distributed.tensor import Replicate, Shard

    assert _row_chunks(_dtensor_like((4,), (Shard(0),)), 4) == (4, [0, 1, 2, 3])
    # HSDP: 2 chunks; ranks 0 and 2 (same shard on both nodes) get chunk 0, ranks 1 and 3 chunk 1
    assert _row_chunks(_dtensor_like((2, 2), (Replicate(), Shard(0))), 4) == (2, [0, 1, 0, 1])
    assert _row_chunks(_dtensor_like((2, 8), (Replicate(), Shard(0))), 16) == (8, [*range(8), *range(8)])
    with pytest.raises(RuntimeError, match="unexpected placements"):
        _row_chunks(_dtensor_like((2, 2), (Replicate(), Shard(1))), 4)
