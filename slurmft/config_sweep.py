"""The ``sweep`` section's schema: a grid (and/or a list) of overrides that turns one run.yaml into several runs.

What the points are and whether each one is a valid run is :mod:`slurmft.sweep` (it needs the whole file and the
override machinery of :mod:`slurmft.config_loading`); this module only says what may be written.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from slurmft.config_values import Section


class SweepSelect(Section):
    """How the points are ranked."""

    metric: str | None = Field(
        None, description="What ranks the points: loss = the final training loss (the last logged step's); reward = "
        "a grpo run's mean reward at its last rollouts (GRPO's loss says nothing of how good the policy is); eval = "
        "the evaluation's headline score (the first task's acc_norm, acc or exact_match, as `slurmft runs` shows "
        "it); eval/TASK/METRIC = one score of the evaluation, named as lm-eval writes it and as W&B gets it "
        "(eval/hellaswag/acc_norm; a filter after a comma: eval/gsm8k/exact_match,strict-match). Default: eval when "
        "the file has an eval section, else reward for grpo, else loss.")
    mode: Literal["min", "max"] | None = Field(
        None, description="min: the lowest value is the best point; max: the highest. Default: min for loss, max "
        "for a reward or an evaluation score (say min for a perplexity).")

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str | None) -> str | None:
        if v is None or v in ("loss", "reward", "eval") or re.fullmatch(r"eval/[^/\s]+/[^/\s]+", v):
            return v
        raise ValueError(f"{v!r} is not a metric: give loss, eval (the evaluation's headline score), "
                         "eval/TASK/METRIC (e.g. eval/hellaswag/acc_norm) or reward (a grpo run's mean reward)")


class SweepConfig(Section):
    """Several runs from one file: each point is this file with some keys overridden (docs/sweeps.md)."""

    grid: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Dotted keys (as on the command line) to lists of values; the points are their product, "
        "e.g. {train.learning_rate: [1e-5, 3e-5], train.seed: [1, 2]} is 4 points.")
    points: list[dict[str, Any]] = Field(
        default_factory=list,
        description="More points, each a mapping of dotted keys to one value (designs that are not a grid); "
        "they follow the grid's points.")
    parallel: int | None = Field(
        None, ge=1, description="How many points train at once (the array's %N throttle; default: all).")
    select: SweepSelect = Field(default_factory=SweepSelect)

    @field_validator("grid")
    @classmethod
    def _grid(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        empty = [k for k, values in v.items() if not values]
        if empty:
            raise ValueError(f"{', '.join(empty)}: an empty list of values makes no points; give at least one value "
                             "or leave the key out of sweep.grid")
        return v
