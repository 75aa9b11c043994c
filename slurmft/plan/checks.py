"""Every check that needs no GPU and no allocation, run by ``validate``, ``submit`` and (in part) the job.

The schema (:mod:`slurmft.config`) catches a wrong type; it cannot know that a data file has Alpaca
columns, that a 512-position model is asked for 4096 tokens, that ``train.sft.save_steps`` fights
``checkpoint.every_steps``, or that the login venv's Python cannot import torch. Found inside the
allocation, each of those costs a queue wait. Found here they cost seconds, all in one report.

What runs here, on the login node, without importing torch or transformers:

- paths: model, tokenizer, data files and a chat template file exist (every missing one listed);
- data: each local file's first rows are read (``.jsonl``/``.json``/``.csv``; ``.parquet`` when
  pyarrow is installed) and converted with the job's own code (:mod:`slurmft.formats`);
- ``data.max_seq_length`` against the model's ``max_position_embeddings`` (``config.json`` found
  the way ``slurmft estimate`` finds it: local, hub cache, shipped copy);
- ``train.sft``: keys slurmft owns, and — when TRL is installed — unknown keys and value types
  against ``SFTConfig``. Importing TRL imports torch, so its field list comes from a child process
  and is cached per TRL/transformers version (:func:`sft_field_kinds`); values are coerced to the
  declared types (``'1e-8'`` -> ``1e-08``) in the config the job reads;
- ``train.report_to`` names;
- the chat template (when the tokenizer is local or in the hub cache): present, with
  ``{% generation %}`` markers (or one TRL knows how to patch) when ``assistant_only_loss`` is on,
  and able to render the first conversations (jinja2 directly, as transformers does);
- the job's Python: it exists and can import the training stack (and the reporters' packages);
- the effective batch, and steps per epoch: exact when ``slurmft prepare`` has counted the packed data
  (``RUN_DIR/prepared/``), estimated when the data is local (``tokenizers`` counts tokens).

Hub-only inputs are checked by the job, which calls the same functions on what it downloads.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmft import attention, formats, prepared, sourcefiles
from slurmft.chat_template import (
    GENERATION_TAG,
    cannot_render_message,
    has_generation_markers,
    no_markers_message,
    no_template_message,
    template_path_problem,
)
from slurmft.config import RunConfig
from slurmft.config_paths import DATA_SUFFIXES, is_local, is_program_path
from slurmft.epochs import steps_per_epoch
from slurmft.errors import ConfigError
from slurmft.interpreter import MISSING, NOT_ON_PATH, NoAnswer, finds_modules, in_words, locate
from slurmft.lora import ALL_LINEAR, EMBEDDING_MODULES, tied_target_problem
from slurmft.methods import epoch_rows
from slurmft.modelinfo import find_tokenizer, read_model_config, seq_length_problem
from slurmft.profiles import runs_on_gpu
from slurmft.sftopts import REPORTERS, sft_field_kinds, sft_problems

SAMPLE_ROWS = 8  # rows read from each data file for the column and template checks
COUNT_LIMIT_BYTES = 64 * 2**20  # local data up to this size is read in full to count tokens (steps per epoch)

TRAINING_STACK = ("slurmft", "submitit", "torch", "transformers", "accelerate", "trl", "datasets", "safetensors")
LORA_STACK = ("peft",)  # a lora section needs it in the job's Python too (part of slurmft[train])


@dataclass
class Report:
    """What the checks found: problems (refuse), notes (facts worth printing), skipped (not checked, and why)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def raise_if_problems(self, source: str) -> None:
        """One ConfigError with every problem."""
        if self.problems:
            raise ConfigError(f"{source}: {len(self.problems)} problem(s) found before submitting", self.problems)


