#!/usr/bin/env bash
# GPU smoke test of the in-job training (one GPU, NCCL, flash-attn if installed): for train.precision
# bf16-true and bf16-mixed, tokens/s, MFU and peak GPU memory against `slurmft estimate`, on a ~1B random
# Llama built locally. Not run in CI. Without a GPU: bash bench/gpu_smoke.sh --dry-run (fp32, CPU).
# Options: --steps N --seq N --batch N --peak-tflops F --workdir DIR --json OUT --modes M1,M2 (bench/gpu_smoke.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/gpu_smoke.py "$@"
