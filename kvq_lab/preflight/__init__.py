"""The preflight: every check a run makes before anything loads, in one ordered list, for every entry point.

    run.py and a sweep's rows      kvq_lab.run.config.build / validate   ->  preflight(Pending(...), RUN)
    lm-eval's `--model kvq`        kvq_lab.lmeval.cli.check_model_args    ->  preflight(Pending(...), LMEVAL)

A check reads the config (plain values, as Hydra composed it, or lm-eval's model args mapped onto the same keys) and
what the earlier checks resolved (the cache, the model, its facts from its files: `Pending`), and either resolves one
more thing or raises the reason it refuses as a one-line `ConfigError` naming the key, the value and the fix. The
first reason stops the preflight: it fails fast, before any model loads. `LMEVAL` is `RUN` less the run's own
settings (results folder, logger, task, probes, fits), in the same order, after lm-eval's own argument check.

The checks themselves live beside what they check (the cache's in kvq_lab.cache, the fits' settings in kvq_lab.fit,
a task's in its module); the run's own settings in `kvq_lab.preflight.settings`, those against the model's files in
`kvq_lab.preflight.model`. The order is here, once. The result is the contract (`kvq_lab.contract.RunConfig`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvq_lab.cache.checks import check_device, check_dtype
from kvq_lab.cache.config import CacheConfig
from kvq_lab.cache.knobs import cache_config as cache_from_knobs
from kvq_lab.common.errors import ConfigError
from kvq_lab.common.section import Section
from kvq_lab.common.spellings import refused
from kvq_lab.contract import RunConfig
from kvq_lab.fit import calibration_settings, precision_settings
from kvq_lab.models.files import ModelFacts
from kvq_lab.models.loading import check_source
from kvq_lab.models.noise import parse_noise

from . import model as against_model
from . import settings

__all__ = ["LMEVAL", "RUN", "Pending", "cache_config", "check_overrides", "preflight"]

SECTIONS = ("model", "task", "logger", "probes", "calibration", "precision")


@dataclass
class Pending:
    """What the preflight has read and resolved so far. c: the config as plain values; known: its allowed top-level
    keys (None: not checked here); tasks: the task registry (`kvq_lab.plugins.TASKS`; None: no task, lm-eval's);
    source_arg: what the user calls the model's path (`model.path`, lm-eval's `pretrained`)."""

    c: dict[str, Any]
    known: frozenset[str] | None = None
    tasks: Any = None
    source_arg: str = "model.path"
    data_dir: Path | None = None
    cache: CacheConfig | None = None
    values: dict[str, Any] = field(default_factory=dict)  # the run's own settings, typed
    task: Any = None
    model: str | None = None
    facts: ModelFacts | None = None
    run: RunConfig | None = None

    @property
    def probing(self) -> bool:
        """Whether the run measures the probes (`probe=true` or `task=probe`)."""
        return bool(self.values.get("probe")) or self.c["task"].get("name") == "probe"


Check = Callable[[Pending], None]


def cache_config(c: Mapping) -> CacheConfig:
    """The cache the knobs ask for (validated, one-line errors); precision=file gives it the file's per-layer key/value
    bits (`kvq_lab.fit.precision_settings`)."""
    return precision_settings.apply_file(c.get("precision"), cache_from_knobs(c))


# --- the checks, each one step -----------------------------------------------------------------------------------


def renamed(p: Pending) -> None:
    """A knob spelled as it was before a rename (`kvq_lab.common.spellings`): refused, naming today's spelling."""
    why = refused(p.c, "" if p.source_arg == "model.path" else "model arg ")
    if why:
        raise ConfigError(why)


def check_overrides(argv: list[str]) -> None:
    """run.py's command line, before Hydra composes it (Hydra's own refusal of an unknown key spans several lines and
    names no replacement): `renamed` on the overrides (`key=value`, `+key=value`, a sweep's `key=a,b`)."""
    c: dict = {}
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq or arg.startswith("-"):
            continue
        *path, last = key.split(".")
        node = c
        for part in path:  # `task=ppl task.x=1`: the group's name is not checked here, its options are
            node[part] = node[part] if isinstance(node.get(part), dict) else {}
            node = node[part]
        node.setdefault(last, value)
    renamed(Pending(c))


