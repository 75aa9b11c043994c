"""Which attention implementations an architecture supports, and which one a run gets: login side and job alike.

What transformers does (5.24): every model class declares ``_supports_sdpa`` and ``_supports_flash_attn``
(``PreTrainedModel`` defaults both to False); building a model with an implementation its class does not
support raises ``ValueError`` ("does not support an attention implementation through
torch.nn.functional.scaled_dot_product_attention yet"). Gemma-2 (logit soft-capping) and gpt-oss
(attention sinks) refuse SDPA, so a job that always asked for SDPA on CPU, or when flash-attn was
missing, stopped at setup, after the queue wait.

What we do: one decision, :func:`choose`, from what the architecture supports (:class:`Support`) and
why flash-attn cannot run here (the job knows; ``None`` when it can): ``auto`` is flash-attention 2
where both allow it, else SDPA where the architecture supports it, else eager, with the reason; an
explicit choice the architecture refuses is an error naming the field and the fix. The job reads
the support off the model class it builds (exact, custom code included). The login side
(``slurmft validate``) must not import transformers (it imports torch), so :func:`support_of` reads
the same two class attributes from the installed transformers' *source*: the ``models/*/`` folder
whose configuration declares ``model_type = "<model_type>"``, and in its ``modeling_*.py`` the
assignments in the ``*PreTrainedModel`` class (Python's ``ast``, no import, ~30 ms). No table of
our own: a new transformers release brings its answers with it. Unknown model types (custom code,
or a transformers without that folder) give ``None``, and the job decides.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SDPA, FLASH, EAGER = "sdpa", "flash_attention_2", "eager"


@dataclass(frozen=True)
class Support:
    """What an architecture's transformers class declares."""

    model_type: str
    sdpa: bool
    flash: bool


def _transformers_dir() -> Path | None:
    """The installed transformers package folder, found without importing it."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _declared(tree: ast.Module) -> dict[str, bool]:
    """``_supports_sdpa`` / ``_supports_flash_attn`` as the first ``*PreTrainedModel`` class of a file sets them."""
    found: dict[str, bool] = {}
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name.endswith("PreTrainedModel")):
            continue
        for stmt in node.body:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
                stmt, ast.AnnAssign) else []
            value = getattr(stmt, "value", None)
            for target in targets:
                if (isinstance(target, ast.Name) and target.id in ("_supports_sdpa", "_supports_flash_attn")
                        and isinstance(value, ast.Constant) and isinstance(value.value, bool)):
                    found.setdefault(target.id, value.value)
        if found:
            return found
    return found


@lru_cache(maxsize=64)
def support_of(model_type: str) -> Support | None:
    """What transformers' class for ``model_type`` declares, read from the installed source; None if unknown."""
    root = _transformers_dir()
    if root is None or not re.fullmatch(r"[A-Za-z0-9_-]+", model_type or ""):
        return None
    pattern = re.compile(rf"""^\s*model_type\s*=\s*["']{re.escape(model_type)}["']""", re.MULTILINE)
    likely = [root / "models" / name for name in (model_type, model_type.removesuffix("_text"))]
    configs = [f for d in likely for f in sorted(d.glob("configuration_*.py"))]  # the usual folder first
    for config_file in configs + sorted((root / "models").glob("*/configuration_*.py")):
        try:
            if not pattern.search(config_file.read_text(encoding="utf-8")):
                continue
        except OSError:
            continue
        for modeling in sorted(config_file.parent.glob("modeling_*.py")):
            try:
                declared = _declared(ast.parse(modeling.read_text(encoding="utf-8")))
            except (OSError, SyntaxError):
                continue
            if declared:
                return Support(model_type, declared.get("_supports_sdpa", False),
                               declared.get("_supports_flash_attn", False))
        return None
    return None


def refusal(requested: str, support: Support | None) -> str | None:
    """The error for an explicit implementation the architecture refuses (None: no refusal known)."""
    if support is None:
        return None
    label = {SDPA: ("SDPA (torch.nn.functional.scaled_dot_product_attention)", support.sdpa),
             FLASH: ("flash-attention 2", support.flash)}.get(requested)
    if label is None or label[1]:
        return None
    fallback = choose("auto", support, "it is not requested")[0]
    return (f"model.attn_implementation={requested}: transformers does not support {label[0]} for "
            f"{support.model_type} models; set model.attn_implementation=auto (gives {fallback} here) or "
            f"{EAGER}")


def choose(requested: str, support: Support | None, flash_problem: str | None) -> tuple[str, str]:
    """(attn_implementation, why) for ``requested`` ("auto" or explicit), the architecture's support (None:
    unknown, assume SDPA as before) and why flash-attn 2 cannot run here (None: it can).

    Raises ValueError with the message of :func:`refusal` for an explicit choice the architecture refuses;
    an explicit flash_attention_2 that cannot run here is the caller's error (it knows the fix).
    """
    problem = refusal(requested, support)
    if problem:
        raise ValueError(problem)
    if requested != "auto":
        return requested, "set by model.attn_implementation"
    arch = support.model_type if support else "this architecture"
    if flash_problem is None and (support is None or support.flash):
        return FLASH, "transformers can use flash-attn 2 on this CUDA device"
    why = flash_problem if support is None or support.flash else f"transformers has no flash-attention 2 for {arch}"
    if support is None or support.sdpa:
        return SDPA, f"{why}; falling back to PyTorch SDPA"
    return EAGER, f"{why}, and no SDPA for {arch} in transformers: eager attention"
