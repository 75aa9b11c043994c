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
# readable=False: a run directory we may not read is said by read_manifest, with whose it is and the fix
RUN_DIR = click.argument("run_dir", type=click.Path(path_type=Path, readable=False), metavar="RUN_DIR")


def _err(text: str) -> None:
    click.echo(text, err=True)


def _load(config: Path, overrides: tuple[str, ...]):  # noqa: ANN202 - returns (RunConfig, ClusterProfile)
    from slurmft.config import Executor
    from slurmft.config_loading import load_config
    from slurmft.profiles import profile_for_run

    cfg = load_config(config, list(overrides))
    profile = profile_for_run(cfg)
    if "profile" not in cfg.cluster.model_fields_set:
        # a CPU run (the README's tiny example, the first command a newcomer runs) uses no GPU: its type is noise
        gpus = f"{profile.gpu.type} GPUs ({profile.gpu.memory_gb:g} GB), " if cfg.resources.gpus_per_node else ""
        ram = (f"this machine's {profile.node_memory_gb:g} GB RAM, where the local executor runs the ranks"
               if cfg.resolved_executor == Executor.LOCAL else f"{profile.node_memory_gb:g} GB RAM per node")
        _err(f"note: no cluster.profile given; assuming {profile.name!r}: {gpus}{ram} (set cluster.profile to "
             f"yours: `slurmft profiles`, or a path to your own profile .yaml)")
    return cfg, profile


def _load_plan(config: Path, overrides: tuple[str, ...]):  # noqa: ANN202 - returns (RunConfig, ClusterProfile)
    """``validate``/``estimate``: a run directory's ``config.yaml`` with overrides is read as ``slurmft resume``
    would resume it (only the overrides a resume accepts; on another allocation the batch recomputed to keep the
    global batch: slurmft/plan/elastic.py), so the new allocation is checked before anything is queued."""
    from slurmft.rundir import RunPaths

    paths = RunPaths.of(config.parent)
    if config.name != paths.config.name or not paths.manifest.is_file():
        return _load(config, overrides)
    from slurmft.checkpoints import latest_complete
    from slurmft.profiles import profile_for_run
    from slurmft.rundir import read_manifest
    from slurmft.submit.resume import check_overrides, resume_config

    check_overrides(list(overrides))
    cfg = resume_config(paths, list(overrides), read_manifest(paths).get("executor", "slurm"),
                        latest_complete(paths.checkpoints), lambda note: _err(f"note: {note}"))
    return cfg, profile_for_run(cfg)


