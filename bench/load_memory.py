"""Peak memory of loading a model into FSDP2 shards: slurmft's loader vs. the naive way.

    python bench/load_memory.py [--model DIR | --file-dtype float32|bfloat16] [--nproc 2] [--json OUT.json] [--quick]

Without ``--model`` it builds the ~170M-parameter Llama of ``python -m slurmft.tiny DIR --size 150m``
(cached under ``$TMPDIR/slurmft-bench/150m-<dtype>``); ``--file-dtype bfloat16`` stores it in
bf16, the way hub checkpoints usually are, while training (and this benchmark) loads float32.
Each method runs in its own ``torch.distributed.run`` job with ``--nproc`` CPU ranks (gloo). Every rank samples ``/proc/self/status`` (RssAnon, RssFile)
in a thread every 5 ms and reports its peak above its own baseline, taken after the imports and
the process group are ready:

- ``slurmft``: meta-device model, FSDP2 per layer, rank 0 streams tensors from the memory-mapped
  safetensors file and scatters row chunks (``slurmft.job.loading.build_sharded_model``);
- ``naive``: every rank ``from_pretrained`` the whole checkpoint, then ``fully_shard`` per decoder
  layer and the root.

Targets (anonymous memory; pages of a file that is only memory-mapped are reported apart, as they
are reclaimable page cache): rank >= 1 at most 1.3 x its shard, rank 0 at most 1 x model + shard.
Prints a markdown table; exits 1 when a target is missed. ``--quick`` (what the test suite runs) uses
the 150m shape with 6 decoder layers instead of 12 (~92M parameters; the tiny preset is too small: a
few MiB of fixed per-process overhead would dominate its 10 MiB shards).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
QUICK_LAYERS = 6  # --quick: the 150m shape with fewer layers


class MemSampler:
    """Peaks of RssAnon, RssFile and their sum, polled from /proc/self/status in a thread."""

    KEYS = ("RssAnon", "RssFile")

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak = {"RssAnon": 0, "RssFile": 0, "Rss": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def read(cls) -> dict[str, int]:
        """Current values in bytes."""
        values = {}
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in cls.KEYS:
                    values[key] = int(line.split()[1]) * 1024
        values["Rss"] = values["RssAnon"] + values["RssFile"]
        return values

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, value in self.read().items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(self.interval_s)

    def start(self) -> MemSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        for key, value in self.read().items():
            self.peak[key] = max(self.peak[key], value)
        return dict(self.peak)


def _file_dtype(model_dir: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_slice(next(iter(f.keys()))).get_dtype()


def _wrap_like_slurmft(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def worker(method: str, model_dir: Path, out: Path) -> None:
    """One rank: baseline, load with ``method``, report peaks above the baseline."""
    import gc

    import torch
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the baseline)
    from safetensors import safe_open  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from slurmft.config import RunConfig
    from slurmft.job import distributed, loading
    from slurmft.job.rendezvous import JobEnv

    ctx = distributed.init(JobEnv.from_environ())
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    cfg = RunConfig.model_validate({
        "name": "bench", "output_dir": "/tmp/unused",
        "model": {"name_or_path": str(model_dir), "dtype": "float32"},
        "data": {"datasets": [{"path": "unused.jsonl"}], "max_seq_length": 64},
        "train": {"max_steps": 1}, "checkpoint": {"every_steps": 1},
        "fsdp": {"activation_checkpointing": False},
    })
    config = loading.load_model_config(model_dir, cfg.model, 64)
    gc.collect()
    dist.barrier()
    base = MemSampler.read()
    sampler = MemSampler().start()
    t0 = time.time()
    if method == "slurmft":
        model = loading.build_sharded_model(cfg, config, model_dir if ctx.is_main else None, ctx).model
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _wrap_like_slurmft(model, mesh)
    dist.barrier()
    seconds = time.time() - t0
    gc.collect()
    peak = sampler.stop()
    shard = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(isinstance(p, DTensor) for p in model.parameters())
    result = {"method": method, "rank": ctx.rank, "world_size": ctx.world_size, "seconds": round(seconds, 2),
              "model_bytes": full, "shard_bytes": shard,
              "peak_anon_above_base": peak["RssAnon"] - base["RssAnon"],
              "peak_file_above_base": peak["RssFile"] - base["RssFile"],
              "peak_rss_above_base": peak["Rss"] - base["Rss"],
              "base_rss": base["Rss"], "file_dtype": _file_dtype(model_dir)}
    (out / f"{method}.rank{ctx.rank}.json").write_text(json.dumps(result))
    distributed.shutdown()


def quick_model(path: Path, file_dtype: str) -> Path:
    """The 150m preset's shape with QUICK_LAYERS decoder layers, random weights, stored in ``file_dtype``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "model.safetensors").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=QUICK_LAYERS,
                             num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                             tie_word_embeddings=False)
        model = LlamaForCausalLM(config).to(getattr(torch, file_dtype))
        model.config.dtype = getattr(torch, file_dtype)
        model.save_pretrained(path)
    return path