# ====================================================================== entry point
def run_checks(cfg: RunConfig, job_python: bool = True) -> Report:
    """All login-side checks of a validated config; ``cfg.train.sft`` values are coerced in place."""
    report = Report()
    check_paths(cfg, report)
    samples = check_data(cfg, report)
    check_seq_length(cfg, report)
    check_attention(cfg, report)
    check_sft(cfg, report)
    check_reporters(cfg, report)
    check_precision(cfg, report)
    check_lora(cfg, report)
    template = check_chat_template(cfg, report, samples)
    container = check_container(cfg, report)
    if job_python:
        check_job_python(cfg, report, in_image=container is not None)
    check_model_jobs(cfg, report)
    if cfg.grpo is not None:
        from slurmft.plan.grpo_checks import check_grpo

        check_grpo(cfg, report, [s.columns for s in samples], job_python=job_python and container is None)
    report.notes += batch_notes(cfg, samples, template)
    return report


# ====================================================================== precision
def precision_problems(cfg: RunConfig, profile: Any) -> list[str]:
    """bf16 (train.precision, or auto on GPUs) on a GPU type known to lack it (V100, T4, ...)."""
    from slurmft.precision import bf16_unsupported, resolve

    if not runs_on_gpu(cfg, profile) or not bf16_unsupported(profile.gpu.type):
        return []
    mode = resolve(cfg.train.precision, on_gpu=True)
    if "bfloat16" not in (mode.param_dtype, mode.compute_dtype):
        return []
    how = "" if cfg.train.precision == mode.name else f" (auto resolves to {mode.name} on GPUs)"
    return [f"train.precision: {mode.name}{how} computes in bfloat16, which {profile.gpu.type} GPUs do not support "
            f"(cluster profile {profile.name!r}); set train.precision=fp16-mixed or fp32"]


def check_precision(cfg: RunConfig, report: Report) -> None:
    """The precision against the profile's GPU type (an unreadable profile is reported elsewhere)."""
    from slurmft.profiles import load_profile

    try:
        profile = load_profile(cfg.cluster.profile)
    except Exception:  # noqa: BLE001 - render/submit report a bad profile with its own message
        return
    report.problems += precision_problems(cfg, profile)


# ====================================================================== paths
def check_paths(cfg: RunConfig, report: Report) -> None:
    """Model, tokenizer and chat template files: every missing one, each with its fix."""
    model = cfg.model.name_or_path
    if is_local(model):
        p = Path(model)
        if not p.exists():
            report.problems.append(
                f"model.name_or_path: local path {model!r} does not exist (give an existing directory with "
                "config.json, or a hub id like meta-llama/Meta-Llama-3-8B)"
            )
        elif p.is_dir() and not (p / "config.json").is_file():
            report.problems.append(
                f"model.name_or_path: {model} has no config.json (give a Hugging Face model directory as written "
                "by save_pretrained, or a hub id)"
            )
    tok = cfg.model.tokenizer
    if tok and is_local(tok) and not Path(tok).is_dir():
        report.problems.append(f"model.tokenizer: local directory {tok!r} does not exist (or give a hub id)")
    template = cfg.train.sft.get("chat_template_path")
    problem = template_path_problem(str(template)) if template else None
    if problem:
        report.problems.append(problem)


# ====================================================================== data
@dataclass
class Sample:
    """What was read from one local data source."""

    index: int
    fmt: str
    conversations: list[list[dict[str, str]]]  # the first rows, converted
    path: Path | None = None
    complete: bool = False  # conversations (texts) holds every row of the source
    texts: list[str] = field(default_factory=list)  # a plain-text source's documents (conversations is empty)
    columns: list[str] = field(default_factory=list)  # the file's columns (after renaming)

    @property
    def rows(self) -> int:
        return len(self.texts) if self.fmt == formats.TEXT else len(self.conversations)


