"""Table and figure of experiments/methods from its run records (python experiments/methods/table.py).

One row per cache (its label), with the stored bits per element of everything it keeps (`cache/bits_total`: codes,
scales/zeros, codebooks, outliers and their indices, the exact window, at the ppl task's length), the format's own
bits (`cache/bits`), decode perplexity and CoQA-turns F1 where run. Writes table.md and bits_vs_quality.png here.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

NAMES = {  # cache label -> the row's name in the words
    "K16b_V16b_pac_R128": "16-bit",
    "K2b-C32_V2b-T32_pac_R128": "KIVI int2 K-C/V-T",
    "K2b-C32_V2b-T32_pac_R128_preRoPE": "int2 K-C/V-T, keys pre-RoPE",
    "K2b-C32_V2b-T32_pac_R128_Kout0.01_Vout0.01": "int2 K-C/V-T + 1% outliers",
    "Knuq3b-C32_Vnuq3b-T32_pac_R128_preRoPE_Kout0.01_Vout0.01": "KVQuant-style nuq3 pre-RoPE + 1% outliers",
    "Knuq2b-C32_Vnuq2b-T32_pac_R128_preRoPE": "nuq2 K-C/V-T, keys pre-RoPE",
    "K2b-T32_V2b-T32_pac_R128": "int2 K-T/V-T",
    "K2b-T32_V2b-T32_pac_R128_Khad": "int2 K-T + hadamard (shared, post-RoPE)",
    "K2b-T32_V2b-T32_pac_R128_preRoPE_Khad32": "int2 K-T + hadamard:32 pre-RoPE (shared)",
    "K2b-T32_V2b-T32_pac_R128_preRoPE_Krkv32": "int2 K-T + rotatekv:32 pre-RoPE (per head)",
    "K2b-T32_V2b-T32_pac_R128_Kinnerq": "int2 K-T + innerq",
    "K2b-T32_V2b-T32_pac_R128_Kinnerq0.5": "int2 K-T + innerq:0.5 (partial scale)",
    "K2b-T32_V2b-T32_pac_R128_Kinnerq0.25": "int2 K-T + innerq:0.25 (partial scale)",
}


def records():
    for p in sorted((HERE / "runs").glob("*/record.json")):
        r = json.loads(p.read_text())
        if r.get("status") == "ok":
            yield r


def main() -> None:
    rows: dict[str, dict] = {}
    for r in records():  # later records of a row win (runs sort by time)
        row = rows.setdefault(r["cache"], {})
        m = r["metrics"]
        row["bits"], row["total"] = m.get("cache/bits"), m.get("cache/bits_total")
        if "ppl/ppl" in m:
            row["ppl"], row["windows"] = m["ppl/ppl"], int(m.get("ppl/windows", 0))
        if "coqa_turns/f1" in m:
            row["f1"], row["f1_se"] = m["coqa_turns/f1"], m.get("coqa_turns/f1_stderr")
            row["turns"] = int(m.get("coqa_turns/n", 0))
    order = list(NAMES)
    lines = [
        "| row | stored bits/elem (all) | format bits/elem | decode ppl (windows) | CoQA-turns F1 (turns) |",
        "|---|---|---|---|---|",
    ]
    for label in sorted(rows, key=lambda x: order.index(x) if x in order else len(order)):
        row = rows[label]
        ppl = f"{row['ppl']:.2f} ({row['windows']})" if "ppl" in row else "-"
        se = f" ± {row['f1_se']:.1f}" if row.get("f1_se") is not None else ""
        f1 = f"{row['f1']:.2f}{se} ({row['turns']})" if "f1" in row else "-"
        total = f"{row['total']:.3f}" if row.get("total") is not None else "-"
        lines.append(f"| {NAMES.get(label, label)} | {total} | {row['bits']:.2f} | {ppl} | {f1} |")
    table = "\n".join(lines)
    print(table)
    (HERE / "table.md").write_text(table + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, name in ((axes[0], "ppl", "decode perplexity"), (axes[1], "f1", "CoQA-turns F1")):
        for label, row in rows.items():
            if key in row and row.get("total") is not None and row["total"] < 16:
                ax.scatter(row["total"], row[key])
                ax.annotate(NAMES.get(label, label), (row["total"], row[key]), fontsize=7)
        ref = next((r[key] for lab, r in rows.items() if lab.startswith("K16b") and key in r), None)
        if ref is not None:
            ax.axhline(ref, color="gray", ls="--", lw=0.8, label="16-bit")
            ax.legend(fontsize=7)
        ax.set_xlabel("stored bits per K/V element (everything stored)")
        ax.set_ylabel(name)
        if key == "ppl":
            ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(HERE / "bits_vs_quality.png", dpi=120)


if __name__ == "__main__":
    main()
