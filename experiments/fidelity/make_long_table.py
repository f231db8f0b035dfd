"""KL and top-1 agreement vs context length on Gemma-3-270M (conf/experiment/fidelity_long_context.yaml) from this
study's records -> long_context_table.md and kl_vs_context.png (run from the repo root:
python experiments/fidelity/make_long_table.py). A window is context_tokens prefilled + eval_tokens scored. Records:
Gemma-3-270M's runs of experiment `fidelity_long_context`, read through `kvq_lab.report.study.read` (each checked
against its digest); the newest completed record of a (cache, window) wins."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # kvq_lab of this checkout

from kvq_lab.report.study import newest as newest_of  # noqa: E402
from kvq_lab.report.study import read  # noqa: E402

MODELS = ("gemma3-270m",)
EXPERIMENT = "fidelity_long_context"


def records() -> list[dict]:
    return read(HERE, MODELS, where={"config.experiment_name": EXPERIMENT})


def by_window(recs: list[dict]) -> dict[tuple[str, int], dict]:
    """(cache label, window tokens) -> the newest completed record."""
    return newest_of(
        recs,
        lambda r: (r["cache"], int(r["config"]["task"]["context_tokens"]) + int(r["config"]["task"]["eval_tokens"])),
    )


def tables(recs: list[dict]) -> dict[str, str]:
    newest = by_window(recs)
    caches = list(dict.fromkeys(c for c, _ in newest))
    lengths = sorted({n for _, n in newest})
    head = "| cache | " + " | ".join(f"{n} tok: KL / top-1 / ppl ratio" for n in lengths) + " |"
    lines = [head, "|---|" + "---|" * len(lengths)]
    for c in caches:
        cells = []
        for n in lengths:
            m = newest[(c, n)]["metrics"] if (c, n) in newest else None
            cells.append(
                "-"
                if m is None
                else f"{m['fidelity/kl_mean']:.4f} ± {m['fidelity/kl_mean_unc']:.4f} / "
                f"{100 * m['fidelity/top1_agree']:.1f}% / {m['fidelity/ppl_ratio']:.3f}"
            )
        lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
    any_rec = next(iter(newest.values()))
    t = any_rec["config"]["task"]
    table = "\n".join(lines) + (
        f"\n\n{any_rec['config']['model']['name']}; one window per length of task.source={t['source']} "
        f"({t['split']}): context_tokens prefilled exactly, {t['eval_tokens']} scored; KL(16-bit || cache) mean "
        "over the scored tokens ± its standard error; top-1: the cache's argmax equals the 16-bit model's; ppl "
        "ratio: the cache's perplexity over the 16-bit one on the same tokens\n"
    )
    return {"long_context_table.md": table}


def main() -> None:
    recs = records()
    for name, text in tables(recs).items():
        (HERE / name).write_text(text)
        print(text)
    figure(by_window(recs))


def figure(newest: dict[tuple[str, int], dict]) -> None:
    caches = list(dict.fromkeys(c for c, _ in newest))
    lengths = sorted({n for _, n in newest})
    any_rec = next(iter(newest.values()))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for c in caches:
        xs = [n for n in lengths if (c, n) in newest]
        ms = [newest[(c, n)]["metrics"] for n in xs]
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
    fig.savefig(HERE / "kl_vs_context.png", dpi=110)


if __name__ == "__main__":
    main()