def _text_sample(i: int, src: Any, files: list[Path], report: Report) -> Sample | None:
    """A .txt/.txt.gz source: every file readable as text (empty, binary or not UTF-8: a problem each)."""
    problems = sourcefiles.source_problems(src.path, src.format, f"data.datasets[{i}].path")
    if problems:
        report.problems += problems
        return None
    texts, complete = sourcefiles.read_documents(files, src.documents, COUNT_LIMIT_BYTES)
    if complete and not texts:
        report.problems.append(f"data.datasets[{i}].path: {src.path!r} holds no text (every document is blank)")
        return None
    return Sample(i, formats.TEXT, [], files[0], complete=complete, texts=texts)


def check_data(cfg: RunConfig, report: Report) -> list[Sample]:
    """Each local data source (a file or a glob of files): exists, is a supported type, has a conversation (or, plain
    text, a document) the job can read."""
    samples: list[Sample] = []
    for i, src in enumerate(cfg.data.datasets):
        where = f"data.datasets[{i}].path"
        local = is_local(src.path) or src.path.endswith(DATA_SUFFIXES) or sourcefiles.is_glob(src.path)
        if not local:
            report.skipped.append(f"data.datasets[{i}]: hub dataset {src.path!r}: its columns are checked in the job")
            continue
        files = sourcefiles.files_of(src.path)
        if not files and Path(src.path).expanduser().is_dir():
            d = src.path.rstrip("/")
            report.problems.append(f"{where}: {src.path!r} is a directory; give one file, or a glob of its files "
                                   f"(e.g. {d}/*.jsonl, or {d}/*.txt for a plain-text corpus)")
            continue
        if not files:
            report.problems.append(
                f"{where}: {src.path!r} matches no file (give a glob that matches your files)" if sourcefiles.is_glob(
                    src.path) else f"{where}: file {src.path!r} does not exist (give a local .jsonl/.json/.csv/"
                ".parquet/.txt file, or a hub dataset id like GAIR/lima)"
            )
            continue
        kinds = sorted({sourcefiles.suffix_of(f) for f in files})
        if any(k not in DATA_SUFFIXES for k in kinds):
            report.problems.append(f"{where}: {files[0].name if len(files) == 1 else src.path} is not a .jsonl, .jsonl.zst, "
                                   ".json, .csv, .parquet, .txt or .txt.gz file")
            continue
        if kinds[0] in sourcefiles.TEXT_SUFFIXES or len(kinds) > 1:
            if (sample := _text_sample(i, src, files, report)) is not None:
                samples.append(sample)
            continue
        path = files[0]
        if path.suffix.lower() == ".parquet" and importlib.util.find_spec("pyarrow") is None:
            report.skipped.append(f"data.datasets[{i}]: {path.name} not read (pyarrow is not installed here)")
            continue
        small = len(files) == 1 and path.stat().st_size <= COUNT_LIMIT_BYTES
        try:
            rows = sourcefiles.read_rows(path, None if small else SAMPLE_ROWS)
        except (OSError, ValueError, UnicodeDecodeError, csv.Error) as exc:
            report.problems.append(f"{where}: cannot read {path.name}: {exc}")
            continue
        if not rows:
            report.problems.append(f"{where}: {path.name} has no rows")
            continue
        rows = [formats.rename(r, src.columns) for r in rows]
        label = f"data.datasets[{i}] ({path.name})"
        try:
            fmt, column = formats.detect_format(src, list(rows[0]), rows[0], label)
        except ConfigError as exc:
            report.problems.append(str(exc))
            continue
        problem = formats.method_problem(fmt, cfg.method.value, list(rows[0]), label)
        if problem:
            report.problems.append(problem)
            continue
        if fmt == formats.TEXT:
            texts = [r.get(column) for r in rows]
            bad = next((n for n, t in enumerate(texts) if t is not None and not isinstance(t, str)), None)
            if bad is not None:
                report.problems.append(f"{label}: format text reads the column {column!r} as plain text, but row {bad} "
                                       f"holds {type(texts[bad]).__name__}, not a string (name the text column with "
                                       "columns: {text: YOUR_COLUMN})")
                continue
            samples.append(Sample(i, fmt, [], path, complete=small, texts=[t for t in texts if t and t.strip()]))
            continue
        if fmt == formats.PROMPT_ONLY:  # grpo: prompts; the other columns reach the rewards
            bad = [(n, why) for n, r in enumerate(rows) if (why := formats.prompt_problem(r.get("prompt")))]
            if bad:
                n, why = bad[0]
                report.problems.append(f"{label}: row {n} has {why}; {len(bad)} of the {len(rows)} rows read cannot "
                                       "be completed: fix or remove them")
                continue
            prompts = [r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
                       for r in rows]
            samples.append(Sample(i, fmt, prompts, path, complete=small, columns=list(rows[0])))
            continue
        if fmt == formats.PREFERENCE:
            pairs = [formats.to_preference(r) for r in rows]
            bad = [(n, why) for n, pair in enumerate(pairs) if (why := formats.preference_problem(pair))]
            if bad:
                n, why = bad[0]
                report.problems.append(
                    f"{label}: row {n} has {why}; {len(bad)} of the {len(rows)} rows read cannot train (DPO needs a "
                    "prompt and a non-empty chosen and rejected reply each): fix or remove them")
                continue
            # the chat template and the token counts see the longer of the two sequences of each pair
            samples.append(Sample(i, fmt, [p["prompt"] + max(p["chosen"], p["rejected"], key=_chars) for p in pairs],
                                  path, complete=small))
            continue
        converted = [formats.to_messages(r, fmt, column) for r in rows]
        usable = [m for m in converted if formats.is_usable(m)]
        if not any(formats.is_usable(m) for m in converted[:SAMPLE_ROWS]):
            report.problems.append(
                f"{label}: read as {fmt}, but none of the first {min(len(rows), SAMPLE_ROWS)} rows is a usable "
                "conversation (a user turn followed by a non-empty assistant turn); check format and columns"
            )
            continue
        samples.append(Sample(i, fmt, usable, path, complete=small))
    return samples


