"""The prepare job (slurmft/job/prepare.py): TRL's own preparation run once, saved, and read by the train job.

* TRL's ``SFTTrainer._prepare_dataset`` reads from its trainer only what :class:`TrlPreparation` holds, and
  from its arguments only what the prepare job sets (checked on TRL's source: an upgrade that reads more fails
  here, not silently in a run);
* the local executor runs prepare -> train -> consolidate in order (the shared ``local_tiny_run``: prepare is
  on by default), the train job reads ``prepared/`` and tokenizes nothing, and the model is bitwise equal to
  the same run with ``prepare.enabled=false`` (tokenized in the allocation);
* a source changed after preparation: ``resume`` refuses with the fix and submits nothing, the train job
  refuses too (exit 2 on every rank), ``slurmft prepare RUN --here`` prepares again and both accept it.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import LOCAL_ARGS, LOCAL_EXAMPLE
from tests.export_check import assert_same_model

from .helpers import REPO, launch_like_srun

pytestmark = pytest.mark.train


def _attributes(fn: object, owner: str) -> set[str]:
    """Every ``owner.X`` the function's source reads."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == owner}


def test_trl_preparation_reads_only_what_the_prepare_job_sets() -> None:
    from trl import SFTTrainer

    from slurmft.prepared import PREPARE_SFT_KEYS
    from slurmft.sftopts import OWNED_SFT_KEYS

    assert _attributes(SFTTrainer._prepare_dataset, "self") == {"_tokenizer", "chat_template", "completion_only_loss"}
    read = _attributes(SFTTrainer._prepare_dataset, "args")
    # what slurmft sets from run.yaml (owned keys) or passes from train.sft (PREPARE_SFT_KEYS): nothing else
    assert read - set(OWNED_SFT_KEYS) - set(PREPARE_SFT_KEYS) == set(), read
    # __init__ turns these into the attributes above (TrlPreparation does the same)
    init = _attributes(SFTTrainer.__init__, "args")
    assert {"eos_token", "chat_template_path", "completion_only_loss", "assistant_only_loss"} <= init


def _submit(run: Path, tiny_model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slurmft.cli", "submit", str(LOCAL_EXAMPLE), f"output_dir={run}",
         f"model.name_or_path={tiny_model}", *LOCAL_ARGS, *extra],
        capture_output=True, text=True, timeout=900, cwd=REPO, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})


def _rank0_log(run: Path, manifest: dict, kind: str) -> str:
    job = next(j for j in manifest["jobs"] if j["kind"] == kind)
    out = Path(job["logs"][0])
    return "".join(p.read_text(errors="replace") for p in (out, out.with_suffix(".err")) if p.is_file())


def test_local_chain_prepares_first_and_trains_bitwise_equal(local_tiny_run: Path, tiny_model: Path,
                                                              tmp_path: Path) -> None:
    # the shared tiny run prepares (prepare.enabled is the default); its twin here trains in the allocation
    manifest = json.loads((local_tiny_run / "manifest.json").read_text())
    kinds = [j["kind"] for j in manifest["jobs"]]  # then the served example's serve check and evaluation
    assert kinds[:3] == ["prepare", "train", "consolidate"] and kinds[3:] in ([], ["serve", "eval"])
    assert all(j["state"] == "COMPLETED" for j in manifest["jobs"])
    assert manifest["attempts"][0]["prepare_job"] == manifest["jobs"][0]["job_id"]
    assert "prepare job" in (local_tiny_run.parent / "submit.err").read_text()
    record = json.loads((local_tiny_run / "prepared" / "slurmft-prepared.json").read_text())
    assert record["result"]["conversations"] > record["result"]["sequences"] > 0  # packed
    assert record["settings"]["max_seq_length"] == 64 and record["num_proc"] is None  # LOCAL_ARGS
    train_log = _rank0_log(local_tiny_run, manifest, "train")
    assert "prepared sequences read from" in train_log and "loading and converting here" not in train_log
    prepare_log = _rank0_log(local_tiny_run, manifest, "prepare")
    assert "examples/s" in prepare_log and "TRL prepared" in prepare_log  # the progress: rows/s (and an ETA)

    run = tmp_path / "run"
    proc = _submit(run, tiny_model, "prepare.enabled=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    twin = json.loads((run / "manifest.json").read_text())
    assert [(j["kind"], j["state"]) for j in twin["jobs"]] == [("train", "COMPLETED"), ("consolidate", "COMPLETED")]
    assert not (run / "prepared").exists() and "prepare job" not in proc.stdout + proc.stderr
    assert "loading and converting here" in _rank0_log(run, twin, "train")  # what the in-allocation run says
    assert_same_model(run / "model", local_tiny_run / "model")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurmft.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})


