"""slurmft.modelinfo: where a model's config.json and tokenizer are found, before any download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slurmft import modelinfo
from slurmft.config_loading import validate
from slurmft.errors import ConfigError

TINY = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=8000,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)


# ====================================================================== finding config.json
def test_read_model_config_local_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert modelinfo.read_model_config(str(tmp_path))["hidden_size"] == 256
    assert modelinfo.read_model_config(str(tmp_path / "config.json"))["hidden_size"] == 256
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="model.name_or_path.*no config.json"):
        modelinfo.read_model_config(str(empty))


@pytest.mark.parametrize(
    ("name", "hidden"),
    [
        ("llama-2-70b", 8192),
        ("meta-llama/Llama-2-70b-hf", 8192),
        ("meta-llama/Llama-2-13b-chat-hf", 5120),
        ("meta-llama/Meta-Llama-3-8B", 4096),
        ("Llama-2-7b-hf", 4096),
    ],
)
def test_read_model_config_shipped_names_and_hub_ids(name, hidden, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    cfg = modelinfo.read_model_config(name)
    assert cfg["hidden_size"] == hidden
    assert set(modelinfo.shipped_model_names()) >= {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b"}


def _fake_hub_cache(root: Path, repo_id: str, cfg: dict[str, Any], commit: str = "a" * 40) -> None:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(cfg))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_read_model_config_from_hub_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    _fake_hub_cache(tmp_path / "hf" / "hub", "someorg/tiny", TINY)
    assert modelinfo.read_model_config("someorg/tiny")["hidden_size"] == 256
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "other"))
    _fake_hub_cache(tmp_path / "other", "someorg/tiny", {**TINY, "hidden_size": 512}, commit="b" * 40)
    assert modelinfo.read_model_config("someorg/tiny")["hidden_size"] == 512
    assert modelinfo.read_model_config("someorg/tiny", revision="b" * 40)["hidden_size"] == 512


def test_read_model_config_not_found_names_the_field_and_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as exc:
        modelinfo.read_model_config("nobody/nothing")
    text = exc.value.render()
    assert "model.name_or_path" in text and "huggingface-cli download nobody/nothing" in text
    assert "llama-2-70b" in text
    with pytest.raises(ConfigError, match="model.name_or_path"):
        modelinfo.read_model_config("/no/such/dir")


def test_tokenizer_from_hub_cache_follows_refs_and_pinned_revision(monkeypatch, tmp_path):
    """find_tokenizer and read_model_config share one snapshot lookup (hub_snapshot)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _fake_hub_cache(tmp_path, "someorg/tiny", TINY)
    snap = tmp_path / "models--someorg--tiny" / "snapshots"
    (snap / ("a" * 40) / "tokenizer_config.json").write_text("{}")
    (snap / ("c" * 40)).mkdir()
    (snap / ("c" * 40) / "tokenizer_config.json").write_text("{}")
    base = {"name": "t", "output_dir": str(tmp_path / "run"), "data": {"datasets": [{"path": "x.jsonl"}]}}
    cfg = validate({**base, "model": {"name_or_path": "someorg/tiny"}})
    assert modelinfo.find_tokenizer(cfg) == (snap / ("a" * 40), "someorg/tiny")  # refs/main
    pinned = validate({**base, "model": {"name_or_path": "someorg/tiny", "revision": "c" * 40}})
    assert modelinfo.find_tokenizer(pinned)[0] == snap / ("c" * 40)
    missing = validate({**base, "model": {"name_or_path": "someorg/none"}})
    assert modelinfo.find_tokenizer(missing) == (None, "someorg/none")


def test_seq_length_rule():
    assert modelinfo.seq_length_problem(512, 1024) is None
    assert modelinfo.seq_length_problem(512, None) is None
    msg = modelinfo.seq_length_problem(4096, 2048)
    assert msg is not None and "data.max_seq_length (4096)" in msg and "at most 2048" in msg