def _chars(turns: list[dict[str, str]]) -> int:
    return sum(len(t["content"]) for t in turns)


# ====================================================================== model length
def check_seq_length(cfg: RunConfig, report: Report) -> None:
    """data.max_seq_length within the model's positions (from its config.json, if one is at hand)."""
    try:
        model_cfg = read_model_config(cfg.model.name_or_path, cfg.model.revision)
    except ConfigError:
        report.skipped.append("data.max_seq_length: not compared with the model's positions (no config.json "
                              "at hand; `hf download MODEL config.json` makes it available)")
        return
    problem = seq_length_problem(cfg.data.max_seq_length, model_cfg.get("max_position_embeddings"))
    if problem:
        report.problems.append(problem)


# ====================================================================== lora
def check_lora(cfg: RunConfig, report: Report) -> None:
    """An adapter on tied embeddings (config.json's tie_word_embeddings), refused as the job refuses it."""
    if cfg.lora is None or cfg.lora.target_modules == ALL_LINEAR:
        return
    named = [t for t in cfg.lora.target_modules if t.rsplit(".", 1)[-1] in EMBEDDING_MODULES]
    if not named:
        return
    try:
        model_cfg = read_model_config(cfg.model.name_or_path, cfg.model.revision)
    except ConfigError:
        model_cfg = {}
    tied = model_cfg.get("tie_word_embeddings")
    if tied is None:
        report.skipped.append(f"lora.target_modules: {', '.join(named)} not checked for tied embeddings (no "
                              "config.json at hand, or it does not say tie_word_embeddings); the job checks before "
                              "loading")
    elif tied:
        model = ", ".join(model_cfg.get("architectures") or []) or str(model_cfg.get("model_type", "this model"))
        report.problems += [tied_target_problem(t, model) for t in named]


