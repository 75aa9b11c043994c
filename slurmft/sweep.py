"""A sweep: one run.yaml with a ``sweep`` section becomes N runs, each a complete run directory under output_dir.

Each point is the file with some dotted keys overridden, applied by the same machinery as ``key=value`` on the
command line (:func:`slurmft.config_loading.apply_overrides`: the same YAML 1.2 values, the same relative-path
rule, so a point is exactly ``slurmft submit run.yaml KEY=VALUE...`` of a run alone) and validated by the same
schema. Everything that can refuse a sweep is here and runs before anything is written: a key no run has (with
the schema's did-you-mean), a key that cannot differ between the tasks of one Slurm array (:data:`FIXED`), a
grid with no points, two points that are the same run, and a point that does not validate (named with its
overrides). Torch-free: ``validate`` and ``submit`` on the login node use it.

The sweep directory (:class:`SweepPaths`) holds ``sweep.json`` (the points, their overrides, directories and
job ids), the array jobs' scripts and logs, one directory per point and ``best`` (a link to the best point's
model, :mod:`slurmft.watch.sweep`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.config import RunConfig
from slurmft.config_loading import apply_overrides, read_yaml, validate
from slurmft.config_paths import absolutize
from slurmft.errors import ConfigError
from slurmft.rundir import SweepPaths

#: Keys a point may not override, and why: every task of one Slurm array has one script's allocation, one
#: partition, one signal; the sweep's directory and name are the sweep's. A key under one of these is refused too.
FIXED = {
    "name": "the sweep's name; each point's run is named NAME-POINT",
    "output_dir": "the sweep's directory; each point's run directory is made under it",
    "executor": "all points run with one executor",
    "cluster": "the tasks of one Slurm array share one partition, account, time limit, setup and image",
    "resources": "the tasks of one Slurm array share one allocation (nodes, GPUs, CPUs, memory)",
    "preemption": "the tasks of one Slurm array share one --signal and one requeue rule",
    "prepare": "one prepare job serves every point",
    "consolidate.enabled": "the consolidation array follows every point or none",
    "consolidate.resources": "the tasks of the consolidation array share one allocation",
    "sweep": "a point cannot hold a sweep of its own",
}
#: Sections whose jobs a sweep does not chain yet (one run at a time: `slurmft serve/eval POINT_DIR`).
NOT_IN_SWEEPS = ("serve", "eval")
#: Names the sweep directory itself uses (a point's name never equals one: it always has a '-').
RESERVED = frozenset({"logs", "scripts", "submitit", "best", "sweep.json"})
NAME_MAX = 80
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its index in the arrays, its directory's name and the keys it overrides."""

    index: int
    name: str
    overrides: dict[str, Any]

    def args(self) -> list[str]:
        """The overrides as ``key=value`` command-line arguments (JSON values: valid YAML, read back the same)."""
        return [f"{key}={json.dumps(value)}" for key, value in self.overrides.items()]

    def label(self) -> str:
        """``train.learning_rate=1e-05 train.seed=1`` (``(the file as written)`` for a point without overrides)."""
        return " ".join(self.args()) or "(the file as written)"


@dataclass
class Sweep:
    """A validated sweep: the file's config (with its ``sweep`` section), the points and each point's config."""

    cfg: RunConfig
    points: list[Point]
    configs: list[RunConfig]

    @property
    def paths(self) -> SweepPaths:
        return SweepPaths(Path(self.cfg.output_dir))


# ------------------------------------------------------------------ the points
def _key_pattern(key: str) -> str:
    """``data.datasets[0].weight`` -> ``data.datasets.weight`` (what :data:`FIXED` is matched against)."""
    return re.sub(r"\[\d+\]|\.\d+(?=\.|$)", "", key)


def fixed_key(key: str) -> str | None:
    """The entry of :data:`FIXED` that ``key`` falls under, else None."""
    plain = _key_pattern(key)
    return next((f for f in FIXED if plain == f or plain.startswith(f + ".")), None)


def _value_text(value: Any) -> str:
    """A value as a directory name's part: ``1e-05``, ``true``, a path's last part, anything else compacted."""
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = value.rstrip("/").rsplit("/", 1)[-1] or value
    elif isinstance(value, int):
        text = str(value)
    else:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return _UNSAFE.sub("-", text).strip("-") or "x"


def _labels(keys: list[str]) -> dict[str, str]:
    """Each swept key's short form in directory names: its last part, or the whole key where two share one."""
    last = {k: _UNSAFE.sub("-", re.sub(r"\[\d+\]", "", k).rsplit(".", 1)[-1]) for k in keys}
    return {k: (short if list(last.values()).count(short) == 1 else _UNSAFE.sub("-", k)) for k, short in last.items()}


