"""Tables and figure of the policies study from its records (python -m kvq_lab.report policies) -> table.md,
the README's Result section and policies.png.

Three tables: the policies at equal stored bytes (SmolLM2: CoQA-turns, fidelity, retrieval), the prompt's prefill
exact vs quantized for KIVI's six axis rows (CoQA-turns, all turns; the quantized rows are the KIVI table's records,
experiments/kivi_axis_table, whose prefill is simulated mode's own), and Gemma-3's sliding-window layers skipped or not.
Records: SmolLM2-135M's and Gemma-3-270M's, read through `kvq_lab.report.study.read` (each checked against its
digest); per (model, task, cache) the newest completed record wins. The README's Result section holds the same text
between its markers.

Beside each paired F1 difference, the noise floor (`kvq_lab.report.noise`): what rerunning the comparison's baseline
row with `noise=permute:1` (the same model with its residual stream permuted: other float rounding, same mathematics)
does against the same row rerun unperturbed on the same commit and host (both under `noise/`; the KIVI rows of each
budget here, the 2-bit K-C/V-T row of the KIVI axis table for the prefill table), and whether the difference lies
beyond it and beyond the committed row against its unperturbed rerun (`kvq_lab.report.noise.beyond`: further from
zero than each rounding-only difference plus two of its standard errors, and than two of its own).
"""

from __future__ import annotations

import math
from pathlib import Path

from kvq_lab.report.noise import beyond, noise_floor
from kvq_lab.report.rows import mean_se, paired_difference
from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import newest as newest_of
from kvq_lab.report.study import per_doc, read, samples

AXIS_TABLE = "kivi_axis_table"  # the sibling study whose records give the prefill table its quantized rows
MODELS = ("smollm2-135m", "gemma3-270m")
POLICIES = ("kivi", "saliency", "mikv", "evict")
MARKERS = ("<!-- tables: python -m kvq_lab.report policies -->", "<!-- /tables -->")


def budget(rec: dict) -> str:
    bits = rec["metrics"]["cache/bits_total"]
    return "16" if bits > 15 else min(("2.5", "3.0"), key=lambda b: abs(float(b) - bits))


def task_key(rec: dict) -> str | None:
    t = rec["config"]["task"]
    if t["name"] == "coqa_turns":
        return "coqa" if rec["config"].get("limit") == 100 else "coqa_all"
    if t["name"] == "fidelity":
        return "fidelity"
    if t["name"] == "retrieval":
        return f"{t['kind']}_{t['context_tokens']}"
    return None


def newest(recs: list[dict]) -> dict[tuple, dict]:
    """(model, task key, cache label) -> the newest completed record (records come oldest first)."""
    return newest_of(recs, lambda r: None if task_key(r) is None else (r["config"]["model"]["name"], task_key(r),
                                                                        r["cache"]))  # fmt: skip


def wilson(hits: int, n: int, z: float = 1.96) -> str:
    """hits/n with its 95% Wilson score interval, in %."""
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return f"{hits}/{n} [{100 * max(0, centre - half):.0f}, {100 * min(1, centre + half):.0f}]"


def retrieval_cell(r: dict | None) -> str:
    if r is None:
        return "-"
    n = int(r["metrics"]["retrieval/n"])
    return wilson(round(r["metrics"]["retrieval/acc"] * n / 100), n)


def floors_of(noise: list[dict], row: dict) -> list:
    """The noise floors of a row (its record) from a noise/ folder's records: its noise=permute:1 rerun against its
    unperturbed rerun (the newest of each, with the row's cache and limit), then the row against that unperturbed
    rerun (another commit, maybe another host); [] until both reruns exist."""
    runs = [r for r in noise if r["cache"] == row["cache"] and r["config"].get("limit") == row["config"].get("limit")]
    plain = [r for r in runs if r["config"].get("noise", "none") == "none"]
    perm = [r for r in runs if r["config"].get("noise") == "permute:1"]
    return [noise_floor(plain[-1], perm[-1]), noise_floor(row, plain[-1])] if plain and perm else []


def floor_cells(floors: list, d: float, ds: float) -> list[str]:
    """[the permutation's floor, whether the paired difference d ± ds (F1 points) lies beyond every floor]."""
    if not floors:
        return ["-", "-"]
    return [floors[0].cell(), "yes" if beyond(d, ds, floors) else "no"]


