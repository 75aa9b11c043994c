"""A submitted run, as a later command sends one more job into it (``slurmft consolidate``, ``prepare``, ``serve``
and ``eval`` RUN_DIR).

Each such command does the same three things: read what the job needs of the run (its config, the executor it was
started on, its cluster profile) and refuse what cannot work before touching anything (:func:`submitted_run`); then,
under the run's lock, refuse while a job it would disturb may still run (:func:`slurmft.rundir.locked`); then send
the job and record it in the manifest as it is under that lock (:mod:`slurmft.submit.dispatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurmft.config import Executor, RunConfig
from slurmft.config_loading import read_run_config
from slurmft.rundir import RunPaths, read_manifest

if TYPE_CHECKING:
    from slurmft.profiles import ClusterProfile


@dataclass(frozen=True)
class SubmittedRun:
    """What a later job needs of a run: its resolved config, with the executor the run was started on (a run
    continues where it was started: a local run's jobs run here), and its cluster profile."""

    cfg: RunConfig
    profile: ClusterProfile

    @property
    def local(self) -> bool:
        """The run's jobs run here, as local processes."""
        return self.cfg.resolved_executor == Executor.LOCAL


def submitted_run(paths: RunPaths, overrides: list[str] | None = None) -> SubmittedRun:
    """The run's config (with ``overrides``: ``slurmft serve|eval RUN_DIR KEY=VALUE``'s, checked and resolved),
    executor and profile; refused when the executor cannot run here (Slurm without sbatch) or the profile does not
    load."""
    from slurmft.profiles import load_profile
    from slurmft.submit.dispatch import check_executor

    manifest = read_manifest(paths)
    cfg = read_run_config(paths.config, overrides)
    cfg.executor = Executor(manifest.get("executor", "slurm"))
    check_executor(cfg.resolved_executor)
    return SubmittedRun(cfg, load_profile(cfg.cluster.profile))
