"""The stored bits a run reports (`cache/bits*`) are each layer kind's own count, asked once by the runner
(`QuantizedKVCache.stored_bits` at the task's `Task.cached_tokens`). The numbers are pinned as the code before that
change gave them (the runner's `cache_bits`, `kvq_lab.cache.accounting.stored_bits` and, for mode=recompute,
`kvq_lab.fit.precision.measured_bits`, computed at commit 3bb2527 on this tiny model): the refactor moved the count,
not one bit of it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvq_lab.cache import QuantizedKVCache
from kvq_lab.cache.knobs import cache_config
from kvq_lab.plugins import TASKS

CONFIGS = {
    "simulated": {"bits": 2},
    "packed": {"bits": 2, "mode": "packed", "exact_window": 32, "sink_tokens": 4, "backend": "torch"},
    "recompute": {"bits": 4, "mode": "recompute", "exact_window": 32, "sink_tokens": 4, "backend": "torch",
                  "group_size": 16, "key_axis": "token", "value_axis": "token"},
    "recompute_rank": {"bits": 4, "mode": "recompute", "exact_window": 32, "backend": "torch",
                       "recompute": {"rank": 16}, "group_size": 16, "key_axis": "token", "value_axis": "token"},
    "tiered": {"bits": 2, "mode": "packed", "exact_window": 32, "backend": "torch", "policy": {"name": "mikv"}},
}  # fmt: skip
TASK_CFGS = {
    "ppl": {"name": "ppl", "context_tokens": 100, "eval_tokens": 60},
    "fidelity": {"name": "fidelity", "protocol": "chunks", "n_ctx": 96},
    "coqa": {"name": "coqa"},
}
PINNED = [
    (
        "ppl",
        "simulated",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 3.0,
            "cache/bits_total_value": 3.0,
            "cache/bits_total": 3.0,
            "cache/bits_tokens": 160.0,
        },
    ),
    (
        "ppl",
        "packed",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 5.925,
            "cache/bits_total_value": 5.925,
            "cache/bits_total": 5.925,
            "cache/bits_tokens": 160.0,
        },
    ),
    ("ppl", "recompute", {"cache/bits_total": 6.2, "cache/bytes_per_token": 198.4, "cache/bits_tokens": 160.0}),
    ("ppl", "recompute_rank", {"cache/bits_total": 0.725, "cache/bytes_per_token": 23.2, "cache/bits_tokens": 160.0}),
    (
        "ppl",
        "tiered",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 5.6,
            "cache/bits_total_value": 5.6,
            "cache/bits_total": 5.6,
            "cache/bits_tokens": 160.0,
        },
    ),
    (
        "ppl",
        "per_head",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 6.699999999999999,
            "cache/bits_total_value": 9.024999999999999,
            "cache/bits_total": 7.862499999999999,
            "cache/bits_tokens": 160.0,
        },
    ),
    (
        "fidelity",
        "simulated",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 3.0,
            "cache/bits_total_value": 3.0,
            "cache/bits_total": 3.0,
            "cache/bits_tokens": 96.0,
        },
    ),
    (
        "fidelity",
        "packed",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 7.875,
            "cache/bits_total_value": 7.875,
            "cache/bits_total": 7.875,
            "cache/bits_tokens": 96.0,
        },
    ),
    (
        "fidelity",
        "recompute",
        {"cache/bits_total": 8.333333333333334, "cache/bytes_per_token": 266.6666666666667, "cache/bits_tokens": 96.0},
    ),
    (
        "fidelity",
        "recompute_rank",
        {
            "cache/bits_total": 0.9583333333333334,
            "cache/bytes_per_token": 30.666666666666668,
            "cache/bits_tokens": 96.0,
        },
    ),
    (
        "fidelity",
        "tiered",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 7.333333333333333,
            "cache/bits_total_value": 7.333333333333333,
            "cache/bits_total": 7.333333333333333,
            "cache/bits_tokens": 96.0,
        },
    ),
    (
        "fidelity",
        "per_head",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 8.5,
            "cache/bits_total_value": 10.375,
            "cache/bits_total": 9.4375,
            "cache/bits_tokens": 96.0,
        },
    ),
    (
        "coqa",
        "simulated",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 3.0,
            "cache/bits_total_value": 3.0,
            "cache/bits_total": 3.0,
            "cache/bits_tokens": 1024.0,
        },
    ),
    (
        "coqa",
        "packed",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 3.45703125,
            "cache/bits_total_value": 3.45703125,
            "cache/bits_total": 3.45703125,
            "cache/bits_tokens": 1024.0,
        },
    ),
    ("coqa", "recompute", {"cache/bits_total": 3.5, "cache/bytes_per_token": 112.0, "cache/bits_tokens": 1024.0}),
    (
        "coqa",
        "recompute_rank",
        {"cache/bits_total": 0.4296875, "cache/bytes_per_token": 13.75, "cache/bits_tokens": 1024.0},
    ),
    (
        "coqa",
        "tiered",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 3.40625,
            "cache/bits_total_value": 3.40625,
            "cache/bits_total": 3.40625,
            "cache/bits_tokens": 1024.0,
        },
    ),
    (
        "coqa",
        "per_head",
        {
            "cache/bits_key": 3.0,
            "cache/bits_value": 3.0,
            "cache/bits": 3.0,
            "cache/bits_total_key": 4.421875,
            "cache/bits_total_value": 7.31640625,
            "cache/bits_total": 5.869140625,
            "cache/bits_tokens": 1024.0,
        },
    ),
]


def config(name: str):
    if name == "per_head":  # per-head bits: heads 0 and 1 at (2, 4) and (4, 8) key/value bits
        return replace(config("packed"), head_bits=((2, 4), (4, 8)))
    return cache_config(CONFIGS[name])


@pytest.mark.parametrize("task,name,want", PINNED, ids=[f"{t}-{n}" for t, n, _ in PINNED])
def test_stored_bits_are_the_old_runners(tiny, task, name, want):
    n = TASKS[task].cached_tokens(TASK_CFGS[task])
    assert QuantizedKVCache.stored_bits(config(name), n, tiny) == want