def point_name(overrides: dict[str, Any], labels: dict[str, str]) -> str:
    """``learning_rate-1e-05_seed-1``: readable, shell-safe, the same for the same overrides."""
    name = "_".join(f"{labels[k]}-{_value_text(v)}" for k, v in overrides.items()) or "base"
    if len(name) > NAME_MAX:
        digest = hashlib.sha1(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()[:8]
        name = f"{name[:NAME_MAX - 9].rstrip('-_.')}-{digest}"
    return name


def points_of(grid: dict[str, list[Any]], extra: list[dict[str, Any]]) -> list[Point]:
    """The grid's product (the last key varying fastest, in the file's order), then the listed points."""
    designs = [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())] if grid else []
    designs += [dict(p) for p in extra]
    labels = _labels(list(dict.fromkeys(k for d in designs for k in d)))
    points: list[Point] = []
    seen: dict[str, int] = {}
    for index, overrides in enumerate(designs):
        name = point_name(overrides, labels)
        if name in seen:  # two values that read the same in a name (a/model, b/model): the index tells them apart
            name = f"{name}-{index}"
        seen[name] = index
        points.append(Point(index, name, overrides))
    return points


def _shape_problems(points: list[Point], cfg: RunConfig) -> list[str]:
    """Refusals that need no point validated: no points, a fixed key, a section not chained, a twin point."""
    problems = []
    if not points:
        problems.append("sweep: no points: give sweep.grid (dotted keys to lists of values) or sweep.points")
    keys = list(dict.fromkeys(k for p in points for k in p.overrides))
    for key in keys:
        where = fixed_key(key)
        if where:
            problems.append(f"sweep: {key} cannot differ between points ({FIXED[where]}); set it once, outside "
                            "sweep, or make two sweeps")
    for section in NOT_IN_SWEEPS:
        if getattr(cfg, section) is not None:
            problems.append(f"{section}: a sweep does not chain {section} jobs yet; remove the {section} section "
                            f"and run `slurmft {section} POINT_DIR` on the points you choose")
    seen: dict[str, Point] = {}
    for p in points:
        key = json.dumps(p.overrides, sort_keys=True, default=str)
        if key in seen:
            problems.append(f"sweep: points {seen[key].name} and {p.name} are the same run ({p.label()}); "
                            "remove one")
        seen.setdefault(key, p)
    return problems


def expand(data: dict[str, Any], cfg: RunConfig, base: Path) -> tuple[list[Point], list[RunConfig]]:
    """Every point of ``cfg.sweep`` validated as a run alone; every problem of every point in one ConfigError.

    ``data`` is the file's mapping (paths absolute, command-line overrides applied), ``base`` the run.yaml's
    folder: a relative path in a point is relative to it, as it would be written in the file.
    """
    assert cfg.sweep is not None
    points = points_of(cfg.sweep.grid, cfg.sweep.points)
    problems = _shape_problems(points, cfg)
    if problems:
        raise ConfigError(f"sweep: {len(problems)} problem(s); nothing was written", problems)
    plain = {k: v for k, v in data.items() if k != "sweep"}
    root = Path(cfg.output_dir)
    configs: list[RunConfig] = []
    by_problem: dict[str, list[Point]] = {}
    for p in points:
        try:
            point_data = apply_overrides(plain, p.args(), base=base)
            point_data.update(output_dir=str(root / p.name), name=f"{cfg.name}-{p.name}"[:200])
            configs.append(validate(point_data, source=f"sweep point {p.name}"))
        except ConfigError as exc:
            for line in exc.problems or [str(exc)]:
                by_problem.setdefault(line, []).append(p)
    for line, failing in by_problem.items():
        if len(failing) == len(points) and len(points) > 1:
            problems.append(f"every point: {line}")
        else:
            problems += [f"point {p.name} ({p.label()}): {line}" for p in failing]
    if problems:
        raise ConfigError(f"sweep: {len(problems)} problem(s); nothing was written", problems)
    return points, configs


def load_sweep(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Sweep | None:
    """run.yaml with command-line overrides as a :class:`Sweep`; None when it has no ``sweep`` section."""
    from slurmft.config_loading import load_config

    cfg = load_config(path, overrides)
    if cfg.sweep is None:
        return None
    base = Path(path).resolve().parent
    data = read_yaml(path)
    absolutize(data, base)
    data = apply_overrides(data, overrides or [], base=Path.cwd())
    points, configs = expand(data, cfg, base)
    return Sweep(cfg, points, configs)
