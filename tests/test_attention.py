"""slurmft.attention: what an architecture supports, read from transformers' source without importing it, and
the choice ``auto`` makes from it (the job's side of the choice is tests/job/test_loading.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_runner import cli

from slurmft import attention
from slurmft.attention import Support

ARCHS = ["llama", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "olmo2", "mixtral", "qwen3_moe",
         "deepseek_v3", "gpt_oss"]


@pytest.mark.parametrize("model_type", ARCHS)
def test_source_reading_equals_the_class_attributes(model_type: str) -> None:
    """The torch-free reading says what transformers' class itself declares (Gemma-2 and gpt-oss: no SDPA)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.for_model(model_type))]
    assert attention.support_of(model_type) == Support(model_type, cls._supports_sdpa, cls._supports_flash_attn)


def test_unknown_model_type_is_left_to_the_job() -> None:
    assert attention.support_of("no_such_model") is None
    assert attention.support_of("../etc") is None
    assert attention.choose("auto", None, "no CUDA device") == ("sdpa", "no CUDA device; falling back to PyTorch SDPA")


def test_auto_is_flash_then_sdpa_then_eager() -> None:
    full, no_sdpa = Support("qwen3", True, True), Support("gemma2", False, True)
    assert attention.choose("auto", full, None)[0] == "flash_attention_2"
    assert attention.choose("auto", full, "flash-attn is not installed")[0] == "sdpa"
    attn, why = attention.choose("auto", no_sdpa, "no CUDA device")
    assert attn == "eager" and why == "no CUDA device, and no SDPA for gemma2 in transformers: eager attention"
    assert attention.choose("auto", Support("x", True, False), None) == (
        "sdpa", "transformers has no flash-attention 2 for x; falling back to PyTorch SDPA")
    assert attention.choose("eager", no_sdpa, None) == ("eager", "set by model.attn_implementation")


def test_an_explicit_choice_the_architecture_refuses_names_the_field_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"model.attn_implementation=sdpa: transformers does not support SDPA .* "
                                         r"for gemma2 models; set model.attn_implementation=auto \(gives eager here\)"):
        attention.choose("sdpa", Support("gemma2", False, True), None)
    assert attention.refusal("flash_attention_2", Support("x", True, False)) is not None
    assert attention.refusal("sdpa", Support("qwen3", True, True)) is None


def test_validate_refuses_sdpa_for_gpt_oss_before_anything_is_submitted(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A local config.json is enough (no weights, no torch on the login side: tests/test_lazy_imports.py)."""
    from tests.test_checks import CHAT, jsonl, write_run

    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_model.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, model / f.name)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "gpt_oss"}))
    data = jsonl(tmp_path / "c.jsonl", [CHAT] * 3)
    path = write_run(tmp_path, model, data, model={"attn_implementation": "sdpa"})
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 2 and "model.attn_implementation=sdpa: transformers does not support SDPA" in err, err
    assert "for gpt_oss models" in err and "auto (gives eager here)" in err
    path = write_run(tmp_path, model, data, model={"attn_implementation": "eager"})
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 0, err
    assert not (tmp_path / "run").exists()
