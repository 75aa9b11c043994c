"""The loss types of the installed TRL's ``DPOTrainer``, read without importing TRL (nor torch), and the names of
the metrics it logs.

TRL 1.16 keeps no list of them: ``DPOConfig.loss_type`` is a free ``list[str]`` and an unknown name
fails only when the first batch reaches ``DPOTrainer._compute_loss`` (a ``ValueError`` on every rank,
after the model was loaded and the data prepared). The accepted names are the branches of that
method (``loss_type == "sigmoid"``, ...), so they are read from the installed source file: the login
side stays torch-free (``slurmft validate``), and the job checks the same names before any collective.
Like :mod:`slurmft.sftopts`, no slurmft imports: either side can load it.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

#: what TRL's DPOTrainer logs beside the loss: the implicit rewards (beta x log-ratio to the reference), their margin
#: and how often the chosen reply wins; the job keeps them in metrics.jsonl, status, plot and the report show them
PREFERENCE_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")

BRANCH_RE = re.compile(r"""loss_type\s*==\s*["']([A-Za-z0-9_]+)["']""")
DPO_TRAINER_FILE = "trainer/dpo_trainer.py"  # trl.trainer.dpo_trainer, inside the trl package


@functools.cache
def read_trl_file(relative: str) -> tuple[str | None, str]:
    """(the text of a file inside the installed trl package, TRL's version), or (None, why not); nothing imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        trl_version = version("trl")
        spec = importlib.util.find_spec("trl")  # the top-level package only: finding it imports nothing
    except (PackageNotFoundError, ModuleNotFoundError, ValueError):
        return None, "trl is not installed here"
    if spec is None or not spec.origin:
        return None, "trl is not installed here"
    path = Path(spec.origin).parent / relative
    try:
        return path.read_text(), trl_version
    except OSError as exc:
        return None, f"cannot read {path} ({exc.strerror})"


@functools.cache
def dpo_loss_types() -> tuple[tuple[str, ...] | None, str]:
    """(the loss types the installed DPOTrainer computes, in its order; TRL's version), or (None, why not)."""
    source, trl_version = read_trl_file(DPO_TRAINER_FILE)
    if source is None:
        return None, trl_version
    names = tuple(dict.fromkeys(BRANCH_RE.findall(source)))
    if not names:
        return None, f"no loss types found in TRL {trl_version}'s DPOTrainer (a new layout?)"
    return names, trl_version


def loss_type_problems(loss_types: list[str], where: str = "dpo.loss_type") -> list[str]:
    """Problems with ``dpo.loss_type`` against the installed TRL (none when TRL is absent: the job checks)."""
    import difflib

    known, trl_version = dpo_loss_types()
    if known is None:
        return []
    problems = []
    for name in loss_types:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"{where}: {name!r} is not a loss type of TRL {trl_version}'s DPOTrainer; {hint}"
                            f"one of {', '.join(known)}")
    return problems