# ====================================================================== attention
def check_attention(cfg: RunConfig, report: Report) -> None:
    """An explicit model.attn_implementation the architecture refuses (read torch-free: slurmft/attention.py)."""
    if cfg.model.attn_implementation == "auto":
        return
    try:
        model_type = read_model_config(cfg.model.name_or_path, cfg.model.revision).get("model_type")
    except ConfigError:
        report.skipped.append("model.attn_implementation: not checked against the architecture (no config.json at "
                              "hand)")
        return
    problem = attention.refusal(cfg.model.attn_implementation, attention.support_of(str(model_type or "")))
    if problem:
        report.problems.append(problem)


# ====================================================================== train.sft
def check_sft(cfg: RunConfig, report: Report) -> None:
    """Owned keys always; unknown keys and types when TRL is installed here; values coerced in place."""
    if not cfg.train.sft:
        return
    kinds, why = sft_field_kinds()
    problems, coerced = sft_problems(cfg.train.sft, kinds, why)
    report.problems += problems
    if kinds is None:
        report.skipped.append(f"train.sft: keys and value types not checked ({why}; the job checks them)")
    elif not problems:
        cfg.train.sft = coerced


def check_reporters(cfg: RunConfig, report: Report) -> None:
    """Names in train.report_to (their packages are looked for in the job's Python)."""
    for name in cfg.train.report_to:
        if name not in REPORTERS:
            report.problems.append(
                f"train.report_to: {name!r} is not supported; use {' or '.join(k for k in REPORTERS if k != 'none')}"
            )


# ====================================================================== chat template
@dataclass
class Template:
    """A tokenizer found on this machine: its chat template and special tokens, and tokenizer.json."""

    source: str
    text: str | None
    bos: str
    eos: str
    tokenizer_json: Path | None


def _token(value: Any) -> str:
    return str(value.get("content", "")) if isinstance(value, dict) else str(value or "")


def read_template(cfg: RunConfig, directory: Path, name: str) -> Template:
    """The chat template the job will use (train.sft.chat_template_path wins) and the special tokens."""
    conf: dict[str, Any] = {}
    if (directory / "tokenizer_config.json").is_file():
        try:
            conf = json.loads((directory / "tokenizer_config.json").read_text())
        except ValueError:
            conf = {}
    text = conf.get("chat_template")
    if isinstance(text, list):  # named variants: the default one
        text = next((t.get("template") for t in text if t.get("name") == "default"), None)
    if (directory / "chat_template.jinja").is_file():
        text = (directory / "chat_template.jinja").read_text()
    override = cfg.train.sft.get("chat_template_path")
    if override and Path(str(override)).is_file():
        text = Path(str(override)).read_text()
    tok_json = directory / "tokenizer.json"
    return Template(name, text or None, _token(conf.get("bos_token")), _token(conf.get("eos_token")),
                    tok_json if tok_json.is_file() else None)


def trl_can_patch(template: str) -> bool:
    """Whether TRL ships a training version (with markers) of this exact template (read from its package data)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    for path in folder.glob("*.jinja"):
        trainable = not path.stem.endswith("_training") and (folder / f"{path.stem}_training.jinja").is_file()
        if trainable and path.read_text(encoding="utf-8") == template:
            return True
    return False


def render_conversation(template: Template, messages: list[dict[str, str]]) -> str:
    """Render one conversation with the chat template as transformers does (sandboxed jinja2), markers removed."""
    return _compiled(template.text or "").render(messages=messages, bos_token=template.bos, eos_token=template.eos,
                                                 add_generation_prompt=False)


@functools.lru_cache(maxsize=8)
def _compiled(text: str) -> Any:
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(GENERATION_TAG.sub("", text))


def check_chat_template(cfg: RunConfig, report: Report, samples: list[Sample]) -> Template | None:
    """The tokenizer's chat template, when the tokenizer is on this machine."""
    directory, name = find_tokenizer(cfg)
    if directory is None:
        report.skipped.append(f"chat template: tokenizer {name!r} is not local (nor in the hub cache); the job "
                              "checks it (`hf download` it first to check here)")
        return None
    template = read_template(cfg, directory, name)
    field_name = "model.tokenizer" if cfg.model.tokenizer else "model.name_or_path"
    if not template.text:
        if not cfg.chat_data:  # plain text alone: no template is applied; the tokenizer still counts tokens
            return template
        report.problems.append(f"{field_name}: {no_template_message(directory)}")
        return None
    if cfg.assistant_masks and not has_generation_markers(template.text):
        if trl_can_patch(template.text):
            report.notes.append("chat template: no {% generation %} markers, but TRL ships a training version of it")
        elif importlib.util.find_spec("trl") is None:
            report.skipped.append("chat template: has no {% generation %} markers; whether TRL can add them is not "
                                  "known here (trl is not installed); the job checks it")
        else:
            report.problems.append(no_markers_message(name))
    for sample in samples:
        src = cfg.data.datasets[sample.index]
        for j, conversation in enumerate(sample.conversations[:SAMPLE_ROWS]):
            try:
                render_conversation(template, conversation)
            except Exception as exc:  # noqa: BLE001 - TemplateError, or whatever the template's code raises
                report.problems.append(
                    cannot_render_message(f"data.datasets[{sample.index}] ({Path(src.path).name})", j, exc))
                break
    return template


