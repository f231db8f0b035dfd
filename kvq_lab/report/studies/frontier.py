"""The frontier search's report (kvq_lab/frontier/driver.py writes it; `python -m kvq_lab.report frontier` remakes it
from experiments/frontier): per model, from its plan (`frontier_<model>/plan.json`: settings, candidates with their
stored bits and engine settings, what each stage ran and left) and its records (experiment_name `frontier:<stage>`).

    report.md     the winner per budget with its margin over the runner-up (KL paired over decode positions, beyond
                  the noise floor or not), what it costs on the confirming task against the 16-bit cache, and the
                  engine settings that run it; the frontier (stored bits vs KL) with the points kept within noise;
                  Spearman's rank correlation between KL and each screen over every candidate both screened and
                  ranked; what each stage ran, left (max_minutes), rejected or failed
    frontier.png  stored bits vs KL, the frontier drawn, the winners named
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvq_lab.report import frontier as select
from kvq_lab.report.noise import Floor, beyond, rerun_changes
from kvq_lab.report.rows import block_paired
from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import model_of, read

MODELS = None  # any model: each plan names its own
SCREENS = {
    "attention output": "probe/attn_out/rel_fro/mean",
    "attention score": "probe/attn_score/rel_fro/mean",
    "key reconstruction": "probe/key/rel_fro/mean",
    "value reconstruction": "probe/value/rel_fro/mean",
}


def _pos(rec: dict) -> list[float]:
    return rec["artifacts"]["fidelity_by_position"]["kl_mean"]


def _floor(base: dict, rerun: dict) -> Floor:
    try:
        changes = tuple(rerun_changes(base, rerun))
    except ValueError as e:
        changes = (str(e),)
    d, se, n = block_paired(_pos(base), _pos(rerun))
    a, b = (r["artifacts"]["fidelity_by_position"]["top1_agree"] for r in (base, rerun))
    return Floor(d, se, n, sum(x != y for x, y in zip(a, b, strict=True)), changes)


def _score(rec: dict, task: str | None) -> tuple[str, float] | None:
    m = rec.get("metrics") or {}
    for k in (f"{task}/f1", f"{task}/acc", f"{task}/exact_match"):
        if k in m:
            return k, float(m[k])
    k = next((k for k, v in m.items() if k.startswith(f"{task}/") and isinstance(v, float)), None)
    return (k, float(m[k])) if k else None


def analyse(plan: dict, screen: dict, rank: dict, confirm: dict) -> dict[str, Any]:
    """The numbers of the report, from the plan and each stage's records (name -> record)."""
    cands = {c["name"]: c for c in plan["candidates"]}
    ranked = {n: r for n, r in rank.items() if "@" not in n and n in cands}
    floors = [_floor(rank[n.split("@")[0]], r) for n, r in rank.items() if "@" in n and n.split("@")[0] in rank]
    pts = [select.Point(n, cands[n]["bits"], r["metrics"]["fidelity/kl_mean"]) for n, r in ranked.items()]

    def gap(d: select.Point, c: select.Point) -> tuple[float, float]:
        m, se, _ = block_paired(_pos(ranked[d.name]), _pos(ranked[c.name]))
        return m, se

    def beats(d, c) -> bool:
        m, se = gap(d, c)
        return m > 0 and (beyond(m, se, floors) if floors else m > 2 * se)

    front, kept = select.pareto(pts, beats)
    by = {p.name: p for p in pts}
    wins = {}
    for b, (w, r) in select.winners(pts, plan["settings"]["budgets"]).items():
        margin = None
        if w and r:
            m, se = gap(by[w], by[r])
            margin = (m, se, beats(by[w], by[r]))
        wins[b] = (w, r, margin)
    engines: dict[float, dict[str, tuple[str, str]]] = {}  # budget -> engine -> (least-KL candidate, its setting)
    for b in plan["settings"]["budgets"]:
        best = engines.setdefault(b, {})
        for p in sorted((p for p in pts if b in cands[p.name]["budgets"]), key=lambda p: (p.kl, p.bits)):
            for e in cands[p.name].get("engines") or []:
                engine, setting = e.split(": ", 1) if ": " in e else (e, "")
                best.setdefault(engine, (p.name, setting))
    both = [n for n in ranked if n in screen]
    kl = [ranked[n]["metrics"]["fidelity/kl_mean"] for n in both]
    rho = {k: select.spearman([screen[n]["metrics"].get(m, math.nan) for n in both], kl) for k, m in SCREENS.items()}
    return {"points": pts, "pareto": {"front": front, "kept": kept}, "winners": wins, "floors": floors,
            "spearman": rho, "n_corr": len(both), "engines": engines}  # fmt: skip


