"""The run config (``run.yaml``): one pydantic model per section, unknown keys rejected.

Every string that can reach a shell script is validated here (and quoted again at render time),
so a bad value fails at ``submit`` with the dotted field name, never inside a job.
"""

from __future__ import annotations

import math
import os
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from slurmft.errors import ConfigError, RunDirError
from slurmft.precision import PRECISIONS
from slurmft.units import SIZE_RE

# ------------------------------------------------------------------ shell-safe value patterns
NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
SLURM_WORD_RE = re.compile(r"^[A-Za-z0-9._-]+$")  # partition, account, qos
CONSTRAINT_RE = re.compile(r"^[A-Za-z0-9._,:&|\[\]*()-]+$")
TIME_RE = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")  # [D-]HH[:MM[:SS]] or minutes
MEM_RE = re.compile(r"^\d+[KMGT]?$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PATH_RE = re.compile(r"^[A-Za-z0-9._/~+@=,-]+$")  # no spaces, quotes, $, `, ;, |, &, <, >
SECRET_KEY_RE = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIALS?)($|_)", re.I)
SIGNALS = ("USR1", "USR2", "TERM", "INT", "URG")


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 numbers.

    PyYAML follows YAML 1.1: ``16:00:00`` is a base-60 integer (57600) and ``1e-8`` (no dot) is a
    string. Neither is what anyone writing a run.yaml means: here ``16:00:00`` stays the string it
    looks like, and ``1e-8`` is a float, in the file and in ``key=value`` overrides alike.
    """


YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
               r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def load_yaml_text(text: str) -> Any:
    """Parse YAML text with :class:`YamlLoader` (YAML 1.2 numbers)."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass


def _check(pattern: re.Pattern[str], value: str, what: str) -> str:
    if not pattern.match(value):
        raise ValueError(f"{value!r} is not a valid {what}")
    return value


def _matching(pattern: re.Pattern[str], what: str) -> AfterValidator:
    """A validator that accepts strings matching ``pattern`` and names ``what`` was expected otherwise."""
    return AfterValidator(lambda v: _check(pattern, v, what))


# One type per kind of Slurm value, so every field of that kind says the same thing when it is wrong.
SlurmWord = Annotated[str, _matching(SLURM_WORD_RE, "Slurm name (letters, digits, . _ -)")]
SlurmTime = Annotated[str, _matching(TIME_RE, "Slurm time limit (use [D-]HH:MM:SS, e.g. 04:00:00 or 1-12:00:00)")]
SlurmMem = Annotated[str, _matching(MEM_RE, "Slurm memory size (e.g. 0, 64G, 500000M)")]
Size = Annotated[str, _matching(SIZE_RE, "size (e.g. 5GB, 500MB)")]

#: train.precision's choices: ``auto`` and the modes of slurmft/precision.py, listed once there.
PrecisionName = Literal[("auto", *PRECISIONS)]  # type: ignore[valid-type]

IFNAME_RE = re.compile(r"^[A-Za-z0-9_.:@-]+$")


def gloo_ifname_problem(value: str) -> str | None:
    """Why ``value`` is not a GLOO_SOCKET_IFNAME gloo can use (None: it is one).

    gloo takes a comma-separated list of interface names and binds one device to each (torch's
    ProcessGroupGloo); NCCL_SOCKET_IFNAME's ``^`` exclusion and ``=`` exact-match prefixes are not
    understood and fail at process-group creation ("Unable to find address for: ^docker").
    """
    names = value.split(",")
    if all(IFNAME_RE.match(n) for n in names):
        return None
    return (f"GLOO_SOCKET_IFNAME={value!r}: gloo takes interface names (e.g. eth0, or ens5,ens6), not NCCL's "
            "'^'/'=' patterns; leave it unset and the job binds gloo to the interface that reaches MASTER_ADDR")


def _no_control_chars(value: str, what: str) -> str:
    if any(ord(c) < 32 and c != "\t" for c in value) or "\x7f" in value:
        raise ValueError(f"{what} must not contain newlines or control characters")
    return value


class Executor(str, Enum):
    """Where the jobs run."""

    AUTO = "auto"
    SLURM = "slurm"
    LOCAL = "local"


class _Section(BaseModel):
    # A number where a string is wanted (``mem: 0``, ``cluster.env.X: 1``, ``time: 240``) means its digits.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


#: The container runtimes slurmft renders the rank step for (docs/containers.md).
RUNTIMES = ("pyxis", "apptainer", "charliecloud", "podman")
#: An image: a file path or a reference (nvcr.io#nvidia/pytorch:24.05-py3, docker://..., localhost/sft:1).
IMAGE_RE = re.compile(r"^[A-Za-z0-9._/~+@=:#-]+$")
#: One side of a mount: an absolute path without the separators the runtimes split on (',' and ':').
MOUNT_PATH_RE = re.compile(r"^/[A-Za-z0-9._/~+@=-]*$")