# ====================================================================== the container
def check_container(cfg: RunConfig, report: Report) -> Any:
    """The run's container (slurmft/plan/container.py) as far as the login node can see it: the runtime, mounts
    that hide nothing the job needs, an image file that exists and is readable. Returns it (None: no container,
    or one that does not resolve). What is inside the image is `slurmft doctor --job`'s to check."""
    from slurmft.plan.container import hf_home_problems, image_problems, resolve
    from slurmft.profiles import load_profile

    try:
        profile = load_profile(cfg.cluster.profile)
    except Exception:  # noqa: BLE001 - render/submit report a bad profile with its own message
        return None
    try:
        container = resolve(cfg, profile)
    except ConfigError as exc:
        report.problems += exc.problems or [str(exc)]
        return None
    if container is None:
        return None
    report.problems += image_problems(container) + hf_home_problems(cfg, container)
    report.skipped.append(f"cluster.container.python: {container.python} in {container.image} ({container.runtime}) "
                          "and the training stack there are checked by `slurmft doctor --job`, not here")
    return container


# ====================================================================== the job's Python
def check_job_python(cfg: RunConfig, report: Report, in_image: bool = False) -> None:
    """The job's Python exists and imports the training stack (with peft for a lora section, and the reporters'
    packages). ``in_image``: the ranks run in a container, so the host's Python runs only the batch script's
    slurmft steps (rendezvous, requeue) and needs slurmft alone."""
    python = cfg.cluster.job_python
    given = "cluster.python" if cfg.cluster.python else "cluster.python (not set: the Python running slurmft)"
    fix = ("set cluster.python to the interpreter of an environment with `pip install 'slurmft[train]'` on the "
           "shared filesystem (e.g. /shared/venvs/sft/bin/python), or add cluster.setup lines that provide one "
           "(module load ..., source .../activate) and set cluster.python: python")
    if not is_program_path(python) and cfg.cluster.setup:
        report.skipped.append(f"cluster.python: {python!r} comes from cluster.setup on the compute nodes; "
                              "not checked here")
        return
    python, where = locate(python)
    if where == NOT_ON_PATH:
        report.problems.append(f"{given}: {in_words(python, where)}; {fix}")
        return
    if where == MISSING:
        if cfg.cluster.setup:
            report.skipped.append(f"cluster.python: {python} does not exist here; assuming cluster.setup provides "
                                  "it on the compute nodes")
        else:
            report.problems.append(f"{given}: {in_words(python, where)}; the compute nodes need it at the same path "
                                   f"(a shared filesystem); {fix}")
        return
    reporters = [m for name in cfg.train.report_to for m in REPORTERS.get(name, ())]
    stack = (*TRAINING_STACK, *(LORA_STACK if cfg.lora is not None else ()))
    if in_image:
        reporters, stack = [], ("slurmft",)
    try:  # a file that may not be run (NOT_EXECUTABLE) answers nothing either
        found_mods = finds_modules(python, (*stack, *reporters)).modules
    except NoAnswer:
        report.problems.append(f"{given}: {python} does not run (or is not a Python); {fix}")
        return
    missing = [m for m in stack if not found_mods.get(m)]
    if missing == list(LORA_STACK):
        report.problems.append(f"lora: {given}: {python} cannot import peft, which LoRA needs in the job: the job "
                               f"would die at start; pip install -e '.[train]' (or 'peft>=0.21.2') in that Python, "
                               "or remove the lora section to fine-tune every weight")
    elif missing:
        report.problems.append(f"{given}: {python} cannot import {', '.join(missing)}: the job would die at start; "
                               f"{fix}")
    for name in cfg.train.report_to:
        mods = REPORTERS.get(name, ())
        if mods and not any(found_mods.get(m) for m in mods):
            report.problems.append(f"train.report_to: {name} is enabled but {python} cannot import {mods[0]} "
                                   f"(pip install {mods[0]} there, or remove {name})")


