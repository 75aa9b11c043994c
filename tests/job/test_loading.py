"""The attention choice (slurmft.job.loading.choose_attention) and the packing note, single process.

There is no GPU here: ``on_gpu=True`` is passed in, and transformers' availability check
(``transformers.utils.is_flash_attn_2_available``) and the import of flash-attn are replaced by the
outcomes a GPU node can have. The fallback at model construction runs real transformers on the meta
device (flash-attention cannot be set up on this machine, so transformers really refuses it).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import pytest
import transformers.utils

from slurmft.config_loading import validate
from slurmft.errors import JobSetupError
from slurmft.job import loading


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch):
    """Set what a GPU node's environment says: transformers' verdict, installed or not, import outcome."""
    calls: list[bool] = []

    def set_node(available: bool, installed: bool = True, import_error: Exception | None = None) -> list[bool]:
        def is_available(*args: Any, **kwargs: Any) -> bool:
            calls.append(available)
            return available

        def do_import() -> object:
            if import_error is not None:
                raise import_error
            return object()

        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", is_available)
        monkeypatch.setattr(loading, "_import_flash_attn", do_import)
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if installed else None) if name == "flash_attn"
                            else real_find_spec(name, *a))
        return calls

    return set_node


def test_no_gpu_means_sdpa_and_an_explicit_request_is_refused() -> None:
    attn, why = loading.choose_attention("auto", on_gpu=False)
    assert attn == "sdpa" and why.startswith("no CUDA device") and "pip install" not in why
    assert loading.choose_attention("eager", on_gpu=False)[0] == "eager"
    with pytest.raises(JobSetupError, match="flash_attention_2 but no CUDA device"):
        loading.choose_attention("flash_attention_2", on_gpu=False)


def test_flash_when_transformers_accepts_it(node) -> None:
    calls = node(available=True)
    for requested in ("auto", "flash_attention_2"):
        assert loading.choose_attention(requested, on_gpu=True)[0] == "flash_attention_2"
    assert calls  # the decision came from transformers' own check


def test_installed_but_rejected_by_transformers_falls_back_to_sdpa(node) -> None:
    """An old or mismatched flash-attn that imports fine but transformers rejects: SDPA, not a setup error."""
    node(available=False, installed=True)
    attn, why = loading.choose_attention("auto", on_gpu=True)
    assert attn == "sdpa"
    assert "installed but transformers rejects it" in why and "pip install 'slurmft[flash]'" in why
    with pytest.raises(JobSetupError, match=r"flash_attention_2 but flash-attn is installed but transformers "
                                            r"rejects it.*pip install 'slurmft\[flash\]'.*auto"):
        loading.choose_attention("flash_attention_2", on_gpu=True)


def test_accepted_but_broken_import_falls_back_to_sdpa(node) -> None:
    node(available=True, import_error=ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c10"))
    attn, why = loading.choose_attention("auto", on_gpu=True)
    assert attn == "sdpa" and "does not import (ImportError: flash_attn_2_cuda.so: undefined symbol" in why
    with pytest.raises(JobSetupError, match="does not import"):
        loading.choose_attention("flash_attention_2", on_gpu=True)


def test_not_installed(node) -> None:
    node(available=False, installed=False)
    attn, why = loading.choose_attention("auto", on_gpu=True)
    assert attn == "sdpa" and why.startswith("flash-attn is not installed") and "slurmft[flash]" in why


def test_packing_note_only_for_padding_free_rows_without_flash_on_a_gpu() -> None:
    note = loading.packing_attention_note("sdpa", padding_free=True, row_tokens=8192, on_gpu=True)
    assert note is not None
    assert "up to 8192 tokens" in note and "block-diagonal mask" in note and "2048+" in note
    assert "pip install 'slurmft[flash]'" in note
    assert loading.packing_attention_note("flash_attention_2", True, 8192, True) is None
    assert loading.packing_attention_note("sdpa", False, 8192, True) is None  # no packing: no mask over a row
    assert loading.packing_attention_note("sdpa", True, 8192, False) is None  # CPU: flash-attn is no fix there


def _run_config(attn: str):
    return validate({"name": "t", "output_dir": "/tmp/slurmft-attn", "model": {"name_or_path": "x",
                     "attn_implementation": attn}, "data": {"datasets": [{"path": "d.jsonl"}]}})


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def test_model_construction_that_refuses_flash_falls_back_for_auto(caplog: pytest.LogCaptureFixture) -> None:
    """transformers itself refuses flash_attention_2 here (no flash-attn, no GPU): auto builds with SDPA."""
    import torch

    with caplog.at_level(logging.WARNING, logger="slurmft.job"):
        model = loading._build_meta_checked(_llama_config(), _run_config("auto"), torch.float32, "flash_attention_2")
    assert model.config._attn_implementation == "sdpa"
    assert "refused flash_attention_2" in caplog.text and "falling back to sdpa" in caplog.text
    with pytest.raises(JobSetupError, match="cannot build the model"):
        loading._build_meta_checked(_llama_config(), _run_config("flash_attention_2"), torch.float32,
                                    "flash_attention_2")


def test_architecture_support_comes_from_the_class_and_picks_eager_where_sdpa_is_refused(node) -> None:
    """Gemma-2 (soft-capping) and gpt-oss (sinks) refuse SDPA: auto gives eager, an explicit sdpa is refused."""
    from transformers import AutoConfig

    support = loading.architecture_support(AutoConfig.for_model("gpt_oss"))
    assert support is not None and not support.sdpa and support.flash
    attn, why = loading.choose_attention("auto", on_gpu=False, support=support)
    assert attn == "eager" and "no SDPA for gpt_oss" in why
    with pytest.raises(JobSetupError, match="model.attn_implementation=sdpa: transformers does not support SDPA"):
        loading.choose_attention("sdpa", on_gpu=False, support=support)
    node(available=True)
    assert loading.choose_attention("auto", on_gpu=True, support=support)[0] == "flash_attention_2"
    qwen = loading.architecture_support(AutoConfig.for_model("qwen3"))
    assert loading.choose_attention("auto", on_gpu=False, support=qwen)[0] == "sdpa"
