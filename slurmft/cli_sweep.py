"""What the ``slurmft`` commands say and do for a sweep (a ``sweep:`` file, a sweep's directory): the sweep's side
of :mod:`slurmft.cli`, which hands a sweep here. Thin like it: the work is :mod:`slurmft.submit.sweep`'s."""

from __future__ import annotations

from pathlib import Path

import click


def err(text: str) -> None:
    click.echo(text, err=True)


def checked(config: Path, overrides: tuple[str, ...], profile, force: bool):  # noqa: ANN001, ANN202
    """RUN.yaml's sweep with every point checked (slurmft/plan/sweep_checks.py); says what it found."""
    from slurmft.plan.sweep_checks import check_points
    from slurmft.sweep import load_sweep, select_of

    sweep = load_sweep(config, list(overrides))
    assert sweep is not None
    for line in check_points(sweep, profile, force):
        err(line)
    click.echo(f"{config}: ok (sweep {sweep.cfg.name}: {len(sweep.points)} point(s), executor "
               f"{sweep.cfg.resolved_executor.value}, profile {profile.name}, ranked by "
               "{metric} ({mode}))".format(**select_of(sweep.cfg)))
    for point in sweep.points:
        click.echo(f"  {point.name}: {point.label()}")
    return sweep


def submit(config: Path, overrides: tuple[str, ...], profile, force: bool,  # noqa: ANN001
           template_dir: str | None) -> None:
    """``slurmft submit SWEEP.yaml``: every point checked, then one array; exits 1 when a point failed to submit."""
    from slurmft.submit.sweep import submit_sweep

    sweep = checked(config, overrides, profile, force)
    result = submit_sweep(sweep, profile, str(config.resolve()), template_dir, say=err)
    click.echo(f"sweep dir: {result.root}")
    n = len(sweep.points)
    for kind, job_id in result.jobs.items():  # on Slurm each job but the shared prepare job is an array of the points
        click.echo(f"{kind} job: {job_id}" if kind == "prepare" or result.executor != "slurm" else
                   f"{kind} jobs: array {job_id} ({n} points, {min(n, sweep.cfg.sweep.parallel or n)} at a time)")
    ending(result.root, result.executor)
    if result.failed:
        raise SystemExit(1)


def ending(root: Path, executor: str) -> None:
    """A Slurm sweep's jobs have only been queued: how to follow them. A local sweep's points have all run by now
    (a point that failed included): its ranking and best point, as ``slurmft status SWEEP_DIR`` says them, not a
    'follow with' that suggests something still runs."""
    if executor == "slurm":
        click.echo(f"follow with: slurmft status {root}")
        return
    from slurmft.watch.sweep import status_lines

    for line in status_lines(root):
        click.echo(line)


def resume(root: Path, overrides: tuple[str, ...], template_dir: str | None, force: bool) -> None:
    """``slurmft resume SWEEP_DIR``: each point that can go on; exits 1 when one was refused."""
    from slurmft.rundir import SweepPaths, read_sweep_record
    from slurmft.submit.sweep import resume_sweep

    done = resume_sweep(root, list(overrides), template_dir, say=err, force=force)
    for line in done.lines(root):
        click.echo(line)
    ending(root, read_sweep_record(SweepPaths(root))["executor"])
    if done.refused:
        raise SystemExit(1)


def consolidate(root: Path, checkpoint: str | None, out: str | None, here: bool, template_dir: str | None) -> None:
    """``slurmft consolidate SWEEP_DIR``: a job for every point that needs one; exits 1 when one failed."""
    from slurmft.submit.sweep import consolidate_sweep

    if checkpoint or out or here:
        raise click.UsageError("--checkpoint, --out and --here take one run: give a point's directory (SWEEP_DIR/POINT)")
    done = consolidate_sweep(root, template_dir, say=err)
    for line in done.lines():
        click.echo(line)
    if done.failed:
        raise SystemExit(1)
