"""Drift and refusal table of this study's records -> table.md, and the drift per cache -> drift.png (run from the
repo root: python experiments/behavior/make_table.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvq_lab.records.record import load_records  # noqa: E402

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
    figure(rows)


def figure(rows: dict[str, dict]) -> None:
    """Per cache, how much of the 16-bit answer survives: ROUGE-L and the common prefix, harmful and neutral prompts."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = list(rows)
    panels = (("rouge_l", "ROUGE-L vs 16-bit"), ("prefix_tokens", "common prefix (tokens)"))
    for ax, (metric, name) in zip(axes, panels, strict=True):
        for j, prompts in enumerate(("harmful", "neutral")):
            values = [rows[c]["metrics"][f"behavior/{prompts}/{metric}"] for c in labels]
            ax.bar([i + 0.4 * j for i in range(len(labels))], values, width=0.4, label=f"{prompts} prompts")
        ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(name, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, greedy 48 tokens, 20 prompts a set", fontsize=9)
    fig.tight_layout()
    fig.savefig(HERE / "drift.png", dpi=100)


if __name__ == "__main__":
    main()
