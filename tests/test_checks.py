"""slurmft.plan.checks, or the first hour of a new user: what `validate` catches before the queue wait, names users
bring from other tools, YAML traps, paths, the job's Python, logs, epochs and data formats.

Every test here runs the real CLI (``slurmft.cli.main``) or the real shared code on real files: a
model directory holding the tiny model's config and tokenizer files (no weights are needed on the
login side), real data files in each format, a real venv without the training stack.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cli_runner import cli

from slurmft.config_loading import load_config
from slurmft.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

CHAT = {"messages": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4."}]}


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's config and tokenizer (chat template with generation markers), 512 positions, no weights."""
    out = tmp_path_factory.mktemp("login-model") / "model"
    out.mkdir()
    for f in tiny_model.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 512
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_run(tmp_path: Path, model_path: Path, data_path: Path | str, text: str = "", **sections: Any) -> Path:
    """A run.yaml in tmp_path: local model, one data file, a two-rank CPU allocation; ``sections`` merged in
    (None removes a section)."""
    cfg: dict[str, Any] = {
        "name": "first-hour", "output_dir": str(tmp_path / "run"), "executor": "slurm",
        "cluster": {"profile": "local-test"},
        "resources": {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 2, "cpus_per_task": 1},
        "model": {"name_or_path": str(model_path)},
        "data": {"datasets": [{"path": str(data_path)}], "max_seq_length": 256},
        "train": {"max_steps": 20},
    }
    for key, value in sections.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False) + text)
    return path




# ====================================================================== 1. validate catches it now
def test_validate_reports_every_in_job_failure_at_once(tmp_path: Path, model_dir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's list, in one config: each used to pass validate and fail after the queue wait."""
    odd = jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    bare = tmp_path / "bare-tokenizer"
    bare.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, bare / f)
    conf = json.loads((bare / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(conf))
    path = write_run(tmp_path, model_dir, odd, model={"tokenizer": str(bare)},
                     data={"datasets": [{"path": str(odd)}, {"path": str(tmp_path / "missing.jsonl")}],
                           "max_seq_length": 4096},
                     train={"max_steps": 20, "report_to": ["mlflow"],
                            "sft": {"gradient_checkpointing": True, "save_steps": 5, "not_a_real_option": 3}})
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 2 and "Traceback" not in err
    for expected in [
        "data.datasets[0] (odd.jsonl): cannot find a conversation in the columns ['question', 'answer']",
        "data.datasets[1].path: file",  # a second problem of the same kind: not only the first
        "data.max_seq_length (4096) is larger than the model's max_position_embeddings (512)",
        "train.sft.gradient_checkpointing: set by slurmft; use fsdp.activation_checkpointing",
        "train.sft.save_steps: set by slurmft; use checkpoint.every_steps",
        "train.sft.not_a_real_option: not an option of TRL",
        "train.report_to: 'mlflow' is not supported",
        "has no chat template",
    ]:
        assert expected in err, f"{expected!r} not in:\n{err}"
    assert "8 problem(s)" in err


def test_sequence_length_is_refused_by_estimate_too(tmp_path: Path, model_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]), data={"max_seq_length": 4096})
    code, _, err = cli(["estimate", str(path)], capsys)
    assert code == 2 and "set data.max_seq_length to at most 512" in err


def test_template_without_generation_markers_is_refused_with_assistant_only_loss(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    data = jsonl(tmp_path / "c.jsonl", [CHAT])
    path = write_run(tmp_path, model_dir, data, train={"sft": {"chat_template_path": str(plain)}})
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 2 and "data.assistant_only_loss needs {% generation %} markers" in err
    code, out, err = cli(["validate", str(path), "data.assistant_only_loss=false"], capsys)
    assert code == 0, err


def test_template_that_cannot_render_the_data_is_refused(tmp_path: Path, model_dir: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                      "{% endif %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}")
    data = jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "system", "content": "be brief"}, *CHAT["messages"]]}])
    path = write_run(tmp_path, model_dir, data, train={"sft": {"chat_template_path": str(strict)}})
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 2 and "cannot render conversation 0 (TemplateError: no system role)" in err


