"""``slurmft prepare``, and the prepare job of ``submit`` and ``resume``: the data made once, before the train job.

``submit`` chains prepare -> train (``afterok``, ``--kill-on-invalid-dep=yes``: a failed prepare job gets
the train job cancelled by Slurm, not left pending in ``DependencyNeverSatisfied``) -> consolidate. A run
directory whose ``prepared/`` already matches the config (``slurmft prepare run.yaml --here`` before the
submit, or a resume after a finished prepare job) gets no prepare job: the train job reads what is there.
``resume`` refuses a ``prepared/`` that no longer matches (a source edited since) with the fix, which is this
command: ``slurmft prepare RUN_DIR`` (a job, or ``--here``), then ``slurmft resume RUN_DIR``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.errors import ConfigError, RunDirError
from slurmft.rundir import (
    RunPaths,
    check_owner,
    locked,
    read_manifest,
    recorded_here,
)

Say = Callable[[str], None]


def check_not_live(paths: RunPaths) -> None:
    """Refuse to replace ``prepared/`` under a job that reads or writes it: a prepare or train job that may still
    run, or that we cannot see (the run's one liveness, slurmft.watch.status.RunState.check_quiet)."""
    from slurmft.watch.status import run_state

    run_state(paths).check_quiet(("prepare", "train"), "its data is not replaced under them")


def prepare_here(paths: RunPaths, say: Say) -> dict[str, Any]:
    """Prepare a run directory's data in this process (needs the training stack), recorded in its manifest."""
    from slurmft.job.prepare import prepare_run

    with recorded_here(paths, "prepare", say, check=lambda: check_not_live(paths)):
        return prepare_run(str(paths.root))


def check_one_run(cfg: RunConfig, config: Path) -> None:
    """``slurmft prepare run.yaml`` prepares one run's data into its output_dir. A sweep's points read the sets its
    own prepare job makes at submit (one per distinct data set, in the points' directories): a set prepared here,
    in the sweep's directory, would never be read, and a prepare job would make that directory a run's."""
    if cfg.sweep is not None:
        raise ConfigError(f"sweep: {config} is a sweep; `slurmft prepare` prepares one run's data, which the sweep's "
                          "points would never read (they read the sets the sweep's own prepare job makes at submit)",
                          [f"`slurmft submit {config}` prepares every distinct data set once, before the points train",
                           "or `slurmft validate` it first: it counts each point's data from the files"])


def prepare_config_here(cfg: RunConfig) -> dict[str, Any]:
    """``slurmft prepare run.yaml --here``: the data of a run not submitted yet, into its ``output_dir``'s
    ``prepared/`` (nothing else is written there; ``submit`` then reuses it)."""
    from slurmft.job.prepare import prepare_run

    paths = RunPaths.of(cfg.output_dir)
    if paths.manifest.exists():
        raise RunDirError(f"{paths.root} is a run directory already: use `slurmft prepare {paths.root}`")
    if paths.root.exists() and any(p != paths.prepared and not p.name.startswith(".prepared.")
                                   for p in paths.root.iterdir()):
        raise RunDirError(f"output_dir {paths.root} is not empty and is not a slurmft run directory; choose an "
                          "empty or new one")
    return prepare_run(str(paths.root), cfg=cfg)


def submit(paths: RunPaths, template_dir: str | None, say: Say, force: bool = False) -> str:
    """``slurmft prepare RUN_DIR``: one prepare job (no train job chained); its id."""
    from slurmft.submit.dispatch import run_local_prepare, submit_prepare
    from slurmft.submit.submitted import submitted_run

    check_owner(paths, read_manifest(paths), "prepare", force)
    run = submitted_run(paths)
    if not run.cfg.prepare.enabled:
        say(f"note: prepare.enabled is false in {paths.config}: its train job prepares the data itself and does not "
            "read prepared/")
    with locked(paths, "prepare", say, check=lambda: check_not_live(paths)) as manifest:
        if run.local:
            return run_local_prepare(run.cfg, paths, manifest, say)
        from slurmft.plan.render import (
            PREPARE_TEMPLATE,
            build_prepare_context,
            rank_python_for,
            render,
            submitit_command,
        )
        from slurmft.rundir import atomic_write

        command = submitit_command(rank_python_for(run.cfg, run.profile), paths.submitit)
        text = render(PREPARE_TEMPLATE, build_prepare_context(run.cfg, run.profile, paths, command,
                                                              str(paths.config)), template_dir)
        atomic_write(paths.script("prepare"), text, executable=True)
        return submit_prepare(run.cfg, run.profile, paths, manifest, str(paths.config), template_dir)


def run_dir_of(target: Path) -> RunPaths | None:
    """RunPaths when ``target`` is a run directory (it has a manifest, or we may not look: read_manifest then says
    whose it is and the fix), else None (a run.yaml)."""
    paths = RunPaths.of(target)
    try:
        return paths if target.is_dir() and paths.manifest.is_file() else None
    except PermissionError:
        return paths
