"""Reading run.yaml into a :class:`~slurmft.config.RunConfig`: the YAML, the command line's ``key=value``
overrides, relative paths made absolute, and the schema's verdict as lines a user can act on.

The schema itself (what may be written) is :mod:`slurmft.config`; this is how a file and a command line
become one validated config, the same way for ``submit``, ``validate``, ``resume`` and the job (which reads
the run directory's resolved ``config.yaml`` with :func:`read_run_config`).
"""

from __future__ import annotations

import json
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from slurmft.config import RunConfig
from slurmft.config_model_checks import IMAGE_TAG
from slurmft.config_paths import absolutize
from slurmft.errors import ConfigError, RunDirError


# ------------------------------------------------------------------ YAML 1.2 numbers
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


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping with readable errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (give the path to your run.yaml)")
    try:
        data = load_yaml_text(p.read_text())
    except UnicodeDecodeError as exc:  # a binary file, or text saved in another encoding
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (name:, model:, data:, ...)")
    return data


# ------------------------------------------------------------------ key=value on the command line
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
    directory: see :func:`slurmft.config_paths.absolutize`).
    """
    import copy

    out = copy.deepcopy(data)
    given: set[str] = set()
    for text in overrides:
        path, value = parse_override(text)
        given.add(format_loc(tuple(path)))
        node: Any = out
        for depth, part in enumerate(path):
            last = depth == len(path) - 1
            where = format_loc(tuple(path[: depth + 1]))
            if isinstance(part, int):
                if not isinstance(node, list):
                    raise ConfigError(f"override {text!r}: {format_loc(tuple(path[:depth]))} is not a list")
                if part > len(node):
                    raise ConfigError(f"override {text!r}: {where} does not exist (the list has {len(node)} item{'' if len(node) == 1 else 's'})")
                if part == len(node):  # one past the end appends
                    node.append({} if not last else None)
            elif not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {format_loc(tuple(path[:depth]))} is not a section")
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
            absolutize(out, base, only=format_loc(tuple(path)))
    # The command line picks the precision: train.precision=bf16-true on a file with model.dtype: float32
    # (or the reverse) replaces the file's other knob instead of contradicting it.
    for chosen, other in (("train.precision", ("model", "dtype")), ("model.dtype", ("train", "precision"))):
        if chosen in given and ".".join(other) not in given and isinstance(out.get(other[0]), dict):
            out[other[0]].pop(other[1], None)
    return out


def resolve_overrides(data: dict[str, Any], overrides: list[str], base: Path) -> list[str]:
    """``overrides`` as ``key=JSON`` with the value they leave in ``data`` (a relative path made absolute against
    ``base``): the same settings wherever they are read later, by a job in another directory with
    :func:`read_run_config` (JSON is YAML), and readable where they are recorded (the manifest)."""
    applied = apply_overrides(data, overrides, base=base)
    out = []
    for text in overrides:
        path = parse_override(text)[0]
        node: Any = applied
        for part in path:
            node = node[part]
        out.append(f"{format_loc(tuple(path))}={json.dumps(node)}")
    return out


# ------------------------------------------------------------------ the schema's verdict, in words
def format_loc(loc: tuple[Any, ...]) -> str:
    """A pydantic location as the user writes the key: ``data.datasets[0].path``."""
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
        where = tuple(p for p in e["loc"] if p not in ("function-after", IMAGE_TAG))
        loc = format_loc(where)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = _unknown_key_message(where)
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
    hint = suggest(str(loc[-1]), format_loc(loc[:-1]) if loc[:-1] else "", valid, all_fields())
    msg = f"unknown key; {hint + '; ' if hint else ''}valid keys here: {', '.join(valid)}"
    if parent == "train" and not hint:
        msg += f"; an option of TRL's SFTConfig goes under train.sft: (train.sft.{loc[-1]}=...)"
    return msg


def all_fields(model: Any = None, prefix: str = "") -> list[str]:
    """Every field of the schema as a dotted path (list sections as ``name[]``)."""
    out = []
    for name, field in (model or RunConfig).model_fields.items():
        ann = field.annotation
        sub = _section_model(ann)
        path = f"{prefix}{field.alias or name}"  # the YAML key (checkpoint.async)
        if sub is not None:
            out += all_fields(sub, path + ("[]." if typing.get_origin(ann) is list else "."))
        else:
            out.append(path)
    return out


def _section_model(ann: Any) -> Any:
    """The section (a pydantic model) a field's annotation holds, through lists, unions and ``Annotated``; None."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in typing.get_args(ann):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _valid_keys(dotted_parent: str) -> list[str]:
    model: Any = RunConfig
    for part in filter(None, dotted_parent.split(".")):
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        sub = _section_model(field.annotation)  # list[DatasetSource], LoraConfig | None and friends
        if sub is None:
            return []
        model = sub
    return sorted(field.alias or name for name, field in model.model_fields.items())


# ------------------------------------------------------------------ a run's config
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
    absolutize(data, Path(path).resolve().parent)
    data = apply_overrides(data, overrides or [], base=Path.cwd())
    return validate(data, source=str(path))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the job reads back)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
