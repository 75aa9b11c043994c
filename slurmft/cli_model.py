"""What ``slurmft serve RUN_DIR`` and ``slurmft eval RUN_DIR`` say and do: the model jobs' side of
:mod:`slurmft.cli` (thin like it: the work is :mod:`slurmft.submit.model_checks`'s), and the follow-up line every
command that starts a Slurm job ends with.

They say what ``status`` says of the result (the serve check's verdict, the scores base -> fine-tuned) once the
check has run here or as a local job, never the job function's raw return value; as a Slurm job, its id and how to
follow it. The records themselves, machine-readable: ``slurmft status RUN_DIR --json`` (``serve``, ``eval``).
"""

from __future__ import annotations

from pathlib import Path

import click

from slurmft.errors import ConfigError


def err(text: str) -> None:
    click.echo(text, err=True)


def follow_line(run_dir: Path, kind: str | None = None) -> str:
    """How to watch what was just submitted: its log (``--job KIND``: that job's) and the run's status."""
    job = f" --job {kind}" if kind else ""
    return f"follow with: slurmft logs {run_dir}{job} -f   |   slurmft status {run_dir}"


def model_job(run_dir: Path, kind: str, overrides: tuple[str, ...], here: bool, template_dir: str | None,
              said: dict[str, str] | None = None) -> None:
    """``slurmft serve`` / ``slurmft eval``: the overrides and the checks of the section first, then the job (or
    here); RUN_DIR/config.yaml is not written (slurmft/submit/model_checks.py says why). ``said``: an override the
    command built from an option (``--tasks``) -> how the user gave it, so that a problem in it names the option."""
    from slurmft.config_loading import read_run_config
    from slurmft.rundir import RunPaths, read_manifest
    from slurmft.submit import model_checks

    paths = RunPaths.of(run_dir)
    given = {o: (said or {}).get(o, o) for o in overrides}
    cfg, resolved = model_checks.checked_config(paths, kind, list(overrides), said)
    own = model_checks.own_tasks(read_run_config(paths.config)) if kind == "eval" and overrides else None
    problems = model_checks.problems_before(cfg, kind, err, own)
    if problems:
        where = f"{paths.config}{' with ' + ' '.join(given.values()) if given else ''}"
        problems, all_given = model_checks.from_command_line(problems, given)
        if all_given:
            where = f"the command line ({' '.join(given.values())})"
        raise ConfigError(f"{where}: {len(problems)} problem(s) found before running the {kind} job on {paths.root}",
                          problems)
    if here:  # the serve check says its verdict itself, and the evaluation its scores, as in their jobs' logs
        model_checks.run_here(paths, kind, resolved, err)
        return
    job_id = model_checks.submit(paths, kind, resolved, template_dir, err)
    click.echo(f"{kind} job: {job_id}")
    if read_manifest(paths).get("executor") == "local":  # a local job has run to its end by now
        _echo_result(paths.root, kind)
    else:
        click.echo(follow_line(paths.root, kind))


def _echo_result(root: Path, kind: str) -> None:
    from slurmft.watch.model_results import eval_lines, read_serve, serve_lines

    for line in serve_lines(read_serve(root)) if kind == "serve" else eval_lines(root):
        click.echo(line)
