"""Data formats, mixing and the job's input checks (single process, no training)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from slurmft.config import DataConfig, DatasetSource, ModelConfig
from slurmft.errors import JobSetupError
from slurmft.job import data, inputs


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("row", "expected"), [
    ({"messages": [{"role": "user", "content": "q"}]}, "messages"),
    ({"conversations": ["q", "a"]}, "lima"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "sharegpt"),
    ({"text": "### Human: q### Assistant: a"}, "guanaco"),
])
def test_format_detection(row: dict, expected: str) -> None:
    fmt, _ = data.detect_format(DatasetSource(path="x.jsonl"), list(row), row, "src")
    assert fmt == expected


def test_wrong_columns_name_the_columns() -> None:
    with pytest.raises(JobSetupError, match=r"columns \['question', 'answer'\]"):
        data.detect_format(DatasetSource(path="x.jsonl"), ["question", "answer"], {"question": "q", "answer": "a"}, "s")
    with pytest.raises(JobSetupError, match=r"needs the column\(s\) \[.conversations.\]"):
        data.detect_format(DatasetSource(path="x.jsonl", format="lima"), ["text"], {"text": "x"}, "s")


def test_mixture_is_seeded_and_weighted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    lima = _jsonl(tmp_path / "lima.jsonl", [{"conversations": [f"q{i}", f"a{i}"]} for i in range(50)])
    guan = _jsonl(tmp_path / "g.jsonl", [{"text": f"### Human: h{i}### Assistant: r{i}"} for i in range(200)])
    cfg = DataConfig(datasets=[DatasetSource(path=str(lima), weight=3), DatasetSource(path=str(guan), weight=1)])
    mixed = data.load_mixture(cfg, seed=7)
    assert mixed.column_names == ["messages"]
    firsts = [m[0]["content"] for m in mixed["messages"]]
    assert {f"h{i}" for i in range(200)} <= set(firsts)  # all_exhausted: nothing dropped
    share = sum(f.startswith("q") for f in firsts) / len(firsts)
    assert 0.6 < share < 0.9  # weight 3:1, the smaller source repeated
    assert firsts == [m[0]["content"] for m in data.load_mixture(cfg, seed=7)["messages"]]


def test_template_that_cannot_render_is_caught_early(tmp_path: Path, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    ds = data.load_source(DatasetSource(path=str(_jsonl(tmp_path / "l.jsonl", [{"conversations": ["q", "a"]}]))),
                          0, None)
    with pytest.raises(JobSetupError, match="cannot render conversation 0"):
        data.check_template(ds, tok, "src")


def test_model_files_are_checked(tmp_path: Path) -> None:
    with pytest.raises(JobSetupError, match="does not exist"):
        inputs.resolve_model_dir(ModelConfig(name_or_path=str(tmp_path / "nope")), with_weights=True)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(JobSetupError, match="only safetensors weights are read"):
        inputs.weight_files(tmp_path / "bin")


def test_tiny_assets_are_deterministic(tmp_path: Path) -> None:
    from slurmft.tiny import build

    def digest(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    assert digest(a) == digest(b)
    config = json.loads((a / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (256, 4, False)
    assert "{% generation %}" in (a / "chat_template.jinja").read_text()


def test_sharegpt_roles_become_chat_roles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = [{"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": f"q{i}"},
                               {"from": "gpt", "value": f"a{i}"}]} for i in range(4)]
    ds = data.load_mixture(DataConfig(datasets=[DatasetSource(path=str(_jsonl(tmp_path / "s.jsonl", rows)))]), 0)
    assert len(ds) == 4 and ds[1]["messages"] == [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "q1"},
                                                  {"role": "assistant", "content": "a1"}]


def test_a_lopsided_mixture_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    big = _jsonl(tmp_path / "big.jsonl", [{"conversations": [f"q{i}", f"a{i}"]} for i in range(1000)])
    small = _jsonl(tmp_path / "small.jsonl", [{"conversations": [f"x{i}", f"y{i}"]} for i in range(10)])
    cfg = DataConfig(datasets=[DatasetSource(path=str(big), weight=0.01), DatasetSource(path=str(small), weight=0.99)])
    mixed = data.load_mixture(cfg, seed=0)
    assert len(mixed) == data.MAX_MIX_BLOWUP * 1010  # not the ~100k rows all_exhausted would produce
    share = sum(m[0]["content"].startswith("x") for m in mixed["messages"]) / len(mixed)
    assert share > 0.95  # still the weights
