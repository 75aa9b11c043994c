"""The docs' commands work, as far as they need no GPU; docs/development.md's device command for the GPU smoke
parses and fits its time limit; the docs' links and the repository files they cite exist; the README stays a
landing page.

Every ``slurmft validate|render|estimate`` line in a fenced block of README.md and docs/*.md is run as
written (the ``run.yaml`` placeholder is run against each shipped Slurm example; any other
path must exist), every shipped
example passes validate, render and estimate, the README's override line validates, and the
data and profile snippets of docs/first-run.md are read by the code that reads users' files.
Every relative link of README.md and docs/*.md reaches a file, and its ``#anchor`` a heading of that file (as
GitHub renders it); the README opens with the two commands, ``.ci/run`` runs its test command, it names every
file of the run directory and links every doc; every figure of docs/benchmarks.md has its command and date.
Every ``slurmft CMD`` the docs show as code names a command and only its options, and the README lists every
command; every config key the docs name (inline code, run-config YAML blocks) is in the schema; the keys a resume may change are named in
docs/preemption.md and ``slurmft resume --help``; an example that quotes ``slurmft estimate`` quotes today's tables.
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

from tests.conftest import SERVED_EXAMPLE, served_args

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
# run configs; examples/tiny/tasks/ holds lm-eval task files (serve-eval.yaml's eval.tasks), not run configs
EXAMPLES = sorted(p for p in (REPO / "examples").rglob("*.yaml") if "tasks" not in p.relative_to(REPO).parts)
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
    """The tiny example's model is built by `python -m slurmft.tiny` (README); the tests build it once. The served
    example's venvs (examples/tiny/envs.sh) are where this machine has them (tests/conftest.py)."""
    if path.parent != TINY.parent:
        return []
    if path.name == SERVED_EXAMPLE.name:
        served = served_args()
        if not served:
            pytest.skip("no vLLM/lm-eval venvs here (bash examples/tiny/envs.sh): serve-eval.yaml's would be refused")
        return [f"model.name_or_path={tiny_model}", *served]
    return [f"model.name_or_path={tiny_model}"]  # run.yaml, dpo.yaml


def test_the_docs_show_commands_to_run() -> None:
    found = {doc for doc, _ in doc_commands()}
    assert found >= {"README.md", "first-run.md"}  # the 70B example's and the first run's commands


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


FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: the text as rendered (no backticks, emphasis or
    link targets), lower-cased, punctuation dropped but ``-`` and ``_``, spaces as ``-``; a repeat gets ``-1``..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", path.read_text()), flags=re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_the_anchor_rule_is_githubs() -> None:
    """The rule above on headings whose GitHub anchors are known (the links that worked before this test)."""
    docs = REPO / "docs"
    assert "check-a-cluster-before-the-first-long-run-slurmft-doctor" in github_anchors(docs / "preemption.md")
    assert "asynchronous-saves-checkpointasync-default-true" in github_anchors(docs / "training.md")
    assert "the-gpu-smoke-on-a-lent-machine" in github_anchors(docs / "development.md")
    assert "cluster" in github_anchors(docs / "config.md")  # "## `cluster`", linked from its own table


def test_every_link_in_the_docs_resolves() -> None:
    broken = []
    for doc in DOCS:
        name = doc.relative_to(REPO)
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:: not ours to check offline
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists() or REPO not in dest.parents:
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest):
                broken.append(f"{name}: {target} (no heading with that anchor in {dest.name})")
    assert not broken, broken


def test_the_docs_cite_only_repository_files_that_exist() -> None:
    """A module, test, bench or example named in the docs exists (one that moved leaves a stale pointer)."""
    cited = re.compile(r"(?<![\w/.-])((?:bench|tests|slurmft|examples|configs|templates|docs|\.ci)/[\w./-]*?"
                       r"\.(?:py|sh|yaml|j2|json|txt|toml|md|png))\b")
    missing = [f"{doc.relative_to(REPO)}: {path}" for doc in DOCS
               for path in sorted(set(cited.findall(doc.read_text()))) if not (REPO / path).exists()]
    assert not missing, missing


