"""The fidelity study: KL and top-1 agreement against the 16-bit model, two parts in one folder.

- SmolLM2-135M's runs of experiment `fidelity`: KL and top-1 agreement vs decode position for every row ->
  table.md and fidelity_curves.png; the newest completed record of a cache wins.
- Gemma-3-270M's runs of experiment `fidelity_long_context` (conf/experiment/fidelity_long_context.yaml): KL and
  top-1 agreement vs context length -> long_context_table.md and kl_vs_context.png. A window is context_tokens
  prefilled + eval_tokens scored; the newest completed record of a (cache, window) wins.

Records read through `kvq_lab.report.study.read`, each checked against its digest.
"""

from __future__ import annotations

from pathlib import Path

from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import newest, read

MODELS = ("smollm2-135m", "gemma3-270m")  # the curves' model, the long-context part's
KEYS = ("kl_mean", "kl_p99", "top1_agree", "kl_first", "kl_last", "top1_first", "top1_last", "ppl", "ref_ppl")


def records(folder: Path) -> dict[str, list[dict]]:
    """{"curves": SmolLM2's `fidelity` runs, "long": Gemma's `fidelity_long_context` runs}."""
    return {
        "curves": read(folder, MODELS[:1], where={"config.experiment_name": "fidelity"}),
        "long": read(folder, MODELS[1:], where={"config.experiment_name": "fidelity_long_context"}),
    }


def by_cache(recs: list[dict]) -> dict[str, dict]:
    """cache label -> its newest completed record."""
    return newest(recs, lambda r: r["cache"])


def by_window(recs: list[dict]) -> dict[tuple[str, int], dict]:
    """(cache label, window tokens) -> the newest completed record."""
    return newest(
        recs,
        lambda r: (r["cache"], int(r["config"]["task"]["context_tokens"]) + int(r["config"]["task"]["eval_tokens"])),
    )


def curves_table(recs: list[dict]) -> str:
    lines = ["| cache | " + " | ".join(KEYS) + " |", "|---|" + "---|" * len(KEYS)]
    for label, r in by_cache(recs).items():
        m = r["metrics"]
        lines.append(f"| `{label}` | " + " | ".join(f"{m[f'fidelity/{k}']:.4g}" for k in KEYS) + " |")
    return "\n".join(lines) + "\n"


def long_table(recs: list[dict]) -> str:
    rows = by_window(recs)
    caches = list(dict.fromkeys(c for c, _ in rows))
    lengths = sorted({n for _, n in rows})
    head = "| cache | " + " | ".join(f"{n} tok: KL / top-1 / ppl ratio" for n in lengths) + " |"
    lines = [head, "|---|" + "---|" * len(lengths)]
    for c in caches:
        cells = []
        for n in lengths:
            m = rows[(c, n)]["metrics"] if (c, n) in rows else None
            cells.append(
                "-"
                if m is None
                else f"{m['fidelity/kl_mean']:.4f} ± {m['fidelity/kl_mean_unc']:.4f} / "
                f"{100 * m['fidelity/top1_agree']:.1f}% / {m['fidelity/ppl_ratio']:.3f}"
            )
        lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
    any_rec = next(iter(rows.values()))
    t = any_rec["config"]["task"]
    return "\n".join(lines) + (
        f"\n\n{any_rec['config']['model']['name']}; one window per length of task.source={t['source']} "
        f"({t['split']}): context_tokens prefilled exactly, {t['eval_tokens']} scored; KL(16-bit || cache) mean "
        "over the scored tokens ± its standard error; top-1: the cache's argmax equals the 16-bit model's; ppl "
        "ratio: the cache's perplexity over the 16-bit one on the same tokens\n"
    )


def tables(recs: dict[str, list[dict]]) -> dict[str, str]:
    return {"table.md": curves_table(recs["curves"]), "long_context_table.md": long_table(recs["long"])}


def figure(recs: dict[str, list[dict]], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, r in by_cache(recs["curves"]).items():
        c = r["artifacts"]["fidelity_curve"]
        a.plot(c["position"], c["kl_mean"], marker=".", label=label)
        b.plot(c["position"], c["top1_agree"], marker=".", label=label)
    a.set(xlabel="decode position (tokens after the prefill)", ylabel="KL(16-bit || cache), nats", yscale="symlog")
    a.set_yscale("symlog", linthresh=1e-3)
    b.set(xlabel="decode position (tokens after the prefill)", ylabel="top-1 agreement with 16-bit", ylim=(0, 1.02))
    b.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(Path(folder) / "fidelity_curves.png", dpi=110)
    plt.close(fig)

    rows = by_window(recs["long"])
    caches = list(dict.fromkeys(c for c, _ in rows))
    lengths = sorted({n for _, n in rows})
    any_rec = next(iter(rows.values()))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for c in caches:
        xs = [n for n in lengths if (c, n) in rows]
        ms = [rows[(c, n)]["metrics"] for n in xs]
        ax.errorbar(xs, [m["fidelity/kl_mean"] for m in ms], yerr=[m["fidelity/kl_mean_unc"] for m in ms],
                    marker="o", capsize=3, label=c)  # fmt: skip
        bx.plot(xs, [100 * m["fidelity/top1_agree"] for m in ms], marker="o", label=c)
    for a, label in ((ax, "KL(16-bit || cache), mean"), (bx, "top-1 agreement with 16-bit (%)")):
        a.set(xscale="log", xlabel="window tokens (context + 256 scored)", ylabel=label)
        a.set_xticks(lengths, [str(n) for n in lengths])
        a.minorticks_off()
        a.grid(alpha=0.3)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.suptitle(f"{any_rec['config']['model']['name']}: fidelity vs context length (packed, R=128, G=32)")
    fig.tight_layout()
    fig.savefig(Path(folder) / "kl_vs_context.png", dpi=110)


def rows(recs: dict[str, list[dict]]):
    """One line per table row: `part` curves (SmolLM2, one per cache) or long (Gemma, one per cache and window)."""
    curves = [{"part": "curves", "cache": c, **r["metrics"]} for c, r in by_cache(recs["curves"]).items()]
    long = [{"part": "long", "cache": c, "window": n, **r["metrics"]} for (c, n), r in by_window(recs["long"]).items()]
    return frame(curves + long)
