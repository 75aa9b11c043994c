"""``slurmft doctor --job``: render, submit and wait for the probe job, then read what its ranks found.

The probe is not a run: it has no submitit pickle, so it goes through ``sbatch`` directly (the adapter's
``sbatch_script``), and it lives in its own directory (``~/.cache/slurmft/doctor/<run>-<time>``), never in
the run's output_dir (``submit`` refuses an output_dir holding foreign files). What runs inside is
slurmft/job/probe.py; the verdicts are slurmft.plan.doctor.probe_lines. The directory is removed when
nothing is a problem and kept (with the probe's log) when something is.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft import slurm, slurm_states
from slurmft.config import RunConfig
from slurmft.plan.doctor import Level, Line, exit_code, probe_expect, probe_lines
from slurmft.plan.render import PROBE_TEMPLATE, build_probe_context, render, render_scripts, signal_directive
from slurmft.probe_paths import ProbePaths
from slurmft.profiles import ClusterProfile
from slurmft.rundir import RunPaths, atomic_write

#: Seconds to wait for the probe to start and end (a busy queue may hold it longer: then it is cancelled).
PROBE_WAIT_S = 1800
#: Seconds between two looks at the probe's state.
POLL_S = 2.0


def probe_root(name: str) -> Path:
    """A fresh directory for one probe (home is shared with the nodes on every cluster slurmft targets)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path.home() / ".cache" / "slurmft" / "doctor" / f"{name}-{stamp}"


def run_dir_target(output_dir: Path) -> Path:
    """The directory whose sharing is tested: output_dir, or its nearest existing parent (before a submit)."""
    path = output_dir.expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _wait(job_id: str, say: Callable[[str], None]) -> str:
    """The probe's final state (or the one it had when the wait ran out: then it is cancelled)."""
    deadline, state, told = time.monotonic() + PROBE_WAIT_S, "PENDING", 0.0
    while time.monotonic() < deadline:
        jobs = slurm.squeue_jobs()
        row = (jobs or {}).get(job_id)
        if jobs is not None and (row is None or not slurm_states.is_live(row["state"])):
            final = (slurm.sacct_jobs([job_id]) or {}).get(job_id, {}).get("state")
            return final or (row["state"] if row else "ENDED")
        state = row["state"] if row else state
        if time.monotonic() - told > 30:
            say(f"probe job {job_id}: {state}")
            told = time.monotonic()
        time.sleep(POLL_S)
    slurm.try_scancel([job_id])
    return f"{state}, cancelled after {PROBE_WAIT_S} s"


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _remove_tokens(ranks: dict[int, dict[str, Any]], job_id: str) -> None:
    """The token files a probe's ranks left behind (they do when their process group failed), where the
    login node sees them."""
    nodes = {r.get("node", "") for r in ranks.values()}
    for report in ranks.values():
        for key in ("run_dir", "hf_home"):
            path = (report.get(key) or {}).get("path")
            for node in nodes if path else ():
                ProbePaths.token(Path(path), job_id, node).unlink(missing_ok=True)


def run_probe(cfg: RunConfig, profile: ClusterProfile, config_path: str, template_dir: str | None,
              estimate: dict[str, Any] | None, say: Callable[[str], None]) -> list[Line]:
    """Submit the probe with the run's shape, wait for it, and turn its files into doctor lines."""
    train = render_scripts(cfg, profile, RunPaths.of(cfg.output_dir), config_path, template_dir)["train"]
    signal = signal_directive(train)
    if signal is None:
        return [Line("warning signal", Level.PROBLEM, "the train script asks Slurm for no --signal: the ranks get "
                                                      "no warning before the time limit",
                     "keep the --signal directive in your train template (slurmft renders it from preemption.*)")]
    target = run_dir_target(Path(cfg.output_dir))
    probe = ProbePaths(probe_root(cfg.name))
    ctx = build_probe_context(cfg, profile, probe.root, signal, target, config_path)
    atomic_write(probe.script, render(PROBE_TEMPLATE, ctx))
    answer = slurm.sbatch_script(str(probe.script))
    if not answer.ok:
        return [Line("probe", Level.PROBLEM, f"sbatch refused the probe job: {answer.problem}",
                     "the run's own submit would be refused the same way: check cluster.partition/account/qos "
                     "and resources")]
    job_id = answer.stdout.strip().split(";")[0]
    say(f"probe job {job_id} submitted ({probe.root}); it takes about a minute once it runs")
    state = _wait(job_id, say)
    ranks = {}
    for rank in range(cfg.resources.nodes * cfg.resources.ranks_per_node):
        report = _json(probe.rank_report(rank))
        if report is not None:
            ranks[rank] = report
    expect = probe_expect(cfg, profile, estimate, signal.name, signal.text, signal.batch_only, str(target))
    tools = {kind: {node: fact for node, path in probe.tool_reports(kind).items() if (fact := _json(path))}
             for kind in expect.model_job_places}
    lines = probe_lines(ranks, _json(probe.batch_report), expect, job_id, state, str(probe.log), tools)
    _remove_tokens(ranks, job_id)
    if exit_code(lines) == 0:
        shutil.rmtree(probe.root, ignore_errors=True)
    else:
        say(f"probe files kept for a look: {probe.root}")
    return lines
