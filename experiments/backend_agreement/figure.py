"""Decode perplexity of the packed cache through each backend (SmolLM2-135M's records in runs/, read through
`kvq_lab.report.study.read`: each checked against its digest), as a bar chart.

python experiments/backend_agreement/figure.py      # writes experiments/backend_agreement/backends.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from kvq_lab.report.study import read  # noqa: E402

MODELS = ("smollm2-135m",)


def main() -> None:
    ppl = {}
    for r in read(HERE, MODELS):
        c = r["config"]
        ppl[(c["bits"], c["residual_length"], c["backend"])] = r["metrics"]["ppl/ppl"]
    settings = sorted({k[:2] for k in ppl})
    fig, ax = plt.subplots(figsize=(6, 3))
    for j, backend in enumerate(("torch", "cpu")):
        xs = [i + 0.4 * j for i in range(len(settings))]
        ax.bar(xs, [ppl[(b, r, backend)] for b, r in settings], width=0.4, label=f"backend={backend}")
    ax.set_xticks([i + 0.2 for i in range(len(settings))], [f"{b}-bit, R={r}" for b, r in settings])
    ax.set_ylabel("decode perplexity")
    ax.set_title("SmolLM2-135M, packed cache, K-C/V-T, G=32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / "backends.png", dpi=80)


if __name__ == "__main__":
    main()
