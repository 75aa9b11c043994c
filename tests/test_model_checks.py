"""``slurmft serve|eval RUN_DIR KEY=VALUE`` on a finished run (slurmft/submit/model_checks.py): the overrides the job
reads give it its settings, as ``slurmft submit``'s give a run its config, and RUN_DIR/config.yaml stays as the run
trained; every other override is refused naming the field and the fix, exit 2, nothing submitted, the run directory
untouched. No cluster and no lm-eval here: the job running with them is tests/test_serve_eval_local.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from cli_runner import cli
from runfixture import local_run

from slurmft.config_loading import read_run_config
from slurmft.errors import ConfigError
from slurmft.rundir import RunPaths
from slurmft.submit.model_checks import checked_config

REPO = Path(__file__).resolve().parent.parent


def finished(root: Path) -> Path:
    """A finished local run with no serve or eval section (runfixture's), and a consolidated model/."""
    run = local_run(root)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "output_dir": str(run),
                                                     "resources": {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 2}}))
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}\n")
    return run


def snapshot(run: Path) -> dict[str, bytes]:
    """Every file of the run directory and its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_overrides_give_the_job_its_settings_and_config_yaml_stays(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmft.plan.render import build_model_job_context
    from slurmft.submit.submitted import submitted_run

    run = finished(tmp_path)
    before = snapshot(run)
    task = tmp_path / "tasks" / "mine.yaml"
    task.parent.mkdir()
    task.write_text("task: mine\n")
    monkeypatch.chdir(tmp_path)  # a task file on the command line is relative to where it is typed
    given = ["eval.tasks=[./tasks/mine.yaml, hellaswag]", "eval.limit=50", "cluster.partition=gpu",
             "eval.resources.time=90"]
    cfg, resolved = checked_config(RunPaths.of(run), "eval", given)
    assert cfg.eval is not None  # the run had no eval section: the overrides give it one
    assert (cfg.eval.tasks, cfg.eval.limit, cfg.cluster.partition) == ([str(task), "hellaswag"], 50, "gpu")
    assert resolved == [f'eval.tasks=["{task}", "hellaswag"]', "eval.limit=50", 'cluster.partition="gpu"',
                        "eval.resources.time=90"]
    monkeypatch.chdir(REPO)  # the job reads them in another directory: the same settings
    assert read_run_config(run / "config.yaml", resolved) == cfg
    # the batch script is rendered from them (submit: submitted_run's config)
    ctx = build_model_job_context(submitted_run(RunPaths.of(run), resolved).cfg, submitted_run(RunPaths.of(run)).profile,
                                  RunPaths.of(run), "python -m submitit", "eval")
    assert {"--partition=gpu", "--time=90"} <= set(ctx["directives"]), ctx["directives"]
    assert snapshot(run) == before  # config.yaml (the record of how it trained) and the manifest untouched
    with pytest.raises(ConfigError, match=r"has no eval section: give it on the command line, e\.g\. `slurmft eval "):
        checked_config(RunPaths.of(run), "eval", ["cluster.partition=gpu"])


REFUSED = {
    "training key": (["eval", "eval.limit=5", "train.max_steps=5"],
                     "train.max_steps: the eval job does not read it, and it would not change the trained model"),
    "the other job's key": (["eval", "serve.prompts=2"],
                            "serve.prompts: the eval job does not read it; it is the serve job's: `slurmft serve "),
    "eval key on serve": (["serve", "eval.limit=3"], "eval.limit: the serve job does not read it; it is the eval job's"),
    "a train-only cluster key": (["serve", "cluster.time=01:00:00"], "cluster.time: the serve job does not read it"),
    "typo": (["eval", "eval.limt=5"], "eval.limt: unknown key; did you mean eval.limit?"),
    "bad value": (["eval", "eval.tasks=[x]", "eval.limit=lots"], "eval.limit: Input should be a valid number"),
    "no section": (["serve", "cluster.qos=high"],
                   "has no serve section: give it on the command line, e.g. `slurmft serve "),
    "not key=value": (["eval", "eval.limit"], "override 'eval.limit': expected key=value"),
    "tasks twice": (["eval", "--tasks", "a", "eval.tasks=[b]"], "give the tasks once"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_override_is_refused_with_the_fix_and_nothing_changes(case: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = finished(tmp_path)
    before = snapshot(run)
    (command, *args), said = REFUSED[case]
    code, out, err = cli([command, str(run), *args], capsys)
    assert code == 2 and said in out + err, (case, out, err)
    assert "Traceback" not in err
    assert snapshot(run) == before  # nothing submitted (no job in the manifest), nothing written


def test_tasks_is_eval_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tasks a,b`` is ``eval.tasks=[a,b]``: a task file relative to where it is typed, names as they are."""
    from slurmft.eval_tasks import tasks_override

    run = finished(tmp_path)
    monkeypatch.chdir(REPO)
    override = tasks_override(" examples/tiny/tasks/tiny_choice.yaml, hellaswag ,")
    assert override == 'eval.tasks=["examples/tiny/tasks/tiny_choice.yaml", "hellaswag"]'
    cfg, resolved = checked_config(RunPaths.of(run), "eval", [override])
    assert cfg.eval is not None
    assert cfg.eval.tasks == [str(REPO / "examples" / "tiny" / "tasks" / "tiny_choice.yaml"), "hellaswag"]
    assert json.loads(resolved[0].split("=", 1)[1]) == cfg.eval.tasks
    assert os.path.isabs(cfg.eval.tasks[0])


