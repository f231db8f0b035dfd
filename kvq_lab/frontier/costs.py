"""The frontier's cost plan and its time budget.

Before any work the driver prints, per stage, rows x units per row (prompts, windows, documents) x seconds per unit
= minutes, the seconds per unit measured (rows of earlier stages or runs in this process) or the first guess
(`frontier.seconds`). `frontier.max_minutes` gives each stage a share of the time left (`frontier.shares`,
renormalised over the stages still to run); a stage runs its rows cheapest first and stops before the first row its
share cannot pay for (`cut`): what was left is named in the output and in the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Rate:
    """Seconds per unit of one stage: the first guess until rows have been timed, then their mean."""

    guess: float
    seconds: float = 0.0
    units: int = 0

    def add(self, seconds: float, units: int) -> None:
        self.seconds += seconds
        self.units += units

    @property
    def per_unit(self) -> float:
        return self.seconds / self.units if self.units else self.guess

    @property
    def measured(self) -> bool:
        return self.units > 0


@dataclass
class StagePlan:
    stage: str
    rows: int
    units: int  # per row
    rate: Rate

    @property
    def seconds(self) -> float:
        return self.rows * self.units * self.rate.per_unit


def plan_text(plans: list[StagePlan], max_minutes: float | None) -> str:
    """The cost plan, one line per stage and a total."""
    lines = ["cost plan (rows x units x seconds per unit):"]
    for p in plans:
        how = "measured" if p.rate.measured else "first guess"
        lines.append(
            f"  {p.stage:8s} {p.rows:4d} rows x {p.units} x {p.rate.per_unit:.1f} s ({how}) = {p.seconds / 60:.1f} min"
        )
    total = sum(p.seconds for p in plans) / 60
    cap = f"; frontier.max_minutes={max_minutes:g}" if max_minutes else ""
    lines.append(f"  total    {total:.1f} min{cap}")
    return "\n".join(lines)


def cut(costs: list[tuple[str, float]], budget_s: float | None) -> tuple[list[str], list[str]]:
    """(run, left): the rows cheapest first (stable), those whose cumulative cost fits `budget_s` (None: all)."""
    order = sorted(costs, key=lambda x: x[1])
    if budget_s is None:
        return [n for n, _ in order], []
    run, used = [], 0.0
    for i, (name, s) in enumerate(order):
        if used + s > budget_s:
            return run, [n for n, _ in order[i:]]
        run.append(name)
        used += s
    return run, []


@dataclass
class Clock:
    """The stages' time budget (`frontier.max_minutes`, None: none) and each stage's share of what is left."""

    max_minutes: float | None
    shares: dict[str, float]
    start: float = field(default_factory=time.monotonic)

    def left_s(self) -> float | None:
        if self.max_minutes is None:
            return None
        return max(0.0, self.max_minutes * 60 - (time.monotonic() - self.start))

    def share_s(self, stage: str, stages_left: list[str]) -> float | None:
        left = self.left_s()
        if left is None:
            return None
        total = sum(self.shares[s] for s in stages_left) or 1.0
        return left * self.shares[stage] / total
