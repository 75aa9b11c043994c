"""A sweep on the real two-node cluster (docs/sweeps.md): one prepare job, one train array, one consolidation
array, one evaluation array; each point's model bitwise equal to the same config run alone; one task preempted
while the others run; one task cancelled, then `slurmft resume SWEEP_DIR` re-submits that point alone; the points
ranked by their evaluation scores (lm-eval on the tiny example's task), the best linked by the evaluation jobs.

One sweep serves every test here: two learning rates by two seeds, 12 steps, each point with a twin run alone. Not
the shared reference run's 40 steps (the point (1e-3, 42) would be that run, and three twins enough): eight runs of
12 steps cost ~40 % less job time than seven of 40, and 10 steps after the warning signal's step 2 are still room
for it. The twins prepare in their allocation (``IN_ALLOCATION``: it saves four job starts; they are compared
bitwise with points whose data a prepare job packed, which is that check too). Only the sweep is evaluated (the
twins' models are compared bitwise): one lm-eval run per point, fine-tuned model only, on one CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from slurmft.eval_results import named_score, read_summary
from tests.conftest import REPO_ROOT, need_model_job_python
from tests.slurm import jobs
from tests.slurm.conftest import IN_ALLOCATION

pytestmark = pytest.mark.slurm

NAME = "sweepms"
RATES = (1e-3, 2e-3)
SEEDS = (42, 7)
PREEMPTED = 1  # the task given the warning signal: point (1e-3, seed 7)
CANCELLED = 3  # the task cancelled (scancel), then resumed: point (2e-3, seed 7)
TRAIN = {"max_steps": 12}
CHECKPOINT = {"every_steps": 4, "keep_last": 2}
TINY_TASK = REPO_ROOT / "examples" / "tiny" / "tasks" / "tiny_choice.yaml"


def _sacct(names: list[str], since: str) -> list[tuple[str, str, str]]:
    """(job id, name, state) of every job of these names submitted since ``since`` (sacct -X; array tasks as
    ``<array>_<task>``; a task cancelled before it started is not listed)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-S", since, "--name", ",".join(names), "-o",
                          "JobID,JobName,State"], capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def sweep_run(slurm_cluster, tiny_model: Path, chat_data: Path, tmp_path_factory: pytest.TempPathFactory,
              config_writer) -> dict:
    """The sweep and the three twins, submitted side by side; task PREEMPTED gets the warning signal after its
    step 2 while another task runs; task CANCELLED is cancelled after its step 2 and the sweep resumed once the
    others are done; everything waited for."""
    tmp = tmp_path_factory.mktemp("sweep")
    path = config_writer.write_config(tmp, tiny_model, chat_data, train=TRAIN, checkpoint=CHECKPOINT)
    cfg = yaml.safe_load(path.read_text())
    cfg.update(name=NAME, sweep={"grid": {"train.learning_rate": list(RATES), "train.seed": list(SEEDS)},
                                 "parallel": 2},
               eval={"python": need_model_job_python("eval"), "tasks": [str(TINY_TASK)], "backend": "hf",
                     "compare_base": False, "resources": {"gpus": 0, "cpus_per_task": 1, "mem": "8G",
                                                          "time": "00:10:00"}})
    path.write_text(yaml.safe_dump(cfg))
    twins: dict[int, tuple[Path, dict]] = {}
    for index, (rate, seed) in enumerate((r, s) for r in RATES for s in SEEDS):
        (tmp / f"twin-{index}").mkdir()
        twin = config_writer.write_config(tmp / f"twin-{index}", tiny_model, chat_data,
                                          train={**TRAIN, "learning_rate": rate, "seed": seed},
                                          checkpoint=CHECKPOINT, prepare=IN_ALLOCATION)
        twins[index] = (tmp / f"twin-{index}" / "run", twin)
    started = {}
    for index, (_, twin) in twins.items():
        started[index] = jobs.started_here(["submit", str(twin)])
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    out = jobs.started_here(["submit", str(path)])
    root = tmp / "run"
    record = json.loads((root / "sweep.json").read_text())
    points = [Path(p["dir"]) for p in record["points"]]
    array = out["train"]
    task = f"{array}_{PREEMPTED}"
    jobs.wait_for("the preempted point's step 2", lambda: any(m["step"] >= 2 for m in jobs.metrics(points[PREEMPTED])),
                  timeout=300)
    running = [i for i in range(len(points)) if i != PREEMPTED and slurm_cluster.squeue_state(f"{array}_{i}") == "RUNNING"]
    _warn_ranks(task)
    jobs.wait_for("the task's restart 1", lambda: jobs.restarts(task) >= 1, timeout=120)
    jobs.wait_for("the cancelled point's step 2", lambda: any(m["step"] >= 2 for m in jobs.metrics(points[CANCELLED])),
                  timeout=400)
    subprocess.run(["scancel", f"{array}_{CANCELLED}"], check=True)  # that task only
    slurm_cluster.wait_state(f"{array}_{CANCELLED}", "CANCELLED", timeout=120)
    for kind in ("consolidate", "eval"):  # aftercorr: invalid now
        slurm_cluster.wait_state(f"{out[kind]}_{CANCELLED}", "CANCELLED", timeout=120)
    for i in range(len(points)):
        if i != CANCELLED:
            slurm_cluster.wait_state(f"{array}_{i}", "COMPLETED", timeout=600)
            slurm_cluster.wait_state(f"{out['consolidate']}_{i}", "COMPLETED", timeout=300)
    resumed = jobs.started_here(["resume", str(root)])  # the evaluation tasks of the others may still run: it leaves them alone
    for kind in ("train", "consolidate", "eval"):
        slurm_cluster.wait_state(resumed[f"point {points[CANCELLED].name}: {kind}"], "COMPLETED", timeout=400)
    for i in range(len(points)):
        if i != CANCELLED:
            slurm_cluster.wait_state(f"{out['eval']}_{i}", "COMPLETED", timeout=300)
    best_after_jobs = os.readlink(root / "best")  # what the evaluation jobs linked, before any `status` does
    for ids in started.values():
        slurm_cluster.wait_state(ids["train"], "COMPLETED", timeout=300)
        slurm_cluster.wait_state(ids["consolidate"], "COMPLETED", timeout=240)
    return {"root": root, "record": record, "points": points, "jobs": out, "running_beside": running, "since": since,
            "resumed": resumed, "best_after_jobs": best_after_jobs,
            "twins": {i: run / "model" for i, (run, _) in twins.items()}}


