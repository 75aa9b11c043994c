"""The job's inputs: the model directory (local or a hub snapshot), its weight index, config and tokenizer.

What transformers does: ``from_pretrained`` of a hub id downloads into HF_HOME on whichever rank calls
it, and a missing or gated repository, an offline node, a ``.bin``-only checkpoint, a model shorter
than ``data.max_seq_length`` or a tokenizer without a chat template surface as library tracebacks, on
some ranks, in the middle of setup. Why that is not enough: the other ranks walk into the next
collective and wait for its time-out, and the traceback does not say which field of run.yaml to change.

What we do: :func:`resolve_model_dir` fetches only the files a rank needs (rank 0 the weights as
well, the other ranks the config files; train.py runs it under ``main_first``, so a shared HF_HOME
gives them rank 0's snapshot and a node-local one is never filled once per node), and every failure
is a :class:`JobSetupError` naming the field (``model.name_or_path``, ``model.tokenizer``,
``train.sft.chat_template_path``, ``data.assistant_only_loss``) and its fix, which ``main_first``
turns into the same error on every rank. The weights themselves are read by slurmft/job/weights.py.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from slurmft import chat_template
from slurmft.config import ModelConfig, RunConfig
from slurmft.config_paths import looks_like_path
from slurmft.errors import JobSetupError

log = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
CONFIG_FILES = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]


# ----------------------------------------------------------------------------- locating files
def _local_path(value: str, field: str) -> Path | None:
    """The local directory ``value`` names, None for a hub id; JobSetupError for a missing local path."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise JobSetupError(f"{field}: {value!r} is a file; give the model directory (with config.json)")
        return path.resolve()
    if looks_like_path(value) or value.count("/") > 1:  # a hub id is org/name
        raise JobSetupError(
            f"{field}: local directory {value!r} does not exist (give an existing directory with config.json "
            "and *.safetensors, or a hub id like meta-llama/Llama-2-7b-hf)"
        )
    return None


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], field: str) -> Path:
    """Download (or find in the cache) the files of a hub repository matching ``patterns``."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # RepositoryNotFound, GatedRepo, LocalEntryNotFound (offline), HTTP errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise JobSetupError(
            f"{field}: could not get {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {first}). "
            "Check the id and revision; gated models need HF_TOKEN exported where you run 'slurmft submit'; "
            "offline nodes need the model in HF_HOME's cache or a local directory."
        ) from None


def resolve_model_dir(model: ModelConfig, with_weights: bool) -> Path:
    """Local directory holding config.json (and, when ``with_weights``, the safetensors files)."""
    local = _local_path(model.name_or_path, "model.name_or_path")
    if local is None:
        patterns = CONFIG_FILES + (WEIGHT_FILES if with_weights else [])
        local = _snapshot(model.name_or_path, model.revision, patterns, "model.name_or_path")
    if not (local / "config.json").is_file():
        raise JobSetupError(f"model.name_or_path: {local} has no config.json; it is not a Hugging Face model directory")
    return local


def resolve_tokenizer_dir(model: ModelConfig, model_dir: Path) -> Path:
    """Local directory of the tokenizer (``model.tokenizer`` or the model's own)."""
    if not model.tokenizer:
        return model_dir
    local = _local_path(model.tokenizer, "model.tokenizer")
    return local if local is not None else _snapshot(model.tokenizer, None, CONFIG_FILES, "model.tokenizer")


def weight_files(model_dir: Path) -> dict[str, str]:
    """Checkpoint key -> safetensors file name (from the index, or the single file)."""
    index = model_dir / SAFE_INDEX
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError) as exc:
            raise JobSetupError(f"model.name_or_path: {index} is not a valid safetensors index ({exc})") from None
    single = model_dir / SAFE_WEIGHTS
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), SAFE_WEIGHTS)
    others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
    raise JobSetupError(
        f"model.name_or_path: {model_dir} has no {SAFE_WEIGHTS} or {SAFE_INDEX}"
        + (f" (found {', '.join(others)}: only safetensors weights are read; convert them with "
           "save_pretrained(..., safe_serialization=True))" if others else "")
    )


# ----------------------------------------------------------------------------- which base model this is
SAMPLE_BYTES = 64 * 1024  # of each weight file's tensor data, at its start and at its end


