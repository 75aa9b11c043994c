"""bench/gpu_smoke.py's checks and FLOP count, without running anything (tests/job/test_bench_scripts.py
runs the whole dry run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_smoke.py"


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module
    spec.loader.exec_module(module)
    return module


def _good(**changes) -> dict:
    one = {"precision": "bf16-mixed", "dtype": "float32", "compute_dtype": "bfloat16",
           "attn_implementation": "flash_attention_2", "backend": "cuda:nccl,cpu:gloo", "steps": 30,
           "first_loss": 9.0, "last_loss": 7.5, "final_checkpoint_complete": True, "tokens_per_s": 50_000.0,
           "sharded_state_bytes": 100, "estimated_state_bytes": 100, "mfu": 0.41}
    return {**one, **changes}


GPU_BF16_MIXED = {"precision": "bf16-mixed", "dtype": "float32", "compute_dtype": "bfloat16",
                  "attn_implementation": "flash_attention_2", "backend": "cuda:nccl"}


def test_a_good_gpu_run_passes(smoke) -> None:
    assert smoke.check(_good(), GPU_BF16_MIXED, 30, on_gpu=True) == []


@pytest.mark.parametrize(("change", "words"), [
    ({"compute_dtype": "float32"}, "compute_dtype is 'float32', expected 'bfloat16'"),
    ({"dtype": "bfloat16"}, "dtype is 'bfloat16', expected 'float32'"),  # bf16-mixed keeps fp32 master weights
    ({"attn_implementation": "sdpa"}, "attn_implementation is 'sdpa', expected 'flash_attention_2'"),
    ({"backend": "gloo"}, "backend is 'gloo'"),
    ({"final_checkpoint_complete": False}, "no COMPLETE marker"),
    ({"last_loss": float("nan")}, "loss is not finite"),
    ({"mfu": 1.7}, "MFU 1.7 is outside (0, 1)"),
    ({"sharded_state_bytes": 200}, "slurmft estimate says 100 B"),
    ({"steps": 29}, "29 steps logged, expected 30"),
])
def test_each_failure_is_named(smoke, change: dict, words: str) -> None:
    problems = smoke.check(_good(**change), GPU_BF16_MIXED, 30, on_gpu=True)
    assert len(problems) == 1 and words in problems[0], problems


def test_expectations_per_mode_and_device(smoke, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmft.job import loading

    monkeypatch.setattr(loading, "flash_attention_problem", lambda on_gpu: None if on_gpu else "no CUDA device")
    assert smoke.expected("bf16-mixed", True, "auto") == GPU_BF16_MIXED
    true = smoke.expected("bf16-true", True, "auto")
    assert (true["dtype"], true["compute_dtype"]) == ("bfloat16", "bfloat16")
    cpu = smoke.expected("bf16-mixed", False, "auto")
    assert (cpu["attn_implementation"], cpu["backend"], cpu["compute_dtype"]) == ("sdpa", "gloo", "bfloat16")
    monkeypatch.setattr(loading, "flash_attention_problem", lambda on_gpu: "flash-attn is not installed")
    assert smoke.expected("bf16-mixed", True, "auto")["attn_implementation"] == "sdpa"  # auto: SDPA is right
    assert smoke.expected("bf16-mixed", True, "flash_attention_2")["attn_implementation"] == "flash_attention_2"


def test_flops_per_token_for_llama_2_7b(smoke, tmp_path: Path) -> None:
    """6 N (no input embedding) + 12 L H Dh T, by hand from Llama-2-7B's published shape."""
    from slurmft.resources import data_dir

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text((data_dir("configs") / "models" / "llama-2-7b.json").read_text())
    f = smoke.flops_per_token(model, 4096)
    assert f["params"] == 6_738_415_616 and f["params_non_embedding"] == 6_738_415_616 - 32000 * 4096
    assert f["flops_per_token"] == 6 * (6_738_415_616 - 32000 * 4096) + 12 * 32 * 32 * 128 * 4096
    assert f["attention_flops_per_token"] == 6_442_450_944  # 14 % of the total at 4096 tokens
