"""What a resume may start from: the verified checkpoints, newest first, and whether each one fits this run.

What the Trainer does: ``train(resume_from_checkpoint=path)`` loads whatever the directory holds into the model and
optimizer this run built. Why that is not enough: discovery's check of the files against the COMPLETE marker
(slurmft/checkpoints.py) passes a checkpoint that does not fit this run, and a misfit either fails deep inside DCP
(an adapter checkpoint has no base weights to fill a full model; adapters of another rank have other shapes) or,
worse, loads and trains on in silence: another precision, another LoRA alpha or scaling rule, another base under
the adapters, an SFT checkpoint continued as DPO.

What we do: :func:`resume_candidates` (rank 0 lists the verified checkpoints, newest first, and removes torn saves;
every rank learns the list; a run whose checkpoints are all damaged stops rather than start over), and one check per
fact the marker records and this run must match, each a :class:`~slurmft.errors.JobSetupError` naming the field and
the fix: :func:`check_resume_method` (full or adapters, SFT or DPO; before the model is built, which it decides),
:func:`check_resume_base` (the base files, for LoRA and DPO), :func:`check_resume_precision` and
:func:`check_resume_adapters` (before each candidate is tried: slurmft/job/train.py, fallback.py). The job runs
each inside ``distributed.guarded``, so every rank stops together. The checks read the marker only (its JSON), never
a tensor: nothing is added to the resume's read of the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from slurmft import checkpoints
from slurmft.errors import CheckpointError, JobSetupError
from slurmft.job.distributed import DistContext
from slurmft.rundir import RunPaths

log = logging.getLogger(__name__)


def resume_candidates(paths: RunPaths, ctx: DistContext) -> list[Path]:
    """Rank 0 lists the verified checkpoints, newest first, and removes torn saves; every rank learns the list.

    A fresh start only when the run has no complete checkpoint at all: when every one is damaged
    (or was set aside after a failed load), every rank raises a CheckpointError naming them.
    """
    import torch.distributed as dist

    choice: list[list[str] | str] = [[]]
    if ctx.is_main:
        bad = [f"{path.name}: {why}" for path, why in checkpoints.damaged(paths.checkpoints)]
        bad += [f"{path.name}: failed to load before (see its {checkpoints.LOAD_FAILED_NOTE})"
                for path in checkpoints.unloadable(paths.checkpoints)]
        for line in bad:
            log.warning("skipping damaged checkpoint %s", line)
        for path in checkpoints.prune(paths.checkpoints):  # torn and damaged ones; every verified one stays
            log.warning("removed unusable checkpoint %s (a save that did not finish, or damaged)", path.name)
        good = [str(path) for path in reversed(checkpoints.verified(paths.checkpoints))]
        choice = [good if good or not bad else "\n".join(bad)]
    dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], str):
        raise CheckpointError(f"every checkpoint in {paths.checkpoints} is damaged; the job stops rather than train "
                              "from step 0. Repair them, or move them out of that directory to start this run over",
                              problems=choice[0].splitlines())
    return [Path(c) for c in choice[0]]


def check_resume_precision(checkpoint: Path, precision: str) -> None:
    """A checkpoint resumes only in the precision it was saved in (its COMPLETE marker says which)."""
    saved = checkpoints.read_marker(checkpoint).get("precision")
    if saved and saved != precision:
        raise JobSetupError(
            f"train.precision: {checkpoint.name} was trained in {saved}, this run is set to {precision}; resume "
            f"with train.precision={saved}, or start a new run (new output_dir) to change the precision"
        )


def check_resume_method(checkpoint: Path, lora: bool, method: str = "sft") -> None:
    """A full fine-tuning checkpoint resumes only without a ``lora`` section, an adapter checkpoint only with one;
    an SFT checkpoint only without a ``dpo`` section, a DPO checkpoint only with one.

    Checked before the model is built: neither kind of checkpoint can fill the other's model (an
    adapter checkpoint has no base weights; a full one has no adapters). A DPO run resumed from an SFT checkpoint
    would load SFT's optimizer and step into a DPO run (and its reference would be the base, not that checkpoint).
    A marker written before DPO existed is an SFT checkpoint.
    """
    marker = checkpoints.read_marker(checkpoint)
    was = marker.get("method", "sft")
    if was != method:
        fix = ("start DPO from it in a new run: consolidate it (slurmft consolidate) and point model.name_or_path at "
               "the consolidated model" if was == "sft" else f"put the {was}: section back to resume it")
        raise JobSetupError(
            f"{method if method != 'sft' else was}: {checkpoint.name} is {'an' if was == 'sft' else 'a'} {was.upper()} "
            f"checkpoint and this run trains "
            f"{method.upper()}; {fix}, or use a new output_dir; nothing was changed in the run directory"
        )
    saved = marker.get("lora")
    if lora and saved is None:
        raise JobSetupError(
            f"lora: {checkpoint.name} is a full fine-tuning checkpoint (every weight, no adapters), and this run "
            "has a lora section. Remove the lora section to resume the full fine-tune, or train LoRA in a new run "
            "(new output_dir); nothing was changed in the run directory"
        )
    if not lora and saved is not None:
        raise JobSetupError(
            f"lora: {checkpoint.name} is a LoRA adapter checkpoint (r={saved.get('r')}, alpha={saved.get('alpha')}: "
            "adapters only, no base weights), and this run has no lora section. Put the lora section back to "
            "resume it, or start a full fine-tune in a new run (new output_dir); nothing was changed in the run "
            "directory"
        )


def check_resume_adapters(checkpoint: Path, adapters: dict[str, Any] | None) -> None:
    """The adapters this run built (``AdapterSummary.marker()``) are the ones ``checkpoint`` saved: same rank,
    alpha, scaling rule, targets and copied modules (a different shape would fail inside DCP; a different alpha or
    use_rslora would not). A marker written before use_rslora existed trained without it."""
    saved = checkpoints.read_marker(checkpoint).get("lora")
    if adapters is None or saved is None:
        return
    saved = {"use_rslora": False, **saved}
    keys = ("r", "alpha", "use_rslora", "target_modules", "modules_to_save")
    differ = [f"{k}: {saved.get(k)!r} in the checkpoint, {adapters.get(k)!r} now" for k in keys
              if saved.get(k) != adapters.get(k)]
    if differ:
        raise JobSetupError(
            f"lora: {checkpoint.name} was trained with other adapters; resume with the lora section it was saved "
            "with, or start a new run (new output_dir)", problems=differ)


def check_resume_base(checkpoint: Path, base: dict[str, Any] | None) -> None:
    """The base model read now (``inputs.base_identity``) is the one ``checkpoint`` was trained on (its marker's
    ``base``), for the runs that read the base on every attempt: LoRA (the frozen base under the adapters), DPO (the
    reference: a copy, or the values computed from it). A checkpoint from before markers recorded it is not checked.
    A hub id follows the checkpoint's commit (``inputs.follow_trained_base``), so this refuses a replaced local
    directory, a cache whose files changed, or a revision the user pinned to another commit."""
    from slurmft.job.inputs import base_differences

    trained = checkpoints.read_marker(checkpoint).get("base")
    if base is None or not isinstance(trained, dict):
        return
    differ = base_differences(trained, base)
    if differ:
        raise JobSetupError(
            f"model.name_or_path: the base model is not the one {checkpoint.name} was trained on "
            f"({trained.get('name_or_path')}{', revision ' + trained['revision'] if trained.get('revision') else ''}); "
            "resuming would continue on other weights. Put that base back (or point model.name_or_path and "
            "model.revision at it), or start a new run (new output_dir); nothing was changed in the run directory",
            problems=differ)
