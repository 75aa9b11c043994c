"""The container boundary: which interpreter runs where, and the rank step wrapped in the user's image.

On clusters with EFA or InfiniBand people train in an image (pyxis + enroot on AWS and NVIDIA systems,
Apptainer at most universities, Charliecloud, podman); the image carries the CUDA-matched torch, NCCL and
the aws-ofi-nccl plugin. Where the boundary goes was measured (docs/design-notes.md, DESIGN §8): a batch
script that itself runs in the image (``#SBATCH --container-image``) has no ``scontrol`` (pyxis#129), so
it cannot requeue. The boundary is the rank ``srun`` line: the batch script, ``cluster.setup``, the
rendezvous lookup, the requeue decision and every Slurm command stay on the host with the host's Python
(``cluster.python``), and only the ranks (and the prepare and consolidation jobs' one task) run the image's
Python (``cluster.container.python``). The warning signal (``--signal=USR2@N``, never ``B:``) then reaches
the ranks directly: pyxis joins the task to the container's namespaces with no wrapper, Charliecloud stays
in the host PID namespace, Apptainer's starter forwards signals, podman forwards them to ``--init``.

An image's own ``ENV`` beats an inherited variable (pyxis#124; NGC images set NCCL_* and even
MASTER_PORT), so every variable slurmft exports for the ranks is passed in by name, the way each runtime
takes it. Everything here is pure: ``resolve`` and ``wrap`` read the config and return quoted strings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from slurmft.config import RunConfig
from slurmft.config_cluster import ContainerConfig
from slurmft.config_paths import looks_like_path
from slurmft.errors import ConfigError

if TYPE_CHECKING:
    from slurmft.profiles import ClusterProfile

#: What the ranks read from their own task's environment: Slurm's per-task values and submitit's. podman
#: is the one runtime that starts a container with the image's environment only; these go in as globs.
TASK_ENV_GLOBS = ("SLURM_*", "SUBMITIT_*")


@dataclass(frozen=True)
class Container:
    """A run's container after the profile's defaults and the run's own section are merged."""

    runtime: str
    image: str
    python: str
    mounts: tuple[tuple[str, str], ...]  # (source on the host, destination in the image), outermost first
    env: dict[str, str] = field(default_factory=dict)
    writable: bool = False
    workdir: str = "/"
    mount_home: bool = False
    field: str = "cluster.container"  # the section that chose it, as messages name it (serve.container, ...)

    @property
    def image_is_path(self) -> bool:
        """The image names a file or directory on the nodes (not a registry reference)."""
        if self.runtime == "charliecloud":
            return True
        if self.runtime == "podman":
            return False  # podman runs references; a saved image is `podman load`ed first
        if self.runtime == "apptainer":
            return "://" not in self.image
        return looks_like_path(self.image)  # pyxis: what enroot imports from a file


def _merged(run: ContainerConfig | None, site: ContainerConfig | None) -> ContainerConfig | None:
    """The profile's container with the run's fields over it (mounts and env add up)."""
    if run is None:
        return site
    if site is None:
        return run
    merged = site.model_dump()
    for name in run.model_fields_set:
        merged[name] = getattr(run, name)
    merged["mounts"] = [*site.mounts, *(m for m in run.mounts if m not in site.mounts)]
    merged["env"] = {**site.env, **run.env}
    return ContainerConfig.model_validate(merged)


def automatic_mounts(cfg: RunConfig, container_env: dict[str, str] | None = None) -> list[str]:
    """Directories the ranks need at the same path in the image: the run directory (checkpoints, logs, the
    prepared data, submitit's pickles), the model and tokenizer directories, each local data file's directory,
    a chat template's directory, the eval job's own task files' directories (lm-eval's include path) and HF_HOME
    when the container's env (``container_env``; default: the run's cluster.container.env) or cluster.env sets
    it."""
    dirs = [cfg.output_dir]
    for value in (cfg.model.name_or_path, cfg.model.tokenizer):
        if value and value.startswith("/"):
            dirs.append(value)
    for source in cfg.data.datasets:
        if looks_like_path(source.path):
            dirs.append(str(PurePosixPath(source.path).parent))
    template = cfg.train.sft.get("chat_template_path")
    if isinstance(template, str) and template.startswith("/"):
        dirs.append(str(PurePosixPath(template).parent))
    for task in cfg.eval.tasks if cfg.eval is not None else ():
        if task.startswith("/"):  # a task file or a folder of them (a registry name is not a path)
            dirs.append(str(PurePosixPath(task).parent) if task.endswith((".yaml", ".yml")) else task)
    home = hf_home(cfg, container_env)
    if home:
        dirs.append(home)
    return _outermost(dirs)