def base_identity(model: ModelConfig, model_dir: Path) -> dict[str, Any]:
    """What identifies the base model's files, cheaply: the hub revision they were resolved to (a snapshot's
    commit, when ``model_dir`` is in the hub cache), and per weight file (and config.json) its size and a
    sha256 of its safetensors header plus the first and last 64 KiB of its tensor data.

    Recorded in a LoRA checkpoint's COMPLETE marker and compared by the merge (:func:`base_differences`): an
    adapter merged onto other weights is another model. The header alone names every tensor with its shape,
    dtype and offsets; the data samples tell apart two same-shaped models (two fine-tunes of one architecture),
    whose headers are equal. Reading 128 KiB per file keeps it cheap for any model size (not a full-file hash).
    """
    import hashlib
    import struct

    # a hub id resolves to HF_HOME/hub/models--*/snapshots/<commit>
    revision = model_dir.name if model_dir.parent.name == "snapshots" else None
    files: dict[str, dict[str, Any]] = {}
    for name in sorted(set(weight_files(model_dir).values())):
        path = model_dir / name
        size = path.stat().st_size
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head)
            digest.update(head + f.read(length))
            start = 8 + length
            digest.update(f.read(min(SAMPLE_BYTES, size - start)))
            f.seek(max(start, size - SAMPLE_BYTES))
            digest.update(f.read())
        files[name] = {"bytes": size, "sha256": digest.hexdigest()}
    config = (model_dir / "config.json").read_bytes()
    files["config.json"] = {"bytes": len(config), "sha256": hashlib.sha256(config).hexdigest()}
    return {"name_or_path": model.name_or_path, "revision": revision, "dir": str(model_dir), "files": files}


def follow_trained_base(model: ModelConfig, trained: dict[str, Any] | None) -> ModelConfig:
    """The model to read when resuming a checkpoint trained on ``trained`` (its marker's ``base``): a hub id
    resolves to the commit the checkpoint was trained on, not to what ``model.revision`` (a branch, or the
    default branch) points at now; a local directory, or a checkpoint that records no commit, stays as it is."""
    commit = (trained or {}).get("revision")
    if not commit or trained.get("name_or_path") != model.name_or_path or model.revision == commit:
        return model
    if Path(model.name_or_path).expanduser().exists():
        return model
    if model.revision and re.fullmatch(r"[0-9a-f]{40}", model.revision):
        return model  # pinned to another commit by the user: the base check names the difference
    return model.model_copy(update={"revision": commit})


def base_differences(trained: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the base model found now differs from the one a checkpoint was trained on (empty: the same files;
    the directory may have moved)."""
    out = []
    if trained.get("revision") and now.get("revision") and trained["revision"] != now["revision"]:
        out.append(f"hub revision: {trained['revision']} at training, {now['revision']} now")
    was, found = trained.get("files") or {}, now.get("files") or {}
    for name in sorted(was.keys() | found.keys()):
        a, b = was.get(name), found.get(name)
        if a != b:
            def words(e: dict[str, Any] | None) -> str:
                return "absent" if e is None else f"{e['bytes']:,} bytes, sha256 {e['sha256'][:16]}"
            out.append(f"{name}: {words(a)} at training, {words(b)} now")
    return out


# ----------------------------------------------------------------------------- config and tokenizer
def load_model_config(model_dir: Path, model: ModelConfig, max_seq_length: int) -> Any:
    """The transformers config, checked against data.max_seq_length."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=model.trust_remote_code)
    except Exception as exc:
        raise JobSetupError(f"model.name_or_path: cannot read {model_dir / 'config.json'}: {exc}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    from slurmft.modelinfo import seq_length_problem

    problem = seq_length_problem(max_seq_length, getattr(text, "max_position_embeddings", None))
    if problem:
        raise JobSetupError(problem)
    return config


def load_tokenizer(tokenizer_dir: Path, cfg: RunConfig) -> Any:
    """The tokenizer, with a chat template TRL can train on when the data holds conversations (else a JobSetupError
    that says the fix)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as exc:
        raise JobSetupError(f"model.tokenizer: cannot load a tokenizer from {tokenizer_dir}: {exc}") from None
    template_path = cfg.train.sft.get("chat_template_path")
    if template_path:
        problem = chat_template.template_path_problem(str(template_path))
        if problem:
            raise JobSetupError(problem)
        tokenizer.chat_template = Path(str(template_path)).expanduser().read_text()
    if not tokenizer.chat_template and cfg.chat_data:  # plain text alone (continued pretraining) applies none
        raise JobSetupError(chat_template.no_template_message(tokenizer_dir))
    if cfg.assistant_masks:
        from trl.chat_template_utils import get_training_chat_template

        try:
            get_training_chat_template(tokenizer)
        except ValueError:
            raise JobSetupError(chat_template.no_markers_message(tokenizer_dir)) from None
    return tokenizer


# ----------------------------------------------------------------------------- train.sft
def check_sft_keys(cfg: RunConfig) -> None:
    """The login side's train.sft and report_to rules (slurmft.sftopts), here with TRL imported; values coerced."""
    from slurmft.job.unused_packages import installed
    from slurmft.sftopts import REPORTERS, sft_field_kinds, sft_problems

    kinds, trl_version = sft_field_kinds()
    problems, coerced = sft_problems(cfg.train.sft, kinds, trl_version)
    for name in cfg.train.report_to:
        if name not in REPORTERS:
            problems.append(f"train.report_to: {name!r} is not supported here; use tensorboard or wandb")
        elif REPORTERS[name] and not any(installed(m) for m in REPORTERS[name]):
            problems.append(f"train.report_to: {name} is enabled but the {REPORTERS[name][0]} package is not installed")
    if problems:
        raise JobSetupError("invalid training options", problems=problems)
    cfg.train.sft = coerced

