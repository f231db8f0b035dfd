"""Retrieval accuracy vs context length from this study's records -> table.md and long_context.png (run from the repo
root: python experiments/long_context/make_table.py)."""

from __future__ import annotations

import math
from pathlib import Path

from kvq_lab.results import load_records

HERE = Path(__file__).parent


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible at 0/n and n/n, unlike p +- SE)."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def main() -> None:
    rows: dict[str, dict[int, dict]] = {}
    for r in load_records(HERE):  # oldest first: the newest record of a cell wins
        if r.get("status") == "ok":
            rows.setdefault(r["cache"], {})[int(r["config"]["task"]["context_tokens"])] = r
    lengths = sorted({n for cells in rows.values() for n in cells})
    lines = [
        "| cache | " + " | ".join(f"{n} tok" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for label, cells in rows.items():
        out = []
        for n in lengths:
            r = cells.get(n)
            if r is None:
                out.append("-")
                continue
            acc, k = r["metrics"]["retrieval/acc"], r["metrics"]["retrieval/n"]
            lo, hi = wilson(acc / 100, k)
            out.append(f"{round(acc * k / 100)}/{k} [{100 * lo:.0f}, {100 * hi:.0f}]")
        lines.append(f"| `{label}` | " + " | ".join(out) + " |")
    table = "\n".join(lines) + "\n"
    (HERE / "table.md").write_text(table)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, cells in rows.items():
        xs = sorted(cells)
        ax.plot(xs, [cells[x]["metrics"]["retrieval/acc"] for x in xs], marker="o", label=label)
    ax.set(xscale="log", xlabel="context tokens", ylabel="needle accuracy (%)", ylim=(-5, 105))
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "long_context.png", dpi=110)


if __name__ == "__main__":
    main()
