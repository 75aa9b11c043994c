"""Realistic run directories on disk for the login-side watching tests (progress, attempts, plot, report, runs, logs).

``preempted_run`` is what a Slurm run of 36 steps leaves after two preemptions, written the way
the job writes it: job 100, restart 0 saved at step 12 after a warning signal (requeue marker
``100-0``); restart 1 was killed hard at step 25 (Slurm requeued it, no marker, no end line in ``train_summary.jsonl``)
and restart 2 resumed from the periodic checkpoint-20 and finished. One logged step per second, 30 s of queue and
start-up between attempts. ``metrics.jsonl`` lines carry ``job_id``/``restart`` as MetricsLog writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

T0 = 1_700_000_000.0
MAX_STEPS = 36

CONFIG = {
    "name": "watch", "executor": "slurm", "output_dir": "",
    "cluster": {"profile": "local-test", "partition": "debug", "time": "00:30:00"},
    "resources": {"nodes": 2, "gpus_per_node": 8, "tasks_per_node": 1},
    "model": {"name_or_path": "/models/tiny", "dtype": "float32"},
    "data": {"datasets": [{"path": "/data/lima.jsonl", "weight": 1.0}], "max_seq_length": 256, "packing": True},
    "train": {"max_steps": MAX_STEPS, "per_device_batch_size": 2, "gradient_accumulation_steps": 1,
              "learning_rate": 1e-3, "lr_scheduler": "cosine", "warmup_ratio": 0.1},
    "checkpoint": {"every_steps": 10, "keep_last": 2},
    "preemption": {"signal": "USR2", "lead_time_s": 60, "max_requeues": 3},
}


def record(step: int, t: float, job: str, restart: int, loss: float | None = None) -> dict[str, Any]:
    """One metrics.jsonl line as MetricsLog writes it."""
    return {"step": step, "time": t, "epoch": step / 40, "loss": 3.0 - step * 0.05 if loss is None else loss,
            "loss_steps": 1, "learning_rate": 1e-3 * (1 - step / (MAX_STEPS + 1)), "grad_norm": 1.5, "tokens_per_s": 1000.0 + step,
            "num_input_tokens_seen": 512 * step, "peak_rss_mib": 500.0 + step, "peak_gpu_mem_mib": None,
            "job_id": job, "restart": restart}


def attempt_records(job: str, restart: int, steps: range, t_start: float) -> list[dict[str, Any]]:
    """Records one second apart."""
    return [record(s, t_start + i, job, restart) for i, s in enumerate(steps)]


def write_checkpoint(run: Path, step: int, complete: bool, payload: int = 1000, t: float | None = None) -> Path:
    """checkpoint-<step>/ with two shard files of ``payload`` bytes, and COMPLETE when complete."""
    ckpt = run / "checkpoints" / f"checkpoint-{step}"
    (ckpt / "pytorch_model_fsdp_0").mkdir(parents=True)
    for rank in (0, 1):
        (ckpt / "pytorch_model_fsdp_0" / f"__{rank}_0.distcp").write_bytes(b"x" * payload)
    if complete:
        (ckpt / "COMPLETE").write_text(json.dumps({"t": t or T0, "step": step}) + "\n")
    return ckpt


def write_metrics(run: Path, records: list[dict[str, Any]], tail: str = "") -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def preempted_run(root: Path, name: str = "watch") -> Path:
    """The Slurm run described in the module docstring (finished training, not consolidated)."""
    run = root / name
    (run / "requeue").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "name": name, "output_dir": str(run)}))
    manifest = {"version": 2, "name": name, "executor": "slurm", "created": T0 - 100, "run_id": "r1",
                "jobs": [{"kind": "train", "job_id": "100", "attempt": 1, "submitted": T0 - 100},
                         {"kind": "consolidate", "job_id": "101", "attempt": 1, "submitted": T0 - 99}],
                "attempts": [{"attempt": 1, "how": "submit", "time": T0 - 100, "train_job": "100",
                              "consolidate_job": "101", "resumed_from": None, "resumed_from_step": None,
                              "previous": None}]}
    (run / "manifest.json").write_text(json.dumps(manifest))
    a0 = attempt_records("100", 0, range(1, 13), T0)            # steps 1..12, ends T0+11
    a1 = attempt_records("100", 1, range(13, 26), T0 + 41)      # 30 s later; steps 13..25, ends T0+53
    a2 = attempt_records("100", 2, range(21, 37), T0 + 83)      # resumed from checkpoint-20; ends T0+98
    write_metrics(run, a0 + a1 + a2)
    # each attempt whose training loop ended (not restart 1: killed) wrote transformers' figures of its own steps
    ends = [{"step": 12, "from_step": 0, "train_runtime": 11.5, "train_loss": 2.5, "train_samples_per_second": 4.2,
             "job_id": "100", "restart": 0},
            {"step": 36, "from_step": 20, "train_runtime": 15.5, "train_loss": 1.5, "train_samples_per_second": 4.1,
             "job_id": "100", "restart": 2}]
    (run / "train_summary.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ends))
    (run / "requeue" / "100-0").write_text(json.dumps({"step": 12, "job_id": "100", "restart": 0,
                                                      "t": T0 + 11.5}) + "\n")
    write_checkpoint(run, 30, complete=True, payload=1000, t=T0 + 92)
    write_checkpoint(run, 36, complete=True, payload=2000, t=T0 + 98)
    write_checkpoint(run, 40, complete=False, payload=5)  # a torn save: never the resume point
    reports = run / "fsdp_report"
    reports.mkdir()
    for rank, rss in ((0, 812.5), (1, 640.25)):
        (reports / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": 2, "device": "cpu",
                                                              "local_bytes": 5_000_000, "peak_rss_mib": rss}))
    (run / "logs").mkdir()
    log = []
    for restart, nodes in ((0, "n[1-2]"), (1, "n[1-2]"), (2, "n1,n2")):
        log.append(f"[slurmft] job=100 restart={restart} nodes={nodes} master=127.0.0.1:20100")
        log += [f"0: [slurmft rank0 12:00:0{restart}] step {restart + 1}/36  loss 2.0000",
                f"1: rank one says hello in attempt {restart}"]
    (run / "logs" / "train-100.out").write_text("\n".join(log) + "\n")
    return run


def slurm_rows(state: str = "COMPLETED", restarts: int = 2, cons_state: str = "PENDING") -> list[dict[str, Any]]:
    """What slurmft.watch.status.job_rows returns for preempted_run's manifest."""
    return [{"kind": "train", "job_id": "100", "attempt": 1, "state": state, "reason": "", "elapsed": "",
             "exit_code": "0:0", "restarts": restarts, "words": ""},
            {"kind": "consolidate", "job_id": "101", "attempt": 1, "state": cons_state, "reason": "Dependency",
             "elapsed": "", "exit_code": "", "restarts": 0, "words": ""}]


def local_run(root: Path, name: str = "local", state: str = "COMPLETED", steps: int = 12) -> Path:
    """A finished local run: one train job, two per-rank log files."""
    run = root / name
    (run / "submitit").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "name": name, "executor": "local",
                                                     "train": {**CONFIG["train"], "max_steps": steps}}))
    logs = [str(run / "submitit" / f"4242_{r}_log.out") for r in (0, 1)]
    for r, path in enumerate(logs):
        Path(path).write_text(f"slurmft rank {r}: completed at step {steps}\n")
        Path(path).with_suffix(".err").write_text(f"[slurmft rank{r} 12:00:00] rank {r} stderr\n")
    manifest = {"version": 2, "name": name, "executor": "local", "created": T0, "run_id": "r2",
                "jobs": [{"kind": "train", "job_id": "4242", "attempt": 1, "submitted": T0, "pid": 4242,
                          "logs": logs, "state": state}]}
    (run / "manifest.json").write_text(json.dumps(manifest))
    write_metrics(run, attempt_records("4242", 0, range(1, steps + 1), T0))
    return run
