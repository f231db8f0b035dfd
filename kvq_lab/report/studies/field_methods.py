"""Table and figure of experiments/field_methods from its run records (python -m kvq_lab.report field_methods).

One row per cache (its label): stored bits per element of everything it keeps (`cache/bits_total`), the fidelity
task's KL(16-bit || cache) mean and p99 and top-1 agreement (4 CoQA windows x 256 decoded tokens), each row's KL minus
KIVI int2's paired over decode positions (per-position means over the windows; the standard error from 16 blocks of
16 consecutive positions, so that neighbouring positions' correlation does not shrink it), decode perplexity, and
passkey / needle retrieval accuracy at 4K and 8K tokens, CoQA-turns F1 (first 100 turns). Then the paired contrasts
that answer the study's three questions, and GEAR's. Per row and task the newest completed record from a clean tree
wins (SmolLM2-135M's records, read through `kvq_lab.report.study.read`: each checked against its digest). Writes
table.md and pareto.png here.
"""

from __future__ import annotations

from pathlib import Path

from kvq_lab.report.frontier import Point, pareto
from kvq_lab.report.rows import block_paired
from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import read

MODELS = ("smollm2-135m",)

BASELINE = "K2b-C32_V2b-T32_sim"  # KIVI int2 K-C/V-T: the row every KL difference is paired against

NAMES = {  # cache label -> the row's name
    "K16b_V16b_sim": "16-bit",
    "K2b-C32_V2b-T32_sim": "KIVI int2 K-C/V-T",
    "K3b-C32_V3b-T32_sim": "KIVI int3 K-C/V-T",
    "K4b-C32_V4b-T32_sim": "KIVI int4 K-C/V-T",
    "Knuq3b-C32_Vnuq3b-T32_sim_preRoPE_Kout0.01_Vout0.01": "KVQuant nuq3 pre-RoPE + 1% outliers",
    "Kturbo2b-T64_Vturbo2b-T64_sim_Krhad_Vrhad": "TurboQuant mse 2b",
    "Kturbo3b-T64_Vturbo3b-T64_sim_Krhad_Vrhad": "TurboQuant mse 3b",
    "Kturbo4b-T64_Vturbo4b-T64_sim_Krhad_Vrhad": "TurboQuant mse 4b",
    "Kturbo2b-T64_Vturbo2b-T64_sim_Krhad_Vrhad_Kqjl64_Vqjl64": "TurboQuant prod 3b (mse 2b + QJL)",
    "K2b-C32_V2b-T32_sim_Kqjl64": "KIVI int2 + QJL on keys",
    "Kq80-T32_Vq80-T32_sim": "ggml q8_0",
    "Kq80-T32_Vq80-T32_sim_Khad_Vhad64": "ggml q8_0 + Hadamard",
    "Kq40-T32_Vq40-T32_sim": "ggml q4_0",
    "Kq40-T32_Vq40-T32_sim_Khad_Vhad64": "ggml q4_0 + Hadamard",
    "Kq50-T32_Vq50-T32_sim": "ggml q5_0",
    "Kq51-T32_Vq51-T32_sim": "ggml q5_1",
    "Kfp8e4m3-C32_Vfp8e4m3-T32_sim": "FP8 E4M3 K-C/V-T",
    "Knvfp4-T16_Vnvfp4-T16_sim": "NVFP4 (G16, E4M3 scales + fp32 tensor scale)",
    "Kmxfp4-T32_Vmxfp4-T32_sim": "MXFP4 (G32, E8M0 scales)",
    "K2b-C32_V2b-T32_sim_Kout0.02_Vout0.02_Klowrank1_Vlowrank1": "GEAR 2b (int2 + 2% outliers + rank-1 error)",
    "K4b-C32_V4b-T32_sim_Kout0.02_Vout0.02_Klowrank1_Vlowrank1": "GEAR 4b (int4 + 2% outliers + rank-1 error)",
}
GEAR2 = "K2b-C32_V2b-T32_sim_Kout0.02_Vout0.02_Klowrank1_Vlowrank1"
GEAR4 = "K4b-C32_V4b-T32_sim_Kout0.02_Vout0.02_Klowrank1_Vlowrank1"

