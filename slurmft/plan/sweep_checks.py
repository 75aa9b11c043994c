"""A sweep's login-side checks: every point's, as ``validate``/``submit`` check a run alone, in one report.

The schema of each point was checked when the sweep was expanded (:mod:`slurmft.sweep`); here each point meets
the checks that read files and the cluster profile (:func:`slurmft.plan.checks.run_checks`) and the memory
estimate, and a ranking metric that is not one measure over the points is warned of (:func:`select_warnings`). The array's allocation is every point's, so the largest point decides whether the array fits: each
point that does not is named with its overrides, and nothing is written.
"""

from __future__ import annotations

from typing import Any

from slurmft.errors import ConfigError, SlurmftError
from slurmft.profiles import ClusterProfile
from slurmft.sweep import Sweep, select_of, select_warnings


def check_points(sweep: Sweep, profile: ClusterProfile, force: bool = False) -> list[str]:
    """Every point's checks and estimate; one ConfigError naming each point's problems (a point that will not fit
    is a problem unless ``force``). Returns the lines worth saying (skipped checks, fit warnings under --force)."""
    from slurmft.plan.checks import run_checks
    from slurmft.plan.estimate import estimate

    problems: list[str] = []
    assert sweep.cfg.sweep is not None
    said: list[str] = select_warnings(select_of(sweep.cfg)["metric"], sweep.configs, sweep.cfg.sweep.select.mode)
    for point, cfg in zip(sweep.points, sweep.configs, strict=True):
        who = f"point {point.name} ({point.label()})"
        report = run_checks(cfg)
        problems += [f"{who}: {p}" for p in report.problems]
        said += [f"not checked: {line}" for line in report.skipped if f"not checked: {line}" not in said]
        result: dict[str, Any] | None
        try:
            result = estimate(cfg, profile)
        except SlurmftError as exc:
            said.append(f"note: no memory estimate for {point.name} ({exc})")
            continue
        fit = [f"{who} will not fit: {p}" for p in result["problems"]]
        if force:
            said += [f"warning (--force): {p}" for p in fit]
        else:
            problems += fit
    if problems:
        raise ConfigError(f"sweep {sweep.cfg.name}: {len(problems)} problem(s) found before submitting; nothing was "
                          "written" + ("" if force else " (a point that will not fit: see `slurmft estimate`; "
                                                          "--force submits anyway)"), problems)
    return said
