#!/usr/bin/env bash
# GPU smoke test of the in-job training (one GPU, NCCL, flash-attention 2 where transformers accepts it): per
# model (a ~1.1B random Llama; an 8B-shaped one, Llama-3-8B's width with 4 layers) and train.precision (bf16-true,
# bf16-mixed) the tokens/s, MFU and peak GPU memory against `slurmft estimate`, the asynchronous save's blocked
# time against a synchronous save, the sliced load's host RSS; checks dtypes, attention, backend, checkpoints;
# exit 1 names a failure. --out DIR gets gpu_smoke.json and gpu_smoke.txt. On the lent GPU machine: one device
# command, docs/development.md (about 4-5 minutes; --budget-s keeps it inside the command's limit). Not run in CI;
# its dry run is: bash bench/gpu_smoke.sh --dry-run (CPU, tiny models, the same cases and checks).
# Options: --out DIR --budget-s S --steps N --seq N --batch N --layers N --peak-tflops F --workdir DIR
# --modes M1,M2 --attn A (bench/gpu_smoke.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/gpu_smoke.py "$@"
