"""Sweeps on the login side (slurmft/sweep.py, slurmft/plan/sweep_checks.py, the array scripts): the points, their
names and configs, every refusal before anything is written; and one sweep on the local executor."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from cli_runner import cli

from slurmft.config_loading import load_config
from slurmft.errors import ConfigError
from slurmft.profiles import load_profile
from slurmft.sweep import FIXED, Sweep, load_sweep, point_name, points_of

DATA = Path(__file__).parent / "data"


def write(tmp_path: Path, sweep: dict | None = None, **sections: object) -> Path:
    """A sweep file: the cluster tests' two-node shape, a model that need not exist (nothing here reads it)."""
    cfg: dict = {
        "name": "sw", "output_dir": "out", "executor": "slurm",
        "cluster": {"profile": "local-test", "time": "00:15:00"},
        "resources": {"nodes": 2, "gpus_per_node": 1, "cpus_per_task": 1, "exclusive": False},
        "model": {"name_or_path": "org/model"},
        "data": {"datasets": [{"path": "data/chat.jsonl"}], "max_seq_length": 64},
        "train": {"max_steps": 4, "learning_rate": 1e-3},
        "sweep": sweep if sweep is not None else {"grid": {"train.learning_rate": [1e-5, 3e-5],
                                                           "train.seed": [1, 2]}, "parallel": 2},
    }
    cfg.update(sections)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_grid_is_the_product_in_the_files_order_with_readable_names(tmp_path: Path) -> None:
    sweep = load_sweep(write(tmp_path))
    assert sweep is not None
    assert [p.name for p in sweep.points] == ["learning_rate-1e-05_seed-1", "learning_rate-1e-05_seed-2",
                                              "learning_rate-3e-05_seed-1", "learning_rate-3e-05_seed-2"]
    assert [(c.train.learning_rate, c.train.seed) for c in sweep.configs] == [(1e-5, 1), (1e-5, 2), (3e-5, 1), (3e-5, 2)]
    for point, cfg in zip(sweep.points, sweep.configs, strict=True):
        assert cfg.output_dir == str(tmp_path / "out" / point.name) and cfg.name == f"sw-{point.name}"
        assert cfg.sweep is None  # a point is a run alone
    assert sweep.points[1].label() == "train.learning_rate=1e-05 train.seed=2"


def test_a_point_is_the_file_with_its_overrides_given_on_the_command_line(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The same override machinery: a point's config equals `submit run.yaml KEY=VALUE...` of the file without its
    sweep section, relative paths included (relative to the file, as if written in it: the command line's are
    relative to the current directory, the file's folder here)."""
    (tmp_path / "data").mkdir()
    path = write(tmp_path, {"points": [{"data.datasets": [{"path": "data/other.jsonl", "weight": 2}],
                                        "train.sft": {"max_length": 64}, "lora.r": 8}]})
    sweep = load_sweep(path)
    assert sweep is not None and len(sweep.points) == 1
    alone = yaml.safe_load(path.read_text())
    del alone["sweep"]
    alone.update(output_dir=f"out/{sweep.points[0].name}", name=f"sw-{sweep.points[0].name}")
    (tmp_path / "alone.yaml").write_text(yaml.safe_dump(alone))
    monkeypatch.chdir(tmp_path)
    expected = load_config(tmp_path / "alone.yaml", sweep.points[0].args())
    assert sweep.configs[0].model_dump() == expected.model_dump()
    assert sweep.configs[0].data.datasets[0].path == str(tmp_path / "data" / "other.jsonl")


def test_names_are_stable_shell_safe_and_distinct() -> None:
    points = points_of({"model.name_or_path": ["/models/a/llama", "/models/b/llama"], "lora.target_modules":
                        [["q_proj", "v_proj"]]}, [{"train.sft": {"x": "a b;c"}}, {}])
    names = [p.name for p in points]
    assert names == ["name_or_path-llama_target_modules-q_proj-v_proj",
                     "name_or_path-llama_target_modules-q_proj-v_proj-1", "sft-x-a-b-c", "base"]
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-") for n in names)
    long = point_name({"train.sft": {"k": "v" * 300}}, {"train.sft": "sft"})
    assert len(long) <= 80 and long == point_name({"train.sft": {"k": "v" * 300}}, {"train.sft": "sft"})
    # two keys with one last part are told apart by the whole key
    assert points_of({"lora.dropout": [0.1], "train.sft.dropout": [0.2]}, [])[0].name == \
        "lora.dropout-0.1_train.sft.dropout-0.2"


REFUSALS = [
    ({"grid": {"train.learnig_rate": [1e-5, 3e-5]}}, {},
     ["train.learnig_rate: unknown key; did you mean train.learning_rate?", "every point"]),
    ({"grid": {"resources.nodes": [1, 2]}}, {}, ["resources.nodes cannot differ between points", FIXED["resources"]]),
    ({"grid": {"cluster.time": ["00:10:00", "00:20:00"]}}, {}, ["cluster.time cannot differ"]),
    ({"points": [{"output_dir": "/elsewhere"}]}, {}, ["output_dir cannot differ"]),
    ({"grid": {}}, {}, ["sweep: no points"]),
    ({"grid": {"train.seed": []}}, {}, ["sweep.grid: train.seed: an empty list of values makes no points"]),
    ({"grid": {"train.learning_rate": [1e-5, 2]}}, {},
     ["point learning_rate-2 (train.learning_rate=2): train.learning_rate: Input should be less than 1"]),
    ({"points": [{"train.seed": 1}, {"train.seed": 1}]}, {}, ["points seed-1 and seed-1-1 are the same run"]),
]


@pytest.mark.parametrize(("sweep", "sections", "expected"), REFUSALS,
                         ids=["unknown-key", "resources", "cluster", "output_dir", "empty-grid", "empty-list",
                              "invalid-point", "twin-points"])
def test_refused_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str], sweep: dict,
                                            sections: dict, expected: list[str]) -> None:
    for err in refusals(tmp_path, capsys, sweep, sections):
        for text in expected:
            assert text in err, err


def refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], sweep: dict, sections: dict) -> list[str]:
    """``validate`` and ``submit`` of the file both exit 2 and write nothing beside run.yaml; what each printed."""
    path = write(tmp_path, sweep, **sections)
    errs = []
    for command in ("validate", "submit"):
        code, _, err = cli([command, str(path)], capsys)
        assert code == 2, err
        errs.append(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]
    return errs


def test_a_point_that_does_not_fit_is_named_and_nothing_is_written(tmp_path: Path, micro_model: Path,
                                                                     chat_data: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, {"grid": {"train.per_device_batch_size": [1, 65536]}},
                 model={"name_or_path": str(micro_model)},
                 data={"datasets": [{"path": str(chat_data)}], "max_seq_length": 512})
    code, _, err = cli(["submit", str(path)], capsys)
    assert code == 2, err
    assert "point per_device_batch_size-65536 (train.per_device_batch_size=65536) will not fit" in err, err
    assert "point per_device_batch_size-1 " not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_array_scripts_pick_the_task_point_and_are_shellcheck_clean(tmp_path: Path) -> None:
    from slurmft.plan.render import render_sweep_arrays

    sweep = load_sweep(write(tmp_path))
    assert sweep is not None
    scripts = render_sweep_arrays(sweep, load_profile("local-test"), "run.yaml", None)
    assert set(scripts) == {"prepare", "train", "consolidate"}
    assert "#SBATCH --array" not in scripts["prepare"] and "#SBATCH --job-name=sw-prepare\n" in scripts["prepare"]
    for kind, text in scripts.items():
        if kind != "prepare":
            check_array_script(tmp_path, sweep, kind, text)
    assert "--requeue" in scripts["train"] and "--signal=USR2@" in scripts["train"]
    assert "--nodes=2" in scripts["train"] and "#SBATCH --nodes=1\n" in scripts["consolidate"]