def _warn_ranks(task: str) -> None:
    """What Slurm does at ``--signal=USR2@lead``: the warning signal to every rank of the array task. Not
    `scancel --signal=USR2 ARRAY_TASK` (tests/slurm/jobs.py): on 22.05 slurmctld answers it "Job can not be altered
    now" while the array has pending tasks, and scancel retries until it lands, again, in the requeued task. Both
    nodes' ranks run on this machine; they are found by the task's own job id (``squeue %A``)."""
    own = subprocess.run(["squeue", "-h", "-j", task, "-o", "%A"], capture_output=True, text=True,
                         check=True).stdout.strip()
    pids = jobs.wait_for(f"the ranks of {task}", lambda: (p := jobs.rank_pids(own)) and len(p) == 2 and p)
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR2)


def test_one_prepare_job_one_train_array_one_consolidation_array(sweep_run: dict, slurm_cluster) -> None:
    record, out = sweep_run["record"], sweep_run["jobs"]
    assert [(j["kind"], j["job_id"]) for j in record["jobs"]] == [
        ("prepare", out["prepare"]), ("train", out["train"]), ("consolidate", out["consolidate"]), ("eval", out["eval"])]
    assert record["jobs"][2]["dependency"] == f"aftercorr:{out['train']}"
    assert record["jobs"][3]["dependency"] == f"aftercorr:{out['consolidate']}"
    slurm_cluster.wait_state(f"{out['eval']}_2", "COMPLETED", timeout=30, via="sacct")
    by_name: dict[str, set[str]] = {}
    for job_id, name, _ in _sacct([f"{NAME}-{k}" for k in ("prepare", "train", "consolidate", "eval")],
                                  sweep_run["since"]):
        by_name.setdefault(name, set()).add(job_id)
    # the cancelled point's consolidation and evaluation tasks never started (its train task failed: aftercorr), so
    # sacct has no line for them; the resumed point's own jobs are named after the point
    assert by_name == {f"{NAME}-prepare": {out["prepare"]},
                       f"{NAME}-train": {f"{out['train']}_{i}" for i in range(4)},
                       f"{NAME}-consolidate": {f"{out['consolidate']}_{i}" for i in range(4) if i != CANCELLED},
                       f"{NAME}-eval": {f"{out['eval']}_{i}" for i in range(4) if i != CANCELLED}}
    # each evaluation task ran its point's own eval script, after that point's consolidation task
    for i, point in enumerate(sweep_run["points"]):
        if i != CANCELLED:
            log = (point / "logs" / f"eval-{out['eval']}_{i}.out").read_text(errors="replace")
            assert "eval: wrote" in log, log[-2000:]
    # two seeds: two prepared sets, both made by the one prepare job; the other points link to them
    points = sweep_run["points"]
    assert [p.name for p in points] == ["learning_rate-0.001_seed-42", "learning_rate-0.001_seed-7",
                                        "learning_rate-0.002_seed-42", "learning_rate-0.002_seed-7"]
    assert not (points[0] / "prepared").is_symlink() and not (points[1] / "prepared").is_symlink()
    assert (points[2] / "prepared").resolve() == (points[0] / "prepared").resolve()
    assert (points[3] / "prepared").resolve() == (points[1] / "prepared").resolve()