def hf_home(cfg: RunConfig, container_env: dict[str, str] | None = None) -> str | None:
    """HF_HOME as the ranks get it (the container's env first, then cluster.env) when it is an absolute path: the
    Hugging Face caches, which slurmft mounts into the image at the same path."""
    if container_env is None:
        container_env = cfg.cluster.container.env if cfg.cluster.container else {}
    home = container_env.get("HF_HOME") or cfg.cluster.env.get("HF_HOME")
    return home if home and home.startswith("/") else None


def created_before_step(cfg: RunConfig, container: Container) -> list[tuple[str, str]]:
    """(directory, what it is) that the batch script creates on the host before the step: what slurmft mounts and
    owns that may not exist yet. Every runtime refuses a bind whose source does not exist, and only once the job
    has waited in the queue: pyxis 0.24 "--container-mounts: source path does not exist" (found with enroot 4.1),
    Charliecloud's bind, podman's --volume. HF_HOME is a cache (the libraries create it themselves without an
    image); the run directory exists from the submit on, and the model, data and chat template are inputs that
    validate checks."""
    home = hf_home(cfg, container.env)
    return [(home, "HF_HOME, the Hugging Face caches")] if home else []


def _outermost(dirs: list[str]) -> list[str]:
    """``dirs`` without repeats and without those inside another one (binding the parent shows them)."""
    out: list[str] = []
    for d in sorted({str(PurePosixPath(d)) for d in dirs}, key=lambda p: (len(PurePosixPath(p).parts), p)):
        if not any(_within(d, parent) for parent in out):
            out.append(d)
    return sorted(out)


def _within(path: str, parent: str) -> bool:
    return PurePosixPath(path) == PurePosixPath(parent) or PurePosixPath(parent) in PurePosixPath(path).parents


def _split(mount: str) -> tuple[str, str]:
    src, _, dst = mount.partition(":")
    return str(PurePosixPath(src)), str(PurePosixPath(dst or src))


def resolve(cfg: RunConfig, profile: ClusterProfile) -> Container | None:
    """The run's container (None: the ranks run on the host); a ConfigError names the field and the fix."""
    return _resolved(cfg, profile, _merged(cfg.cluster.container, profile.container), "cluster.container")


#: The jobs that may run in an image of their own (their section's ``container``): the jobs after consolidation.
OWN_CONTAINER_JOBS = ("serve", "eval")


def job_container(cfg: RunConfig, profile: ClusterProfile, kind: str) -> Container | None:
    """The image job ``kind`` runs in (None: on the host). The prepare, train and consolidation jobs run where the
    ranks run (:func:`resolve`); a job after consolidation too, unless its section says otherwise: ``container:
    false`` puts it on the host, a mapping gives it its own image, its keys over the run's container (vLLM and
    lm-eval pin their own versions, so a site may keep them in images of their own)."""
    section = cfg.model_job(kind) if kind in OWN_CONTAINER_JOBS else None
    own = section.container if section is not None else None
    if own is None:
        return resolve(cfg, profile)
    if own is False:
        return None
    return _resolved(cfg, profile, _merged(own, _merged(cfg.cluster.container, profile.container)),
                     f"{kind}.container")


def own_place_jobs(cfg: RunConfig, profile: ClusterProfile) -> dict[str, Container | None]:
    """The jobs after consolidation that run somewhere else than the ranks (``serve.container`` / ``eval.container``
    set: their own image, or the host beside a run in an image), each with its container (None: the host). The
    doctor's probe asks their interpreters in a step of its own there; the others' are asked by its ranks."""
    ranks = resolve(cfg, profile)
    return {kind: place for kind in OWN_CONTAINER_JOBS if cfg.model_job(kind) is not None
            and (place := job_container(cfg, profile, kind)) != ranks}


def _resolved(cfg: RunConfig, profile: ClusterProfile, spec: ContainerConfig | None, field: str) -> Container | None:
    """``spec`` (the merged section ``field``) checked and made a Container: runtime and image given somewhere,
    no mount hiding what the job needs."""
    if spec is None:
        return None
    also = "" if field == "cluster.container" else ", nor in cluster.container"
    where = f"(not in the run's {field}{also} nor in cluster profile {profile.name!r})"
    if spec.runtime is None:
        raise ConfigError(f"{field}.runtime: required {where}; set it to one of pyxis, apptainer, "
                          "charliecloud, podman")
    if spec.image is None:
        raise ConfigError(f"{field}.image: required {where}; set it to the image the job runs in "
                          "(docs/containers.md)")
    auto = [(d, d) for d in automatic_mounts(cfg, spec.env)]
    extra = [_split(m) for m in spec.mounts]
    problems = []
    for src, dst in extra:
        for needed, _ in auto:
            if src != dst and _within(needed, dst):
                problems.append(f"{field}.mounts: {src}:{dst} hides {needed} in the image (the job needs "
                                f"it at that path: {_why(cfg, needed)}); mount {src} elsewhere, or bind it at the same "
                                f"path ({src}:{src})")
    if problems:
        raise ConfigError(f"{field}.mounts: a mount hides what the job needs", problems)
    return Container(runtime=spec.runtime, image=spec.image, python=spec.python, mounts=_ordered([*auto, *extra]),
                     env=dict(spec.env), writable=spec.writable, workdir=spec.workdir or cfg.output_dir,
                     mount_home=spec.mount_home, field=field)


