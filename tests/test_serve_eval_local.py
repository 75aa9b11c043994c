"""The served tiny example (examples/tiny/serve-eval.yaml on the local executor, tests/conftest.py's shared
``local_tiny_run``): after its consolidation, vLLM's CPU build served model/ and its greedy tokens equal
transformers'; lm-eval scored it and the base (tests/test_evaluate.py compares those scores with lm-eval by hand).
A model that does not serve fails the check naming why, and the model stays; bad serve/eval input is refused
before anything is submitted."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from cli_runner import cli

from tests.conftest import SERVED_EXAMPLE, need_model_job_python

pytestmark = pytest.mark.train


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code, out, err = cli(args, capsys)
    return code, out + err


@pytest.fixture(scope="module")
def served(local_tiny_run: Path) -> Path:
    need_model_job_python("serve")
    need_model_job_python("eval")
    return local_tiny_run


def test_vllm_serves_the_consolidated_model_as_transformers_runs_it(served: Path) -> None:
    record = json.loads((served / "serve" / "result.json").read_text())
    assert record["ok"] and list(record["engines"]) == ["model"] and record["vllm_version"] == "0.32.0"
    engine = record["engines"]["model"]
    assert engine["dtype"] == "float32" and engine["exact"] and engine["problems"] == []
    assert engine["loading"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert len(engine["prompts"]) == 3 and len(record["prompts"]) == 3
    for p in engine["prompts"]:
        assert p["vllm"] == p["transformers"] and p["agree"] == len(p["vllm"])
        assert len(set(p["vllm"])) >= 3, p  # not one repeated token: the comparison has something to compare
        assert p["max_first_logprob_gap"] <= 1e-3
        assert p["finish_reason"] == "stop" and p["stop_token"] in engine["eos"]  # it stops at its EOS
    assert engine["startup_s"] > 0 and engine["tokens_per_s"] > 0
    sent = json.loads((served / "serve" / "model.request.json").read_text())
    assert sent["model"] == str(served / "model") and sent["lora"] is None and sent["max_new_tokens"] == 16
    assert sent["prompts"][0] == [int(t) for t in sent["prompts"][0]]  # token ids, one tokenization for both
    # the job's log says the verdict, as status does (it said nothing of it: only vLLM's own lines)
    jobs = json.loads((served / "manifest.json").read_text())["jobs"]
    log = "".join(Path(f).read_text() for j in jobs if j["kind"] == "serve" for f in j["logs"])
    assert "serve check passed: vLLM 0.32.0 served model/: greedy tokens equal transformers' on 3 prompt(s)" in log
    # and what it was doing meanwhile (a logger no handler printed said it: nothing came out)
    assert "serve check (model): vLLM in " in log and "now transformers on " in log, log[-3000:]


def test_status_runs_and_the_report_show_the_check_and_the_scores(served: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(["status", str(served)], capsys)
    assert code == 0, out
    assert "serve check passed: vLLM 0.32.0 served model/: greedy tokens equal transformers' on 3 prompt(s)" in out
    assert "evaluation (lm-eval 0.4.13, hf backend):" in out and "tiny_choice acc_norm,none: " in out
    # tests/test_evaluate.py: the fine-tuned model's acc is above the base's, and status says so
    assert re.search(r"\n  tiny_choice acc,none: [0-9.]+ -> [0-9.]+: beats the base model by \+0\.\d{4}\n", out), out
    code, out, _ = cli(["status", str(served), "--json"], capsys)
    status = json.loads(out)
    assert status["serve"]["ok"] and set(status["eval"]["tasks"]) == {"tiny_choice"}
    code, out = run_cli(["runs", str(served.parent)], capsys)
    assert code == 0 and "(tiny_choice acc_norm)" in out
    assert "## Served and scored" in (served / "report.md").read_text()


def _copy_run(src: Path, dst: Path) -> Path:
    """The run's directory without its checkpoints and prepared data (a check only reads config.yaml and model/)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "prepared", "submitit", "eval", "serve"))
    return dst


