#!/usr/bin/env bash
# The Charliecloud image the container tests run their ranks in (tests/slurm/test_container.py), built
# with no registry: a Debian 12 root from mmdebstrap (python3 + venv), and the training stack installed
# into a venv in it (/opt/sft) with this machine's pip from the same wheels CI installs (.ci/constraints.txt;
# `torch==2.13.0` is the CPU build). slurmft itself is not in the image: the tests mount this checkout and
# set PYTHONPATH in the image (cluster.container), so the image outlives every commit.
#
#   bash tests/slurm/image.sh          build once (a no-op when the cached image matches), print its path
#   bash tests/slurm/image.sh path     print the path only (exit 1 when not built)
#   bash tests/slurm/image.sh podman   the same image imported into podman's storage (installs Debian's podman
#                                      if missing; a no-op when imported), print its reference
#
# Knobs: SLURMFT_IMAGE_CACHE  where the image is built and kept   (/var/cache/slurmft)
# Also installs Debian's charliecloud-runtime (ch-run) if missing. Needs root (mmdebstrap, apt-get).
#
# The image carries a test hook, slurmft_test_image_mark.py in the venv's site-packages, imported by a .pth
# file there (Debian's own /usr/lib/python3.11/sitecustomize.py would shadow a sitecustomize.py): a Python
# started in the image with SLURMFT_TEST_IMAGE_MARKS set writes one JSON file there (its Slurm job, restart,
# rank, sys.executable, the image's marker and os-release), the proof that a rank ran inside the image.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CACHE=${SLURMFT_IMAGE_CACHE:-/var/cache/slurmft}
IMAGE=$CACHE/image-bookworm-sft
PY_SITE=opt/sft/lib/python3.11/site-packages

# What the image is made of: a change here (or in the pinned stack) rebuilds it.
HOOK=$(cat <<'EOF'
"""slurmft's test image: a Python started with SLURMFT_TEST_IMAGE_MARKS records that it ran in the image."""
import json
import os
import sys

_marks = os.environ.get("SLURMFT_TEST_IMAGE_MARKS")
if _marks:
    def _field(name):
        return os.environ.get(name, "")

    try:
        with open("/etc/slurmft-test-image") as _f:
            _image = _f.read().strip()
        with open("/etc/os-release") as _f:
            _os = dict(line.rstrip("\n").split("=", 1) for line in _f if "=" in line)
        _rec = {"job": _field("SLURM_JOB_ID"), "restart": _field("SLURM_RESTART_COUNT") or "0",
                "rank": _field("SLURM_PROCID"), "pid": os.getpid(), "executable": sys.executable,
                "image": _image, "os": _os.get("PRETTY_NAME", "").strip('"'), "argv": sys.argv[:3],
                "ch_running": "CH_RUNNING" in os.environ}
        os.makedirs(_marks, exist_ok=True)
        _name = f"{_rec['job']}-{_rec['restart']}-{_rec['rank']}-{os.getpid()}.json"
        with open(os.path.join(_marks, _name), "w") as _f:
            json.dump(_rec, _f)
    except OSError as _exc:
        print(f"[slurmft test image] could not record the mark: {_exc}", file=sys.stderr)
EOF
)
PACKAGES=(torch==2.13.0 transformers accelerate trl datasets safetensors tokenizers peft submitit)
WANT="bookworm python3 ${PACKAGES[*]} $(sha256sum "$REPO/.ci/constraints.txt" | cut -c1-16) $(printf '%s' "$HOOK" | sha256sum | cut -c1-16) v3"

log() { printf '[image +%ds] %s\n' "$SECONDS" "$*"; }

if [ "${1:-build}" = path ]; then
  [ "$(cat "$IMAGE/etc/slurmft-test-image" 2>/dev/null)" = "$WANT" ] || exit 1
  echo "$IMAGE"
  exit 0
fi

if [ "${1:-build}" = podman ]; then
  built=$(bash "${BASH_SOURCE[0]}" build | tail -n 1)
  REF="localhost/slurmft-sft:$(printf '%s' "$WANT" | sha256sum | cut -c1-12)"
  if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! dpkg -s catatonit >/dev/null 2>&1; then
    log "installing podman (catatonit: the --init that passes the warning signal on; runc: crun refuses a hybrid cgroup layout)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends podman catatonit runc >/dev/null \
      || { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends podman catatonit runc >/dev/null; }
  fi
  if ! podman image exists "$REF"; then
    log "importing $built into podman as $REF" >&2
    tar -C "$built" -c . | podman import --quiet - "$REF" >/dev/null
  fi
  echo "$REF"
  exit 0
fi

if ! command -v ch-run >/dev/null; then
  log "installing charliecloud-runtime (ch-run)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends charliecloud-runtime >/dev/null \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends charliecloud-runtime >/dev/null; }
fi

if [ "$(cat "$IMAGE/etc/slurmft-test-image" 2>/dev/null)" = "$WANT" ]; then
  echo "$IMAGE"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || { echo "building the test image needs root (mmdebstrap)" >&2; exit 1; }
mkdir -p "$CACHE"
exec 8>"$CACHE/.lock-image"
flock -w 1200 8 || { echo "another build holds $CACHE/.lock-image" >&2; exit 1; }
if [ "$(cat "$IMAGE/etc/slurmft-test-image" 2>/dev/null)" = "$WANT" ]; then
  echo "$IMAGE"
  exit 0
fi
if ! command -v mmdebstrap >/dev/null; then
  log "installing mmdebstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends mmdebstrap >/dev/null
fi
tmp=$(mktemp -d "$CACHE/.image.XXXXXX")
trap 'rm -rf --one-file-system "$tmp"' EXIT
log "mmdebstrap bookworm (python3, python3-venv, libgomp1; libnuma1: vLLM's CPU build, the serve job in its image) into $tmp"
if ! mmdebstrap --variant=minbase --include=python3,python3-venv,libgomp1,libnuma1 bookworm "$tmp" \
     http://deb.debian.org/debian >"$tmp.log" 2>&1; then
  tail -n 30 "$tmp.log" >&2
  exit 1
fi
log "venv /opt/sft in the image"
chroot "$tmp" /usr/bin/python3 -m venv --without-pip /opt/sft
log "the training stack into it (this machine's pip, CI's pinned versions; torch==2.13.0 is the CPU build)"
# --target: the image's own python3.11 (the same ABI as this one) imports what is written there
python -m pip install --quiet --no-warn-script-location --no-warn-conflicts --progress-bar off --target "$tmp/$PY_SITE" \
  -c "$REPO/.ci/constraints.txt" "${PACKAGES[@]}"
printf '%s\n' "$HOOK" >"$tmp/$PY_SITE/slurmft_test_image_mark.py"
echo "import slurmft_test_image_mark" >"$tmp/$PY_SITE/slurmft_test_image_mark.pth"
# mount points of the tests' binds (ch-run binds onto existing directories of a read-only image)
mkdir -p "$tmp/tmp" "$tmp/work" "$tmp/root" "$tmp/var/cache/slurmft"
echo "$WANT" >"$tmp/etc/slurmft-test-image"
rm -rf --one-file-system "$IMAGE"
mv "$tmp" "$IMAGE"
trap - EXIT
rm -f "$tmp.log"
log "built $IMAGE ($(du -sh "$IMAGE" | cut -f1))"
echo "$IMAGE"