def test_changed_source_is_refused_by_resume_and_the_train_job_until_prepared_again(
        tiny_model: Path, tmp_path: Path, job_env: dict[str, str]) -> None:
    from slurmft.config_loading import dump_config, load_config
    from slurmft.prepared import needed_for_new_run
    from slurmft.rundir import RunPaths, new_manifest, record_job, start_attempt, write_manifest

    data = tmp_path / "chat.jsonl"
    rows = (REPO / "examples" / "tiny" / "data" / "lima.jsonl").read_text().splitlines()[:60]
    data.write_text("\n".join(rows) + "\n")
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    raw = yaml.safe_load(LOCAL_EXAMPLE.read_text())
    raw.update(output_dir=str(run))
    raw["model"]["name_or_path"] = str(tiny_model)
    raw["data"]["datasets"] = [{"path": str(data)}]
    raw["prepare"] = {"enabled": True}
    raw["train"]["max_steps"] = 2
    config.write_text(yaml.safe_dump(raw))

    # before any GPU: the counts, from the run.yaml, into output_dir/prepared only
    proc = _cli("prepare", str(config), "--here", "train.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "60 conversations -> " in proc.stdout and "packing fills" in proc.stdout
    # the submit that reuses it is given the same overrides (it said `slurmft submit run.yaml` of one prepared with
    # output_dir=..., whose submit would not have found it)
    assert f"`slurmft submit {config} train.max_steps=2` reuses it" in proc.stdout, proc.stdout
    said: list[str] = []  # and that submit says it reuses it (the prepare job was missing without a word)
    assert not needed_for_new_run(RunPaths.of(run), load_config(config), said.append)
    assert said == [f"prepared data reused (no prepare job): {proc.stdout.splitlines()[0].removeprefix('prepared: ')}"]
    assert sorted(p.name for p in run.iterdir()) == ["prepared"]
    proc = _cli("validate", str(config))  # validate sees the counts
    assert proc.returncode == 0 and "prepared data: 60 conversations -> " in proc.stdout, proc.stdout + proc.stderr

    # a run whose train job failed (resumable), as the local executor records it
    cfg = load_config(config)
    paths = RunPaths.of(run)
    (run / "config.yaml").write_text(dump_config(cfg))
    manifest = new_manifest(cfg.name, "local", paths.run_id)
    start_attempt(manifest, "submit")
    dead = subprocess.Popen(["true"])
    dead.wait()
    record_job(manifest, "train", str(dead.pid), pid=dead.pid, host=os.uname().nodename, state="FAILED")
    write_manifest(paths, manifest)

    with open(data, "a") as f:  # the source grows after preparation
        f.write(rows[0] + "\n")
    proc = _cli("resume", str(run))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"data.datasets[0] ({data}): the file changed after preparation" in proc.stderr
    assert f"slurmft prepare {run}" in proc.stderr
    assert json.loads(paths.manifest.read_text()) == manifest  # nothing submitted, nothing recorded

    # the train job on the changed source: every rank stops with the same words, nothing trains
    code, out = launch_like_srun(run, job_env).wait(timeout=300)  # one process per rank, as srun starts them
    assert code == 2, out[-3000:]
    errors = re.findall(r"slurmft rank (\d): setup error: (.*)", out)
    assert sorted(r for r, _ in errors) == ["0", "1"], out[-3000:]  # every rank stops, none hangs
    assert out.count("the file changed after preparation") >= 2 and f"slurmft prepare {run}" in out
    assert not list(run.glob("checkpoints/checkpoint-*"))

    proc = _cli("prepare", str(run), "--here")  # the fix
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "61 conversations -> " in proc.stdout
    recorded = json.loads(paths.manifest.read_text())["jobs"][-1]
    assert recorded["kind"] == "prepare" and recorded["here"] and recorded["state"] == "COMPLETED"
    from slurmft import prepared

    assert prepared.check(paths, cfg)["result"]["conversations"] == 61


PREPARE_WITH = """
import sys

import datasets

from slurmft.config_loading import read_run_config
from slurmft.job import data, prepare
from slurmft.job.inputs import load_tokenizer, resolve_model_dir, resolve_tokenizer_dir
from slurmft.rundir import RunPaths

datasets.disable_caching()  # each preparation computes every step itself, with its own number of processes
one, three, allocation = sys.argv[1:4]
prepare.prepare_run(one, num_proc=1)
prepare.prepare_run(three, num_proc=3)
paths = RunPaths.of(allocation)  # what the train job does with prepare.enabled: false (slurmft/job/train.py)
cfg = read_run_config(paths.config)
model_dir = resolve_model_dir(cfg.model, with_weights=False)
tokenizer = load_tokenizer(resolve_tokenizer_dir(cfg.model, model_dir), cfg)
mixed = data.load_mixture(cfg.data, cfg.train.seed, tokenizer)
prepare.prepare_rows(cfg, tokenizer, mixed, cfg.data.num_proc, paths.checkpoints, paths).save_to_disk(
    str(paths.prepared))
"""


def test_the_prepared_set_does_not_depend_on_the_number_of_processes(tiny_model: Path, tmp_path: Path,
                                                                      job_env: dict[str, str]) -> None:
    """The tiny example's 800 conversations, prepared by 1 and by 3 processes and as the train job prepares them in
    its allocation (one process for the three: one start-up): the same packed rows, in the same order (TRL alone
    packed each process's share apart: issue 45)."""
    from datasets import load_from_disk

    from tests.job.helpers import write_run

    runs = {how: write_run(tmp_path / f"run-{how}", tiny_model, ["data.max_seq_length=64"])
            for how in ("1", "3", "allocation")}
    proc = subprocess.run([sys.executable, "-c", PREPARE_WITH, *map(str, runs.values())], capture_output=True,
                          text=True, timeout=600, cwd=REPO, env=job_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sets = {how: load_from_disk(str(run / "prepared")) for how, run in runs.items()}
    first = sets["1"][:]
    assert len(sets["1"]) > 100 and set(first) == {"input_ids", "labels", "seq_lengths"}
    assert max(map(len, first["input_ids"])) <= 64
    for how in ("3", "allocation"):
        assert sets[how][:] == first, how


def test_the_prepare_job_of_a_run_using_every_optional_package(tiny_model: Path, tmp_path: Path,
                                                                job_env: dict[str, str]) -> None:
    """The prepare job keeps wandb, torchao and peft out of its process (slurmft/job/unused_packages.py) and still
    checks what the train job after it needs: a run reporting to W&B and TensorBoard, with LoRA and torchao's
    optimizer, prepares (it failed with "wandb is enabled but the wandb package is not installed": issue 45)."""
    from tests.job.helpers import write_run

    rows = (REPO / "examples" / "tiny" / "data" / "lima.jsonl").read_text().splitlines()[:40]
    (tmp_path / "chat.jsonl").write_text("\n".join(rows) + "\n")

    def every_package(cfg: dict) -> None:
        cfg["data"]["datasets"] = [{"path": str(tmp_path / "chat.jsonl")}]
        cfg["train"].update(report_to=["wandb", "tensorboard"], precision="bf16-true",
                            optimizer="adamw-stochastic-rounding")
        cfg["model"]["dtype"] = "bfloat16"
        cfg["lora"] = {"r": 4}

    run = write_run(tmp_path / "run", tiny_model, ["prepare.enabled=true"], edit=every_package)
    probe = ("import sys; from slurmft.job import entrypoint, unused_packages as u; entrypoint.run_prepare(sys.argv[1]);"
             " print('kept out:', ','.join(u.kept_out))")
    proc = subprocess.run([sys.executable, "-c", probe, str(run)], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env={**job_env, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kept out: torchao,wandb,peft" in proc.stdout  # the job did keep them out
    assert (run / "prepared" / "slurmft-prepared.json").is_file()
