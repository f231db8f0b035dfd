"""One probe result as a run records it: flat `probe/...` metrics, per-layer and per-head tables, W&B tables and
heat-map figures. The tables over many runs' records (KIVI Table 2) are kvq_lab.report.error_geometry."""

from __future__ import annotations

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
    """One row per layer: its attention (`sliding <window>` or `global`), then each column's mean over heads."""
    cols = ["layer", "attention", *_columns(res)]
    L = next(iter(next(iter(res.tables.values())).values())).shape[0]
    rows = [
        [layer, res.attention_kind(layer)] + [_num(ds[d][layer].mean()) for ds in res.tables.values() for d in ds]
        for layer in range(L)
    ]
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
                higher = key in ERRORS and ERRORS[key].direction == "higher"
                cmap = "viridis_r" if higher else "viridis"  # bright = bad in every error panel
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
        if any(res.windows):  # a model with sliding-window layers: mark its global ones
            for layer in (i for i, w in enumerate(res.windows) if w is None):
                ax.axvline(layer, color="grey", ls=":", lw=1)
        ax.set_xlabel("layer (dotted: global attention)" if any(res.windows) else "layer")
        ax.set_title(d)
        ax.set_yscale("linear" if ERRORS[d].unit == "dB" else "log")
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
