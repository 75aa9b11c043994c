"""The run config (``run.yaml``): one pydantic model per section, unknown keys rejected.

Every string that can reach a shell script is validated here (and quoted again at render time),
so a bad value fails at ``submit`` with the dotted field name, never inside a job.
"""

from __future__ import annotations

import os
import re
import shutil
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from slurmft.errors import ConfigError

# ------------------------------------------------------------------ shell-safe value patterns
NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
SLURM_WORD_RE = re.compile(r"^[A-Za-z0-9._-]+$")  # partition, account, qos
CONSTRAINT_RE = re.compile(r"^[A-Za-z0-9._,:&|\[\]*()-]+$")
TIME_RE = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")  # [D-]HH[:MM[:SS]] or minutes
MEM_RE = re.compile(r"^\d+[KMGT]?$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PATH_RE = re.compile(r"^[A-Za-z0-9._/~+@=,-]+$")  # no spaces, quotes, $, `, ;, |, &, <, >
SIZE_RE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$")
SECRET_KEY_RE = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIALS?)($|_)", re.I)
SIGNALS = ("USR1", "USR2", "TERM", "INT", "URG")


def _check(pattern: re.Pattern[str], value: str, what: str) -> str:
    if not pattern.match(value):
        raise ValueError(f"{value!r} is not a valid {what}")
    return value


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
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ClusterConfig(_Section):
    """Where the job runs: the cluster profile and the scheduler account fields."""

    profile: str = Field(
        "ethernet",
        description="Cluster profile: a name from configs/clusters/ (aws-efa, aws-efa-legacy, infiniband, "
        "ethernet, local-test) or a path to your own YAML profile.",
    )
    partition: str | None = Field(None, description="Slurm partition (--partition).")
    account: str | None = Field(None, description="Slurm account (--account).")
    qos: str | None = Field(None, description="Slurm QOS (--qos).")
    constraint: str | None = Field(None, description="Slurm node constraint (--constraint), e.g. 'a100&ib'.")
    time: str = Field("04:00:00", description="Wall-clock limit of the train job, [D-]HH:MM:SS.")
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
        description="Python interpreter on the compute nodes (default: the one running slurmft submit).",
    )
    master_addr: str | None = Field(
        None,
        description="Override the rendezvous address (default: NodeAddr of the allocation's first node).",
    )

    @field_validator("partition", "account", "qos")
    @classmethod
    def _slurm_word(cls, v: str | None) -> str | None:
        return None if v is None else _check(SLURM_WORD_RE, v, "Slurm name (letters, digits, . _ -)")

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v: str | None) -> str | None:
        return None if v is None else _check(CONSTRAINT_RE, v, "Slurm constraint expression")

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        return _check(TIME_RE, v, "Slurm time limit (use [D-]HH:MM:SS, e.g. 04:00:00 or 1-12:00:00)")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            _check(ENV_KEY_RE, key, "environment variable name")
            if SECRET_KEY_RE.search(key):
                raise ValueError(
                    f"{key} looks like a secret; do not put secrets in run.yaml (they would be written into "
                    f"the sbatch script). Export {key} in the shell that runs 'slurmft submit' instead."
                )
            _no_control_chars(str(value), f"env value of {key}")
        return v

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