def mount_problem(mount: str) -> str | None:
    """Why ``mount`` is not an absolute ``SRC:DST`` (or ``SRC``, bound at the same path) every runtime accepts."""
    parts = mount.split(":")
    if len(parts) > 2:
        return (f"{mount!r}: expected SRC:DST (two absolute paths); pyxis and Apptainer split mounts on ':' and ',', "
                "so neither may appear inside a path")
    for side, path in zip(("the source", "the destination"), parts, strict=False):
        if not path.startswith("/"):
            return (f"{mount!r}: {side} {path!r} is not an absolute path (a mount is bound on every node, where a "
                    f"relative path means nothing); write it from / (e.g. /shared/data:/data)")
        if not MOUNT_PATH_RE.match(path):
            return f"{mount!r}: {side} {path!r} has characters a mount cannot carry (spaces, ',', quotes, $)"
    return None


class ContainerConfig(_Section):
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
        return None if v is None else _check(IMAGE_RE, v, "image path or reference (no spaces, ',' or shell characters)")

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
        return _check(PATH_RE, v, "interpreter (a name on the image's PATH or an absolute path in the image)")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _checked_env(v)

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        return None if v is None else _check(MOUNT_PATH_RE, v, "absolute directory in the image")


def runtime_choice(value: str) -> str:
    """``value`` as one of :data:`RUNTIMES`, or a ValueError with a did-you-mean."""
    import difflib

    name = value.strip().lower()
    aliases = {"enroot": "pyxis", "singularity": "apptainer", "ch-run": "charliecloud", "podman-hpc": "podman"}
    if name in RUNTIMES:
        return name
    if name in aliases:
        raise ValueError(f"unknown runtime {value!r}; did you mean {aliases[name]!r}? (use one of {', '.join(RUNTIMES)})")
    close = difflib.get_close_matches(name, RUNTIMES, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown runtime {value!r}; {hint}use one of {', '.join(RUNTIMES)}")


def _checked_env(v: dict[str, str]) -> dict[str, str]:
    """Variable names, no secrets, no control characters (cluster.env and cluster.container.env)."""
    for key, value in v.items():
        _check(ENV_KEY_RE, key, "environment variable name")
        if SECRET_KEY_RE.search(key):
            raise ValueError(
                f"{key} looks like a secret; do not put secrets in run.yaml (they would be written into "
                f"the sbatch script). Export {key} in the shell that runs 'slurmft submit' instead."
            )
        _no_control_chars(str(value), f"env value of {key}")
        if key == "GLOO_SOCKET_IFNAME" and (problem := gloo_ifname_problem(str(value))):
            raise ValueError(problem)
    return v


class ClusterConfig(_Section):
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
        "are written verbatim, one per line.",
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
        return None if v is None else _check(CONSTRAINT_RE, v, "Slurm constraint expression")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _checked_env(v)

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        for line in v:
            _no_control_chars(line, "a setup line")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        return None if v is None else _check(PATH_RE, v, "interpreter path (no spaces or shell characters)")

    @field_validator("master_addr")
    @classmethod
    def _addr(cls, v: str | None) -> str | None:
        return None if v is None else _check(re.compile(r"^[A-Za-z0-9.:-]+$"), v, "host name or IP address")

    @property
    def job_python(self) -> str:
        """The interpreter the job runs on the compute nodes: ``cluster.python``, else the one running slurmft
        (the one place this is decided: the scripts, the submitit executors and ``validate``'s check use it)."""
        return self.python or sys.executable


class ResourcesConfig(_Section):
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


class ModelConfig(_Section):
    """The model to fine-tune."""

    name_or_path: str = Field(..., description="Hugging Face hub id or local directory with config.json.")
    tokenizer: str | None = Field(None, description="Tokenizer id or path (default: name_or_path).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Compute dtype. Follows train.precision (bf16-* = bfloat16, fp32 = float32); when only this "
        "is set it picks the precision (bfloat16 = bf16-mixed, float16 = fp16-mixed, float32 = fp32). Setting "
        "both to disagreeing values is an error.",
    )
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto", description="auto = flash_attention_2 on a GPU when the architecture supports it, transformers accepts the installed flash-attn (is_flash_attn_2_available) and it imports, else sdpa where the architecture supports it, else eager (logged, with why). flash_attention_2 = that or a setup error; an explicit choice the architecture refuses is refused by validate."
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")


class DatasetSource(_Section):
    """One data source; several are mixed by weight."""

    path: str = Field(..., description="Hub id or local .json/.jsonl/.csv/.parquet file.")
    split: str = Field("train", description="Split to read.")
    weight: float = Field(1.0, gt=0, description="Mixing weight (relative sampling probability).")
    format: Literal["auto", "messages", "sharegpt", "lima", "guanaco", "alpaca", "prompt_completion",
                    "preference"] = Field(
        "auto",
        description="Record layout: messages (role/content list), sharegpt (conversations: from/value list), lima "
        "(conversations: [str]), guanaco (text with '### Human:' / '### Assistant:'), alpaca (instruction, "
        "input, output), prompt_completion (prompt, completion), preference (dpo: only; chosen, rejected and an "
        "optional prompt, strings or conversations), or auto-detect.",
    )
    name: str | None = Field(None, description="Hub dataset config name (subset).")
    revision: str | None = Field(
        None, description="Hub dataset revision (branch, tag or commit) to read; unset: the newest, whose commit the "
        "prepare job records, so that a resume after a new push is refused instead of mixing two versions.",
    )
    text_field: str | None = Field(None, description="Column holding the text/conversation if not the default.")
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Your column names for the format's fields, e.g. {prompt: question, completion: answer} or "
        "{instruction: task, output: response}; keys: messages, conversations, text, instruction, input, output, "
        "prompt, completion, chosen, rejected.",
    )

    @field_validator("columns")
    @classmethod
    def _columns(cls, v: dict[str, str]) -> dict[str, str]:
        known = ("messages", "conversations", "text", "instruction", "input", "output", "prompt", "completion",
                 "chosen", "rejected")
        for key in v:
            if key not in known:
                raise ValueError(f"unknown field {key!r}; map any of {', '.join(known)} to your column names")
        return v


