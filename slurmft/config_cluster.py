"""The sections of run.yaml that say where and how the jobs run: the cluster (and the image the ranks run in),
the train job's allocation, Slurm's warning signal, and the prepare and consolidation jobs' allocations.

Part of the run config's schema (:class:`slurmft.config.RunConfig` holds these sections); what these
sections say becomes the batch scripts' ``#SBATCH`` lines, environment and setup, so every value is one
of the checked types of :mod:`slurmft.config_values`.
"""

from __future__ import annotations

import re
import sys

from pydantic import Field, field_validator

from slurmft.config_values import (
    CONSTRAINT_RE,
    IMAGE_RE,
    MOUNT_PATH_RE,
    PATH_RE,
    RUNTIMES,
    SIGNALS,
    Section,
    SlurmMem,
    SlurmTime,
    SlurmWord,
    check_value,
    checked_env,
    mount_problem,
    no_control_chars,
    runtime_choice,
    secret_in_line,
)


class ContainerConfig(Section):
    """The image the ranks run in (docs/containers.md); absent = the ranks run on the host (cluster.python).

    The batch script, cluster.setup, the requeue and every Slurm command stay on the host; only the rank step and
    the prepare and consolidation jobs' Python run in the image. A cluster profile may carry the site's defaults
    (runtime, image, mounts); what is written here wins, and mounts add to the profile's.
    """

    runtime: str | None = Field(
        None, description=f"Container runtime: {', '.join(RUNTIMES)} (default: the cluster profile's).")
    image: str | None = Field(
        None,
        description="The image: pyxis an enroot URI (nvcr.io#nvidia/pytorch:24.05-py3) or a .sqsh path; apptainer a "
        ".sif path or docker://...; charliecloud an image directory or SquashFS path; podman a reference (default: "
        "the cluster profile's). A path must exist and be readable (validate checks it); a relative one is relative to "
        "run.yaml's folder (on the command line: the current directory), ~ is expanded.")
    mounts: list[str] = Field(
        default_factory=list,
        description="Extra bind mounts, SRC:DST with absolute paths (SRC alone: the same path inside). The run "
        "directory, the model and tokenizer directories, the data files' directories and HF_HOME (cluster.env) are "
        "mounted automatically at the same paths.")
    python: str = Field(
        "python",
        description="The image's interpreter, with slurmft[train] installed. A bare name is looked up on the image's "
        "PATH (srun resolves an absolute path on the host first: pyxis#104).")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra variables for the ranks in the image (exported by the batch script and passed in "
        "explicitly, like every variable slurmft sets: an image's own ENV would otherwise win).")
    writable: bool = Field(
        False, description="A writable root file system in the image (pyxis --container-writable, apptainer "
        "--writable-tmpfs, charliecloud --write; podman gets --read-only unless this is true).")
    workdir: str | None = Field(None, description="Working directory in the image (default: the run directory).")
    mount_home: bool = Field(
        False, description="Mount the user's home directory (pyxis --container-mount-home, apptainer without "
        "--no-home, charliecloud --home). Off: a ~/.cache or ~/.local in the home cannot shadow the image's packages.")

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, v: str | None) -> str | None:
        return None if v is None else runtime_choice(v)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        return None if v is None else check_value(IMAGE_RE, v, "image path or reference (no spaces, ',' or shell characters)")

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for mount in v:
            if problem := mount_problem(mount):
                raise ValueError(problem)
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        return check_value(PATH_RE, v, "interpreter (a name on the image's PATH or an absolute path in the image)")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return checked_env(v)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        return None if v is None else check_value(MOUNT_PATH_RE, v, "absolute directory in the image")


