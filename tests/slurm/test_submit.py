"""`slurmft submit/status/logs/cancel` against the real local two-node Slurm cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from slurmft.rundir import RunPaths, read_manifest
from tests.export_check import assert_export_matches_checkpoint
from tests.slurm.conftest import IN_ALLOCATION
from tests.slurm.jobs import started_jobs

pytestmark = pytest.mark.slurm


SECRETS = {"HF_TOKEN": "hf_TopSecretValue123", "WANDB_API_KEY": "wandb_TopSecretValue456"}


def test_submit_runs_train_then_consolidation(slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path: Path,
                                              slurmft, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SECRETS.items():  # in the submitting shell, as users keep them
        monkeypatch.setenv(key, value)
    path = slurmft.write_config(tmp_path, tiny_model, chat_data)  # the product's defaults: a prepare job first
    jobs = slurmft.submit(path)
    run = tmp_path / "run"
    # the train job waits on the prepare job, the consolidation job on the train job
    assert slurm_cluster.squeue_reason(jobs["consolidate"]) == "Dependency"
    assert slurm_cluster.squeue_state(jobs["consolidate"]) == "PENDING"
    slurm_cluster.wait_state(jobs["train"], "COMPLETED", timeout=240)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=30, via="sacct")
    rows = slurmft.status_json(run)
    assert rows["train"]["state"] == rows["consolidate"]["state"] == "COMPLETED"
    assert rows["consolidate"]["words"] == "completed"
    # the run directory holds everything
    manifest = read_manifest(RunPaths.of(run))
    assert [(j["kind"], j["job_id"]) for j in manifest["jobs"]] == [
        ("prepare", jobs["prepare"]), ("train", jobs["train"]), ("consolidate", jobs["consolidate"])]
    assert manifest["jobs"][1]["dependency"] == f"afterok:{jobs['prepare']}"
    assert manifest["jobs"][2]["dependency"] == f"afterok:{jobs['train']}"
    assert (run / "prepared" / "slurmft-prepared.json").is_file()
    assert (run / "config.yaml").is_file() and (run / "scripts" / "train.sbatch").is_file()
    # ranks ran on both nodes and met through MASTER_ADDR from the allocation
    code, out, _ = slurmft.cli(["logs", str(run)])
    assert code == 0
    assert re.search(r"^0: ", out, re.M) and re.search(r"^1: ", out, re.M)  # srun --label: rank 0 and rank 1
    log = (run / "logs" / f"train-{jobs['train']}.out").read_text(errors="replace")
    # n1 (rank 0) answers on 127.0.0.2: the address came from its NodeAddr, not a 127.0.0.1 fallback
    assert "master=127.0.0.2:" in log
    # the deployable model exists
    assert (run / "model" / "config.json").is_file()
    # the trained weights (the newest checkpoint's, not the base model's) reached the export
    assert assert_export_matches_checkpoint(run, tiny_model)["checkpoint"].name == "checkpoint-4"
    assert list((run / "model").glob("model-*.safetensors"))
    # no secret reached any file of the run: scripts, config, manifest, logs, checkpoints, model
    for file in run.rglob("*"):
        if file.is_file():
            data = file.read_bytes()
            for key, value in SECRETS.items():
                assert value.encode() not in data, f"{key} leaked into {file}"


def test_failed_train_takes_its_consolidation_with_it(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                      tmp_path: Path, slurmft) -> None:
    wrong = tmp_path / "wrong-columns.jsonl"
    wrong.write_text(chat_data.read_text())  # valid when `submit` checks it...
    path = slurmft.write_config(tmp_path, tiny_model, wrong, prepare=IN_ALLOCATION)  # the train job must read it
    jobs = slurmft.submit(path)
    wrong.write_text('{"question": "2+2?", "answer": "4"}\n' * 8)  # ...replaced before the job reads it
    slurm_cluster.wait_state(jobs["train"], "FAILED", timeout=240)
    # issue 47: Slurm cancels the consolidation (--kill-on-invalid-dep=yes), it is not left pending forever in
    # DependencyNeverSatisfied
    slurm_cluster.wait_state(jobs["consolidate"], "CANCELLED", timeout=60)
    assert slurm_cluster.squeue_reason(jobs["consolidate"]) == "DependencyNeverSatisfied"
    rows = slurmft.status_json(tmp_path / "run")
    assert rows["train"]["state"] == "FAILED"
    log = (tmp_path / "run" / "logs" / f"train-{jobs['train']}.out").read_text(errors="replace")
    assert "setup error: data.datasets[0]" in log and "Traceback" not in log  # the user's error, said plainly
    assert f"train job {jobs['train']} did not succeed" in rows["consolidate"]["words"]
    code, out, _ = slurmft.cli(["status", str(tmp_path / "run")])  # the table says so in words too
    assert code == 0 and "cancelled by Slurm before it started" in out and f"slurmft resume {tmp_path / 'run'}" in out
    # resume with no complete checkpoint: says it starts at step 0; nothing stale is left to cancel
    code, out, err = slurmft.cli(["resume", str(tmp_path / "run")])
    assert code == 0, err
    assert "no complete checkpoint, training starts again at step 0" in err
    assert "cancelled" not in err
    again = started_jobs(out)
    slurm_cluster.wait_state(again["train"], "FAILED", timeout=240)  # the data is still wrong
    slurm_cluster.wait_state(again["consolidate"], "CANCELLED", timeout=60)
    code, out, _ = slurmft.cli(["cancel", str(tmp_path / "run")])
    assert code == 0 and "no live jobs to cancel" in out


def test_cancel_cancels_both_and_refuses_a_second_submit(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                         tmp_path: Path, slurmft) -> None:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, train={"max_steps": 400}, checkpoint={"every_steps": 200},
                                prepare=IN_ALLOCATION)  # cancel and a second submit: no data preparation in them
    jobs = slurmft.submit(path)
    # a second submit into the same live run directory is refused, nothing is clobbered
    before = (tmp_path / "run" / "manifest.json").read_text()
    code, _, err = slurmft.cli(["submit", str(path)])
    assert code == 2 and "already holds a live run" in err
    assert (tmp_path / "run" / "manifest.json").read_text() == before
    code, out, _ = slurmft.cli(["cancel", str(tmp_path / "run")])
    assert code == 0 and jobs["train"] in out and jobs["consolidate"] in out
    slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=60)
    slurm_cluster.wait_state(jobs["consolidate"], "CANCELLED", timeout=60)
    # who cancelled them: `slurmft cancel`, not Slurm (the consolidation said "cancelled by Slurm before it started:
    # train job T did not succeed (DependencyNeverSatisfied)"); what to run next stays `slurmft resume`
    rows = slurmft.status_json(tmp_path / "run")
    for kind in ("train", "consolidate"):
        assert rows[kind]["words"].startswith("cancelled by `slurmft cancel` ("), rows[kind]
        assert f"`slurmft resume {tmp_path / 'run'}`" in rows[kind]["words"] and "Slurm" not in rows[kind]["words"]
    assert f"before it started (it waited on train job {jobs['train']})" in rows["consolidate"]["words"]
    code, out, _ = slurmft.cli(["cancel", str(tmp_path / "run")])
    assert code == 0 and "no live jobs" in out


def test_two_nodes_by_two_tasks_shard_over_four_ranks(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                      tmp_path: Path, slurmft) -> None:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, resources={"tasks_per_node": 2},
                                train={"max_steps": 2}, consolidate={"enabled": False},
                                prepare=IN_ALLOCATION)  # four ranks' shards: no data preparation in them
    code, out, err = slurmft.cli(["submit", str(path)])
    assert code == 0, err
    job = out.split("train job: ")[1].split()[0]
    slurm_cluster.wait_state(job, "COMPLETED", timeout=300)
    reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "run" / "fsdp_report").glob("rank*.json"))]
    assert [r["rank"] for r in reports] == [0, 1, 2, 3] and {r["world_size"] for r in reports} == {4}
    for r in reports:  # real FSDP2 over 4 ranks on 2 nodes: every parameter a DTensor, ~1/4 of the bytes each
        assert r["param_types"] == ["DTensor"] and r["distributed_type"].endswith("FSDP")
        assert 0.2 < r["local_fraction"] < 0.3
    log = (tmp_path / "run" / "logs" / f"train-{job}.out").read_text(errors="replace")
    assert "nodes=n[1-2]" in log


def test_sbatch_refusal_is_reported_and_leaves_no_run_dir(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                          tmp_path: Path, slurmft) -> None:
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, cluster={"partition": "nosuchpartition"},
                                prepare=IN_ALLOCATION)  # sbatch's refusal of the train job itself
    code, _, err = slurmft.cli(["submit", str(path)])
    assert code == 2 and "sbatch refused the train job" in err and "partition" in err.lower(), err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    assert "set cluster.partition to one of: debug, wide" in err  # the fix, from the cluster's partitions
    # sbatch's own words once, inside slurmft's error (submitit printed them above it too)
    assert err.count("invalid partition specified") == 1 and err.startswith("error: sbatch refused"), err
    # with a prepare job (the default) accepted before the train job is refused: the prepare job is cancelled and the
    # run directory removed too (it was left with the cancelled prepare job, and a second submit said `slurmft resume`)
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, resources={"gpus_per_node": 9})
    code, _, err = slurmft.cli(["submit", str(path)])
    assert code == 2 and "sbatch refused the train job" in err and "cancelled prepare job" in err, err
    assert "resources.gpus_per_node" in err and not (tmp_path / "run").exists()
    assert err.lower().count("node configuration is not available") == 1, err
