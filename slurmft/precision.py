"""Training precision: one table that the config, the estimator, the loader and consolidation share.

Why one table: the dtype of the sharded parameters, the compute dtype, the dtype gradients are
reduced in and the dtype of the AdamW state are four facts that must agree everywhere (the loader
allocates the shards, the FSDP2 ``MixedPrecisionPolicy`` casts, the optimizer inherits the
parameter dtype, DCP checkpoints store it, ``slurmft estimate`` counts it). Deriving all of them
from ``train.precision`` here means no two places can silently disagree.

The names are Lightning's, which users know:

* ``bf16-mixed``: fp32 sharded parameters and AdamW state, bf16 compute, fp32 reduce
  (16 bytes/parameter of training state: 4 weights + 4 gradients + 8 optimizer).
* ``bf16-true``: bf16 parameters, gradients and AdamW state, bf16 compute and reduce
  (8 bytes/parameter: 2 + 2 + 4; the "~56 GB for a 7B model" of the sizing notes, torchtune's default).
* ``fp32``: everything in fp32 (16 bytes/parameter).
* ``fp16-mixed``: as ``bf16-mixed`` with fp16 compute (what ``model.dtype: float16`` always meant).
* ``auto``: ``bf16-mixed`` on GPUs, ``fp32`` on CPU.

No torch here: the login side (config, estimate) imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Precision:
    """What one precision mode stores, computes and communicates in (dtype names as in run.yaml)."""

    name: str
    param_dtype: str  # sharded parameters = master weights = checkpoint = sharded gradients
    compute_dtype: str  # FSDP2 all-gathers and the forward/backward run in this
    reduce_dtype: str  # the default of fsdp.reduce_dtype
    description: str

    @property
    def optim_dtype(self) -> str:
        """AdamW's exp_avg/exp_avg_sq follow the parameter dtype (torch.optim.AdamW's ``zeros_like``)."""
        return self.param_dtype

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    def state_bytes(self) -> dict[str, int]:
        """Training-state bytes per parameter as FSDP2 holds them: weights, gradients, AdamW (2 states)."""
        p = self.param_bytes
        return {"weights": p, "gradients": p, "optimizer": 2 * DTYPE_BYTES[self.optim_dtype]}


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("bf16-mixed", "float32", "bfloat16", "float32",
                  "fp32 sharded parameters and AdamW state, bf16 compute, fp32 gradient reduce"),
        Precision("bf16-true", "bfloat16", "bfloat16", "bfloat16",
                  "bf16 parameters, gradients and AdamW state, bf16 compute and reduce"),
        Precision("fp32", "float32", "float32", "float32", "everything in fp32"),
        Precision("fp16-mixed", "float32", "float16", "float32",
                  "fp32 sharded parameters and AdamW state, fp16 compute, fp32 gradient reduce"),
    )
}
#: model.dtype (the compute dtype) -> the precision it meant before train.precision existed.
FROM_MODEL_DTYPE = {"bfloat16": "bf16-mixed", "float16": "fp16-mixed", "float32": "fp32"}
#: GPUs without bf16 arithmetic (compute capability < 8.0), by a word of the profile's gpu.type.
NO_BF16_GPUS = ("V100", "T4", "P100", "P40", "K80")


def reconcile(precision: str, model_dtype: str) -> tuple[str, str, str | None]:
    """(train.precision, model.dtype, problem): one knob derives the other; a contradiction is a problem.

    ``auto`` on both sides stays ``auto`` (resolved where the device is known: :func:`resolve`).
    """
    if precision == "auto":
        if model_dtype == "auto":
            return "auto", "auto", None
        return FROM_MODEL_DTYPE[model_dtype], model_dtype, None
    compute = PRECISIONS[precision].compute_dtype
    if model_dtype in ("auto", compute):
        return precision, compute, None
    return precision, model_dtype, (
        f"train.precision: {precision} computes in {compute} but model.dtype is {model_dtype}; the two disagree. "
        f"Remove model.dtype (train.precision sets it), or set model.dtype={compute}"
        + (f", or train.precision={FROM_MODEL_DTYPE[model_dtype]} to compute in {model_dtype}"
           if model_dtype in FROM_MODEL_DTYPE else "")
    )


def resolve(precision: str, on_gpu: bool) -> Precision:
    """The mode a run really uses: ``auto`` is bf16-mixed on GPUs, fp32 on CPU."""
    if precision == "auto":
        return PRECISIONS["bf16-mixed" if on_gpu else "fp32"]
    return PRECISIONS[precision]


def reduce_dtype(mode: Precision, configured: str | None) -> str:
    """fsdp.reduce_dtype, or the precision's default when it is unset."""
    return configured or mode.reduce_dtype


def consolidated_dtype(configured: str, mode: Precision) -> str:
    """consolidate.dtype, where ``auto`` means the training compute dtype (bf16 for both bf16 modes)."""
    return mode.compute_dtype if configured == "auto" else configured


def bf16_unsupported(gpu_type: str) -> bool:
    """True for GPU types known to lack bf16 (V100, T4, P100, ...): bf16 runs there fail or crawl."""
    import re

    words = re.split(r"[^A-Z0-9]+", gpu_type.upper())
    return any(w.startswith(NO_BF16_GPUS) and not w.startswith("T4G") for w in words)
