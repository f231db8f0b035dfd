"""KIVI Table 2 over run records: reconstruction error vs error where the tensor is consumed, per-token beside
per-channel, ours beside the paper's Llama-2-13B numbers, and per-layer/head figures of the axis effect.

python -m kvq_lab.report.error_geometry results [--experiment NAME] [--model NAME] [--figures DIR]

Probe records are read through `kvq_lab.report.study.read` (each checked against its digest), of one model
(`--model`, default SmolLM2-135M): a folder holding two models' probes never averages them into one cell.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvq_lab.probes.metrics import ERRORS
from kvq_lab.probes.results import PREFIX
from kvq_lab.probes.settings import KV_QUANTITIES

TABLE2 = [
    # (label, quantity, axis knob that decides it, KIVI per-token, KIVI per-channel)
    ("key reconstruction", "key", "key_axis", 13.67, 4.55),
    ("attention score (all rows)", "attn_score", "key_axis", 47.00, 9.60),
    ("attention score (decode row)", "attn_score_decode", "key_axis", 47.00, 9.60),
    ("value reconstruction", "value", "value_axis", 4.57, 3.73),
    ("attention output, only V quantized (all rows)", "attn_out_v", "value_axis", 3.55, 49.89),
    ("attention output, only V quantized (decode row)", "attn_out_v_decode", "value_axis", 3.55, 49.89),
]


def table2(records: list[dict], definitions=None) -> str:
    """Markdown: per-token vs per-channel for keys and values, ours beside KIVI's Llama-2-13B numbers.

    Each of our cells is the mean over the records with that axis (the other axis does not change it; the spread
    across those records is shown when it is not zero). definitions: the error definitions shown (default: every
    registered one, `kvq_lab.probes.metrics.ERRORS`)."""
    definitions = tuple(ERRORS) if definitions is None else definitions
    lines = [
        "| quantity | definition | ours per-token | ours per-channel | KIVI per-token | KIVI per-channel |",
        "|---|---|---|---|---|---|",
    ]
    for label, q, knob, kt, kc in TABLE2:
        for d in definitions:
            cells = []
            for axis in ("token", "channel"):
                vals = [
                    r["metrics"][f"{PREFIX}/{q}/{d}/mean"]
                    for r in records
                    if r["config"].get(knob) == axis and f"{PREFIX}/{q}/{d}/mean" in r["metrics"]
                ]
                if not vals:
                    cells.append("-")
                    continue
                m = sum(vals) / len(vals)
                spread = max(vals) - min(vals)
                cells.append(f"{m:.4g}" + (f" (±{spread / 2:.2g})" if spread > 1e-9 * max(abs(m), 1) else ""))
            paper = (f"{kt}", f"{kc}") if d == "kivi_ratio" else ("", "")
            lines.append(f"| {label} | {d} | {cells[0]} | {cells[1]} | {paper[0]} | {paper[1]} |")
    return "\n".join(lines)


def record_matrix(rec: dict, column: str):
    """[L, heads] numpy matrix of one per-head column of a probe record (KV quantities: one column per KV head)."""
    import numpy as np

    from kvq_lab.records.record import read_table

    t = read_table(rec, "probe_tables", "per_head")
    cols = t["columns"]
    i, li, hi, ki = cols.index(column), cols.index("layer"), cols.index("head"), cols.index("kv_head")
    kv = column.split("/")[0] in KV_QUANTITIES
    rows = [r for r in t["rows"] if not kv or r[hi] == min(x[hi] for x in t["rows"] if x[ki] == r[ki])]
    L = max(r[li] for r in rows) + 1
    m = np.array([r[i] for r in rows], dtype=float)
    return m.reshape(L, -1)


AXIS_PANELS = {
    "key_axis": ["key", "attn_score", "attn_score_decode", "attn_out_k", "attn_out_k_decode"],
    "value_axis": ["value", "attn_out_v", "attn_out_v_decode"],
}


def axis_figure(records: list[dict], definition: str, path: Path, title: str = "") -> Path:
    """Per-token vs per-channel heat-maps (layer x head) for keys and for values, one shared colour scale per
    column (log scale for error ratios), so the two axes can be compared cell by cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.ticker import MaxNLocator

    ncol = max(len(v) for v in AXIS_PANELS.values())
    fig, axes = plt.subplots(4, ncol, figsize=(3.4 * ncol, 15), squeeze=False)
    for b, (knob, quantities) in enumerate(AXIS_PANELS.items()):
        pick = {a: next((r for r in records if r["config"].get(knob) == a), None) for a in ("token", "channel")}
        for c in range(ncol):
            if c >= len(quantities) or None in pick.values():
                for a in range(2):
                    axes[2 * b + a][c].axis("off")
                continue
            q = quantities[c]
            mats = {a: record_matrix(r, f"{q}/{definition}") for a, r in pick.items()}
            both = np.concatenate([m.ravel() for m in mats.values()])
            pos = both[both > 0]
            # 1st-99th percentile: one near-exact head (e.g. a row held by a single sink token) must not flatten
            # the colour scale of the rest; cells beyond it are drawn at the end colours
            linear = ERRORS[definition].unit == "dB"  # a log-scale quantity already; ratios go on a log scale
            lo = float(np.percentile(both if linear else pos, 1)) if pos.size else 1e-6
            hi = float(np.percentile(both, 99))
            norm = Normalize(lo, hi) if linear else LogNorm(max(lo, 1e-6), max(hi, 2e-6))
            for a_i, (a, m) in enumerate(mats.items()):
                ax = axes[2 * b + a_i][c]
                cmap = "viridis_r" if ERRORS[definition].direction == "higher" else "viridis"
                im = ax.imshow(m, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
                ax.set_title(f"{knob.split('_')[0]} per-{a}: {q}\nmean {m.mean():.3g}", fontsize=9)
                ax.set_xlabel("KV head" if q in KV_QUANTITIES else "head", fontsize=8)
                ax.set_ylabel("layer", fontsize=8)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(f"{title}  {definition}: keys (rows 1-2), values (rows 3-4); bright = worse", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    from kvq_lab.report.study import read

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", nargs="?", default="results")
    ap.add_argument("--experiment", default=None, help="only records with this experiment_name")
    ap.add_argument("--model", default="smollm2-135m", help="whose probes (model.path or name, e.g. gemma3-270m)")
    ap.add_argument("--runs", nargs="*", default=None, help="only these run folder names")
    ap.add_argument(
        "--figures", default=None, help="folder for per-token vs per-channel heat-maps (one per definition)"
    )
    args = ap.parse_args(argv)
    if not (Path(args.results_dir) / "runs").is_dir():
        print(f"error: {args.results_dir!r} holds no runs/ folder: name a results folder (e.g. experiments/bits)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    recs = [
        r
        for r in read(Path(args.results_dir), (args.model,), where={"config.task.name": "probe"})
        if (args.experiment is None or r.get("experiment") == args.experiment)
        and (args.runs is None or Path(r["_path"]).name in args.runs)
    ]
    print(f"{len(recs)} probe records")
    print(table2(recs))
    if args.figures:
        for d in ERRORS:
            print(axis_figure(recs, d, Path(args.figures) / f"axis_heatmaps_{d}.png", title=args.experiment or ""))


if __name__ == "__main__":
    main()
