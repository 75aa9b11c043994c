"""The evaluation job (slurmft.job.evaluate), its summary's readers (slurmft.eval_results) and its login-side checks
(slurmft.plan.eval_checks), against a real lm-eval on the tiny model and a local 8-row task (nothing downloaded).

lm-eval lives in an interpreter of its own: CI names it in SLURMFT_TEST_EVAL_PYTHON. Unset, these tests skip
(and fail under CI=..., so a CI that lost the variable does not pass by skipping). One evaluate_run serves
every assertion about it (module-scoped); the registry check builds lm-eval's task index once (about 30 s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurmft import eval_results
from slurmft.config_loading import dump_config, load_config, read_run_config
from slurmft.errors import EvalError
from slurmft.eval_tasks import read_task_yaml, resolve_tasks
from slurmft.rundir import RunPaths
from tests.conftest import need_model_job_python

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_TASKS = REPO_ROOT / "examples" / "tiny" / "tasks"
EXAMPLE_TASK = "tiny_choice"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def eval_python() -> str:
    """examples/tiny/envs.sh's lm-eval venv (tests/conftest.py: a skip without one, a failure under CI)."""
    return need_model_job_python("eval")


def _run_dir(root: Path, model: Path, python: str, tasks: list[str], **eval_extra: Any) -> Path:
    """A run directory as consolidation leaves it: config.yaml (with an eval: section) and model/ (a copy of the
    tiny model, so the fine-tuned and base paths differ)."""
    spec = yaml.safe_load((REPO_ROOT / "examples" / "tiny" / "run.yaml").read_text())
    spec["model"]["name_or_path"] = str(model)
    spec["output_dir"] = str(root / "runs")
    for ds in spec["data"]["datasets"]:
        ds["path"] = str(REPO_ROOT / "examples" / "tiny" / ds["path"])
    spec["eval"] = {"tasks": tasks, "python": python, "batch_size": 4, "limit": 6, "backend": "hf",
                    "resources": {"gpus": 0}, **eval_extra}
    source = root / "run.yaml"
    source.write_text(yaml.safe_dump(spec))
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(source)))
    shutil.copytree(model, run / "model")
    return run


@pytest.fixture(scope="module")
def evaluated(local_tiny_run: Path, eval_python: str) -> tuple[Path, dict[str, Any], list[str]]:
    """The served tiny example's evaluation (tests/conftest.py's ``local_tiny_run``: serve-eval.yaml, its eval job
    after the consolidation, lm-eval on examples/tiny/tasks/tiny_choice.yaml): (run dir, summary, the job log)."""
    manifest = json.loads((local_tiny_run / "manifest.json").read_text())
    job = next(j for j in manifest["jobs"] if j["kind"] == "eval")
    log = Path(job["logs"][0]).read_text().splitlines() + Path(job["logs"][0]).with_suffix(".err").read_text(
        ).splitlines()
    return local_tiny_run, json.loads((local_tiny_run / "eval" / "summary.json").read_text()), log


#: lm-eval by hand, through its own Python API, both models in one process (one import of lm-eval, not two): the
#: arguments the CLI's ``--model hf --model_args pretrained=M,dtype=float32 --tasks T --include_path D --batch_size 8
#: --device cpu`` stand for, with the CLI's default seeds; the task index of the include path alone (its
#: ``include_defaults=False``: the task is a file, lm-eval's ~14,000 own task files need not be read).
BY_HAND = r"""
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
task, include, models = sys.argv[1], sys.argv[2], sys.argv[3:]
out = {}
for model in models:
    r = simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", tasks=[task], batch_size=8,
                        device="cpu", task_manager=TaskManager(include_path=include, include_defaults=False))
    out[model] = r["results"][task]
print(json.dumps(out))
"""


