"""DPO on the real two-node cluster (docs/dpo.md): a full fine-tune with its frozen FSDP2 reference copy, and LoRA-DPO
(the reference is the base with the adapters disabled), each preempted once by the warning signal mid-run beside
its uninterrupted twin. The preempted run is requeued under the same job id, resumes at the step it saved, logs
every step once and ends bitwise equal to the twin: the consolidated model, and for LoRA the adapter too. Every
checkpoint it wrote says ``method: dpo`` and holds the policy only (no reference weight)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.job.helpers import preference_data
from tests.slurm.jobs import preempted_beside_uninterrupted

pytestmark = pytest.mark.slurm

SECTIONS = {
    "train": {"max_steps": 8, "per_device_batch_size": 1},
    "checkpoint": {"every_steps": 3, "keep_last": 2},
    "resources": {"nodes": 1, "gpus_per_node": 2},  # 2 ranks on one node: the two runs share the cluster's nodes
    "dpo": {"beta": 0.1},
}


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}], ids=["full", "lora"])
def test_dpo_preempted_once_ends_bitwise_equal_to_its_uninterrupted_run(
        slurm_cluster, tiny_model: Path, tmp_path: Path, slurmft, lora: dict | None) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from slurmft.checkpoints import read_marker

    pairs = preference_data(tmp_path / "pairs.jsonl")
    sections = {**SECTIONS, **({"lora": lora} if lora else {})}
    run, twin, _ = preempted_beside_uninterrupted(slurmft, slurm_cluster, tmp_path, tiny_model, pairs, **sections)

    slurmft.assert_same_model(run / "model", twin / "model")
    if lora:
        adapter, expected = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (run, twin))
        assert adapter.keys() == expected.keys() and adapter
        assert all(adapter[k].equal(t) for k, t in expected.items())
    losses = [m["loss"] for m in sorted(slurmft.metrics(run), key=lambda m: m["step"])]
    assert losses == [m["loss"] for m in sorted(slurmft.metrics(twin), key=lambda m: m["step"])]
    checkpoints = sorted((run / "checkpoints").glob("checkpoint-*"))
    assert checkpoints
    for checkpoint in checkpoints:
        assert read_marker(checkpoint)["method"] == "dpo"
        keys = FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
        assert keys and not any("ref" in k for k in keys), sorted(keys)[:4]  # the policy only
