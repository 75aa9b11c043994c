"""The ``sweep`` section's schema: a grid (and/or a list) of overrides that turns one run.yaml into several runs.

What the points are and whether each one is a valid run is :mod:`slurmft.sweep` (it needs the whole file and the
override machinery of :mod:`slurmft.config_loading`); this module only says what may be written.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from slurmft.config_values import Section


class SweepSelect(Section):
    """How the points are ranked."""

    metric: Literal["loss"] = Field(
        "loss", description="What ranks the points: loss = the final training loss (the last logged step's).")
    mode: Literal["min", "max"] = Field("min", description="min: the lowest value is the best point; max: the highest.")


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
