"""Cluster profiles: NCCL/EFA/IB presets and hardware facts, kept as data in configs/clusters/."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from slurmft.config_cluster import ContainerConfig
from slurmft.config_loading import format_validation_error, read_yaml
from slurmft.config_paths import is_profile_file
from slurmft.config_values import ENV_KEY_RE, SECRET_KEY_RE, gloo_ifname_problem
from slurmft.errors import ConfigError
from slurmft.resources import data_dir

if TYPE_CHECKING:
    from slurmft.config import RunConfig

DEFAULT_CHECKPOINT_WRITE_GB_PER_S = 1.0


class EnvVar(BaseModel):
    """One environment variable and why it is set."""

    model_config = ConfigDict(extra="forbid")
    value: str = Field(..., description="Value (always quoted in the script).")
    reason: str = Field(..., min_length=3, description="One line: why this variable is set.")

    @field_validator("value", mode="before")
    @classmethod
    def _str(cls, v: object) -> str:
        return str(v)


class GPUSpec(BaseModel):
    """The GPU model of the profile (for `slurmft estimate`)."""

    model_config = ConfigDict(extra="forbid")
    type: str = Field(..., description="GPU model, e.g. A100-80GB.")
    memory_gb: float = Field(..., gt=0, description="Memory per GPU in GB (10^9 bytes).")
    bf16_tflops: float | None = Field(None, gt=0, description="Dense bf16 peak, for MFU.")


class ClusterProfile(BaseModel):
    """A cluster profile file."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = Field(..., description="What stack this profile is for.")
    gpu: GPUSpec
    node_memory_gb: float = Field(..., gt=0, description="CPU RAM per node in GB.")
    gres_gpu: bool = Field(True, description="Request GPUs with --gpus-per-node (false: not at all).")
    checkpoint_write_gb_per_s: float = Field(
        DEFAULT_CHECKPOINT_WRITE_GB_PER_S, gt=0,
        description="GB/s one node writes to the checkpoint filesystem (10^9 bytes). The projected save time is "
        "checkpoint bytes / (nodes x this); validate/submit warn when preemption.lead_time_s is shorter. Default "
        f"{DEFAULT_CHECKPOINT_WRITE_GB_PER_S:g}: a conservative shared-filesystem figure; measure your checkpoint filesystem's write speed.",
    )
    checkpoint_write_gb_per_s_total: float | None = Field(
        None, gt=0,
        description="GB/s the checkpoint filesystem takes from all nodes together (10^9 bytes): a shared "
        "filesystem's aggregate (e.g. FSx for Lustre's provisioned throughput) caps a many-node save, whose projected "
        "time is then checkpoint bytes / min(nodes x checkpoint_write_gb_per_s, this). Unset: no cap, the projected "
        "save shrinks with every node added (64 nodes at the default: 64 GB/s).",
    )
    env: dict[str, EnvVar] = Field(default_factory=dict)
    container: ContainerConfig | None = Field(
        None, description="The site's container defaults (runtime, image, mounts, ...): every run on this profile "
        "runs its ranks in it; a run's cluster.container overrides field by field (docs/containers.md).")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, EnvVar]) -> dict[str, EnvVar]:
        for key in v:
            if not ENV_KEY_RE.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if SECRET_KEY_RE.search(key):
                raise ValueError(f"{key} looks like a secret; profiles must not carry secrets")
        if "GLOO_SOCKET_IFNAME" in v and (problem := gloo_ifname_problem(v["GLOO_SOCKET_IFNAME"].value)):
            raise ValueError(problem)
        return v


def profile_names() -> list[str]:
    """Names of the profiles that ship with slurmft."""
    return sorted(p.stem for p in (data_dir("configs") / "clusters").glob("*.yaml"))


def load_profile(name_or_path: str) -> ClusterProfile:
    """Load a shipped profile by name, or the user's own profile file by path."""
    path, data = _profile_data(name_or_path)
    try:
        return ClusterProfile.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"cluster.profile: {path} is not a valid profile", format_validation_error(err)) from None


def machine_memory_gb() -> float:
    """This machine's physical memory in GB (10^9 bytes, as ``node_memory_gb``)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def on_this_machine(cfg: RunConfig) -> bool:
    """Whether ``cfg`` is a local run (``executor: local``, or ``auto`` without sbatch) that names no profile: its ranks
    run on this machine, which is what ``estimate`` and ``validate`` describe, not the default profile's node."""
    from slurmft.config import Executor

    return "profile" not in cfg.cluster.model_fields_set and cfg.resolved_executor == Executor.LOCAL


def profile_for_run(cfg: RunConfig) -> ClusterProfile:
    """``cfg``'s cluster profile. A local run that names no profile (:func:`on_this_machine`) runs its ranks on this
    machine: the default profile's 512 GB node would have ``estimate`` and ``validate`` judge a run that needs more RAM
    than this machine has as fitting, so its ``node_memory_gb`` is this machine's. A profile the config names is taken
    as written (a local rehearsal of a cluster's run)."""
    profile = load_profile(cfg.cluster.profile)
    if not on_this_machine(cfg):
        return profile
    return profile.model_copy(update={"node_memory_gb": round(machine_memory_gb(), 1)})


def _profile_data(name_or_path: str) -> tuple[Path, dict[str, object]]:
    """The profile file and its mapping, on top of its ``base:`` profile's (a shipped name or a path), on top of that
    one's base, and so on: the base's variables stay unless the file sets them again, every other key of the file
    replaces the base's. The container form of a network profile (aws-efa-pyxis) carries the same NCCL/EFA values
    this way, once."""
    files: list[Path] = []  # the profile file, its base, its base's base, ...
    data: dict[str, object] = {}
    name: object = name_or_path
    while name is not None:
        if not isinstance(name, str):
            raise ConfigError(f"cluster.profile: {files[-1]}: base: must name a profile (e.g. aws-efa), not {name!r}")
        path = _profile_path(name)
        if path in files:
            raise ConfigError(f"cluster.profile: {files[-1]}: base: {name} leads back to itself")
        files.append(path)
        layer = read_yaml(path)
        name = layer.pop("base", None)
        if len(files) == 1:
            data = layer
        else:  # what was read so far on top of its base, this layer
            env = {**(layer.get("env") or {}), **(data.get("env") or {})}  # type: ignore[dict-item]
            data = {**layer, **data, "env": env}
    return files[0], data


def _profile_path(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if not is_profile_file(name_or_path):
        path = data_dir("configs") / "clusters" / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ConfigError(
                f"cluster.profile: unknown profile {name_or_path!r}; "
                f"use one of {', '.join(profile_names())} or a path to your own profile .yaml"
            )
    elif not path.is_file():
        raise ConfigError(f"cluster.profile: profile file {str(path)!r} does not exist")
    return path


def runs_on_gpu(cfg: RunConfig, profile: ClusterProfile) -> bool:
    """GPU ranks unless the allocation has no GPUs or the profile's GPUs are fake (the CPU test cluster)."""
    gpu_type = profile.gpu.type.lower()
    fake = "fake" in gpu_type or gpu_type in ("none", "cpu")
    return cfg.resources.gpus_per_node > 0 and profile.gres_gpu and not fake