QUESTIONS = {  # question -> (a, b) pairs: b minus a
    "1. QJL residual vs the same bit on the MSE stage": [
        ("Kturbo3b-T64_Vturbo3b-T64_sim_Krhad_Vrhad", "Kturbo2b-T64_Vturbo2b-T64_sim_Krhad_Vrhad_Kqjl64_Vqjl64"),
        ("Kturbo2b-T64_Vturbo2b-T64_sim_Krhad_Vrhad", "Kturbo2b-T64_Vturbo2b-T64_sim_Krhad_Vrhad_Kqjl64_Vqjl64"),
        ("K3b-C32_V3b-T32_sim", "K2b-C32_V2b-T32_sim_Kqjl64"),
        ("K2b-C32_V2b-T32_sim", "K2b-C32_V2b-T32_sim_Kqjl64"),
    ],
    "2. TurboQuant vs ggml q4_0 + Hadamard and KIVI": [
        ("Kq40-T32_Vq40-T32_sim_Khad_Vhad64", "Kturbo4b-T64_Vturbo4b-T64_sim_Krhad_Vrhad"),
        ("K3b-C32_V3b-T32_sim", "Kturbo4b-T64_Vturbo4b-T64_sim_Krhad_Vrhad"),
        ("K2b-C32_V2b-T32_sim", "Kturbo3b-T64_Vturbo3b-T64_sim_Krhad_Vrhad"),
        ("K4b-C32_V4b-T32_sim", "Kturbo4b-T64_Vturbo4b-T64_sim_Krhad_Vrhad"),
        ("K3b-C32_V3b-T32_sim", "Kturbo3b-T64_Vturbo3b-T64_sim_Krhad_Vrhad"),
        ("K2b-C32_V2b-T32_sim", "Kturbo2b-T64_Vturbo2b-T64_sim_Krhad_Vrhad"),
        ("Kq40-T32_Vq40-T32_sim", "Kq40-T32_Vq40-T32_sim_Khad_Vhad64"),
    ],
    "3. NVFP4 and MXFP4 vs int4 and FP8": [
        ("K4b-C32_V4b-T32_sim", "Knvfp4-T16_Vnvfp4-T16_sim"),
        ("K4b-C32_V4b-T32_sim", "Kmxfp4-T32_Vmxfp4-T32_sim"),
        ("K3b-C32_V3b-T32_sim", "Kmxfp4-T32_Vmxfp4-T32_sim"),
        ("Kq40-T32_Vq40-T32_sim", "Knvfp4-T16_Vnvfp4-T16_sim"),
        ("Kfp8e4m3-C32_Vfp8e4m3-T32_sim", "Knvfp4-T16_Vnvfp4-T16_sim"),
        ("Kmxfp4-T32_Vmxfp4-T32_sim", "Knvfp4-T16_Vnvfp4-T16_sim"),
    ],
    "4. GEAR vs KIVI and KVQuant": [
        ("K2b-C32_V2b-T32_sim", GEAR2),
        ("K3b-C32_V3b-T32_sim", GEAR2),
        ("Knuq3b-C32_Vnuq3b-T32_sim_preRoPE_Kout0.01_Vout0.01", GEAR2),
        ("K4b-C32_V4b-T32_sim", GEAR2),
        ("K4b-C32_V4b-T32_sim", GEAR4),
        ("Kq51-T32_Vq51-T32_sim", GEAR4),
    ],
}


def records(folder: Path) -> list[dict]:
    """Every completed record of the study's model made from a clean tree, oldest first."""
    return read(folder, MODELS, clean=True)