def test_an_eval_job_queued_before_overrides_reads_its_task_list_as_eval_tasks(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An eval job ``slurmft eval RUN_DIR --tasks a,b`` queued by the release before the overrides carries
    ``run_eval(RUN_DIR, [a, b])`` in its pickle (the task names, not KEY=VALUE): starting after an upgrade, the job
    reads them as eval.tasks, a relative task file against its working directory as that release did; a job queued
    since still passes overrides. Run as submitit runs it: the job function called with the pickled arguments, in a
    process of its own (the job's stack loads there). A task file that is not there stops it before lm-eval, naming
    the file where the list went; without the fix it stopped on the task names as malformed overrides."""
    import subprocess
    import sys

    from slurmft.eval_tasks import queued_task_list

    monkeypatch.chdir(tmp_path)
    assert queued_task_list(["./tasks/mine.yaml", "hellaswag"]) == [
        f'eval.tasks=["{tmp_path / "tasks" / "mine.yaml"}", "hellaswag"]']
    assert queued_task_list(['eval.tasks=["hellaswag"]', "eval.limit=4"]) == ['eval.tasks=["hellaswag"]', "eval.limit=4"]
    assert queued_task_list(None) is None and queued_task_list([]) == []
    run = finished(tmp_path)
    old_call = f"from slurmft.job.entrypoint import run_eval; run_eval({str(run)!r}, ['./tasks/gone.yaml', 'hellaswag'])"
    done = subprocess.run([sys.executable, "-c", old_call], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "SUBMITIT_EXECUTOR"})
    assert done.returncode == 2, done.stderr
    assert f"eval.tasks[0]: {tmp_path / 'tasks' / 'gone.yaml'} does not exist" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_status_reads_an_eval_job_that_tasks_recorded_before_overrides(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``slurmft eval RUN_DIR --tasks x`` on a Slurm run recorded ``tasks: [x]`` in the manifest, the name an array's
    task count has there: ``slurmft status`` then died of a TypeError. Such a manifest still reads; a new eval job
    records its ``overrides`` instead."""
    from runfixture import preempted_run

    run = preempted_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["jobs"].append({"kind": "eval", "job_id": "991", "attempt": 1, "submitted": 1_700_000_500.0,
                             "tasks": ["hellaswag"]})
    (run / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = cli(["status", str(run), "--json"], capsys)
    assert code == 0, err
    assert [j["job_id"] for j in json.loads(out)["jobs"] if j["kind"] == "eval"] == ["991"]
