"""The cache speed study's tables and figure, from the benchmark's records (records/*.json, one per setting and length).

    python -m kvq_lab.report cache_speed      # prints the README's tables; writes ratio_vs_length.png here

Decode speed is a ratio to DynamicCache in the same setting (dtype, batch) and prompt length, by the two estimators the
records hold: `ratio` (the cache's median step against DynamicCache's) and `paired_ratio` (the median over rounds of
the two caches' step-time ratio in one round, which cancels the machine's drift). Peak cache in MiB (2^20 bytes).
The records are the benchmark's JSON runs (`kvq_lab.report.study.bench_runs`); the tables are the README's.
"""

from __future__ import annotations

from pathlib import Path

from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import bench_runs

MODELS = None  # benchmark records (bench_runs): SmolLM2-135M's, as the figure's title says
LENGTHS = (512, 4096, 8192)
BARS = {512: 1.0, 4096: 1.2, 8192: 1.35}  # the decode-speed bars against DynamicCache
PRE_BAR = 0.95  # rope=pre within 5% of rope=post
SETTINGS = {("float32", 1): "fp32 b1", ("bfloat16", 1): "bf16 b1", ("float32", 4): "fp32 padded b4"}


def cache_name(row: dict) -> str:
    if row["kind"] == "dynamic":
        return "DynamicCache"
    name = {"int": "2-bit int", "lut": "2-bit lut", "fp8_e4m3": "fp8_e4m3"}[row["format"]]
    if row["transform"]:
        name += f" + {row['transform']}"
    return name + (", rope=pre" if row["rope"] == "pre" else "")


def records(folder: Path) -> dict[tuple[str, str], dict[int, dict]]:
    """(setting, cache) -> prompt length -> the record's row, in the records' order."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for _, run in bench_runs(folder):
        for row in run["rows"]:
            key = (SETTINGS[row["dtype"], row["batch"]], cache_name(row))
            out.setdefault(key, {})[row["length"]] = row
    order = list(SETTINGS.values())
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0][0])))


def table(rows: dict, header: str, cell, bar: str = "") -> str:
    """One row per (setting, cache) of `rows` that has a cell; `cell(row, length)` formats one record row."""
    lines = [f"| {header} | " + " | ".join(f"{n} tokens" for n in LENGTHS) + " |", "|---" * (len(LENGTHS) + 1) + "|"]
    for (setting, cache), by_len in rows.items():
        cells = [cell(by_len[n], n) if n in by_len else "" for n in LENGTHS]
        if any(cells):
            lines.append(f"| {setting}{': ' + cache if cache else ''} | " + " | ".join(cells) + " |")
    if bar:
        lines.append("| bar | " + " | ".join(bar.format(n=n, bar=BARS[n]) for n in LENGTHS) + " |")
    return "\n".join(lines)


def bold_below(value: float, bar: float, text: str) -> str:
    return f"**{text}**" if value < bar else text


def speed(r: dict, n: int) -> str:
    if r["kind"] == "dynamic":
        return f"{r['tok_s']:.1f} tok/s"
    return " / ".join(bold_below(r[k], BARS[n], f"{r[k]:.3f}x") for k in ("ratio", "paired_ratio"))


def pre_over_post(r: dict, n: int) -> str:
    return " / ".join(bold_below(r[k], PRE_BAR, f"{r[k]:.3f}") for k in ("pre_over_post", "paired_pre_over_post"))


def figure(rows: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    shades = {"fp32 b1": plt.cm.Blues, "bf16 b1": plt.cm.Oranges, "fp32 padded b4": plt.cm.Greens}  # a hue a setting
    marks = {"2-bit int": "o", "2-bit int, rope=pre": "s", "fp8_e4m3": "^", "2-bit lut": "v"}
    marks["2-bit int + hadamard"] = "D"
    caches = [k for k in rows if k[1] != "DynamicCache"]
    for setting, cache in caches:
        same = [c for s, c in caches if s == setting]
        shade = shades[setting](0.9 - 0.45 * same.index(cache) / max(len(same) - 1, 1))
        by_len = rows[setting, cache]
        ns = sorted(by_len)
        ax.plot(ns, [by_len[n]["paired_ratio"] for n in ns], marker=marks[cache], color=shade,
                linestyle="--" if "rope=pre" in cache else "-", label=f"{setting}: {cache}")  # fmt: skip
    ax.plot(list(BARS), list(BARS.values()), "k:", marker="_", markersize=14, label="bar")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decode tok/s / DynamicCache's (paired)")
    ax.set_title("SmolLM2-135M, packed 2-bit K-C/V-T G32 R128, C kernel; AMD EPYC Zen 4, 2 threads")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(Path(folder) / "ratio_vs_length.png", dpi=100)


def readme_tables(rows: dict) -> list[str]:
    """The README's three tables: decode speed, rope=pre over rope=post, peak cache."""
    pre = {(s, ""): by_len for (s, c), by_len in rows.items() if c.endswith("rope=pre")}
    return [
        table(rows, "decode speed vs DynamicCache (medians / paired)", speed, ">= {bar}x"),
        table(pre, "rope=pre / rope=post (medians / paired)", pre_over_post, f">= {PRE_BAR}"),
        table(rows, "peak cache MiB", lambda r, n: f"{r['peak_bytes'] / 2**20:.1f}"),
    ]


def tables(rows: dict) -> dict[str, str]:
    return {}  # the README holds the tables (tests/report: test_the_cache_speed_readme_holds_the_tables_...)


def text(rows: dict) -> str:
    """The README's tables, and the peak cache against the storage arithmetic."""
    arith = [r["measured_over_arith"] for by_len in rows.values() for r in by_len.values() if r["measured_over_arith"]]
    ratio = f"peak / storage arithmetic (ours): {min(arith):.4f} - {max(arith):.4f}"
    return "\n\n".join([*readme_tables(rows), ratio])


def rows(recs: dict):
    """One line per (setting, cache, prompt length): the benchmark's row."""
    return frame({"setting": s, "cache": c, **r} for (s, c), by_len in recs.items() for r in by_len.values())
