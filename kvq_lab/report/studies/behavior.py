"""Drift and refusal of the behavior study: table.md, and the drift per cache -> drift.png. Records: SmolLM2-135M's,
read through `kvq_lab.report.study.read` (each checked against its digest); the newest completed record of a cache
wins."""

from __future__ import annotations

from pathlib import Path

from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import newest, read

MODELS = ("smollm2-135m",)
COLS = ("refusal_rate", "ref_refusal_rate", "refusal_flips", "identical", "prefix_tokens", "rouge_l")


def records(folder: Path) -> list[dict]:
    return read(folder, MODELS)


def by_cache(recs: list[dict]) -> dict[str, dict]:
    """cache label -> its newest completed record."""
    return newest(recs, lambda r: r["cache"])


def tables(recs: list[dict]) -> dict[str, str]:
    head = [f"{s} {c}" for s in ("harmful", "neutral") for c in COLS]
    lines = ["| cache | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for label, r in by_cache(recs).items():
        m = r["metrics"]
        cells = [m[f"behavior/{s}/{c}"] for s in ("harmful", "neutral") for c in COLS]
        lines.append(f"| `{label}` | " + " | ".join(f"{v:.3g}" for v in cells) + " |")
    return {"table.md": "\n".join(lines) + "\n"}


def figure(recs: list[dict], folder: Path) -> None:
    """Per cache, how much of the 16-bit answer survives: ROUGE-L and the common prefix, harmful and neutral prompts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = by_cache(recs)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = list(latest)
    panels = (("rouge_l", "ROUGE-L vs 16-bit"), ("prefix_tokens", "common prefix (tokens)"))
    for ax, (metric, name) in zip(axes, panels, strict=True):
        for j, prompts in enumerate(("harmful", "neutral")):
            values = [latest[c]["metrics"][f"behavior/{prompts}/{metric}"] for c in labels]
            ax.bar([i + 0.4 * j for i in range(len(labels))], values, width=0.4, label=f"{prompts} prompts")
        ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(name, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, greedy 48 tokens, 20 prompts a set", fontsize=9)
    fig.tight_layout()
    fig.savefig(Path(folder) / "drift.png", dpi=100)


def rows(recs: list[dict]):
    """One line per cache: its label and the table's metrics (behavior/<prompts>/<metric>)."""
    return frame({"cache": c, **r["metrics"]} for c, r in by_cache(recs).items())
