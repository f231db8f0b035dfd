"""Per-layer error of the KIVI axis rows on Gemma-3-270M's long prompts (task=probe task.source=gsm8k, 4096 tokens)
from this study's probe records -> probe_layers.png and probe_layers.md (run from the repo root:
python experiments/long_context/make_probe_figure.py). Sliding-window layers attend to their last 512 tokens, global
ones to all 4096: the per-layer table names each layer's attention (kvq_lab/probes/results.py). Records: Gemma-3-270M's
probe runs, read through `kvq_lab.report.study.read` (each checked against its digest, its Parquet tables included);
the newest completed record of a cache wins."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # kvq_lab of this checkout

from kvq_lab.records.record import read_table  # noqa: E402
from kvq_lab.report.study import newest, read  # noqa: E402

MODELS = ("gemma3-270m",)
QUANTITIES = ("attn_score_decode/rel_fro", "attn_out_v_decode/rel_fro", "attn_out_decode/rel_fro")


def records() -> list[dict]:
    return read(HERE, MODELS, where={"config.task.name": "probe"})


def per_layer(recs: list[dict]) -> dict[str, dict]:
    """cache label -> the per-layer probe table of its newest record."""
    return {c: read_table(r, "probe_tables", "per_layer") for c, r in newest(recs, lambda r: r["cache"]).items()}


def tables(recs: list[dict]) -> dict[str, str]:
    tables = per_layer(recs)
    first = next(iter(tables.values()))
    kinds = [row[first["columns"].index("attention")] for row in first["rows"]]
    lines = ["| layer | attention | " + " | ".join(f"`{c}` {q.split('/')[0]}" for c in tables for q in QUANTITIES[2:])
             + " |"]  # fmt: skip
    lines.append("|---|---|" + "---|" * len(tables))
    for i, kind in enumerate(kinds):
        cells = [f"{t['rows'][i][t['columns'].index(QUANTITIES[2])]:.3f}" for t in tables.values()]
        lines.append(f"| {i} | {kind} | " + " | ".join(cells) + " |")
    return {"probe_layers.md": "\n".join(lines) + "\n"}


def main() -> None:
    recs = records()
    for name, text in tables(recs).items():
        (HERE / name).write_text(text)
        print(text)
    figure(per_layer(recs))


def figure(tables: dict[str, dict]) -> None:
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
    fig.savefig(HERE / "probe_layers.png", dpi=110)


if __name__ == "__main__":
    main()
