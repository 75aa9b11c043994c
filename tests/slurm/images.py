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


#: A sitecustomize.py for the copy of slurmft the image's PYTHONPATH names (it comes before Debian's own there): a
#: Python started in the image with SLURMFT_TEST_IMAGE_MARKS set also records what its environment says of the
#: user's variables and the GPUs (issue 47). A secret is recorded as its sha256, never as itself.
ENV_HOOK = """\"\"\"slurmft's tests: what a process in the test image sees of its environment (tests/slurm/images.py).\"\"\"
import hashlib
import json
import os
import sys

_marks = os.environ.get("SLURMFT_TEST_IMAGE_MARKS")
if _marks and os.path.exists("/etc/slurmft-test-image"):  # in the image only: the host's Pythons read this path too
    _env = os.environ
    _rec = {"job": _env.get("SLURM_JOB_ID", ""), "restart": _env.get("SLURM_RESTART_COUNT") or "0",
            "rank": _env.get("SLURM_PROCID", ""), "argv": sys.argv[:3], "executable": sys.executable,
            "cdi_gpus": sorted(n.rsplit("_", 1)[1] for n in _env if n.startswith("SLURMFT_TEST_CDI_GPU_")),
            "cuda_visible_devices": _env.get("CUDA_VISIBLE_DEVICES"),
            "slurm_gpus": _env.get("SLURM_STEP_GPUS") or _env.get("SLURM_JOB_GPUS"),
            "hf_token_sha256": hashlib.sha256(_env["HF_TOKEN"].encode()).hexdigest() if "HF_TOKEN" in _env else None,
            "from_setup": _env.get("SLURMFT_TEST_FROM_SETUP")}
    try:  # a folder of its own: the image hook's marks are the *.json beside it
        os.makedirs(os.path.join(_marks, "env"), exist_ok=True)
        with open(os.path.join(_marks, "env", f"{_rec['job']}-{_rec['restart']}-{_rec['rank']}-{os.getpid()}.json"),
                  "w") as _f:
            json.dump(_rec, _f)
    except OSError as _exc:
        print(f"[slurmft test image] could not record the environment: {_exc}", file=sys.stderr)
"""


def env_marks(directory: Path, job: str) -> list[dict]:
    """What :data:`ENV_HOOK` recorded for the processes of ``job`` that slurmft started (``python -m ...``)."""
    found = [json.loads(p.read_text()) for p in (directory / "env").glob(f"{job}-*.json")]
    return [m for m in found if m["argv"][:1] == ["-m"]]


#: A CDI spec with the NVIDIA toolkit's kind (nvidia.com/gpu) for the test cluster's fake GPUs: device N sets
#: SLURMFT_TEST_CDI_GPU_N in the container (as the real one injects /dev/nvidiaN), ``all`` every one of them, as
#: ``nvidia-ctk cdi generate`` writes it. podman 4.3 reads specs from /var/run/cdi (a tmpfs: gone at reboot).
CDI_SPEC = Path("/var/run/cdi/slurmft-test-gpus.yaml")


def fake_gpus_cdi(count: int = 8) -> str:
    """The CDI spec of ``count`` fake GPUs (JSON is YAML)."""
    devices = [{"name": str(i), "containerEdits": {"env": [f"SLURMFT_TEST_CDI_GPU_{i}={i}"]}} for i in range(count)]
    devices.append({"name": "all", "containerEdits": {"env": [f"SLURMFT_TEST_CDI_GPU_{i}={i}" for i in range(count)]}})
    return json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices}, indent=1)


def interpreter_mounts(python: str, image: Path) -> list[str]:
    """What a host venv's interpreter needs bound into ``image`` to run there (a serve or eval job's tool in its
    image, issue 48): the venv, and the installation its bin/python links to (a venv holds no interpreter of its own:
    here pyenv's under /root, absent from the image), each as its nearest directory the read-only image already has
    (a Charliecloud bind's destination must exist). Nothing for what lies under /tmp (ch-run shares it) or what the
    image has at that path already (e.g. Debian's own /usr/bin/python3.11)."""
    import os

    venv = Path(python).parent.parent
    base = Path(os.path.realpath(python)).parent.parent
    out: set[str] = set()
    for directory in (venv, base):
        if directory.is_relative_to("/tmp") or (image / directory.relative_to("/")).exists():
            continue
        while not (image / directory.relative_to("/")).is_dir():
            directory = directory.parent
        out.add(str(directory))
    return sorted(out)


def copy_of_slurmft(dest: Path) -> Path:
    """slurmft's package and its data folders (templates, configs: slurmft/resources.py) copied to ``dest``."""
    for name in ("slurmft", "templates", "configs"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "sitecustomize.py").write_text(ENV_HOOK)
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