class ResourcesConfig(_Section):
    """The allocation of the train job. One Slurm task per GPU."""

    nodes: int = Field(2, ge=1, le=4096, description="Number of nodes.")
    gpus_per_node: int = Field(8, ge=0, le=64, description="GPUs per node; one task (rank) per GPU.")
    tasks_per_node: int | None = Field(
        None, ge=1, le=256, description="Ranks per node (default: gpus_per_node, or 1 without GPUs)."
    )
    cpus_per_task: int = Field(8, ge=1, le=1024, description="CPU cores per rank (--cpus-per-task).")
    mem: str | None = Field(None, description="Memory per node (--mem), e.g. '0' for all, '500G'.")
    exclusive: bool = Field(True, description="Request whole nodes (--exclusive).")

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        return None if v is None else _check(MEM_RE, v, "Slurm memory size (e.g. 0, 64G, 500000M)")

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
        description="Compute dtype: auto = bfloat16 on GPU, float32 on CPU. Master weights and optimizer state "
        "stay float32 (mixed precision).",
    )
    attn_implementation: Literal["auto", "flash_attention_2", "sdpa", "eager"] = Field(
        "auto", description="auto = flash_attention_2 when flash-attn imports, else sdpa."
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")


class DatasetSource(_Section):
    """One data source; several are mixed by weight."""

    path: str = Field(..., description="Hub id or local .json/.jsonl/.parquet file.")
    split: str = Field("train", description="Split to read.")
    weight: float = Field(1.0, gt=0, description="Mixing weight (relative sampling probability).")
    format: Literal["auto", "messages", "lima", "guanaco"] = Field(
        "auto",
        description="Record layout: messages (role/content list), lima (conversations: [str]), "
        "guanaco (text with '### Human:' / '### Assistant:'), or auto-detect.",
    )
    name: str | None = Field(None, description="Hub dataset config name (subset).")
    text_field: str | None = Field(None, description="Column holding the text/conversation if not the default.")


class DataConfig(_Section):
    """Training data."""

    datasets: list[DatasetSource] = Field(..., min_length=1, description="Sources to mix.")
    max_seq_length: int = Field(2048, ge=8, le=1_048_576, description="Tokens per sequence (packed).")
    packing: bool = Field(True, description="Pack examples into max_seq_length sequences.")
    assistant_only_loss: bool = Field(True, description="Compute the loss on assistant tokens only.")
    num_proc: int | None = Field(None, ge=1, description="Processes for dataset preprocessing.")


class TrainConfig(_Section):
    """Optimisation settings; anything TRL's SFTConfig accepts can go under ``sft``."""

    max_steps: int = Field(500, ge=1, description="Optimizer steps.")
    per_device_batch_size: int = Field(1, ge=1, description="Micro-batch per rank.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(5e-5, gt=0, lt=1, description="Peak learning rate.")
    lr_scheduler: str = Field("cosine", description="transformers scheduler name.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps used for warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    seed: int = Field(42, ge=0, description="Random seed.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every N steps.")
    report_to: list[str] = Field(default_factory=list, description="Extra loggers: tensorboard, wandb.")
    sft: dict[str, Any] = Field(default_factory=dict, description="Extra keys passed to trl.SFTConfig as-is.")

    @field_validator("lr_scheduler")
    @classmethod
    def _sched(cls, v: str) -> str:
        return _check(NAME_RE, v, "scheduler name")


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
    wrap_class: str | None = Field(None, description="Decoder layer class to wrap (default: from the model).")


class CheckpointConfig(_Section):
    """Sharded (torch.distributed.checkpoint) checkpoints."""

    every_steps: int = Field(100, ge=1, description="Save a sharded checkpoint every N steps.")
    keep_last: int = Field(2, ge=1, description="Keep the N newest complete checkpoints.")


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


class ConsolidateResources(_Section):
    """The consolidation job's allocation (CPU is enough)."""

    cpus_per_task: int = Field(4, ge=1, le=1024, description="CPU cores.")
    mem: str | None = Field("32G", description="Memory (--mem).")
    time: str = Field("02:00:00", description="Time limit.")
    partition: str | None = Field(None, description="Partition (default: the train job's).")

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        return None if v is None else _check(MEM_RE, v, "Slurm memory size (e.g. 0, 64G, 500000M)")

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        return _check(TIME_RE, v, "Slurm time limit (use [D-]HH:MM:SS)")

    @field_validator("partition")
    @classmethod
    def _part(cls, v: str | None) -> str | None:
        return None if v is None else _check(SLURM_WORD_RE, v, "Slurm name (letters, digits, . _ -)")


class ConsolidateConfig(_Section):
    """Turn the final sharded checkpoint into a deployable Hugging Face model."""

    enabled: bool = Field(True, description="Chain a consolidation job after training (afterok).")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Dtype of the saved model.")
    max_shard_size: str = Field("5GB", description="Largest safetensors file, e.g. 5GB, 500MB.")
    resources: ConsolidateResources = Field(default_factory=ConsolidateResources)

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        return _check(SIZE_RE, v, "size (e.g. 5GB, 500MB)")


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
        if self.executor == Executor.LOCAL and self.resources.nodes != 1:
            raise ValueError(
                "resources.nodes: the local executor runs on this machine only; set resources.nodes=1 "
                "(or executor=slurm)"
            )
        if self.checkpoint.every_steps > self.train.max_steps:
            raise ValueError(
                f"checkpoint.every_steps ({self.checkpoint.every_steps}) exceeds train.max_steps "
                f"({self.train.max_steps}): no checkpoint would ever be written; lower checkpoint.every_steps"
            )
        return self

    @property
    def resolved_executor(self) -> Executor:
        """``auto`` resolved: slurm when sbatch is on PATH, else local."""
        if self.executor != Executor.AUTO:
            return self.executor
        return Executor.SLURM if shutil.which("sbatch") else Executor.LOCAL


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
            parent = ".".join(str(p) for p in e["loc"][:-1])
            msg = f"unknown key; valid keys here: {', '.join(_valid_keys(parent))}"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and not isinstance(e["input"], dict | list) and repr(e["input"]) not in msg:
            msg += f" (got {e['input']!r})"
        if not e["loc"] and re.match(r"^[a-z_.]+: ", msg):  # cross-field check that names its own field
            problems.append(msg)
            continue
        problems.append(f"{loc}: {msg}")
    return problems


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
    return sorted(model.model_fields)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value`` (value read as YAML) into (path, value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value with a dotted key, e.g. train.max_steps=10")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", p) for p in path):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted key like resources.nodes")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc.__class__.__name__})") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted ``key=value`` overrides applied."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping with readable errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (give the path to your run.yaml)")
    try:
        data = yaml.safe_load(p.read_text())
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


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> RunConfig:
    """Read run.yaml, apply overrides and validate. Relative local paths are resolved against the file."""
    data = apply_overrides(read_yaml(path), overrides or [])
    cfg = validate(data, source=str(path))
    return resolve_paths(cfg, Path(path).resolve().parent)