def test_a_good_config_validates_and_says_what_was_not_checked(tmp_path: Path, model_dir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT] * 3),
                     data={"datasets": [{"path": str(tmp_path / "c.jsonl")}, {"path": "GAIR/lima"}]})
    code, out, err = cli(["validate", str(path)], capsys)
    assert code == 0, err
    assert "ok (run first-hour" in out
    assert "not checked: data.datasets[1]: hub dataset 'GAIR/lima'" in err


# ====================================================================== 2. the README's override line
def test_readme_override_line_validates_and_the_last_step_is_saved(tmp_path: Path, model_dir: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]),
                     cluster={"profile": "local-test"}, train={"max_steps": 500}, checkpoint={"every_steps": 100})
    code, out, err = cli(["validate", str(path), "resources.nodes=4", "train.max_steps=10",
                          "cluster.partition=gpu"], capsys)
    assert code == 0, err
    assert "4 node(s)" in out
    # why that is right: the Trainer saves at max_steps whatever save_steps is
    from types import SimpleNamespace

    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    args = SimpleNamespace(logging_first_step=False, logging_strategy=IntervalStrategy.NO, eval_strategy="no",
                           save_strategy=SaveStrategy.STEPS, eval_delay=0)
    state = SimpleNamespace(global_step=10, max_steps=10, save_steps=100, logging_steps=1, eval_steps=None)
    control = DefaultFlowCallback().on_step_end(args, state, TrainerControl())
    assert control.should_save and control.should_training_stop


# ====================================================================== 3. YAML traps
def test_yaml_numbers_mean_what_they_look_like(tmp_path: Path, model_dir: Path) -> None:
    data = jsonl(tmp_path / "c.jsonl", [CHAT])
    text = ("cluster:\n  profile: local-test\n  time: 16:00:00\n  env: {NCCL_NSOCKS_PERTHREAD: 4}\n"
            "resources: {nodes: 1, gpus_per_node: 0, tasks_per_node: 2, mem: 0}\n")
    path = write_run(tmp_path, model_dir, data)
    raw = yaml.safe_load(path.read_text())
    del raw["cluster"], raw["resources"]
    path.write_text(yaml.safe_dump(raw) + text + "consolidate: {resources: {time: 2:00:00}}\n")
    cfg = load_config(path, ["train.sft.adam_epsilon=1e-8"])
    assert cfg.cluster.time == "16:00:00" and cfg.consolidate.resources.time == "2:00:00"
    assert cfg.resources.mem == "0" and cfg.cluster.env == {"NCCL_NSOCKS_PERTHREAD": "4"}
    assert cfg.train.sft["adam_epsilon"] == 1e-8 and isinstance(cfg.train.sft["adam_epsilon"], float)
    from slurmft.config_loading import load_yaml_text

    assert load_yaml_text("a: 1e-8\nb: 010\nc: 12:30")["a"] == 1e-8


