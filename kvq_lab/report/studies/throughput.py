"""Aggregate decode tok/s vs batch from bench_throughput's JSON runs -> throughput.png and table.md (python -m
kvq_lab.report throughput). One line per cache, its budget batch marked; the table pools nothing: one block per run
(records/*.json, read by `kvq_lab.report.study.bench_runs`), so the repeated runs' ratios stand side by side."""

from __future__ import annotations

from pathlib import Path

from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import bench_runs


def records(folder: Path) -> list[tuple[str, dict]]:
    return bench_runs(folder)


def tables(runs: list[tuple[str, dict]]) -> dict[str, str]:
    """{file name here: its text}: table.md."""
    lines = []
    for name, data in runs:
        budget = data["budget_bytes"] / 2**30
        lines.append(f"### {name}: budget {budget:.3g} GiB, code {data['code']}\n")
        lines.append(
            "| dtype | context | cache | MiB / seq | batch | x seqs | decode tok/s | x Dynamic | tok/s per seq | "
            "prefill tok/s | fits | same tokens |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in data["rows"]:
            lines.append(
                f"| {r['dtype']} | {r['length']} | {r['label']} | {r['bytes_per_seq'] / 2**20:.1f} | {r['batch']} | "
                f"{r['batch_ratio']:.1f}x | {r['decode_tok_s']:.1f} | **{r['ratio']:.2f}x** | "
                f"{r['per_seq_tok_s']:.2f} | {r['prefill_tok_s']:.0f} | {r['fits']} | {r['same_tokens']} |"
            )
        lines.append("")
    return {"table.md": "\n".join(lines)}


def figure(runs: list[tuple[str, dict]], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the figure: the run with the most measured points (--curve); the table shows every run
    data = max((d for _, d in runs), key=lambda d: sum(len(r["curve"]) for r in d["rows"]))
    panels = sorted({(r["dtype"], r["length"]) for r in data["rows"]}, key=lambda p: (p[0], p[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, (dtype, length) in zip(axes[0], panels, strict=True):
        for i, r in enumerate(x for x in data["rows"] if (x["dtype"], x["length"]) == (dtype, length)):
            b, tps = zip(*r["curve"], strict=True)
            (line,) = ax.plot(b, tps, marker=".", label=r["label"], color=f"C{i}")
            ax.plot(b[-1], tps[-1], marker="*", ms=14, color=line.get_color())  # the batch the budget holds
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences decoded together)")
        ax.set_ylabel("aggregate decode tokens/s")
        ax.set_title(f"{dtype}, {length}-token context; * = the {data['budget_bytes'] / 2**30:.3g} GiB budget")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(folder) / "throughput.png", dpi=110)


def rows(runs: list[tuple[str, dict]]):
    """One line per row of every run (its file name in `run`)."""
    return frame({"run": name, **r} for name, data in runs for r in data["rows"])
