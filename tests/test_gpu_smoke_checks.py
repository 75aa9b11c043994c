"""bench/gpu_smoke.py's checks, cases, budget and FLOP count, without running anything
(tests/job/test_bench_scripts.py runs the whole dry run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_module import load_bench


@pytest.fixture(scope="module")
def smoke():
    return load_bench("gpu_smoke")


def _good(**changes) -> dict:
    one = {"precision": "bf16-mixed", "dtype": "float32", "compute_dtype": "bfloat16",
           "attn_implementation": "flash_attention_2", "backend": "cuda:nccl,cpu:gloo", "steps": 30,
           "first_loss": 9.0, "last_loss": 7.5, "final_checkpoint_complete": True, "tokens_per_s": 50_000.0,
           "sharded_state_bytes": 100, "estimated_state_bytes": 100, "mfu": 0.41,
           "saves": [{"step": 10, "mode": "async", "blocked_s": 0.1, "durable_s": 4.0, "bytes": 10},
                     {"step": 20, "mode": "async", "blocked_s": 0.05, "durable_s": 3.0, "bytes": 10},
                     {"step": 30, "mode": "sync", "blocked_s": 2.5, "durable_s": 2.5, "bytes": 10}]}
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
    ({"saves": [{"step": 10, "mode": "sync"}, {"step": 30, "mode": "sync"}]}, "periodic saves not asynchronous"),
    ({"saves": [{"step": 10, "mode": "async"}, {"step": 30, "mode": "async"}]}, "is not one synchronous save"),
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


def test_the_cases_run_the_async_save_first_then_the_8b_shape_and_sdpa_beside_flash(smoke) -> None:
    modes = ["bf16-true", "bf16-mixed"]
    gpu = smoke.plan_cases(modes, 30, "auto", on_gpu=True, flash_usable=False)
    assert [(c.name, c.every) for c in gpu] == [("1b/bf16-true", 10), ("1b/bf16-mixed", 30),
                                                ("8b-shaped/bf16-true", 30), ("8b-shaped/bf16-mixed", 30)]
    with_flash = smoke.plan_cases(modes, 30, "auto", on_gpu=True, flash_usable=True)
    assert with_flash[-1].name == "1b/bf16-true/sdpa" and with_flash[:-1] == gpu
    dry = smoke.plan_cases(modes, 3, "auto", on_gpu=False, flash_usable=False)  # each mode and model once
    assert [(c.name, c.every) for c in dry] == [("tiny/bf16-true", 1), ("8b-shaped/bf16-mixed", 3)]
    one_mode = smoke.plan_cases(["bf16-mixed"], 3, "auto", on_gpu=False, flash_usable=False)
    assert [c.name for c in one_mode] == ["tiny/bf16-mixed", "8b-shaped/bf16-mixed"]


def test_a_case_starts_only_when_the_budget_holds_it(smoke) -> None:
    small, wide = smoke.Case("1b", "bf16-true", "auto", 30), smoke.Case("8b-shaped", "bf16-true", "auto", 30)
    assert smoke.over_budget(small, {}, None) is None and smoke.over_budget(small, {}, 5.0) is None  # the first runs
    assert smoke.over_budget(small, {"1b": 60.0}, 61.0) is None
    assert smoke.over_budget(small, {"1b": 60.0}, 59.0) == "budget: 59s left, the case needs ~60s"
    assert smoke.over_budget(wide, {"1b": 60.0}, 89.0) == "budget: 89s left, the case needs ~90s"  # 1.5x: larger


def test_async_figures_set_the_waits_against_the_synchronous_save(smoke) -> None:
    figures = smoke.async_figures(_good(), 30)
    assert figures == {"async_blocked_s": [0.1, 0.05], "async_durable_s": [4.0, 3.0], "sync_save_s": 2.5,
                       "bytes": 10, "blocked_over_sync": 0.02}
    assert smoke.async_figures(_good(saves=[{"step": 30, "mode": "sync", "durable_s": 1.0}]), 30) is None
