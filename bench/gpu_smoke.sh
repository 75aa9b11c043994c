#!/usr/bin/env bash
# GPU smoke test of the in-job training (one GPU, NCCL, bf16, flash-attn if installed): tokens/s and MFU
# of a ~1B random Llama built locally. Not run in CI. Without a GPU: bash bench/gpu_smoke.sh --dry-run
# Options: --steps N --seq N --batch N --peak-tflops F --workdir DIR --json OUT (see bench/gpu_smoke.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/gpu_smoke.py "$@"