def test_sft_values_are_coerced_to_sftconfig_types(tmp_path: Path, model_dir: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A quoted '1e-8' (or any string a YAML 1.1 tool wrote) reaches SFTConfig as the float it declares."""
    from slurmft.plan.checks import run_checks

    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]),
                     train={"max_steps": 20, "sft": {"adam_epsilon": "1e-8", "warmup_steps": "5",
                                                     "adam_beta2": "fast"}})
    cfg = load_config(path)
    report = run_checks(cfg, job_python=False)
    assert report.problems == ["train.sft.adam_beta2: expects float, got 'fast' (str)"]
    cfg.train.sft.pop("adam_beta2")
    assert run_checks(cfg, job_python=False).problems == []
    assert cfg.train.sft["adam_epsilon"] == 1e-8 and cfg.train.sft["warmup_steps"] in (5, 5.0)
    from slurmft.config_loading import dump_config

    assert yaml.safe_load(dump_config(cfg))["train"]["sft"]["adam_epsilon"] == 1e-8  # what the job reads


def test_a_boolean_where_a_string_is_wanted_says_quote_it(tmp_path: Path, model_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]),
                     cluster={"profile": "local-test", "env": {"WANDB_DISABLED": True}})
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 2 and 'cluster.env.WANDB_DISABLED: expected a string, got True' in err and 'quote it ("true")' in err


# ====================================================================== 4. familiar names
@pytest.mark.parametrize(("key", "ours"), [
    ("per_device_train_batch_size", "train.per_device_batch_size"),
    ("bf16", "model.dtype"),
    ("gradient_checkpointing", "fsdp.activation_checkpointing"),
    ("lr_scheduler_type", "train.lr_scheduler"),
    ("num_train_epochs", "train.epochs"),
    ("warmup_steps", "train.warmup_ratio"),
    ("micro_batch_size", "train.per_device_batch_size"),
    ("sequence_len", "data.max_seq_length"),
])
def test_familiar_names_get_a_did_you_mean(key: str, ours: str, tmp_path: Path, model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]))
    code, _, err = cli(["validate", str(path), f"train.{key}=1"], capsys)
    assert code == 2 and f"train.{key}: unknown key; did you mean {ours}?" in err, err


def test_an_unknown_train_key_points_at_the_sft_passthrough(tmp_path: Path, model_dir: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]))
    code, _, err = cli(["validate", str(path), "train.adam_beta2=0.95"], capsys)
    assert code == 2 and "goes under train.sft: (train.sft.adam_beta2=...)" in err
    code, _, err = cli(["validate", str(path), "train.sft.adam_beta2=0.95"], capsys)
    assert code == 0, err


def test_list_items_can_be_overridden(tmp_path: Path, model_dir: Path) -> None:
    data = jsonl(tmp_path / "c.jsonl", [CHAT])
    path = write_run(tmp_path, model_dir, data, data={"datasets": [{"path": str(data)}, {"path": "GAIR/lima"}]})
    cfg = load_config(path, ["data.datasets[0].weight=2", "data.datasets.1.format=lima"])
    assert cfg.data.datasets[0].weight == 2 and cfg.data.datasets[1].format == "lima"
    with pytest.raises(ConfigError, match=r"data.datasets\[5\] does not exist"):
        load_config(path, ["data.datasets[5].weight=2"])


# ====================================================================== 5. one rule for paths
def test_relative_paths_are_relative_to_where_they_were_written(tmp_path: Path, model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    jsonl(project / "data" / "c.jsonl", [CHAT])
    shutil.copy(Path(__file__).parent.parent / "configs" / "clusters" / "ethernet.yaml", project / "mycluster.yaml")
    (project / "run.yaml").write_text(
        f"name: r\noutput_dir: runs/r\ncluster: {{profile: ./mycluster.yaml}}\nmodel: {{name_or_path: {model_dir}}}\n"
        "data: {datasets: [{path: data/c.jsonl}]}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(project / "run.yaml")
    assert cfg.output_dir == str(project / "runs" / "r")
    assert cfg.cluster.profile == str(project / "mycluster.yaml")
    assert cfg.data.datasets[0].path == str(project / "data" / "c.jsonl")
    cfg = load_config(project / "run.yaml", ["output_dir=runs/r2"])  # the command line: the current directory
    assert cfg.output_dir == str(elsewhere / "runs" / "r2")


# ====================================================================== 6. the job's Python
@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real venv without the training stack (what a login node often has)."""
    venv = tmp_path_factory.mktemp("bare-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


def test_submit_refuses_a_job_python_without_the_training_stack(tmp_path: Path, model_dir: Path, bare_python: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]),
                     cluster={"profile": "local-test", "python": str(bare_python)})
    code, _, err = cli(["submit", str(path)], capsys)
    assert code == 2 and f"cluster.python: {bare_python} cannot import" in err and "torch" in err
    assert "set cluster.python to the interpreter of an environment" in err and "cluster.setup" in err
    assert not (tmp_path / "run").exists()
    code, _, err = cli(["submit", str(path), "cluster.python=/nonexistent/venv/bin/python"], capsys)
    assert code == 2 and "/nonexistent/venv/bin/python does not exist on this machine" in err
    # a Python that cluster.setup provides on the compute nodes cannot be checked here: one line says so
    code, out, err = cli(["validate", str(path), "cluster.python=python", "cluster.setup=[module load sft]"], capsys)
    assert code == 0 and "not checked: cluster.python: 'python' comes from cluster.setup" in err


