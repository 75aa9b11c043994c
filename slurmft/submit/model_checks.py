"""``slurmft serve RUN_DIR`` and ``slurmft eval RUN_DIR``: the jobs after consolidation, again, on the model there.

The chained jobs run once, after the consolidation succeeds. These commands run them again without retraining:
after a fix (a vLLM that refused the model, an eval Python without lm-eval), with other settings (``key=value``
overrides of the job's own section and of the cluster keys its batch script reads, as ``slurmft submit`` takes them;
``--tasks`` is ``eval.tasks``), or on a model consolidated by hand. As a job (Slurm, or a local process for a local
run), or ``--here`` in this process. The model is only read: a check that fails says why and leaves it.

The overrides are not written into RUN_DIR/config.yaml, the record of how the run trained (and of what its chained
jobs do when ``slurmft resume`` chains them again): they travel with the job (its argument and its manifest entry,
``overrides``), and the job records the section it ran with beside its result (``RUN_DIR/serve/result.json``,
``RUN_DIR/eval/summary.json``: ``settings``, ``overrides``), so the scores say what produced them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_loading import read_run_config, read_yaml, resolve_overrides
from slurmft.errors import ConfigError, RunDirError
from slurmft.rundir import (
    RunPaths,
    locked,
    read_manifest,
    recorded_here,
)

Say = Callable[[str], None]
#: What each job needs in the run's config, and how its result is written.
WHAT = {"serve": "serve check (vLLM)", "eval": "evaluation (lm-eval)"}


def from_command_line(problems: list[str], given: dict[str, str]) -> tuple[list[str], bool]:
    """The problems found in keys the command line set (``given``: each override -> how the user gave it, ``--tasks
    a,b`` or ``eval.tasks=[a,b]``) said as the command line's, not as RUN_DIR/config.yaml's; and whether every problem
    is. A problem starts with the key it is about (``eval.tasks[0]: ...``, the schema's and the checks' form)."""
    from slurmft.config_loading import format_loc, parse_override

    keys = {format_loc(tuple(parse_override(o)[0])): said for o, said in given.items()}
    out, all_given = [], True
    for problem in problems:
        key = problem.split(":", 1)[0].strip()
        said = next((s for k, s in keys.items() if key == k or key.startswith((k + ".", k + "["))), None)
        out.append(f"{said} ({problem})" if said else problem)
        all_given = all_given and said is not None
    return out, all_given


def checked_config(paths: RunPaths, kind: str, overrides: list[str],
                   said: dict[str, str] | None = None) -> tuple[RunConfig, list[str]]:
    """The run's config with ``overrides`` (only keys the ``kind`` job reads), its ``kind`` section (refused without
    one) and a model to run it on; with the overrides resolved (:func:`resolve_overrides`: a relative path on the
    command line made absolute here) as the job will read them. RUN_DIR/config.yaml is not written. ``said``: an
    override the command built from an option (``--tasks``) -> how the user gave it, for the errors."""
    from slurmft.plan.model_job_checks import check_model_job_overrides

    read_manifest(paths)  # a run directory at all?
    check_model_job_overrides(kind, overrides, str(paths.root))
    cfg = read_run_config(paths.config)  # the run's config as it trained (a missing file said as such)
    resolved = resolve_overrides(read_yaml(paths.config), overrides, Path.cwd()) if overrides else []
    if kind == "eval" and resolved:  # a name of the run's own task files: that file
        from slurmft.eval_tasks import own_task_files

        own = own_tasks(cfg)
        resolved = [own_task_files(o, own) for o in resolved]
    if resolved:
        try:
            cfg = read_run_config(paths.config, resolved)
        except ConfigError as exc:  # the schema's did-you-mean, for the key the user typed (config.yaml itself read)
            given = {o: (said or {}).get(o, o) for o in overrides}
            raise ConfigError(f"the command line ({' '.join(given.values())}): {len(exc.problems)} problem(s) with "
                              f"{paths.config}", from_command_line(exc.problems, given)[0]) from None
    if cfg.model_job(kind) is None:
        example = ("serve.python=/path/to/vllm-venv/bin/python" if kind == "serve" else
                   "eval.tasks=[hellaswag] eval.python=/path/to/lm-eval-venv/bin/python")
        raise ConfigError(f"{paths.config} has no {kind} section: give it on the command line, e.g. "
                          f"`slurmft {kind} {paths.root} {example}` (docs/serve-eval.md)")
    has_model = (paths.model / "config.json").is_file() or (paths.adapter / "adapter_config.json").is_file()
    if not has_model:
        raise RunDirError(f"no consolidated model in {paths.root} (model/ has no config.json): consolidate first "
                          f"(`slurmft consolidate {paths.root}`)")
    return cfg, resolved


def own_tasks(cfg: RunConfig) -> dict[str, str]:
    """The tasks of the run's own task files (config.yaml's ``eval.tasks``, before any override): name -> file."""
    from slurmft.eval_tasks import resolve_tasks

    return resolve_tasks(cfg.eval.tasks).from_files if cfg.eval is not None else {}


def check_quiet(paths: RunPaths, kind: str) -> None:
    """Refuse while the model is being written (a consolidation) or another job of ``kind`` may still run."""
    from slurmft.watch.status import run_state

    run_state(paths).check_quiet(("train", "consolidate", kind), f"the {WHAT[kind]} is not started again")


def problems_before(cfg: RunConfig, kind: str, say: Say | None = None,
                    own: dict[str, str] | None = None) -> list[str]:
    """The login-side checks of the section (its Python imports what it needs, the tasks exist); what cannot be
    checked here (an interpreter in an image) is said through ``say``, and so is the one slow step (listing lm-eval's
    registry for a task name, ~30 s once per interpreter: it was silent). ``own``: :func:`own_tasks`, for a
    did-you-mean of a misspelt task of the run's own."""
    from slurmft.plan.model_job_checks import check_model_job

    problems, skipped = check_model_job(cfg, kind, say, own)
    for line in skipped:
        if say is not None:
            say(f"not checked: {line}")
    return problems


def run_here(paths: RunPaths, kind: str, overrides: list[str], say: Say) -> dict[str, Any]:
    """Run the job in this process (needs the training stack), recorded in the manifest with its (resolved)
    ``overrides``."""
    with recorded_here(paths, kind, say, check=lambda: check_quiet(paths, kind),
                       **({"overrides": overrides} if overrides else {})):
        if kind == "serve":
            from slurmft.job.serve_check import serve_check_run

            return serve_check_run(str(paths.root), overrides)
        from slurmft.job.evaluate import evaluate_run

        return evaluate_run(str(paths.root), overrides)


def submit(paths: RunPaths, kind: str, overrides: list[str], template_dir: str | None, say: Say) -> str:
    """Submit the job (no dependency) where the run ran, its script rendered and the job run with the (resolved)
    ``overrides``: a Slurm job, or a local process; returns its id."""
    from slurmft.submit.dispatch import run_local_model_job, submit_model_job
    from slurmft.submit.submitted import submitted_run

    run = submitted_run(paths, overrides)
    with locked(paths, kind, say, check=lambda: check_quiet(paths, kind)) as manifest:
        if run.local:
            return run_local_model_job(run.cfg, paths, manifest, kind, say, overrides=overrides)
        return submit_model_job(run.cfg, run.profile, paths, manifest, kind, str(paths.config), template_dir,
                                overrides=overrides)
