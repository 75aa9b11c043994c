"""Preemption and watching a run on the real two-node cluster: a run preempted twice by the warning signal
(the first reaching one rank only) saves at one step boundary each time, is requeued under the same job
id, resumes exactly there and is consolidated once; it shows three
attempts in `status`, two markers in `slurmft plot`, a report that matches metrics.jsonl, one loss line per
step in the log; `status` and `runs` ask squeue and sacct at most once each (the calls are counted by
shims that exec the real commands). With `report_to: [wandb]` and WANDB_MODE=offline, the three attempts
write three offline W&B directories of one run id whose rows are steps 1..40, once each, in order; with
`tensorboard` as well, three event files in the one `tensorboard/` directory, steps 1..40 once each."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest
from runfixture import local_run

from slurmft.rundir import RunPaths, read_manifest
from slurmft.watch.run_totals import read_summaries
from tests.export_check import assert_export_matches_checkpoint
from tests.slurm.conftest import IN_ALLOCATION
from tests.slurm.jobs import metrics, rank_pid, wait_for
from tests.tracker_check import WANDB_HOME, tensorboard_steps, wandb_offline_runs

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
# W&B with no network; a key in the environment as users keep it (it must reach no file of the run)
WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_API_KEY": "wandbTopSecretValue0123456789abcdef01234567"}


def _wait(what: str, predicate, timeout: float = 240):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _calls(path: Path) -> list[str]:
    return [line.split()[0] for line in path.read_text().splitlines()]


@pytest.mark.every_slurm
def test_preempted_twice_status_plot_report_logs_wandb(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                       tmp_path: Path, slurmft, slurm_calls: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**WANDB_OFFLINE, **{k: str(tmp_path / "wandb-home" / k) for k in WANDB_HOME}}.items():
        monkeypatch.setenv(key, value)  # in the submitting shell: the job inherits it (sbatch --export=ALL)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    path = slurmft.write_config(tmp_path, tiny_model, chat_data, train={"max_steps": 40, "report_to": ["wandb", "tensorboard"]},
                                checkpoint={"every_steps": 20}, preemption={"lead_time_s": 30, "max_requeues": 3})
    jobs = slurmft.submit(path)
    run, job = tmp_path / "run", jobs["train"]
    for restart in (0, 1):  # the warning signal twice, a few steps into restart 0 and restart 1
        _wait(f"restart {restart} under way", lambda r=restart: sum(m["restart"] == r for m in metrics(run)) >= 4)
        if restart == 0:
            # Only rank 1 (on n2) gets this one: the ranks must still agree (the all-reduce of the flag) and
            # stop at one step boundary, or rank 0 trains on into a collective rank 1 never joins.
            os.kill(wait_for("rank 1's process", lambda: rank_pid(job, 1), timeout=30), signal.SIGUSR2)
        else:  # what Slurm's --signal=USR2@lead does: every rank of the step
            subprocess.run(["scancel", "--signal=USR2", job], check=True)
        _wait(f"requeue marker {job}-{restart}", lambda r=restart: (run / "requeue" / f"{job}-{r}").exists(), 120)
    slurm_cluster.wait_state(job, "COMPLETED", timeout=300)
    slurm_cluster.wait_state(jobs["consolidate"], "COMPLETED", timeout=240)
    # the same job id came back twice; the afterok consolidation ran once, after the final success
    assert [p.name for p in (run / "logs").glob("consolidate-*.out")] == [f"consolidate-{jobs['consolidate']}.out"]
    marker = json.loads((run / "checkpoints" / "checkpoint-40" / "COMPLETE").read_text())
    assert marker["restart"] == 2
    # the trained weights (the final checkpoint's, not the base model's) reached the export
    assert assert_export_matches_checkpoint(run, tiny_model)["checkpoint"].name == "checkpoint-40"
    stops = [json.loads((run / "requeue" / f"{job}-{r}").read_text())["step"] for r in (0, 1)]

    slurm_calls.write_text("")
    code, out, err = slurmft.cli(["status", str(run), "--json"])
    assert code == 0, err
    assert _calls(slurm_calls) == ["squeue", "sacct"]  # one each, however many jobs and restarts
    status = json.loads(out)
    attempts = status["attempts"]
    assert [(a["job_id"], a["restart"]) for a in attempts] == [(job, 0), (job, 1), (job, 2)]
    assert [a["reason"] for a in attempts[:2]] == ["preempted (warning signal), requeued"] * 2
    assert attempts[2]["reason"] == "completed" and attempts[2]["last_step"] == 40
    assert [a["last_step"] for a in attempts[:2]] == stops
    assert [a["resumed_from_step"] for a in attempts[1:]] == stops
    assert status["progress"]["step"] == 40 and status["progress"]["max_steps"] == 40
    assert status["checkpoint"]["step"] == 40 and status["model"] == str(run / "model")

    # the plot: a real picture with a marker at each preemption step
    from slurmft.watch.plot import marker_steps

    assert [m.step for m in marker_steps(metrics(run))] == stops
    png = tmp_path / "loss.png"
    code, _, err = slurmft.cli(["plot", str(run), "--out", str(png)])
    assert code == 0, err
    import numpy as np
    from PIL import Image

    img = Image.open(png)
    assert img.format == "PNG" and img.size[0] >= 600 and img.size[1] >= 300
    assert np.asarray(img.convert("L")).astype(float).std() > 10  # not blank
    if os.environ.get("SLURMFT_DOCS_PLOT"):  # how docs/ got its picture of a real run
        shutil.copy(png, os.environ["SLURMFT_DOCS_PLOT"])

    # the report the consolidation job wrote matches metrics.jsonl
    report = (run / "report.md").read_text()
    rows = metrics(run)
    assert f"{rows[-1]['loss']:.4f}" in report
    assert "preempted (warning signal), requeued" in report and str(run / "model") in report
    assert (run / "loss.png").is_file()

    # the log: each step's loss line once (only global rank 0 prints them), three starts of the same job
    log = (run / "logs" / f"train-{job}.out").read_text(errors="replace")
    for step in range(1, 41):
        lines = re.findall(rf"\bstep {step}/40 +loss", log)
        assert len(lines) == 1, f"step {step} has {len(lines)} loss lines, not one"
    ones = [s for s in range(1, 41) if len(re.findall(rf"^1: .*\bstep {s}/40 +loss", log, re.M))]
    assert ones == []  # rank 1 (node n2) never prints the per-step line
    assert len(re.findall(r"^\[slurmft\] job=\d+ restart=", log, re.M)) == 3

    # W&B, offline: one directory per attempt, one run id (the run's), steps 1..40 once each, in order,
    # with metrics.jsonl's losses; status and the report name the run; the API key reached no file
    wandb_id = f"{RunPaths.of(run).run_id}-{int(read_manifest(RunPaths.of(run))['created'])}"
    offline = wandb_offline_runs(run)
    assert [(o["dir"].name.endswith(f"-{wandb_id}"), o["id"], o["resume"]) for o in offline] == [(True, wandb_id, True)] * 3
    steps = [row["_step"] for o in offline for row in o["rows"]]
    assert steps == list(range(1, 41))
    assert all(row["train/global_step"] == row["_step"] for o in offline for row in o["rows"])
    assert [len(o["rows"]) for o in offline] == [stops[0], stops[1] - stops[0], 40 - stops[1]]
    loss = {m["step"]: m["loss"] for m in rows}
    assert {row["_step"]: row["train/loss"] for o in offline for row in o["rows"]} == loss
    assert status["tracker"]["wandb"]["id"] == wandb_id
    # W&B's summary gives the whole run (transformers' figures cover one attempt: after the second stop, the mean
    # loss of the last steps alone), computed here from metrics.jsonl's per-step losses (one line per step); each
    # attempt's own figures stay, labelled last_attempt/; the runtime is the three attempts' added up
    summary = offline[-1]["summary"]
    assert summary["train_loss"] == pytest.approx(sum(loss.values()) / 40, rel=1e-9)
    ends = read_summaries(RunPaths.of(run).train_summary)
    assert [(e["restart"], e["from_step"], e["step"]) for e in ends] == [(0, 0, stops[0]), (1, *stops), (2, stops[1], 40)]
    assert summary["train_loss_steps"] == 40 and summary["train_attempts"] == 3
    assert summary["last_attempt/train_loss"] == pytest.approx(sum(loss[s] for s in range(stops[1] + 1, 41))
                                                               / (40 - stops[1]), rel=1e-6)
    assert summary["train_runtime"] == pytest.approx(sum(e["train_runtime"] for e in ends), abs=1e-3)
    assert summary["last_attempt/train_runtime"] == ends[-1]["train_runtime"] < summary["train_runtime"]
    assert offline[0]["summary"]["last_attempt/train_loss"] == pytest.approx(
        sum(loss[s] for s in range(1, stops[0] + 1)) / stops[0], rel=1e-6)
    assert f"| train loss, whole run | {summary['train_loss']:.4f} over 40 of 40 steps " in report
    assert re.search(rf"step 40/40  train_loss={summary['train_loss']:.4g} train_loss_steps=40 .* train_attempts=3 "
                     rf"last_attempt/train_loss={summary['last_attempt/train_loss']:.4g} ", log)
    code, out, _ = slurmft.cli(["status", str(run)])
    assert code == 0 and f"W&B: run {wandb_id} in huggingface (3 attempt(s), 3 offline)" in out
    assert f"wandb sync {run / 'wandb'}/offline-run-*-{wandb_id}" in out
    assert f"W&B: run {wandb_id}" in report
    sync = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", *map(str, (run / "wandb").glob(
        f"offline-run-*-{wandb_id}"))], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "Would sync 3 run(s)" in sync.stdout + sync.stderr, sync.stdout + sync.stderr
    for file in run.rglob("*"):
        assert not file.is_file() or WANDB_OFFLINE["WANDB_API_KEY"].encode() not in file.read_bytes(), file

    # TensorBoard: each attempt's event file in the one RUN/tensorboard/, together steps 1..40 once each
    bounds = [0, *stops, 40]
    assert tensorboard_steps(run / "tensorboard") == [list(range(a + 1, b + 1)) for a, b in pairwise(bounds)]


@pytest.mark.every_slurm
def test_runs_lists_every_run_with_one_squeue_and_one_sacct(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                              tmp_path: Path, slurmft, slurm_calls: Path) -> None:
    root = tmp_path / "runs"
    submitted = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        path = slurmft.write_config(tmp_path / name, tiny_model, chat_data, train={"max_steps": 400},
                                    checkpoint={"every_steps": 200},
                                    prepare=IN_ALLOCATION)  # one squeue and one sacct for every run: no preparation
        cfg = path.read_text().replace(str(tmp_path / name / "run"), str(root / name))
        path.write_text(cfg)
        submitted.append(slurmft.submit(path))
    local_run(root, "c")
    (root / "d").mkdir()
    (root / "d" / "manifest.json").write_text("{torn")
    try:
        slurm_calls.write_text("")
        code, out, err = slurmft.cli(["runs", str(root)])
        assert code == 0, err
        assert _calls(slurm_calls) in (["squeue"], ["squeue", "sacct"]), slurm_calls.read_text()
        lines = {line.split()[-1]: line.split() for line in out.splitlines()[1:] if not line.startswith(("/", " "))}
        assert set(lines) >= {"a", "b", "c", "d"}, out
        assert lines["a"][1] in ("queued", "training") and lines["b"][1] in ("queued", "training")
        assert lines["c"][1:4] == ["trained", "12/12", "2.4000"]
        assert lines["d"][1] == "broken"

        slurm_calls.write_text("")
        code, _, err = slurmft.cli(["status", str(root / "a")])
        assert code == 0, err
        assert _calls(slurm_calls) == ["squeue", "sacct"]  # no per-job scontrol any more

        # accounting unreachable: status still answers, and says what it could not ask
        (slurm_calls.parent / "counting-bin" / "sacct").write_text("#!/bin/sh\necho 'slurmdbd down' >&2\nexit 1\n")
        code, out, err = slurmft.cli(["status", str(root / "a")])
        assert code == 0, err
        assert "note: sacct did not answer" in out and "states of finished jobs are unknown" in out
        (root / "a" / "metrics.jsonl").unlink(missing_ok=True)
        code, out, err = slurmft.cli(["status", str(root / "a")])
        assert code == 0 and "progress: " in out and "Traceback" not in out + err
        (root / "a" / "manifest.json").write_text("{torn")
        code, out, err = slurmft.cli(["status", str(root / "a")])
        assert code == 2 and "manifest.json is corrupt" in err and "Traceback" not in err

        # issue 47: a train job that ends without success takes its consolidation job with it (Slurm cancels it,
        # --kill-on-invalid-dep=yes), on both Slurm versions: nothing slurmft submitted waits for a dependency
        # that can never be satisfied
        first = submitted[0]
        subprocess.run(["scancel", first["train"]], check=True)
        slurm_cluster.wait_state(first["train"], "CANCELLED", timeout=60)
        slurm_cluster.wait_state(first["consolidate"], "CANCELLED", timeout=60)
        assert slurm_cluster.squeue_reason(first["consolidate"]) == "DependencyNeverSatisfied"
    finally:
        for jobs in submitted:
            subprocess.run(["scancel", *jobs.values()], check=False)