class ClusterConfig(Section):
    """Where the job runs: the cluster profile and the scheduler account fields."""

    profile: str = Field(
        "ethernet",
        description="Cluster profile: a name from configs/clusters/ (aws-efa, aws-efa-legacy, infiniband, "
        "ethernet, local-test) or a path to your own YAML profile.",
    )
    partition: SlurmWord | None = Field(None, description="Slurm partition (--partition).")
    account: SlurmWord | None = Field(None, description="Slurm account (--account).")
    qos: SlurmWord | None = Field(None, description="Slurm QOS (--qos).")
    constraint: str | None = Field(None, description="Slurm node constraint (--constraint), e.g. 'a100&ib'.")
    time: SlurmTime = Field("04:00:00", description="Wall-clock limit of the train job, [D-]HH:MM:SS.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables for the job (added after the profile's; never secrets: "
        "tokens are read from the submitting environment at run time).",
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines run before srun (module load, source venv). They are your own commands and "
        "are written verbatim, one per line (so a line setting a secret such as HF_TOKEN to a literal value is "
        "refused: export it in the shell that runs submit, or read it at run time).",
    )
    python: str | None = Field(
        None,
        description="Python interpreter on the compute nodes (default: the one running slurmft submit). With a "
        "container it is the batch script's, on the host (rendezvous, requeue: slurmft without the training stack "
        "is enough); the ranks use cluster.container.python.",
    )
    container: ContainerConfig | None = Field(
        None, description="Run the ranks in an image (docs/containers.md); absent: on the host, or in the cluster "
        "profile's container when it has one.")
    master_addr: str | None = Field(
        None,
        description="Override the rendezvous address (default: NodeAddr of the allocation's first node).",
    )

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v: str | None) -> str | None:
        return None if v is None else check_value(CONSTRAINT_RE, v, "Slurm constraint expression")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return checked_env(v)

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        for line in v:
            no_control_chars(line, "a setup line")
            if name := secret_in_line(line):
                raise ValueError(
                    f"{line!r} sets {name} to a secret; setup lines are written into the sbatch scripts as they are. "
                    f"Export {name} in the shell that runs 'slurmft submit' instead (the job inherits it), or read "
                    f"it at run time: export {name}=$(cat ~/.secrets/{name.lower()})")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        return None if v is None else check_value(PATH_RE, v, "interpreter path (no spaces or shell characters)")

    @field_validator("master_addr")
    @classmethod
    def _addr(cls, v: str | None) -> str | None:
        return None if v is None else check_value(re.compile(r"^[A-Za-z0-9.:-]+$"), v, "host name or IP address")

    @property
    def job_python(self) -> str:
        """The interpreter the job runs on the compute nodes: ``cluster.python``, else the one running slurmft
        (the one place this is decided: the scripts, the submitit executors and ``validate``'s check use it)."""
        return self.python or sys.executable


class ResourcesConfig(Section):
    """The allocation of the train job. One Slurm task per GPU."""

    nodes: int = Field(2, ge=1, le=4096, description="Number of nodes.")
    gpus_per_node: int = Field(8, ge=0, le=64, description="GPUs per node; one task (rank) per GPU.")
    tasks_per_node: int | None = Field(
        None, ge=1, le=256, description="Ranks per node (default: gpus_per_node, or 1 without GPUs)."
    )
    cpus_per_task: int = Field(8, ge=1, le=1024, description="CPU cores per rank (--cpus-per-task).")
    mem: SlurmMem | None = Field(None, description="Memory per node (--mem), e.g. '0' for all, '500G'.")
    exclusive: bool = Field(True, description="Request whole nodes (--exclusive).")

    @property
    def ranks_per_node(self) -> int:
        """Tasks per node: explicit, else one per GPU, else one."""
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.ranks_per_node


class PreemptionConfig(Section):
    """Slurm's warning signal before the time limit or a preemption."""

    signal: str = Field("USR2", description="Signal Slurm sends ahead of the end (--signal).")
    lead_time_s: int = Field(300, ge=30, le=86400, description="Seconds of warning before the end.")
    max_requeues: int = Field(5, ge=0, le=1000, description="Requeue at most N times, then fail.")

    @field_validator("signal")
    @classmethod
    def _signal(cls, v: str) -> str:
        v = v.upper().removeprefix("SIG")
        if v not in SIGNALS:
            raise ValueError(f"unsupported signal {v!r}; use one of {', '.join(SIGNALS)}")
        return v


class ConsolidateResources(Section):
    """The consolidation job's allocation (CPU is enough)."""

    cpus_per_task: int = Field(4, ge=1, le=1024, description="CPU cores.")
    mem: SlurmMem | None = Field("32G", description="Memory (--mem).")
    time: SlurmTime = Field("02:00:00", description="Time limit.")
    partition: SlurmWord | None = Field(None, description="Partition (default: the train job's).")


class PrepareResources(Section):
    """The prepare job's allocation: CPUs only, no GPU is asked for."""

    cpus_per_task: int = Field(8, ge=1, le=1024, description="CPU cores; data.num_proc defaults to this.")
    mem: SlurmMem | None = Field("32G", description="Memory (--mem).")
    time: SlurmTime = Field("04:00:00", description="Time limit.")
    partition: SlurmWord | None = Field(None, description="Partition (default: the train job's).")
