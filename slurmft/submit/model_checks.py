"""``slurmft serve RUN_DIR`` and ``slurmft eval RUN_DIR``: the jobs after consolidation, again, on the model there.

The chained jobs run once, after the consolidation succeeds. These commands run them again without retraining:
after a fix (a vLLM that refused the model, an eval Python without lm-eval), with other tasks (``--tasks``), or on
a model consolidated by hand. As a job (Slurm, or a local process for a local run), or ``--here`` in this process.
The model is only read: a check that fails says why and leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_loading import read_run_config
from slurmft.config_paths import absolutize
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


def checked_config(paths: RunPaths, kind: str, tasks: list[str] | None) -> RunConfig:
    """The run's config with its ``kind`` section (refused without one) and a model to run it on."""
    read_manifest(paths)  # a run directory at all?
    cfg = read_run_config(paths.config)
    if cfg.model_job(kind) is None:
        example = "serve: {python: /path/to/vllm-venv/bin/python}" if kind == "serve" else (
            "eval: {tasks: [hellaswag], python: /path/to/lm-eval-venv/bin/python}")
        raise ConfigError(f"{paths.config} has no {kind} section: add one ({example}; docs/serve-eval.md), then run "
                          f"`slurmft {kind} {paths.root}` again")
    if tasks and cfg.eval is not None:  # a task file given on the command line is relative to the current directory
        given = {"eval": {"tasks": list(tasks)}}
        absolutize(given, Path.cwd(), "eval")
        cfg.eval.tasks = given["eval"]["tasks"]
    has_model = (paths.model / "config.json").is_file() or (paths.adapter / "adapter_config.json").is_file()
    if not has_model:
        raise RunDirError(f"no consolidated model in {paths.root} (model/ has no config.json): consolidate first "
                          f"(`slurmft consolidate {paths.root}`)")
    return cfg


def check_quiet(paths: RunPaths, kind: str) -> None:
    """Refuse while the model is being written (a consolidation) or another job of ``kind`` may still run."""
    from slurmft.watch.status import run_state

    run_state(paths).check_quiet(("train", "consolidate", kind), f"the {WHAT[kind]} is not started again")


def problems_before(cfg: RunConfig, kind: str, say: Say | None = None) -> list[str]:
    """The login-side checks of the section (its Python imports what it needs, the tasks exist); what cannot be
    checked here (an interpreter in an image) is said through ``say``, and so is the one slow step (listing lm-eval's
    registry for a task name, ~30 s once per interpreter: it was silent)."""
    from slurmft.plan.model_job_checks import check_model_job

    problems, skipped = check_model_job(cfg, kind, say)
    for line in skipped:
        if say is not None:
            say(f"not checked: {line}")
    return problems


def run_here(paths: RunPaths, kind: str, tasks: list[str] | None, say: Say) -> dict[str, Any]:
    """Run the job in this process (needs the training stack), recorded in the manifest."""
    with recorded_here(paths, kind, say, check=lambda: check_quiet(paths, kind),
                       **({"tasks": list(tasks)} if tasks else {})):
        if kind == "serve":
            from slurmft.job.serve_check import serve_check_run

            return serve_check_run(str(paths.root))
        from slurmft.job.evaluate import evaluate_run

        return evaluate_run(str(paths.root), tasks)


def submit(paths: RunPaths, kind: str, tasks: list[str] | None, template_dir: str | None, say: Say) -> str:
    """Submit the job (no dependency) where the run ran: a Slurm job, or a local process; returns its id."""
    from slurmft.submit.dispatch import run_local_model_job, submit_model_job
    from slurmft.submit.submitted import submitted_run

    run = submitted_run(paths)
    with locked(paths, kind, say, check=lambda: check_quiet(paths, kind)) as manifest:
        if run.local:
            return run_local_model_job(run.cfg, paths, manifest, kind, say, tasks=tasks)
        return submit_model_job(run.cfg, run.profile, paths, manifest, kind, str(paths.config), template_dir,
                                tasks=tasks)