def test_a_lora_run_needs_peft_in_the_job_python(tmp_path: Path, model_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The training stack without peft (a sitecustomize hides it from this very Python): a full fine-tune
    passes, a lora section is refused before submitting, with the install that gives it."""
    hide = tmp_path / "hide-peft"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['peft'] = None  # find_spec: None, import fails\n")
    python = tmp_path / "python-without-peft"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={hide}:{REPO} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]),
                     cluster={"profile": "local-test", "python": str(python)})
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 0, err
    code, _, err = cli(["validate", str(path), "lora.r=8"], capsys)
    assert code == 2 and f"lora: cluster.python: {python} cannot import peft" in err, err
    assert "pip install -e '.[train]'" in err and "remove the lora section" in err
    code, _, err = cli(["submit", str(path), "lora.r=8"], capsys)
    assert code == 2 and "cannot import peft" in err and not (tmp_path / "run").exists()


def test_an_adapter_on_tied_embeddings_is_refused_before_submitting(tmp_path: Path, model_dir: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """target_modules [q_proj, lm_head] on a model whose config.json ties its embeddings (Qwen2-0.5B, Gemma):
    validate refuses with the job's own words and the fix; untied, the same section is fine."""
    tied = tmp_path / "tied"
    shutil.copytree(model_dir, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    path = write_run(tmp_path, tied, jsonl(tmp_path / "c.jsonl", [CHAT]), cluster={"profile": "local-test"})
    code, _, err = cli(["validate", str(path), "lora.target_modules=[q_proj, lm_head]"], capsys)
    assert code == 2 and "lora.target_modules: 'lm_head' is one of the tied input and output embeddings of " \
        "LlamaForCausalLM" in err, err
    assert "Leave it out (adapt the decoder layers" in err and "'q_proj'" not in err
    code, _, err = cli(["validate", str(path), "lora.target_modules=[q_proj, lm_head]", f"model.name_or_path={model_dir}"],
                       capsys)
    assert code == 0, err


def test_the_train_extra_holds_everything_the_job_python_check_asks_for() -> None:
    """The README's install (`pip install -e '.[train]'`) gives what validate checks, LoRA's peft included."""
    import tomllib

    from slurmft.plan.checks import LORA_STACK, TRAINING_STACK

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[]", d)[0] for d in project["dependencies"] + project["optional-dependencies"]["train"]}
    assert set(TRAINING_STACK) - {"slurmft"} | set(LORA_STACK) <= names, names
    assert "pip install -e '.[train]'" in (REPO / "README.md").read_text()


# ====================================================================== 7. logs of a local run
def test_logs_of_a_local_run_show_stderr_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slurmft.rundir import RunPaths, new_manifest, record_job, write_manifest

    paths = RunPaths.of(tmp_path / "run")
    paths.root.mkdir()
    logs = [tmp_path / "run" / "submitit" / f"123_{r}_log.out" for r in range(2)]
    logs[0].parent.mkdir()
    for r, out in enumerate(logs):
        out.write_text(f"rank {r} stdout: {{'loss': 1.0}}\n")
        out.with_suffix(".err").write_text(f"[slurmft rank{r} 12:00:00] JobSetupError: data.datasets[0]: bad\n")
    manifest = new_manifest("r", "local")
    record_job(manifest, "train", "123", logs=[str(p) for p in logs])
    write_manifest(paths, manifest)
    code, out, _ = cli(["logs", str(paths.root)], capsys)
    assert code == 0
    assert "rank 0 stdout" in out and "[slurmft rank0 12:00:00] JobSetupError" in out
    assert "[slurmft rank1 12:00:00]" in out and "123_0_log.err <==" in out


# ====================================================================== 8. what users expect
def test_epochs_instead_of_max_steps(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"messages": [{"role": "user", "content": f"question {i} " * 20},
                          {"role": "assistant", "content": f"answer {i} " * 20}]} for i in range(200)]
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", rows), train={"max_steps": None, "epochs": 2})
    code, out, err = cli(["validate", str(path)], capsys)
    assert code == 0, err
    assert "batch: 2 rank(s) x 1 x 1 accumulation = 2 packed sequences of 256 tokens = 512 tokens per optimizer step" \
        in out
    assert "optimizer steps per epoch" in out and "train.epochs 2 -> ~" in out
    assert load_config(path, ["train.max_steps=10"]).train.epochs is None  # the command line's smoke test wins
    code, out, err = cli(["validate", str(path), "data.packing=false"], capsys)  # was: "(up to of 256 tokens)"
    assert code == 0, err
    assert "accumulation = 2 sequences (up to 256 tokens each) = 512 tokens at most per optimizer step" in out
    both = write_run(tmp_path, model_dir, tmp_path / "c.jsonl", train={"max_steps": 10, "epochs": 2})
    code, _, err = cli(["validate", str(both)], capsys)
    assert code == 2 and "train.epochs (2.0) and train.max_steps (10) are both set" in err


def test_epochs_become_steps_from_the_packed_count() -> None:
    from slurmft.config import TrainConfig
    from slurmft.epochs import plan_steps

    cfg = type("C", (), {"train": TrainConfig(epochs=2.5, per_device_batch_size=2, gradient_accumulation_steps=2)})
    # 16 sequences a step: ceil(101 / 16) = 7 steps per epoch, the last completed from the epoch's first sequences
    # (slurmft/job/sampler.py: the same on every shape; the Trainer's own sampler left a short step here)
    plan = plan_steps(cfg, sequences=101, world_size=4)
    assert (plan["steps_per_epoch"], plan["max_steps"], plan["sequences_per_step"]) == (7, 18, 16)


@pytest.mark.parametrize(("name", "rows", "extra", "expected"), [
    ("alpaca.jsonl", [{"instruction": "Add.", "input": "2 and 2", "output": "4"}], {},
     [{"role": "user", "content": "Add.\n\n2 and 2"}, {"role": "assistant", "content": "4"}]),
    ("pc.jsonl", [{"prompt": "Capital of France?", "completion": "Paris."}], {},
     [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]),
    ("sharegpt.jsonl", [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}],
     {"format": "sharegpt"}, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
    ("mine.jsonl", [{"question": "why?", "answer": "because."}],
     {"format": "prompt_completion", "columns": {"prompt": "question", "completion": "answer"}},
     [{"role": "user", "content": "why?"}, {"role": "assistant", "content": "because."}]),
    ("mine.csv", None, {"columns": {"instruction": "task", "output": "reply"}},
     [{"role": "user", "content": "sum 1 2"}, {"role": "assistant", "content": "3"}]),
])
def test_data_formats_validate_and_convert(name: str, rows: list[dict] | None, extra: dict, expected: list[dict],
                                           tmp_path: Path, model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from slurmft import formats
    from slurmft.config import DatasetSource
    from slurmft.sourcefiles import read_rows

    path = tmp_path / name
    if rows is None:
        path.write_text("task,reply\nsum 1 2,3\n")
    else:
        jsonl(path, rows)
    run = write_run(tmp_path, model_dir, path, data={"datasets": [{"path": str(path), **extra}]})
    code, out, err = cli(["validate", str(run)], capsys)
    assert code == 0, err
    src = DatasetSource(path=str(path), **extra)
    row = formats.rename(read_rows(path, 1)[0], src.columns)
    fmt, column = formats.detect_format(src, list(row), row, "src")
    assert formats.to_messages(row, fmt, column) == expected


def test_the_job_reads_those_formats_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's loader (datasets) on an Alpaca jsonl and a mapped csv: the conversations validate saw."""
    from slurmft.config import DataConfig, DatasetSource
    from slurmft.job import data

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    alpaca = jsonl(tmp_path / "a.jsonl", [{"instruction": "Add.", "input": "", "output": "4"}] * 3)
    mine = tmp_path / "m.csv"
    mine.write_text("task,reply\nsum 1 2,3\nsum 2 2,4\n")
    ds = data.load_mixture(DataConfig(datasets=[
        DatasetSource(path=str(alpaca)), DatasetSource(path=str(mine), columns={"instruction": "task",
                                                                               "output": "reply"})]), 0)
    seen = {tuple((m["role"], m["content"]) for m in row) for row in ds["messages"]}
    assert (("user", "Add."), ("assistant", "4")) in seen and (("user", "sum 1 2"), ("assistant", "3")) in seen


def test_sharegpt_format_is_accepted_by_the_config() -> None:
    from slurmft.config import DatasetSource

    assert DatasetSource(path="x.jsonl", format="sharegpt").format == "sharegpt"


def test_validate_and_estimate_say_which_profile_they_assumed(tmp_path: Path, model_dir: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]), cluster=None)
    for command in ("validate", "estimate"):
        code, _, err = cli([command, str(path), "resources.gpus_per_node=8"], capsys)
        assert code == 0, err
        assert "note: no cluster.profile given; assuming 'ethernet': A100-80GB GPUs (80 GB), 512 GB RAM" in err
        # a CPU run (examples/tiny, the README's first command) is not told of GPUs it will not use
        code, _, err = cli([command, str(path), "resources.gpus_per_node=0"], capsys)
        assert code == 0, err
        assert "note: no cluster.profile given; assuming 'ethernet': 512 GB RAM per node" in err and "GPU" not in err


