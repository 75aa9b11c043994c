"""The benchmark scripts, so a bench that silently breaks turns CI red: bench/gpu_smoke.sh --dry-run runs
the whole pipeline on CPU, and every bench behind a number in docs/benchmarks.md runs in
its ``--quick`` mode and must meet its own targets (each exits 1 when one is missed) — except
bench/checkpoint.py, whose quick ratios are noise (a 60 MB checkpoint, time-to-first-step on a busy
machine): its test checks that every figure is reported, not the targets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import REPO

pytestmark = pytest.mark.train


def test_gpu_smoke_dry_run(tiny_model: Path, job_env: dict[str, str], tmp_path: Path) -> None:
    """The GPU run's cases and checks on CPU: bf16-mixed's master dtype (float32) differs from its compute
    dtype (bfloat16), so a smoke test that checked the wrong field fails here, not first on a GPU; the first case's
    periodic saves are asynchronous and its final one synchronous; the 8B-shaped model is built (narrower) and
    trained in the other mode; the JSON and the text land in --out. The dry run's small model is the tiny preset,
    which it finds in --workdir (the session's, not built again)."""
    out = tmp_path / "out"
    (tmp_path / "model-tiny").symlink_to(tiny_model)
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_smoke.sh"), "--dry-run", "--workdir", str(tmp_path),
                           "--out", str(out)], env={**job_env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=360)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "gpu_smoke.json").read_text())
    # gpu_smoke.check ran on every case, nothing failed
    assert summary["problems"] == {"tiny/bf16-true": [], "8b-shaped/bf16-mixed": []}
    assert summary["skipped"] == {} and summary["dry_run"] and summary["device"] == "cpu (dry run)"
    assert summary["versions"]["torch"].startswith("2.") and "trl" in summary["versions"]
    assert summary["unlisted"] and summary["unmet"] == []  # this set is not the image's; it meets the job's needs
    assert summary["flash_attn"] == {"usable": False, "why": "no CUDA device"}
    cases = summary["cases"]
    assert (cases["tiny/bf16-true"]["dtype"], cases["tiny/bf16-true"]["compute_dtype"]) == ("bfloat16", "bfloat16")
    mixed = cases["8b-shaped/bf16-mixed"]
    assert (mixed["dtype"], mixed["compute_dtype"]) == ("float32", "bfloat16")
    for one in cases.values():
        assert one["attn_implementation"] == "sdpa" and one["attn_requested"] == "auto"  # what transformers set up
        assert one["estimate"]["total"] > 0 and one["sharded_state_bytes"] == one["estimated_state_bytes"] > 0
        assert one["steps"] == 3 and one["final_checkpoint_complete"] and one["load_peak_rss_mib"] > 0
        assert one["tokens_per_s"] > 0 and one["mfu"] is None  # no GPU peak to divide by
    assert [(s["step"], s["mode"]) for s in cases["tiny/bf16-true"]["saves"]] == [(1, "async"), (2, "async"),
                                                                                 (3, "sync")]
    assert [(s["step"], s["mode"]) for s in mixed["saves"]] == [(3, "sync")]
    async_save = summary["async_save"]
    assert async_save["case"] == "tiny/bf16-true" and len(async_save["async_blocked_s"]) == 2
    assert async_save["sync_save_s"] > 0 and async_save["blocked_over_sync"] > 0
    # the tiny model (h 256, 4 layers of 4 heads x 64, V 4096 untied), by hand: 6 N without the input
    # embedding + 12 L H Dh T at the dry run's T = 64
    tiny = cases["tiny/bf16-true"]
    assert tiny["params"] == 5_261_568 and tiny["params_non_embedding"] == 5_261_568 - 4096 * 256
    assert tiny["seq"] == 64 and tiny["flops_per_token"] == 6 * (5_261_568 - 4096 * 256) + 12 * 4 * 4 * 64 * 64
    # the narrow 8B shape: 1 layer of h 256, 4 query heads and 1 KV head of 64, MLP 896, V 4096 untied, by hand
    layer = 256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 896 + 2 * 256
    assert mixed["params"] == 2 * 4096 * 256 + layer + 256
    text = (out / "gpu_smoke.txt").read_text()
    assert "| tiny/bf16-true |" in text and "| 8b-shaped/bf16-mixed |" in text and "async save (tiny/bf16-true" in text
    assert text.rstrip().splitlines()[-1].startswith("passed in")
    assert "[smoke] passed" not in proc.stdout and "passed in" in proc.stdout


#: The benches whose quick mode trains the tiny preset: they get the session's (``--model``) instead of building it.
ON_TINY = ("lora_memory.py", "dpo_memory.py", "prepare_first_step.py")