def _by_hand(python: str, models: list[Path]) -> dict[str, Any]:
    """lm-eval's results of the served example's task on each of ``models``, run by hand (:data:`BY_HAND`)."""
    proc = subprocess.run([python, "-c", BY_HAND, EXAMPLE_TASK, str(EXAMPLE_TASKS), *map(str, models)],
                          cwd=EXAMPLE_TASKS, check=True, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **OFFLINE})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_summary_has_both_models_scores_as_lm_eval_writes_them(evaluated: tuple[Path, dict[str, Any], list[str]],
                                                               eval_python: str, tiny_model: Path,
                                                               tmp_path: Path) -> None:
    run, summary, log = evaluated
    assert summary["backend"] == "hf" and summary["backend_reason"] == "eval.backend: hf"
    assert summary["device"] == "cpu"
    assert summary["lm_eval_version"] == "0.4.13"
    assert summary["models"] == {"finetuned": str(run / "model"), "base": str(tiny_model)}
    metrics = summary["tasks"][EXAMPLE_TASK]
    assert set(metrics) == {"acc,none", "acc_norm,none"}  # the stderrs stay in lm-eval's own files
    # lm-eval's own output, as it writes it, under eval/finetuned and eval/base
    for which in ("finetuned", "base"):
        written = run / summary["results_files"][which]
        assert written.is_relative_to(run / "eval" / which) and written.name.startswith("results_")
        assert list(written.parent.glob(f"samples_{EXAMPLE_TASK}_*.jsonl"))
    assert set(summary["seconds"]) == {"finetuned", "base", "total"}
    # lm-eval's own directions of the metrics, so the login side can say whether the fine-tune beat the base
    finetuned_results = json.loads((run / summary["results_files"]["finetuned"]).read_text())
    assert summary["higher_is_better"] == {EXAMPLE_TASK: {"acc": True, "acc_norm": True}}
    assert summary["higher_is_better"] == {EXAMPLE_TASK: finetuned_results["higher_is_better"][EXAMPLE_TASK]}
    assert "base_eval" not in summary  # a run alone scores its own base, as before sweeps kept one (docs/sweeps.md)
    # its output streamed into the job log
    assert any("Running loglikelihood requests" in line for line in log)
    # and it ends with the scores as status says them (it ended with the summary's path)
    assert "evaluation (lm-eval 0.4.13, hf backend):" in log
    assert any(line.startswith("  tiny_choice acc,none: ") and "base model" in line for line in log), log[-5:]
    # the same scores as lm-eval run by hand, with the same arguments, on the same two models
    by_hand = _by_hand(eval_python, [run / "model", tiny_model])
    for which, model in (("finetuned", run / "model"), ("base", tiny_model)):
        for metric, cell in metrics.items():
            assert cell[which] == by_hand[str(model)][metric], (which, metric)
    # 18 steps on the chat data: the tuned model tells which kind of answer follows which question better
    assert metrics["acc,none"]["finetuned"] > metrics["acc,none"]["base"], metrics


def test_eval_results_reads_the_summary(evaluated: tuple[Path, dict[str, Any], list[str]]) -> None:
    run, summary, _ = evaluated
    assert eval_results.read_summary(run) == summary
    rows = eval_results.score_rows(summary)
    assert [(r[0], r[1]) for r in rows] == [(EXAMPLE_TASK, "acc,none"), (EXAMPLE_TASK, "acc_norm,none")]
    name, value = eval_results.headline_score(summary) or ("", -1.0)
    assert name == f"{EXAMPLE_TASK} acc_norm" and value == summary["tasks"][EXAMPLE_TASK]["acc_norm,none"]["finetuned"]