def check_model_jobs(cfg: RunConfig, report: Report) -> None:
    """The jobs after consolidation (serve, eval): their interpreters where they run (in an image: left to
    `doctor --job`) and, for eval, the tasks."""
    import sys

    from slurmft.plan.model_job_checks import check_model_job

    for kind in ("serve", "eval"):
        problems, skipped = check_model_job(cfg, kind, lambda line: print(f"note: {line}", file=sys.stderr))
        report.problems += problems
        report.skipped += skipped


# ====================================================================== the effective batch
def batch_notes(cfg: RunConfig, samples: list[Sample], template: Template | None) -> list[str]:
    """Sequences and tokens per optimizer step; steps per epoch when every source is a local file."""
    t, ws = cfg.train, cfg.train_world_size  # ws: a GRPO server's node does not train
    per_step = ws * t.per_device_batch_size * t.gradient_accumulation_steps
    packed = cfg.packed
    unit = (f"packed sequences of {cfg.data.max_seq_length} tokens" if packed
            else f"sequences (up to {cfg.data.max_seq_length} tokens each)")
    tokens = f"{per_step * cfg.data.max_seq_length:,} tokens" + ("" if packed else " at most")
    lines = [f"batch: {ws} rank(s) x {t.per_device_batch_size} x {t.gradient_accumulation_steps} "
             f"accumulation = {per_step} {unit} = {tokens} per optimizer step"]
    if cfg.dpo is not None:
        lines = [f"batch: {ws} rank(s) x {t.per_device_batch_size} x {t.gradient_accumulation_steps} "
                 f"accumulation = {per_step} preference pairs per optimizer step, each a chosen and a rejected "
                 f"sequence of up to {cfg.data.max_seq_length} tokens (prompt + reply)"]
    if cfg.grpo is not None:
        g = cfg.grpo
        steps = g.generations_per_step(t.gradient_accumulation_steps)
        lines = [f"batch: {ws} rank(s) x {t.per_device_batch_size} x {steps} steps per generation = "
                 f"{ws * t.per_device_batch_size * steps} completions per generation "
                 f"({ws * t.per_device_batch_size * steps // g.num_generations} prompts x "
                 f"{g.num_generations}), up to {g.max_completion_length} new tokens each; "
                 f"{per_step} completions per optimizer step"]
        return lines  # steps per epoch: TRL's sampler repeats each prompt; train.max_steps counts the steps
    if cfg.dpo is not None and cfg.data.packing:
        lines.append("data.packing: does not apply to DPO (each pair is scored as its own padded sequences); ignored")
    rows = epoch_rows(cfg.method, cfg.data.packing)  # per_step's
    counts = prepared.counted(cfg)
    if counts is not None:  # counted by the prepare job: the job's own figure, not an estimate
        exact = counts["sequences"]
        steps = steps_per_epoch(exact, ws, t.per_device_batch_size, t.gradient_accumulation_steps)
        lines.append(f"data: {exact:,} {rows} per epoch (prepared, "
                     f"exact) -> {steps} optimizer steps per epoch")
        if counts.get("tokens"):
            lines.append(f"data: {counts['tokens']:,} tokens per epoch (prepared, exact), "
                         f"~{counts['tokens'] // steps:,} per optimizer step")
        if t.epochs is not None:
            lines.append(f"train.epochs {t.epochs:g} -> {math.ceil(t.epochs * steps)} steps")
        elif t.max_steps:
            lines.append(f"train.max_steps {t.max_steps} = {t.max_steps / steps:.2f} epoch(s)")
        return lines
    per_epoch, tokens = epoch_estimate(cfg, samples, template)
    if isinstance(per_epoch, str):
        lines.append(f"steps per epoch: not computed ({per_epoch}; `slurmft prepare` counts it exactly)")
        if t.epochs is not None:
            lines.append(f"train.epochs {t.epochs:g}: the job computes the steps from the packed data at start")
        return lines
    steps = max(1, math.ceil(per_epoch / per_step))
    lines.append(f"data: ~{per_epoch:,} {rows} per epoch -> ~{steps} "
                 "optimizer steps per epoch (estimated from the files; `slurmft prepare` counts them exactly)")
    if tokens:
        lines.append(f"data: ~{tokens:,} tokens per epoch (estimated from the files)")
    if t.epochs is not None:
        lines.append(f"train.epochs {t.epochs:g} -> ~{math.ceil(t.epochs * steps)} steps (exact count computed in "
                     "the job and recorded in plan.json)")
    elif t.max_steps:
        lines.append(f"train.max_steps {t.max_steps} = ~{t.max_steps / steps:.2f} epoch(s)")
    return lines