def _run_minutes(*stages: dict[str, dict]) -> float:
    """The stages' records' wall time (start to finish), summed: a resumed search's rows count once, when they ran."""
    from datetime import datetime

    total = 0.0
    for recs in stages:
        for r in recs.values():
            if r.get("started") and r.get("finished"):
                total += (datetime.fromisoformat(r["finished"]) - datetime.fromisoformat(r["started"])).total_seconds()
    return total / 60


def _engines(c: dict) -> str:
    return "<br>".join(c.get("engines") or []) or "no engine runs this yet"


def report(plan: dict, screen: dict, rank: dict, confirm: dict) -> str:
    a = analyse(plan, screen, rank, confirm)
    s, cands = plan["settings"], {c["name"]: c for c in plan["candidates"]}
    task = plan.get("confirm_task")
    ref = _score(confirm["fp16"], task) if "fp16" in confirm else None
    rank_s = s["rank"]
    searched = sum(c.get("source") != "reference" for c in cands.values())  # the 16-bit cache is the yardstick
    lines = [
        f"# Frontier: {plan['model']}",
        "",
        f"Budgets {s['budgets']} stored bits per cached K/V element (counted before any run at {plan['tokens']} "
        "tokens). "
        f"{plan['enumerated']} candidates within a budget, {searched} searched; screened on {s['screen']['prompts']} "
        f"prompts x {s['screen']['tokens']} tokens (task=probe), ranked by task=fidelity ({rank_s['windows']} "
        f"window(s), {rank_s['context_tokens']} + {rank_s['eval_tokens']} tokens), confirmed on task={task} "
        f"(limit {s['confirm']['limit']}). The stages' runs took {_run_minutes(screen, rank, confirm):.1f} min (their "
        f"records' start to finish, summed: the same after a resume); the last invocation "
        f"{plan['stages'].get('minutes', '?')} min.",
        "",
        "## Winner per budget",
        "",
        f"| budget | winner | stored bits | KL mean | top-1 | margin over runner-up (KL, paired ± SE) | {task} "
        "(Δ vs 16-bit) | engines |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b, (w, r, margin) in a["winners"].items():
        if w is None:
            lines.append(f"| {b:g} | none ranked | | | | | | |")
            continue
        m = rank[w]["metrics"]
        mg = (
            "-"
            if margin is None
            else f"{r}: {margin[0]:+.4f} ± {margin[1]:.4f}" + (" (beyond noise)" if margin[2] else " (within noise)")
        )
        sc = _score(confirm[w], task) if w in confirm else None
        conf = "-" if sc is None else f"{sc[1]:.4g}" + (f" ({sc[1] - ref[1]:+.4g})" if ref else "")
        c = cands[w]
        bits = (
            f"{c['bits']:.3f}"
            if c["exact"]
            else f"<= {c['bits']:g} ({rank[w]['metrics'].get('cache/bits_total', 0):.3f})"
        )
        lines.append(
            f"| {b:g} | {w} | {bits} | {m['fidelity/kl_mean']:.4f} | {m['fidelity/top1_agree']:.3f} | {mg} | {conf} | "
            f"{_engines(c)} |"
        )
    fl = "; ".join(f"{f.cell()} ({', '.join(f.changes)})" for f in a["floors"]) or "none measured (frontier.noise=none)"
    lines += ["", f"Noise floor (each winner rerun with only float rounding changed, KL paired): {fl}.", ""]
    lines += ["## Best per engine", "", "Per budget, the ranked candidate of least KL that each engine runs, and the "
              "setting that runs it.", "", "| budget | engine | candidate | stored bits | KL mean | setting |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for b, best in a["engines"].items():
        for engine, (name, setting) in sorted(best.items()):
            lines.append(f"| {b:g} | {engine} | {name} | {cands[name]['bits']:.3f} | "
                         f"{rank[name]['metrics']['fidelity/kl_mean']:.4f} | {setting} |")  # fmt: skip
    lines += ["", "## Frontier (stored bits vs KL)", "", "| candidate | source | stored bits | KL mean | top-1 | "
              "attention-output error | place |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    front, kept = set(a["pareto"]["front"]), set(a["pareto"]["kept"])
    for p in sorted(a["points"], key=lambda p: (p.bits, p.kl)):
        err = screen.get(p.name, {}).get("metrics", {}).get(SCREENS["attention output"])
        place = "frontier" if p.name in front else "within noise" if p.name in kept else "dominated"
        e = "-" if err is None else f"{err:.4f}"
        lines.append(f"| {p.name} | {cands[p.name]['source']} | {p.bits:.3f} | {p.kl:.4f} | "
                     f"{rank[p.name]['metrics']['fidelity/top1_agree']:.3f} | {e} | {place} |")  # fmt: skip
    lines += ["", f"## Does a cheap screen rank like KL? (Spearman over {a['n_corr']} screened and ranked)", ""]
    lines += ["| screen | Spearman ρ with KL |", "|---|---|"]
    lines += [f"| {k} | {v:+.3f} |" for k, v in a["spearman"].items()]
    lines += ["", "## Stages", ""]
    for st, d in plan["stages"].items():
        if isinstance(d, dict):
            lines.append(f"- {st}: ran {len(d['ran'])}, left by max_minutes {len(d['left'])} {d['left'] or ''}, "
                         f"rejected {len(d['rejected'])}, failed {len(d['failed'])}")  # fmt: skip
            lines += [f"  - {x}" for x in d["rejected"] + d["failed"]]
    return "\n".join(lines) + "\n"


def draw(plan: dict, rank: dict, screen: dict, path: Path) -> None:
    """One model's frontier.png: stored bits vs KL, the frontier drawn, the winners named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = analyse(plan, screen, rank, {})
    front = [p for p in a["points"] if p.name in a["pareto"]["front"]]
    fig, ax = plt.subplots(figsize=(8, 5))
    for p in a["points"]:
        ax.scatter(p.bits, p.kl, s=14, color="C0" if p in front else "C7")
    if front:
        ax.plot([p.bits for p in front], [p.kl for p in front], color="C0", lw=1, label="frontier")
    for b, (w, _r, _m) in a["winners"].items():
        ax.axvline(b, color="C3", lw=0.5, ls=":")
        if w:
            p = next(p for p in a["points"] if p.name == w)
            ax.annotate(w, (p.bits, p.kl), fontsize=7, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("stored bits per K/V element")
    ax.set_ylabel("KL(16-bit || cache), nats per token")
    if all(p.kl > 0 for p in a["points"]) and a["points"]:
        ax.set_yscale("log")
    ax.set_title(f"{plan['model']}: frontier")
    ax.legend(fontsize=8) if front else None
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(folder: Path, plan: dict, screen: dict, rank: dict, confirm: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.md").write_text(report(plan, screen, rank, confirm))
    draw(plan, rank, screen, folder / "frontier.png")
    return folder / "report.md"


# --- the study protocol (kvq_lab/report/studies/__init__.py) --------------------------------------------------------


# --- the recommended llama.cpp settings, run through llama.cpp (experiments/frontier/llama_cpp_check.py) ------------


@dataclass(frozen=True)
class LlamaCppSetting:
    """A llama.cpp setting to check: the candidate (kvq_lab's cache: `overrides`), its flags, the budgets whose
    llama.cpp row it is (none: the q8_0 cache of the same rotation, for llama.cpp's kernel floor)."""

    candidate: str
    overrides: dict
    flags: str
    budgets: tuple[float, ...]

    @property
    def rotation(self) -> bool:
        return "LLAMA_ATTN_ROT_DISABLE=1" not in self.flags

    @property
    def ctk(self) -> str:
        return re.search(r"-ctk (\S+)", self.flags).group(1)

    @property
    def ctv(self) -> str:
        return re.search(r"-ctv (\S+)", self.flags).group(1)

    @property
    def kind(self) -> tuple[str, str, bool]:
        return self.ctk, self.ctv, self.rotation

    def log(self, n_ctx: int) -> str:
        return f"{n_ctx}_{self.ctk}_{self.ctv}_{'rot' if self.rotation else 'norot'}.log"


def _llama_cpp(c: dict, budgets: tuple[float, ...] = ()) -> list[LlamaCppSetting]:
    """A plan candidate's llama.cpp settings (its `llama.cpp: `<flags>` ...` engine lines)."""
    lines = [e for e in c.get("engines") or [] if e.startswith("llama.cpp: ")]
    return [LlamaCppSetting(c["name"], c["overrides"], e.split("`")[1], budgets) for e in lines]


def llama_cpp_settings(plan: dict, stages: dict) -> list[LlamaCppSetting]:
    """The report's llama.cpp rows (per budget, the least-KL ranked candidate llama.cpp runs), then for each rotation
    among them the q8_0 cache of that rotation (the floor), from the plan's candidates (their engine rows are those
    of the model's architecture)."""
    cands = {c["name"]: c for c in plan["candidates"]}
    a = analyse(plan, stages["screen"], stages["rank"], stages["confirm"])
    picked: dict[str, list[float]] = {}
    for b, best in a["engines"].items():
        if "llama.cpp" in best:
            picked.setdefault(best["llama.cpp"][0], []).append(b)
    out = [_llama_cpp(cands[name], tuple(budgets))[0] for name, budgets in picked.items()]
    for rot in sorted({s.rotation for s in out}):
        floor = ("q8_0", "q8_0", rot)
        q8 = [s for c in plan["candidates"] for s in _llama_cpp(c) if s.kind == floor]
        if q8 and not any(s.kind == floor for s in out):
            out.append(q8[0])
    return out


def llama_cpp_check(plan: dict, stages: dict, check: dict | None) -> str:
    """check.md: each recommended setting's mean KLD in llama.cpp beside kvq_lab's for the same cache (llama.cpp's
    perplexity chunks), raw and with llama.cpp's kernel floor added (its q8_0 KLD less kvq_lab's, same rotation),
    against the parity study's band max(15% of llama.cpp's, 0.002)."""
    from kvq_lab.report.studies.llama_cpp_parity import agree

    check = check or {"kvq": {}, "logs": {}}
    n_ctx = sorted({int(r["config"]["task"]["n_ctx"]) for r in check["kvq"].values()} or [0])[-1]
    rows, floor = [], {}
    for s in llama_cpp_settings(plan, stages):
        rec, theirs = check["kvq"].get(s.candidate), check["logs"].get(s.log(n_ctx), {})
        if rec is None or "kl_mean" not in theirs:
            rows.append((s, None, None))
            continue
        ours = rec["metrics"]["fidelity/kl_mean"]
        rows.append((s, ours, theirs))
        if (s.ctk, s.ctv) == ("q8_0", "q8_0"):
            floor[s.rotation] = theirs["kl_mean"] - ours
    lines = [f"# llama.cpp's settings for {plan['model']}, run through llama.cpp", "",
             f"llama-perplexity's protocol on both sides (CoQA stories, chunks of {n_ctx} tokens, the second half "
             "scored), mean KLD against each side's 16-bit run. Band: max(15% of llama.cpp's, 0.002) "
             "(experiments/llama_cpp_parity); floor: llama.cpp's q8_0 KLD less kvq_lab's, same rotation.", "",
             "| budgets | candidate | llama.cpp setting | KLD llama.cpp | KLD kvq_lab | raw within band | floor | "
             "kvq_lab + floor | within band |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s, ours, theirs in rows:
        budgets = ", ".join(f"{b:g}" for b in s.budgets) or "(floor)"
        if ours is None:
            lines.append(f"| {budgets} | {s.candidate} | `{s.flags}` | not run | | | | | |")
            continue
        t, f = theirs["kl_mean"], floor.get(s.rotation)
        raw = "yes" if agree(ours, t) else "no"
        with_floor = "-" if f is None else f"{ours + f:.4f}"
        ok = "-" if f is None else ("yes" if agree(ours + f, t) else "no")
        if (s.ctk, s.ctv) == ("q8_0", "q8_0") and f is not None:
            ok = "by construction"
        fl = "-" if f is None else f"{f:.4f}"
        lines.append(f"| {budgets} | {s.candidate} | `{s.flags}` | {t:.4f} | {ours:.4f} | {raw} | {fl} | "
                     f"{with_floor} | {ok} |")  # fmt: skip
    return "\n".join(lines) + "\n"


# --- the study protocol (kvq_lab/report/studies/__init__.py) --------------------------------------------------------


def records(folder: Path) -> dict[str, tuple[dict, dict[str, dict[str, dict]], dict | None]]:
    """model -> (its plan, stage -> name -> newest completed record, its llama.cpp check or None: kvq_lab's records
    by candidate and llama.cpp's logs parsed); empty where the folder holds no search yet."""
    from kvq_lab.report.studies.llama_cpp_parity import parse

    out = {}
    if not (Path(folder) / "runs").is_dir():
        return out
    for plan_file in sorted(Path(folder).glob("frontier_*/plan.json")):
        plan = json.loads(plan_file.read_text())
        stages: dict[str, dict[str, dict]] = {"screen": {}, "rank": {}, "confirm": {}}
        for r in read(folder, [plan["model"]], clean=True):
            st = str(r["config"].get("experiment_name") or "").removeprefix("frontier-")
            if st in stages and model_of(r) == plan["model"]:
                name = str(r["config"].get("run_name", "")).removeprefix(f"frontier-{st}-")
                noise = r["config"].get("noise", "none")
                stages[st][name if noise == "none" else f"{name}@{noise}"] = r
        check = None
        where = Path(folder) / "llama_cpp_check" / plan["model"].replace("/", "_")
        if (where / "runs").is_dir():
            kvq = {str(r["config"].get("run_name")): r for r in read(where, [plan["model"]], clean=True)}
            logs = {p.name: parse(p.read_text()) for p in sorted(where.glob("*.log"))}
            check = {"kvq": kvq, "logs": logs}
        out[plan["model"]] = (plan, stages, check)
    return out


def tables(recs) -> dict[str, str]:
    out = {}
    for m, (plan, st, check) in recs.items():
        out[f"frontier_{m.replace('/', '_')}/report.md"] = report(plan, st["screen"], st["rank"], st["confirm"])
        if check is not None:
            out[f"llama_cpp_check/{m.replace('/', '_')}/check.md"] = llama_cpp_check(plan, st, check)
    return out


def figure(recs, folder: Path) -> None:
    """Each model's frontier.png beside its report (`python -m kvq_lab.report frontier`)."""
    for m, (plan, st, _) in recs.items():
        out = Path(folder) / f"frontier_{m.replace('/', '_')}"
        out.mkdir(parents=True, exist_ok=True)
        draw(plan, st["rank"], st["screen"], out / "frontier.png")


def rows(recs):
    out = []
    for m, (plan, st, _) in recs.items():
        a = analyse(plan, st["screen"], st["rank"], st["confirm"])
        out += [{"model": m, "name": p.name, "bits": p.bits, "kl": p.kl} for p in a["points"]]
    return frame(out)
