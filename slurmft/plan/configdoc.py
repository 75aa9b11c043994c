"""The config reference (docs/config.md), generated from the pydantic schema so docs match the code.

Regenerate: python -m slurmft.plan.configdoc > docs/config.md
"""

from __future__ import annotations

import functools
import json
import operator
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from slurmft.config import RunConfig


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found:
            return found
    return None


def _plain(annotation: Any) -> Any:
    """The type a user writes: ``Annotated`` validators (config.SlurmTime, ...) dropped, ``X | None`` kept."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _plain(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [_plain(a) for a in typing.get_args(annotation)])
    return annotation


def _type_name(annotation: Any) -> str:
    annotation = _plain(annotation)
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return text.replace("slurmft.config.", "")


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if hasattr(value, "value"):
        value = value.value
    return f"`{json.dumps(value)}`"


def reference() -> str:
    """Markdown tables, one per section, in schema order."""
    lines = [
        "# run.yaml reference",
        "",
        "Generated from the schema (`slurmft/config.py`, the cluster sections in `slurmft/config_cluster.py`) by "
        "`python -m slurmft.plan.configdoc`; a test keeps it in sync.",
        "Unknown keys are rejected. Override any field on the command line with a dotted path:",
        "`slurmft submit run.yaml resources.nodes=4 train.max_steps=10`.",
        "",
    ]
    sections: list[tuple[str, type[BaseModel]]] = [("(top level)", RunConfig)]
    while sections:
        title, model = sections.pop(0)
        lines += [f"## `{title}`", "", (model.__doc__ or "").strip().splitlines()[0], ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for attr, field in model.model_fields.items():
            name = field.alias or attr  # the key as written in YAML (checkpoint.async: ``async`` is a Python keyword)
            sub = _submodel(field.annotation)
            path = name if title == "(top level)" else f"{title}.{name}"
            if sub is not None:
                sections.append((path + ("[]" if "list" in str(field.annotation) else ""), sub))
            typ = f"[{sub.__name__}](#{path.replace('.', '').replace('[]', '')})" if sub else _type_name(field.annotation)
            desc = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{name}` | {typ.replace('|', ' or ')} | {_default(field)} | {desc} |")
        lines.append("")
    from slurmft.names import alias_table

    lines += [
        "## Names from other tools",
        "",
        "An unknown key that another tool spells this way gets a did-you-mean naming our field. Any other",
        "option of TRL's `SFTConfig` goes under `train.sft:` as-is (keys and types are checked by",
        "`slurmft validate` when TRL is installed, and always in the job).",
        "",
        *alias_table(),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
