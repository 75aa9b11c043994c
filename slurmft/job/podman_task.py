"""What ``srun`` starts on each task of a podman run, on the host: the task's own ``podman run`` options, then podman.

pyxis, Apptainer and Charliecloud give a container the environment of the task that starts it; ``podman run``
gives it the image's, plus what it is told. So a variable the user exported before ``slurmft submit`` (the docs'
``export HF_TOKEN``, ``WANDB_API_KEY``, ``WANDB_MODE``) and one that ``cluster.setup`` exports in the batch script
never reached the ranks, and ``--device=nvidia.com/gpu=all`` gave every rank every GPU of the node, another job's
too when nodes are shared (issue 47). What a task must pass is known only on its node, at its start (the batch
script runs on the first node; a step's GPUs are per node), so it is decided here, per task, by the host's Python:

* every variable of the task's environment is passed **by name** (``--env=NAME``: podman reads the value from its
  own environment; no value is ever on a command line or in a file), except the host's own (:data:`HOST_ONLY`:
  ``PATH``, ``HOME``, ``LD_LIBRARY_PATH``, ``PYTHONPATH``... which would break the image's Python) — as Apptainer
  does by default. A name slurmft sets itself (cluster.env, cluster.container.env, the profile) is rendered into
  the script already and wins;
* on a GPU run, the GPUs Slurm gave this task's step on this node (``SLURM_STEP_GPUS``: global ids, not relative to
  a device cgroup; a one-node job's ``SLURM_JOB_GPUS``), one CDI device each (``--device=nvidia.com/gpu=ID``,
  NVML's index as Slurm's gres autodetection numbers them), and ``CUDA_VISIBLE_DEVICES`` counting them from 0 in
  the container. A task whose GPUs cannot be told is refused, unless the job has its nodes to itself
  (``resources.exclusive``): then the node's every GPU is its own.

Then it ``exec``s podman (the same process: Slurm's signal reaches podman, which passes it on). A warning signal
or SIGTERM in the few milliseconds before the ``exec`` is dropped, not fatal, as podman's own start drops one
that comes before the container runs: the handlers below come first.
"""

from __future__ import annotations

import signal
import sys


def _drop(*_: object) -> None:
    """A caught signal is reset to its default action by ``exec``: podman gets it as it would from srun."""


# before anything else (as slurmft/job/launch.py): the warning signal (``--signal=NAME``, rendered first) and SIGTERM
_WARNING = next((a.split("=", 1)[1] for a in sys.argv[1:3] if a.startswith("--signal=")), "USR2")
for _sig in {getattr(signal, "SIG" + _WARNING.upper().removeprefix("SIG"), signal.SIGUSR2), signal.SIGTERM}:
    signal.signal(_sig, _drop)

import os  # noqa: E402 - after the handlers, on purpose
import re  # noqa: E402
from collections.abc import Mapping  # noqa: E402

