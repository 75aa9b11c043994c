"""The README's and docs/first-run.md's commands work, as far as they need no GPU; docs/development.md's device
command for the GPU smoke parses and fits its time limit.

Every ``slurmft validate|render|estimate`` line in a fenced block of those two files is run as
written (the ``run.yaml`` placeholder is run against each shipped Slurm example; any other
path must exist), every shipped
example passes validate, render and estimate, the README's override line validates, and the
data and profile snippets of docs/first-run.md are read by the code that reads users' files.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from bench_module import load_bench
from cli_runner import cli

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "docs" / "first-run.md"]
EXAMPLES = sorted(p for p in (REPO / "examples").rglob("*.yaml"))
SLURM_EXAMPLES = [p for p in EXAMPLES if yaml.safe_load(p.read_text()).get("executor") != "local"]
TINY = REPO / "examples" / "tiny" / "run.yaml"
PLACEHOLDER = "run.yaml"  # the one config name the docs use for "your config"
README_OVERRIDES = ["resources.nodes=4", "train.max_steps=10", "cluster.partition=gpu"]


def fenced(path: Path, lang: str | None = None) -> list[str]:
    """The fenced code blocks of a Markdown file (of one language)."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), flags=re.S | re.M)
    return [body for tag, body in blocks if lang is None or tag == lang]


def doc_commands() -> list[tuple[str, str]]:
    """(file, command line) for every login-side command the docs show."""
    out = []
    for doc in DOCS:
        for block in fenced(doc):
            for line in block.splitlines():
                line = line.split("#", 1)[0].strip()
                if re.match(r"^slurmft (validate|render|estimate) ", line) and "[" not in line:
                    out.append((doc.name, line))
    return out


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code, out, err = cli(args, capsys)
    return code, out + err


def with_tiny_model(path: Path, tiny_model: Path) -> list[str]:
    """The tiny example's model is built by `python -m slurmft.tiny` (README); the tests build it once."""
    return [f"model.name_or_path={tiny_model}"] if path.parent == TINY.parent else []  # run.yaml, dpo.yaml


def test_the_docs_show_commands_to_run() -> None:
    found = {doc for doc, _ in doc_commands()}
    assert found == {"README.md", "first-run.md"}