def _checks(cfg, config: Path):  # noqa: ANN001, ANN202 - returns slurmft.plan.checks.Report
    """Every login-side check (slurmft.plan.checks); all problems in one error; what was skipped, one line each."""
    from slurmft.plan.checks import run_checks

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
    slurmft submit run.yaml            validate, submit prepare -> train -> consolidation (-> serve, eval)
    slurmft prepare RUN_DIR|run.yaml   tokenize and pack the data once, on CPUs (--here: right here)
    slurmft status RUN_DIR             state of every job of a run, the serve check and the scores
    slurmft logs RUN_DIR [--job KIND]  the newest job's log (train, consolidate, prepare, serve, eval)
    slurmft cancel RUN_DIR             cancel every live job of a run
    slurmft runs [DIR]                 every run under DIR: state, step, loss, age
    slurmft resume RUN_DIR             continue a run that died, from its newest checkpoint
    slurmft consolidate RUN_DIR        (re)export a checkpoint as a Hugging Face model
    slurmft serve|eval RUN_DIR         the serve check (vLLM) or the evaluation (lm-eval) again
    slurmft estimate run.yaml          will it fit? GPU and CPU memory per rank
    slurmft doctor [run.yaml]          can this run survive on this cluster? (--job: probe the nodes)

    Overrides use dotted keys: slurmft submit run.yaml resources.nodes=4 train.max_steps=10
    """


@cli.command()
@CONFIG
@OVERRIDES
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Write the scripts into DIR.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
def render(config: Path, overrides: tuple[str, ...], out: Path | None, template_dir: str | None) -> None:
    """Render train.sbatch and consolidate.sbatch (and prepare.sbatch with prepare.enabled) for RUN.yaml; print
    them, submit nothing. A sweep: its arrays' scripts, then each point's (POINT/train.sbatch, ...)."""
    from slurmft.plan.render import render_scripts, render_sweep_arrays
    from slurmft.rundir import RunPaths, atomic_write

    cfg, profile = _load(config, overrides)
    if cfg.sweep is not None:
        from slurmft.sweep import load_sweep

        sweep = load_sweep(config, list(overrides))
        scripts = render_sweep_arrays(sweep, profile, str(config.resolve()), template_dir)
        for p, point_cfg in zip(sweep.points, sweep.configs, strict=True):
            scripts |= {f"{p.name}/{kind}": text for kind, text in render_scripts(
                point_cfg, profile, RunPaths.of(point_cfg.output_dir), str(config.resolve()), template_dir).items()}
    else:
        scripts = render_scripts(cfg, profile, RunPaths.of(cfg.output_dir), str(config.resolve()), template_dir)
    if cfg.resolved_executor.value == "local":
        _err("note: executor local: `slurmft submit` runs these jobs here as processes, not these sbatch scripts; they "
             "are what executor=slurm would submit (and what the run directory's scripts/ keeps)")
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
    """Check RUN.yaml (and its cluster profile) without writing or submitting anything.

    RUN_DIR/config.yaml with overrides: checks the run as `slurmft resume RUN_DIR OVERRIDES` would continue it."""
    cfg, profile = _load_plan(config, overrides)
    if cfg.sweep is not None:
        from slurmft import cli_sweep

        cli_sweep.checked(config, overrides, profile, force=False)
        return
    from slurmft.plan.elastic import allocation
    from slurmft.watch.progress import allocation_words

    report = _checks(cfg, config)
    result = _estimate(cfg, profile)[0]
    _warn_lead_time(result, cfg, profile)
    click.echo(f"{config}: ok (run {cfg.name}, executor {cfg.resolved_executor.value}, profile {profile.name}, "
               f"{cfg.resources.nodes} node(s) x {cfg.resources.ranks_per_node} rank(s)"
               f"{'' if cfg.train_nodes == cfg.resources.nodes else ':' + allocation_words(allocation(cfg))})")
    if cfg.lora is not None:
        from slurmft.plan.estimate_text import lora_summary
        from slurmft.plan.settings import LoraSettings

        click.echo(f"  {lora_summary(LoraSettings.of(cfg.lora), result['lora'] if result else None)}")
    for line in report.notes:
        click.echo(f"  {line}")
    _prepared_note(cfg)
    from slurmft.submit.dispatch import run_dir_refusal

    if config.resolve().parent != Path(cfg.output_dir).resolve() and (why := run_dir_refusal(cfg)):
        click.echo(f"  note: `slurmft submit` would refuse this output_dir: {why}")  # RUN_DIR/config.yaml: a resume


def _prepared_note(cfg) -> None:  # noqa: ANN001
    """What ``slurmft prepare run.yaml --here`` left in output_dir/prepared/: its counts, or why it is stale."""
    from slurmft import prepared
    from slurmft.rundir import RunPaths

    paths = RunPaths.of(cfg.output_dir)
    try:
        record = prepared.check(paths, cfg)
    except SlurmftError as exc:
        click.echo(f"  prepared data: does not match ({'; '.join(exc.problems[:-1]) or exc}): prepare it again")
        return
    if record is not None:
        click.echo(f"  prepared data: {prepared.summary_line(record)}")


@cli.command()
@CONFIG
@OVERRIDES
@click.option("--force", is_flag=True, help="Submit even if `slurmft estimate` says it will not fit.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
def submit(config: Path, overrides: tuple[str, ...], force: bool, template_dir: str | None) -> None:
    """Validate RUN.yaml, write the run directory, submit the train job and the consolidation job."""
    from slurmft.errors import ConfigError
    from slurmft.submit.dispatch import check_submittable, submit_run

    cfg, profile = _load(config, overrides)
    if cfg.sweep is not None:
        from slurmft import cli_sweep

        cli_sweep.submit(config, overrides, profile, force, template_dir)
        return
    check_submittable(cfg)
    _checks(cfg, config)
    result, why = _estimate(cfg, profile)
    if why:
        _err(f"note: no memory estimate ({why})")
    problems = result["problems"] if result else []  # estimate_text.fit_problems, computed with it
    _warn_lead_time(result, cfg, profile)
    if problems and not force:
        raise ConfigError("the run will not fit (see `slurmft estimate`); pass --force to submit anyway", problems)
    for p in problems:
        _err(f"warning (--force): {p}")
    submitted = submit_run(cfg, profile, str(config.resolve()), template_dir, say=_err)
    _echo_jobs(submitted.run_dir, submitted.executor, submitted.jobs)


def _echo_jobs(run_dir: Path, executor: str, jobs: dict[str, str]) -> None:
    """What a submit or resume started, and how to follow it."""
    from slurmft.submit.console import job_lines

    click.echo("\n".join([f"run dir: {run_dir}", *job_lines(run_dir, executor, jobs)]))
    if executor == "slurm":
        from slurmft.cli_model import follow_line

        click.echo(follow_line(run_dir))
    elif "consolidate" in jobs:  # local: the jobs have run; say what they left (a LoRA run: an adapter, maybe no model)
        from slurmft.watch.results import result_lines
        click.echo("\n".join(result_lines(run_dir)))


def _estimate(cfg, profile) -> tuple[dict | None, str | None]:  # noqa: ANN001
    """The memory estimate, or (None, why) when it cannot be made: that never blocks a submit."""
    from slurmft.plan.estimate import estimate

    try:
        return estimate(cfg, profile), None
    except SlurmftError as exc:
        return None, str(exc)


def _warn_lead_time(result: dict | None, cfg, profile) -> None:  # noqa: ANN001
    """Warn when preemption.lead_time_s is below the projected save time (never blocks)."""
    from slurmft.plan.estimate_text import lead_time_warning

    if result is None:
        return  # submit already said why there is no estimate; validate stays quiet about it
    warning = lead_time_warning(result)
    if warning:
        _err(f"warning: {warning}")


@cli.command()
@CONFIG
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (bytes as integers).")
def estimate(config: Path, overrides: tuple[str, ...], as_json: bool) -> None:
    """Will this run fit? Parameters, GPU memory per rank, CPU RAM per node at load, checkpoint size.

    RUN_DIR/config.yaml with overrides: the run as `slurmft resume RUN_DIR OVERRIDES` would continue it."""
    from slurmft.plan.estimate import estimate as run_estimate
    from slurmft.plan.estimate_text import render_table

    cfg, profile = _load_plan(config, overrides)
    if cfg.sweep is not None:  # every point; the array's allocation must hold the largest
        from slurmft.sweep import load_sweep

        sweep = load_sweep(config, list(overrides))
        results = {p.name: run_estimate(c, profile) for p, c in zip(sweep.points, sweep.configs, strict=True)}
    else:
        results = {"": run_estimate(cfg, profile)}
    if as_json:
        click.echo(json.dumps(results[""] if cfg.sweep is None else results, indent=2))
        return
    from rich.console import Console

    for name, result in results.items():
        if name:
            click.echo(f"point {name}:")
        Console().print(render_table(result))


@cli.command()
@RUN_DIR
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(run_dir: Path, as_json: bool) -> None:
    """State of every job of a run: kind, job id, attempt, state, reason, elapsed, and what to do next.

    A sweep's directory: one row per point (overrides, state, step, loss, score), the points ranked, SWEEP_DIR/best."""
    from slurmft.rundir import RunPaths, is_sweep_dir
    from slurmft.watch.progress import overview, overview_lines
    from slurmft.watch.status import run_state

    if is_sweep_dir(run_dir):
        from slurmft.watch.sweep import status_lines

        for line in status_lines(run_dir, as_json):
            click.echo(line)
        return
    paths = RunPaths.of(run_dir)
    state = run_state(paths)
    manifest, rows = state.manifest, state.rows
    ov = overview(paths, manifest, rows)
    if as_json:
        from slurmft.eval_results import read_summary
        from slurmft.watch.model_results import read_serve

        click.echo(json.dumps({"run": manifest["name"], "executor": manifest["executor"], "jobs": rows, **ov,
                               "run_attempts": manifest.get("attempts", []), "problems": state.problems,
                               "serve": read_serve(paths.root), "eval": read_summary(paths.root)},
                              indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {manifest['name']} ({manifest['executor']})")
    for col in ("job", "id", "attempt", "state", "reason", "restarts", "elapsed"):
        table.add_column(col)
    for r in rows:
        by = r.get("submitter") or {}
        theirs = f" ({by.get('user')}'s)" if state.owner and by.get("uid", state.owner.uid) != state.owner.uid else ""
        kind = r["kind"] + (f" {r['task'] + 1}/{r['tasks']}" if "task" in r else "")  # the array task
        table.add_row(kind, r["job_id"] + (" (adopted)" if r.get("adopted") else "") + theirs,
                      str(r["attempt"]), r["state"], r["reason"], str(r["restarts"]), r["elapsed"])
    Console().print(table)
    for r in rows:  # what each state means, one unwrapped line per job
        click.echo(f"{r['kind']} {r['job_id']}: {r['words']}")
    for line in overview_lines(ov):
        click.echo(line)
    from slurmft.watch.model_results import result_lines

    for line in result_lines(paths.root, rows):
        click.echo(line)
    for job in state.adopted:
        click.echo(f"note: {job['kind']} job {job['job_id']} carries this run's tag but was missing from the "
                   "manifest (a submit interrupted after sbatch?); it is now recorded")
    for p in state.problems:
        click.echo(f"note: {p}")


@cli.command()
@RUN_DIR
@click.option("--job", "kind", type=click.Choice(["train", "consolidate", "prepare", "serve", "eval"]), default="train",
              show_default=True)
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows, until the job has ended (or Ctrl-C).")
@click.option("-n", "--lines", type=click.IntRange(min=0), help="Lines of the end to show (default 50; a sweep's: "
              "10 per point).")
@click.option("--rank", type=click.IntRange(min=0), help="Only this global rank's lines.")
@click.option("--attempt", type=click.IntRange(min=1),
              help="Only the K-th attempt (1 = first; requeues and resumes each count), all of it.")
@click.option("--job-id", metavar="ID", help="This job's log, of any kind (an older consolidation a later one "
              "superseded; `slurmft status RUN_DIR` lists the ids).")
@click.option("--point", help="A sweep's directory: this point's logs (as its own directory's; the other options "
              "apply). Without it: the end of every point's log.")
def logs(run_dir: Path, kind: str, follow: bool, lines: int | None, rank: int | None, attempt: int | None,
         job_id: str | None, point: str | None) -> None:
    """Show the log of the newest job of a kind of a run (--job train, consolidate, prepare, serve or eval; train by
    default), or of one job by its id, or of each point of a sweep."""
    from slurmft.cli_logs import filtered, kind_of_job
    from slurmft.rundir import is_sweep_dir
    from slurmft.watch.logs import ended_words, job_now, log_files, sweep_log_lines, tail
    from slurmft.watch.sweep import point_dir

    if is_sweep_dir(run_dir) and point is None:
        if follow or rank is not None or attempt is not None or job_id is not None:
            raise click.UsageError("-f, --rank, --attempt and --job-id read one point's log: add --point NAME "
                                   "(`slurmft status SWEEP_DIR` names the points)")
        for line in sweep_log_lines(run_dir, kind, 10 if lines is None else lines):
            click.echo(line)
        return
    if point is not None:
        if not is_sweep_dir(run_dir):
            raise click.UsageError(f"--point: {run_dir} is not a sweep's directory (it has no sweep.json)")
        run_dir = point_dir(run_dir, point)
    if job_id is not None:
        kind = kind_of_job(run_dir, job_id, kind)
    lines = 50 if lines is None else lines
    if rank is not None or attempt is not None:
        filtered(run_dir, kind, follow, lines, rank, attempt, job_id)
        return
    files = log_files(run_dir, kind, job_id)
    tail(files, lines, follow, click.echo, ended_words(run_dir, kind, job_id) if follow else None,
         why_no_log=job_now(run_dir, kind, job_id), more=lambda: log_files(run_dir, kind, job_id))


@cli.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path), default=".",
                metavar="[DIR]")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def runs(directory: Path, as_json: bool) -> None:
    """Every run directory under DIR (default: here, 3 levels deep): state, step, last loss, age."""
    from slurmft.watch.runs import MAX_DEPTH, format_rows, run_lines

    rows = run_lines(directory)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo(f"no run directories (with a manifest.json) under {directory}, {MAX_DEPTH} levels deep")
        return
    for line in format_rows(rows, directory):
        click.echo(line)
    for r in rows:
        if r["problem"]:
            click.echo(f"{r['path']}: {r['problem']}")


