"""Per-layer error of the KIVI axis rows on Gemma-3-270M's long prompts (task=probe task.source=gsm8k, 4096 tokens)
from this study's probe records -> probe_layers.png and probe_layers.md (run from the repo root:
python experiments/long_context/make_probe_figure.py). Sliding-window layers attend to their last 512 tokens, global
ones to all 4096: the per-layer table names each layer's attention (kvq_lab/probes/results.py)."""

from __future__ import annotations

from pathlib import Path

from kvq_lab.records.record import load_records, read_table

HERE = Path(__file__).parent
QUANTITIES = ("attn_score_decode/rel_fro", "attn_out_v_decode/rel_fro", "attn_out_decode/rel_fro")


def main() -> None:
    newest: dict[str, dict] = {}
    for r in load_records(HERE):  # oldest first: the newest record of a cache wins
        if r.get("status") == "ok" and r["config"]["task"]["name"] == "probe":
            newest[r["cache"]] = r
    tables = {c: read_table(r, "probe_tables", "per_layer") for c, r in newest.items()}
    first = next(iter(tables.values()))
    kinds = [row[first["columns"].index("attention")] for row in first["rows"]]
    lines = ["| layer | attention | " + " | ".join(f"`{c}` {q.split('/')[0]}" for c in tables for q in QUANTITIES[2:])
             + " |"]  # fmt: skip
    lines.append("|---|---|" + "---|" * len(tables))
    for i, kind in enumerate(kinds):
        cells = [f"{t['rows'][i][t['columns'].index(QUANTITIES[2])]:.3f}" for t in tables.values()]
        lines.append(f"| {i} | {kind} | " + " | ".join(cells) + " |")
    (HERE / "probe_layers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

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
