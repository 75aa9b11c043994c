"""DPO on the real two-node cluster (docs/dpo.md): a full fine-tune with its frozen FSDP2 reference copy, and LoRA-DPO
(the reference is the base with the adapters disabled), each preempted once by the warning signal mid-run beside
its uninterrupted twin. The preempted run is requeued under the same job id, resumes at the step it saved, logs
every step once and ends bitwise equal to the twin: the consolidated model, and for LoRA the adapter too. Every
checkpoint it wrote says ``method: dpo`` and holds the policy only (no reference weight).

A ``dpo.reference: precomputed`` run with the prepare job paused, then resumed onto a replaced base (refused) and
with its pairs fixed and prepared again (its values computed again, never the old pairs' reused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.job.helpers import preference_data
from tests.slurm.conftest import IN_ALLOCATION
from tests.slurm.jobs import preempted_beside_uninterrupted

pytestmark = pytest.mark.slurm

SECTIONS = {
    "train": {"max_steps": 8, "per_device_batch_size": 1},
    "checkpoint": {"every_steps": 3, "keep_last": 2},
    "resources": {"nodes": 1, "gpus_per_node": 2},  # 2 ranks on one node: the two runs share the cluster's nodes
    "dpo": {"beta": 0.1},
    # the twins' preemption and resume: no data preparation in them (DPO with the prepare job: the precomputed
    # test below, and tests/job/test_dpo_cpu.py's prepared run)
    "prepare": IN_ALLOCATION,
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


def test_a_paused_precomputed_run_refuses_a_replaced_base_and_computes_fixed_pairs_again(
        slurm_cluster, tiny_model: Path, tmp_path: Path, slurmft) -> None:
    """``dpo.reference: precomputed`` with the product's defaults (a prepare job first), cancelled after its first
    checkpoint (issue 45, items 3 and 5):

    - its base model replaced under it (the same files, one weight changed): ``resume`` starts a train job that
      stops before loading anything, naming the changed file; nothing trained on the other base;
    - the base put back and the data fixed (the same rows, chosen and rejected swapped), ``slurmft prepare RUN``,
      ``resume``: the values kept for the old pairs are not used: the job reads the starting model from its files
      (the policy's shards are empty before the checkpoint loads), computes the values for the new pairs, keeps
      them, and finishes; the new chosen values are the old rejected ones and the reverse.
    """
    import shutil

    import torch
    from safetensors import safe_open

    from tests.slurm.jobs import started_jobs

    model = shutil.copytree(tiny_model, tmp_path / "base")  # the run's own copy: it is changed below
    pairs = preference_data(tmp_path / "pairs.jsonl")
    path = slurmft.write_config(tmp_path, model, pairs, train={"max_steps": 30, "per_device_batch_size": 1},
                                checkpoint={"every_steps": 2, "keep_last": 2}, resources={"nodes": 1, "gpus_per_node": 2},
                                dpo={"beta": 0.1, "reference": "precomputed"})
    run = tmp_path / "run"
    jobs = slurmft.submit(path)
    assert "prepare" in jobs
    slurmft.wait_for("checkpoint-2", lambda: slurmft.complete(run, 2), timeout=400)
    code, out, err = slurmft.cli(["cancel", str(run)])
    assert code == 0, err
    slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=60)

    def values() -> tuple[dict[str, str], dict[str, torch.Tensor]]:
        with safe_open(str(run / "reference_logps.safetensors"), framework="pt") as f:
            return f.metadata(), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)

    meta_old, old = values()

    weights = model / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-8] + (b"\x01" * 8 if original[-8:] != b"\x01" * 8 else bytes(8)))
    refused = slurmft.resume(run)
    slurm_cluster.wait_state(refused["train"], "FAILED", timeout=300)
    log = (run / "logs" / f"train-{refused['train']}.out").read_text(errors="replace")
    assert "the base model is not the one checkpoint-" in log and "model.safetensors:" in log, log[-3000:]
    assert "Traceback" not in log
    assert not [m for m in slurmft.metrics(run) if m["job_id"] == refused["train"]]  # nothing trained on it

    slurmft.cli(["cancel", str(run)])  # its consolidation job, if Slurm left it waiting for the failed train job
    weights.write_bytes(original)  # the base put back
    pairs.write_text("".join(json.dumps({**row, "chosen": row["rejected"], "rejected": row["chosen"]}) + "\n"
                             for row in map(json.loads, pairs.read_text().splitlines())))
    code, out, err = slurmft.cli(["prepare", str(run)])
    assert code == 0, err
    slurm_cluster.wait_state(started_jobs(out)["prepare"], "COMPLETED", timeout=300)
    last = slurmft.resume(run)
    slurm_cluster.wait_state(last["train"], "COMPLETED", timeout=400)
    slurm_cluster.wait_state(last["consolidate"], "COMPLETED", timeout=240)
    log = (run / "logs" / f"train-{last['train']}.out").read_text(errors="replace")
    assert "was computed from other data or another model (the pairs' token ids changed since)" in log, log[-3000:]
    assert "the starting model read from its files to compute the values" in log
    meta, new = values()
    assert meta["data_sha256"] != meta_old["data_sha256"] and meta["base"] == meta_old["base"]
    assert torch.allclose(new["ref_chosen_logps"], old["ref_rejected_logps"], rtol=0, atol=1e-5)
    assert torch.allclose(new["ref_rejected_logps"], old["ref_chosen_logps"], rtol=0, atol=1e-5)
    assert (run / "model" / "model.safetensors.index.json").is_file()