def test_the_readme_is_a_landing_page() -> None:
    """Issue 46: what it is, the two commands, the commands, a config, where the files are, a line per doc."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "the README is a landing page: move details into docs/"
    first, second = [block.strip() for block in fenced(README, "bash")][:2]
    assert first.startswith("pip install torch==2.13.0 ") and "\n" not in first  # one command: set-up to model
    assert first.endswith(" && python -m slurmft.tiny examples/tiny/assets/model"
                          " && slurmft submit examples/tiny/run.yaml")
    assert second == "bash .ci/run"
    test_cmd = re.search(r"^TEST_CMD=\((.+)\)$", (REPO / ".ci" / "run").read_text(), flags=re.M)
    assert test_cmd and f"runs the test command `{test_cmd.group(1)}`" in text  # what CI runs is what it says
    linked = {target.partition("#")[0] for target in LINK.findall(text)}
    assert {f"docs/{doc.name}" for doc in (REPO / "docs").glob("*.md")} <= linked  # every doc one click away


def test_the_readme_names_every_file_of_the_run_directory() -> None:
    """Its run-directory tree holds every name ``RunPaths`` gives directly inside a run directory."""
    from slurmft.rundir import RunPaths

    paths = RunPaths(Path("/run"))
    names = {value.name for name, attr in vars(RunPaths).items() if isinstance(attr, property)
             for value in [getattr(paths, name)] if isinstance(value, Path) and value.parent == paths.root}
    [tree] = [block for block in fenced(README) if block.startswith("<output_dir>/")]
    assert names >= {"config.yaml", "manifest.json", "checkpoints", "model"}
    assert not [n for n in sorted(names) if not re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", tree)]


def test_every_benchmark_has_its_command_and_its_date() -> None:
    doc = REPO / "docs" / "benchmarks.md"
    sections = re.split(r"^## ", FENCE.sub("", doc.read_text()), flags=re.M)[1:]
    figures = [s for s in sections if not s.startswith("Figures kept beside")]
    assert len(figures) >= 12
    for section in figures:
        title = section.splitlines()[0]
        command = re.search(r"`(?:python|bash) (bench/[\w.]+)|`slurmft estimate (examples/[\w./-]+\.yaml)`",
                            section)
        assert command and (REPO / (command.group(1) or command.group(2))).is_file(), title
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", section) or "not measured yet" in section, title


def code_lines(path: Path) -> list[str]:
    """What a Markdown file shows as code: its fenced blocks' lines (shell comments dropped) and its inline code."""
    text = path.read_text()
    lines = [re.sub(r"(^|\s)#.*", "", line) for block in fenced(path) for line in block.splitlines()]
    return lines + re.findall(r"`([^`\n]+)`", FENCE.sub("", text))


# Code spans that start with "slurmft WORD" and are not commands: the ranks' error lines (docs/grpo.md).
NOT_COMMANDS = {"rank"}


def test_every_slurmft_command_in_the_docs_exists_with_its_options() -> None:
    """A command line the docs show (in a block or inline: `slurmft consolidate RUN_DIR --here`) names a command of
    the CLI and only options that command has: a renamed or dropped flag fails here, not in a user's shell."""
    from slurmft.cli import cli as group

    wrong = []
    for doc in DOCS:
        for line in code_lines(doc):
            for word, rest in re.findall(r"(?:^|\$ |&& |\| |; |\()\s*slurmft +([a-z][\w-]*)(.*?)(?=&&|\|\||;|$)",
                                         line.strip()):
                command = group.commands.get(word)
                if command is None:
                    if word not in NOT_COMMANDS:
                        wrong.append(f"{doc.name}: `{line.strip()}`: no command {word!r}")
                    continue
                options = {o for p in command.params for o in p.opts + p.secondary_opts if o.startswith("-")}
                wrong += [f"{doc.name}: `{line.strip()}`: `slurmft {word}` has no {flag}"
                          for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rest)
                          if flag not in options | {"-h", "--help"}]
    assert not wrong, wrong


def test_the_readme_lists_every_command() -> None:
    from slurmft.cli import cli as group

    [commands] = [block for block in fenced(README) if block.startswith("slurmft render")]
    listed = set(re.findall(r"^slurmft (\w+)", commands, flags=re.M))
    assert listed == set(group.commands), "README's `## The commands` lists each command of `slurmft --help` once"


# Dotted names in the docs' inline code that start like a config key but are not one, each with why.
NOT_KEYS = {
    "model.model.layers.0.self_attn.q_proj.weight": "a parameter name in a checkpoint (docs/consolidation.md)",
    "model.lm_head.weight": "a parameter name in a checkpoint",
    "model.embed_tokens.weight": "a tensor name in the consolidated files",
    "model.load_weights": "vLLM's method (docs/grpo.md)",
    "model._no_split_modules": "the transformers attribute (docs/training.md)",
    "model.config._attn_implementation": "the transformers attribute",
    "lora.adapter_bytes": "a term of the estimate's arithmetic (docs/estimate.md)",
    "train.per_device_train_batch_size": "HF's spelling, shown with its did-you-mean (docs/first-run.md)",
    "train.learnig_rate": "a misspelling, shown with its did-you-mean (docs/sweeps.md)",
}


FILE_NAME = r"\.(?:py|json|jsonl|md|yaml|txt|sh|safetensors|npy|png)$"  # `sweep.json`, `model.safetensors.index.json`


def known(name: str, fields: set[str], sections: set[str]) -> bool:
    """A field, a section, or a key under a free-form mapping field (`train.sft.packing_strategy`)."""
    return name in fields or name in sections or any(name.startswith(f + ".") for f in fields)