@pytest.mark.parametrize("script", ["cli_latency.py", "load_memory.py", "consolidate_memory.py", "lora_memory.py",
                                    "dpo_memory.py", "prepare_first_step.py"])
def test_readme_bench_quick_mode_meets_its_targets(script: str, job_env: dict[str, str], tmp_path: Path,
                                                   request: pytest.FixtureRequest) -> None:
    env = {**job_env, "TMPDIR": str(tmp_path)}  # the benches cache their models under $TMPDIR
    env.pop("CUDA_VISIBLE_DEVICES", None)
    model = ["--model", str(request.getfixturevalue("tiny_model"))] if script in ON_TINY else []
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick", *model], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    # stdout's end first: the targets line says which was missed (CI76 showed only stderr's warnings)
    assert proc.returncode == 0, proc.stdout[-2500:] + "\n--- stderr ---\n" + proc.stderr[-1500:]
    assert "targets" in out and ": met" in out and "MISSED" not in out, out[-2000:]
    assert "| " in proc.stdout  # the table docs/benchmarks.md quotes


def test_checkpoint_bench_quick_mode_reports_every_figure(tiny_model: Path, job_env: dict[str, str],
                                                          tmp_path: Path) -> None:
    """bench/checkpoint.py --quick: the whole bench runs (2-rank DCP save/load with AdamW state, the sequential
    baselines, a fresh and a resumed job) and reports every figure. Its targets are not asserted here: with a
    60 MB checkpoint and no warm-up run both ratios are noise (docs/benchmarks.md's figures come from the full
    run)."""
    out = tmp_path / "checkpoint.json"
    env = {**job_env, "TMPDIR": str(tmp_path)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "checkpoint.py"), "--quick", "--model", str(tiny_model),
                           "--json", str(out)], env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    figures = json.loads(out.read_text())
    tp, rs = figures["throughput"], figures["resume"]
    assert tp["bytes"] > 3 * 4 * 5_000_000  # fp32 weights + AdamW exp_avg and exp_avg_sq of ~5M parameters
    for key in ("save_GBps", "write_GBps", "load_GBps", "read_GBps", "save_ratio", "load_ratio"):
        assert tp[key] > 0, key
    pair = rs["pairs"][0]
    assert pair["fresh"]["first_step"] == 1 and pair["resume"]["first_step"] == 2  # the resume started at step 2
    assert pair["fresh"]["to_first_step_s"] > 0 and pair["resume"]["to_first_step_s"] > 0
    assert rs["ratio"] == rs["median_pair"]["ratio"] == pair["ratio"] > 0
    assert "| save (accelerate" in proc.stdout and "| start to end of first step" in proc.stdout
    assert "targets not enforced with --quick" in proc.stdout


def test_async_save_bench_quick_mode_reports_every_figure(tiny_model: Path, job_env: dict[str, str],
                                                          tmp_path: Path) -> None:
    """bench/async_save.py --quick: the real train job three times (no periodic save, synchronous, asynchronous
    saves) and every figure from metrics.jsonl's save lines. Its target is not asserted: 6 steps of the tiny
    model (64-token rows) on a busy machine make the ratios noise (docs/benchmarks.md's figures come from the full
    run)."""
    out = tmp_path / "async.json"
    env = {**job_env, "TMPDIR": str(tmp_path)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "async_save.py"), "--quick", "--model", str(tiny_model),
                           "--seq-len", "64", "--json", str(out)], env=env, cwd=str(REPO), capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    figures = json.loads(out.read_text())
    runs, summary = figures["runs"], figures["summary"]
    assert [s["step"] for s in runs["none"]["saves"]] == []  # only the final save, outside the figures
    for mode in ("sync", "async"):
        assert [(s["step"], s["mode"]) for s in runs[mode]["saves"]] == [(2, mode), (4, mode)]
        assert all(s["blocked_s"] > 0 and s["durable_s"] > 0 and s["bytes"] > 3 * 4 * 5_000_000
                   for s in runs[mode]["saves"])
    assert summary["periodic_saves"] == 2 and summary["sync_save_s"] > 0 and summary["blocked_ratio"] > 0
    assert "| async |" in proc.stdout and "target not enforced with --quick" in proc.stdout


def test_dcp_crc_bench_quick_mode_reports_every_figure(job_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "crc.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "dcp_crc.py"), "--quick", "--json", str(out)],
                          env=job_env, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    figures = json.loads(out.read_text())
    assert len(figures["seconds"]["with_crc"]) == len(figures["seconds"]["without_crc"]) == 3
    assert all(t > 0 for ts in figures["seconds"].values() for t in ts) and figures["ratio_without_over_with"] > 0
    assert "| median of 3 |" in proc.stdout and "target not enforced with --quick" in proc.stdout
