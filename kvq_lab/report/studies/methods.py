"""Table and figure of experiments/methods from its run records (python -m kvq_lab.report methods).

One row per cache (its label), with the stored bits per element of everything it keeps (`cache/bits_total`: codes,
scales/zeros, codebooks, outliers and their indices, the exact window, at the ppl task's length), the format's own
bits (`cache/bits`), decode perplexity and CoQA-turns F1 where run (over the row's own turns, and over the turns every
row scored, which the figure plots), and each row's CoQA-turns F1 minus KIVI's (K-C/V-T) paired over the turns both
scored. Per row and task the record with the most coverage (ppl windows, CoQA
turns) wins, the newest among equals, so a quick rerun never hides the full one; records from a dirty git tree are
skipped (SmolLM2-135M's records, read through `kvq_lab.report.study.read`: each checked against its digest). Writes
table.md and bits_vs_quality.png here.
"""

from __future__ import annotations

from pathlib import Path

from kvq_lab.report.rows import mean_se, paired_difference
from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import per_doc, read

MODELS = ("smollm2-135m",)

BASELINE = "K2b-C32_V2b-T32_pac_R128"  # KIVI int2 K-C/V-T: the row every CoQA difference is paired against

NAMES = {  # cache label -> the row's name in the papers' words
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

CONTRASTS = [  # (a, b): the papers' claims as paired CoQA differences, b minus a, over the turns both scored
    ("K2b-C32_V2b-T32_pac_R128", "K2b-C32_V2b-T32_pac_R128_preRoPE"),
    ("K2b-T32_V2b-T32_pac_R128_Khad", "K2b-T32_V2b-T32_pac_R128_preRoPE_Khad32"),
    ("K2b-T32_V2b-T32_pac_R128_preRoPE_Khad32", "K2b-T32_V2b-T32_pac_R128_preRoPE_Krkv32"),
    ("K2b-C32_V2b-T32_pac_R128", "K2b-C32_V2b-T32_pac_R128_Kout0.01_Vout0.01"),
    ("K16b_V16b_pac_R128", "Knuq3b-C32_Vnuq3b-T32_pac_R128_preRoPE_Kout0.01_Vout0.01"),
    ("K2b-C32_V2b-T32_pac_R128_preRoPE", "Knuq2b-C32_Vnuq2b-T32_pac_R128_preRoPE"),
    ("K2b-T32_V2b-T32_pac_R128", "K2b-T32_V2b-T32_pac_R128_Kinnerq"),
    ("K2b-T32_V2b-T32_pac_R128", "K2b-T32_V2b-T32_pac_R128_Kinnerq0.5"),
    ("K2b-T32_V2b-T32_pac_R128", "K2b-T32_V2b-T32_pac_R128_Kinnerq0.25"),
    ("K2b-T32_V2b-T32_pac_R128", "K2b-T32_V2b-T32_pac_R128_preRoPE_Krkv32"),
]


def records(folder: Path) -> list[dict]:
    """Every completed record of the study's model made from a clean tree, oldest first."""
    return read(folder, MODELS, clean=True)


def collect(recs: list[dict]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for r in recs:
        run = Path(r["_path"])
        row = rows.setdefault(r["cache"], {})
        m = r["metrics"]
        row["bits"], row["total"] = m.get("cache/bits"), m.get("cache/bits_total")
        if "ppl/ppl" in m and int(m.get("ppl/windows", 0)) >= row.get("windows", 0):
            row["ppl"], row["windows"] = m["ppl/ppl"], int(m.get("ppl/windows", 0))
        if "coqa_turns/f1" in m and int(m.get("coqa_turns/n", 0)) >= row.get("turns", 0):
            row["f1"], row["turns"], row["coqa_run"] = m["coqa_turns/f1"], int(m["coqa_turns/n"]), run
            row["coqa_git"] = r["env"]["git"]
            row["turn_f1"] = per_doc(r, "f1", 100)  # doc_id -> F1 (%) of each CoQA turn the run scored
            row["f1_se"] = mean_se(list(row["turn_f1"].values()))[1]
    base = rows.get(BASELINE, {}).get("turn_f1")
    for label, row in rows.items():
        if base is not None and "turn_f1" in row and label != BASELINE:
            row["diff"] = paired_difference(base, row["turn_f1"])
    shared = shared_turns(rows)
    for row in rows.values():
        if "turn_f1" in row and shared:
            row["f1_shared"] = mean_se([row["turn_f1"][i] for i in shared])
    return rows


def shared_turns(rows: dict[str, dict]) -> list[int]:
    """The CoQA turns every row with a CoQA record scored: rows run at different limits compare on these."""
    sets = [set(r["turn_f1"]) for r in rows.values() if "turn_f1" in r]
    return sorted(set.intersection(*sets)) if sets else []


def tables(recs: list[dict]) -> dict[str, str]:
    rows = collect(recs)
    shared = shared_turns(rows)
    order = list(NAMES)
    lines = [
        "| row | stored bits/elem (all) | format bits/elem | decode ppl (windows) | CoQA-turns F1 ± SE (turns) "
        f"| CoQA F1 ± SE, the {len(shared)} turns all rows share | CoQA F1 - KIVI, paired ± SE (turns) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in sorted(rows, key=lambda x: order.index(x) if x in order else len(order)):
        row = rows[label]
        ppl = f"{row['ppl']:.2f} ({row['windows']})" if "ppl" in row else "-"
        f1 = f"{row['f1']:.2f} ± {row['f1_se']:.1f} ({row['turns']})" if "f1" in row else "-"
        sh = f"{row['f1_shared'][0]:.2f} ± {row['f1_shared'][1]:.1f}" if "f1_shared" in row else "-"
        d = f"{row['diff'][0]:+.2f} ± {row['diff'][1]:.2f} ({row['diff'][2]})" if "diff" in row else "-"
        total = f"{row['total']:.3f}" if row.get("total") is not None else "-"
        lines.append(f"| {NAMES.get(label, label)} | {total} | {row['bits']:.2f} | {ppl} | {f1} | {sh} | {d} |")
    lines += ["", "Paired CoQA-turns F1 differences (b - a, over the turns both scored):", ""]
    for a, b in CONTRASTS:
        if "turn_f1" in rows.get(a, {}) and "turn_f1" in rows.get(b, {}):
            m, se, n = paired_difference(rows[a]["turn_f1"], rows[b]["turn_f1"])
            lines.append(f"- {NAMES[b]} - {NAMES[a]}: {m:+.2f} ± {se:.2f} ({n} turns)")
    return {"table.md": "\n".join(lines) + "\n"}


def figure(recs: list[dict], folder: Path) -> None:
    rows = collect(recs)
    order = list(NAMES)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.2, 1]})
    ax = axes[0]
    for label, row in rows.items():
        if "ppl" in row and row.get("total") is not None and row["total"] < 16:
            ax.scatter(row["total"], row["ppl"])
            ax.annotate(NAMES.get(label, label), (row["total"], row["ppl"]), fontsize=7)
    ref = next((r["ppl"] for lab, r in rows.items() if lab.startswith("K16b") and "ppl" in r), None)
    if ref is not None:
        ax.axhline(ref, color="gray", ls="--", lw=0.8, label="16-bit")
        ax.legend(fontsize=7)
    ax.set_xlabel("stored bits per K/V element (everything stored)")
    ax.set_ylabel(f"decode perplexity ({max(r.get('windows', 0) for r in rows.values())} windows x 512 tokens)")
    ax.set_yscale("log")
    # CoQA: per-turn F1 spread dwarfs the differences, so plot each row's paired difference from KIVI, not raw F1
    ax = axes[1]
    diffs = [(lab, rows[lab]["diff"]) for lab in order if "diff" in rows.get(lab, {})]
    y = range(len(diffs))
    ax.errorbar([d[0] for _, d in diffs], y, xerr=[d[1] for _, d in diffs], fmt="o", ms=4, capsize=2)
    ax.set_yticks(list(y), [f"{NAMES[lab]}: {rows[lab]['total']:.2f} b, {d[2]} turns" for lab, d in diffs], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="gray", ls="--", lw=0.8)
    ax.set_xlabel(f"CoQA-turns F1 - KIVI's ({rows[BASELINE]['total']:.2f} b), paired ± 1 SE")
    fig.tight_layout()
    fig.savefig(Path(folder) / "bits_vs_quality.png", dpi=120)


def rows(recs: list[dict]):
    """One line per cache: the numbers the table shows (per-position and per-turn scores stay out)."""
    return frame({"cache": label, "name": NAMES.get(label, label), **row} for label, row in collect(recs).items())