def equal_bytes(runs: dict, noise: list[dict] = ()) -> tuple[str, dict]:
    model = "smollm2-135m"
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for (m, task, _label), r in runs.items():
        if m != model or task == "coqa_all":
            continue
        policy = "fp16" if budget(r) == "16" else r["cache_config"]["policy"]
        rows.setdefault((budget(r), policy), {})[task] = r
    retrieval = sorted({t for cells in rows.values() for t in cells if t.startswith(("needle", "variable"))})
    head = ["budget", "policy", "cache", "bits/elem", "CoQA-turns EM", "CoQA-turns F1", "F1 - KIVI (paired)",
            "noise floor: KIVI row, permute:1 alone", "beyond", "KL mean", "top-1 agree", *retrieval]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = [("16", "fp16")] + [(b, p) for b in ("3.0", "2.5") for p in POLICIES]
    for b, p in order:
        cells = rows.get((b, p))
        if not cells:
            continue
        any_rec = next(iter(cells.values()))
        coqa, fid = cells.get("coqa"), cells.get("fidelity")
        em = f1 = diff = kl = top1 = "-"
        beside = ["-", "-"]
        if coqa is not None:
            e, es = mean_se(list(per_doc(coqa, "em").values()))
            f, fs = mean_se(list(per_doc(coqa, "f1").values()))
            em, f1 = f"{100 * e:.1f} ± {100 * es:.1f}", f"{100 * f:.1f} ± {100 * fs:.1f}"
            kivi = rows.get((b, "kivi"), {}).get("coqa")
            if kivi is not None and p not in ("kivi", "fp16"):
                d, ds, _ = paired_difference(per_doc(kivi, "f1"), per_doc(coqa, "f1"))
                diff = f"{100 * d:+.1f} ± {100 * ds:.1f}"
                beside = floor_cells(floors_of(noise, kivi), 100 * d, 100 * ds)
        if fid is not None:
            fm = fid["metrics"]
            kl = f"{fm['fidelity/kl_mean']:.3f} ± {fm['fidelity/kl_mean_unc']:.3f}"
            top1 = f"{100 * fm['fidelity/top1_agree']:.0f}%"
        bits = f"{any_rec['metrics']['cache/bits_total']:.2f}"
        label = f"`{any_rec['cache']}`"
        rets = [retrieval_cell(cells.get(t)) for t in retrieval]
        lines.append("| " + " | ".join([b, p, label, bits, em, f1, diff, *beside, kl, top1, *rets]) + " |")
    return "\n".join(lines), rows


AXES = [("K4b-T32_V4b-T32", "4bit (K-T, V-T)"), ("K2b-C32_V2b-T32", "2bit (K-C, V-T)"),
        ("K2b-T32_V2b-T32", "2bit (K-T, V-T)"), ("K2b-C32_V2b-C32", "2bit (K-C, V-C)"),
        ("K2b-T32_V2b-C32", "2bit (K-T, V-C)")]  # fmt: skip


def prefill_table(runs: dict, axis_runs: dict, axis_noise: list[dict] = ()) -> str:
    lines = [
        "| setting | prefill quantized: EM | F1 | prefill exact: EM | F1 | F1 exact - quantized (paired) "
        "| noise floor: 2-bit K-C/V-T quantized, permute:1 alone | beyond |",
        "|---|---|---|---|---|---|---|---|",
    ]
    baseline = axis_runs.get(("smollm2-135m", "coqa_all", "K2b-C32_V2b-T32_sim"))
    floors = floors_of(axis_noise, baseline) if baseline is not None else []
    for key, name in AXES:
        quant = axis_runs.get(("smollm2-135m", "coqa_all", f"{key}_sim"))
        exact = runs.get(("smollm2-135m", "coqa_all", f"{key}_sim_Pexact"))
        cells = []
        for r in (quant, exact):
            if r is None:
                cells += ["-", "-"]
                continue
            for metric in ("em", "f1"):
                m, se = mean_se(list(per_doc(r, metric).values()))
                cells.append(f"{100 * m:.2f} ± {100 * se:.1f}")
        diff, beside = "-", ["-", "-"]
        if quant is not None and exact is not None:
            d, ds, n = paired_difference(per_doc(quant, "f1"), per_doc(exact, "f1"))
            diff = f"{100 * d:+.2f} ± {100 * ds:.1f} (n={n})"
            beside = floor_cells(floors, 100 * d, 100 * ds)
        lines.append(f"| {name} | " + " | ".join([*cells, diff, *beside]) + " |")
    return "\n".join(lines)


def same_outputs(runs: dict, axis_runs: dict) -> str:
    """The 2-bit K-C/V-T row rerun with prefill=quantized set explicitly, against the KIVI table's record."""
    again = runs.get(("smollm2-135m", "coqa_all", "K2b-C32_V2b-T32_sim_Pquant"))
    old = axis_runs.get(("smollm2-135m", "coqa_all", "K2b-C32_V2b-T32_sim"))
    if again is None or old is None:
        return "(the rerun of the 2-bit K-C/V-T row with prefill=quantized is not among the records)"
    a, b = (samples(r) for r in (again, old))
    differ = sum(x["response"] != y["response"] for x, y in zip(a, b, strict=True))
    return (
        f"The 2-bit K-C/V-T row rerun with `prefill=quantized` set (commit {again['env']['git'][:7]}, prefix reuse on) "
        f"against the KIVI table's record (commit {old['env']['git'][:7]}, before prefix reuse existed): {differ} of "
        f"{len(a)} responses differ, EM {again['metrics']['coqa_turns/em']:.2f} against "
        f"{old['metrics']['coqa_turns/em']:.2f}; the cause is prefix reuse, not the knob (README, Checks)."
    )


