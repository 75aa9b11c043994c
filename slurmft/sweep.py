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
from collections.abc import Callable
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
    "serve.resources": "the tasks of the serve-check array share one allocation",
    "eval.resources": "the tasks of the evaluation array share one allocation",
    "sweep": "a point cannot hold a sweep of its own",
}
#: The sections whose jobs follow each point's consolidation as one more array each: every point has them or none.
MODEL_JOB_SECTIONS = ("serve", "eval")
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
    """Refusals that need no point validated: no points, a fixed key, a twin point."""
    problems = []
    if not points:
        problems.append("sweep: no points: give sweep.grid (dotted keys to lists of values) or sweep.points")
    keys = list(dict.fromkeys(k for p in points for k in p.overrides))
    for key in keys:
        where = fixed_key(key)
        if where:
            problems.append(f"sweep: {key} cannot differ between points ({FIXED[where]}); set it once, outside "
                            "sweep, or make two sweeps")
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
    problems += _section_problems(points, configs) + select_problems(select_of(cfg)["metric"], configs)
    if problems:
        raise ConfigError(f"sweep: {len(problems)} problem(s); nothing was written", problems)
    return points, configs


def _section_problems(points: list[Point], configs: list[RunConfig]) -> list[str]:
    """A serve or eval section is every point's or none's: its array follows every consolidation task."""
    problems = []
    for section in MODEL_JOB_SECTIONS:
        has = [getattr(c, section) is not None for c in configs]
        if any(has) and not all(has):
            without = ", ".join(p.name for p, h in zip(points, has, strict=True) if not h)
            problems.append(f"sweep: points {without} have no {section} section and the others have one; its jobs "
                            f"are one array that follows every point's consolidation: give every point the {section} "
                            "section or none")
    return problems


# ------------------------------------------------------------------ the ranking
def select_of(cfg: RunConfig) -> dict[str, str]:
    """``sweep.select`` with its defaults said: the metric (eval when the file has an eval section, else reward for a
    grpo run, whose loss does not measure the policy, else loss) and the mode (min for loss, max for a reward or an
    evaluation score). sweep.json records this; status ranks by it."""
    assert cfg.sweep is not None
    chosen = cfg.sweep.select
    metric = chosen.metric or ("eval" if cfg.eval is not None else "reward" if cfg.grpo is not None else "loss")
    return {"metric": metric, "mode": chosen.mode or ("min" if metric == "loss" else "max")}


def select_problems(metric: str, configs: list[RunConfig]) -> list[str]:
    """An evaluation metric needs an eval section; ``eval/TASK/METRIC`` a task of eval.tasks (did-you-mean) and, when
    that task's file declares its metrics (``metric_list``), one of them. A registry task's metrics are lm-eval's to
    say: they are checked when the scores arrive (status shows none for a metric the summary lacks)."""
    import difflib

    from slurmft.eval_tasks import declared_metrics, resolve_tasks

    if metric == "loss":
        return []
    problems: list[str] = []
    for cfg in configs:
        if metric == "reward":
            if cfg.grpo is not None:
                continue
            line = ("sweep.select.metric: reward is a grpo run's mean reward, but this run has no grpo section; rank "
                    "by metric: loss (or an eval section's score)")
        elif cfg.eval is None:
            line = (f"sweep.select.metric: {metric} is an evaluation score, but there is no eval section; add one "
                    "(eval.tasks) or rank by metric: loss")
        elif metric == "eval":
            continue
        else:
            _, task, name = metric.split("/", 2)
            tasks = resolve_tasks(cfg.eval.tasks)
            declared = declared_metrics(tasks.from_files[task]) if task in tasks.from_files else []
            if task not in tasks.names:
                close = difflib.get_close_matches(task, tasks.names, n=1, cutoff=0.6)
                line = (f"sweep.select.metric: {metric}: eval.tasks has no task {task!r}" +
                        (f"; did you mean eval/{close[0]}/{name}?" if close else
                         f" (its tasks: {', '.join(tasks.names)})"))
            elif declared and name.split(",", 1)[0] not in declared:
                close = difflib.get_close_matches(name.split(",", 1)[0], declared, n=1, cutoff=0.6)
                line = (f"sweep.select.metric: {metric}: task {task} declares no metric {name!r}" +
                        (f"; did you mean eval/{task}/{close[0]}?" if close else f" (it declares {', '.join(declared)})"))
            else:
                continue
        if line not in problems:
            problems.append(line)
    return problems