def did_you_mean(name: str, options, prefix: str = "") -> str:
    """ "did you mean <prefix>a or <prefix>b?" for the options spelled close to `name`; "" where none is."""
    near = difflib.get_close_matches(name, [str(o) for o in options], n=3, cutoff=0.6)
    return f"did you mean {' or '.join(prefix + n for n in near)}?" if near else ""


def not_a_setting(key: str, siblings, where: str = "conf/config.yaml") -> str:
    """One line for a key that is no setting: the settings beside it spelled close to it, or where they are listed."""
    parent, _, last = key.rpartition(".")
    near = did_you_mean(last, siblings, f"{parent}." if parent else "")
    return f"{key} is not a kvq_lab setting; {near or f'see {where} for the settings'}"


def known_keys(p: Pending) -> None:
    """`+key=value` slips past Hydra's struct check; a typo must not change the run silently."""
    unknown = sorted(set(p.c) - p.known) if p.known is not None else []
    if unknown:
        raise ConfigError(not_a_setting(unknown[0], p.known))
    for s in SECTIONS:
        p.c[s] = p.c.get(s) or {}


def cache(p: Pending) -> None:
    p.cache = cache_config(p.c)


def device(p: Pending) -> None:
    check_device(p.c.get("device"), p.cache)


def dtype(p: Pending) -> None:
    """float64: the CPU reference, on the PyTorch path."""
    p.cache = check_dtype(p.c["model"].get("dtype"), p.c.get("device"), p.cache)


def precision(p: Pending) -> None:
    """Its settings, a budget the smallest choice meets, a K/V mode."""
    precision_settings.check(p.c["precision"], p.cache)


def calibration(p: Pending) -> None:
    """The data folder; the calibration text exists and is not the evaluated task's."""
    p.data_dir = settings.data_dir(p.c)
    calibration_settings.check_calibration(p.c["calibration"], p.cache, p.c["task"].get("name"), p.data_dir)


def run_values(p: Pending) -> None:
    """limit, seed, batch size, flags, noise, and where the record goes."""
    c, v = p.c, p.values
    v["limit"] = settings.integer(c, "limit", lo=1, allow_none=True)
    v["seed"], v["batch_size"] = settings.integer(c, "seed", lo=0), settings.integer(c, "batch_size", lo=1)
    v.update({k: settings.flag(c, k) for k in ("probe", "resume", "resume_dirty", "prefix_reuse")})
    v["noise"] = parse_noise(c.get("noise"))
    v["results_dir"] = settings.check_paths(c)


def search_settings(p: Pending) -> None:
    """experiment=frontier's own settings (`kvq_lab.preflight.frontier`), where the config has them."""
    if p.c.get("frontier"):
        from . import frontier as search

        search.settings(p.c["frontier"])


def logger(p: Pending) -> None:
    section = p.c["logger"]
    name = section.get("name")
    if name not in settings.LOGGER_KEYS:
        raise ConfigError(f"logger={name!r} is not a logger; choose one of: {', '.join(settings.LOGGER_KEYS)}")
    settings.check_keys("logger", section, settings.LOGGER_KEYS[name])
    if name == "wandb" and section.get("mode") not in settings.WANDB_MODES:
        raise ConfigError(f"logger.mode={section.get('mode')!r}; choose offline, online or disabled")


def probes(p: Pending) -> None:
    """What the probes model (every token's quantizer), and their own settings, checked before a task has run."""
    if p.probing and p.cache.splits_tokens:
        raise ConfigError(
            f"the probes measure the error of every token's quantizer; policy={p.cache.policy}'s tiers and dropped "
            "tokens are not modelled there: probe with policy=kivi"
        )
    p.values["probes"] = None
    if p.values["probe"]:
        from kvq_lab.probes.settings import ProbeSettings

        try:
            p.values["probes"] = ProbeSettings.from_dict(p.c["probes"])
        except (TypeError, ValueError) as e:
            raise ConfigError(f"probes: {e}") from None


def task(p: Pending) -> None:
    name = p.c["task"].get("name")
    if name not in p.tasks:
        raise ConfigError(f"task.name={name!r} is not a known task; choose one of: {', '.join(sorted(p.tasks))}")
    p.task = p.tasks[name]


