"""Table and figure of experiments/mixed_precision from its run records (python -m kvq_lab.report mixed_precision).

Rows: one per cache (uniform b-bit, or a searched per-layer or per-head assignment), with decode ppl (the full task,
4 windows x 512 scored tokens, and the quick version's 4 x 256, each where run), CoQA-turns F1 (when run), mean
key/value code bits, and stored bits per K/V element counted as the search counts them
(`kvq_lab.fit.precision.measure_costs`: the packed cache's nbytes() at `precision.tokens` tokens). Figure: the chosen
per-layer key and value bits of each searched row (per_layer_bits.png; a per-head row: each layer's mean over its KV
heads). Records: SmolLM2-135M's, read through `kvq_lab.report.study.read` (each checked against its digest). The
stored bits need the model's shapes: the model is loaded (the real SmolLM2, converted once).
"""

from __future__ import annotations

import functools
from pathlib import Path

from kvq_lab.cache.config import CacheConfig
from kvq_lab.fit import precision
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.report.rows import mean_se, paired_difference
from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import per_doc, read

MODELS = ("smollm2-135m",)


def records(folder: Path) -> list[dict]:
    return read(folder, MODELS)


def f1_se(rec: dict) -> float | None:
    """Standard error of the mean per-turn F1 (in %) from a CoQA run's samples, None without them."""
    if not (Path(rec["_path"]) / "samples.json").is_file():
        return None
    return mean_se(list(per_doc(rec, "f1", 100).values()))[1]


def turn_f1(row: dict) -> dict:
    """A CoQA row's per-turn F1 in % by doc_id, in the samples' order."""
    return per_doc(row["coqa"], "f1", 100)


def paired_f1(base: dict, other: dict) -> str:
    """`other` minus `base` on the CoQA turns both scored, as a table note."""
    mean, se, n = paired_difference(turn_f1(base), turn_f1(other))
    return f"CoQA-turns F1 {mean:+.2f} ± {se:.2f} (paired over the same {n} turns)"


def paired(rows) -> list[str]:
    """Searched vs uniform at equal stored bits on the same CoQA turns: the mean per-turn F1 difference and its
    standard error (paired, so the turns' own spread cancels)."""
    out = []
    uniform = [r for r in rows if not r["budget"] and "stored" in r and "coqa" in r]
    for s in sorted((r for r in rows if r["budget"] and "coqa" in r), key=lambda r: r["budget"]):
        for u in uniform:
            if abs(u["stored"] - s.get("stored", -1)) > 1e-9:
                continue
            if list(turn_f1(s)) != list(turn_f1(u)):
                continue
            out.append(f"- {s['label']} vs {u['label']} (both {u['stored']:.3f} bits per element): {paired_f1(u, s)}")
    return ["", *out] if out else []


def per_unit_bits(cc: dict, tensor: str, heads: int | None) -> list:
    """A record's bits per layer (30 layers): an int each, or with `heads` (a per-head row's KV heads) a list per
    layer, one per head (a layer whose heads agree is stored as a plain layer config: its width for every head)."""
    layers = cc.get("layers") or []
    if not layers:
        return [cc[tensor]["bits"]] * 30
    i = 0 if tensor == "key" else 1
    bits = [[h[i] for h in lc["head_bits"]] if lc.get("head_bits") else lc[tensor]["bits"] for lc in layers]
    return bits if heads is None else [b if isinstance(b, list) else [b] * heads for b in bits]


def mean(bits: list) -> float:
    units = precision.flat(bits)
    return sum(units) / len(units)


def _tuple(bits: list) -> tuple:
    return tuple(tuple(b) if isinstance(b, list) else b for b in bits)


def per_head_vs_layer(rows) -> list[str]:
    """Searched per head vs searched per layer at equal stored bits: the decode ppl ratio (same 4 x 512 tokens)."""
    out = []
    layer = [r for r in rows if r["budget"] and not r["heads"] and 512 in r["ppl"] and "stored" in r]
    for h in sorted((r for r in rows if r["budget"] and r["heads"] and 512 in r["ppl"]), key=lambda r: r["budget"]):
        for r in layer:
            if abs(r["stored"] - h.get("stored", -1)) < 1e-9:
                change = 100 * (h["ppl"][512] / r["ppl"][512] - 1)
                line = (
                    f"- {h['label']} vs {r['label']} (both {r['stored']:.3f} bits per element): decode ppl "
                    f"{h['ppl'][512]:.2f} vs {r['ppl'][512]:.2f} ({change:+.1f}%)"
                )
                if "coqa" in h and "coqa" in r:
                    line += f"; {paired_f1(r, h)}"
                out.append(line)
    return ["", *out] if out else []


def spec(d) -> QuantSpec:
    return QuantSpec(d["bits"], d["group_size"], d["axis"], d["format"])


@functools.cache
def load_model():
    from kvq_lab.models.loading import load_model

    return load_model(MODELS[0])[0]


def tables(recs: list[dict], model=None) -> dict[str, str]:
    """{file name here: its text}: table.md (`model`: the loaded SmolLM2, loaded here when not given)."""
    return {"table.md": "\n".join(collect(recs, model or load_model())[0]) + "\n"}


