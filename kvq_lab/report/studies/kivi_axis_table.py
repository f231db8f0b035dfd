"""The KIVI axis table (SmolLM2-135M and Gemma-3-270M, six cache rows: 16-bit, 4-bit K-T/V-T and the four 2-bit
axis pairs on CoQA), and its paired differences with the noise floor beside each.

Writes table.md and kivi_axis_table.png (SmolLM2's rows beside KIVI's Table 1, `kvq_lab.report.studies.paper`),
gemma3-270m/table.md and its PNG (Gemma's rows: the folder holds both models' runs of the same labels, never mixed),
and paired.md: all 297 CoQA turns on SmolLM2, F1 paired turn by turn. Beside each difference: what a rerun of the
baseline row (2-bit K-C/V-T) that changes only float rounding does to it, `noise=permute:1`
(`kvq_lab/models/noise.py`) against the same row rerun unperturbed on the same commit, libraries, host and thread
count (both under `noise/`), and whether the difference lies beyond every floor of that row
(`kvq_lab.report.noise.beyond`: further from zero than each rounding-only difference plus two of its standard
errors, and than two of its own). paired.md's second table gives every row's floor under each rounding-only rerun
the study holds: the permutation (`noise/`), the committed row against its unperturbed rerun here (another host and
transformers build), prefix reuse (`prefix_reuse/`) and continuous batching with reuse (`continuous/`). Records
through `kvq_lab.report.study.read` (each checked against its digest).
"""

from __future__ import annotations

from pathlib import Path

from kvq_lab.report.noise import beyond, noise_floor
from kvq_lab.report.rows import paired_difference
from kvq_lab.report.studies.paper import study_rows, table
from kvq_lab.report.study import per_doc, read, samples
from kvq_lab.report.tables import bar_chart, to_frame

MODELS = ("smollm2-135m", "gemma3-270m")
TABLES = {"smollm2-135m": ".", "gemma3-270m": "gemma3-270m"}  # model -> the subfolder its table and PNG go to

MODEL = "smollm2-135m"
BASELINE = "K2b-C32_V2b-T32_sim"
ROWS = {"K16b_V16b_sim": "16bit", "K4b-T32_V4b-T32_sim": "4bit (K-T, V-T)", BASELINE: "2bit (K-C, V-T)",
        "K2b-T32_V2b-T32_sim": "2bit (K-T, V-T)", "K2b-C32_V2b-C32_sim": "2bit (K-C, V-C)",
        "K2b-T32_V2b-C32_sim": "2bit (K-T, V-C)"}  # fmt: skip
PAIRS = [("K16b_V16b_sim", k) for k in list(ROWS)[1:]] + [(BASELINE, "K2b-C32_V2b-C32_sim")]
RERUNS = {"prefix_reuse": "prefix reuse", "continuous": "batch 8 + reuse"}  # folders of rounding-only reruns


def fullest(recs: list[dict]) -> dict[str, dict]:
    """cache label -> the completed coqa_turns record over the most turns (the newest among equals)."""
    best: dict[str, dict] = {}
    for r in recs:  # oldest first
        n = r["metrics"].get("coqa_turns/n", 0)
        held = best.get(r["cache"], {}).get("metrics", {}).get("coqa_turns/n", 0)
        if r["config"]["task"]["name"] == "coqa_turns" and n >= held:
            best[r["cache"]] = r
    return best


def paired_records(folder: Path) -> dict[str, list[dict]]:
    """folder (`.` = the table's own runs) -> its SmolLM2 records."""
    return {f: read(folder / f, (MODEL,)) for f in (".", "noise", *RERUNS) if (folder / f / "runs").is_dir()}


def permuted(noise: list[dict]) -> tuple[dict | None, dict | None]:
    """(the baseline rerun unperturbed, the same rerun with noise=permute:1) from the noise/ folder's records."""
    runs = [r for r in noise if r["cache"] == BASELINE and r["config"].get("limit") is None]
    plain = [r for r in runs if r["config"].get("noise", "none") == "none"]
    perm = [r for r in runs if r["config"].get("noise") == "permute:1"]
    return (plain[-1] if plain else None), (perm[-1] if perm else None)


