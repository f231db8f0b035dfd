"""A study's rows as a pandas DataFrame: what `rows(records)` of each study returns (for notebooks and checks)."""

from __future__ import annotations

from collections.abc import Iterable


def frame(rows: Iterable[dict]):
    """One line per dict; only scalar cells (numbers, strings, None) are kept: per-position curves, per-turn scores
    and the records themselves stay with the study's tables, which read them."""
    import pandas as pd

    scalar = (int, float, str, bool, type(None))
    return pd.DataFrame([{k: v for k, v in row.items() if isinstance(v, scalar)} for row in rows])