def source(p: Pending) -> None:
    """The model to load (registry name, hub id, folder or GGUF file), found without loading anything."""
    try:
        p.model = check_source(p.c["model"])
    except ConfigError as e:
        if p.source_arg == "model.path":
            raise
        raise ConfigError(str(e).replace("model.path=", f"{p.source_arg}=")) from None


def facts(p: Pending) -> None:
    """The model's shape from its files (None for a hub id)."""
    p.facts = against_model.model_facts(p.model, p.c["model"].get("head_dim"))


def layers(p: Pending) -> None:
    p.cache = against_model.resolve_layers(p.cache, p.facts, p.model)


def features(p: Pending) -> None:
    """A chat template the task needs, RoPE by layer type, sliding-window layers under a token policy."""
    if p.task is not None:
        against_model.check_model_features(p.cache, p.facts, p.model, p.task, p.c["task"])


def recompute(p: Pending) -> None:
    """mode=recompute caches the attention input: the model's projections must allow it."""
    if not p.cache.caps.stores_kv:
        against_model.check_recompute(p.cache, p.model, p.probing)


def run_config(p: Pending) -> None:
    """The contract the layers below read, built from what is checked so far (the task's checks read it)."""
    c, v = p.c, p.values
    p.run = RunConfig(
        cache=p.cache,
        task=Section(c["task"]),
        model=Section(c["model"]),
        logger=Section(c["logger"]),
        calibration=Section(calibration_settings.settings(c["calibration"])),
        precision=Section(precision_settings.settings(c["precision"])),
        **v,
        device=c["device"],
        data_dir=p.data_dir,
        run_name=c.get("run_name"),
        experiment_name=c.get("experiment_name"),
        model_source=p.model,
        facts=p.facts,
        resolved=Section(c),
    )


def task_options(p: Pending) -> None:
    """The task's options, read by `positions` next; no file is read."""
    p.task.check_options(p.run)


def task_inputs(p: Pending) -> None:
    """The task's data files parsed and counted (a text tokenized), `limit` against what they hold."""
    p.task.check_data(p.run, p.data_dir)


def positions(p: Pending) -> None:
    """The task's longest sequence against the model's context."""
    p.task.check_positions(p.run.task, p.facts.context if p.facts is not None else None, f"model={p.model}")


def prompt(p: Pending) -> None:
    """A policy that means the prompt quantized (`policy=fakequant`, KIVI Table 1) on a task whose prompt's forward
    would not read the quantized cache (`Task.prompt_prefill`): refused, so the record never names a method that did
    not run."""
    if not p.cache.token_policy().quantizes_prompt:
        return
    got = p.task.prompt_prefill(p.run.task, p.cache)
    if got != "quantized":
        what = "runs no prompt through the cache" if got is None else f"hands the cache the prompt's {got} K/V"
        raise ConfigError(
            f"policy={p.cache.policy} quantizes the prompt (KIVI Table 1), and task={p.task.name} {what}: use "
            "policy=kivi"
        )


def model_files(p: Pending) -> None:
    """Group tiling and transforms against the head dim, per-layer bits against the layer count, a search budget,
    the calibration and sensitivity texts against the model's tokenizer."""
    c = p.c
    dt = c["model"].get("dtype") or "float32"
    args = (p.cache, p.model, p.facts, c["calibration"], c["precision"], p.data_dir, c["task"] or None, dt)
    against_model.check_against_model(*args)


def backend(p: Pending) -> None:
    """The backend `auto` stands for (records name it)."""
    p.cache = against_model.resolve_backend(p.cache, p.facts)
    if p.run is not None:
        p.run = replace(p.run, cache=p.cache)


# --- the order, once -----------------------------------------------------------------------------------------------

RUN: tuple[Check, ...] = (
    renamed, known_keys, cache, device, dtype, precision, calibration, run_values, search_settings, logger, probes,
    task, source, facts, layers, features, recompute, run_config, task_options, positions, task_inputs, prompt,
    model_files, backend,
)  # fmt: skip
# lm-eval's `kvq` model: no run settings, no task (lm-eval's own), no fit settings (calibration's defaults)
LMEVAL: tuple[Check, ...] = (renamed, cache, device, dtype, source, facts, layers, recompute, model_files, backend)


def preflight(p: Pending, checks: tuple[Check, ...]) -> Pending:
    """Run `checks` in order on `p`; the first reason raises (one-line ConfigError). -> p, resolved."""
    for check in checks:
        check(p)
    return p
