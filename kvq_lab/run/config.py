"""The user's config surface: the run config schema, and the typed `RunConfig` built from it once, at the entry point.

Hydra composes `conf/` against `RunSchema` (registered as `kvq_schema`; the cache knobs come from
`kvq_lab.cache.knobs.CacheKnobs`), so an unknown top-level key fails at compose time. `build(cfg)` then runs the
preflight (`kvq_lab.preflight.RUN`: every check, in one order) and turns Hydra's config into a frozen `RunConfig`
(`kvq_lab.contract`) *before any model loads*; each failure is a `ConfigError` whose one-line message names the key,
the bad value and what is allowed. Nothing below the runner reads Hydra's config: tasks, fits and caches get the
`RunConfig` (or one of its sections). `validate(cfg)` adds what the run's
numbers are computed from (`RunPlan`: inputs, run key).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvq_lab import preflight
from kvq_lab.cache.config import CacheConfig
from kvq_lab.cache.knobs import CACHE_KNOBS, CacheKnobs, knob
from kvq_lab.common.errors import ConfigError
from kvq_lab.common.spellings import as_hashed, task_as_hashed
from kvq_lab.contract import RunConfig
from kvq_lab.models.noise import NOISE_HELP, parse_noise
from kvq_lab.preflight import SECTIONS

__all__ = [
    "SECTIONS",
    "ConfigError",
    "RunConfig",
    "RunPlan",
    "RunSchema",
    "build",
    "cache_config",
    "config_hash",
    "validate",
]


@dataclass
class RunSchema(CacheKnobs):
    """Every top-level knob: the cache's (`CacheKnobs`) and the run's, with defaults and meaning (conf/config.yaml
    sets the same defaults where it names a knob; tests/run/test_schema.py checks both it and the README's knob table
    against this)."""

    limit: Any = knob(None, "evaluate only the first N documents of the task")
    seed: Any = knob(0, "seed of every random generator")
    batch_size: Any = knob(
        1,
        "prompts per batch (left-padded; padding never enters a group). The same numbers computed in another order: at "
        "4 bits or fewer per element per-turn answers change with it in float32 (a last-bit difference flips a code), "
        "so only aggregates compare across batch sizes (`noise`)",
    )
    prefix_reuse: Any = knob(
        True,
        "lm-eval tasks: prompts sharing a prefix (CoQA's turns of one story) reuse its cache, at any batch_size. Cut "
        "where the cache sees no difference, computed in other GEMM shapes: at 4 bits or fewer per element per-turn "
        "answers change with it in float32, so only aggregates compare with and without it (`noise`)",
    )
    noise: Any = knob("none", NOISE_HELP)
    probe: Any = knob(False, "also log reconstruction / attention-score / attention-output error per layer and head")
    probes: Any = knob(None, "settings of `probe=true` (prompts, lengths, figures), see conf/config.yaml", factory=dict)
    device: Any = knob("cpu", "`cpu`, `cuda` or `cuda:<index>`")
    data_dir: Any = knob(None, "local data folder (`$KVQ_DATA_DIR`); unset: download from the hub")
    results_dir: Any = knob(
        "results",
        "records go to `<results_dir>/runs/<run name>/record.json`; `experiment=<name>` sets `experiments/<name>`",
    )
    run_name: Any = knob(None, "the run's folder name; default `<task>_<cache label>_<config hash>`")
    resume: Any = knob(
        True,
        "skip a run whose completed record exists for the same config, data files, model, fit, code and libraries: a "
        "killed sweep repeats nothing, a changed input reruns",
    )
    resume_dirty: Any = knob(False, "also reuse records made from a git tree with uncommitted changes to code")
    experiment_name: Any = knob(None, "the study a run belongs to (`experiment=<name>` sets it)")
    model: Any = knob(
        None,
        "`conf/model/`: `smollm2-135m`, `gemma3-270m`, or `model=hub model.path=<hub id or folder>`; `model.dtype`: "
        "`float32` (default), `float16`, `bfloat16`, or `float64` (the CPU reference for checking, PyTorch path)",
        factory=dict,
    )
    task: Any = knob(None, "`conf/task/`: `coqa_turns` (default), see the task table", factory=dict)
    logger: Any = knob(None, "`wandb` (offline unless `logger.mode=online` or `WANDB_MODE`) or `none`", factory=dict)
    calibration: Any = knob(
        None,
        "text the fitted methods (`nuq`, `nvfp4`, `key_outliers`, `innerq`, `rotatekv`) learn from, never the "
        "evaluated text: `gsm8k_train` (GSM8K train split), `coqa_stories` (the tail of the CoQA stories, after the "
        "ppl windows; "
        "refused for the CoQA tasks), `file` (`calibration.path`); `calibration.tokens` (2048). Fitted once per model, "
        "method, settings and code version, kept in `~/.cache/kvq_lab/calibration/` with its digest "
        "(`kvq_lab/fit/calibration.py`)",
        factory=dict,
    )
    precision: Any = knob(
        None,
        "`uniform`: every layer at `key_bits`/`value_bits`; `search`: per-layer (key bits, value bits) from "
        "`precision.choices` ([2,3,4,8]) with the least logit-KL sensitivity under `precision.budget` stored bits per "
        "K/V element (counted as the packed cache's `nbytes()` counts, at `precision.tokens`), written to "
        "`<run>/precision.yaml`; `file`: `precision.path=<that file>` reruns it (`kvq_lab/fit/precision.py`, KVTuner). "
        "`precision.granularity=head`: bits per KV head of each layer (each width's heads stored as a layer of their "
        "own, decoded on the PyTorch path)",
        factory=dict,
    )
    frontier: Any = knob(
        None,
        "`experiment=frontier`: the frontier search's settings (`frontier.budgets` [3, 4.5, 8.5] stored bits per K/V "
        "element, `max_candidates`, `max_minutes`, `keep`, `correlate`, `sources`, `screen`, `rank`, `confirm`, "
        "`noise`, `seconds`, `shares`, `stages`, `report_dir`: conf/experiment/frontier.yaml, "
        "experiments/frontier/README.md); empty: an ordinary run",
        factory=dict,
    )


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="kvq_schema", node=RunSchema)


def _container(cfg) -> dict:
    """Hydra's config as plain Python values (`???` stays as written: `model=hub` without a path says so)."""
    if isinstance(cfg, DictConfig):
        c = OmegaConf.to_container(cfg, resolve=True)
    else:
        c = dict(cfg)
    c.pop("hydra", None)
    return c


