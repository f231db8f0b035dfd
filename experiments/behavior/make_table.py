"""Drift and refusal table of this study's records -> table.md (run from the repo root:
python experiments/behavior/make_table.py)."""

from __future__ import annotations

from pathlib import Path

from kvq_lab.records.record import load_records

HERE = Path(__file__).parent
COLS = ("refusal_rate", "ref_refusal_rate", "refusal_flips", "identical", "prefix_tokens", "rouge_l")


def main() -> None:
    rows: dict[str, dict] = {}
    for r in load_records(HERE):  # oldest first: the newest record of a cache wins
        if r.get("status") == "ok":
            rows[r["cache"]] = r
    head = [f"{s} {c}" for s in ("harmful", "neutral") for c in COLS]
    lines = ["| cache | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for label, r in rows.items():
        m = r["metrics"]
        cells = [m[f"behavior/{s}/{c}"] for s in ("harmful", "neutral") for c in COLS]
        lines.append(f"| `{label}` | " + " | ".join(f"{v:.3g}" for v in cells) + " |")
    table = "\n".join(lines) + "\n"
    (HERE / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