def baseline_floors(recs: dict[str, list[dict]]) -> list:
    """Every rounding-only floor of the baseline row: permute:1 against its unperturbed rerun, the committed row
    against that rerun, and the committed row against each rerun folder's (the second table's baseline line)."""
    table = fullest(recs["."])
    plain, perm = permuted(recs.get("noise", []))
    out = [noise_floor(plain, perm), noise_floor(table[BASELINE], plain)] if plain and perm else []
    for f in RERUNS:
        r = fullest(recs.get(f, [])).get(BASELINE)
        if r is not None:
            out.append(noise_floor(table[BASELINE], r))
    return out


def paired(recs: dict[str, list[dict]]) -> str:
    table = fullest(recs["."])
    plain, perm = permuted(recs.get("noise", []))
    floor = noise_floor(plain, perm) if plain is not None and perm is not None else None
    shown, floors = (floor.cell() if floor else "-"), baseline_floors(recs)
    head = "| B - A | paired F1 | turns differ | noise floor (2-bit K-C/V-T, permute:1 alone) | beyond every floor |"
    lines = [head, "|---|---|---|---|---|"]
    for a, b in PAIRS:
        ra, rb = table[a], table[b]
        d, se, n = paired_difference(per_doc(ra, "f1", 100), per_doc(rb, "f1", 100))
        sa, sb = ({s["doc_id"]: s["response"] for s in samples(r)} for r in (ra, rb))
        differ = sum(sa[i] != sb[i] for i in sa.keys() & sb.keys())
        verdict = "-" if floor is None else ("yes" if beyond(d, se, floors) else "no")
        lines.append(f"| {ROWS[b]} - {ROWS[a]} | {d:+.2f} ± {se:.2f} | {differ}/{n} | {shown} | {verdict} |")
    return "\n".join(lines)


def floors(recs: dict[str, list[dict]]) -> str:
    table = fullest(recs["."])
    plain, perm = permuted(recs.get("noise", []))
    cols = ["permute:1 vs unperturbed (this host)", "committed vs rerun here"] + list(RERUNS.values())
    lines = ["| cache | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    reruns = {f: fullest(recs[f]) for f in RERUNS if f in recs}
    for label, name in ROWS.items():
        cells = []
        here = plain if label == BASELINE else None
        cells.append(noise_floor(plain, perm).cell() if here is not None and perm is not None else "-")
        cells.append(noise_floor(table[label], here).cell() if here is not None else "-")
        for f in RERUNS:
            r = reruns.get(f, {}).get(label)
            cells.append(noise_floor(table[label], r).cell() if r is not None else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_md(recs: dict[str, list[dict]]) -> str:
    return (
        "### Paired F1 differences against the noise floor (SmolLM2-135M, 297 CoQA turns)\n\n"
        + paired(recs)
        + "\n\n### Noise floors: rounding-only reruns of each row (rerun - row, paired F1, answers changed)\n\n"
        + floors(recs)
        + "\n"
    )


def records(folder: Path) -> dict:
    """{"rows": model -> (experiment, its table's rows), "paired": folder -> SmolLM2's records}."""
    return {"rows": {m: study_rows(folder, m) for m in TABLES}, "paired": paired_records(folder)}


def tables(recs: dict) -> dict[str, str]:
    out = {str(Path(TABLES[m]) / "table.md"): table(*rows) for m, rows in recs["rows"].items()}
    return {**out, "paired.md": paired_md(recs["paired"])}


def figure(recs: dict, folder: Path) -> None:
    for m, (experiment, rows) in recs["rows"].items():
        bar_chart(rows, Path(folder) / TABLES[m] / f"{experiment}.png", title=experiment)


def rows(recs: dict):
    """Both models' table rows (`to_frame`), with a `model` column."""
    import pandas as pd

    return pd.concat([to_frame(r).assign(model=m) for m, (_, r) in recs["rows"].items()], ignore_index=True)