def _ordered(mounts: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """Each mount once, a same-path one inside another same-path one dropped (/fsx bound whole covers
    /fsx/data), parents before what lies inside them (a bind's destination must exist in the image: ch-run,
    enroot)."""
    same = set(_outermost([s for s, d in mounts if s == d]))
    kept = [(s, d) for s, d in dict.fromkeys(mounts) if s != d or s in same]
    return tuple(sorted(kept, key=lambda m: (len(PurePosixPath(m[1]).parts), m[1])))


def rebound(container: Container, instead_of: str, paths: list[str]) -> Container:
    """``container`` with the same-path mounts of ``paths`` in place of any mount inside ``instead_of``: the
    doctor's probe runs before the run directory exists, and binds its nearest existing parent and its own
    directory instead (a bind's source must exist), and starts in the first of ``paths`` when the working
    directory was inside ``instead_of``."""
    kept = [(s, d) for s, d in container.mounts if not _within(s, instead_of)]
    workdir = paths[0] if _within(container.workdir, instead_of) else container.workdir
    return replace(container, mounts=_ordered([*kept, *((p, p) for p in paths)]), workdir=workdir)


def _why(cfg: RunConfig, path: str) -> str:
    if _within(cfg.output_dir, path):
        return "the run directory"
    return "a model, data, task or cache directory of the run"


def image_problems(container: Container) -> list[str]:
    """What ``validate`` can check of the image on the login node: a path image exists and is readable."""
    if not container.image_is_path:
        return []
    import os

    path = Path(os.path.expanduser(container.image))
    if not path.exists():
        return [f"{container.field}.image: {container.image} does not exist ({container.runtime} reads it from the "
                "nodes' file system: give a path on the shared file system, or a registry reference the runtime "
                "pulls; docs/containers.md shows how to build one)"]
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        return [f"{container.field}.image: {container.image} is not readable by you (chmod a+r it, or give a "
                "copy you can read)"]
    return []


def hf_home_problems(cfg: RunConfig, container: Container) -> list[str]:
    """A job in an image needs HF_HOME (or the user's home mounted): the Hugging Face caches default to
    ~/.cache/huggingface, and the image's home is neither yours nor writable."""
    if container.mount_home or "HF_HOME" in {**cfg.cluster.env, **container.env}:
        return []
    who = "the ranks run" if container.field == "cluster.container" else f"the {container.field.split('.')[0]} job runs"
    return [f"cluster.env.HF_HOME: needed when {who} in an image: the Hugging Face caches (models, datasets) "
            "default to ~/.cache/huggingface, and the image's home is neither yours nor writable (datasets fails "
            "with 'Read-only file system'); set cluster.env.HF_HOME to a shared writable directory (it is mounted "
            f"at the same path), or {container.field}.mount_home: true"]


# ------------------------------------------------------------------ interpreters
def host_python(cfg: RunConfig) -> str:
    """The batch shell's interpreter on the host (rendezvous, requeue): ``cluster.python``, else the one running
    slurmft."""
    return cfg.cluster.job_python


def rank_python(cfg: RunConfig, profile: ClusterProfile) -> str:
    """The ranks' interpreter: the image's (``cluster.container.python``) in a container, else the host's. The
    prepare and consolidation jobs' one task runs where the ranks run."""
    return step_python(cfg, profile, "train")


def step_python(cfg: RunConfig, profile: ClusterProfile, kind: str) -> str:
    """The interpreter job ``kind``'s step starts (slurmft's entrypoint, through submitit): the image's
    (:func:`job_container`'s ``python``) when it runs in one, else the host's."""
    container = job_container(cfg, profile, kind)
    return container.python if container else host_python(cfg)


def tool_python(cfg: RunConfig, profile: ClusterProfile, kind: str) -> str:
    """The interpreter a job after consolidation runs vLLM / lm-eval in: ``serve.python`` / ``eval.python``, else
    its step's own (:func:`step_python`), the image's in a container: never a host path inside an image."""
    return cfg.model_job_python(kind, step_python(cfg, profile, kind))


# ------------------------------------------------------------------ the wrapped step
#: The exit code of a rank whose image lacks cluster.container.python (the shell's "command not found").
NO_PYTHON_EXIT = 127


def _python_check(container: Container) -> str:
    """``sh -c`` text: exec ``$0`` (the interpreter) with the rest, or say that the image lacks it."""
    return (f'command -v "$0" >/dev/null 2>&1 || {{ echo "[slurmft] {container.field}.python: $0 is not in the '
            f'{container.runtime} image {container.image}: install slurmft[train] in the image, or set '
            f'{container.field}.python to its interpreter (docs/containers.md)" >&2; exit {NO_PYTHON_EXIT}; }}; '
            'exec "$0" "$@"')
def wrap(container: Container, srun: list[str], command: str, env_names: list[str], gpus: bool,
         q: Callable[[object], str], *, host_python: str = "python", warning_signal: str = "USR2",
         exclusive: bool = True) -> tuple[list[str], str]:
    """The step's ``srun`` options and command, run in ``container``: ``srun`` options (unquoted) and the command
    line (quoted with ``q``, render's one quoting rule), with every name of ``env_names`` passed in explicitly.
    podman's command starts with ``host_python`` (quoted already) running slurmft/job/podman_task.py on each task:
    the task's own environment by name and its GPUs (``exclusive``: the job has its nodes to itself).
    ``command`` starts with the image's interpreter (:func:`rank_python`); a ``sh`` in the image checks that it is
    there before it execs it (same process: the signal still reaches the rank), so an image without it fails with
    a line naming the image, not a runtime's own "No such file"."""
    names = list(dict.fromkeys([*env_names, *container.env]))
    command = f"sh -c {q(_python_check(container))} {command}"
    runtime = container.runtime
    if runtime == "pyxis":
        opts = [f"--container-image={container.image}",
                f"--container-mounts={','.join(f'{s}:{d}' for s, d in container.mounts)}",
                f"--container-workdir={container.workdir}",
                "--container-mount-home" if container.mount_home else "--no-container-mount-home"]
        if container.writable:
            opts.append("--container-writable")
        opts.append(f"--container-env={','.join(names)}")
        return [*srun, *opts], command
    if runtime == "apptainer":
        # APPTAINERENV_NAME beats the image's own value; --env would split a value at its commas
        passed = " ".join(f'"APPTAINERENV_{n}=${{{n}}}"' for n in names)
        args = ["exec"]
        if gpus:
            args.append("--nv")
        if not container.mount_home:
            args.append("--no-home")
        if container.writable:
            args.append("--writable-tmpfs")
        for s, d in container.mounts:
            args += ["--bind", f"{s}:{d}"]
        args += ["--pwd", container.workdir, container.image]
        return srun, f"env {passed} apptainer {' '.join(q(a) for a in args)} {command}"
    if runtime == "charliecloud":
        # --env-no-expand: the value is the batch shell's, taken as it is
        passed = " ".join(f'"--set-env={n}=${{{n}}}"' for n in names)
        args = []
        for s, d in container.mounts:
            args.append(f"--bind={s}:{d}")
        if container.writable:
            args.append("--write")
        if container.mount_home:
            args.append("--home")
        args += [f"--cd={container.workdir}", container.image, "--"]
        return srun, f"ch-run --env-no-expand {passed} {' '.join(q(a) for a in args)} {command}"
    if runtime == "podman":
        # --ipc=host: each rank is its own container, and NCCL's shared-memory transport needs the node's ranks in
        # one IPC namespace; they share the node's /dev/shm (podman refuses --shm-size beside it)
        args = ["run", "--rm", "--init", "--sig-proxy=true", "--network=host", "--ipc=host"]
        if not container.writable:
            args.append("--read-only")
        for glob in TASK_ENV_GLOBS:
            args.append(f"--env={glob}")
        for n in names:
            args.append(f"--env={n}")  # a name alone: podman takes the value from its own environment
        for s, d in container.mounts:
            args.append(f"--volume={s}:{d}")
        args += [f"--workdir={container.workdir}", container.image]
        # each task adds its own: the user's exported variables by name, the GPUs Slurm gave it (podman_task.py)
        task = [f"--signal={warning_signal}", *([f"--gpus={'exclusive' if exclusive else 'shared'}"] if gpus else [])]
        return srun, (f"{host_python} -m slurmft.job.podman_task {' '.join(q(a) for a in task)} "
                      f"podman {' '.join(q(a) for a in args)} {command}")
    raise ConfigError(f"cluster.container.runtime: {runtime!r} has no rendering")  # config.RUNTIMES keeps it out