def test_a_model_that_does_not_serve_fails_the_check_naming_why_and_stays(served: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # a tokenizer file deliberately removed: neither a server nor the check can load the tokenizer
    run = _copy_run(served, tmp_path / "no-tokenizer")
    (run / "model" / "tokenizer.json").unlink()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (run / "model").iterdir())
    code, out = run_cli(["serve", str(run), "--here", "serve.max_new_tokens=7"], capsys)
    assert code == 2 and "the tokenizer in" in out and "does not load" in out, out
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (run / "model").iterdir()) == before  # the model stays
    record = json.loads((run / "serve" / "result.json").read_text())  # what it ran with, beside what it found
    assert record["settings"]["max_new_tokens"] == 7 and record["overrides"] == ["serve.max_new_tokens=7"]
    code, out = run_cli(["status", str(run)], capsys)
    assert "serve check FAILED: the tokenizer in" in out, out
    jobs = json.loads((run / "manifest.json").read_text())["jobs"]
    assert (jobs[-1]["kind"], jobs[-1]["state"]) == ("serve", "FAILED")
    # vLLM's own refusal, in its words: tests/slurm/test_slurm_resume.py (the micro model's head size on the cluster)


def test_an_override_reaches_the_eval_job_and_config_yaml_stays(served: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft eval RUN_DIR eval.limit=4 eval.compare_base=false` on a copy of the served run: its job (a local
    process, the job function and the overrides pickled by submitit as for a Slurm job) scores 4 of the task's 32
    examples on the fine-tuned model alone; config.yaml, the record of how the run trained, stays as it was; the
    manifest, summary.json and status say what the scores were made with."""
    run = _copy_run(served, tmp_path / "limited")
    config = (run / "config.yaml").read_bytes()
    code, out, err = cli(["eval", str(run), "eval.limit=4", "eval.compare_base=false"], capsys)
    assert code == 0, out + err
    # a local run's job has ended when the command returns: its scores are said, as status says them (it said
    # only "eval job: N")
    assert out.startswith("eval job: ") and "\nevaluation (lm-eval 0.4.13, hf backend; with eval.limit=4 " in out, out
    assert "  tiny_choice acc_norm,none: " in out, out
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert (summary["settings"]["limit"], summary["settings"]["compare_base"], summary["models"]["base"]) == (
        4, False, None)
    assert summary["overrides"] == ["eval.limit=4", "eval.compare_base=false"]
    results = json.loads((run / summary["results_files"]["finetuned"]).read_text())
    assert results["n-samples"]["tiny_choice"] == {"original": 32, "effective": 4}  # lm-eval itself took 4
    job = json.loads((run / "manifest.json").read_text())["jobs"][-1]
    assert (job["kind"], job["overrides"]) == ("eval", ["eval.limit=4", "eval.compare_base=false"]), job
    assert (run / "config.yaml").read_bytes() == config
    code, out = run_cli(["status", str(run)], capsys)
    assert "evaluation (lm-eval 0.4.13, hf backend; with eval.limit=4 eval.compare_base=false):" in out, out


def test_here_says_the_verdict_and_the_scores_not_a_json_dict(served: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft serve|eval RUN_DIR --here` printed the job function's return value as JSON (`"agree": [4, 8, 13]`):
    now what status says, the serve check's verdict and the scores."""
    run = _copy_run(served, tmp_path / "here")
    code, out, err = cli(["serve", str(run), "--here", "serve.prompts=1", "serve.max_new_tokens=4"], capsys)
    assert code == 0, err
    # (vLLM's own log lines come through too)
    assert "\nserve check passed: vLLM 0.32.0 served model/: greedy tokens equal transformers' on 1 prompt(s) " \
           "(float32)" in f"\n{out}" and '"agree"' not in out and not out.rstrip().endswith("}"), out
    code, out, err = cli(["eval", str(run), "--here", "eval.limit=2", "eval.compare_base=false"], capsys)
    assert code == 0, err
    lines = out.splitlines()  # (after the evaluation's own progress lines)
    header = lines.index("evaluation (lm-eval 0.4.13, hf backend; with eval.limit=2 eval.compare_base=false):")
    assert lines[header + 1].startswith("  tiny_choice acc"), out
    assert lines.count(lines[header]) == 1, out  # said once: by the evaluation, not again by the command
    assert not any(line.startswith(("{", "}")) for line in lines) and '"tasks"' not in out, out


def test_status_says_which_eval_job_wrote_the_scores_and_a_newer_one(served: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """status showed the previous evaluation's scores while a newer eval job ran, or after it failed, without a word."""
    import os

    from slurmft.rundir import RunPaths, read_manifest, this_host, write_manifest

    run = _copy_run(served, tmp_path / "newer")
    shutil.copytree(served / "eval", run / "eval")
    paths = RunPaths.of(run)
    manifest = read_manifest(paths)
    scored = next(j["job_id"] for j in reversed(manifest["jobs"]) if j["kind"] == "eval")
    code, out = run_cli(["status", str(run)], capsys)
    assert code == 0 and "  (written 20" in out and f" by eval job {scored})" in out, out
    # a newer eval job running (this process stands for it: alive on this host)
    manifest["jobs"].append({"kind": "eval", "job_id": "424242", "attempt": 1, "pid": os.getpid(), "host": this_host()})
    write_manifest(paths, manifest)
    code, out = run_cli(["status", str(run)], capsys)
    assert f" by eval job {scored}; eval job 424242 is running: these are the previous scores)" in out, out
    manifest["jobs"][-1]["state"] = "FAILED"
    write_manifest(paths, manifest)
    code, out = run_cli(["status", str(run)], capsys)
    assert f" by eval job {scored}; the newer eval job 424242 ended FAILED: these are the previous scores)" in out, out


def test_bad_serve_and_eval_input_is_refused_before_anything_is_submitted(
        served: Path, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setenv("SLURMFT_CACHE_DIR", str(tmp_path / "cache"))  # lm-eval's registry listed for real, once
    bad_task = tmp_path / "bad.yaml"
    bad_task.write_text("task: [unclosed\n")
    cases = {
        "unknown task": (["eval.tasks=[hellaswagg]"], "eval.tasks[0]: 'hellaswagg' is not a task lm-eval 0.4.13 "
                                                       "knows; did you mean hellaswag"),
        "task file": ([f"eval.tasks=[{bad_task}]"], "eval.tasks[0]: "),
        "no lm-eval": ([f"eval.python={sys.executable}"], f"cannot import lm_eval; install it: {sys.executable} -m pip"),
        "no vLLM": ([f"serve.python={sys.executable}"], f"serve.python: {sys.executable} cannot import vllm"),
    }
    vllm, lm_eval = need_model_job_python("serve"), need_model_job_python("eval")
    # `slurmft eval RUN --tasks NAME`: the registry's one slow listing is said, not waited through in silence
    jobs_before = json.loads((served / "manifest.json").read_text())["jobs"]
    code, out = run_cli(["eval", str(served), "--tasks", "hellaswagg"], capsys)
    assert code == 2 and "listing lm-eval 0.4.13's task registry once (about half a minute" in out, out
    assert "'hellaswagg' is not a task lm-eval 0.4.13 knows; did you mean hellaswag" in out, out
    # the bad value came from the command line: said so, not as config.yaml's
    assert "the command line (--tasks hellaswagg): 1 problem(s) found before running the eval job" in out, out
    assert "--tasks hellaswagg (eval.tasks[0]: 'hellaswagg' is not a task" in out and "config.yaml" not in out, out
    code, out = run_cli(["eval", str(served), "eval.limt=4"], capsys)  # the schema's, for a key given so
    assert code == 2 and "the command line (eval.limt=4): 1 problem(s)" in out and "eval.limt=4 (eval.limt" in out, out
    assert json.loads((served / "manifest.json").read_text())["jobs"] == jobs_before  # nothing run
    for name, (overrides, said) in cases.items():
        out_dir = tmp_path / name.replace(" ", "-")
        code, out = run_cli(["submit", str(SERVED_EXAMPLE), f"output_dir={out_dir}", f"model.name_or_path={tiny_model}",
                         f"serve.python={vllm}", f"eval.python={lm_eval}", *overrides], capsys)
        assert code == 2 and said in out, (name, out)
        assert not out_dir.exists(), name  # nothing written, nothing submitted
    assert list((tmp_path / "cache").glob("lm-eval-tasks-0.4.13-*.json"))  # listed once, cached
