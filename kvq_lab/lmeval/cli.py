"""The `kvq` model for lm-eval's own command line: QuantCacheLM built from `--model_args`.

    kvq-lm-eval run --model kvq --model_args pretrained=smollm2-135m,key_axis=channel,value_axis=token,bits=2 \
        --tasks coqa_turns --include_path kvq_lab/lmeval/yaml --limit 20
    python -m kvq_lab.lmeval.cli run --model kvq ...            (the same)

`pretrained` takes what `model.path` takes (registry names such as `smollm2-135m`, hub ids, folders, GGUF files);
every cache knob of run.py is a model arg (key_axis, value_axis, bits, key_bits, value_bits, group_size,
exact_window, sink_tokens, rope, mode, backend), with run.py's defaults, validated by run.py's preflight
(`kvq_lab.preflight`, in the same order), so a bad value gets the same one-line error before the model loads; on
the command line (`kvq-lm-eval`, and `lm_eval` with the plugin hook) before lm-eval even reads its tasks
(`check_cli`). So is `recompute.rank`, spelled as run.py spells it (mode=recompute: cache X's projection on r
singular vectors; not given, or None: X itself), checked against the model's config.json before its weights load,
as run.py checks it:

    kvq-lm-eval run --model kvq --model_args pretrained=smollm2-135m,mode=recompute,bits=4,recompute.rank=384 ...

Registration: importing this module registers `kvq` in lm-eval's model registry. lm-eval 0.4.x discovers no
out-of-tree models (no entry-point group; EleutherAI/lm-evaluation-harness#1457, #3282), so plain `lm_eval --model
kvq` cannot find it; `kvq-lm-eval` (pyproject's console script) and `python -m kvq_lab.lmeval.cli` are lm-eval's CLI
with this module imported first. Programmatic use: `import kvq_lab.lmeval.cli` then `lm_eval.simple_evaluate(
model="kvq", model_args=...)`.
"""

from __future__ import annotations

import logging

from kvq_lab import preflight
from kvq_lab.cache.knobs import CACHE_KNOBS
from kvq_lab.common.errors import ConfigError
from kvq_lab.common.spellings import RENAMED
from kvq_lab.fit.calibration_settings import data_dir_from_env
from kvq_lab.lmeval.wrapper import QuantCacheLM

log = logging.getLogger("kvq_lab")
MODEL_ARGS = ("pretrained", "dtype", "device", "revision", "batch_size", "max_batch_size", "max_length", "prefix_reuse")
RECOMPUTE_RANK = "recompute.rank"  # run.py's `recompute.rank`, one model arg (lm-eval passes it as a kwarg name)


def _device(device: str | None) -> str:
    """lm-eval's CLI passes `cuda:0` when --device is not given; like its HF model, fall back to the CPU (with a
    warning) when CUDA is absent. None: CUDA when present, else the CPU."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("kvq: device=%s but this machine has no CUDA device; running on the CPU", device)
        return "cpu"
    return str(device)


def knob_config(args: dict) -> dict:
    """model_args (cache knobs and `recompute.rank` only) -> the same keys as run.py's config."""
    args = dict(args)
    rank = args.pop(RECOMPUTE_RANK, None)
    return {**args, "recompute": {"rank": rank}}


def cache_from_args(args: dict):
    """model_args (cache knobs and `recompute.rank` only) -> CacheConfig, with run.py's defaults for the knobs not
    given."""
    return preflight.cache_config(knob_config(args))