def test_a_failing_lm_eval_names_its_stderr_and_leaves_the_model(evaluated: tuple[Path, dict[str, Any], list[str]],
                                                                  tmp_path: Path) -> None:
    from slurmft.job.evaluate import evaluate_run

    shared, _, _ = evaluated
    run = tmp_path / "run"  # the shared run's config and model, its eval/ left alone
    run.mkdir()
    shutil.copy(shared / "config.yaml", run / "config.yaml")
    shutil.copytree(shared / "model", run / "model")
    model_files = sorted((p.name, p.stat().st_mtime_ns) for p in (run / "model").iterdir())
    with pytest.raises(EvalError) as err:
        evaluate_run(str(run), ['eval.tasks=["slurmft_no_such_task_xyz"]'], say=lambda line: None)
    assert "lm-eval exited with" in str(err.value)
    assert any("slurmft_no_such_task_xyz" in p for p in err.value.problems)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (run / "model").iterdir()) == model_files


def test_a_task_whose_data_an_offline_job_cannot_download_names_the_fix(tmp_path: Path) -> None:
    """`slurmft eval RUN --tasks hellaswag` on offline nodes (the local-test profile sets HF_HUB_OFFLINE=1): lm-eval's
    stderr ends in datasets' ConnectionError, which names no fix; the error adds it. A process that fails as lm-eval
    failed on the tour's cluster run (its last line, verbatim)."""
    from slurmft.job.evaluate import run_lm_eval

    line = "ConnectionError: Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)"
    with pytest.raises(EvalError) as err:
        run_lm_eval([sys.executable, "-c", f"import sys; sys.stderr.write({line!r} + '\\n'); sys.exit(1)"], tmp_path,
                    lambda _: None)
    assert err.value.problems[0] == line
    assert "load_dataset('Rowan/hellaswag')" in err.value.problems[-1] and "HF_HUB_OFFLINE" in err.value.problems[-1]
    unreached = line.replace("OfflineModeIsEnabled", "LocalEntryNotFoundError")  # no network, not told to be offline
    with pytest.raises(EvalError) as err:
        run_lm_eval([sys.executable, "-c", f"import sys; sys.stderr.write({unreached!r} + '\\n'); sys.exit(1)"],
                    tmp_path, lambda _: None)
    assert "cannot be reached" in err.value.problems[-1] and "load_dataset('Rowan/hellaswag')" in err.value.problems[-1]
    with pytest.raises(EvalError) as other:  # any other failure: lm-eval's lines alone
        run_lm_eval([sys.executable, "-c", "import sys; sys.stderr.write('KeyError: x\\n'); sys.exit(1)"], tmp_path,
                    lambda _: None)
    assert other.value.problems == ["KeyError: x"]


def test_auto_backend_is_hf_without_vllm(eval_python: str) -> None:
    from slurmft.job.evaluate import choose_backend

    backend, why = choose_backend("auto", eval_python)
    if backend == "hf":
        assert why.startswith(f"auto: {eval_python} cannot import vllm (")
    else:
        assert why == f"auto: {eval_python} imports vllm"


def test_unmerged_lora_is_the_base_plus_the_adapter(tiny_model: Path, tmp_path: Path) -> None:
    from slurmft.job.evaluate import lm_eval_command, model_specs

    run = _run_dir(tmp_path, tiny_model, sys.executable, ["hellaswag"])
    shutil.rmtree(run / "model")
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}")
    spec = yaml.safe_load((run / "config.yaml").read_text())
    spec["lora"] = {"r": 8}
    spec["consolidate"]["merge"] = False
    (run / "config.yaml").write_text(yaml.safe_dump(spec))
    cfg = read_run_config(run / "config.yaml")
    assert cfg.eval is not None
    specs = model_specs(cfg, cfg.eval, RunPaths.of(run), "hf")
    assert specs["finetuned"]["args"]["peft"] == str(run / "adapter")
    assert specs["finetuned"]["args"]["pretrained"] == specs["base"]["args"]["pretrained"] == str(tiny_model)
    assert "peft" not in specs["base"]["args"]
    vllm = model_specs(cfg, cfg.eval, RunPaths.of(run), "vllm")["finetuned"]["args"]
    assert vllm["lora_local_path"] == str(run / "adapter") and vllm["enable_lora"] == "True"
    cmd = lm_eval_command("py", "hf", "pretrained=x", ["t"], None, cfg.eval, tmp_path, "cpu")
    assert cmd[cmd.index("--limit") + 1] == "6" and cmd[-2:] == ["--device", "cpu"]
    (run / "adapter" / "adapter_config.json").unlink()
    with pytest.raises(EvalError, match="nothing to evaluate"):
        model_specs(cfg, cfg.eval, RunPaths.of(run), "hf")