@cli.command()
@RUN_DIR
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="PNG to write (default RUN_DIR/loss.png).")
def plot(run_dir: Path, out: Path | None) -> None:
    """Loss and learning rate by step, each restart or resume marked (needs the `plot` extra: matplotlib). A sweep's
    directory: every point's loss on one picture (SWEEP_DIR/loss.png)."""
    from slurmft.rundir import is_sweep_dir
    from slurmft.watch.plot import plot_run
    from slurmft.watch.sweep import plot_sweep

    click.echo(f"wrote {(plot_sweep if is_sweep_dir(run_dir) else plot_run)(run_dir, out)}")


@cli.command()
@RUN_DIR
def report(run_dir: Path) -> None:
    """(Re)write RUN_DIR/report.md and loss.png: config, allocation, attempts, time lost, loss, memory, model."""
    from slurmft.watch.report import write_report

    click.echo(f"wrote {write_report(run_dir)}")


FORCE_OTHERS = click.option("--force", is_flag=True,
                            help="Act on another user's run (a teammate's); jobs you cannot see are still never "
                                 "taken for ended.")


@cli.command()
@RUN_DIR
@FORCE_OTHERS
def cancel(run_dir: Path, force: bool) -> None:
    """Cancel every live job of a run (prepare, train, consolidation, serve check, evaluation, and tagged jobs the
    manifest missed); of every point of a sweep's directory."""
    from slurmft.rundir import is_sweep_dir
    from slurmft.submit.cancel import cancel_run, cancel_sweep

    result = (cancel_sweep if is_sweep_dir(run_dir) else cancel_run)(run_dir, force, say=_err)
    for line in result.not_touched:
        _err(f"not cancelled: {line}")
    click.echo(f"cancelled: {', '.join(result.cancelled)}" if result.cancelled else "no live jobs to cancel")