def check_array_script(tmp_path: Path, sweep: Sweep, kind: str, text: str) -> None:
    """An array script of the 4-point sweep written to ``tmp_path/out`` (2 at a time): task i execs point i's own
    ``scripts/KIND.sbatch`` into its log; ``bash -n`` and shellcheck clean."""
    out = tmp_path / "out"
    assert f"#SBATCH --array=0-3%2\n#SBATCH --output={out}/logs/{kind}-%A_%a.out\n" in text
    assert f"#SBATCH --job-name=sw-{kind}\n" in text
    for i, point in enumerate(sweep.points):
        assert f"    {i}) run_dir={out / point.name} ;;\n" in text
    assert f'exec "$run_dir/scripts/{kind}.sbatch" >>"$run_dir/logs/{kind}-${{SLURM_ARRAY_JOB_ID}}_' in text
    script = tmp_path / f"{kind}.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if shutil.which("shellcheck"):  # test_render.py's test_shellcheck_clean says when its absence fails
        check = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout


def test_local_sweep_runs_the_points_one_after_another(tmp_path: Path, micro_model: Path, chat_data: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Two learning rates: one prepared set (the second point links to the first's), two models."""
    path = write(tmp_path, {"grid": {"train.learning_rate": [1e-3, 3e-3]}}, executor="local",
                 resources={"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1},
                 model={"name_or_path": str(micro_model), "dtype": "float32", "attn_implementation": "sdpa"},
                 data={"datasets": [{"path": str(chat_data)}], "max_seq_length": 64},
                 train={"max_steps": 2, "per_device_batch_size": 2, "warmup_ratio": 0.0},
                 consolidate={"dtype": "float32"})
    code, out, err = cli(["submit", str(path)], capsys)
    assert code == 0, err
    assert "point(s), executor local, profile local-test, ranked by loss (min))" in out  # no eval section
    # every point has run: submit ends with the ranking status shows, not a 'follow with' (as if jobs were queued)
    assert "follow with" not in out and "best: learning_rate-0.00" in out and "(#1)" in out, out
    root = tmp_path / "out"
    first, second = root / "learning_rate-0.001", root / "learning_rate-0.003"
    assert err.count("prepare job") == 2  # started + completed: one prepare job for both points
    assert (second / "prepared").is_symlink() and (second / "prepared").resolve() == (first / "prepared").resolve()
    record = json.loads((root / "sweep.json").read_text())
    assert [(p["name"], p["overrides"]) for p in record["points"]] == [
        (first.name, {"train.learning_rate": 1e-3}), (second.name, {"train.learning_rate": 3e-3})]
    assert set(record["points"][0]["jobs"]) == {"prepare", "train", "consolidate"}
    assert set(record["points"][1]["jobs"]) == {"train", "consolidate"}
    for point in (first, second):
        assert (point / "model" / "config.json").is_file()
        assert load_config(point / "config.yaml").output_dir == str(point)
        # what the point trains by, recorded by its submit for the watching commands (slurmft/methods.py)
        assert json.loads((point / "manifest.json").read_text())["objective"] == {"method": "sft", "packed": True}
    a, b = ((p / "model" / "model-00001-of-00001.safetensors").read_bytes() for p in (first, second))
    assert a != b  # two learning rates, two models
    assert not (root / "scripts").exists()  # no arrays here
    # the consolidation of each point refreshed SWEEP_DIR/best; status ranks the points by their final loss
    code, out, err = cli(["status", str(root), "--json"], capsys)
    assert code == 0, err
    shown = json.loads(out)
    rows = shown["points"]
    assert [(r["name"], r["state"], r["step"], r["max_steps"]) for r in rows] == [
        (first.name, "done", 2, 2), (second.name, "done", 2, 2)]
    best = min(rows, key=lambda r: r["score"])
    assert shown["best"] == best["name"] and {r["rank"] for r in rows} == {1, 2}
    assert os.readlink(root / "best") == f"{best['name']}/model"
    code, out, _ = cli(["resume", str(root)], capsys)
    assert code == 0 and f"finished: {first.name}, {second.name}" in out  # nothing died: nothing re-submitted
    assert "follow with" not in out and f"best: {best['name']} (" in out, out
    code, _, err = cli(["submit", str(path)], capsys)
    assert code == 2 and "already holds a sweep" in err
    code, out, err = cli(["plot", str(root)], capsys)  # every point's loss on one picture
    assert code == 0 and (root / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", err
    # report SWEEP_DIR: the points ranked, best first, the best one named, the picture beside it
    code, out, err = cli(["report", str(root)], capsys)
    assert code == 0 and out.strip() == f"wrote {root / 'report.md'}", err
    report = (root / "report.md").read_text()
    other = next(r for r in rows if r["name"] != best["name"])
    assert f"**Best:** {best['name']} (`{best['model']}`" in report and "ranked by loss (min)" in report
    assert report.index(f"| 1 | {best['name']} |") < report.index(f"| 2 | {other['name']} |")
    assert f"{best['score']:.4f}" in report and "![loss by step](loss.png)" in report
    # logs of the sweep's directory: the end of each point's log under a line naming it; --point: one point's, as
    # its own directory's
    code, out, err = cli(["logs", str(root), "--job", "consolidate", "-n", "3"], capsys)
    assert code == 0, err
    heads = [line for line in out.splitlines() if line.startswith("==> point ")]
    assert [h.split(":")[0] for h in heads] == [f"==> point {first.name}", f"==> point {second.name}"], out
    assert all(": consolidate job " in h for h in heads)
    assert cli(["logs", str(root), "--point", second.name, "--job", "consolidate"], capsys)[1] == \
        cli(["logs", str(second), "--job", "consolidate"], capsys)[1]
    code, out, _ = cli(["logs", str(root), "--job", "prepare", "-n", "1"], capsys)
    assert code == 0 and f"==> point {second.name}: no prepare job <==" in out  # it read the first point's set
    code, _, err = cli(["logs", str(root), "--point", "learning_rate-0.0003"], capsys)
    assert code == 2 and "has no such point; did you mean learning_rate-0.003?" in err, err
    code, _, err = cli(["logs", str(root), "-f"], capsys)
    assert code == 2 and "add --point NAME" in err
    # the commands that take one run only say the sweep's directory is one, and name its points (was: "has no
    # manifest.json: it is not a slurmft run directory")
    for command in (["serve"], ["eval"], ["prepare"]):
        code, _, err = cli([*command, str(root)], capsys)
        assert code == 2 and f"{root} is a sweep directory (sweep.json), not a run directory" in err, err
        assert f"{root}/POINT ({first.name}, {second.name})" in err, err
    # consolidate SWEEP_DIR: the points with their model are left alone; one whose model is gone is consolidated
    # again (here: a local sweep), from its newest complete checkpoint, into the same model
    code, out, err = cli(["consolidate", str(root)], capsys)
    assert code == 0 and out.count(": not consolidated: has its model") == 2, out + err
    shutil.rmtree(second / "model")
    code, out, err = cli(["consolidate", str(root)], capsys)
    assert code == 0, err
    assert f"point {second.name}: consolidate job: " in out and f"point {first.name}: not consolidated" in out
    assert (second / "model" / "model-00001-of-00001.safetensors").read_bytes() == b
    # `slurmft cancel SWEEP_DIR` while a local consolidate SWEEP_DIR consolidates its first point: it stops there
    # (it went on to the next point's consolidation)
    _cancel_a_local_sweeps_consolidation(root, first, second, capsys)


def _cancel_a_local_sweeps_consolidation(root: Path, first: Path, second: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import signal
    import sys
    import time

    for point in (first, second):
        shutil.rmtree(point / "model")
    jobs = len(json.loads((first / "manifest.json").read_text())["jobs"])
    second_jobs = json.loads((second / "manifest.json").read_text())["jobs"]
    proc = subprocess.Popen([sys.executable, "-m", "slurmft.cli", "consolidate", str(root)], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(json.loads((first / "manifest.json").read_text())["jobs"]) == jobs:
            assert proc.poll() is None and time.monotonic() < deadline, "the first point's consolidation never started"
            time.sleep(0.1)
        code, out, err = cli(["cancel", str(root)], capsys)
        assert code == 0 and out.startswith("cancelled: "), out + err
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2 and "cancelled by `slurmft cancel` (" in err, out + err
    assert f"not started: {second.name}; `slurmft consolidate {root}` consolidates" in err, err
    assert not (second / "model").exists()  # the next point was not consolidated: no job of it
    assert json.loads((second / "manifest.json").read_text())["jobs"] == second_jobs


@pytest.mark.parametrize("how", ["killed", "cancelled"])
def test_a_stopped_local_sweeps_points_not_started_say_so_and_what_starts_them(
        how: str, tmp_path: Path, micro_model: Path, chat_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A local sweep runs its points one after another: killed (or `slurmft cancel`led) during its first point's
    prepare job, the second point has no job at all; status said 'unknown' for both. While the sweep's submit lives,
    the second waits its turn; a cancelled one starts no further point (it went on to the next)."""
    import signal
    import sys
    import time

    path = write(tmp_path, {"grid": {"train.learning_rate": [1e-3, 3e-3]}}, executor="local",
                 resources={"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1},
                 model={"name_or_path": str(micro_model), "dtype": "float32", "attn_implementation": "sdpa"},
                 data={"datasets": [{"path": str(chat_data)}], "max_seq_length": 64},
                 train={"max_steps": 2, "per_device_batch_size": 2, "warmup_ratio": 0.0})
    root = tmp_path / "out"
    first, second = root / "learning_rate-0.001", root / "learning_rate-0.003"
    submit = subprocess.Popen([sys.executable, "-m", "slurmft.cli", "submit", str(path)], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (first / "manifest.json").is_file() or not json.loads((first / "manifest.json").read_text())["jobs"]:
            assert submit.poll() is None and time.monotonic() < deadline, "the sweep's first job never started"
            time.sleep(0.2)
        code, out, err = cli(["status", str(root), "--json"], capsys)  # the submit still runs: the second waits
        assert code == 0, err
        assert [r["state"] for r in json.loads(out)["points"]] == ["preparing", "waiting its turn"]
        if how == "cancelled":
            code, out, err = cli(["cancel", str(root)], capsys)
            assert code == 0 and out.startswith("cancelled: "), err
            _, err = submit.communicate(timeout=60)
            assert submit.returncode == 2 and "prepare job" in err and "cancelled by `slurmft cancel` (" in err, err
            assert "point 2/2" not in err  # the next point is not started
    finally:
        if submit.poll() is None:
            os.killpg(submit.pid, signal.SIGKILL)  # the submit and the prepare job it started
            submit.wait()
    # a killed process is gone when the kernel has torn it down, not when its parent's wait returns: under CI's load
    # the prepare job's process outlived the submit for a moment and status rightly said "preparing" (CI72)
    from slurmft.locks import pid_alive

    job = json.loads((first / "manifest.json").read_text())["jobs"][0]
    deadline = time.monotonic() + 60
    while pid_alive(int(job["pid"]), job.get("pid_start")):
        assert time.monotonic() < deadline, f"the prepare job's process {job['pid']} outlived SIGKILL by 60 s"
        time.sleep(0.2)
    code, out, err = cli(["status", str(root)], capsys)
    assert code == 0, err
    states = {line.split()[0]: line.split()[2:4] for line in out.splitlines()[2:4]}
    assert states == {first.name: ["prepare", how], second.name: ["not", "started"]}, out
    assert (f"not started: {second.name}: the sweep stopped before them; `slurmft resume {root}` runs them, and "
            "continues the points that stopped") in out
    code, out, err = cli(["report", str(root)], capsys)
    assert code == 0 and f"| {second.name} | `train.learning_rate=0.003` | not started |" in (root / "report.md").read_text()


def test_the_best_point_is_the_best_scored_one_with_a_model(tmp_path: Path) -> None:
    from slurmft.watch.sweep import best_point, score, update_best

    def row(name: str, step: int | None, loss: float | None, model: bool = True) -> dict:
        r = {"name": name, "step": step, "max_steps": 10, "loss": loss, "rank": None,
             "model": str(tmp_path / name / "model") if model else None}
        r["score"] = score(r, "loss")
        return r

    rows = [row("a", 10, 2.0), row("b", 4, 0.5), row("c", 10, 1.0, model=False), row("d", 10, 1.5)]
    assert [r["score"] for r in rows] == [2.0, None, 1.0, 1.5]  # b is still training: no score yet
    for rank, r in enumerate(sorted((r for r in rows if r["score"] is not None), key=lambda r: r["score"]), 1):
        r["rank"] = rank
    assert best_point(rows)["name"] == "d"  # c ranks first but has no model yet
    assert update_best(tmp_path, rows)["name"] == "d" and os.readlink(tmp_path / "best") == "d/model"
    rows[2]["model"] = str(tmp_path / "c" / "model")
    update_best(tmp_path, rows)
    assert os.readlink(tmp_path / "best") == "c/model"
    assert update_best(tmp_path, [row("b", 4, 0.5)]) is None and not (tmp_path / "best").is_symlink()


def test_points_whose_jobs_would_ask_for_another_allocation_are_refused(tmp_path: Path) -> None:
    """The safety net behind FIXED: the points' rendered scripts themselves are compared."""
    from slurmft.errors import ConfigError
    from slurmft.submit.sweep import check_one_allocation

    sweep = load_sweep(write(tmp_path))
    assert sweep is not None
    same = "#!/bin/bash\n#SBATCH --job-name={}\n#SBATCH --nodes=2\n#SBATCH --output=/x/{}.out\n"
    scripts = [{"train": same.format(p.name, p.name)} for p in sweep.points]
    check_one_allocation(sweep, scripts)  # names and logs differ: one allocation
    scripts[2]["train"] = scripts[2]["train"].replace("--nodes=2", "--nodes=1")
    with pytest.raises(ConfigError) as err:
        check_one_allocation(sweep, scripts)
    assert err.value.problems == [f"point {sweep.points[2].name} ({sweep.points[2].label()}): its train job would ask "
                                  f"Slurm for another allocation than point {sweep.points[0].name}'s "
                                  "(#SBATCH --nodes=1; #SBATCH --nodes=2)"]


def test_a_sweeps_shared_prepare_job_stays_one_job_with_prepare_tasks(tmp_path: Path) -> None:
    """prepare.tasks is for a single run's prepare job: a sweep's one prepare job (every point's set, one after
    another: run_prepare_each) is never rendered as an array, whatever the points say."""
    from slurmft.plan.render import render_sweep_arrays

    sweep = load_sweep(write(tmp_path, prepare={"tasks": 4}))
    assert sweep is not None and sweep.configs[0].prepare.tasks == 4
    scripts = render_sweep_arrays(sweep, load_profile("local-test"), "run.yaml", None)
    assert "#SBATCH --array" not in scripts["prepare"] and "prepare-%j.out" in scripts["prepare"]


def test_a_grpo_sweep_is_ranked_by_its_reward_not_its_loss(tmp_path: Path) -> None:
    """GRPO's loss says nothing of how good the policy is (advantage-weighted, near 0 whatever the rewards): a grpo
    sweep without an eval section ranks its points by the mean reward of their last rollouts, highest first (was:
    by the final loss, lowest first, so `best` named a point by chance); reward is refused for a run without grpo."""
    from slurmft.sweep import select_of, select_problems
    from slurmft.watch.sweep import rank, score

    grpo = {"num_generations": 2, "rewards": [{"function": "exact_match"}]}
    sweep = load_sweep(write(tmp_path, grpo=grpo, data={"datasets": [{"path": "data/prompts.jsonl"}],
                                                        "max_seq_length": 64}))
    assert sweep is not None and select_of(sweep.cfg) == {"metric": "reward", "mode": "max"}
    assert select_problems("reward", sweep.configs) == []
    with pytest.raises(ConfigError) as refused:
        load_sweep(write(tmp_path, {"grid": {"train.learning_rate": [1e-5, 3e-5]}, "select": {"metric": "reward"}}))
    assert refused.value.problems == [
        "sweep.select.metric: reward is a grpo run's mean reward, but this run has no grpo section; rank by metric: "
        "loss (or an eval section's score)"]

    def point(name: str, losses: list[float], rewards: dict[int, float]) -> dict:
        """A point's metrics.jsonl as the job keeps TRL's GRPO metrics: the reward only on the steps that generated."""
        run = tmp_path / name
        run.mkdir()
        records = [{"step": s, "loss": loss, **({"reward": rewards[s]} if s in rewards else {})}
                   for s, loss in enumerate(losses, start=1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        row = {"name": name, "step": len(losses), "max_steps": 4, "loss": losses[-1], "rank": None}
        return {**row, "score": score(row, "reward", run)}

    rows = [point("a", [0.0, -0.4, 0.0, -0.5], {1: 0.1, 3: 0.2}), point("b", [0.0, 0.3, 0.0, 0.4], {1: 0.1, 3: 0.9}),
            point("c", [0.0, 0.1], {1: 0.95})]
    assert [r["score"] for r in rows] == [0.2, 0.9, None]  # c is still training: no score yet
    rank(rows, "max")
    assert [r["rank"] for r in rows] == [2, 1, None]  # b: the higher reward, though a's final loss is the lowest


def test_prepare_of_a_sweep_file_is_refused_and_writes_nothing(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft prepare SWEEP.yaml` prepared one run's data into the sweep's directory (--here: a prepared/ that the
    sweep's submit then ignored, preparing again; as a job: a manifest that made the sweep's directory a run's)."""
    path = write(tmp_path)
    for here in ([], ["--here"]):
        code, _, err = cli(["prepare", str(path), *here], capsys)
        assert code == 2 and f"sweep: {path} is a sweep; `slurmft prepare` prepares one run's data" in err, err
        assert f"`slurmft submit {path}` prepares every distinct data set once" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


GRPO = {"num_generations": 2, "rewards": [{"function": "exact_match"}]}
PROMPTS = {"datasets": [{"path": "data/prompts.jsonl"}], "max_seq_length": 64}


@pytest.mark.parametrize(("grid", "sections", "said"), [
    ({"dpo.beta": [0.1, 0.5]}, {"dpo": {"beta": 0.1}}, "dpo.beta differs between points (0.1, 0.5): the DPO loss"),
    ({"data.max_seq_length": [64, 128]}, {}, "data.max_seq_length differs between points (64, 128)"),
    ({"data.packing": [True, False]}, {}, "data.packing differs between points (true, false)"),
    ({"model.name_or_path": ["org/a", "org/b"]}, {},
     'model.tokenizer (model.name_or_path when unset) differs between points ("org/a", "org/b")'),
    ({"train.sft": [{}, {"loss_type": "dft"}]}, {}, "train.sft (loss_type, completion_only_loss, packing_strategy)"),
    ({"grpo.temperature": [0.7, 1.0]}, {"grpo": GRPO, "data": PROMPTS},
     "sweep.select.metric is reward, but the points' reward values are not one measure"),
    ({"train.learning_rate": [1e-5, 3e-5]}, {"grpo": GRPO, "data": PROMPTS, "sweep_select": {"metric": "loss"}},
     "GRPO's loss (advantage-weighted, near 0 whatever the rewards) says nothing of how good the policy is"),
], ids=["dpo-beta", "max-seq-length", "packing", "tokenizer", "sft-loss-type", "grpo-temperature-by-reward",
        "grpo-by-loss"])
def test_a_ranking_metric_that_is_not_one_measure_over_the_points_is_warned_of(tmp_path: Path, grid: dict,
                                                                               sections: dict, said: str) -> None:
    """Ranking by the training loss compares unlike things when the swept key changes what the loss measures (the
    DPO loss's scale follows beta, a longer max_seq_length predicts every token from more context, ...): the sweep is
    valid, so it is a warning naming the axis, its values, why, and the fix (an evaluation score), not a refusal."""
    from slurmft.sweep import select_of, select_warnings

    select = sections.pop("sweep_select", None)
    sweep = load_sweep(write(tmp_path, {"grid": grid, **({"select": select} if select else {})}, **sections))
    assert sweep is not None
    warned = "\n".join(select_warnings(select_of(sweep.cfg)["metric"], sweep.configs))
    assert said in warned and warned.startswith("warning: sweep.select.metric is "), warned
    assert "sweep.select.metric: reward" in warned if "GRPO's loss" in said else "fix: rank by an evaluation score" in warned


@pytest.mark.parametrize(("grid", "sections"), [
    ({"train.learning_rate": [1e-5, 3e-5], "train.seed": [1, 2], "lora.r": [8, 16]}, {"lora": {"r": 8}}),
    ({"model.name_or_path": ["org/a", "org/b"]}, {"model": {"name_or_path": "org/a", "tokenizer": "org/tok"}}),
    ({"dpo.beta": [0.1, 0.5]}, {"dpo": {"beta": 0.1}, "eval": {"tasks": ["hellaswag"]}}),
    ({"grpo.beta": [0.0, 0.04], "train.learning_rate": [1e-5, 3e-5]}, {"grpo": GRPO, "data": PROMPTS}),
], ids=["lr-seed-rank", "models-one-tokenizer", "dpo-beta-by-eval", "grpo-beta-by-reward"])
def test_a_ranking_metric_that_is_one_measure_over_the_points_is_not_warned_of(tmp_path: Path, grid: dict,
                                                                               sections: dict) -> None:
    from slurmft.sweep import select_of, select_warnings

    sweep = load_sweep(write(tmp_path, {"grid": grid}, **sections))
    assert sweep is not None
    assert select_warnings(select_of(sweep.cfg)["metric"], sweep.configs) == []


def test_validate_says_the_warning_and_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft validate` (and `submit`, through the same checks: slurmft/cli_sweep.py ``checked``) prints it to
    stderr and still says ok (exit 0)."""
    (tmp_path / "data").mkdir()
    shutil.copy(Path(__file__).parents[1] / "examples" / "tiny" / "data" / "pairs.jsonl", tmp_path / "data")
    path = write(tmp_path, {"grid": {"dpo.beta": [0.1, 0.5]}}, dpo={"beta": 0.1},
                 data={"datasets": [{"path": "data/pairs.jsonl"}], "max_seq_length": 64})
    code, out, err = cli(["validate", str(path)], capsys)
    assert code == 0 and "ok (sweep sw: 2 point(s)" in out, err
    assert "warning: sweep.select.metric is loss, but the points' loss values are not one measure" in err, err
    assert "  dpo.beta differs between points (0.1, 0.5)" in err and "  fix: rank by an evaluation score" in err, err


def test_the_fix_names_mode_max_when_the_file_ranks_lowest_first(tmp_path: Path) -> None:
    """`select: {metric: loss, mode: min}` followed by the fix's `sweep.select.metric: eval` alone keeps mode min: the
    lowest accuracy would be `best`. The fix says to set mode: max with it (and sweep.json keeps that); without an
    explicit mode it does not (eval's default is max already)."""
    from slurmft.submit.sweep import new_record

    grid = {"dpo.beta": [0.1, 0.5]}
    for select, said in (({"metric": "loss", "mode": "min"}, True), ({"metric": "loss"}, False)):
        sweep = load_sweep(write(tmp_path, {"grid": grid, "select": select}, dpo={"beta": 0.1}))
        assert sweep is not None
        fix = new_record(sweep, "run.yaml")["select_warnings"][-1]
        assert fix.startswith("  fix: rank by an evaluation score") and ("sweep.select.mode: max" in fix) is said, fix


def test_the_ranking_warning_is_kept_in_sweep_json_and_said_by_status_and_report(tmp_path: Path) -> None:
    """`best` follows the ranking whether or not the submit's warning was read: sweep.json keeps it, and the status
    table (and --json) and report.md say it again beside the ranking."""
    from slurmft.rundir import SweepPaths, write_sweep_record
    from slurmft.submit.sweep import new_record
    from slurmft.watch.sweep import format_table, status_lines, write_sweep_report

    sweep = load_sweep(write(tmp_path, {"grid": {"data.max_seq_length": [64, 128]}}))
    assert sweep is not None
    record = new_record(sweep, "run.yaml")
    assert record["select_warnings"][1].startswith("  data.max_seq_length differs between points (64, 128)")
    root = tmp_path / "out"
    root.mkdir()
    write_sweep_record(SweepPaths(root), record)
    table = format_table(root, record, [], None)
    assert table[-1] == "best: none yet (no point has a score and a model)"
    assert table[-1 - len(record["select_warnings"]):-1] == record["select_warnings"]
    assert json.loads(status_lines(root, as_json=True)[0])["select_warnings"] == record["select_warnings"]
    report = write_sweep_report(root).read_text()
    assert "> warning: sweep.select.metric is loss, but the points' loss values are not one measure" in report
    assert "> data.max_seq_length differs between points (64, 128)" in report
    calm = new_record(load_sweep(write(tmp_path, {"grid": {"train.seed": [1, 2]}})), "run.yaml")
    assert calm["select_warnings"] == [] and not any("warning" in line for line in format_table(root, calm, [], None))