# --- eval_results without lm-eval ---------------------------------------------------------------------------------


def test_headline_prefers_acc_norm_then_acc_then_exact_match() -> None:
    def summary(metrics: dict[str, float]) -> dict[str, Any]:
        return {"tasks": {"t": {m: {"finetuned": v, "base": None} for m, v in metrics.items()}}}

    assert eval_results.headline_score(summary({"acc,none": 0.5, "acc_norm,none": 0.6})) == ("t acc_norm", 0.6)
    assert eval_results.headline_score(summary({"f1,none": 0.1, "acc,none": 0.5})) == ("t acc", 0.5)
    assert eval_results.headline_score(summary({"exact_match,strict-match": 0.3, "f1,none": 0.1})) == (
        "t exact_match,strict-match", 0.3)
    assert eval_results.headline_score(summary({"bleu,none": 0.2})) == ("t bleu", 0.2)
    assert eval_results.headline_score({"tasks": {}}) is None


def test_a_runs_scores_say_whether_the_fine_tune_beats_the_base(tmp_path: Path) -> None:
    """`base -> fine-tuned` alone left the reader to know each metric's direction: each line with both scores says
    whether the fine-tune beats the base (by lm-eval's higher_is_better, which the summary keeps; a tie does not),
    in the words of a sweep's best line; nothing is said where the direction or the base is unknown."""
    from slurmft.job.evaluate import directions_of
    from slurmft.watch.model_results import eval_lines

    results = {"higher_is_better": {"t": {"acc": True, "word_perplexity": False, "bleu": None}, "u": None}}
    assert directions_of(results) == {"t": {"acc": True, "word_perplexity": False}}
    assert directions_of({"results": {}}) == {}
    tasks = {"t": {"acc,none": {"finetuned": 0.5, "base": 0.25}, "acc_norm,none": {"finetuned": 0.5, "base": 0.25},
                   "word_perplexity,none": {"finetuned": 12.0, "base": 15.0}, "bleu,none": {"finetuned": 1.0,
                                                                                             "base": 2.0}},
             "u": {"acc,none": {"finetuned": 0.3, "base": 0.3}, "f1,none": {"finetuned": 0.2, "base": None}}}
    directions = {"t": {"acc": True, "word_perplexity": False}, "u": {"acc": True, "f1": True}}
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "summary.json").write_text(json.dumps({"tasks": tasks, "higher_is_better": directions}))
    assert eval_lines(tmp_path)[1:] == [
        "  t acc,none: 0.25 -> 0.5: beats the base model by +0.2500",
        "  t acc_norm,none: 0.25 -> 0.5",  # no direction for it: nothing said
        "  t word_perplexity,none: 15 -> 12: beats the base model by -3.0000 (lower is better)",
        "  t bleu,none: 2 -> 1",
        "  u acc,none: 0.3 -> 0.3: does not beat the base model (+0.0000)",
        "  u f1,none: 0.2"]
    assert eval_results.metric_mode({"tasks": tasks}, "t", "acc,none") is None  # a summary from before: unknown
    worse = {"t": {"acc,none": {"finetuned": 0.2, "base": 0.25}}}
    (tmp_path / "eval" / "summary.json").write_text(json.dumps({"tasks": worse, "higher_is_better": directions}))
    assert eval_lines(tmp_path)[1:] == ["  t acc,none: 0.25 -> 0.2: does not beat the base model (-0.0500)"]


