#!/usr/bin/env bash
# GPU check of GRPO with vLLM rollouts (bench/gpu_grpo_check.py): a few GRPO steps on the tiny model with TRL's
# colocate mode, and with slurmft's server mode through the product (slurmft validate with
# SLURMFT_UNPROVEN_VLLM_SERVER=1, the rendered server step's command, the train job's entrypoint; 2 GPUs, else
# skipped and said); prints seconds per step, the server's start-up and the rewards; --out DIR gets
# gpu_grpo_check.json and .txt.
# Needs a CUDA GPU and vLLM + TRL in $PYTHON: without them it says which is missing and exits 2 (the lent GPU
# machines' image has no vLLM, docs/grpo.md). Never run yet. Options: --out DIR --steps N --workdir DIR
# --cases colocate,server --server-wait-s S.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/gpu_grpo_check.py "$@"