def collect(recs: list[dict], model) -> tuple[list[str], dict]:
    """-> (the table's lines, its rows by (key bits, value bits))."""
    rows: dict[tuple, dict] = {}
    H = model.config.num_key_value_heads
    tokens = set()  # the searches' precision.tokens: every row's bytes are counted at that length
    for r in recs:
        folder = Path(r["_path"])
        cc = r["cache_config"]
        layers = cc.get("layers") or []
        prec = r["config"].get("precision") or {}
        name = prec.get("name", "uniform")
        budget = prec.get("budget") if name == "search" else None
        heads = prec.get("granularity") == "head" or any(lc.get("head_bits") for lc in layers)
        kb, vb = (per_unit_bits(cc, t, H if heads else None) for t in ("key", "value"))
        # CoQA rows rerun a searched file (precision=file): they join the searched row with the same bits
        key = (_tuple(kb), _tuple(vb))
        row = rows.setdefault(key, {"kb": kb, "vb": vb, "budget": budget, "heads": heads, "folder": folder, "ppl": {}})
        row["budget"] = row["budget"] or budget
        m = r["metrics"]
        if "ppl/ppl" in m:  # keyed by scored tokens per window: the quick version (256) and the full one (512)
            row["ppl"][r["config"]["task"]["eval_tokens"]] = m["ppl/ppl"]
        n = int(m.get("coqa_turns/n") or r["config"].get("limit") or 0)
        if "coqa_turns/f1" in m and n >= row.get("n", 0):  # the run over the most turns (60, then 100 where run)
            row["f1"], row["n"] = m["coqa_turns/f1"], n
            row["f1_se"] = f1_se(r)
            row["coqa"] = r
        if name == "search":
            row["searched"] = folder / "precision.yaml"
            tokens.add(prec["tokens"])
    if len(tokens) > 1:
        raise SystemExit(f"searches at different precision.tokens {sorted(tokens)}: their bytes are not comparable")
    T = tokens.pop() if tokens else 512
    base = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"))
    lines = [
        f"Stored bits per K/V element counted at {T} tokens (the searches' precision.tokens).",
        "",
        "| row | budget | mean key bits | mean value bits | stored bits / element | decode ppl, 4 x 512 | "
        "decode ppl, 4 x 256 (quick) | CoQA-turns F1 ± SE (turns) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows.values(), key=lambda r: (mean(r["kb"]) + mean(r["vb"]), r["heads"])):
        kb, vb = row["kb"], row["vb"]
        used = set(precision.flat(kb)) | set(precision.flat(vb))
        reference = used == {16}
        if reference:  # 16 bits: the exact cache, stored in the model's dtype; not a point of the byte budget
            stored, label = "-", "16-bit (reference)"
        else:
            costs = precision.measure_costs(model, base, sorted(used), T, "head" if row["heads"] else "layer")
            row["stored"] = costs.bits(kb, vb)
            stored = f"{row['stored']:.3f}"
            unit = "per head" if row["heads"] else "per layer"
            label = f"searched {unit}, budget {row['budget']:g}" if row["budget"] else f"uniform {kb[0]}-bit"
        se = f" ± {row['f1_se']:.1f}" if row.get("f1_se") is not None else ""
        f1 = f"{row['f1']:.2f}{se} ({row['n']})" if "f1" in row else "-"
        ppl = [f"{row['ppl'][t]:.2f}" if t in row["ppl"] else "-" for t in (512, 256)]
        budget = f"{row['budget']:g}" if row["budget"] else "-"
        lines.append(
            f"| {label} | {budget} | {mean(kb):.2f} | {mean(vb):.2f} | {stored} | {ppl[0]} | {ppl[1]} | {f1} |"
        )
        row["label"] = label
    lines += paired(rows.values())
    lines += per_head_vs_layer(rows.values())
    return lines, rows


def figure(recs: list[dict], folder: Path) -> None:
    rows = collect(recs, load_model())[1]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    searched = [r for r in rows.values() if r["budget"]]
    if not searched:
        return
    fig, axes = plt.subplots(len(searched), 1, figsize=(9, 2.2 * len(searched)), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], sorted(searched, key=lambda r: r["budget"]), strict=True):
        x = range(len(row["kb"]))
        ax.step(x, [mean([b]) for b in row["kb"]], where="mid", label="key bits", lw=2)
        ax.step(x, [mean([b]) for b in row["vb"]], where="mid", label="value bits", lw=2, ls="--")
        ax.set_ylabel("bits")
        ax.set_yticks([2, 3, 4, 8])
        ax.set_title(row["label"], fontsize=9)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("layer")
    fig.tight_layout()
    fig.savefig(Path(folder) / "per_layer_bits.png", dpi=110)


def rows(recs: list[dict]):
    """One line per table row: label, budget, mean key/value bits, stored bits, F1 (loads the model for the bytes)."""
    by_bits = collect(recs, load_model())[1]
    return frame(
        {
            **row,
            "mean_key_bits": mean(row["kb"]),
            "mean_value_bits": mean(row["vb"]),
            **{f"ppl_{t}": p for t, p in row["ppl"].items()},
        }
        for row in by_bits.values()
    )