class DataConfig(_Section):
    """Training data."""

    datasets: list[DatasetSource] = Field(..., min_length=1, description="Sources to mix.")
    max_seq_length: int = Field(2048, ge=8, le=1_048_576, description="Tokens per sequence (packed).")
    packing: bool = Field(True, description="Pack examples into max_seq_length sequences.")
    assistant_only_loss: bool = Field(True, description="Compute the loss on assistant tokens only.")
    num_proc: int | None = Field(None, ge=1, description="Processes for dataset preprocessing.")


DEFAULT_MAX_STEPS = 500


class TrainConfig(_Section):
    """Optimisation settings; anything TRL's SFTConfig accepts can go under ``sft``."""

    max_steps: int | None = Field(
        None, ge=1, description="Optimizer steps (500 when neither max_steps nor epochs is set)."
    )
    epochs: float | None = Field(
        None,
        gt=0,
        le=1000,
        description="Passes over the data instead of max_steps: the job computes the steps from the packed "
        "dataset at start and records them in the run directory (plan.json). train.max_steps=N on the command "
        "line replaces it (a smoke test).",
    )
    per_device_batch_size: int = Field(1, ge=1, description="Micro-batch per rank.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(5e-5, gt=0, lt=1, description="Peak learning rate.")
    lr_scheduler: str = Field("cosine", description="transformers scheduler name.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps used for warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    precision: PrecisionName = Field(
        "auto",
        description="bf16-mixed: fp32 sharded weights and AdamW state, bf16 compute, fp32 reduce (16 bytes/"
        "parameter). bf16-true: bf16 weights, gradients and AdamW state, bf16 compute and reduce (8 bytes/"
        "parameter). fp32: all fp32. fp16-mixed: as bf16-mixed with fp16 compute. auto: bf16-mixed on GPU, fp32 "
        "on CPU (or what model.dtype implies). See docs/estimate.md for what fits.",
    )
    optimizer: Literal["adamw", "adamw-stochastic-rounding"] = Field(
        "adamw",
        description="adamw: torch.optim.AdamW (fused where supported). adamw-stochastic-rounding: torchao's AdamW "
        "with bf16 stochastic rounding of the weight update (train.precision=bf16-true only; needs torchao).",
    )
    seed: int = Field(42, ge=0, description="Random seed.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every N steps.")
    report_to: list[str] = Field(default_factory=list, description=(
        "Extra loggers: tensorboard (into RUN_DIR/tensorboard), wandb (one W&B run across every requeue and "
        "resume; docs/watching.md)."))
    sft: dict[str, Any] = Field(default_factory=dict, description="Extra keys passed to trl.SFTConfig as-is.")

    @field_validator("lr_scheduler")
    @classmethod
    def _sched(cls, v: str) -> str:
        return _check(NAME_RE, v, "scheduler name")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainConfig:
        if self.epochs is not None and self.max_steps is not None:
            raise ValueError(
                f"train.epochs ({self.epochs}) and train.max_steps ({self.max_steps}) are both set; keep one "
                "(epochs: steps are computed from the packed data; max_steps: a fixed count)"
            )
        if self.epochs is None and self.max_steps is None:
            self.__dict__["max_steps"] = DEFAULT_MAX_STEPS  # not an assignment: that would re-run this check
        return self


class FSDPConfig(_Section):
    """FSDP2 sharding."""

    enabled: bool = Field(
        True,
        description="Shard with FSDP2 (full shard). false only models an unsharded run in `slurmft estimate`; "
        "`slurmft submit` refuses it (the trainer always shards).",
    )
    reshard_after_forward: bool = Field(True, description="Free gathered parameters after forward (ZeRO-3).")
    activation_checkpointing: bool = Field(True, description="Recompute activations in backward.")
    cpu_offload: bool = Field(False, description="Offload parameters to CPU.")
    reduce_dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description="Dtype gradients are reduce-scattered in (default: follows train.precision: float32 for "
        "bf16-mixed and fp32, bfloat16 for bf16-true). bfloat16 with bf16-mixed is the setting of accelerate's "
        "FSDP1 bf16 policy: half the reduce-scatter buffer and traffic, less exact sums.",
    )
    wrap_class: str | None = Field(None, description="Decoder layer class to wrap (default: from the model).")
    replicate_across_nodes: bool = Field(
        False,
        description="HSDP: shard over the ranks of each node and keep one full replica per node (a 2-D mesh, "
        "nodes x ranks per node). Parameter all-gathers and gradient reduce-scatters stay inside a node; only a "
        "gradient all-reduce crosses the inter-node network. Needs the model's training state to fit one node: "
        "`slurmft estimate` shows both layouts and recommends this when it fits. With resources.nodes=1 it is "
        "plain FSDP.",
    )


