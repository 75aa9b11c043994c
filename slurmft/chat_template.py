"""The chat-template rules, and their words, that ``validate`` and the job both apply.

``validate`` reads the tokenizer's template from disk with jinja2 (no transformers on the login node);
the job gets it from ``AutoTokenizer``. Both must refuse the same templates with the same sentence, or
a user fixes what ``validate`` said and meets a different complaint after the queue wait. So the rules
and messages live here, in a module with no imports beyond the standard library, the way
:mod:`slurmft.formats` serves both sides for the data rows.
"""

from __future__ import annotations

import re
from pathlib import Path

#: ``{% generation %}`` / ``{% endgeneration %}``: the markers TRL's assistant-only loss needs.
GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")
TEMPLATE_SUFFIXES = (".jinja", ".j2")


def template_path_problem(value: str) -> str | None:
    """What is wrong with ``train.sft.chat_template_path`` (a template file, not another tokenizer), or None."""
    path = Path(value).expanduser()
    if path.suffix not in TEMPLATE_SUFFIXES:
        return ("train.sft.chat_template_path: only a .jinja/.j2 template file is supported (cloning a template "
                "from another tokenizer adds tokens, which needs an embedding resize the sharded model cannot do)")
    if not path.is_file():
        return f"train.sft.chat_template_path: {str(path)!r} does not exist"
    return None


def has_generation_markers(template: str) -> bool:
    return GENERATION_TAG.search(template) is not None


def no_template_message(tokenizer_dir: str | Path) -> str:
    """A tokenizer without a chat template: conversations cannot be formatted."""
    return (f"the tokenizer at {tokenizer_dir} has no chat template, so conversations cannot be formatted. Use a "
            "tokenizer that has one (model.tokenizer, e.g. the model's -chat/-instruct sibling with the same "
            "vocabulary), or set train.sft.chat_template_path to a .jinja file (with {% generation %} markers "
            "around assistant replies for data.assistant_only_loss)")


def no_markers_message(tokenizer: str | Path) -> str:
    """``data.assistant_only_loss`` on a template without markers that TRL cannot patch either."""
    return (f"data.assistant_only_loss needs {{% generation %}} markers around assistant replies in the chat "
            f"template, and the template of {tokenizer} has none (nor does TRL know how to add them). Set "
            "data.assistant_only_loss: false (loss on every token) or point train.sft.chat_template_path at a "
            "template with the markers")


def cannot_render_message(where: str, index: int, exc: BaseException) -> str:
    """The template raised on one of the user's conversations (a role it refuses, a bad loop)."""
    return (f"{where}: the chat template cannot render conversation {index} ({type(exc).__name__}: {exc}); use a "
            "tokenizer/template that accepts these roles (model.tokenizer, train.sft.chat_template_path)")