def check_model_args(
    pretrained: str = "smollm2-135m",
    dtype: str = "float32",
    device: str | None = None,
    revision: str | None = None,
    batch_size: int | str = 1,
    prefix_reuse: bool = True,
    **knobs,
):
    """Every check `KvqLM` makes before it loads anything -> (cache config, model name, device): lm-eval's own model
    args, then run.py's preflight less the run's own settings (`kvq_lab.preflight.LMEVAL`, one-line ConfigError).
    Also run on lm-eval's command line before lm-eval reads its tasks (`check_cli`)."""
    knobs = {k: v for k, v in knobs.items() if k not in ("max_batch_size", "max_length")}
    unknown = sorted(set(knobs) - {*CACHE_KNOBS, RECOMPUTE_RANK, *RENAMED})  # renamed: the preflight names the new
    if unknown:
        allowed = ", ".join((*MODEL_ARGS, *CACHE_KNOBS, RECOMPUTE_RANK))
        raise ConfigError(f"model arg {unknown[0]!r} is not a kvq setting; model args: {allowed}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be an integer >= 1 (kvq does not size batches itself)")
    if not isinstance(prefix_reuse, bool):
        raise ConfigError(f"prefix_reuse={prefix_reuse!r} must be true or false")
    device = _device(device)
    model = {"path": str(pretrained), "dtype": dtype, "revision": revision}
    c = {**knob_config(knobs), "device": device, "model": model}
    c.update({s: {} for s in preflight.SECTIONS if s != "model"})  # calibration's and precision's defaults, no task
    p = preflight.Pending(c, source_arg="pretrained", data_dir=data_dir_from_env())
    preflight.preflight(p, preflight.LMEVAL)
    return p.cache, p.model, device


def check_cli(argv: list[str]) -> None:
    """lm-eval's command line with `--model kvq`: the model args checked before lm-eval reads its task index (which
    takes ~20 s), so a bad one is one line (`error: ...`, exit status 2), not a traceback after the wait."""
    if "kvq" not in " ".join(argv):
        return
    import sys

    from lm_eval._cli.harness import HarnessCLI

    saved = list(sys.argv)
    try:
        sys.argv = list(argv)
        args = HarnessCLI().parse_args()
    finally:
        sys.argv = saved
    if getattr(args, "model", None) != "kvq":
        return
    try:
        check_model_args(**(args.model_args or {}), **({"device": args.device} if args.device else {}))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


class KvqLM(QuantCacheLM):
    """lm-eval model `kvq`: loads `pretrained` as run.py does and hands every generate call a fresh cache built
    from the cache knobs among the model args."""

    def __init__(
        self,
        pretrained: str = "smollm2-135m",
        dtype: str = "float32",
        device: str | None = None,
        revision: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        prefix_reuse: bool = True,
        **knobs,
    ):
        from kvq_lab.cache import QuantizedKVCache
        from kvq_lab.models.loading import load_model

        cache, name, device = check_model_args(pretrained, dtype, device, revision, batch_size, prefix_reuse, **knobs)
        model, tok = load_model(name, dtype=dtype, device=device)
        from kvq_lab.fit.calibration import calibrate

        # fitted methods (nuq, outliers, innerq, rotatekv): calibration's defaults (GSM8K train), as run.py fits them
        cache = calibrate(model, tok, cache, None, data_dir_from_env(), name)
        QuantizedKVCache.for_model(model, cache)  # fail now (e.g. group size vs head dim), not at the first generate
        super().__init__(
            model,
            tok,
            lambda: QuantizedKVCache.for_model(model, cache),
            batch_size=batch_size,
            max_length=max_length,
            prefix_reuse=prefix_reuse,
        )
        self.cache_config = cache

    def get_model_info(self) -> dict:
        from dataclasses import asdict

        return {
            **super().get_model_info(),
            "kvq_cache": self.cache_config.label(),
            "kvq_cache_config": asdict(self.cache_config),
        }


def register() -> None:
    """Register `kvq` in lm-eval's model registry (idempotent)."""
    import lm_eval.models  # noqa: F401  (lm-eval's own placeholders first: an empty registry is what triggers them)
    from lm_eval.api.registry import model_registry

    if "kvq" in model_registry.keys():  # e.g. the placeholder of the lm_eval_plugin hook: it resolves to this class
        return
    model_registry.register("kvq", target=KvqLM)


register()


def main() -> None:
    """lm-eval's command line with `kvq` registered (console script `kvq-lm-eval`); kvq's model args are checked
    first (`check_cli`)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    check_cli(sys.argv)
    cli_evaluate()


if __name__ == "__main__":
    main()