class CheckpointConfig(_Section):
    """Sharded (torch.distributed.checkpoint) checkpoints."""

    # ``async`` is a Python keyword: the field is ``asynchronous`` in code, ``async`` in YAML and when written back.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True,
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    every_steps: int = Field(100, ge=1, description="Save a sharded checkpoint every N steps; the last step is always saved.")
    keep_last: int = Field(2, ge=1, description="Keep the N newest complete checkpoints.")
    asynchronous: bool = Field(
        True, alias="async",
        description="Periodic saves are staged to CPU memory at the step boundary and written in the background "
        "while training goes on (one save in flight; COMPLETE only once every rank's write succeeded). false: "
        "training waits for every save. The final save and the save on the warning signal are always synchronous.",
    )
    max_failed_saves: int = Field(
        3, ge=1, le=1000,
        description="Stop the run when this many asynchronous saves in a row failed (a failed save leaves no "
        "COMPLETE and training goes on; the next save retries).",
    )


class PreemptionConfig(_Section):
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


MODULE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
ALL_LINEAR = "all-linear"


class LoraConfig(_Section):
    """LoRA adapters (PEFT's ``LoraConfig`` meanings, without its ``lora_`` prefix); absent = full fine-tuning."""

    r: int = Field(16, description="Adapter rank: the inner dimension of B·A (typical 8-64).")
    alpha: float = Field(32.0, gt=0, description="Scaling numerator: the update is (alpha / r)·B·A, or (alpha / sqrt(r))·B·A with use_rslora (PEFT's lora_alpha).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (PEFT's lora_dropout); "
                           "exact under activation checkpointing (the recompute replays the forward's masks).")
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA (PEFT's use_rslora): the update is "
                             "(alpha / sqrt(r))·B·A, for the adapter and the merged model alike.")
    use_dora: bool = Field(False, description="DoRA (PEFT's use_dora): not supported, only false is accepted "
                           "(docs/lora.md says why).")
    target_modules: Literal["all-linear"] | list[str] = Field(
        ALL_LINEAR,
        description="Modules that get an adapter: all-linear (every linear layer of the decoder, not the output "
        "head; in mixture-of-experts models the fused experts and the router stay frozen: docs/lora.md) or a list "
        "of module names, e.g. [q_proj, v_proj] (a name matches a module whose name ends with it).",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full beside the adapters and saved with them, e.g. [embed_tokens, lm_head] "
        "when new tokens are added.",
    )

    @field_validator("r")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"the adapter rank must be at least 1 (typical: 8 to 64; got {v}); set lora.r=16")
        return v

    @field_validator("use_dora")
    @classmethod
    def _no_dora(cls, v: bool) -> bool:
        if v:
            raise ValueError("DoRA is not supported: its magnitude vector starts as the norms of the base weight, "
                             "which PEFT computes when it adds the adapter (on the meta device here, before any weight "
                             "is read), and slurmft's merge does not apply it; remove lora.use_dora (plain LoRA, or "
                             "lora.use_rslora: true)")
        return v

    @field_validator("target_modules", "modules_to_save", mode="before")
    @classmethod
    def _module_names(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str) and v != ALL_LINEAR:
            v = [v]  # one name written without brackets
        if isinstance(v, list):
            if not v and info.field_name == "target_modules":
                raise ValueError("an empty list adapts nothing; list module names (e.g. [q_proj, v_proj]) or use "
                                 "all-linear")
            for name in v:
                if not isinstance(name, str) or not MODULE_NAME_RE.match(name):
                    raise ValueError(f"{name!r} is not a module name (letters, digits, _ and .; e.g. q_proj)")
        return v

    @property
    def scaling(self) -> float:
        """The factor of B·A in the forward and the merged weight (:func:`lora_scaling`)."""
        return lora_scaling(self.alpha, self.r, self.use_rslora)


#: The input and output embeddings as ``target_modules`` names them (Llama-style models).
EMBEDDING_MODULES = ("embed_tokens", "lm_head")