def test_read_summary_missing_or_broken(tmp_path: Path) -> None:
    assert eval_results.read_summary(tmp_path) is None
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "summary.json").write_text("{torn")
    assert eval_results.read_summary(tmp_path) is None


def test_eval_results_imports_no_heavy_package() -> None:
    code = ("import sys, slurmft.eval_results, slurmft.plan.eval_checks; "
            "print(sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


# --- task files ----------------------------------------------------------------------------------------------------


def test_task_yaml_with_lm_eval_tags_reads(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("task: mine\nprocess_docs: !function utils.process_docs\ndataset_path: json\n")
    assert read_task_yaml(f)["process_docs"] == "utils.process_docs"
    assert resolve_tasks([str(f), "hellaswag"]).names == ["mine", "hellaswag"]


def test_task_files_problems_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text("dataset_path: json\n")
    yml = tmp_path / "t.yml"
    yml.write_text("task: x\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "o.yaml").write_text("task: o\n")
    problems = resolve_tasks([str(bad), str(nameless), str(yml), str(tmp_path / "gone.yaml"),
                              str(other / "o.yaml")]).problems
    assert problems[0].startswith("eval.tasks[0]: ") and "does not parse as YAML" in problems[0]
    assert problems[1].startswith("eval.tasks[1]: ") and "no task: key" in problems[1]
    assert problems[2].startswith("eval.tasks[2]: ") and "rename it to end in .yaml" in problems[2]
    assert problems[3].startswith("eval.tasks[3]: ") and "does not exist" in problems[3]
    assert problems[4].startswith("eval.tasks: task files in 2 folders")


# --- the login-side checks -----------------------------------------------------------------------------------------


def _cfg(tmp_path: Path, model: Path, python: str, tasks: list[str], **extra: Any) -> Any:  # noqa: ANN401
    sub = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
    sub.mkdir()
    return read_run_config(RunPaths.of(_run_dir(sub, model, python, tasks, **extra)).config)


def test_check_eval_bad_file(eval_python: str, tiny_model: Path, tmp_path: Path) -> None:
    """A task file that does not parse, named by its field (an unknown registry name, with lm-eval's registry listed
    for real: tests/test_serve_eval_local.py, through `slurmft submit`)."""
    from slurmft.plan.eval_checks import check_eval

    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [unclosed\n")
    problems = check_eval(_cfg(tmp_path, tiny_model, eval_python, [str(bad)]))
    assert len(problems) == 1 and problems[0].startswith("eval.tasks[0]: ") and "does not parse as YAML" in problems[0]
    # the good config: no problem
    assert check_eval(_cfg(tmp_path, tiny_model, eval_python, [str(EXAMPLE_TASKS / "tiny_choice.yaml")])) == []


def test_a_misspelt_task_of_the_runs_own_is_offered_that_task(eval_python: str, tiny_model: Path,
                                                              tmp_path: Path) -> None:
    """`slurmft eval RUN_DIR --tasks tiny_choise`: "did you mean multiple_choice?" (lm-eval's registry's nearest),
    where the run's own task file defines tiny_choice. The run's own tasks come first (lm-eval's registry is listed
    for real, cached)."""
    from slurmft.plan.eval_checks import check_eval

    mine = str(EXAMPLE_TASKS / "tiny_choice.yaml")
    cfg = _cfg(tmp_path, tiny_model, eval_python, ["tiny_choise"])
    assert "did you mean multiple_choice" in check_eval(cfg)[0]  # without the run's own tasks
    problems = check_eval(cfg, own={EXAMPLE_TASK: mine})
    assert problems == [f"eval.tasks[0]: 'tiny_choise' is not a task lm-eval 0.4.13 knows; did you mean tiny_choice, "
                        f"this run's task ({mine})? (or give your own task YAML file)"], problems


def test_check_eval_python_without_lm_eval(tiny_model: Path, tmp_path: Path) -> None:
    from slurmft.plan.eval_checks import check_eval

    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    python = str(bare / "bin" / "python")
    problems = check_eval(_cfg(tmp_path, tiny_model, python, ["hellaswag"]))
    assert len(problems) == 1 and problems[0].startswith("eval.python: ") and "cannot import lm_eval" in problems[0]
    assert f"{python} -m pip install lm-eval" in problems[0]
    missing = check_eval(_cfg(tmp_path, tiny_model, str(tmp_path / "nope" / "python"), ["hellaswag"]))
    assert len(missing) == 1 and missing[0].startswith("eval.python: ") and "does not exist" in missing[0]


def test_the_scores_go_into_the_runs_one_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.report_to: [wandb]``: the evaluation job resumes the run's W&B run (the train job's id, from
    tracker.json) and puts the scores in its summary; the offline attempt is recorded for `wandb sync`."""
    from slurmft.job.evaluate import send_to_wandb, wandb_summary
    from slurmft.trackers import read_tracker, sync_command
    from tests.tracker_check import WANDB_HOME

    for key in WANDB_HOME:
        monkeypatch.setenv(key, str(tmp_path / "wandb-home" / key))
    for key in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_NAME", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    paths = RunPaths.of(tmp_path / "run")
    paths.root.mkdir()
    paths.tracker.write_text(json.dumps({"wandb": {"id": "the-train-jobs-run", "attempts": []}}))
    summary = {"tasks": {"tiny_choice": {"acc,none": {"finetuned": 0.5, "base": 0.25},
                                         "acc_norm,none": {"finetuned": 0.75, "base": None}}}}
    assert wandb_summary(summary) == {"eval/tiny_choice/acc": 0.5, "eval/tiny_choice/acc/base": 0.25,
                                      "eval/tiny_choice/acc_norm": 0.75}
    said: list[str] = []
    assert send_to_wandb(paths, "tiny", summary, said.append) == "the-train-jobs-run", said
    [folder] = (paths.root / "wandb").glob("offline-run-*-the-train-jobs-run")
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(next(folder.glob("*.wandb")))],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, check=True)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    sent = {key: value for r in records if r.get("type") == "summary"
            for key, value in r["summary"].get("update", {}).items()}
    assert {k: v for k, v in sent.items() if k.startswith("eval/")} == wandb_summary(summary), records[-3:]
    record = read_tracker(paths) or {}
    assert record["wandb"]["attempts"][-1]["job"] == "eval" and record["wandb"]["attempts"][-1]["offline"]
    assert "the-train-jobs-run" in (sync_command(record) or "")


def test_eval_tasks_naming_the_runs_own_task_file_read_as_that_file(tmp_path: Path) -> None:
    """`slurmft eval RUN_DIR --tasks tiny_choice`, the name status shows the run's scores under, was refused: "not a
    task lm-eval knows; did you mean multiple_choice?" (lm-eval finds a file's task only through its folder). A name of
    one of the run's own task files now reads as that file; other names stay names."""
    from slurmft.eval_tasks import own_task_files, tasks_override
    from slurmft.submit.model_checks import checked_config

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    task_file = str(EXAMPLE_TASKS / f"{EXAMPLE_TASK}.yaml")
    run = _run_dir(tmp_path, model, sys.executable, [task_file])
    (run / "manifest.json").write_text(json.dumps({"name": "tiny", "executor": "slurm", "jobs": []}))
    cfg, resolved = checked_config(RunPaths.of(run), "eval", [tasks_override(f"{EXAMPLE_TASK},hellaswag")])
    assert resolved == [f"eval.tasks={json.dumps([task_file, 'hellaswag'])}"]
    assert cfg.eval is not None and cfg.eval.tasks == [task_file, "hellaswag"]
    assert own_task_files('eval.tasks=["hellaswag"]', {EXAMPLE_TASK: task_file}) == 'eval.tasks=["hellaswag"]'
    assert own_task_files("eval.limit=4", {EXAMPLE_TASK: task_file}) == "eval.limit=4"
