"""Probe results as records, W&B tables and figures; and KIVI-Table-2-style tables over run records.

python -m kvq_lab.probes.report results [--experiment NAME]    # markdown table over probe runs
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .metrics import ERRORS
from .probe import ProbeResult
from .settings import ERROR_QUANTITIES, KV_QUANTITIES

PREFIX = "probe"


def flat_metrics(res: ProbeResult) -> dict[str, float]:
    """`probe/<quantity>/<definition>/mean` (mean over layers, heads and prompts), plus counts. Modest on purpose:
    the per-layer/head tables go into the record's artifacts."""
    out: dict[str, float] = {}
    for q, ds in res.tables.items():
        for d in ds:
            name = f"{PREFIX}/{q}/mean" if d == "value" else f"{PREFIX}/{q}/{d}/mean"
            out[name] = res.mean(q, d)
    out[f"{PREFIX}/n_prompts"] = res.n_prompts
    out[f"{PREFIX}/mean_tokens"] = sum(res.tokens) / max(len(res.tokens), 1)
    return out


def _columns(res: ProbeResult) -> list[str]:
    return [f"{q}/{d}" if d != "value" else q for q, ds in res.tables.items() for d in ds]


def head_table(res: ProbeResult) -> tuple[list[str], list[list]]:
    """One row per (layer, query head). Key/value columns hold the error of the KV head that head reads
    (kv_head = head // groups), so they repeat across a GQA group."""
    groups = res.num_heads // max(res.num_kv_heads, 1)
    cols = ["layer", "head", "kv_head", *_columns(res)]
    rows = []
    L = next(iter(next(iter(res.tables.values())).values())).shape[0]
    for layer in range(L):
        for h in range(res.num_heads):
            row = [layer, h, h // groups]
            for q, ds in res.tables.items():
                hh = h // groups if q in KV_QUANTITIES else h
                row += [_num(ds[d][layer, hh]) for d in ds]
            rows.append(row)
    return cols, rows


def layer_table(res: ProbeResult) -> tuple[list[str], list[list]]:
    """One row per layer: each column's mean over heads."""
    cols = ["layer", *_columns(res)]
    L = next(iter(next(iter(res.tables.values())).values())).shape[0]
    rows = [[layer] + [_num(ds[d][layer].mean()) for ds in res.tables.values() for d in ds] for layer in range(L)]
    return cols, rows


def _num(t) -> float:
    v = float(t)
    return round(v, 6) if math.isfinite(v) else v


def heatmaps(res: ProbeResult, out_dir: Path, title: str = "") -> dict[str, Path]:
    """One PNG per error definition: a (layer x head) heat-map per quantity. Returns {definition: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    kname = next(q for q in res.tables if q.startswith("top") and not q.endswith("_decode"))
    panels = [
        ["key", "value", "sparsity", kname, "sparsity_decode"],
        ["attn_score", "attn_out_k", "attn_out_v", "attn_out", None],
        ["attn_score_decode", "attn_out_k_decode", "attn_out_v_decode", "attn_out_decode", None],
    ]
    for d in ERRORS:
        fig, axes = plt.subplots(3, 5, figsize=(17, 13), squeeze=False)
        for r, row in enumerate(panels):
            for c, q in enumerate(row):
                ax = axes[r][c]
                if q is None or q not in res.tables:
                    ax.axis("off")
                    continue
                key = d if q in ERROR_QUANTITIES else "value"
                data = res.tables[q][key].numpy()
                finite = data[abs(data) != float("inf")]
                vmin, vmax = (finite.min(), finite.max()) if finite.size else (0, 1)
                cmap = "viridis_r" if key == "sqnr_db" else "viridis"  # bright = bad in every error panel
                im = ax.imshow(data, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
                label = f"{q} [{key}]" if key != "value" else f"{q} (exact A)"
                ax.set_title(f"{label}\nmean {data.mean():.3g}", fontsize=9)
                ax.set_xlabel("KV head" if q in KV_QUANTITIES else "head", fontsize=8)
                ax.set_ylabel("layer", fontsize=8)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                fig.colorbar(im, ax=ax, fraction=0.046)
        fig.suptitle(f"{title}  error: {d}  (rows: reconstruction & sparsity / full prefill / decode row)", fontsize=11)
        fig.tight_layout()
        p = out_dir / f"probe_heatmap_{d}.png"
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths[d] = p
    return paths


def layer_plot(res: ProbeResult, out_dir: Path, title: str = "") -> Path:
    """Per-layer means (over heads) of each error quantity, one panel per definition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ERRORS), figsize=(6 * len(ERRORS), 4.5), squeeze=False)
    for ax, d in zip(axes[0], ERRORS, strict=True):
        for q in ERROR_QUANTITIES:
            if q in res.tables and not q.endswith("_decode"):
                ax.plot(res.tables[q][d].mean(-1).numpy(), marker=".", label=q)
        ax.set_xlabel("layer")
        ax.set_title(d)
        ax.set_yscale("linear" if d == "sqnr_db" else "log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{title}  per-layer mean over heads (full prefill)")
    fig.tight_layout()
    p = out_dir / "probe_layers.png"
    fig.savefig(p, dpi=80)
    plt.close(fig)
    return p