def test_every_point_equals_its_config_run_alone(sweep_run: dict, slurmft) -> None:
    for index, point in enumerate(sweep_run["points"]):
        slurmft.assert_same_model(point / "model", sweep_run["twins"][index])
    # the points differ: a sweep that trained one config four times would pass the line above for none but one
    models = {(p / "model" / "model-00001-of-00001.safetensors").read_bytes() for p in sweep_run["points"]}
    assert len(models) == 4


def test_a_preempted_task_is_requeued_alone(sweep_run: dict) -> None:
    array = sweep_run["jobs"]["train"]
    assert sweep_run["running_beside"], "no other task ran when the warning signal came"
    assert jobs.restarts(f"{array}_{PREEMPTED}") == 1
    for i in range(4):
        if i != PREEMPTED:
            assert jobs.restarts(f"{array}_{i}") == 0
    steps = jobs.metrics(sweep_run["points"][PREEMPTED])
    assert sorted(m["step"] for m in steps) == list(range(1, TRAIN["max_steps"] + 1))
    assert {m["restart"] for m in steps} == {0, 1}
    # the ranks name the task as its point's manifest does (its requeue marker too), so `status POINT` counts its steps
    assert {m["job_id"] for m in steps} == {f"{array}_{PREEMPTED}"}
    assert (sweep_run["points"][PREEMPTED] / "requeue" / f"{array}_{PREEMPTED}-0").is_file()
    log = (sweep_run["points"][PREEMPTED] / "logs" / f"train-{array}_{PREEMPTED}.out").read_text(errors="replace")
    assert "requeueing" in log


def test_a_cancelled_task_is_resumed_alone_and_the_sweep_ranks_four_models(sweep_run: dict, slurmft) -> None:
    points = sweep_run["points"]
    assert set(sweep_run["resumed"]) == {f"point {points[CANCELLED].name}: {kind}"
                                         for kind in ("train", "consolidate", "eval")}
    steps = jobs.metrics(points[CANCELLED])
    assert {m["step"] for m in steps} == set(range(1, TRAIN["max_steps"] + 1))  # trained in two jobs
    record = json.loads((sweep_run["root"] / "sweep.json").read_text())
    assert record["jobs"][-1]["kind"] == "resume" and list(record["jobs"][-1]["points"]) == [points[CANCELLED].name]
    code, out, err = slurmft.cli(["status", str(sweep_run["root"]), "--json"])
    assert code == 0, err
    shown = json.loads(out)
    rows = shown["points"]
    assert [r["state"] for r in rows] == ["done"] * 4
    # ranked by the evaluation (the file has an eval section: the default), the highest score first, not by the loss:
    # each point's score is its fine-tuned model's headline score (acc_norm) in its eval/summary.json
    assert shown["select"] == {"metric": "eval", "mode": "max"}
    scores = [named_score(read_summary(p), "eval") for p in points]
    assert all(s is not None and 0 <= s <= 1 for s in scores), scores
    assert [r["score"] for r in rows] == scores and [r["score"] for r in rows] != [r["loss"] for r in rows]
    expected = sorted(range(4), key=lambda i: -scores[i])  # ties: the earlier point first
    assert [r["rank"] for r in rows] == [expected.index(i) + 1 for i in range(4)]
    best = rows[expected[0]]
    # the models are bitwise those of the runs alone and lm-eval's log-likelihoods are deterministic, so this is
    # always so here: the evaluation's best point is not the loss's (a ranking by loss would fail the lines below)
    assert best["name"] != min(rows, key=lambda r: r["loss"])["name"], rows
    assert shown["best"] == best["name"]
    assert sweep_run["best_after_jobs"] == f"{best['name']}/model"  # linked by the last evaluation job, before status
    assert (sweep_run["root"] / "best").resolve() == (Path(best["dir"]) / "model").resolve()
    code, out, err = slurmft.cli(["status", str(sweep_run["root"])])
    assert code == 0 and f"best: {best['name']}" in out and "train.learning_rate=0.002 train.seed=7" in out
    assert "eval: tiny_choice acc_norm (max)" in out.splitlines()[1], out  # the score eval stands for, named


