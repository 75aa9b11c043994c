"""A mixture-of-experts model on the real two-node cluster: preempted once (the warning signal mid-run), it ends
bitwise equal to its uninterrupted run. A tiny Mixtral built by transformers (slurmft.tiny.build_arch): its
checkpoint keeps one tensor per expert (``block_sparse_moe.experts.<e>.w1.weight``), the model one fused
``mlp.experts.gate_up_proj``, so both the sliced load (each rank reads its experts) and the export (back to
per-expert tensors) go through transformers' conversion mapping (slurmft/job/conversion.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.slurm.conftest import IN_ALLOCATION
from tests.slurm.jobs import preempted_beside_uninterrupted

pytestmark = pytest.mark.slurm

TRAIN = {"max_steps": 8}
CHECKPOINT = {"every_steps": 4, "keep_last": 2}
RESOURCES = {"nodes": 1, "gpus_per_node": 2}  # 2 ranks on one node: the two runs share the cluster's two nodes


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from slurmft.tiny import build_arch

    return build_arch(tmp_path_factory.mktemp("mixtral") / "model", "mixtral")


def test_moe_preempted_once_ends_bitwise_equal_to_its_uninterrupted_run(
        slurm_cluster, mixtral: Path, chat_data: Path, tmp_path: Path, slurmft) -> None:
    run, reference, _ = preempted_beside_uninterrupted(slurmft, slurm_cluster, tmp_path, mixtral, chat_data,
                                                       train=TRAIN, checkpoint=CHECKPOINT, resources=RESOURCES,
                                                       prepare=IN_ALLOCATION)  # experts' shards: no data preparation
    slurmft.assert_same_model(run / "model", reference / "model")
    from safetensors import safe_open

    index = run / "model" / "model.safetensors.index.json"
    names = set(json.loads(index.read_text())["weight_map"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names  # per expert, as save_pretrained writes
    assert not any("gate_up_proj" in n for n in names)
    with safe_open(str(mixtral / "model.safetensors"), framework="pt") as f:
        assert names == set(f.keys())
