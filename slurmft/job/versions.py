"""What differs between the library versions the job supports, each difference handled in this one room.

The job is tested on two version sets: torch 2.13 + transformers 5.24 (CI, ``.ci/constraints.txt``) and torch
2.11 + transformers 5.17 + accelerate 1.15 on Python 3.12, the lent GPU machine's image
(``bench/gpu_image_env.sh`` builds it here and runs the job's CPU tests in it; docs/development.md). pyproject's
lower bounds are the older set. Each function below says what differs, from which version, and how both are
handled.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


def no_trainer_checkpointing(config_cls: type) -> dict[str, bool]:
    """The Trainer's own activation checkpointing, off (FSDP-level checkpointing is applied at load), under the
    name the installed transformers gives it: ``activation_checkpointing`` from 5.23, ``gradient_checkpointing``
    before (5.23 keeps that as a deprecated alias until v6; 5.17 rejects the new name: "unexpected keyword
    argument 'activation_checkpointing'")."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False}


def reusable_stager(options: Any) -> Any:
    """A DCP ``DefaultStager`` that stages again and again into the CPU buffers of its first stage.

    torch 2.11's ``DefaultStager._stage`` closes its inner ``StateDictStager`` at the end of every stage (a
    2.11 regression, pytorch#183413, fixed by pytorch#183424; 2.13 keeps it open): that empties the stager's
    deepcopy table and its buffer cache, so the next ``stage`` of the same stager raises ``KeyError: <class
    'type'>`` (a checkpoint is two stages, the model and the optimizer: the first asynchronous save failed), and
    even a fresh stager per save would allocate every CPU copy (pinned, on a GPU) anew. Where the installed torch
    does that, the inner close waits for the stager's own :meth:`close`; elsewhere the stager is untouched.
    """
    from torch.distributed.checkpoint.staging import DefaultStager

    stager = DefaultStager(options)
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is None or not _stager_closes_after_each_stage():
        return stager
    close_inner, close_outer = inner.close, stager.close
    inner.close = lambda: None

    def close() -> None:
        close_outer()
        close_inner()

    stager.close = close
    return stager


@functools.cache
def _stager_closes_after_each_stage() -> bool:
    """Whether a second ``stage`` of one CPU ``DefaultStager`` fails (torch 2.11), tried on a one-element tensor."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    probe = DefaultStager(StagingOptions(False, False, False, False))
    try:
        probe.stage({"t": torch.zeros(1)})
        probe.stage({"t": torch.zeros(1)})
    except KeyError:
        return True
    finally:
        probe.close()
    return False
