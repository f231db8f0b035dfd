"""KL and top-1 agreement vs decode position for every row of this study -> fidelity_curves.png and table.md (run from
the repo root: python experiments/fidelity/make_figure.py). Records: SmolLM2-135M's runs of experiment `fidelity` (the
folder also holds Gemma's long-context runs, make_long_table.py), read through `kvq_lab.report.study.read` (each
checked against its digest); the newest completed record of a cache wins."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # kvq_lab of this checkout

from kvq_lab.report.study import newest, read  # noqa: E402

MODELS = ("smollm2-135m",)
KEYS = ("kl_mean", "kl_p99", "top1_agree", "kl_first", "kl_last", "top1_first", "top1_last", "ppl", "ref_ppl")


def records() -> list[dict]:
    return read(HERE, MODELS, where={"config.experiment_name": "fidelity"})  # not the long-context runs


def rows(recs: list[dict]) -> dict[str, dict]:
    """cache label -> its newest completed record."""
    return newest(recs, lambda r: r["cache"])


def tables(recs: list[dict]) -> dict[str, str]:
    lines = ["| cache | " + " | ".join(KEYS) + " |", "|---|" + "---|" * len(KEYS)]
    for label, r in rows(recs).items():
        m = r["metrics"]
        lines.append(f"| `{label}` | " + " | ".join(f"{m[f'fidelity/{k}']:.4g}" for k in KEYS) + " |")
    return {"table.md": "\n".join(lines) + "\n"}


def figure(rows: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, r in rows.items():
        c = r["artifacts"]["fidelity_curve"]
        a.plot(c["position"], c["kl_mean"], marker=".", label=label)
        b.plot(c["position"], c["top1_agree"], marker=".", label=label)
    a.set(xlabel="decode position (tokens after the prefill)", ylabel="KL(16-bit || cache), nats", yscale="symlog")
    a.set_yscale("symlog", linthresh=1e-3)
    b.set(xlabel="decode position (tokens after the prefill)", ylabel="top-1 agreement with 16-bit", ylim=(0, 1.02))
    b.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(HERE / "fidelity_curves.png", dpi=110)


def main() -> None:
    recs = records()
    for name, text in tables(recs).items():
        (HERE / name).write_text(text)
        print(text)
    figure(rows(recs))


if __name__ == "__main__":
    main()
