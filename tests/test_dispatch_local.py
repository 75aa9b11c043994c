"""The README's first command: the tiny example through `slurmft submit` on the local executor
(submitit, 2 processes, real FSDP2 on CPU), then consolidation into a loadable HF model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurmft.cli import main
from slurmft.rundir import RunPaths, read_manifest
from tests.export_check import assert_export_matches_checkpoint

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny" / "run.yaml"

pytestmark = pytest.mark.train


def test_tiny_example_trains_and_consolidates_locally(local_tiny_run: Path, tiny_model: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run = local_tiny_run  # `slurmft submit examples/tiny/serve-eval.yaml` (18 steps, every 6), run once per session
    err = (run.parent / "submit.err").read_text()
    assert "train job" in err and "completed" in err  # progress was shown
    shown = [int(line.split()[1]) for line in err.splitlines() if line.startswith("  step ")]
    assert shown == list(range(1, 19)), shown  # one console line per step, none dropped or repeated
    manifest = read_manifest(RunPaths.of(run))
    # prepare.enabled (the default): the data is prepared first, in its own step, and the train job reads it
    # the served example: the serve check and the evaluation after the consolidation (tests/test_serve_eval_local.py)
    after = [("serve", "COMPLETED"), ("eval", "COMPLETED")] if "serve:" in (run / "config.yaml").read_text() else []
    assert [(j["kind"], j["state"]) for j in manifest["jobs"]] == [("prepare", "COMPLETED"), ("train", "COMPLETED"),
                                                                    ("consolidate", "COMPLETED"), *after]
    assert "prepare job" in err  # what the train job read from it: tests/job/test_prepare.py
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) >= 15 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3  # it learned something

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tok = AutoTokenizer.from_pretrained(run / "model")
    assert tok.chat_template and model.config.vocab_size == len(tok)
    umask = os.umask(0)
    os.umask(umask)
    assert (run / "model").stat().st_mode & 0o777 == 0o777 & ~umask  # readable by the team, not 0700
    index = json.loads((run / "model" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) >= {n for n, _ in model.named_parameters()}
    # the trained weights, not the base model's, are what shipped: equal to the final DCP checkpoint
    report = assert_export_matches_checkpoint(run, tiny_model)
    assert report["checkpoint"].name == "checkpoint-18"

    # the run directory refuses a second submit and `status` reads the local manifest
    with pytest.raises(SystemExit) as info:
        main(["submit", str(EXAMPLE), f"output_dir={run}", f"model.name_or_path={tiny_model}"])
    assert info.value.code == 2 and "already holds a finished run" in capsys.readouterr().err
    main(["status", str(run), "--json"])
    rows = json.loads(capsys.readouterr().out)["jobs"]
    assert [(r["kind"], r["state"]) for r in rows] == [("prepare", "COMPLETED"), ("train", "COMPLETED"),
                                                       ("consolidate", "COMPLETED"), *after]


def test_a_local_prepare_job_says_its_progress_while_submit_waits(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`slurmft submit` of a local run said `prepare job J started here` and nothing more until the preparation
    ended: its progress bars go to the job's log. The wait now says the newest progress line now and then. A real
    submitit local job stands in for the prepare job: it writes one bar of datasets' form to its stderr, as
    `datasets` does, and lives 4 s."""
    import subprocess

    from submitit import LocalExecutor
    from submitit.core.utils import JobPaths

    from slurmft.rundir import new_manifest, record_job
    from slurmft.submit import console

    monkeypatch.setattr(console, "PREPARE_PROGRESS_EVERY_S", 1.0, raising=False)
    paths = RunPaths.of(tmp_path / "run")
    (paths.root / "submitit").mkdir(parents=True)
    bar = "Tokenizing train dataset (num_proc=1):  49%|####9     | 400/809 [00:10<00:10, 40.10 examples/s]"
    ex = LocalExecutor(folder=paths.submitit)
    ex.update_parameters(timeout_min=2)
    job = ex.submit(subprocess.run, ["sh", "-c", "printf '%s\\r' \"$0\" >&2; sleep 4", bar], check=True)
    manifest = new_manifest("r", "local")
    record_job(manifest, "prepare", job.job_id, logs=[str(JobPaths(paths.submitit, job.job_id, 0).stdout)])
    said: list[str] = []
    console.wait_local(job, "prepare", paths, manifest, said.append)
    assert said[0] == "  Tokenizing train dataset (num_proc=1): 400/809 rows, 40.10 examples/s, ETA 00:10", said
    assert said.count(said[0]) == 1 and said[-1].startswith(f"prepare job {job.job_id} completed in "), said


def test_a_local_job_is_called_by_one_name_from_start_to_end(tmp_path: Path) -> None:
    """A local submit said "consolidation job J started here" then "consolidate job J completed", and "prepare task 1
    of 2 (job J) started here" then "prepare job J completed": one name per job, from its start to its end. A real
    submitit local job (``true``) stands in for each."""
    import subprocess

    from submitit import LocalExecutor

    from slurmft.rundir import new_manifest, record_job
    from slurmft.submit.console import JOB_NAMES, wait_local

    paths = RunPaths.of(tmp_path / "run")
    (paths.root / "submitit").mkdir(parents=True)
    ex = LocalExecutor(folder=paths.submitit)
    ex.update_parameters(timeout_min=1)
    manifest = new_manifest("r", "local")
    said: list[str] = []
    for kind, what in (("consolidate", None), ("prepare", "prepare task 1 of 2 (job {})")):
        job = ex.submit(subprocess.run, ["true"], check=True)
        record_job(manifest, kind, job.job_id)
        wait_local(job, kind, paths, manifest, said.append, what and what.format(job.job_id))
        assert said[-1].startswith(f"{what.format(job.job_id) if what else f'consolidation job {job.job_id}'} "
                                   "completed in "), said
    assert JOB_NAMES["consolidate"] == "consolidation" and JOB_NAMES["eval"] == "evaluation"