@cli.command()
@RUN_DIR
@OVERRIDES
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
@FORCE_OTHERS
def resume(run_dir: Path, overrides: tuple[str, ...], template_dir: str | None, force: bool) -> None:
    """Continue a run that died (failed, cancelled, time limit, node failure, requeue budget used up)
    from its newest complete checkpoint, and chain a new consolidation job.

    Overrides may change only where and how it runs: cluster.*, preemption.*, consolidate.*, prepare.resources.*,
    serve.*, eval.*, checkpoint.keep_last, checkpoint.every_steps, checkpoint.async, checkpoint.max_failed_saves,
    train.logging_steps, resources.* and the batch keys (the global batch stays: accumulation is recomputed;
    check it first with `slurmft estimate RUN_DIR/config.yaml resources...`).
    """
    from slurmft.rundir import is_sweep_dir
    from slurmft.submit.resume import Phase, resume_run

    if is_sweep_dir(run_dir):
        from slurmft import cli_sweep

        cli_sweep.resume(run_dir, overrides, template_dir, force)
        return
    result = resume_run(run_dir, list(overrides), template_dir, say=_err, force=force)
    if result.phase == Phase.FINISHED:
        click.echo(f"{result.run_dir} is finished: trained to step {result.step} and consolidated; nothing to resume")
        from slurmft.rundir import ADAPTER_CONFIG, MODEL_INDEX, RunPaths

        paths = RunPaths.of(result.run_dir)
        if (paths.model / MODEL_INDEX).is_file():
            click.echo(f"model: {paths.model}")
        if (paths.adapter / ADAPTER_CONFIG).is_file():  # a LoRA run
            click.echo(f"adapter: {paths.adapter}")
        return
    _echo_jobs(result.run_dir, result.executor, result.jobs)


