"""The frontier search: `python run.py experiment=frontier model=<any> frontier.budgets=[3,4.5,8.5]`.

    enumerate  every candidate (`kvq_lab.frontier.candidates`), bits counted from the model's files; nothing runs
    screen     task=probe on each (a few captured prompts, no decoding): key/value reconstruction, attention-score
               and attention-output error; the `keep` lowest attention-output errors per budget survive (token
               policies, which the probes do not model, pass unscreened)
    rank       task=fidelity on the survivors (plus `correlate` more screened ones, for the rank correlations): KL and
               top-1 against the 16-bit model; each budget's winner rerun under `noise` (rounding only) for the floor
    confirm    the Pareto set (bits vs KL; the points within noise of it kept) on the run's task (`task=`, CoQA turns
               by default) at `confirm.limit` documents, beside the 16-bit cache
    report     <report_dir>/report.md and frontier.png (`kvq_lab.report.studies.frontier`)

Each stage is a sweep of ordinary runs (`kvq_lab.run.runner.run`): sealed records under `results_dir`, found again
by their run key, so a killed search rerun with the same command runs only what is missing. The cost plan is printed
before any work (`kvq_lab.frontier.costs`); bad settings stop it in one line before the model loads.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvq_lab.common.errors import ConfigError
from kvq_lab.frontier.candidates import CONF, Candidate, apply, cap, cheapest, enumerate_candidates
from kvq_lab.frontier.costs import Clock, Rate, StagePlan, cut, plan_text
from kvq_lab.preflight import frontier as frontier_settings
from kvq_lab.report import frontier as select
from kvq_lab.report.study import model_of, read

SCREEN_METRIC = "probe/attn_out/rel_fro/mean"


def plain(cfg) -> dict[str, Any]:
    c = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else json.loads(json.dumps(cfg))
    c.pop("hydra", None)
    return c


def task_section(name: str, **over) -> dict[str, Any]:
    t = OmegaConf.to_container(OmegaConf.load(CONF / "task" / f"{name}.yaml"))
    t.update(over)
    return t


class Frontier:
    """One search: the settings, the run config every row starts from, the candidates and what each stage did."""

    def __init__(self, cfg, out=sys.stdout):
        from kvq_lab.run.config import build

        base = plain(cfg)
        self.s = frontier_settings.settings(base.get("frontier"))
        base["frontier"] = {}
        self.out = out
        self.confirm_task = base["task"]
        self.rank_task = task_section(
            "fidelity", **{k: v for k, v in self.s["rank"].items() if v is not None or k != "path"}
        )
        if self.s["rank"]["path"]:
            self.rank_task["source"] = "file"
        base["task"] = self.rank_task
        self.base = base
        run = build(base)  # the model, the data, the run's own settings: one line each before anything loads
        self.model = model_of({"config": base})
        self.results = Path(run.results_dir)
        from kvq_lab.common.section import Section
        from kvq_lab.plugins import TASKS

        tokens = TASKS["fidelity"].cached_tokens(Section(self.rank_task))
        cands, self.notes = enumerate_candidates(base, run.facts, self.s["budgets"], self.s["sources"], tokens)
        frontier_settings.check_budgets(self.s["budgets"], cheapest(cands), self.model)
        self.enumerated = len(cands)
        self.cands = {c.name: c for c in cap(cands, self.s["max_candidates"], self.s["sources"])}
        safe = self.model.replace("/", "_")
        self.dir = Path(self.s["report_dir"] or self.results / f"frontier_{safe}")
        self.clock = Clock(self.s["max_minutes"], self.s["shares"])
        self.rates = {k: Rate(v) for k, v in self.s["seconds"].items()}
        self.stages: dict[str, dict[str, Any]] = {}
        self.run_stages = list(self.s["stages"])  # what this invocation runs
        self.refresh_only(self.dir / "plan.json")

    def refresh_only(self, previous: Path) -> None:
        """`frontier.stages=[]` runs nothing: it enumerates again (the engine table and counts as the code has them now)
        and rewrites the plan and report from the records. What the stages ran, and the stages setting, are then the
        plan's it replaces, so the report still says what the search did."""
        if self.s["stages"] or not previous.is_file():
            return
        old = json.loads(previous.read_text())
        if old.get("model") != self.model:
            return
        self.stages = {k: v for k, v in old.get("stages", {}).items() if isinstance(v, dict)}
        self.s["stages"] = old.get("settings", {}).get("stages", [])

    # --- rows ------------------------------------------------------------------------------------------------------

    def units(self, stage: str) -> int:
        return {"screen": self.s["screen"]["prompts"], "rank": self.s["rank"]["windows"]}.get(
            stage, self.s["confirm"]["limit"]
        )

    def row_config(self, stage: str, cand: Candidate, extra: dict | None = None) -> dict[str, Any]:
        c = apply(self.base, cand.overrides)
        if stage == "screen":
            sc = self.s["screen"]
            c["task"] = task_section("probe", n_prompts=sc["prompts"], max_tokens=sc["tokens"], figures=False)
        elif stage == "confirm":
            c["task"], c["limit"] = self.confirm_task, self.s["confirm"]["limit"]
        c["experiment_name"] = f"frontier-{stage}"
        c["run_name"] = f"frontier-{stage}-{cand.name}"
        c.update(extra or {})
        return c

    def run_rows(self, stage: str, rows: list[tuple[Candidate, dict]], stages_left: list[str]) -> None:
        """Run one stage's rows (cheapest first, cut at the stage's share of max_minutes), each an ordinary run."""
        from tqdm import tqdm

        from kvq_lab.run.runner import RunFailed, run

        units, rate = self.units(stage), self.rates[stage]
        est = {f"{c.name}{json.dumps(x)}": units * rate.per_unit for c, x in rows}
        order, left = cut(list(est.items()), self.clock.share_s(stage, stages_left))
        by_key = {f"{c.name}{json.dumps(x)}": (c, x) for c, x in rows}
        done = self.stages.setdefault(stage, {"ran": [], "left": [], "rejected": [], "failed": []})
        done["left"] += [by_key[k][0].name for k in left]
        if left:
            print(f"frontier {stage}: max_minutes leaves {len(left)} of {len(rows)} rows: "
                  f"{', '.join(by_key[k][0].name for k in left)}", file=self.out)  # fmt: skip
        for key in tqdm(order, desc=f"frontier {stage}", unit="row", file=sys.stderr):
            cand, extra = by_key[key]
            t0 = time.perf_counter()
            try:
                metrics = run(OmegaConf.create(self.row_config(stage, cand, extra)))
            except ConfigError as e:
                done["rejected"].append(f"{cand.name}: {e}")
                print(f"frontier {stage}: {cand.name} rejected: {e}", file=self.out)
                continue
            except RunFailed as e:
                done["failed"].append(f"{cand.name}: {e}")
                print(f"frontier {stage}: {cand.name} failed: {e}", file=self.out)
                continue
            spent = time.perf_counter() - t0
            if spent > 1.0:  # a resumed row costs nothing and measures nothing
                rate.add(spent, units)
            done["ran"].append(cand.name) if metrics else None

    def records(self, stage: str) -> dict[str, dict]:
        """candidate name (or `name@noise`) -> its newest completed record of `stage` under results_dir."""
        out = {}
        if not (self.results / "runs").is_dir():
            return out
        for r in read(self.results, [self.model], where={"config.experiment_name": f"frontier-{stage}"}):
            name = str(r["config"].get("run_name", "")).removeprefix(f"frontier-{stage}-")
            noise = r["config"].get("noise", "none")
            out[name if noise == "none" else f"{name}@{noise}"] = r
        return out

    # --- stages ----------------------------------------------------------------------------------------------------

    def print_plan(self, ranked: int, confirmed: int) -> None:
        counts = {"screen": len(self.screenable()), "rank": ranked, "confirm": confirmed}
        plans = [StagePlan(s, counts[s], self.units(s), self.rates[s]) for s in self.run_stages]
        print(plan_text(plans, self.s["max_minutes"]), file=self.out)

    def screenable(self) -> list[Candidate]:
        return [c for c in self.cands.values() if c.overrides.get("policy") is None]

    def screen(self, left: list[str]) -> list[str]:
        """-> the candidates to rank: the best per budget, the unscreened, and `correlate` more."""
        rows = [(c, {}) for c in self.screenable()]
        if "screen" in self.run_stages:
            self.run_rows("screen", rows, left)
        recs = self.records("screen")
        errors = {n: recs[n]["metrics"].get(SCREEN_METRIC, math.nan) for n in self.cands if n in recs}
        bits = {n: self.cands[n].bits for n in self.cands}
        keep = select.best_per_band(errors, bits, self.s["budgets"], self.s["keep"])
        chosen = [n for b in self.s["budgets"] for n in keep[b]]
        chosen += [c.name for c in self.cands.values() if c.name not in errors]  # policies, or not screened
        ordered = sorted(errors, key=lambda n: (math.isnan(errors[n]), errors[n]))
        chosen += select.spread(ordered, self.s["correlate"])
        return list(dict.fromkeys(chosen))

    def rank(self, names: list[str], left: list[str]) -> None:
        self.run_rows("rank", [(self.cands[n], {}) for n in names], left)
        if self.s["noise"] == "none":
            return
        recs = self.records("rank")
        pts = [select.Point(n, self.cands[n].bits, recs[n]["metrics"]["fidelity/kl_mean"]) for n in names if n in recs]
        wins = {w for w, _ in select.winners(pts, self.s["budgets"]).values() if w}
        self.run_rows("rank", [(self.cands[n], {"noise": self.s["noise"]}) for n in sorted(wins)], left)

    def confirm(self, names: list[str], left: list[str]) -> None:
        fp16 = Candidate("fp16", "reference", OmegaConf.to_container(OmegaConf.load(CONF / "quant" / "fp16.yaml")),
                         bits=16.0)  # fmt: skip
        self.cands.setdefault("fp16", fp16)
        rows = [(self.cands[n], {}) for n in names[: self.s["confirm"]["max"]]] + [(self.cands["fp16"], {})]
        self.run_rows("confirm", rows, left)

    def search(self) -> Path:
        t0 = time.monotonic()
        print(f"frontier: model={self.model}, budgets {self.s['budgets']}: {self.enumerated} candidates within a "
              f"budget, {len(self.cands)} kept (max_candidates={self.s['max_candidates']}); {len(self.notes)} "
              "dropped (invalid here or over every budget)", file=self.out)  # fmt: skip
        survivors = self.s["keep"] * len(self.s["budgets"])
        self.print_plan(min(len(self.cands), survivors), self.s["confirm"]["max"] + 1)
        self.write_plan()
        stages = list(self.run_stages)
        ranked = self.screen(stages)
        stages = [s for s in stages if s != "screen"]
        if "rank" in stages:
            self.print_plan(len(ranked), self.s["confirm"]["max"] + 1)
            self.rank(ranked, stages)
            stages.remove("rank")
        from kvq_lab.report.studies import frontier as study

        if "confirm" in stages:
            front = study.analyse(self.plan(), self.records("screen"), self.records("rank"), {})["pareto"]
            self.confirm(front["front"] + front["kept"], stages)
        self.stages["minutes"] = round((time.monotonic() - t0) / 60, 2)
        self.write_plan()
        written = study.write(self.dir, self.plan(), self.records("screen"), self.records("rank"),
                              self.records("confirm"))  # fmt: skip
        print(f"frontier: report {written}", file=self.out)
        return written

    def plan(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "settings": self.s,
            "tokens": self.rank_task.get("context_tokens", 0) + self.rank_task.get("eval_tokens", 0),
            "confirm_task": self.confirm_task.get("name"),
            "candidates": [c.as_dict() for c in self.cands.values()],
            "enumerated": self.enumerated,
            "notes": self.notes,
            "stages": self.stages,
            "rates": {k: r.per_unit for k, r in self.rates.items()},
        }

    def write_plan(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "plan.json").write_text(json.dumps(self.plan(), indent=1, default=str) + "\n")


def main(cfg) -> int:
    """run.py's entry for `experiment=frontier`: -> exit status (2: bad input, before any model loads)."""
    try:
        Frontier(cfg).search()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
