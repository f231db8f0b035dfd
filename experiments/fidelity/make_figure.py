"""KL and top-1 agreement vs decode position for every row of this study -> fidelity_curves.png and table.md (run from
the repo root: python experiments/fidelity/make_figure.py)."""

from __future__ import annotations

from pathlib import Path

from kvq_lab.records.record import load_records

HERE = Path(__file__).parent
KEYS = ("kl_mean", "kl_p99", "top1_agree", "kl_first", "kl_last", "top1_first", "top1_last", "ppl", "ref_ppl")


def main() -> None:
    rows: dict[str, dict] = {}
    for r in load_records(HERE):  # oldest first: the newest record of a cache wins
        if r.get("status") == "ok" and r["config"].get("experiment_name") == "fidelity":  # not the long-context runs
            rows[r["cache"]] = r
    lines = ["| cache | " + " | ".join(KEYS) + " |", "|---|" + "---|" * len(KEYS)]
    for label, r in rows.items():
        m = r["metrics"]
        lines.append(f"| `{label}` | " + " | ".join(f"{m[f'fidelity/{k}']:.4g}" for k in KEYS) + " |")
    table = "\n".join(lines) + "\n"
    (HERE / "table.md").write_text(table)
    print(table)

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


if __name__ == "__main__":
    main()
