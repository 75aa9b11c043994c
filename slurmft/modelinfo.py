"""What we know about a model before anything is downloaded: where its config.json and tokenizer are.

``validate``, ``estimate`` and the job must find the same ``config.json`` for the same
``model.name_or_path`` or they disagree about the model (a 4096-token run estimated against one
config and refused by the job against another). The order is one: a local directory (or ``.json``
file), then the Hugging Face hub cache (a pinned 40-hex revision, the snapshot ``refs/<rev>`` points
at, else the newest snapshot), then the copies shipped in ``configs/models/``. The hub cache comes
before the shipped copies because it is the exact model the job will load.

Torch-free and network-free: the login side imports this, and so does the job (the sequence-length
rule, with the message both sides print).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurmft.config_paths import is_local, looks_like_path
from slurmft.errors import ConfigError
from slurmft.resources import data_dir

if TYPE_CHECKING:
    from slurmft.config import RunConfig

#: Hub ids (lower case) answered by the configs shipped in configs/models/.
HUB_ALIASES: dict[str, str] = {
    "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "meta-llama/llama-2-7b-chat-hf": "llama-2-7b",
    "meta-llama/llama-2-7b": "llama-2-7b",
    "meta-llama/llama-2-13b-hf": "llama-2-13b",
    "meta-llama/llama-2-13b-chat-hf": "llama-2-13b",
    "meta-llama/llama-2-13b": "llama-2-13b",
    "meta-llama/llama-2-70b-hf": "llama-2-70b",
    "meta-llama/llama-2-70b-chat-hf": "llama-2-70b",
    "meta-llama/llama-2-70b": "llama-2-70b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
}


def shipped_model_names() -> list[str]:
    """Names of the model configs that ship in configs/models/."""
    return sorted(p.stem for p in (data_dir("configs") / "models").glob("*.json"))


#: Moves slurmft's own cache (:func:`cache_dir`) elsewhere.
CACHE_DIR_ENV = "SLURMFT_CACHE_DIR"


def _user_cache() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``: where huggingface's cache and ours live by default."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg).expanduser() if xdg else Path.home() / ".cache"


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, honouring HF_HUB_CACHE and HF_HOME like huggingface_hub does."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return _user_cache() / "huggingface" / "hub"


def cache_dir() -> Path:
    """slurmft's own cache (what is computed once per installation: TRL's SFTConfig fields, transformers' import
    table): ``SLURMFT_CACHE_DIR``, else ``slurmft`` in the user's cache. Not created here."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    return _user_cache() / "slurmft"


def hub_snapshot(repo_id: str, revision: str | None, marker: str) -> Path | None:
    """The hub-cache snapshot directory of ``repo_id`` that holds ``marker`` (a file name), or None.

    Tried in order: a pinned 40-hex revision, the snapshot ``refs/<revision or main>`` points at, and
    (no revision pinned) every snapshot, newest first.
    """
    repo_dir = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = revision or "main"
    candidates: list[Path] = []
    if re.fullmatch(r"[0-9a-f]{40}", ref):
        candidates.append(snapshots / ref)
    ref_file = repo_dir / "refs" / ref
    if ref_file.is_file():
        candidates.append(snapshots / ref_file.read_text().strip())
    if revision is None:  # no pinned revision: any snapshot, newest first
        found = sorted(snapshots.glob(f"*/{marker}"), key=lambda p: p.stat().st_mtime, reverse=True)
        candidates += [p.parent for p in found]
    return next((c for c in candidates if (c / marker).is_file()), None)


def _shipped(name: str) -> Path | None:
    key = name.strip().lower()
    key = HUB_ALIASES.get(key, key)
    models = data_dir("configs") / "models"
    for stem in (key, key.removesuffix(".json"), key.split("/")[-1].removesuffix("-hf")):
        path = models / f"{stem}.json"
        if re.fullmatch(r"[a-z0-9._-]+", stem) and path.is_file():
            return path
    return None


def locate_model_config(name_or_path: str, revision: str | None = None) -> Path:
    """Where the model's config.json is: a local directory (or .json file), the hub cache, or configs/models/.

    The hub cache comes before the shipped copies because it is the exact model the job will load.
    """
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return local / "config.json"
        raise ConfigError(
            f"model.name_or_path: directory {str(local)!r} has no config.json "
            "(give the directory of a saved Hugging Face model, e.g. one written by save_pretrained)"
        )
    if local.is_file() and local.suffix == ".json":
        return local
    if looks_like_path(name_or_path):
        raise ConfigError(f"model.name_or_path: local path {name_or_path!r} does not exist (give the directory of "
                          "a saved Hugging Face model, or a hub id such as meta-llama/Llama-3.1-8B)")
    if name_or_path.count("/") == 1:
        cached = hub_snapshot(name_or_path, revision, "config.json")
        if cached:
            return cached / "config.json"
    shipped = _shipped(name_or_path)
    if shipped:
        return shipped
    raise ConfigError(
        f"model.name_or_path: no config.json found for {name_or_path!r} to estimate from",
        [
            f"not a local directory, not in the hub cache ({hub_cache_dir()}), not a shipped config",
            f"fix: download it first (hf download {name_or_path} config.json; huggingface_hub < 1.0 spells it "
            f"huggingface-cli download {name_or_path} config.json), or point model.name_or_path at a local directory with config.json",
            f"shipped configs: {', '.join(shipped_model_names())}",
        ],
    )


def read_model_config(name_or_path: str, revision: str | None = None) -> dict[str, Any]:
    """The model's config.json as a dict (a multimodal wrapper's ``text_config`` is merged in)."""
    path = locate_model_config(name_or_path, revision)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name_or_path: cannot read {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"model.name_or_path: {path} is not a JSON object")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    return cfg


def tokenizer_name(cfg: RunConfig) -> str:
    """The tokenizer the run names: ``model.tokenizer``, else the model's own (``model.name_or_path``)."""
    return cfg.model.tokenizer or cfg.model.name_or_path


def tokenizer_revision(cfg: RunConfig) -> str | None:
    """The revision the run's tokenizer is read at: ``model.revision`` for the model's own; a ``model.tokenizer``
    of its own is read as found (the train job's rule, slurmft/job/inputs.py ``resolve_tokenizer_dir``)."""
    return None if cfg.model.tokenizer else cfg.model.revision


def find_tokenizer(cfg: RunConfig) -> tuple[Path | None, str]:
    """The local directory of the tokenizer the job will use (local path or hub cache), and its name."""
    name = tokenizer_name(cfg)
    path = Path(name)
    if path.is_dir():
        return path, name
    if is_local(name) or name.count("/") != 1:
        return None, name
    found = hub_snapshot(name, tokenizer_revision(cfg), "tokenizer_config.json")
    return found, name


def seq_length_problem(max_seq_length: int, limit: Any) -> str | None:
    """The message for a sequence longer than the model's positions (shared with the job and estimate)."""
    if isinstance(limit, int) and max_seq_length > limit:
        return (f"data.max_seq_length ({max_seq_length}) is larger than the model's max_position_embeddings "
                f"({limit}); set data.max_seq_length to at most {limit}")
    return None
