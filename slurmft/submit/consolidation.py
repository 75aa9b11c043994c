"""``slurmft consolidate``: (re)export a run's checkpoint as a Hugging Face model, as a job or here.

The automatic consolidation job runs once, after the train job succeeds. This is how a failed one is
rerun (full disk, wrong partition, an unwritable output) and how an intermediate checkpoint is
exported. The checks that need no torch (which checkpoint, is it complete, where to write) run here
before anything is submitted; the job itself (:mod:`slurmft.job.consolidate`) checks the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.checkpoints import COMPLETE_MARKER, is_complete, latest_complete, list_checkpoints, named
from slurmft.errors import CheckpointError
from slurmft.rundir import (
    RunPaths,
    locked,
    read_manifest,
    recorded_here,
    sweep_locked,
)

Say = Callable[[str], None]


@dataclass
class ConsolidationRequest:
    """A checked request: which checkpoint, where to write."""

    checkpoint: Path
    out: Path


def check_request(paths: RunPaths, checkpoint: str | None, out: str | None) -> ConsolidationRequest:
    """The checkpoint to export (given, or the newest complete one) and the output; refuse what cannot work."""
    read_manifest(paths)  # a run directory at all?
    found = ", ".join(f"{p.name}{'' if ok else ' (incomplete)'}" for _, p, ok in list_checkpoints(paths.checkpoints))
    if checkpoint is None:
        chosen = latest_complete(paths.checkpoints)
        if chosen is None:
            raise CheckpointError(f"nothing to consolidate: no complete checkpoint in {paths.checkpoints}",
                                  [f"found: {found or 'none'}"])
    else:
        chosen = named(paths.checkpoints, checkpoint)
        if not chosen.is_dir():
            raise CheckpointError(f"--checkpoint {checkpoint}: no such checkpoint", [f"found: {found or 'none'}"])
        if not is_complete(chosen):
            raise CheckpointError(f"--checkpoint {checkpoint}: {chosen} has no {COMPLETE_MARKER} marker (a save "
                                  "that did not finish)", [f"found: {found or 'none'}"])
    target = Path(out).expanduser().resolve() if out else paths.model
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"output {target} exists and is not a directory: remove it, or write elsewhere "
                              "with --out DIR")
    return ConsolidationRequest(chosen.resolve(), target)


def check_not_live(paths: RunPaths, request: ConsolidationRequest) -> None:
    """Into the run's own ``model/`` (the default), refuse while a job of the run may still run or cannot be seen
    (the run's one liveness, slurmft.watch.status.RunState.check_quiet): a live train job rotates the checkpoints
    being read and its chained consolidation writes ``model/`` when it ends, another consolidation writes it now.
    Elsewhere (``--out DIR``) an intermediate checkpoint may be exported while the run trains."""
    if request.out != paths.model:
        return
    from slurmft.watch.status import KINDS, run_state

    run_state(paths).check_quiet(KINDS, f"{paths.model} is not written under them (`--out DIR` exports a "
                                        "checkpoint elsewhere while the run trains)")


def consolidate_here(paths: RunPaths, request: ConsolidationRequest, say: Say, bar: bool) -> dict[str, Any]:
    """Run the consolidation in this process (a progress bar when ``bar``), recorded in the manifest."""
    from slurmft.job.consolidate.job import consolidate_run

    with recorded_here(paths, "consolidate", say, check=lambda: check_not_live(paths, request),
                       checkpoint=str(request.checkpoint), out=str(request.out)):
        if not bar:
            return consolidate_run(str(paths.root), str(request.checkpoint), str(request.out))
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                      TimeRemainingColumn()) as progress:
            task = progress.add_task(f"{request.checkpoint.name} -> {request.out}", total=None)

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            return consolidate_run(str(paths.root), str(request.checkpoint), str(request.out), advance)


def submit(paths: RunPaths, request: ConsolidationRequest, template_dir: str | None, say: Say) -> str:
    """Submit a consolidation job for ``request`` (no dependency) where the run ran; returns its id."""
    from slurmft.submit.dispatch import run_local_consolidation, submit_consolidation
    from slurmft.submit.submitted import submitted_run

    run = submitted_run(paths)
    with sweep_locked(paths.root, "consolidate", say), locked(paths, "consolidate", say,
                                                               check=lambda: check_not_live(paths, request)) as manifest:
        if run.local:
            return run_local_consolidation(run.cfg, paths, manifest, say, checkpoint=str(request.checkpoint),
                                           out=str(request.out))
        return submit_consolidation(run.cfg, run.profile, paths, manifest, str(paths.config), template_dir,
                                    checkpoint=str(request.checkpoint), out=str(request.out))