def cache_config(cfg) -> CacheConfig:
    """The cache the run asks for, from the top-level knobs (validated, one-line errors); precision=file gives it
    the file's per-layer key/value bits (`kvq_lab.preflight.cache_config`)."""
    return preflight.cache_config(_container(cfg))


def build(cfg) -> RunConfig:
    """Hydra's config (or a plain mapping of it) -> the validated `RunConfig`: the preflight's checks in their order
    (`kvq_lab.preflight.RUN`); no model is loaded. Raises ConfigError (one line, with the fix)."""
    from kvq_lab.plugins import TASKS

    known = frozenset(f.name for f in fields(RunSchema))
    return preflight.preflight(preflight.Pending(_container(cfg), known=known, tasks=TASKS), preflight.RUN).run


@dataclass
class RunPlan:
    """A validated run: its config, the cache to build, and what its numbers are computed from.

    config_hash: the resolved config (cache knobs replaced by the cache they build, its backend resolved); inputs:
    identities of the data files, the model, the package sources, the libraries and, where something is fitted
    (calibration, per-layer bits), the digest of the fitted parameters (`fitted`), and where MKL could not be pinned to
    its reproducible mode, the mode and thread count (`numerics`, `kvq_lab.models.numerics`); run_key: all of it hashed
    together (the resume key), "" while the fit is still to be made (the runner sets it once the fit exists, `refit`);
    row_key: the same without the fit (what a sweep row is claimed and found by, fitted or not).
    """

    cfg: RunConfig
    cache: CacheConfig
    config_hash: str
    inputs: dict[str, Any] = field(default_factory=dict)
    run_key: str = ""
    row_key: str = ""

    @property
    def task(self) -> str:
        return self.cfg.task.name

    @property
    def results_dir(self) -> Path:
        return self.cfg.results_dir

    @property
    def data_dir(self) -> Path | None:
        return self.cfg.data_dir

    def refit(self, cache: CacheConfig) -> bool:
        """Take the fitted cache (after calibration and the per-layer search) and key the run by its fit; -> whether
        the run key changed (then the runner looks for a completed record of the new key)."""
        from kvq_lab.fit.fit_cache import fitted_digest
        from kvq_lab.records.provenance import run_key

        self.cache = cache
        digest = fitted_digest(cache)
        if digest == self.inputs.get("fitted") and self.run_key:
            return False
        self.inputs = {k: v for k, v in self.inputs.items() if k != "fitted"}
        if digest:
            self.inputs["fitted"] = digest
        self.run_key = run_key(self.config_hash, self.inputs)
        return True