def _looks_local(value: str, base: Path) -> Path | None:
    p = Path(os.path.expanduser(value))
    if not p.is_absolute():
        p = base / p
    return p if p.exists() else None


def resolve_paths(cfg: RunConfig, base: Path) -> RunConfig:
    """Make output_dir and existing local model/data paths absolute (jobs run in another cwd)."""
    out = Path(os.path.expanduser(cfg.output_dir))
    cfg.output_dir = str(out if out.is_absolute() else (Path.cwd() / out).resolve())
    local = _looks_local(cfg.model.name_or_path, base) or _looks_local(cfg.model.name_or_path, Path.cwd())
    if local:
        cfg.model.name_or_path = str(local.resolve())
        if local.is_dir() and not (local / "config.json").is_file():
            raise ConfigError(
                f"model.name_or_path: {cfg.model.name_or_path} has no config.json (give a Hugging Face model "
                "directory as written by save_pretrained, or a hub id)"
            )
    elif cfg.model.name_or_path.startswith(("/", "./", "../", "~")):
        raise ConfigError(
            f"model.name_or_path: local path {cfg.model.name_or_path!r} does not exist "
            "(give an existing directory with config.json, or a hub id like meta-llama/Llama-2-7b-hf)"
        )
    if cfg.model.tokenizer:
        tok = _looks_local(cfg.model.tokenizer, base)
        if tok:
            cfg.model.tokenizer = str(tok.resolve())
    for i, ds in enumerate(cfg.data.datasets):
        local = _looks_local(ds.path, base) or _looks_local(ds.path, Path.cwd())
        if local:
            ds.path = str(local.resolve())
        elif ds.path.startswith(("/", "./", "../", "~")) or ds.path.endswith((".json", ".jsonl", ".parquet")):
            raise ConfigError(
                f"data.datasets[{i}].path: file {ds.path!r} does not exist (give a local .json/.jsonl/.parquet "
                "file or a hub dataset id like GAIR/lima)"
            )
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the job reads back)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