@pytest.mark.parametrize(("doc", "line"), doc_commands(), ids=[f"{d}:{c}" for d, c in doc_commands()])
def test_doc_command_runs(doc: str, line: str, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    args = shlex.split(line)[1:]
    if args[1] == PLACEHOLDER:  # `slurmft validate run.yaml`: stands for any config, so every Slurm example
        configs = SLURM_EXAMPLES
    else:  # a documented path must exist: a typo in the docs fails here
        assert (REPO / args[1]).is_file(), f"{doc}: `{line}` names {args[1]}, which does not exist"
        configs = [Path(args[1])]
    for config in configs:
        code, output = run([args[0], str(config), *args[2:]], capsys)
        assert code == 0, f"{line} ({config}):\n{output}"


@pytest.mark.parametrize("command", ["validate", "render", "estimate"])
@pytest.mark.parametrize("example", EXAMPLES, ids=[str(p.relative_to(REPO)) for p in EXAMPLES])
def test_every_shipped_example(example: Path, command: str, tiny_model: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    code, output = run([command, str(example), *with_tiny_model(example, tiny_model)], capsys)
    assert code == 0, output
    if command == "estimate":
        assert "fits" in output and "does not fit" not in output


@pytest.mark.parametrize("example", SLURM_EXAMPLES, ids=[p.name for p in SLURM_EXAMPLES])
def test_readme_override_line(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = (REPO / "README.md").read_text()
    assert f"slurmft submit run.yaml {' '.join(README_OVERRIDES)}" in readme
    code, output = run(["validate", str(example), *README_OVERRIDES], capsys)
    assert code == 0 and "4 node(s)" in output, output


def test_first_run_data_examples_are_read_as_documented(tmp_path: Path) -> None:
    from slurmft import formats
    from slurmft.config import DatasetSource

    blocks = fenced(REPO / "docs" / "first-run.md", "json")
    assert len(blocks) == 6
    for block in blocks:
        rows = [json.loads(line) for line in block.splitlines()]
        assert len(rows) == 2
        fmt, column = formats.detect_format(DatasetSource(path="x.jsonl"), list(rows[0]), rows[0], "doc")
        for row in rows:
            assert formats.is_usable(formats.to_messages(row, fmt, column)), (fmt, row)


def test_first_run_profile_example_is_a_valid_profile(tmp_path: Path) -> None:
    from slurmft.profiles import ClusterProfile, load_profile

    block = next(b for b in fenced(REPO / "docs" / "first-run.md", "yaml") if "gres_gpu" in b)
    path = tmp_path / "my-cluster.yaml"
    path.write_text(block)
    profile = load_profile(str(path))
    documented = set(re.findall(r"^\s*(\w+):", block, flags=re.M)) - set(profile.env)
    assert documented >= set(ClusterProfile.model_fields) | set(profile.gpu.model_fields)  # every field shown


# Files slurmft writes into a run directory: named by the docs, never part of the repository.
RUN_DIR_FILES = {"report.md"}
# Pages of tools outside the repository that a file names as its source (bench/gpu_image_packages.txt: the
# device tool's page of the GPU image's packages).
OUTSIDE_FILES = {"KINDS.md"}


def test_the_repository_cites_only_files_it_contains() -> None:
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    names = {Path(p).name for p in tracked} | set(tracked)
    missing = []
    for rel in tracked:
        if not rel.endswith((".py", ".md", ".yaml", ".txt", ".j2", ".sh", ".toml")):
            continue
        text = (REPO / rel).read_text(errors="replace")
        for cited in set(re.findall(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]+\.md\b", text)):
            local = (REPO / rel).parent / cited
            if Path(cited).name in RUN_DIR_FILES | OUTSIDE_FILES:
                continue
            if cited not in names and cited.lstrip("./") not in names and not local.exists():
                missing.append(f"{rel} cites {cited}")
    assert not missing, missing


def test_the_tiny_example_with_a_lora_section_validates_on_the_readmes_install(
        tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's install (`.[train]`, peft included) is this Python: a lora section on the tiny example passes
    validate with the job-Python check on (tests/test_checks.py: without peft it is refused, naming the install)."""
    import importlib.util

    assert importlib.util.find_spec("peft") is not None
    code, output = run(["validate", str(TINY), *with_tiny_model(TINY, tiny_model), "lora.r=8"], capsys)
    assert code == 0, output
    assert "LoRA: r=8, alpha=32 on all-linear" in output and "cannot import" not in output


def test_the_gpu_smoke_device_command_installs_the_wheels_and_fits_its_limit() -> None:
    """The one device command of docs/development.md: it installs what bench/gpu_wheels.sh writes the way the
    device tool's recipe says, the smoke's options parse, and its budget leaves the command's time limit room to
    install, start and write the results (twice that limit plus a start fits the 15-minute lease)."""
    doc = REPO / "docs" / "development.md"
    [command] = [line for block in fenced(doc, "bash") for line in block.splitlines() if "bench/gpu_smoke.sh" in line
                 and "--out" in line]
    assert "--no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl" in command
    assert 'OUT="${1:-.whl}"' in (REPO / "bench" / "gpu_wheels.sh").read_text()  # where the wheels are written
    timeout = int(re.search(r"`timeout_s: (\d+)`", doc.read_text()).group(1))
    smoke = shlex.split(command.split("bench/gpu_smoke.sh", 1)[1].split("2>&1")[0])
    args = load_bench("gpu_smoke").parser().parse_args(smoke)
    assert str(args.out) == "$OUT" and not args.dry_run
    assert 0 < args.budget_s <= timeout - 45 and 2 * timeout + 120 <= 15 * 60
