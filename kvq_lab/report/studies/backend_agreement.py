"""Decode perplexity of the packed cache through each backend, as a bar chart (backends.png; no table: the README
quotes the numbers). SmolLM2-135M's records, read through `kvq_lab.report.study.read`, each checked against its
digest."""

from __future__ import annotations

from pathlib import Path

from kvq_lab.common.spellings import current
from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import read

MODELS = ("smollm2-135m",)


def records(folder: Path) -> list[dict]:
    return read(folder, MODELS)


def ppl(recs: list[dict]) -> dict[tuple[int, int, str], float]:
    """(bits, residual length, backend) -> decode perplexity of the newest record."""
    out = {}
    for r in recs:
        c = current(r["config"])  # records written before exact_window was renamed say residual_length
        out[(c["bits"], c["exact_window"], c["backend"])] = r["metrics"]["ppl/ppl"]
    return out


def tables(recs: list[dict]) -> dict[str, str]:
    return {}


def figure(recs: list[dict], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = ppl(recs)
    settings = sorted({k[:2] for k in by})
    fig, ax = plt.subplots(figsize=(6, 3))
    for j, backend in enumerate(("torch", "cpu")):
        xs = [i + 0.4 * j for i in range(len(settings))]
        ax.bar(xs, [by[(b, r, backend)] for b, r in settings], width=0.4, label=f"backend={backend}")
    ax.set_xticks([i + 0.2 for i in range(len(settings))], [f"{b}-bit, R={r}" for b, r in settings])
    ax.set_ylabel("decode perplexity")
    ax.set_title("SmolLM2-135M, packed cache, K-C/V-T, G=32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(folder) / "backends.png", dpi=80)


def rows(recs: list[dict]):
    """One line per (bits, residual length, backend): its decode perplexity."""
    return frame({"bits": b, "exact_window": r, "backend": k, "ppl": v} for (b, r, k), v in ppl(recs).items())
