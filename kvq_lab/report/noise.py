"""The noise floor beside a study's differences: what a rerun that changes only float rounding does to a row.

At 4 bits or fewer per element, fake quant turns last-bit differences into code flips and flips into other answers,
so a paired difference between two cache settings mixes the settings' effect with rounding chaos. A study reruns its
baseline row under a perturbation that keeps the mathematics (`noise=permute:<seed>`, `model.dtype=float64`,
`batch_size`, `prefix_reuse`: `ROUNDING_KNOBS`; or another host or library build) and prints, beside each paired
difference, what the rerun alone gives against the row: `noise_floor(base, rerun)` -> `Floor` (paired difference
rerun - base with its standard error, and the units whose response changed, the flips).

A difference is beyond the floor (`beyond`) when it is more than two of its own standard errors from zero and, for
every rounding-only rerun of the row the study holds, further from zero than that rerun's difference plus two of its
standard errors. A noise-only difference is one draw (against a row that is itself one draw), and measured ones reach
2.4 standard errors (experiments/kivi_axis_table/paired.md): taking the largest is the honest bound. The flips say what
share of per-unit answers are rounding, whatever the aggregate does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvq_lab.report.rows import mean_se
from kvq_lab.report.study import model_of, samples

# knob -> its value in records made before the knob existed (prefix reuse did not exist: every prompt was whole)
ROUNDING_KNOBS = {"noise": "none", "model.dtype": "float32", "batch_size": 1, "prefix_reuse": False}
SAME = ("model", "task", "limit", "seed", "cache")  # what a rerun shares with its row, else it measures something else


def _get(rec: dict, dotted: str, default=None):
    v = rec.get("config") or {}
    for part in dotted.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return default if v is None else v


def _what(rec: dict, key: str):
    if key == "model":
        return model_of(rec)
    if key == "cache":
        return rec.get("cache")
    return _get(rec, key)


def rerun_changes(base: dict, rerun: dict) -> list[str]:
    """What a rounding-only rerun changed against its row: `knob a -> b` per rounding knob, and `commit`,
    `libraries` or `threads` where the environment differs. Raises ValueError naming the first thing that is not
    rounding-only (another model, task, limit, seed or cache)."""
    for key in SAME:
        a, b = _what(base, key), _what(rerun, key)
        if a != b:
            raise ValueError(f"not a rounding-only rerun: {key} {a!r} vs {b!r}")
    out = [
        f"{k} {_get(base, k, d)} -> {_get(rerun, k, d)}"
        for k, d in ROUNDING_KNOBS.items()
        if _get(base, k, d) != _get(rerun, k, d)
    ]
    ea, eb = base.get("env") or {}, rerun.get("env") or {}
    if str(ea.get("git"))[:7] != str(eb.get("git"))[:7]:
        out.append("commit")
    if ea.get("versions") != eb.get("versions"):
        out.append("libraries")
    if ea.get("torch_threads") != eb.get("torch_threads"):
        out.append("threads")
    return out


@dataclass(frozen=True)
class Floor:
    """What a rounding-only rerun did to a row: mean per-unit difference (rerun - base, in the metric's unit x
    `scale`), its standard error, the units compared, the units whose response changed, and what the rerun changed."""

    diff: float
    se: float
    n: int
    flips: int
    changes: tuple[str, ...]

    def cell(self) -> str:
        """`+0.12 ± 1.70, 224/297 flip`: the difference rounding alone makes, and how many per-unit answers."""
        return f"{self.diff:+.2f} ± {self.se:.2f}, {self.flips}/{self.n} flip"


def noise_floor(base: dict, rerun: dict, metric: str = "f1", scale: float = 100.0) -> Floor:
    """Pair a row's record with its rounding-only rerun (`rerun_changes`) over the units both scored (doc_id of
    their samples): the paired difference of `metric` and the flips (responses that differ)."""
    changes = rerun_changes(base, rerun)
    a, b = ({int(s["doc_id"]): s for s in samples(r)} for r in (base, rerun))
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("the row and its rerun share no scored unit (doc_id); rerun with the row's limit")
    m, se = mean_se([scale * (float(b[i][metric]) - float(a[i][metric])) for i in ids])
    flips = sum(a[i].get("response") != b[i].get("response") for i in ids)
    return Floor(m, se, len(ids), flips, tuple(changes))


def beyond(diff: float, se: float, floors: Floor | list[Floor]) -> bool:
    """Whether a paired difference (the floors' unit) lies beyond the noise floors (module docstring)."""
    floors = [floors] if isinstance(floors, Floor) else list(floors)
    if not floors or math.isnan(se) or abs(diff) <= 2 * se:
        return False
    return all(abs(diff) > abs(f.diff) + 2 * f.se for f in floors)
