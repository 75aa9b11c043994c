"""The model's own files beside its weights: ``config.json``, ``generation_config.json`` and the tokenizer.

``config.json`` is the checkpoint's copy if the trainer wrote one, else the base model's, with ``dtype`` set to
the dtype the weights are saved in (and ``architectures`` filled in if the config had none), so
``from_pretrained`` builds the model the files hold. ``generation_config.json`` is the first source's that has
one (the checkpoint, then the base model), else derived from the config, as ``save_pretrained`` does.

The tokenizer comes from the checkpoint if the trainer saved it there, else from the run's tokenizer
(``model.tokenizer``, else the model's own: :func:`slurmft.modelinfo.tokenizer_name`). A local tokenizer's files
are copied verbatim, so the chat template the trainer used is the one that ships; a hub tokenizer is loaded from
the node's cache and saved. Whatever was written must load with ``AutoTokenizer`` before the output is put in
place: a model directory whose tokenizer does not load is not deployable.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_paths import local_dir
from slurmft.errors import CheckpointError
from slurmft.modelinfo import tokenizer_name, tokenizer_revision

# Files that make up a tokenizer directory (copied verbatim, so the chat template the trainer used
# is the one that ships).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json",
)  # fmt: skip
TOKENIZER_DIRS = ("additional_chat_templates",)
TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_MARKERS)


def config_for_export(cfg: RunConfig, ckpt: Path) -> tuple[Any, str]:
    """The model config (the checkpoint's copy if the trainer wrote one) and where it came from."""
    from transformers import AutoConfig

    source = str(ckpt) if (ckpt / "config.json").is_file() else cfg.model.name_or_path
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.model.trust_remote_code}
    if cfg.model.revision and local_dir(source) is None:
        kwargs["revision"] = cfg.model.revision
    try:
        return AutoConfig.from_pretrained(os.path.expanduser(source), **kwargs), source
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot read the model config from {source!r}: {exc}",
            ["model.name_or_path must be a local directory with config.json, or a hub id in the local "
             "Hugging Face cache (compute nodes often have no network)"],
        ) from None  # fmt: skip


def write_model_config(
    config: Any, directory: Path, dtype_name: str, architecture: str, sources: list[Path | str]
) -> None:
    """``config.json`` with the saved dtype, and ``generation_config.json`` (the first source's that
    has one, else derived from the config, as save_pretrained does)."""
    config.dtype = dtype_name
    if not getattr(config, "architectures", None):
        config.architectures = [architecture]
    config.save_pretrained(directory)
    generation_config(config, sources).save_pretrained(directory)


def generation_config(config: Any, sources: list[Path | str]) -> Any:
    """The first source's generation config (local directory or cached hub id), else the config's."""
    from transformers import GenerationConfig

    for source in sources:
        local = Path(os.path.expanduser(str(source)))
        if (local / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(local)
        if not local.exists():
            try:
                return GenerationConfig.from_pretrained(str(source))
            except (OSError, ValueError):
                continue
    return GenerationConfig.from_model_config(config)


def tokenizer_for_export(cfg: RunConfig, ckpt: Path) -> str:
    """Where the exported tokenizer comes from: the checkpoint if the trainer saved it there, else the run's
    tokenizer (a local directory there must hold one; a hub id is looked up when it is written)."""
    if _has_tokenizer(ckpt):
        return str(ckpt)
    source = tokenizer_name(cfg)
    local = local_dir(source)
    if local is not None and not _has_tokenizer(local):
        raise CheckpointError(
            f"no tokenizer in {local} (none of {', '.join(TOKENIZER_MARKERS)}), and none saved in {ckpt}",
            ["set model.tokenizer to the tokenizer's directory or hub id"],
        )
    return source


def write_tokenizer(source: str, directory: Path, cfg: RunConfig) -> list[str]:
    """Copy a local tokenizer's files verbatim, or save a cached hub tokenizer; returns the files."""
    local = local_dir(source)
    if local is not None:
        copied = []
        for name in TOKENIZER_FILES:
            if (local / name).is_file():
                shutil.copy2(local / name, directory / name)
                copied.append(name)
        for name in TOKENIZER_DIRS:
            if (local / name).is_dir():
                shutil.copytree(local / name, directory / name)
                copied.append(name + "/")
        return copied
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": cfg.model.trust_remote_code}
    revision = tokenizer_revision(cfg)  # the revision the train job read it at (not local: source is the run's)
    if revision:
        kwargs["revision"] = revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load the tokenizer {source!r}: {exc}",
            ["set model.tokenizer to a local directory, or make sure the hub cache on this node has it"],
        ) from None
    before = set(os.listdir(directory))
    tokenizer.save_pretrained(directory)
    return sorted(set(os.listdir(directory)) - before)


def verify_tokenizer(directory: Path, cfg: RunConfig, files: list[str]) -> None:
    """The tokenizer written into ``directory`` (``files``) loads, else a CheckpointError naming what was copied."""
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(directory), trust_remote_code=cfg.model.trust_remote_code)
    except Exception as exc:  # any failure here means the output would not be deployable
        raise CheckpointError(
            f"the tokenizer files copied into the output do not load: {exc.__class__.__name__}: {exc}",
            [f"copied: {', '.join(files) or 'nothing'}"],
        ) from None