# The cache fields every config hash holds (those records were first written with). Any other field is hashed only
# where it differs from its default (`CACHE_DEFAULTS`, derived): a field added later, a new knob included, leaves the
# hashes of configs that do not set it as they were. Renamed fields go under their old names (`as_hashed`).
HASHED_ALWAYS = tuple("key value mode exact_window sink_tokens rope backend key_transform value_transform".split())
CACHE_DEFAULTS = as_hashed(
    {
        f.name: f.default_factory() if f.default is MISSING else f.default
        for f in fields(CacheConfig)
        if f.name not in HASHED_ALWAYS
    }
)
WHERE = ("results_dir", "run_name", "logger", "resume", "resume_dirty", "experiment_name", "data_dir")


def config_hash(cfg, cache: CacheConfig | None = None) -> str:
    """Hash of what determines a run's result: everything except where it is written and how it is logged,
    with the cache knobs replaced by the cache they describe. `cfg`: a RunConfig, or Hydra's config."""
    c = cfg.resolved.to_dict() if isinstance(cfg, RunConfig) else _container(cfg)
    cache = cache if cache is not None else cfg.cache if isinstance(cfg, RunConfig) else cache_config(c)
    from kvq_lab.fit import precision_settings
    from kvq_lab.fit.calibration_settings import needs_calibration

    precision = precision_settings.hash_part(c.get("precision"))  # per-layer bits by content; uniform: left out
    # where the run is written, the cache knobs (the cache is hashed below, as built), precision (by content, above),
    # the search's own settings (its rows run without them)
    for k in (*WHERE, *CACHE_KNOBS, "precision", "frontier"):
        c.pop(k, None)
    noise = parse_noise(c.pop("noise", None))  # added after records existed: hashed only when a rerun is perturbed
    if noise != "none":
        c["noise"] = noise
    if precision is not None:
        c["precision"] = precision
    fitted_out = as_hashed(asdict(cache.unfitted())).items()  # renamed knobs hashed under their old names
    c["cache"] = {k: v for k, v in fitted_out if k not in CACHE_DEFAULTS or v != CACHE_DEFAULTS[k]}
    if isinstance(c.get("task"), dict):
        c["task"] = task_as_hashed(c["task"])
    if not needs_calibration(cache):
        c.pop("calibration", None)  # calibration settings only matter to fitted methods
    if not c.get("probe"):
        c.pop("probes", None)  # probe settings only matter when probes run
    return hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()[:12]


def validate(cfg) -> RunPlan:
    """`build` the RunConfig, then identify what its numbers come from (`RunPlan`); no model is loaded."""
    from kvq_lab.fit.fit_cache import fit_pending, kept_fit
    from kvq_lab.models.numerics import unpinned_inputs
    from kvq_lab.plugins import TASKS
    from kvq_lab.records.provenance import code_version, library_versions, model_identity, run_key

    numerics = unpinned_inputs()  # pins MKL's reproducible mode before any product; what changes the bits if it can't
    run = build(cfg)
    h = config_hash(run)
    inputs = {
        "data": TASKS[run.task.name].inputs(run, run.data_dir),
        "model": model_identity(run.model_source, run.model.get("revision")),
        "code": code_version(),
        "libraries": library_versions(),
        **({"numerics": numerics} if numerics else {}),  # only where unpinned: pinned run keys stay as they were
    }
    plan = RunPlan(cfg=run, cache=run.cache, config_hash=h, inputs=inputs, row_key=run_key(h, inputs))
    fitted = kept_fit(run.cache, run.calibration, run.precision, run.data_dir, inputs["model"])
    if fitted is not None or not fit_pending(run.cache, run.precision):  # else the key waits for the fit
        plan.refit(fitted if fitted is not None else run.cache)
    return plan
