"""Optional packages a job process does not use are kept out of it, before torch and transformers load.

transformers, TRL and accelerate import some optional packages merely because they are installed:
torchao (through transformers' quantizers, ~1.6 s and two "Failed to load ..._C_*.so" lines on a
CPU-only or older GPU build), wandb (through TRL's trainer base, ~0.7 s), peft (through
``transformers.trainer_utils``, ~0.6 s), scipy (through transformers' object-detection loss, which every
model import loads: ~1 s) and boto3 (through accelerate, ~0.3 s). Every rank pays that at every start,
requeue and resume. A run that uses none of them does not need them: they are marked absent
(``sys.modules[name] = None``, the interpreter's own way of blocking an import), so the libraries'
availability checks (``importlib.util.find_spec``) answer "not installed" and skip them. A run that uses one keeps it:

- torchao: ``train.optimizer=adamw-stochastic-rounding``, or an ``optim`` passed through ``train.sft``;
- wandb: ``train.report_to`` names wandb (the train job, and the evaluation job, which sends its scores there);
- peft: the run has a ``lora`` section;
- scipy: never (no job of ours calls it; datasets reads MATLAB files with it, transformers matches boxes for
  object detection);
- boto3: never (accelerate imports it, ~0.3 s, for its SageMaker launcher only; data on S3 goes through s3fs,
  which uses botocore).

``SLURMFT_IMPORT_EVERYTHING=1`` in the job's environment turns this off (a model's remote code that
imports one of them itself, say).

A package kept out is still installed: :func:`installed` answers for it as the interpreter did before it was
marked, so a check that asks "is wandb installed?" (``train.report_to``, which the prepare job checks for the
train job that follows it) gets the same answer in every job. tests/job/test_prepare.py runs the prepare job with
every optional feature on, which is how the first version of this module was found to break it (W&B runs failed
in their prepare job: "wandb is enabled but the wandb package is not installed").
"""

from __future__ import annotations

import os
import sys

from slurmft.config import RunConfig
from slurmft.config_loading import read_run_config
from slurmft.errors import SlurmftError
from slurmft.rundir import RunPaths

#: Set this to 1 in the job's environment to import every installed package as the libraries decide.
OPT_OUT = "SLURMFT_IMPORT_EVERYTHING"

#: What this process marked absent (empty: nothing, or the opt-out was set); the train job logs it.
kept_out: tuple[str, ...] = ()
#: Of those, the ones installed here (found before they were marked absent).
_installed_but_kept_out: frozenset[str] = frozenset()


def installed(name: str) -> bool:
    """Whether package ``name`` is installed for this interpreter, whether or not this process keeps it out."""
    import importlib.util

    if name in kept_out:
        return name in _installed_but_kept_out
    return importlib.util.find_spec(name) is not None


def unused(cfg: RunConfig, job: str) -> list[str]:
    """The optional packages that ``job`` (train, prepare or consolidate) of this run does not import."""
    t = cfg.train
    needs = {
        "torchao": job == "train" and (t.optimizer == "adamw-stochastic-rounding" or "optim" in t.sft),
        "wandb": job in ("train", "eval") and "wandb" in t.report_to,
        "peft": job != "prepare" and cfg.lora is not None,
        "scipy": False,
        "boto3": False,
    }
    return [name for name, needed in needs.items() if not needed]


def keep_out(run_dir: str | os.PathLike[str], job: str) -> tuple[str, ...]:
    """Mark the packages ``job`` of the run in ``run_dir`` does not use absent in this process; returns them.

    A package this process imported already stays. Does nothing when the opt-out is set or when the run's
    config cannot be read (the job itself then reports that, as it would have)."""
    global kept_out, _installed_but_kept_out
    if os.environ.get(OPT_OUT, "").strip() in ("1", "true", "yes"):
        return ()
    try:
        cfg = read_run_config(RunPaths.of(run_dir).config)
    except (SlurmftError, OSError, ValueError):
        return ()
    import importlib.util

    names = tuple(n for n in unused(cfg, job) if n not in sys.modules)
    _installed_but_kept_out = frozenset(n for n in names if importlib.util.find_spec(n) is not None)
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError, find_spec says None
    kept_out = names
    return names
