#!/usr/bin/env bash
# GPU smoke test of the in-job training (one GPU, NCCL, flash-attention 2 where transformers accepts it):
# for train.precision bf16-true and bf16-mixed, tokens/s, MFU and peak GPU memory against `slurmft estimate`,
# on a ~1.1B random Llama built locally; checks dtypes, attention, backend, checkpoint; exit 1 names a failure.
# One H200: about 3-4 minutes (needs ~25 GB free under --workdir for two checkpoints). Not run in CI; its
# dry run is: bash bench/gpu_smoke.sh --dry-run (CPU, tiny model, the same modes and checks).
# Options: --steps N --seq N --batch N --peak-tflops F --workdir DIR --json OUT --modes M1,M2 --attn A
# (bench/gpu_smoke.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/gpu_smoke.py "$@"