def ensure_model(model: str | None, file_dtype: str, size: str = "150m") -> Path:
    """The benchmark model: ``--model``, the quick model, or the cached ``size`` preset in ``file_dtype``."""
    if model:
        return Path(model).resolve()
    path = Path(tempfile.gettempdir()) / "slurmft-bench" / f"{size}-{file_dtype}"
    if size == "quick":
        return quick_model(path, file_dtype)
    if not (path / "model.safetensors").is_file():
        print(f"building the {size} model in {path} ...", flush=True)
        subprocess.run([sys.executable, "-m", "slurmft.tiny", str(path), "--size", size, "--dtype", file_dtype],
                       check=True, cwd=REPO)
    return path


def table(results: list[dict]) -> str:
    """Markdown table of per-rank peaks (MiB) and their ratios to the targets."""
    model_mib = results[0]["model_bytes"] / MIB
    lines = [
        f"Model: {model_mib:.0f} MiB as fp32 ({results[0]['model_bytes'] // 4 / 1e6:.0f}M params, file in "
        f"{results[0]['file_dtype']}), "
        f"{results[0]['world_size']} ranks, CPU/gloo. Peak above each rank's post-import baseline, MiB.",
        "",
        "| loading | rank | anon peak | file-mapped peak | total RSS peak | shard | anon / shard "
        "| anon / (model + shard) | time s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"slurmft": "slurmft (meta + rank-0 stream + scatter)",
             "naive": "naive (every rank from_pretrained, then shard)"}
    for r in results:
        anon, shard = r["peak_anon_above_base"] / MIB, r["shard_bytes"] / MIB
        lines.append(f"| {names[r['method']]} | {r['rank']} | {anon:.0f} | {r['peak_file_above_base'] / MIB:.0f} | "
                     f"{r['peak_rss_above_base'] / MIB:.0f} | {shard:.0f} | {anon / shard:.2f} | "
                     f"{anon / (model_mib + shard):.2f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: build the 150m preset)")
    ap.add_argument("--file-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the built checkpoint (training loads float32 either way)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_LAYERS} decoder layers instead of 12 (the test suite's mode)")
    ap.add_argument("--worker", choices=["slurmft", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, Path(args.model), Path(args.out))
        return 0
    model = ensure_model(args.model, args.file_dtype, "quick" if args.quick else "150m")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    results = []
    with tempfile.TemporaryDirectory() as out:
        for method in ("slurmft", "naive"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--worker", method, "--model", str(model), "--out", out]
            subprocess.run(cmd, check=True, env=env, cwd=REPO)
            results += [json.loads((Path(out) / f"{method}.rank{r}.json").read_text()) for r in range(args.nproc)]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    worst_other = max(r["peak_anon_above_base"] / r["shard_bytes"] for r in results
                      if r["method"] == "slurmft" and r["rank"] > 0)
    rank0 = next(r for r in results if r["method"] == "slurmft" and r["rank"] == 0)
    ok = worst_other <= 1.3 and rank0["peak_anon_above_base"] <= rank0["model_bytes"] + rank0["shard_bytes"]
    print(f"\nslurmft targets (rank>=1 <= 1.3 x shard, rank 0 <= model + shard): {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