#: What a ranking metric measures, setting by setting: points that differ in one of these are ranked on different
#: measures, not on better and worse values of one. (name, the setting of a point's config, why it changes the measure)
Measure = tuple[str, Callable[[RunConfig], Any], str]
#: train.sft keys that change which tokens the SFT loss counts, or how
SFT_LOSS_KEYS = ("loss_type", "completion_only_loss", "packing_strategy")
LOSS_MEASURES: tuple[Measure, ...] = (
    ("the method", lambda c: c.objective["method"], "each method (sft, dpo, grpo, plain text) has a loss of its own"),
    ("model.tokenizer (model.name_or_path when unset)", lambda c: c.model.tokenizer or c.model.name_or_path,
     "another tokenizer cuts the same text into other tokens: a loss per token of another vocabulary"),
    ("data.datasets", lambda c: [d.model_dump(mode="json") for d in c.data.datasets],
     "each loss is measured on other examples"),
    ("data.max_seq_length", lambda c: c.data.max_seq_length, "sequences (and plain text's chunks) are cut at another "
     "length: other tokens in each loss, and a longer context makes every token easier to predict"),
    ("data.packing", lambda c: c.packed, "a packed step averages its loss over other sequences and tokens than a "
     "padded one"),
    ("data.assistant_only_loss", lambda c: c.assistant_masks, "the loss counts the replies only, or every token"),
    (f"train.sft ({', '.join(SFT_LOSS_KEYS)})", lambda c: {k: c.train.sft[k] for k in SFT_LOSS_KEYS if k in c.train.sft},
     "they change which tokens the loss counts, or its formula"),
    ("dpo.beta", lambda c: c.dpo and c.dpo.beta, "the DPO loss is -log sigmoid(beta x the reward margin): its scale "
     "follows beta (ln 2 at the first step whatever beta, then apart)"),
    ("dpo.loss_type", lambda c: c.dpo and c.dpo.loss_type, "each loss type is another function of the margins"),
    ("dpo.label_smoothing", lambda c: c.dpo and c.dpo.label_smoothing, "it mixes in the flipped labels' loss"),
)
REWARD_MEASURES: tuple[Measure, ...] = (
    ("grpo.rewards", lambda c: c.grpo and [r.model_dump(mode="json") for r in c.grpo.rewards],
     "other functions or weights score the completions"),
    ("grpo.temperature", lambda c: c.grpo and c.grpo.temperature, "the rewarded completions are sampled otherwise, "
     "whatever the policy"),
    ("grpo.top_p", lambda c: c.grpo and c.grpo.top_p, "the rewarded completions are sampled otherwise, whatever the "
     "policy"),
    ("grpo.max_completion_length", lambda c: c.grpo and c.grpo.max_completion_length, "completions are cut at "
     "another length before they are scored"),
    ("data.datasets", lambda c: [d.model_dump(mode="json") for d in c.data.datasets], "the rewards are of other "
     "prompts"),
)
EVAL_MEASURES: tuple[Measure, ...] = (
    ("eval (tasks, num_fewshot, limit)", lambda c: c.eval and [c.eval.tasks, c.eval.num_fewshot, c.eval.limit],
     "the points are scored by other evaluations"),
)


def select_warnings(metric: str, configs: list[RunConfig], mode: str | None = None) -> list[str]:
    """Why ``metric`` does not rank these points on one measure (none when it does): the swept settings that change
    what it measures, each with its values and why, then the fix. A warning, not a refusal: the sweep is valid, and
    its points are worth training whatever ranks them; ``best`` just cannot be trusted until they are ranked by a
    score that is one measure (an evaluation's), or by hand. ``mode`` is the one the file says (``sweep.select.mode``,
    None when unset): the fix names ``mode: max`` when it says min (``select: {metric: loss, mode: min}``), since
    changing only the metric would then rank an accuracy lowest first, the worst point as ``best``."""
    if metric == "loss" and any(c.grpo is not None for c in configs):
        return ["warning: sweep.select.metric is loss, but GRPO's loss (advantage-weighted, near 0 whatever the "
                "rewards) says nothing of how good the policy is, so `best` would be chosen by chance; rank by "
                "sweep.select.metric: reward (the default for grpo) or eval (with an eval: section)"]
    measures = LOSS_MEASURES if metric == "loss" else REWARD_MEASURES if metric == "reward" else EVAL_MEASURES
    lines = []
    for name, setting, why in measures:
        values = list(dict.fromkeys(json.dumps(setting(c), sort_keys=True, default=str) for c in configs))
        if len(values) > 1:
            shown = ", ".join(v if len(v) <= 40 else v[:37] + "..." for v in values[:4]) + (", ..." if values[4:] else "")
            lines.append(f"  {name} differs between points ({shown}): {why}")
    if not lines:
        return []
    fix = ("rank by an evaluation score, the same measure for every point: sweep.select.metric: eval (with an eval: "
           "section) or eval/TASK/METRIC" if metric in ("loss", "reward") else "give every point the same eval section")
    if metric in ("loss", "reward") and mode == "min":
        fix += (", and sweep.select.mode: max (a score ranks highest first; mode: min would make the worst point "
                "`best`; keep min only for a perplexity)")
    return [f"warning: sweep.select.metric is {metric}, but the points' {metric} values are not one measure, so "
            "`best` would compare unlike things:", *lines, f"  fix: {fix}; or compare the points by hand "
            "(`slurmft status`/`report` show each one's loss and score, `slurmft plot` their curves)"]


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
