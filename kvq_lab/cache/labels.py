"""A cache config's short name in tables and run names (`CacheConfig.label`): the quantizers, the mode and what differs
from the defaults, e.g. `K2b-C32_V2b-T32_sim`, `K2b-T32_V2b-T32_pac_R32_preRoPE_Khad`."""

from __future__ import annotations

from kvq_lab.quant.transforms import get_transform


def label(cfg) -> str:
    """`cfg`'s label (a validated `CacheConfig`: a string `skip_layers` is `sliding_window`)."""
    extra = f"_R{cfg.exact_window}" if cfg.caps.residual_window else ""
    extra += {None: "", "exact": "_Pexact", "quantized": "_Pquant"}[cfg.prefill]
    extra += f"_r{cfg.recompute_rank}" if cfg.recompute_rank is not None else ""
    extra += f"_S{cfg.sink_tokens}" if cfg.sink_tokens else ""
    extra += "_preRoPE" if cfg.rope == "pre" else ""
    for tag, spellings in (("K", cfg.key_transform), ("V", cfg.value_transform)):
        # rope_pre shows as `_preRoPE` above, the label rope=pre has always had
        shown = [get_transform(s).label for s in spellings if s != "rope_pre"]
        extra += f"_{tag}{'+'.join(shown)}" if shown else ""
    for tag, f in (("K", cfg.key_outliers), ("V", cfg.value_outliers)):
        extra += f"_{tag}out{f:g}" if f else ""
    if cfg.skip_layers:
        skip = cfg.skip_layers
        shown = "SW" if isinstance(skip, str) else "-".join(map(str, skip)) if len(skip) <= 3 else f"{len(skip)}L"
        extra += f"_skip{shown}"
    for tag, chain in (("K", cfg.residual("key")), ("V", cfg.residual("value"))):
        extra += f"_{tag}{'+'.join(r.label for r in chain.residuals)}" if chain else ""
    if cfg.policy != "kivi":  # the default goes unnamed, as do options at their defaults
        defaults = dict(type(cfg.token_policy())().options())  # options at their defaults go unnamed
        shown = [f"-{k}{_short(v)}" for k, v in cfg.policy_options if defaults.get(k) != v]
        extra += f"_{cfg.policy}" + "".join(shown)
    if not cfg.caps.stores_kv:  # one tensor, X, under the key quantizer
        return f"X{cfg.key.short()}_{cfg.mode[:3]}{extra}"
    return f"K{cfg.key.short()}_V{cfg.value.short()}_{cfg.mode[:3]}{extra}"


def _short(v) -> str:
    """A policy option's value in a label: 0.5 -> 0.5, None -> null."""
    return "null" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
