"""`slurmft submit/status/logs/cancel` against the real local two-node Slurm cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from slurmft.cli import main
from slurmft.rundir import RunPaths, read_manifest

pytestmark = pytest.mark.slurm


def write_config(tmp_path: Path, model: Path, data: Path, **sections: dict) -> Path:
    cfg = {
        "name": "it",
        "output_dir": str(tmp_path / "run"),
        "executor": "slurm",
        "cluster": {"profile": "local-test", "time": "00:15:00"},
        "resources": {"nodes": 2, "gpus_per_node": 1, "cpus_per_task": 1, "exclusive": False},
        "model": {"name_or_path": str(model), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"datasets": [{"path": str(data)}], "max_seq_length": 128},
        "train": {"max_steps": 4, "per_device_batch_size": 2, "learning_rate": 1e-3, "warmup_ratio": 0.0},
        "checkpoint": {"every_steps": 2, "keep_last": 2},
        "consolidate": {"dtype": "float32", "resources": {"cpus_per_task": 1, "mem": "2G", "time": "00:10:00"}},
    }
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def submit(path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> dict[str, str]:
    code, out, err = cli(["submit", str(path), *overrides], capsys)
    assert code == 0, err
    jobs = dict(line.split(" job: ") for line in out.splitlines() if " job: " in line)
    assert set(jobs) == {"train", "consolidate"}, out
    return jobs


def status_json(run: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, dict]:
    code, out, err = cli(["status", str(run), "--json"], capsys)
    assert code == 0, err
    return {row["kind"]: row for row in json.loads(out)["jobs"]}


def test_submit_runs_train_then_consolidation(slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, tiny_model, chat_data)
    jobs = submit(path, capsys)
    run = tmp_path / "run"
    # the consolidation job waits on the train job
    assert slurm_cluster.squeue_reason(jobs["consolidate"]) == "Dependency"
    assert slurm_cluster.squeue_state(jobs["consolidate"]) == "PENDING"
    slurm_cluster.wait_state(jobs["train"], "COMPLETED", timeout=240)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=30, via="sacct")
    rows = status_json(run, capsys)
    assert rows["train"]["state"] == rows["consolidate"]["state"] == "COMPLETED"
    assert rows["consolidate"]["words"] == "finished successfully"
    # the run directory holds everything
    manifest = read_manifest(RunPaths.of(run))
    assert [(j["kind"], j["job_id"]) for j in manifest["jobs"]] == [("train", jobs["train"]),
                                                                      ("consolidate", jobs["consolidate"])]
    assert manifest["jobs"][1]["dependency"] == f"afterok:{jobs['train']}"
    assert (run / "config.yaml").is_file() and (run / "scripts" / "train.sbatch").is_file()
    # ranks ran on both nodes and met through MASTER_ADDR from the allocation
    code, out, _ = cli(["logs", str(run)], capsys)
    assert code == 0
    assert "0: " in out and "1: " in out  # srun --label: lines of rank 0 and rank 1
    log = (run / "logs" / f"train-{jobs['train']}.out").read_text()
    assert "master=127.0.0.1:" in log
    # the deployable model exists
    assert (run / "model" / "config.json").is_file()
    assert list((run / "model").glob("model-*.safetensors"))


def test_failed_train_leaves_consolidation_never_satisfied(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = tmp_path / "wrong-columns.jsonl"  # exists (passes submit-time checks); the job rejects it
    wrong.write_text('{"question": "2+2?", "answer": "4"}\n' * 8)
    path = write_config(tmp_path, tiny_model, wrong)
    jobs = submit(path, capsys)
    slurm_cluster.wait_state(jobs["train"], "FAILED", timeout=240)
    deadline = time.time() + 60
    while slurm_cluster.squeue_reason(jobs["consolidate"]) != "DependencyNeverSatisfied" and time.time() < deadline:
        time.sleep(0.5)
    assert slurm_cluster.squeue_reason(jobs["consolidate"]) == "DependencyNeverSatisfied"
    rows = status_json(tmp_path / "run", capsys)
    assert rows["train"]["state"] == "FAILED"
    assert "will never start" in rows["consolidate"]["words"]
    code, out, _ = cli(["status", str(tmp_path / "run")], capsys)  # the table says so in words too
    assert code == 0 and "will never start" in out
    code, out, _ = cli(["cancel", str(tmp_path / "run")], capsys)
    assert code == 0 and jobs["consolidate"] in out
    slurm_cluster.wait_state(jobs["consolidate"], "CANCELLED", timeout=30)


def test_cancel_cancels_both_and_refuses_a_second_submit(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, tiny_model, chat_data, train={"max_steps": 400}, checkpoint={"every_steps": 200})
    jobs = submit(path, capsys)
    # a second submit into the same live run directory is refused, nothing is clobbered
    before = (tmp_path / "run" / "manifest.json").read_text()
    code, _, err = cli(["submit", str(path)], capsys)
    assert code == 2 and "already holds a live run" in err
    assert (tmp_path / "run" / "manifest.json").read_text() == before
    code, out, _ = cli(["cancel", str(tmp_path / "run")], capsys)
    assert code == 0 and jobs["train"] in out and jobs["consolidate"] in out
    slurm_cluster.wait_state(jobs["train"], "CANCELLED", timeout=60)
    slurm_cluster.wait_state(jobs["consolidate"], "CANCELLED", timeout=60)
    code, out, _ = cli(["cancel", str(tmp_path / "run")], capsys)
    assert code == 0 and "no live jobs" in out
