"""What the frontier search decides between stages and reports, as pure functions of numbers (tests feed them fixed
inputs; `kvq_lab.frontier.driver` and the frontier study read them).

    best_per_band      screening: the `keep` lowest screen errors among the candidates under each budget
    pareto             stored bits vs KL: the points nothing cheaper beats, and the others kept because no frontier
                       point beats them beyond the noise floor (`kvq_lab.report.noise.beyond`)
    winners            per budget the lowest-KL candidate under it, and its margin over the runner-up
    spearman           rank correlation (average ranks for ties) of two lists
    spread             an evenly spaced subset (the screened candidates also ranked for the correlations)
KL is paired over decode positions by `kvq_lab.report.rows.block_paired`, as experiments/field_methods pairs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def best_per_band(
    errors: dict[str, float], bits: dict[str, float], budgets: Sequence[float], keep: int
) -> dict[float, list[str]]:
    """budget -> the `keep` names with the lowest screen error among those storing at most the budget (NaN last)."""
    out = {}
    for b in budgets:
        inside = [n for n in errors if bits[n] <= b + 1e-9]
        inside.sort(key=lambda n: (math.isnan(errors[n]), errors[n], bits[n], n))
        out[b] = inside[:keep]
    return out


@dataclass(frozen=True)
class Point:
    name: str
    bits: float
    kl: float


def pareto(points: Sequence[Point], beats: Callable[[Point, Point], bool] | None = None) -> tuple[list[str], list[str]]:
    """(frontier, kept): the frontier is the points with a lower KL than every point storing fewer or as many bits
    (ties in bits: the lower KL), cheapest first; `kept` the other points that no frontier point storing at most as
    many bits beats: `beats(d, c)` says d's KL is lower than c's beyond the noise (default: lower at all)."""
    beats = beats or (lambda d, c: d.kl < c.kl)
    front: list[Point] = []
    best = math.inf
    for p in sorted(points, key=lambda p: (p.bits, p.kl, p.name)):
        if p.kl < best:
            front.append(p)
            best = p.kl
    names = {p.name for p in front}
    kept = [
        c.name
        for c in sorted(points, key=lambda p: (p.bits, p.kl, p.name))
        if c.name not in names and not any(d.bits <= c.bits and d.kl < c.kl and beats(d, c) for d in front)
    ]
    return [p.name for p in front], kept


def winners(points: Sequence[Point], budgets: Sequence[float]) -> dict[float, tuple[str | None, str | None]]:
    """budget -> (the lowest-KL point storing at most the budget, the runner-up), names or None."""
    out = {}
    for b in budgets:
        inside = sorted((p for p in points if p.bits <= b + 1e-9), key=lambda p: (p.kl, p.bits, p.name))
        out[b] = (inside[0].name if inside else None, inside[1].name if len(inside) > 1 else None)
    return out


def _ranks(x: Sequence[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's on average ranks); NaN under 3 pairs or a constant side."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if not (math.isnan(a) or math.isnan(b))]
    if len(pairs) < 3:
        return math.nan
    rx, ry = _ranks([a for a, _ in pairs]), _ranks([b for _, b in pairs])
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else math.nan


def spread(names: Sequence[str], n: int | str) -> list[str]:
    """`n` names evenly spaced over `names` (all of them for n="all" or n >= len)."""
    if n == "all" or n >= len(names):
        return list(names)
    if n <= 0:
        return []
    step = (len(names) - 1) / max(1, n - 1)
    return list(dict.fromkeys(names[round(i * step)] for i in range(n)))
