"""The long-context study, two parts in one folder.

- Retrieval accuracy vs context length -> table.md and long_context.png. SmolLM2-135M's and Gemma-3-270M's
  retrieval runs, one block each; the newest completed record of a (model, cache, length, seed) wins, and the seeds
  are pooled.
- Per-layer error of the KIVI axis rows on Gemma-3-270M's long prompts (task=probe task.source=gsm8k, 4096 tokens)
  -> probe_layers.md and probe_layers.png. Sliding-window layers attend to their last 512 tokens, global ones to all
  4096: the per-layer table names each layer's attention (kvq_lab/probes/results.py). The newest completed probe
  record of a cache wins (its Parquet tables are covered by its digest).

Records read through `kvq_lab.report.study.read`, each checked against its digest.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvq_lab.records.record import read_table
from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import newest as newest_of
from kvq_lab.report.study import read

MODELS = ("smollm2-135m", "gemma3-270m")  # the retrieval blocks; the probes are Gemma's
PROBE_MODELS = ("gemma3-270m",)
QUANTITIES = ("attn_score_decode/rel_fro", "attn_out_v_decode/rel_fro", "attn_out_decode/rel_fro")


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible at 0/n and n/n, unlike p +- SE)."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def records(folder: Path) -> dict[str, list[dict]]:
    """{"retrieval": both models' retrieval runs, "probe": Gemma's probe runs}."""
    return {
        "retrieval": read(folder, MODELS, where={"config.task.name": "retrieval"}),
        "probe": read(folder, PROBE_MODELS, where={"config.task.name": "probe"}),
    }


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


def retrieval_table(recs: list[dict]) -> str:
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
    return "\n".join(blocks)


def retrieval_figure(models: dict, folder: Path) -> None:
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
    fig.savefig(Path(folder) / "long_context.png", dpi=110)


def per_layer(recs: list[dict]) -> dict[str, dict]:
    """cache label -> the per-layer probe table of its newest record."""
    return {c: read_table(r, "probe_tables", "per_layer") for c, r in newest_of(recs, lambda r: r["cache"]).items()}


def probe_table(recs: list[dict]) -> str:
    tables = per_layer(recs)
    first = next(iter(tables.values()))
    kinds = [row[first["columns"].index("attention")] for row in first["rows"]]
    lines = ["| layer | attention | " + " | ".join(f"`{c}` {q.split('/')[0]}" for c in tables for q in QUANTITIES[2:])
             + " |"]  # fmt: skip
    lines.append("|---|---|" + "---|" * len(tables))
    for i, kind in enumerate(kinds):
        cells = [f"{t['rows'][i][t['columns'].index(QUANTITIES[2])]:.3f}" for t in tables.values()]
        lines.append(f"| {i} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def probe_figure(tables: dict[str, dict], folder: Path) -> None:
    first = next(iter(tables.values()))
    kinds = [row[first["columns"].index("attention")] for row in first["rows"]]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(5.5 * len(QUANTITIES), 3.8), squeeze=False)
    for ax, q in zip(axes[0], QUANTITIES, strict=True):
        for c, t in tables.items():
            ax.plot([row[t["columns"].index(q)] for row in t["rows"]], marker=".", label=c)
        for i, kind in enumerate(kinds):
            if kind == "global":
                ax.axvspan(i - 0.4, i + 0.4, color="grey", alpha=0.2)
        ax.set(yscale="log", xlabel="layer (grey: global attention; the rest sliding 512)", title=q)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Gemma-3-270M, 4096-token prompts: error of the last query row (a decode step), per layer")
    fig.tight_layout()
    fig.savefig(Path(folder) / "probe_layers.png", dpi=110)


def tables(recs: dict[str, list[dict]]) -> dict[str, str]:
    return {"table.md": retrieval_table(recs["retrieval"]), "probe_layers.md": probe_table(recs["probe"])}


def figure(recs: dict[str, list[dict]], folder: Path) -> None:
    retrieval_figure(pooled(recs["retrieval"])[1], folder)
    probe_figure(per_layer(recs["probe"]), folder)


def rows(recs: dict[str, list[dict]]):
    """One line per retrieval cell (model, cache, context length: hits and samples pooled over the seeds)."""
    cells = pooled(recs["retrieval"])[1]
    return frame(
        {"model": m, "cache": c, "context_tokens": n, "hits": h, "n": k}
        for m, by_cache in cells.items() for c, by_len in by_cache.items() for n, (h, k) in by_len.items()
    )  # fmt: skip
