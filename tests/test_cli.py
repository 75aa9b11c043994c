"""slurmft.cli on bad input: each malformed config exits non-zero with one readable message naming the field,
prints no traceback, submits nothing and leaves no run directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurmft.cli import main

DATA = Path(__file__).parent / "data"


def good(tmp_path: Path) -> dict:
    return {
        "name": "bad-input",
        "output_dir": str(tmp_path / "run"),
        "executor": "slurm",
        "cluster": {"profile": "local-test"},
        "resources": {"nodes": 2, "gpus_per_node": 1},
        "model": {"name_or_path": "org/model"},
        "data": {"datasets": [{"path": str(DATA / "chat.jsonl")}]},
        "train": {"max_steps": 10},
        "checkpoint": {"every_steps": 5},
    }


def setp(d: dict, dotted: str, value: object) -> dict:
    node = d
    keys = dotted.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return d


SHELL = "x; rm -rf ~ `id` $(id) | & > <"

# (case id, dotted field to set, value, text the message must contain)
CASES = [
    ("nodes-zero", "resources.nodes", 0, "resources.nodes"),
    ("nodes-string", "resources.nodes", "two", "resources.nodes"),
    ("gpus-negative", "resources.gpus_per_node", -1, "resources.gpus_per_node"),
    ("steps-negative", "train.max_steps", -3, "train.max_steps"),
    ("lr-string", "train.learning_rate", "fast", "train.learning_rate"),
    ("batch-float", "train.per_device_batch_size", 1.5, "train.per_device_batch_size"),
    ("unknown-top-key", "trian", {"max_steps": 3}, "trian"),
    ("unknown-nested-key", "train.max_step", 3, "train.max_step"),
    ("unknown-profile", "cluster.profile", "no-such-cluster", "cluster.profile"),
    ("profile-file-missing", "cluster.profile", "/nonexistent/profile.yaml", "cluster.profile"),
    ("bad-time", "cluster.time", "forever", "cluster.time"),
    ("bad-mem", "resources.mem", "lots", "resources.mem"),
    ("bad-signal", "preemption.signal", "KILL", "preemption.signal"),
    ("lead-time-too-short", "preemption.lead_time_s", 1, "preemption.lead_time_s"),
    ("dtype-unknown", "model.dtype", "float8", "model.dtype"),
    ("attn-unknown", "model.attn_implementation", "magic", "model.attn_implementation"),
    ("datasets-empty", "data.datasets", [], "data.datasets"),
    ("weight-zero", "data.datasets", [{"path": "org/x", "weight": 0}], "data.datasets[0].weight"),
    ("dataset-file-missing", "data.datasets", [{"path": "/nonexistent/data.jsonl"}], "data.datasets[0].path"),
    ("dataset-is-a-directory", "data.datasets", [{"path": str(DATA)}], "is a directory; give one file, or a glob"),
    ("model-path-missing", "model.name_or_path", "/nonexistent/model", "model.name_or_path"),
    ("model-dir-not-a-model", "model.name_or_path", str(DATA), "model.name_or_path"),
    ("secret-in-env", "cluster.env", {"HF_TOKEN": "hf_x"}, "cluster.env"),
    ("secret-in-setup", "cluster.setup", ["module load cuda; export HF_TOKEN=hf_x"], "cluster.setup"),
    ("env-bad-key", "cluster.env", {"BAD KEY": "x"}, "cluster.env"),
    ("epochs-and-max-steps", "train.epochs", 2, "train.epochs"),
    ("shard-size", "consolidate.max_shard_size", "huge", "consolidate.max_shard_size"),
    ("executor-unknown", "executor", "kubernetes", "executor"),
    ("fsdp-disabled", "fsdp.enabled", False, "fsdp.enabled"),
    ("setup-newline", "cluster.setup", ["echo a\necho b"], "cluster.setup"),
    ("local-two-nodes", "executor", "local", "resources.nodes"),
]
SHELL_FIELDS = ["name", "output_dir", "cluster.partition", "cluster.account", "cluster.qos", "cluster.constraint",
                "cluster.time", "cluster.python", "cluster.master_addr", "resources.mem", "train.lr_scheduler",
                "consolidate.resources.partition", "consolidate.resources.mem", "consolidate.resources.time"]
CASES += [(f"shell-{f}", f, SHELL, f) for f in SHELL_FIELDS]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(args)
    return int(info.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize(("case", "field", "value", "expect"), CASES, ids=[c[0] for c in CASES])
def test_bad_config_is_refused(case: str, field: str, value: object, expect: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    cfg = setp(good(tmp_path), field, value)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, err = run_cli(["submit", str(path)], capsys)
    assert code == 2, err
    assert expect in err, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "run").exists() and not Path(str(SHELL)).exists()


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("name: [unclosed\n", "not valid YAML at line"),
        ("- just\n- a list\n", "top level must be a mapping"),
        ("", "name: required field is missing"),
    ],
)
def test_unparseable_yaml(text: str, expect: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, err = run_cli(["render", str(path)], capsys)
    assert code == 2 and expect in err and "Traceback" not in err


def test_config_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A binary file (or one saved as Latin-1) is a config error naming the file, not a UnicodeDecodeError."""
    path = tmp_path / "run.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    code, err = run_cli(["validate", str(path)], capsys)
    assert code == 2 and "not UTF-8 text" in err and "Traceback" not in err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["submit", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "does not exist" in err


def test_bad_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(good(tmp_path)))
    code, err = run_cli(["submit", str(path), "resources.nodes"], capsys)
    assert code == 2 and "key=value" in err


def test_real_process_exit_code_and_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(setp(good(tmp_path), "resources.nodes", 0)))
    out = subprocess.run([sys.executable, "-m", "slurmft.cli", "submit", str(path)], capture_output=True, text=True)
    assert out.returncode == 2 and "resources.nodes" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_existing_run_dir_is_never_clobbered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "precious.txt").write_text("keep me")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(good(tmp_path)))
    code, err = run_cli(["submit", str(path)], capsys)
    assert code == 2 and "not empty" in err
    assert (run / "precious.txt").read_text() == "keep me" and sorted(p.name for p in run.iterdir()) == ["precious.txt"]


def test_render_of_a_local_config_says_its_scripts_are_not_what_runs(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`slurmft render examples/tiny/text.yaml` printed sbatch scripts (--mem=32G, srun, SUBMITIT_EXECUTOR=slurm) with
    nothing saying the local executor never runs them: it says so now; a Slurm config is not told."""
    (tmp_path / "d.jsonl").write_text('{"text": "### Human: hi### Assistant: yo"}\n')
    path = tmp_path / "run.yaml"
    path.write_text(f"name: r\noutput_dir: {tmp_path / 'out'}\nmodel: {{name_or_path: gpt2}}\n"
                    "data: {datasets: [{path: ./d.jsonl}]}\n")
    from cli_runner import cli

    local = ["executor=local", "resources.nodes=1", "resources.gpus_per_node=0", "resources.tasks_per_node=2"]
    code, _, err = cli(["render", str(path), *local], capsys)
    assert code == 0 and "note: executor local: `slurmft submit` runs these jobs here as processes, not these " \
        "sbatch scripts" in err, err
    code, _, err = cli(["render", str(path), "executor=slurm"], capsys)
    assert code == 0 and "executor local" not in err, err
    assert not (tmp_path / "out").exists()