@pytest.mark.every_slurm  # what squeue and sacct say of an array's never-started tasks is version-bound: both versions
def test_cancel_of_the_sweep_directory_cancels_every_points_jobs(slurm_cluster, tiny_model: Path, chat_data: Path,
                                                                 tmp_path: Path, slurmft) -> None:
    """Cancelled while queued (no step trains): the prepare job, both arrays' tasks; status says so per point."""
    path = slurmft.write_config(tmp_path, tiny_model, chat_data)
    cfg = yaml.safe_load(path.read_text())
    cfg.update(name="sweepcancel", sweep={"grid": {"train.learning_rate": [1e-3, 2e-3]}})
    path.write_text(yaml.safe_dump(cfg))
    code, out, err = slurmft.cli(["submit", str(path)])
    assert code == 0, err
    started = jobs.started_jobs(out)
    # each array said as one, with its points (it said "train job: 11" of a 2-point array)
    assert f"train jobs: array {started['train']} (2 points, 2 at a time)" in out, out
    assert f"prepare job: {started['prepare']}\n" in out, out
    for name in ("learning_rate-0.001", "learning_rate-0.002"):  # what each array point trains by, for its watchers
        manifest = json.loads((tmp_path / "run" / name / "manifest.json").read_text())
        assert manifest["objective"] == {"method": "sft", "packed": cfg["data"].get("packing", True)}, manifest
    code, out, err = slurmft.cli(["cancel", str(tmp_path / "run")])
    assert code == 0, err
    cancelled = set(out.removeprefix("cancelled: ").strip().split(", "))
    assert started["prepare"] in cancelled and {f"{started['train']}_{i}" for i in range(2)} <= cancelled
    slurm_cluster.wait_state(started["prepare"], "CANCELLED", timeout=60)
    # array tasks cancelled while pending have no line of their own in `squeue -j`/sacct: status reads them from the
    # array's record (squeue's JobArrayID, <array>_[0-1])
    states = jobs.wait_for("both points cancelled", lambda: (
        s := [r["state"] for r in json.loads(slurmft.cli(["status", str(tmp_path / "run"), "--json"])[1])["points"]]
    ) == ["cancelled", "cancelled"] and s, timeout=60, poll=2)
    assert states == ["cancelled", "cancelled"]
    train = slurmft.status_json(tmp_path / "run" / "learning_rate-0.002")["train"]  # who: slurmft cancel, not Slurm
    assert train["words"].startswith("cancelled by `slurmft cancel` (") and "Slurm" not in train["words"], train
    # resumed: each point its own chain; the second point's link to the prepared set that was never made is dropped,
    # so it prepares its own (the run alone's prepare job then writes a directory there)
    code, out, err = slurmft.cli(["resume", str(tmp_path / "run")])
    assert code == 0, err
    resumed = jobs.started_jobs(out)
    names = ["learning_rate-0.001", "learning_rate-0.002"]
    assert set(resumed) == {f"point {n}: {kind}" for n in names for kind in ("prepare", "train", "consolidate")}
    assert not (tmp_path / "run" / names[1] / "prepared").is_symlink()
    code, out, err = slurmft.cli(["cancel", str(tmp_path / "run")])  # and cancelled again: this test trains nothing
    assert code == 0 and set(out.removeprefix("cancelled: ").strip().split(", ")) >= {
        resumed[f"point {n}: train"] for n in names}, out + err
