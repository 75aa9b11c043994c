"""What ``slurmft logs RUN_DIR`` checks and prints beyond the newest job's tail: the logs side of :mod:`slurmft.cli`
(thin like it: the work is :mod:`slurmft.watch.logs`'s)."""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource


def kind_of_job(run_dir: Path, job_id: str, kind: str) -> str:
    """``logs --job-id``: the kind the manifest records of that job; an id the run does not have, or a ``--job`` of
    another kind, is the command line's mistake."""
    from slurmft.rundir import RunPaths
    from slurmft.watch.logs import UnknownJobId, job_with_id

    try:
        job = job_with_id(RunPaths.of(run_dir), job_id)
    except UnknownJobId as exc:
        raise click.BadParameter(str(exc), param_hint="'--job-id'") from None
    if kind != job["kind"] and click.get_current_context().get_parameter_source("kind") != ParameterSource.DEFAULT:
        raise click.UsageError(f"--job {kind}: job {job_id} is the run's {job['kind']} job (--job-id alone names it)")
    return job["kind"]


def filtered(run_dir: Path, kind: str, follow: bool, lines: int, rank: int | None, attempt: int | None,
             job_id: str | None) -> None:
    """``logs --rank/--attempt``: one attempt whole, or the last ``lines`` of one rank's lines (of the job
    ``job_id`` when given)."""
    from slurmft.watch.logs import select_lines

    if follow:
        raise click.UsageError("-f cannot be combined with --rank or --attempt (they show a snapshot)")
    out = select_lines(run_dir, kind, rank=rank, attempt=attempt, job_id=job_id)
    for line in out if attempt is not None else out[-lines:]:
        click.echo(line)