def artifacts(res: ProbeResult, settings, out_dir: Path | None, title: str = "") -> dict:
    """What goes into ctx.artifacts: the full tables (record.json), W&B tables and images."""
    cols, rows = head_table(res)
    lcols, lrows = layer_table(res)
    art = {
        "probe_tables": {
            "settings": dict(settings.__dict__),
            "n_prompts": res.n_prompts,
            "tokens": res.tokens,
            "per_head": {"columns": cols, "rows": rows},
            "per_layer": {"columns": lcols, "rows": lrows},
        },
        "wandb_tables": {"probe/per_head": (cols, rows), "probe/per_layer": (lcols, lrows)},
    }
    if out_dir is not None and settings.figures:
        imgs = {f"probe/heatmap/{d}": str(p) for d, p in heatmaps(res, out_dir, title).items()}
        imgs["probe/layers"] = str(layer_plot(res, out_dir, title))
        art["wandb_images"] = imgs
        art["probe_figures"] = sorted(Path(p).name for p in imgs.values())
    return art


# --- KIVI Table 2 over run records ----------------------------------------------------------------------------

TABLE2 = [
    # (label, quantity, axis knob that decides it, KIVI per-token, KIVI per-channel)
    ("key reconstruction", "key", "key_axis", 13.67, 4.55),
    ("attention score (all rows)", "attn_score", "key_axis", 47.00, 9.60),
    ("attention score (decode row)", "attn_score_decode", "key_axis", 47.00, 9.60),
    ("value reconstruction", "value", "value_axis", 4.57, 3.73),
    ("attention output, only V quantized (all rows)", "attn_out_v", "value_axis", 3.55, 49.89),
    ("attention output, only V quantized (decode row)", "attn_out_v_decode", "value_axis", 3.55, 49.89),
]


def table2(records: list[dict], definitions=("kivi_ratio", "rel_fro", "sqnr_db")) -> str:
    """Markdown: per-token vs per-channel for keys and values, ours beside KIVI's Llama-2-13B numbers.

    Each of our cells is the mean over the records with that axis (the other axis does not change it; the spread
    across those records is shown when it is not zero)."""
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

    from kvq_lab.results import read_table

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
            lo = float(np.percentile(pos if definition != "sqnr_db" else both, 1)) if pos.size else 1e-6
            hi = float(np.percentile(both, 99))
            norm = Normalize(lo, hi) if definition == "sqnr_db" else LogNorm(max(lo, 1e-6), max(hi, 2e-6))
            for a_i, (a, m) in enumerate(mats.items()):
                ax = axes[2 * b + a_i][c]
                cmap = "viridis_r" if definition == "sqnr_db" else "viridis"
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
    from kvq_lab.results import load_records

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", nargs="?", default="results")
    ap.add_argument("--experiment", default=None, help="only records with this experiment_name")
    ap.add_argument("--runs", nargs="*", default=None, help="only these run folder names")
    ap.add_argument(
        "--figures", default=None, help="folder for per-token vs per-channel heat-maps (one per definition)"
    )
    args = ap.parse_args(argv)
    recs = [
        r
        for r in load_records(Path(args.results_dir), verified=True)
        if r.get("status") == "ok"
        and r["config"].get("task", {}).get("name") == "probe"
        and (args.experiment is None or r.get("experiment") == args.experiment)
        and (args.runs is None or Path(r["_path"]).name in args.runs)
    ]
    print(f"{len(recs)} probe records")
    print(table2(recs))
    if args.figures:
        for d in ERRORS:
            print(axis_figure(recs, d, Path(args.figures) / f"axis_heatmaps_{d}.png", title=args.experiment or ""))


if __name__ == "__main__":
    main()