def test_validate_says_when_submit_would_refuse_the_output_dir(tmp_path: Path, model_dir: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`validate run.yaml` said ok of a config whose output_dir holds a finished run, and `submit` then refused it
    (seen re-running examples/tiny/text.yaml): validate says so beforehand. RUN_DIR/config.yaml is a resume's check
    and a free output_dir says nothing."""
    from runfixture import local_run

    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]))
    code, out, err = cli(["validate", str(path)], capsys)
    assert code == 0 and "would refuse" not in out, err
    run = local_run(tmp_path, "run")  # write_run's output_dir, now a finished run
    code, out, err = cli(["validate", str(path)], capsys)
    assert code == 0, err
    assert f"note: `slurmft submit` would refuse this output_dir: output_dir {run} already holds a " in out, out
    code, out, err = cli(["submit", str(path)], capsys)
    assert code == 2 and f"output_dir {run} already holds a " in err


def test_a_local_run_without_a_profile_is_estimated_with_this_machines_ram(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A local run's ranks run here: `estimate` (and validate/submit's fit check) counts this machine's RAM, not the
    default profile's 512 GB node (examples/tiny/text.yaml on a 25 GB machine was said to have 256 GB per rank)."""
    import os

    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]), cluster=None)
    here = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    for executor, node_gb in (("local", here), ("slurm", 512)):
        code, out, err = cli(["estimate", str(path), f"executor={executor}", "--json"], capsys)
        assert code == 0, err
        assert json.loads(out)["cpu_ram_per_node"]["capacity"] == int(node_gb * 1e9)
        assert json.loads(out)["per_gpu"]["capacity"] == int(node_gb * 1e9) // 2  # 2 ranks share the node
        assert (f"this machine's {here:g} GB RAM, where the local executor runs the ranks" in err) == \
            (executor == "local"), err
    # a profile the config names is taken as written, locally too
    code, out, err = cli(["estimate", str(path), "executor=local", "cluster.profile=ethernet", "--json"], capsys)
    assert code == 0 and json.loads(out)["cpu_ram_per_node"]["capacity"] == 512 * 10**9 and "note:" not in err


