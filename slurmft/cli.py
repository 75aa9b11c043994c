"""The ``slurmft`` command line. Thin: each command imports what it needs, never torch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from slurmft import __version__
from slurmft.errors import SlurmftError

OVERRIDES = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
CONFIG = click.argument("config", type=click.Path(dir_okay=False, path_type=Path), metavar="RUN.yaml")
RUN_DIR = click.argument("run_dir", type=click.Path(path_type=Path), metavar="RUN_DIR")


def _err(text: str) -> None:
    click.echo(text, err=True)


def _load(config: Path, overrides: tuple[str, ...]):  # noqa: ANN202 - returns (RunConfig, ClusterProfile)
    from slurmft.config import load_config
    from slurmft.profiles import load_profile

    cfg = load_config(config, list(overrides))
    profile = load_profile(cfg.cluster.profile)
    if "profile" not in cfg.cluster.model_fields_set:
        _err(f"note: no cluster.profile given; assuming {profile.name!r}: {profile.gpu.type} GPUs "
             f"({profile.gpu.memory_gb:g} GB), {profile.node_memory_gb:g} GB RAM per node (set cluster.profile to "
             f"yours: `slurmft profiles`, or a path to your own profile .yaml)")
    return cfg, profile


def _checks(cfg, config: Path):  # noqa: ANN001, ANN202 - returns slurmft.checks.Report
    """Every login-side check (slurmft.checks); all problems in one error; what was skipped, one line each."""
    from slurmft.checks import run_checks

    report = run_checks(cfg)
    report.raise_if_problems(str(config))
    for line in report.skipped:
        _err(f"not checked: {line}")
    return report


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="slurmft")
def cli() -> None:
    """Fine-tune LLMs on Slurm from one YAML file: submit, survive preemption, get a HF model.

    \b
    slurmft render run.yaml            write and print the sbatch scripts, submit nothing
    slurmft submit run.yaml            validate, submit train + consolidation jobs
    slurmft status RUN_DIR             state of every job of a run
    slurmft estimate run.yaml          will it fit? GPU and CPU memory per rank

    Overrides use dotted keys: slurmft submit run.yaml resources.nodes=4 train.max_steps=10
    """


@cli.command()
@CONFIG
@OVERRIDES
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Write the scripts into DIR.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
def render(config: Path, overrides: tuple[str, ...], out: Path | None, template_dir: str | None) -> None:
    """Render train.sbatch and consolidate.sbatch for RUN.yaml; print them, submit nothing."""
    from slurmft.render import render_scripts
    from slurmft.rundir import RunPaths, atomic_write

    cfg, profile = _load(config, overrides)
    scripts = render_scripts(cfg, profile, RunPaths.of(cfg.output_dir), str(config.resolve()), template_dir)
    for kind, text in scripts.items():
        if out:
            atomic_write(out / f"{kind}.sbatch", text)
            _err(f"wrote {out / f'{kind}.sbatch'}")
        click.echo(f"# ===== {kind}.sbatch =====")
        click.echo(text)


@cli.command()
@CONFIG
@OVERRIDES
def validate(config: Path, overrides: tuple[str, ...]) -> None:
    """Check RUN.yaml (and its cluster profile) without writing or submitting anything."""
    cfg, profile = _load(config, overrides)
    report = _checks(cfg, config)
    click.echo(f"{config}: ok (run {cfg.name}, executor {cfg.resolved_executor.value}, profile {profile.name}, "
               f"{cfg.resources.nodes} node(s) x {cfg.resources.ranks_per_node} rank(s))")
    for line in report.notes:
        click.echo(f"  {line}")


@cli.command()
@CONFIG
@OVERRIDES
@click.option("--force", is_flag=True, help="Submit even if `slurmft estimate` says it will not fit.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
def submit(config: Path, overrides: tuple[str, ...], force: bool, template_dir: str | None) -> None:
    """Validate RUN.yaml, write the run directory, submit the train job and the consolidation job."""
    from slurmft.dispatch import check_submittable, submit_run
    from slurmft.errors import ConfigError

    cfg, profile = _load(config, overrides)
    check_submittable(cfg)
    _checks(cfg, config)
    problems = _fit_problems(cfg, profile)
    if problems and not force:
        raise ConfigError("the run will not fit (see `slurmft estimate`); pass --force to submit anyway", problems)
    for p in problems:
        _err(f"warning (--force): {p}")
    result = submit_run(cfg, profile, str(config.resolve()), template_dir, say=_err)
    click.echo(f"run dir: {result.run_dir}")
    for kind, job_id in result.jobs.items():
        click.echo(f"{kind} job: {job_id}")
    if result.executor == "slurm":
        click.echo(f"follow with: slurmft status {result.run_dir}   |   slurmft logs {result.run_dir} -f")
    elif "consolidate" in result.jobs:
        click.echo(f"model: {result.run_dir / 'model'}  (AutoModelForCausalLM.from_pretrained loads it)")


def _fit_problems(cfg, profile) -> list[str]:  # noqa: ANN001
    """Problems from the memory estimate; an estimate that cannot be made never blocks a submit."""
    from slurmft.estimate import estimate, fit_problems

    try:
        return fit_problems(estimate(cfg, profile))
    except SlurmftError as exc:
        _err(f"note: no memory estimate ({exc})")
        return []


@cli.command()
@CONFIG
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (bytes as integers).")
def estimate(config: Path, overrides: tuple[str, ...], as_json: bool) -> None:
    """Will this run fit? Parameters, GPU memory per rank, CPU RAM per node at load, checkpoint size."""
    from slurmft.estimate import estimate as run_estimate
    from slurmft.estimate import render_table

    cfg, profile = _load(config, overrides)
    result = run_estimate(cfg, profile)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    from rich.console import Console

    Console().print(render_table(result))


@cli.command()
@RUN_DIR
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(run_dir: Path, as_json: bool) -> None:
    """State of every job of a run: kind, job id, attempt, state, reason, elapsed."""
    from slurmft.rundir import RunPaths, read_manifest
    from slurmft.status import job_rows

    manifest = read_manifest(RunPaths.of(run_dir))
    rows = job_rows(manifest)
    if as_json:
        click.echo(json.dumps({"run": manifest["name"], "executor": manifest["executor"], "jobs": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {manifest['name']} ({manifest['executor']})")
    for col in ("job", "id", "attempt", "state", "reason", "restarts", "elapsed"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["kind"], r["job_id"], str(r["attempt"]), r["state"], r["reason"], str(r["restarts"]),
                      r["elapsed"])
    Console().print(table)
    for r in rows:  # what each state means, one unwrapped line per job
        click.echo(f"{r['kind']} {r['job_id']}: {r['words']}")


@cli.command()
@RUN_DIR
@click.option("--job", "kind", type=click.Choice(["train", "consolidate"]), default="train", show_default=True)
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows (Ctrl-C to stop).")
@click.option("-n", "--lines", default=50, show_default=True, help="Lines of the end to show.")
def logs(run_dir: Path, kind: str, follow: bool, lines: int) -> None:
    """Show the log of the newest train (or consolidation) job of a run."""
    from slurmft.logs import log_files, tail

    files = log_files(run_dir, kind)
    tail(files, lines, follow, click.echo)


@cli.command()
@RUN_DIR
def cancel(run_dir: Path) -> None:
    """Cancel every live job of a run (train and consolidation)."""
    from slurmft.cancel import cancel_run

    cancelled = cancel_run(run_dir)
    click.echo(f"cancelled: {', '.join(cancelled)}" if cancelled else "no live jobs to cancel")


@cli.command()
def profiles() -> None:
    """List the shipped cluster profiles."""
    from slurmft.profiles import load_profile, profile_names

    for name in profile_names():
        click.echo(f"{name:16s} {load_profile(name).description}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: a SlurmftError is printed without a traceback and exits 2."""
    try:
        code = cli.main(args=argv, prog_name="slurmft", standalone_mode=False)
    except SlurmftError as exc:
        _err(f"error: {exc.render()}")
        sys.exit(2)
    except click.exceptions.Abort:
        _err("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
