"""A mixture-of-experts model on the real two-node cluster: preempted once (the warning signal mid-run), it ends
bitwise equal to its uninterrupted run. A tiny Mixtral built by transformers (slurmft.tiny.build_arch): its
checkpoint keeps one tensor per expert (``block_sparse_moe.experts.<e>.w1.weight``), the model one fused
``mlp.experts.gate_up_proj``, so both the sliced load (each rank reads its experts) and the export (back to
per-expert tensors) go through transformers' conversion mapping (slurmft/job/conversion.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.slurm.jobs import restarts, signal_rank_steps

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
    runs = {}
    for name in ("uninterrupted", "preempted"):
        (tmp_path / name).mkdir()
        path = slurmft.write_config(tmp_path / name, mixtral, chat_data, train=TRAIN, checkpoint=CHECKPOINT,
                                    resources=RESOURCES)
        runs[name] = (tmp_path / name / "run", slurmft.submit(path))
    run, jobs = runs["preempted"]
    job = jobs["train"]
    slurmft.wait_for("step 2", lambda: any(m["step"] >= 2 for m in slurmft.metrics(run)))
    signal_rank_steps(job)
    slurmft.wait_for("restart 1", lambda: restarts(job) >= 1, timeout=120)
    for _, started in runs.values():
        slurm_cluster.wait_state(started["train"], "COMPLETED", timeout=400)
        slurm_cluster.wait_state(started["consolidate"], "COMPLETED", timeout=240)
    steps = slurmft.metrics(run)
    assert sorted(m["step"] for m in steps) == list(range(1, TRAIN["max_steps"] + 1))
    assert {m["restart"] for m in steps} == {0, 1}  # the preemption happened between two steps it logged
    slurmft.assert_same_model(run / "model", runs["uninterrupted"][0] / "model")
    from safetensors import safe_open

    index = run / "model" / "model.safetensors.index.json"
    names = set(json.loads(index.read_text())["weight_map"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names  # per expert, as save_pretrained writes
    assert not any("gate_up_proj" in n for n in names)
    with safe_open(str(mixtral / "model.safetensors"), framework="pt") as f:
        assert names == set(f.keys())