def tied_target_problem(target: str, model: str) -> str:
    """Why an adapter on a tied input/output embedding is refused (the job and ``validate`` say the same)."""
    return (f"lora.target_modules: {target!r} is one of the tied input and output embeddings of {model} "
            "(tie_word_embeddings: one matrix used twice); an adapter there trains a change of one use only, which "
            "the merged model cannot hold. Leave it out (adapt the decoder layers: all-linear, or e.g. q_proj, v_proj)")


def lora_scaling(alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's rule (``LoraLayer.update_layer``): alpha / r, or alpha / sqrt(r) with use_rslora."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


class ConsolidateResources(_Section):
    """The consolidation job's allocation (CPU is enough)."""

    cpus_per_task: int = Field(4, ge=1, le=1024, description="CPU cores.")
    mem: SlurmMem | None = Field("32G", description="Memory (--mem).")
    time: SlurmTime = Field("02:00:00", description="Time limit.")
    partition: SlurmWord | None = Field(None, description="Partition (default: the train job's).")


class ConsolidateConfig(_Section):
    """Turn the final sharded checkpoint into a deployable Hugging Face model."""

    enabled: bool = Field(True, description="Chain a consolidation job after training (afterok).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Dtype of the saved model; auto = the training compute dtype (bfloat16 for bf16-mixed and "
        "bf16-true, float32 for fp32), as recorded in the checkpoint; for a LoRA run's merged model, auto = the "
        "base model's file dtype (its untouched weights stay bit for bit). LoRA adapters are saved as trained "
        "(float32).",
    )
    max_shard_size: Size = Field("5GB", description="Largest safetensors file, e.g. 5GB, 500MB.")
    merge: bool = Field(
        True,
        description="LoRA runs: also write the merged full model (W + scaling·B·A, streamed from the base "
        "model's files) into RUN_DIR/model/; false writes only the adapter (RUN_DIR/adapter/).",
    )
    resources: ConsolidateResources = Field(default_factory=ConsolidateResources)


class PrepareResources(_Section):
    """The prepare job's allocation: CPUs only, no GPU is asked for."""

    cpus_per_task: int = Field(8, ge=1, le=1024, description="CPU cores; data.num_proc defaults to this.")
    mem: SlurmMem | None = Field("32G", description="Memory (--mem).")
    time: SlurmTime = Field("04:00:00", description="Time limit.")
    partition: SlurmWord | None = Field(None, description="Partition (default: the train job's).")


class PrepareConfig(_Section):
    """Tokenize once: a CPU job before the train job prepares the data into RUN_DIR/prepared/ (docs/prepare.md)."""

    enabled: bool = Field(
        True,
        description="Chain a prepare job (CPU) before the train job (afterok): it loads, converts, tokenizes and "
        "packs the data with TRL's own preparation; the train job and every requeue and resume read the result. "
        "false: the train job prepares the data inside its allocation (small data, quick local runs).",
    )
    resources: PrepareResources = Field(default_factory=PrepareResources)


class DPOReference(str, Enum):
    """How a DPO run gets the reference model's log-probabilities."""

    AUTO = "auto"
    COPY = "copy"
    PRECOMPUTED = "precomputed"


class DPOConfig(_Section):
    """Direct preference optimisation (TRL's ``DPOTrainer``/``DPOConfig`` meanings); absent = supervised fine-tuning.

    A later method (KTO, ORPO, ...) is one more section like this one: RunConfig.method names the one set.
    """

    beta: float = Field(0.1, gt=0, description="Strength of the pull towards the reference model (TRL's beta): "
                        "higher stays closer to it.")
    loss_type: list[str] = Field(
        default_factory=lambda: ["sigmoid"],
        description="TRL's DPO loss: sigmoid (DPO), ipo, hinge, robust, ... (the names the installed TRL's "
        "DPOTrainer computes; validate lists them). A list combines several (TRL's loss_type list).",
    )
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Probability that a preference label is flipped "
                                   "(cDPO / robust DPO; TRL's label_smoothing).")
    reference: DPOReference = Field(
        DPOReference.AUTO,
        description="The frozen reference model: copy = a second copy of the starting model, loaded and "
        "FSDP2-sharded like the policy, without gradients or optimizer state; precomputed = no reference in memory "
        "while training: the train job's first attempt runs the starting model (the policy before step 1, "
        "dropout off) once over every pair and keeps the log-probabilities in RUN_DIR/reference_logps.safetensors, "
        "which every later attempt reads (TRL's precompute_ref_log_probs); auto = copy, or with a lora: section the "
        "base model with the adapters disabled (no second copy). The reference is never saved in a checkpoint: a "
        "resume rebuilds the copy from the model files.",
    )

    @property
    def precomputed(self) -> bool:
        """``reference: precomputed``: no reference model while training (the job and the estimate ask this)."""
        return self.reference == DPOReference.PRECOMPUTED

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]  # one name written without brackets
        if isinstance(v, list) and not v:
            raise ValueError("an empty list computes no loss; use sigmoid (DPO) or another of TRL's loss types")
        return v

    @field_validator("loss_type")
    @classmethod
    def _known_loss(cls, v: list[str]) -> list[str]:
        from slurmft.dpoopts import loss_type_problems

        problems = loss_type_problems(v, where="loss_type")
        if problems:
            raise ValueError("; ".join(p.removeprefix("loss_type: ") for p in problems))
        return v


