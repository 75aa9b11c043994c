"""HSDP (``fsdp.replicate_across_nodes``) on the real two-node cluster, 2 nodes x 2 ranks: parameters are
sharded over the 2 ranks of a node and replicated across the nodes, the losses equal a plain FSDP run
of the same config (also 2 x 2) within fp32 tolerance, and checkpoint, preemption + resume and
consolidation work unchanged.

One module fixture submits both runs at once (they share the cluster): the HSDP run gets the warning
signal mid-run, saves, is requeued and resumes; the plain FSDP run is uninterrupted. Few steps of the
tiny model keep this under ~2 minutes.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.export_check import assert_export_matches_checkpoint, load_safetensors_dir
from tests.slurm.conftest import IN_ALLOCATION

pytestmark = pytest.mark.slurm

STEPS = 8
SIGNAL_AFTER = 4  # the HSDP run gets the warning signal once this step is logged (after checkpoint-3)
SECTIONS = {
    "resources": {"tasks_per_node": 2},
    "train": {"max_steps": STEPS, "warmup_ratio": 0.0},
    "checkpoint": {"every_steps": 3, "keep_last": 2},
    "preemption": {"lead_time_s": 30},
    "prepare": IN_ALLOCATION,  # the mesh, its losses and its checkpoints: no data preparation in them
}
# fp32 tolerances. HSDP sums gradients in another order (reduce-scatter inside a node, then all-reduce across
# the nodes): measured, losses agree to ~3e-6 and grad norms to ~1e-4 (relative) over 12 steps. AdamW normalises
# each update, so a gradient component near zero whose rounding differs can move its weight by up to the
# learning rate (1e-3) per step: measured 8e-6 at most. Those figures are the tiny preset's; on the micro model
# the cluster tests train now (8 steps): losses 1.2e-7, grad norms 1.2e-5, weights 1.3e-7 at most.
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-3
WEIGHT_ATOL = 1e-4


def _reports(run: Path) -> list[dict]:
    return [json.loads((run / "fsdp_report" / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.fixture(scope="module")
def runs(slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path_factory: pytest.TempPathFactory,
         config_writer) -> dict:
    """The HSDP run (preempted once, then requeued) and the plain FSDP run, both trained and consolidated."""
    from slurmft.config_loading import load_config
    from slurmft.profiles import load_profile
    from slurmft.submit.dispatch import submit_run
    from tests.slurm import jobs as watch

    out: dict = {}
    for name, hsdp in (("hsdp", True), ("fsdp", False)):
        tmp = tmp_path_factory.mktemp(name)
        fsdp = {"replicate_across_nodes": True} if hsdp else {}
        path = config_writer.write_config(tmp, tiny_model, chat_data, **SECTIONS, fsdp=fsdp)
        cfg = load_config(path)
        out[name] = {"run": tmp / "run", "jobs": submit_run(cfg, load_profile(cfg.cluster.profile), str(path)).jobs}
    run, job = out["hsdp"]["run"], out["hsdp"]["jobs"]["train"]
    watch.wait_for(f"step {SIGNAL_AFTER} of the HSDP run",
                   lambda: any(m["step"] >= SIGNAL_AFTER for m in watch.metrics(run)), timeout=240, poll=0.1)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # Slurm's warning signal, to every rank
    for name in ("hsdp", "fsdp"):
        slurm_cluster.wait_state(out[name]["jobs"]["train"], "COMPLETED", timeout=300)
        slurm_cluster.wait_state(out[name]["jobs"]["consolidate"], "COMPLETED", timeout=240)
    return out


def test_parameters_sharded_in_a_node_and_replicated_across_nodes(runs: dict) -> None:
    hsdp, fsdp = _reports(runs["hsdp"]["run"]), _reports(runs["fsdp"]["run"])
    for r in hsdp:
        assert r["param_types"] == ["DTensor"] and r["num_dtensors"] == r["num_tensors"] > 0
        assert r["distributed_type"].endswith("FSDP") and r["grad_types"] == ["DTensor"]
        assert r["mesh_shapes"] == [[2, 2]] and r["mesh_dim_names"] == ["replicate", "shard"]
        assert r["placements"] == ["(Replicate(), Shard(dim=0))"]
        assert r["mesh_coordinate"] == [r["rank"] // 2, r["rank"] % 2]
        assert 0.45 < r["local_fraction"] < 0.55  # half the model per rank: sharded over the 2 ranks of a node
    # each mesh row (replica) is one node: ranks 0, 1 on one node, ranks 2, 3 on the other
    assert hsdp[0]["node"] == hsdp[1]["node"] != hsdp[2]["node"] == hsdp[3]["node"]
    assert {r["node"] for r in hsdp} == {"n1", "n2"}
    # the two ranks holding the same shard on different nodes hold the same numbers, at load and after training
    # (gradients were all-reduced across the nodes); the two shards of a node differ
    for key in ("local_checksum", "local_checksum_at_end"):
        assert hsdp[0][key] == hsdp[2][key] and hsdp[1][key] == hsdp[3][key], key
        assert hsdp[0][key] != hsdp[1][key], key
    assert hsdp[0]["step_at_end"] == STEPS
    # the plain run of the same config: one 1-D mesh over the 4 ranks, a quarter each
    for r in fsdp:
        assert r["mesh_shapes"] == [[4]] and r["placements"] == ["(Shard(dim=0),)"]
        assert 0.2 < r["local_fraction"] < 0.3
    assert sum(r["local_bytes"] for r in hsdp) == 2 * hsdp[0]["full_bytes"]


def test_losses_equal_plain_fsdp(runs: dict) -> None:
    from tests.slurm.jobs import metrics

    hsdp, fsdp = metrics(runs["hsdp"]["run"]), metrics(runs["fsdp"]["run"])
    assert [m["step"] for m in hsdp] == [m["step"] for m in fsdp] == list(range(1, STEPS + 1))
    assert len({m["restart"] for m in hsdp}) == 2  # the HSDP curve spans the preemption
    for a, b in zip(hsdp, fsdp, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=GRAD_NORM_RTOL), (a["step"], a, b)
    assert fsdp[-1]["loss"] < 0.95 * fsdp[0]["loss"]  # it trained (the micro model: 8.33 -> 7.70 in 8 steps)


def test_checkpoint_resume_and_consolidation_unchanged(runs: dict, tiny_model: Path) -> None:
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from tests.slurm.jobs import metrics

    run, job = runs["hsdp"]["run"], runs["hsdp"]["jobs"]["train"]
    marker = json.loads((run / "requeue" / f"{job}-0").read_text())
    assert marker["saved"] and SIGNAL_AFTER <= marker["step"] < STEPS
    assert min(m["step"] for m in metrics(run) if m["restart"] == 1) == marker["step"] + 1  # resumed at that step

    # the same DCP layout as the plain run: keys, shapes and dtypes; and each replicated shard is written once
    def model_dir(r: Path) -> Path:
        return r / "checkpoints" / f"checkpoint-{STEPS}" / "pytorch_model_fsdp_0"

    def layout(r: Path) -> dict:
        meta = FileSystemReader(str(model_dir(r))).read_metadata()
        return {k: (tuple(v.size), v.properties.dtype) for k, v in meta.state_dict_metadata.items()
                if hasattr(v, "size")}

    def written(r: Path) -> int:
        return sum(p.stat().st_size for p in model_dir(r).glob("*.distcp"))

    assert layout(run) == layout(runs["fsdp"]["run"])
    assert abs(written(run) - written(runs["fsdp"]["run"])) < 0.05 * written(runs["fsdp"]["run"])
    assert assert_export_matches_checkpoint(run, tiny_model)["checkpoint"].name == f"checkpoint-{STEPS}"
    model = AutoModelForCausalLM.from_pretrained(run / "model")  # the deployable model loads
    got, want = load_safetensors_dir(run / "model"), load_safetensors_dir(runs["fsdp"]["run"] / "model")
    assert sorted(got) == sorted(want)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in got.items())
    worst = max((got[n] - want[n]).abs().max().item() for n in got)
    assert worst < WEIGHT_ATOL, f"HSDP and plain FSDP weights differ by up to {worst}"