def gemma_table(runs: dict) -> str:
    lines = ["| cache | bits/elem | KL mean | top-1 agree | needle 8192 |", "|---|---|---|---|---|"]
    labels = sorted({label for (m, _t, label) in runs if m == "gemma3-270m"})
    for label in labels:
        fid = runs.get(("gemma3-270m", "fidelity", label))
        ndl = runs.get(("gemma3-270m", "needle_8192", label))
        any_rec = fid or ndl
        kl = top1 = "-"
        if fid is not None:
            fm = fid["metrics"]
            kl = f"{fm['fidelity/kl_mean']:.3f} ± {fm['fidelity/kl_mean_unc']:.3f}"
            top1 = f"{100 * fm['fidelity/top1_agree']:.0f}%"
        bits = f"{any_rec['metrics']['cache/bits_total']:.2f}"
        lines.append(f"| `{label}` | {bits} | {kl} | {top1} | {retrieval_cell(ndl)} |")
    return "\n".join(lines)


def figure(recs: dict, folder: Path) -> None:
    rows = equal_bytes(newest(recs["runs"]))[1]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    panels = (("coqa", "CoQA-turns F1 (%)"), ("fidelity", "fidelity KL (nats)"))
    for ax, (metric, title) in zip(axes, panels, strict=True):
        for i, b in enumerate(("3.0", "2.5")):
            xs, ys, es = [], [], []
            for j, p in enumerate(POLICIES):
                r = rows.get((b, p), {}).get(metric)
                if r is None:
                    continue
                if metric == "coqa":
                    m, se = mean_se(list(per_doc(r, "f1").values()))
                    y, e = 100 * m, 100 * se
                else:
                    y, e = r["metrics"]["fidelity/kl_mean"], r["metrics"]["fidelity/kl_mean_unc"]
                xs.append(j + (i - 0.5) * 0.35)
                ys.append(y)
                es.append(e)
            ax.bar(xs, ys, width=0.35, yerr=es, label=f"{b} bits/elem", capsize=3)
        if metric == "coqa" and ("16", "fp16") in rows and "coqa" in rows[("16", "fp16")]:
            m, _ = mean_se(list(per_doc(rows[("16", "fp16")]["coqa"], "f1").values()))
            ax.axhline(100 * m, color="k", ls="--", lw=1, label="16-bit")
        ax.set_xticks(range(len(POLICIES)), POLICIES)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M: policies at equal stored bytes", fontsize=10)
    fig.tight_layout()
    fig.savefig(Path(folder) / "policies.png", dpi=110)


def records(folder: Path) -> dict:
    """This study's records (`runs`), the KIVI axis table's beside it (`axis`), the noise/ reruns of each, SmolLM2's
    (`noise`, `axis_noise`: [] until made), and the README whose Result section holds the tables (`readme`)."""
    folder = Path(folder)
    axis = folder.parent / AXIS_TABLE
    noise = [read(f / "noise", MODELS[:1]) if (f / "noise" / "runs").is_dir() else [] for f in (folder, axis)]
    recs = {"runs": read(folder, MODELS), "axis": read(axis, MODELS), "noise": noise[0], "axis_noise": noise[1]}
    return {**recs, "readme": (folder / "README.md").read_text()}


def text(recs: dict) -> str:
    runs, axis_runs = newest(recs["runs"]), newest(recs["axis"])
    noise, axis_noise = recs["noise"], recs["axis_noise"]
    eq, _ = equal_bytes(runs, noise)
    return "\n\n".join(
        [
            "### Policies at equal stored bytes (SmolLM2-135M)\n\n" + eq,
            "### Prefill exact vs quantized, KIVI's axis rows (SmolLM2-135M, CoQA-turns, all turns)\n\n"
            + prefill_table(runs, axis_runs, axis_noise)
            + "\n\n"
            + same_outputs(runs, axis_runs),
            "### Gemma-3-270M: sliding-window layers skipped or not\n\n" + gemma_table(runs),
        ]
    )


def tables(recs: dict) -> dict[str, str]:
    """{file name here: its text}: table.md, and the README with the same tables between its markers."""
    body, tables = recs["readme"], text(recs)
    a, b = body.index(MARKERS[0]), body.index(MARKERS[1])
    return {"table.md": tables + "\n", "README.md": body[: a + len(MARKERS[0])] + "\n" + tables + "\n" + body[b:]}


def rows(recs: dict):
    """One line per (model, task, cache): the newest record's metrics (the tables' inputs)."""
    return frame({"model": m, "task": t, "cache": c, **r["metrics"]} for (m, t, c), r in newest(recs["runs"]).items())