def collect(recs: list[dict]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for r in recs:
        row = rows.setdefault(r["cache"], {})
        m, task = r["metrics"], r["config"]["task"]
        row["bits"], row["total"] = m.get("cache/bits"), m.get("cache/bits_total")
        if "fidelity/kl_mean" in m:
            row.update(kl=m["fidelity/kl_mean"], p99=m["fidelity/kl_p99"], top1=m["fidelity/top1_agree"])
            row["kl_pos"] = r["artifacts"]["fidelity_by_position"]["kl_mean"]
            row["top1_pos"] = r["artifacts"]["fidelity_by_position"]["top1_agree"]
            row["git"] = r["env"]["git"]
        if "ppl/ppl" in m:
            row["ppl"] = m["ppl/ppl"]
        if "coqa_turns/f1" in m:
            row.update(coqa_f1=m["coqa_turns/f1"], coqa_n=m["coqa_turns/n"])
        if "retrieval/acc" in m:
            row[f"{task['kind']}{int(task['context_tokens']) // 1024}K"] = m["retrieval/acc"]
    return rows


RETRIEVAL = ("needle4K", "needle8K", "passkey4K", "passkey8K")  # columns shown where some record has them (% correct)


def tables(recs: list[dict]) -> dict[str, str]:
    rows = collect(recs)
    retrieval = [k for k in RETRIEVAL if any(k in r for r in rows.values())]
    base = rows.get(BASELINE, {}).get("kl_pos")
    order = list(NAMES)
    lines = [
        "| row | stored bits/elem | KL mean | KL p99 | top-1 agree | KL - KIVI int2, paired ± SE | decode ppl | "
        + " | ".join(f"{k} (%)" for k in retrieval)
        + " | CoQA-turns F1 (n) |",
        "|---|---|---|---|---|---|---|" + "---|" * len(retrieval) + "---|",
    ]
    for label in sorted(rows, key=lambda x: order.index(x) if x in order else len(order)):
        row = rows[label]

        def f(key, fmt, row=row):
            return format(row[key], fmt) if key in row else "-"

        diff = "-"
        if base is not None and "kl_pos" in row and label != BASELINE:
            m, se, _ = block_paired(base, row["kl_pos"])
            diff = f"{m:+.3f} ± {se:.3f}"
        ret = "".join(f" {f(k, '.0f')} |" for k in retrieval)
        coqa = f"{row['coqa_f1']:.1f} ({row['coqa_n']})" if "coqa_f1" in row else "-"
        lines.append(
            f"| {NAMES.get(label, label)} | {f('total', '.3f')} | {f('kl', '.3f')} | {f('p99', '.2f')} | "
            f"{f('top1', '.3f')} | {diff} | {f('ppl', '.2f')} |{ret} {coqa} |"
        )
    for q, pairs in QUESTIONS.items():
        lines += ["", f"{q} (b - a; KL paired over decode positions ± SE; top-1 agreement difference):", ""]
        for a, b in pairs:
            if "kl_pos" in rows.get(a, {}) and "kl_pos" in rows.get(b, {}):
                m, se, n = block_paired(rows[a]["kl_pos"], rows[b]["kl_pos"])
                t = rows[b]["top1"] - rows[a]["top1"]
                bits = rows[b]["total"] - rows[a]["total"]
                lines.append(
                    f"- {NAMES.get(b, b)} - {NAMES.get(a, a)}: KL {m:+.3f} ± {se:.3f} ({n} positions), top-1 {t:+.3f}, "
                    f"bits {bits:+.3f}"
                )
    return {"table.md": "\n".join(lines) + "\n"}


def figure(recs: list[dict], folder: Path) -> None:
    rows = collect(recs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted((row["total"], row["kl"], label) for label, row in rows.items() if "kl" in row and row["total"] < 16)
    front, _ = pareto([Point(label, bits, kl) for bits, kl, label in pts])  # the points nothing cheaper beats
    frontier = [(bits, kl) for bits, kl, label in pts if label in front]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for bits, kl, label in pts:
        ax.scatter(bits, kl, s=18, color="C0" if (bits, kl) in frontier else "C7")
        ax.annotate(NAMES.get(label, label), (bits, kl), fontsize=7, xytext=(3, 2), textcoords="offset points")
    ax.plot(*zip(*frontier, strict=True), color="C0", lw=1, label="Pareto frontier (fewer bits, lower KL)")
    ax.set_xlabel("stored bits per K/V element (codes, scales, norms, sketches, outliers: everything)")
    ax.set_ylabel("KL(16-bit || cache), nats per token (mean over 4 x 256 decoded tokens)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("SmolLM2-135M-Instruct, every cached token quantized (simulated), CoQA stories")
    fig.tight_layout()
    fig.savefig(Path(folder) / "pareto.png", dpi=120)


def rows(recs: list[dict]):
    """One line per cache: the numbers the table shows (per-position and per-turn scores stay out)."""
    return frame({"cache": label, "name": NAMES.get(label, label), **row} for label, row in collect(recs).items())
