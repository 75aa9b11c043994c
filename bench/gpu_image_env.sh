#!/usr/bin/env bash
# The lent GPU machine's version set, here on CPU: the job's path proven on it before a lease is spent on it.
#
#   bash bench/gpu_image_env.sh [build|test|all]      (default all; docs/development.md)
#
# build: a Python 3.12 venv in .image-env/ (ignored; about 5 GB, most of it torch 2.11's CUDA wheel from PyPI,
#   which runs on CPU) with the image's packages the job needs, at the versions its list records
#   (bench/gpu_image_packages.txt: torch 2.11.0, transformers 5.17.0, accelerate 1.15.0, ...; the others at what
#   pip resolves within what the carried wheels ask), then the travelling wheels of bench/gpu_wheels.sh installed
#   as the device command installs them: pip install --no-index --no-deps --target .image-env/site .whl/*.whl.
#   Copies of the carried packages that pip pulled in for the image's own (the image has none) are removed, so
#   the wheels' versions are the ones imported. Ends with bench/gpu_image.py check: every version, and every
#   requirement the set does not meet.
# test: in that set, slurmft from this checkout: the job's import, bench/gpu_smoke.sh --dry-run, and the job's
#   CPU tests that matter (LANE_TESTS below: sliced FSDP2 loading, one run per precision with a resume and a
#   consolidation, asynchronous saves with preemption and a bitwise resume, a resume on 1 and 4 ranks, every
#   architecture, the version differences). The lane took 32 minutes on a 2-core machine shared with other work
#   (load 5-7; 16 CPU-minutes), the build 2-3 minutes with pip's cache warm.
# PYTHON: the project's own environment (pip install -e '.[train]'), which derives the lists; PY312: the 3.12
# interpreter (default: python3.12, else pyenv's newest 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ENV_DIR="$REPO/.image-env"
VENV_PY="$ENV_DIR/venv/bin/python"
SITE="$ENV_DIR/site"
PY="${PYTHON:-python}"
LANE_TESTS=(
  tests/test_gpu_image.py
  tests/test_gpu_smoke_checks.py
  tests/job/test_versions.py
  tests/job/test_loading.py
  tests/job/test_weights.py
  tests/job/test_precision_cpu.py
  tests/test_consolidate.py
  tests/job/test_train_cpu.py
  tests/job/test_elastic_cpu.py
  tests/job/test_architectures_cpu.py
)

python312() {
  if [ -n "${PY312:-}" ]; then echo "$PY312"; return; fi
  if python3.12 -V >/dev/null 2>&1; then command -v python3.12; return; fi
  local root
  root=$(pyenv root 2>/dev/null) || { echo "no Python 3.12: set PY312" >&2; exit 2; }
  local newest
  newest=$(find "$root/versions" -maxdepth 1 -name '3.12.*' | sort -V | tail -1)
  [ -n "$newest" ] || { echo "no Python 3.12 under $root/versions: set PY312" >&2; exit 2; }
  echo "$newest/bin/python3.12"
}

build() {
  mkdir -p "$ENV_DIR"
  [ -x "$VENV_PY" ] || "$(python312)" -m venv "$ENV_DIR/venv"
  "$VENV_PY" -m pip install -q --upgrade pip
  "$PY" bench/gpu_image.py image-needs >"$ENV_DIR/image-needs.txt"
  "$VENV_PY" -m pip install -q --progress-bar off -r "$ENV_DIR/image-needs.txt"
  bash bench/gpu_wheels.sh
  mapfile -t carried < <(sed 's/==.*//' .whl/carried.txt)
  "$VENV_PY" -m pip uninstall -y -q "${carried[@]}" 2>/dev/null || true
  rm -rf "$SITE"
  "$VENV_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
  PYTHONPATH="$SITE" "$VENV_PY" bench/gpu_image.py check
}

lane() {
  [ -x "$VENV_PY" ] && [ -d "$SITE" ] || { echo "no image environment: bash bench/gpu_image_env.sh build" >&2; exit 2; }
  # slurmft from this checkout, not installed, as on the lent machine (submit's check of the job's Python too)
  export PYTHONPATH="$REPO:$SITE"
  "$VENV_PY" -c "import slurmft.job.train"
  rm -rf "$ENV_DIR/smoke" "$ENV_DIR/smoke-out"
  CUDA_VISIBLE_DEVICES='' PYTHON="$VENV_PY" bash bench/gpu_smoke.sh --dry-run --workdir "$ENV_DIR/smoke" \
    --out "$ENV_DIR/smoke-out"
  # -n 0: one process (the tests launch their own two ranks); the cache stays out of the way of the main env's
  "$VENV_PY" -m pytest -q -n 0 -p no:cacheprovider "${LANE_TESTS[@]}" "$@"
}

case "${1:-all}" in
  build) build ;;
  test) shift; lane "$@" ;;
  all) build; lane ;;
  *) echo "usage: bash bench/gpu_image_env.sh [build|test|all]" >&2; exit 2 ;;
esac
