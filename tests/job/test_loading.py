"""The sharded loader gives every rank exactly its slice of the checkpoint (two CPU ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import launch

pytestmark = pytest.mark.train


def _odd_tied_model(path: Path) -> Path:
    """Row counts not divisible by 2 (vocab 1001, intermediate 171) and tied embeddings: the padded path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=171, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_loaded_shards_equal_the_checkpoint(tiny_model: Path, job_env: dict[str, str], tmp_path: Path) -> None:
    odd = _odd_tied_model(tmp_path / "odd")
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).with_name("load_check.py")
    rc, log = launch(out, job_env, target=[str(script), str(out), str(tiny_model), str(odd)]).wait(timeout=180)
    assert rc == 0, log[-4000:]
    for name in (tiny_model.name, odd.name):
        results = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
        main = results[0]
        assert main["unchecked_keys"] == [] and main["params_not_in_file"] == [], main  # every key, both ways
        assert main["checked"] in (main["file_keys"], main["file_keys"] - main["tied"]), main
        assert main["mismatched"] == [], main
        assert main["max_abs_logit_diff"] < 1e-4, main
        for res in results:
            assert res["bad_rotary"] == []
            assert 0.45 <= res["local_fraction"] <= 0.55
    assert json.loads((out / "odd.rank0.json").read_text())["tied"] is True
