"""The container test image on the real cluster: where it is, a run's ``cluster`` section that puts its ranks in it
(Charliecloud or podman), and the proof, left by the image's hook, that a job's processes ran there.

tests/slurm/image.sh builds the image with no registry (mmdebstrap + the pinned training stack; cached) and imports
it into podman's storage. The image holds the stack only: slurmft itself is a copy of this checkout, mounted and
put on PYTHONPATH, so the image outlives every commit. Its hook writes one JSON file per Python started with
SLURMFT_TEST_IMAGE_MARKS set: the job, restart, rank, sys.executable, the image's marker and os-release.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGE_SH = REPO / "tests" / "slurm" / "image.sh"
IMAGE_PYTHON = "/opt/sft/bin/python"  # the venv image.sh makes in the image; the host has none


def built(*mode: str) -> str:
    """``image.sh`` (build or import once, cached): the image directory, or with ``podman`` its reference."""
    out = subprocess.run(["bash", str(IMAGE_SH), *mode], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def in_image(where: Path, runtime: str, image: Path | str) -> dict:
    """A run's ``cluster`` section (profile and time kept) with its ranks in ``image``; the marks go to where/marks.

    Everything the job reads lies under /tmp, which ch-run shares with the image, so every automatic bind finds
    its destination in the read-only image: the model, the data, the copy of slurmft. podman shares nothing it is
    not told to: the copy and the marks are two more mounts (the run directory, model, data and HF_HOME slurmft
    mounts itself)."""
    (where / "marks").mkdir(parents=True)
    # HF_HOME (the image's home is not writable; validate asks for it: the datasets cache) is not made here: the
    # batch script makes it before the step, as a user's first run needs (issue 47: a runtime refuses a mount whose
    # source does not exist, pyxis "--container-mounts: source path does not exist", ch-run and podman alike)
    src = copy_of_slurmft(where / "src")
    container = {"runtime": runtime, "image": str(image), "python": IMAGE_PYTHON,
                 "env": {"PYTHONPATH": str(src), "SLURMFT_TEST_IMAGE_MARKS": str(where / "marks")}}
    env = {"HF_HOME": str(where / "hf")}
    if runtime == "podman":
        container["mounts"] = [str(src), str(where / "marks")]
        env["CONTAINERS_CONF"] = str(podman_conf(where / "containers.conf"))
    return {"container": container, "env": env}


def podman_conf(path: Path) -> Path:
    """What this machine's podman needs, as a site would put it in containers.conf (podman reads CONTAINERS_CONF):
    rootful podman asks for rlimits above what this VM allows (nofile 1048576; and it lowers its own nproc to
    32768 before its runtime sets the container's), and crun refuses the hybrid cgroup v1/v2 layout, runc does not."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(32768, resource.getrlimit(resource.RLIMIT_NPROC)[1])
    path.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
                    '[engine]\nruntime = "runc"\n')
    return path


def copy_of_slurmft(dest: Path) -> Path:
    """slurmft's package and its data folders (templates, configs: slurmft/resources.py) copied to ``dest``."""
    for name in ("slurmft", "templates", "configs"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def marks(directory: Path, job: str) -> list[dict]:
    """What the image's hook recorded for the processes of ``job`` that slurmft started (``python -m ...``; the
    hook runs before runpy replaces argv[0]), not a helper process a library started (``python -c``)."""
    found = [json.loads(p.read_text()) for p in directory.glob(f"{job}-*.json")]
    return [m for m in found if m["argv"][:1] == ["-m"]]


def ran_in_image(directory: Path, jobs: dict[str, str], image: Path, charliecloud: bool) -> None:
    """Every rank of both attempts of the train job (2 ranks, one requeue) and every other job's task left the
    image's mark: the image's interpreter (absent on the host), its marker file and os-release, and whether ch-run
    started it."""
    assert not Path(IMAGE_PYTHON).exists()  # the host has no such interpreter: only the image does
    marker = (image / "etc" / "slurmft-test-image").read_text().strip()
    ranks = marks(directory, jobs["train"])
    assert {(m["restart"], m["rank"]) for m in ranks} == {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}, ranks
    others = {kind: marks(directory, job) for kind, job in jobs.items() if kind != "train"}
    for kind, found in others.items():
        assert found, f"the {kind} job's task left no mark"
    for mark in ranks + [m for found in others.values() for m in found]:
        assert mark["executable"] == IMAGE_PYTHON and mark["image"] == marker, mark
        assert mark["ch_running"] is charliecloud and "bookworm" in mark["os"], mark