#: The host's own variables: they describe this machine's file system and shell, and would break the image's
#: (its PATH finds its Python, its HOME is its own, a host PYTHONPATH or LD_LIBRARY_PATH loads the host's modules).
HOST_ONLY = frozenset({
    "PATH", "HOME", "PWD", "OLDPWD", "SHELL", "SHLVL", "_", "HOSTNAME", "TERM", "MAIL", "DISPLAY", "TMPDIR",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "LIBRARY_PATH", "CPATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
    "PYTHONUSERBASE", "VIRTUAL_ENV", "MANPATH", "INFOPATH", "PKG_CONFIG_PATH", "MODULEPATH", "MODULESHOME",
    "LOADEDMODULES", "DBUS_SESSION_BUS_ADDRESS", "CUDA_VISIBLE_DEVICES",
})
HOST_ONLY_PREFIXES = ("LMOD", "_LMOD", "CONDA", "_CE_", "SSH_", "XDG_", "BASH_FUNC_", "__")
#: Names a shell can export (an exported function is ``BASH_FUNC_name%%``, not one).
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: The CDI kind of a GPU (the NVIDIA container toolkit's ``nvidia-ctk cdi generate``).
GPU_KIND = "nvidia.com/gpu"
#: The exit code of a task whose GPUs cannot be told (nothing started).
NO_GPUS_EXIT = 3


class UnknownGpus(RuntimeError):
    """Which GPUs Slurm gave this task cannot be told from its environment."""


def passed_names(environ: Mapping[str, str]) -> list[str]:
    """The task's variables that go into the container by name: all but the host's own."""
    return sorted(n for n in environ if NAME.fullmatch(n) and n not in HOST_ONLY and not n.startswith(HOST_ONLY_PREFIXES))


def _ids(text: str) -> list[str]:
    """Slurm's GPU id list (``0,1``, ``0-3``, ``0,2-3``) as ids."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        if dash and first.isdigit() and last.isdigit():
            out += [str(i) for i in range(int(first), int(last) + 1)]
        elif part.isdigit():
            out.append(part)
        elif part:
            raise UnknownGpus(f"cannot read the GPU ids {text!r}")
    return out


def step_gpus(environ: Mapping[str, str]) -> list[str] | None:
    """The global ids of the GPUs Slurm gave this task's step on this node; None when the environment cannot say
    (Slurm 22.05 on the test cluster sets no ``SLURM_STEP_GPUS`` in a step; ``SLURM_JOB_GPUS`` is the batch node's,
    so it tells only for a job on one node)."""
    if environ.get("SLURM_STEP_GPUS"):
        return _ids(environ["SLURM_STEP_GPUS"])
    if environ.get("SLURM_JOB_GPUS") and environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES")) == "1":
        return _ids(environ["SLURM_JOB_GPUS"])
    return None


def task_options(environ: Mapping[str, str], gpus: str | None) -> list[str]:
    """The ``podman run`` options of this task (pure: its environment in, options out). ``gpus``: None (a CPU
    step), ``shared`` (a job that may share its nodes: only its own GPUs, or :class:`UnknownGpus`) or
    ``exclusive`` (its own GPUs when they can be told, else the node's every GPU, all its own)."""
    options = [f"--env={n}" for n in passed_names(environ)]
    if gpus is None:
        return options
    ids = step_gpus(environ)
    if ids is None and gpus == "exclusive":
        return [*options, f"--device={GPU_KIND}=all"]
    if ids is None:
        raise UnknownGpus("neither SLURM_STEP_GPUS nor (on a one-node job) SLURM_JOB_GPUS is set on this task")
    devices = [f"--device={GPU_KIND}={i}" for i in ids]
    return [*options, *devices, f"--env=CUDA_VISIBLE_DEVICES={','.join(str(i) for i in range(len(ids)))}"]


def main(argv: list[str]) -> int:
    """``[--signal=NAME] [--gpus=shared|exclusive] podman run OPTIONS... IMAGE COMMAND...``: exec podman with this
    task's options after ``run``."""
    gpus = None
    while argv and argv[0].startswith(("--signal=", "--gpus=")):
        if argv[0].startswith("--gpus="):
            gpus = argv[0].split("=", 1)[1]
        argv = argv[1:]
    if len(argv) < 2 or argv[1] != "run":
        print(f"[slurmft] podman_task: expected 'podman run ...', got {' '.join(argv[:2])!r}", file=sys.stderr)
        return 2
    try:
        options = task_options(os.environ, gpus)
    except UnknownGpus as exc:
        print(f"[slurmft] task {os.environ.get('SLURM_PROCID', '?')} on {os.environ.get('SLURMD_NODENAME', '?')}: "
              f"{exc}: cannot tell which GPUs Slurm gave it, and podman would show it every GPU of the node (another "
              "job's too). Set resources.exclusive: true (the nodes are then the job's alone), or ask for a Slurm "
              "that sets SLURM_STEP_GPUS in a step (docs/containers.md)", file=sys.stderr)
        return NO_GPUS_EXIT
    sys.stdout.flush()
    os.execvp(argv[0], [argv[0], argv[1], *options, *argv[2:]])
    return 127  # not reached: execvp raises when podman is missing


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