class Method(str, Enum):
    """What the train job optimises: the section that selects it (none = sft)."""

    SFT = "sft"
    DPO = "dpo"


class RunConfig(_Section):
    """A whole run: the contents of run.yaml."""

    name: str = Field(..., description="Run name (job names, directories): letters, digits, . _ -")
    output_dir: str = Field(..., description="Run directory on the shared filesystem.")
    executor: Executor = Field(Executor.AUTO, description="slurm, local, or auto (slurm when sbatch exists).")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    consolidate: ConsolidateConfig = Field(default_factory=ConsolidateConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters on a frozen base model instead of every weight (docs/lora.md)."
    )
    dpo: DPOConfig | None = Field(
        None, description="Preference tuning with DPO on preference data (prompt/chosen/rejected) instead of "
        "supervised fine-tuning (docs/dpo.md)."
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check(NAME_RE, v, "run name (letters, digits, '.', '_', '-')")

    @field_validator("output_dir")
    @classmethod
    def _outdir(cls, v: str) -> str:
        return _check(PATH_RE, v, "path (no spaces, quotes or shell characters)")

    @model_validator(mode="after")
    def _cross(self) -> RunConfig:
        self._reconcile_precision()
        limit = slurm_time_seconds(self.cluster.time)
        if self.preemption.lead_time_s >= limit:
            raise ValueError(
                f"preemption.lead_time_s: {self.preemption.lead_time_s} s is not shorter than cluster.time "
                f"({self.cluster.time} = {limit} s): Slurm would send the warning signal at the start. Set "
                f"preemption.lead_time_s below {limit} (e.g. {max(30, limit // 10)}) or raise cluster.time"
            )
        if self.fsdp.replicate_across_nodes and not self.fsdp.enabled:
            raise ValueError(
                "fsdp.replicate_across_nodes: shards inside each node, which needs fsdp.enabled=true; set "
                "fsdp.enabled=true or fsdp.replicate_across_nodes=false"
            )
        if self.dpo is not None:
            self._check_dpo(self.dpo)
        if self.executor == Executor.LOCAL and self.cluster.container is not None:
            raise ValueError(
                "cluster.container: the local executor runs the job on this machine, outside any image; remove "
                "cluster.container (or set executor=slurm)"
            )
        if self.executor == Executor.LOCAL and self.resources.nodes != 1:
            raise ValueError(
                "resources.nodes: the local executor runs on this machine only; set resources.nodes=1 "
                "(or executor=slurm)"
            )
        return self

    def _check_dpo(self, dpo: DPOConfig) -> None:
        """What a DPO run cannot combine with."""
        if dpo.reference == DPOReference.COPY and self.lora is not None:
            raise ValueError(
                "dpo.reference: copy loads a second model, but with a lora: section the reference is the base model "
                "with the adapters disabled (no copy needed); remove dpo.reference (auto) or the lora: section"
            )
        if self.train.sft:
            raise ValueError(
                f"train.sft: passes options to TRL's SFTConfig, but a dpo run trains with TRL's DPOTrainer; remove "
                f"train.sft ({', '.join(sorted(self.train.sft))}) or the dpo: section"
            )

    @property
    def method(self) -> Method:
        """sft, or the preference method whose section is set."""
        return Method.DPO if self.dpo is not None else Method.SFT

    @property
    def packed(self) -> bool:
        """data.packing where it applies: supervised fine-tuning. DPO trains on each pair, padded, never packed."""
        return self.data.packing and self.method == Method.SFT

    @property
    def assistant_masks(self) -> bool:
        """data.assistant_only_loss where it applies: supervised fine-tuning (DPO scores the replies only)."""
        return self.data.assistant_only_loss and self.method == Method.SFT

    def _reconcile_precision(self) -> None:
        """train.precision and model.dtype: one derives the other; a contradiction names both fields."""
        from slurmft.precision import reconcile

        precision, dtype, problem = reconcile(self.train.precision, self.model.dtype)
        if problem:
            raise ValueError(problem)
        if self.train.optimizer == "adamw-stochastic-rounding" and precision != "bf16-true":
            raise ValueError(
                f"train.optimizer: adamw-stochastic-rounding rounds bf16 weights, but train.precision is {precision}; "
                "set train.precision=bf16-true or train.optimizer=adamw"
            )
        # not assignments: those would re-run the section validators for a value already checked
        self.train.__dict__["precision"] = precision
        self.model.__dict__["dtype"] = dtype

    @property
    def resolved_executor(self) -> Executor:
        """``auto`` resolved: slurm when sbatch is on PATH, else local."""
        if self.executor != Executor.AUTO:
            return self.executor
        from slurmft.slurm import available

        return Executor.SLURM if available("sbatch") else Executor.LOCAL


def slurm_time_seconds(slurm_time: str) -> int:
    """Seconds in a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S)."""
    days, _, rest = slurm_time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        h, (m, s) = 0, (parts + [0])[:2]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


# ------------------------------------------------------------------ loading
def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def format_validation_error(err: ValidationError) -> list[str]:
    """One readable line per problem: ``dotted.field: message (got value)``."""
    problems = []
    for e in err.errors():
        loc = _format_loc(tuple(p for p in e["loc"] if p not in ("function-after",)))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = _unknown_key_message(e["loc"])
        elif e["type"] == "string_type" and isinstance(e.get("input"), bool):
            msg = f"expected a string, got {e['input']!r}: YAML reads yes/no/true/false as booleans; quote it " \
                  f"(\"{str(e['input']).lower()}\")"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and not isinstance(e["input"], dict | list) and repr(e["input"]) not in msg:
            msg += f" (got {e['input']!r})"
        if not e["loc"] and re.match(r"^[a-z_.]+: ", msg):  # cross-field check that names its own field
            problems.append(msg)
            continue
        problems.append(f"{loc}: {msg}")
    return problems


def _unknown_key_message(loc: tuple[Any, ...]) -> str:
    """Unknown key: a did-you-mean (our field for a foreign spelling), the valid keys, the sft passthrough."""
    from slurmft.names import suggest

    parent = ".".join(str(p) for p in loc[:-1])
    valid = _valid_keys(parent)
    hint = suggest(str(loc[-1]), _format_loc(loc[:-1]) if loc[:-1] else "", valid, all_fields())
    msg = f"unknown key; {hint + '; ' if hint else ''}valid keys here: {', '.join(valid)}"
    if parent == "train" and not hint:
        msg += f"; an option of TRL's SFTConfig goes under train.sft: (train.sft.{loc[-1]}=...)"
    return msg


def all_fields(model: Any = None, prefix: str = "") -> list[str]:
    """Every field of the schema as a dotted path (list sections as ``name[]``)."""
    out = []
    for name, field in (model or RunConfig).model_fields.items():
        ann = field.annotation
        inner = getattr(ann, "__args__", None) or ()
        sub = next((a for a in (ann, *inner) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        path = f"{prefix}{field.alias or name}"  # the YAML key (checkpoint.async)
        if sub is not None:
            out += all_fields(sub, path + ("[]." if sub is not ann else "."))
        else:
            out.append(path)
    return out


def _valid_keys(dotted_parent: str) -> list[str]:
    model: Any = RunConfig
    for part in filter(None, dotted_parent.split(".")):
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        if inner:  # list[DatasetSource] and friends
            ann = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(field.alias or name for name, field in model.model_fields.items())


KEY_PART_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """Parse ``a.b.c=value`` or ``a.b[0].c=value`` (value read as YAML) into (path, value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value with a dotted key, e.g. train.max_steps=10")
    key, raw = text.split("=", 1)
    path: list[str | int] = []
    for part in key.strip().split("."):
        m = KEY_PART_RE.match(part)
        if part.isdigit() and path:
            path.append(int(part))
        elif m:
            path.append(m.group(1))
            path += [int(i) for i in re.findall(r"\[(\d+)\]", m.group(2))]
        else:
            raise ConfigError(
                f"override {text!r}: {key!r} is not a dotted key like resources.nodes or data.datasets[0].weight"
            )
    try:
        value = load_yaml_text(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc.__class__.__name__})") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str], base: Path | None = None) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted ``key=value`` overrides applied.

    With ``base``, a relative path given on the command line is made absolute against it (the current
    directory: see :func:`absolutize_paths`).
    """
    import copy

    out = copy.deepcopy(data)
    given: set[str] = set()
    for text in overrides:
        path, value = parse_override(text)
        given.add(_format_loc(tuple(path)))
        node: Any = out
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            where = _format_loc(tuple(path[: depth + 1]))
            if isinstance(part, int):
                if not isinstance(node, list):
                    raise ConfigError(f"override {text!r}: {_format_loc(tuple(path[:depth]))} is not a list")
                if part > len(node):
                    raise ConfigError(f"override {text!r}: {where} does not exist (the list has {len(node)} items)")
                if part == len(node):  # one past the end appends
                    node.append({} if not last else None)
            elif not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {_format_loc(tuple(path[:depth]))} is not a section")
            if last:
                node[part] = value
            else:
                child = node[part] if isinstance(part, int) else node.get(part)
                if child is None:
                    child = [] if isinstance(path[depth + 1], int) else {}
                    node[part] = child
                node = child
        if path in (["train", "max_steps"], ["train", "epochs"]) and value is not None:
            # the command line picks the length: train.max_steps=10 on a file with epochs is a smoke test
            out["train"].pop("epochs" if path[1] == "max_steps" else "max_steps", None)
        if base is not None:
            _absolutize(out, base, only=_format_loc(tuple(path)))
    # The command line picks the precision: train.precision=bf16-true on a file with model.dtype: float32
    # (or the reverse) replaces the file's other knob instead of contradicting it.
    for chosen, other in (("train.precision", ("model", "dtype")), ("model.dtype", ("train", "precision"))):
        if chosen in given and ".".join(other) not in given and isinstance(out.get(other[0]), dict):
            out[other[0]].pop(other[1], None)
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping with readable errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (give the path to your run.yaml)")
    try:
        data = load_yaml_text(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (name:, model:, data:, ...)")
    return data


def validate(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a mapping into a RunConfig; every problem is collected into one ConfigError."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        problems = format_validation_error(err)
        raise ConfigError(f"{source}: {len(problems)} problem(s) in the run config", problems) from None


def read_run_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> RunConfig:
    """A run directory's resolved ``config.yaml`` (with ``overrides``), read the one way every command and the
    job read it: the YAML 1.2 reader of ``run.yaml`` and the schema. Readers that must survive a broken
    file (the report, ``runs``) read the raw YAML themselves."""
    p = Path(path)
    if not p.is_file():
        raise RunDirError(f"{p.parent} is not a slurmft run directory: {p.name} is missing")
    return validate(apply_overrides(read_yaml(p), overrides or []), source=str(p))


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> RunConfig:
    """Read run.yaml, apply overrides and validate; every relative path becomes absolute.

    One rule for every path (output_dir, model, tokenizer, data files, a profile file, the job's
    Python, a chat template, a container image file): a relative path is relative to where it was written — the run.yaml's
    folder for a value in the file, the current directory for a ``key=value`` on the command line.
    Whether the files exist is checked by :mod:`slurmft.plan.checks`, which reports every problem at once.
    """
    data = read_yaml(path)
    _absolutize(data, Path(path).resolve().parent)
    data = apply_overrides(data, overrides or [], base=Path.cwd())
    return validate(data, source=str(path))


#: Local data file suffix -> the ``datasets`` builder the job reads it with.
DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
DATA_SUFFIXES = tuple(DATA_BUILDERS)


def _path_kind(loc: str) -> str:
    """How a path field is told apart from a name: always a path, a path when it looks like one, ..."""
    if loc in ("output_dir", "train.sft.chat_template_path"):
        return "path"
    if loc == "cluster.profile":
        return "profile"
    if loc == "cluster.python":
        return "program"
    if loc == "cluster.container.image":
        return "image"
    return "path-or-hub-id"  # model.name_or_path, model.tokenizer, data.datasets[i].path


def looks_like_path(value: str) -> bool:
    """A value written as a local path (not a hub id like org/name)."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..")


def _resolve_one(value: str, kind: str, base: Path) -> str:
    expanded = Path(os.path.expanduser(value))
    if expanded.is_absolute():
        return str(expanded)
    local = str((base / expanded).resolve())
    if kind == "path":
        return local
    if kind == "profile":
        return local if ("/" in value or value.endswith((".yaml", ".yml"))) else value
    if kind == "program":
        return local if "/" in value else value  # a bare name is looked up on the job's PATH
    if kind == "image":  # a file or directory here, or a registry reference (docker://..., nvcr.io#..., localhost/x:1)
        return local if looks_like_path(value) or (base / expanded).exists() else value
    if looks_like_path(value) or value.endswith(DATA_SUFFIXES) or (base / expanded).exists():
        return local
    return value  # a hub id


def _path_fields(data: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(dotted location, the mapping holding it, key) for every path-valued field present in raw data."""
    found: list[tuple[str, dict[str, Any], str]] = []

    def take(loc: str, holder: Any, key: str) -> None:
        if isinstance(holder, dict) and isinstance(holder.get(key), str) and holder[key]:
            found.append((loc, holder, key))

    take("output_dir", data, "output_dir")
    cluster, model, dat, train = (data.get(k) if isinstance(data.get(k), dict) else {} for k in
                                  ("cluster", "model", "data", "train"))
    take("cluster.profile", cluster, "profile")
    take("cluster.python", cluster, "python")
    if isinstance(cluster.get("container"), dict):
        take("cluster.container.image", cluster["container"], "image")
    take("model.name_or_path", model, "name_or_path")
    take("model.tokenizer", model, "tokenizer")
    if isinstance(train.get("sft"), dict):
        take("train.sft.chat_template_path", train["sft"], "chat_template_path")
    datasets = dat.get("datasets")
    for i, ds in enumerate(datasets if isinstance(datasets, list) else []):
        take(f"data.datasets[{i}].path", ds, "path")
    return found


def _absolutize(data: dict[str, Any], base: Path, only: str | None = None) -> None:
    """Make the relative paths in raw config ``data`` absolute against ``base`` (only those under ``only``)."""
    for loc, holder, key in _path_fields(data):
        if only is None or loc == only or loc.startswith((only + ".", only + "[")):
            holder[key] = _resolve_one(holder[key], _path_kind(loc), base)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the job reads back)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
