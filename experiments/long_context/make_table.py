"""Retrieval accuracy vs context length from this study's records -> table.md and long_context.png (run from the repo
root: python experiments/long_context/make_table.py). Records: SmolLM2-135M's and Gemma-3-270M's retrieval runs, one
block each, read through `kvq_lab.report.study.read` (each checked against its digest); the newest completed record
of a (model, cache, length, seed) wins, and the seeds are pooled."""

from __future__ import annotations

import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # kvq_lab of this checkout

from kvq_lab.report.study import newest as newest_of  # noqa: E402
from kvq_lab.report.study import read  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m")


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible at 0/n and n/n, unlike p +- SE)."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def records() -> list[dict]:
    return read(HERE, MODELS, where={"config.task.name": "retrieval"})


def pooled(recs: list[dict]) -> tuple[dict, dict]:
    """-> ((model, cache, length, seed) -> the newest record; model -> cache -> length -> [hits, samples] pooled
    over the seeds)."""
    newest = newest_of(
        recs,
        lambda r: (r["config"]["model"]["name"], r["cache"], int(r["config"]["task"]["context_tokens"]),
                   int(r["config"]["task"]["seed"])),
    )  # fmt: skip
    # pooled over generator seeds: hits and samples per (model, cache, length)
    models: dict[str, dict[str, dict[int, list[int]]]] = {}
    for (model, label, n, _), r in newest.items():
        cell = models.setdefault(model, {}).setdefault(label, {}).setdefault(n, [0, 0])
        k = int(r["metrics"]["retrieval/n"])
        cell[0] += round(r["metrics"]["retrieval/acc"] * k / 100)
        cell[1] += k
    return newest, models


def tables(recs: list[dict]) -> dict[str, str]:
    newest, models = pooled(recs)
    blocks = []
    for model, rows in models.items():
        seeds = sorted({s for m, _, _, s in newest if m == model})
        lengths = sorted({n for cells in rows.values() for n in cells})
        lines = [
            f"### {model}\n",
            "| cache | " + " | ".join(f"{n} tok" for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        for label, cells in rows.items():
            out = []
            for n in lengths:
                if n not in cells:
                    out.append("-")
                    continue
                hits, k = cells[n]
                lo, hi = wilson(hits / k, k)
                out.append(f"{hits}/{k} [{100 * lo:.0f}, {100 * hi:.0f}]")
            lines.append(f"| `{label}` | " + " | ".join(out) + " |")
        blocks.append("\n".join(lines) + f"\n\nseeds pooled: {seeds}; [..] = 95% Wilson interval, %\n")
    return {"table.md": "\n".join(blocks)}


def main() -> None:
    recs = records()
    for name, text in tables(recs).items():
        (HERE / name).write_text(text)
        print(text)
    figure(pooled(recs)[1])


def figure(models: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.5), squeeze=False)
    for ax, (model, rows) in zip(axes[0], models.items(), strict=True):
        lengths = sorted({n for cells in rows.values() for n in cells})
        for i, (label, cells) in enumerate(rows.items()):
            xs = sorted(cells)
            acc = [100 * cells[x][0] / cells[x][1] for x in xs]
            ax.plot([x * (1 + 0.02 * (i - 1.5)) for x in xs], acc, marker="o", label=label)  # offsets: no overlap
        ax.set(xscale="log", xlabel="context tokens", ylabel="needle accuracy (%)", ylim=(-5, 105), title=model)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "long_context.png", dpi=110)


if __name__ == "__main__":
    main()