def yaml_keys(data: dict, prefix: str = "") -> list[str]:
    """Every key of a YAML mapping as a dotted name, through nested mappings and lists of mappings."""
    out = []
    for key, value in data.items():
        out.append(f"{prefix}{key}")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict):
                out += yaml_keys(item, f"{prefix}{key}.")
    return out


def test_every_config_key_the_docs_name_exists() -> None:
    """`section.key` (with `: value` or `=value`) in the docs' inline code, and every key of a run config's YAML
    fragment, is a field of the schema, a section of it, `section.*`, or a key under a free-form mapping
    (`train.sft.*`, `cluster.env.*`): a renamed field leaves no stale name behind."""
    from slurmft.config import RunConfig
    from slurmft.config_loading import all_fields

    fields = {f.replace("[]", "") for f in all_fields()}
    sections = {".".join(f.split(".")[:i]) for f in fields for i in range(1, f.count(".") + 1)}
    top = "|".join(RunConfig.model_fields)
    key = re.compile(rf"^((?:{top})(?:\.(?:[a-z_0-9]+|\*)(?:\[\d*\])?)+)(?:[:=].*)?$")
    unknown = []
    for doc in DOCS:
        for block in fenced(doc, "yaml"):  # a run config's fragment: every key in it, as a dotted name
            data = yaml.safe_load(block)
            if isinstance(data, dict) and set(data) <= set(RunConfig.model_fields):
                unknown += [f"{doc.name}: yaml `{k}`" for k in yaml_keys(data) if not known(k, fields, sections)]
        for span in re.findall(r"`([^`\n]+)`", FENCE.sub("", doc.read_text())):
            found = key.match(span.strip())
            if not found or found.group(1) in NOT_KEYS or re.search(FILE_NAME, found.group(1)):
                continue
            if not known(re.sub(r"\[\d*\]", "", found.group(1)).removesuffix(".*"), fields, sections):
                unknown.append(f"{doc.name}: `{span}`")
    assert not unknown, unknown
    assert not [k for k in NOT_KEYS if not any(f"`{k}" in doc.read_text() for doc in DOCS)], "a NOT_KEYS entry is unused"


def test_the_keys_a_resume_may_change_are_the_documented_ones() -> None:
    """docs/preemption.md and `slurmft resume --help` name every key `slurmft/submit/resume.py` accepts on a resume
    (`resources.*` for the allocation's)."""
    from slurmft.cli import cli as group
    from slurmft.plan.elastic import BATCH_KEYS
    from slurmft.submit.resume import ALLOWED_KEYS, ALLOWED_PREFIXES

    doc = " ".join((REPO / "docs" / "preemption.md").read_text().split())
    [paragraph] = [p for p in doc.split("Overrides may change only")[1:2]]
    named = {*(p + "*" for p in ALLOWED_PREFIXES), *(k for k in ALLOWED_KEYS if not k.startswith("resources.")),
             "resources.*"}
    assert not [k for k in sorted(named) if f"`{k}`" not in paragraph.split("never what it computes")[0]]
    help_text = " ".join(group.commands["resume"].help.split())
    assert not [k for k in sorted(named - set(BATCH_KEYS)) if k not in help_text] and "batch keys" in help_text


def estimate_rows(text: str) -> set[str]:
    """The rows of `slurmft estimate`'s tables, cell by cell, whatever their width: a line whose first cell is empty,
    or whose other cells are all empty, is the row above wrapped by rich (a narrower console: CI69 and CI72 printed
    80 columns though COLUMNS said 200), joined to it."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if not cells:
            continue
        wrapped = not cells[0] or (len(cells) > 1 and not any(cells[1:]))
        if rows and wrapped and len(cells) == len(rows[-1]):
            rows[-1] = [f"{above} {more}".strip() for above, more in zip(rows[-1], cells, strict=True)]
        else:
            rows.append(cells)
    return {" | ".join(row) for row in rows}


@pytest.mark.parametrize("example", [p for p in EXAMPLES if "#   Per GPU" in p.read_text()], ids=lambda p: p.name)
def test_the_estimate_an_example_quotes_is_the_estimate_now(example: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An example whose comment quotes `slurmft estimate` on it quotes every row of today's tables and its verdict."""
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps nothing: the rows compare cell by cell
    monkeypatch.setenv("LINES", "50")  # with both set rich takes the size as given, before its dumb-terminal 80x25
    code, output = run(["estimate", str(example)], capsys)
    assert code == 0, output
    comment = "\n".join(line[1:] for line in example.read_text().splitlines() if line.startswith("#"))
    assert estimate_rows(comment) == estimate_rows(output), "paste `slurmft estimate` again into the comment"
    [verdict] = [line for line in output.splitlines() if line.startswith("fits: ")]
    assert f"#   {verdict}" in example.read_text()
