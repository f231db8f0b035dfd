"""What a reported number is, for tables and comparisons: its key in a record, its column title, which way is better
and its unit. Tasks declare their headline metrics with it (`kvq_lab.tasks.Task.headline`); the probes' error
definitions carry the same three facts (`kvq_lab.probes.metrics.ErrorMetric`)."""

from __future__ import annotations

from dataclasses import dataclass

DIRECTIONS = ("higher", "lower")


def check_direction(name: str, direction: str) -> None:
    """A metric's direction is one of DIRECTIONS (ValueError naming the metric otherwise)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"metric {name}: direction={direction!r}; give one of {', '.join(DIRECTIONS)}")


@dataclass(frozen=True)
class Metric:
    """A metric as a table shows it.

    key: the record's metric name (`coqa/em`); title: its column title (`CoQA EM`); direction: "higher" or "lower"
    is better; unit: "%", "dB", or "" (a ratio or a count); per_sample: the per-sample field of the record's
    samples a standard error over documents is computed from, or None."""

    key: str
    title: str
    direction: str = "higher"
    unit: str = ""
    per_sample: str | None = None

    def __post_init__(self):
        check_direction(self.key, self.direction)