@cli.command()
@RUN_DIR
@click.option("--checkpoint", help="A checkpoint directory, or a name like checkpoint-500 (default: newest complete).")
@click.option("--out", help="Output directory (default: RUN_DIR/model).")
@click.option("--here", is_flag=True, help="Run it in this process (needs the training stack), not as a job.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
def consolidate(run_dir: Path, checkpoint: str | None, out: str | None, here: bool, template_dir: str | None) -> None:
    """Export a run's checkpoint as a Hugging Face model: rerun a failed consolidation, or export an
    intermediate checkpoint. Submits a consolidation job unless --here. A sweep's directory: every point with a
    complete checkpoint, no model and no live job, one job each."""
    from slurmft.rundir import RunPaths, is_sweep_dir, read_manifest
    from slurmft.submit import consolidation

    if is_sweep_dir(run_dir):
        from slurmft import cli_sweep

        cli_sweep.consolidate(run_dir, checkpoint, out, here, template_dir)
        return
    paths = RunPaths.of(run_dir)
    request = consolidation.check_request(paths, checkpoint, out)
    if here:
        summary = consolidation.consolidate_here(paths, request, _err, bar=sys.stderr.isatty())
        if summary.get("adapter"):  # a LoRA run: the adapter, and the merged model unless consolidate.merge: false
            click.echo(f"adapter: {summary['adapter']['output']}  ({summary['adapter']['parameters']:,} adapter "
                       f"parameters from {Path(summary['checkpoint']).name})")
        if summary.get("model"):
            click.echo(f"model: {summary['model']}  ({summary['parameters']:,} parameters from "
                       f"{Path(summary['checkpoint']).name}, {summary['seconds']} s)")
        return
    job_id = consolidation.submit(paths, request, template_dir, _err)
    click.echo(f"consolidate job: {job_id}  ({request.checkpoint.name} -> {request.out})")
    if read_manifest(paths).get("executor") != "local":  # a Slurm job (a local one has run to its end by now)
        from slurmft.cli_model import follow_line

        click.echo(follow_line(run_dir, "consolidate"))



@cli.command()
@RUN_DIR
@OVERRIDES
@click.option("--here", is_flag=True, help="Run it in this process (needs the training stack), not as a job.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
def serve(run_dir: Path, overrides: tuple[str, ...], here: bool, template_dir: str | None) -> None:
    """Check again that a run's model serves with vLLM as it trained (the serve section; RUN_DIR/serve/).

    Overrides change this check's settings: serve.* and the cluster keys its script reads (cluster.partition,
    account, qos, env, setup, python, container, profile), e.g. serve.max_new_tokens=32 serve.resources.time=30;
    RUN_DIR/config.yaml stays as the run trained (docs/serve-eval.md)."""
    from slurmft.cli_model import model_job

    model_job(run_dir, "serve", overrides, here, template_dir)


@cli.command(name="eval")
@RUN_DIR
@OVERRIDES
@click.option("--tasks", help="Comma-separated lm-eval tasks instead of the config's (names or files): the same as "
                              "eval.tasks=[a,b].")
@click.option("--here", is_flag=True, help="Run it in this process (needs the training stack), not as a job.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
def evaluate(run_dir: Path, overrides: tuple[str, ...], tasks: str | None, here: bool, template_dir: str | None) -> None:
    """Score a run's model (and the base) with lm-eval again, without retraining (the eval section; RUN_DIR/eval/).

    Overrides change this evaluation's settings: eval.* and the cluster keys its script reads (cluster.partition,
    account, qos, env, setup, python, container, profile), e.g. eval.tasks=[hellaswag] eval.limit=50; a run
    submitted without an eval section gets one so. RUN_DIR/config.yaml stays as the run trained (docs/serve-eval.md)."""
    from slurmft.cli_model import model_job

    said = {}
    if tasks is not None:
        from slurmft.eval_tasks import tasks_override

        if any(o.split("=", 1)[0].strip().startswith("eval.tasks") for o in overrides):
            raise click.UsageError("give the tasks once: --tasks a,b or eval.tasks=[a,b], not both")
        said = {tasks_override(tasks): f"--tasks {tasks}"}
        overrides = (*overrides, *said)
    model_job(run_dir, "eval", overrides, here, template_dir, said)


@cli.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path, readable=False), metavar="RUN.yaml|RUN_DIR")
@OVERRIDES
@click.option("--here", is_flag=True, help="Prepare in this process (needs the training stack), not as a job.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
@FORCE_OTHERS
def prepare(target: Path, overrides: tuple[str, ...], here: bool, template_dir: str | None, force: bool) -> None:
    """Prepare the data once into RUN_DIR/prepared/ (load, convert, tokenize and pack with TRL's own
    preparation): token counts and the packing ratio before any GPU is asked for (docs/prepare.md).

    \b
    RUN_DIR           prepare a run's data again (a prepare job; --here: in this process), e.g. after a
                      source changed: then `slurmft resume RUN_DIR`
    RUN.yaml          a new run directory (output_dir) with only its prepare job: see the counts with
                      `slurmft status`, then train with `slurmft resume RUN_DIR`
    RUN.yaml --here   prepare a run not submitted yet into its output_dir; `slurmft submit` reuses it
    """
    from slurmft.prepared import summary_line
    from slurmft.rundir import no_manifest
    from slurmft.submit import prepare as prep

    paths = prep.run_dir_of(target)
    if paths is None:
        if target.is_dir():
            raise no_manifest(target, "give RUN.yaml, or a run directory")
        cfg, profile = _load(target, overrides)
        prep.check_one_run(cfg, target)
        if not here:
            from slurmft.submit.dispatch import check_prepares, submit_run

            check_prepares(cfg)
            _checks(cfg, target)
            result = submit_run(cfg, profile, str(target), template_dir, _err, prepare_only=True)
            click.echo(f"run dir: {result.run_dir}")
            click.echo(f"prepare job: {result.jobs['prepare']}")
            click.echo(f"then: slurmft status {result.run_dir}   (the counts, once prepared), and to train: "
                       f"slurmft resume {result.run_dir}")
            return
        record = prep.prepare_config_here(cfg)
        click.echo(f"prepared: {summary_line(record)}")
        click.echo(f"data: {Path(cfg.output_dir) / 'prepared'}")
        import shlex

        again = " ".join(shlex.quote(str(a)) for a in (target, *overrides))  # an output_dir=... given here included
        click.echo(f"`slurmft submit {again}` reuses it" if cfg.prepare.enabled else
                   "note: prepare.enabled is false in this config, so `slurmft submit` would prepare in the train "
                   "job instead; set prepare.enabled: true to reuse this")
        return
    if overrides:
        raise click.UsageError("KEY=VALUE overrides need RUN.yaml (a run directory prepares its own config.yaml)")
    if here:
        from slurmft.rundir import check_owner, read_manifest

        check_owner(paths, read_manifest(paths), "prepare", force)
        record = prep.prepare_here(paths, _err)
        click.echo(f"prepared: {summary_line(record)}")
        click.echo(f"data: {paths.prepared}")
        return
    job_id = prep.submit(paths, template_dir, _err, force)
    click.echo(f"prepare job: {job_id}")
    click.echo(f"then: slurmft resume {paths.root}   (follow with: slurmft logs {paths.root} --job prepare -f)")


@cli.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False, path_type=Path), metavar="[RUN.yaml]")
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--job", "probe", is_flag=True, help="Also submit a short probe job with the run's nodes and profile.")
@click.option("--template-dir", type=click.Path(file_okay=False, exists=True), help="Your own templates first.")
def doctor(config: Path | None, overrides: tuple[str, ...], as_json: bool, probe: bool, template_dir: str | None) -> int:
    """Ask the cluster whether this run can survive on it: Slurm's preemption, KillWait, GraceTime and
    accounting settings against the run's projected save; with --job, a probe job on the run's nodes.
    Exit 0 when nothing is a problem, 1 otherwise."""
    from slurmft import slurm
    from slurmft.plan.doctor import diagnose, exit_code, format_lines, run_facts

    if probe and config is None:
        raise click.UsageError("--job needs RUN.yaml (the probe runs with the run's nodes, profile and setup)")
    cfg = profile = run = result = None
    if config is not None:
        cfg, profile = _load(config, overrides)
        result, why = _estimate(cfg, profile)
        run = run_facts(cfg, profile, result, why or "")
    elif overrides:
        raise click.UsageError("KEY=VALUE overrides need RUN.yaml")
    lines = diagnose(slurm.cluster_facts(run.partition if run else None), run)
    if probe:
        from slurmft.submit.probe import run_probe

        lines += run_probe(cfg, profile, str(config.resolve()), template_dir, result, say=_err)
    if as_json:
        click.echo(json.dumps({"lines": [line.as_dict() for line in lines], "exit_code": exit_code(lines)}, indent=2))
    else:
        for text in format_lines(lines):
            click.echo(text)
    return exit_code(lines)


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