def epoch_estimate(cfg: RunConfig, samples: list[Sample], template: Template | None) -> tuple[int | str, int | None]:
    """(packed sequences (or rows) in one pass over the mixture, its tokens when packed); a reason string instead of
    the sequences when they cannot be counted."""
    if len(samples) != len(cfg.data.datasets) or not all(s.complete for s in samples):
        return "some data is on the hub or larger than 64 MiB; the job counts it", None
    rows = [s.rows for s in samples]
    weights = [cfg.data.datasets[s.index].weight for s in samples]
    total_w = sum(weights)
    probs = [w / total_w for w in weights]
    # interleave_datasets(all_exhausted) runs until every source was seen once: the rarest decides
    mixed = rows[0] if len(rows) == 1 else min(4 * sum(rows), math.ceil(max(n / p for n, p in zip(rows, probs, strict=True))))
    if not cfg.packed:
        return mixed, None
    chat = any(s.fmt != formats.TEXT for s in samples)
    if template is None or (chat and template.text is None) or template.tokenizer_json is None:
        return "tokenizer.json and a chat template are needed to count tokens", None
    if importlib.util.find_spec("tokenizers") is None:
        return "the tokenizers package is not installed here", None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(template.tokenizer_json))
    tokens = 0.0
    for sample, p in zip(samples, probs, strict=True):
        if sample.fmt == formats.TEXT:  # TRL's language modelling: the tokenizer's specials, the text, EOS; all kept
            counts = [len(e.ids) + 1 for e in tok.encode_batch(sample.texts, add_special_tokens=True)]
            tokens += mixed * p * (sum(counts) / max(1, len(counts)))
            continue
        try:
            texts = [render_conversation(template, c) for c in sample.conversations]
        except Exception:  # noqa: BLE001 - reported by check_chat_template
            return "the chat template does not render this data", None
        counts = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
        tokens += mixed * p * (sum(min(c, cfg.data.max_seq_length) for c in counts) / max(1, len(counts)))
    return max(1, math.ceil(tokens / cfg.data.max_seq_length)), round(tokens)
