"""Run under torchrun by test_weights.py: a weight read that fails on rank 0 only, mid-load.

Rank 0's safetensors reads of ``KEY``'s data raise ``OSError(EIO)`` (what a flaky network filesystem
returns); its header stays readable, so rank 0's check against the headers passes and the failure comes
in the middle of the load, after earlier tensors were already read or sent. The model is loaded twice:
``sliced`` (every rank sees the directory) and ``scatter`` (only rank 0 does). Each rank writes what it
raised, and how long it took, to ``OUT/<how>.rank<r>.json``; exit status 0 when every load raised a
:class:`JobSetupError`.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/job/load_fault.py OUT DIR KEY
"""

from __future__ import annotations

import errno
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import safetensors
from load_check import run_config  # this script's directory is sys.path[0]

from slurmft.errors import JobSetupError
from slurmft.job import distributed, inputs, loading
from slurmft.job.rendezvous import JobEnv


class _FailingSlice:
    """A safetensors slice whose header reads work and whose data reads raise EIO."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def get_dtype(self) -> str:
        return self.inner.get_dtype()

    def __getitem__(self, index: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error")


class _FailingFile:
    """A safetensors file handle whose data reads of one key raise EIO."""

    def __init__(self, inner: Any, key: str) -> None:
        self.inner, self.key = inner, key

    def __enter__(self) -> _FailingFile:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, key: str) -> Any:
        sl = self.inner.get_slice(key)
        return _FailingSlice(sl) if key == self.key else sl

    def get_tensor(self, key: str) -> Any:
        if key == self.key:
            raise OSError(errno.EIO, "Input/output error")
        return self.inner.get_tensor(key)


def main() -> None:
    out, model_dir, key = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    ctx = distributed.init(JobEnv.from_environ())
    if ctx.is_main:
        real = safetensors.safe_open
        safetensors.safe_open = lambda path, **kw: _FailingFile(real(path, **kw), key)  # type: ignore[assignment]
    cfg = run_config(model_dir, activation_checkpointing=False)
    config = inputs.load_model_config(model_dir, cfg.model, 64)
    for how in ("sliced", "scatter"):
        t0 = time.time()
        try:
            loading.build_sharded_model(cfg, config, model_dir if ctx.is_main or how == "sliced" else None, ctx)
            error = None
        except JobSetupError as exc:
            error = exc.render()
        result = {"rank": ctx.rank, "error": error, "seconds": time.time() - t0}
        (out / f"{how}.rank{ctx.rank}.json").write_text(json.dumps(result))
        if error is None:
            sys.exit(1)
    gc.collect()  # free the half-built models (their meshes) first: one alive at destroy crashes the exit (torch 2.13)
    distributed.shutdown()


if __name__ == "__main__":
    main()