def test_a_local_cpu_runs_estimate_says_this_machine_and_sdpa(tmp_path: Path, model_dir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft estimate` of a local CPU run without a profile (examples/tiny/text.yaml) said `2 ranks on CPU
    (ethernet)` and `flash/sdpa attention`: its ranks run on this machine, and flash-attention 2 needs a CUDA device
    (CPU ranks get SDPA). A Slurm run still names its profile."""
    path = write_run(tmp_path, model_dir, jsonl(tmp_path / "c.jsonl", [CHAT]), cluster=None)
    for executor, where in (("local", "this machine"), ("slurm", "ethernet")):
        code, out, err = cli(["estimate", str(path), f"executor={executor}", "--json"], capsys)
        assert code == 0, err
        result = json.loads(out)
        assert result["setup"]["this_machine"] == (executor == "local") and result["setup"]["attention"] == "sdpa"
        assert any(a.startswith("SDPA (flash-attention 2 needs a CUDA device)") or
                   "; SDPA (flash-attention 2 needs a CUDA device): no seq x seq matrix" in a
                   for a in result["assumptions"]), result["assumptions"]
        code, out, err = cli(["estimate", str(path), f"executor={executor}"], capsys)
        said = " ".join(out.split())  # the table's head wraps at the terminal's width
        assert code == 0 and f"2 ranks on CPU ({where})," in said and "sdpa attention" in said, said
        assert "flash/sdpa" not in said and "flash-attention/SDPA" not in said, said


# ====================================================================== preference data (dpo:)
PAIR = {"prompt": "What is 2 plus 2?", "chosen": "4.", "rejected": "5."}
HH = {"chosen": "\n\nHuman: What is 2 plus 2?\n\nAssistant: 4.", "rejected": "\n\nHuman: What is 2 plus 2?\n\nAssistant: 5."}
ULTRAFEEDBACK = {"prompt": "What is 2 plus 2?", "score_chosen": 9.0, "score_rejected": 2.0,
                 "chosen": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4."}],
                 "rejected": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "5."}]}


@pytest.mark.parametrize("rows", [[PAIR] * 3, [HH] * 3, [ULTRAFEEDBACK] * 3,
                                  [{"question": "What is 2 plus 2?", "good": "4.", "bad": "5."}] * 3])
def test_preference_layouts_validate_under_dpo(rows: list[dict], tmp_path: Path, model_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    data = jsonl(tmp_path / "p.jsonl", rows)
    source: dict[str, Any] = {"path": str(data)}
    if "good" in rows[0]:
        source["columns"] = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    path = write_run(tmp_path, model_dir, data, dpo={}, data={"datasets": [source]})
    code, out, err = cli(["validate", str(path)], capsys)
    assert code == 0, err
    assert "preference pairs" in err + out and "data.packing: does not apply to DPO" in err + out
    assert "~3 preference pairs per epoch" in out and "sequences per epoch" not in out  # an epoch is its pairs


def test_sft_data_under_dpo_and_preference_data_without_it_are_refused_naming_the_columns(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sft = jsonl(tmp_path / "c.jsonl", [CHAT])
    code, _, err = cli(["validate", str(write_run(tmp_path, model_dir, sft, dpo={}))], capsys)
    assert code == 2 and "dpo: trains on preference data" in err and "the columns are ['messages']" in err
    pairs = jsonl(tmp_path / "p.jsonl", [PAIR])
    code, _, err = cli(["validate", str(write_run(tmp_path, model_dir, pairs))], capsys)
    assert code == 2 and "the columns ['prompt', 'chosen', 'rejected'] are preference data" in err
    assert "add a dpo: section" in err


def test_a_preference_row_with_an_empty_chosen_is_refused(tmp_path: Path, model_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    data = jsonl(tmp_path / "p.jsonl", [PAIR, {**PAIR, "chosen": "  "}, PAIR])
    code, _, err = cli(["validate", str(write_run(tmp_path, model_dir, data, dpo={}))], capsys)
    assert code == 2 and "row 1 has an empty 'chosen'" in err
