"""Synthetic run records (the layout kvq_lab.run.runner writes) for table and notebook tests: no model needed."""

from __future__ import annotations

import json
from pathlib import Path

AXIS_ROWS = [  # (key_bits, value_bits, key_axis, value_axis, cache label, coqa_turns F1)
    (16, 16, "token", "token", "K16b_V16b_sim", 60.0),
    (4, 4, "token", "token", "K4b-T32_V4b-T32_sim", 59.0),
    (2, 2, "channel", "token", "K2b-C32_V2b-T32_sim", 50.0),
    (2, 2, "token", "token", "K2b-T32_V2b-T32_sim", 30.0),
    (2, 2, "channel", "channel", "K2b-C32_V2b-C32_sim", 20.0),
    (2, 2, "token", "channel", "K2b-T32_V2b-C32_sim", 5.0),
]


def write_record(results: Path, name: str, record: dict, samples: list | None = None) -> Path:
    """A sealed record as the runner writes it (samples first, then the record with its digest)."""
    from kvq_lab.records import record as R

    d = results / "runs" / name
    d.mkdir(parents=True, exist_ok=True)
    if samples is not None:
        (d / "samples.json").write_text(json.dumps(samples))
        record = {**record, "samples_file": "samples.json"}
    R.write_record(d / "record.json", record)
    return d


def config(kb, vb, ka, va, task="coqa_turns", experiment="kivi_axis_table", limit=None, **kw) -> dict:
    return {
        "key_bits": kb, "value_bits": vb, "key_axis": ka, "value_axis": va, "bits": None, "group_size": 32,
        "exact_window": 0, "sink_tokens": 0, "rope": "post", "mode": "simulated", "limit": limit,
        "experiment_name": experiment, "task": {"name": task},
        "model": {"name": "smollm2-135m", "path": "smollm2-135m"},
        **kw,
    }  # fmt: skip


def axis_table_results(results: Path) -> Path:
    """The six KIVI-axis rows as coqa_turns records, plus the cases a table must show honestly: a quick run
    (limit=20) beside a full one, a failed row, a killed (still `running`) row, a probe record, another experiment."""
    for i, (kb, vb, ka, va, label, f1) in enumerate(AXIS_ROWS):
        n = 4
        samples = [{"doc_id": j, "em": float(j % 2), "f1": f1 / 100 + (0.1 if j % 2 else -0.1)} for j in range(n)]
        if label == "K2b-T32_V2b-C32_sim":  # this row failed
            rec = {"status": "failed", "error": "NonFiniteError: non-finite value at layer 3, step 7"}
            write_record(
                results,
                f"2026010{i}-000000_{label}",
                {
                    **rec,
                    "cache": label,
                    "config": config(kb, vb, ka, va),
                    "experiment": "kivi_axis_table",
                    "metrics": {},
                },
            )
            continue
        metrics = {"coqa_turns/em": f1 - 10, "coqa_turns/f1": f1, "coqa_turns/n": n}
        rec = {"status": "ok", "cache": label, "config": config(kb, vb, ka, va), "experiment": "kivi_axis_table",
               "metrics": metrics}  # fmt: skip
        write_record(results, f"2026010{i}-000000_{label}", rec, samples)
    # a quick run of the 2bit K-C/V-T row, newer than the full one: the full one still wins
    quick = {"status": "ok", "cache": "K2b-C32_V2b-T32_sim", "experiment": "kivi_axis_table",
             "config": config(2, 2, "channel", "token", limit=20),
             "metrics": {"coqa_turns/em": 1.0, "coqa_turns/f1": 1.0, "coqa_turns/n": 20}}  # fmt: skip
    write_record(results, "20260201-000000_quick", quick)
    # the 2bit K-T/V-T row was killed on its rerun: the older ok record still counts
    killed = {"status": "running", "cache": "K2b-T32_V2b-T32_sim", "experiment": "kivi_axis_table",
              "config": config(2, 2, "token", "token"), "metrics": {}}  # fmt: skip
    write_record(results, "20260202-000000_killed", killed)
    # a probe record for the 2bit K-C/V-T cache (another experiment): joined by cache label and model
    probe = {"status": "ok", "cache": "K2b-C32_V2b-T32_sim", "experiment": "error_geometry",
             "config": config(2, 2, "channel", "token", task="probe", experiment="error_geometry"),
             "metrics": {"probe/key/rel_fro/mean": 0.123, "probe/attn_out_decode/rel_fro/mean": 0.456}}  # fmt: skip
    write_record(results, "20260203-000000_probe", probe)
    other = {"status": "ok", "cache": "K8b-C32_V8b-T32_sim", "experiment": "bits",
             "config": config(8, 8, "channel", "token", experiment="bits"),
             "metrics": {"coqa_turns/f1": 1.0}}  # fmt: skip
    write_record(results, "20260204-000000_other", other)
    return results
