#!/usr/bin/env bash
# The wheels that travel to the lent GPU machine: exactly the packages the job imports (and their needs) that the
# machine's image lacks (bench/gpu_image.py carry: the image's list, bench/gpu_image_packages.txt, against the
# job's imports), each at the version installed here, downloaded as cp312 manylinux wheels into .whl/ (ignored),
# the device tool's recipe. The smoke's command installs them there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
# (docs/development.md). Run it with the project's environment (pip install -e '.[train]'): its versions are the
# ones the tests ran with. Exits 1 when the folder would exceed its share of the 64 MiB the working tree may take.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${1:-.whl}"
LIMIT_MIB=48  # of the 64 MiB a device call may carry: the checkout itself takes a few

mapfile -t wanted < <("$PY" bench/gpu_image.py carry)
[ "${#wanted[@]}" -gt 0 ] || { echo "nothing to carry: the image has every package the job imports"; exit 0; }
rm -rf "$OUT"
mkdir -p "$OUT"
# The image's Python is 3.12 on x86-64; pip matches a manylinux tag exactly, so name the usual ones.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${wanted[@]}"
count=$(find "$OUT" -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#wanted[@]}" ]; then
  echo "expected ${#wanted[@]} wheels (${wanted[*]}), found $count in $OUT" >&2
  exit 1
fi
bytes=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
printf '%s\n' "${wanted[@]}" >"$OUT/carried.txt"
echo "$count wheels, $((bytes / 1024)) KiB, in $OUT: ${wanted[*]}"
if [ "$bytes" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "over ${LIMIT_MIB} MiB: the device call would refuse the working tree" >&2
  exit 1
fi
