"""The paper's numbers (KIVI, Liu et al., ICML 2024, arXiv 2402.02750) as data, for "paper" columns.

Copied from ANCHORS.md of the shared folder beside the checkout (../shared/ANCHORS.md). CoQA and GSM8K are exact
match in %, TruthfulQA is BLEU (lm-eval `truthfulqa_gen` bleu_max). `paper_values(config)` maps one of our resolved
run configs to the paper's row for the same quantizer setting, or {} when the paper has no such row.
"""

from __future__ import annotations

from kvq_lab.cache.modes import MODES
from kvq_lab.common.spellings import current

SOURCE = "KIVI (Liu et al., ICML 2024), Table 1 / Table 5"
BENCHMARKS = ("CoQA", "TruthfulQA", "GSM8K")
# our task -> the paper's benchmark column it corresponds to
TASK_TO_BENCHMARK = {"coqa": "CoQA", "coqa_turns": "CoQA", "truthfulqa_gen": "TruthfulQA", "gsm8k": "GSM8K"}

# Table 1: fake quant of every cached token, G=32, no fp window. Row key: (key bits, value bits, K axis, V axis);
# 16-bit rows ignore the axes. Values: (CoQA, TruthfulQA, GSM8K).
TABLE1: dict[str, dict[tuple, tuple[float, float, float]]] = {
    "Llama-2-13B": {
        (16, 16, None, None): (66.37, 29.53, 22.67),
        (4, 4, "token", "token"): (66.48, 29.51, 20.92),
        (2, 2, "channel", "token"): (63.53, 28.60, 12.21),
        (2, 2, "token", "token"): (52.93, 24.98, 4.55),
        (2, 2, "channel", "channel"): (2.88, 0.74, 0.00),
        (2, 2, "token", "channel"): (2.80, 0.26, 0.08),
    },
    "Llama-2-7B": {
        (16, 16, None, None): (63.88, 30.76, 13.50),
        (4, 4, "token", "token"): (64.82, 29.85, 12.28),
        (2, 2, "channel", "token"): (59.08, 33.10, 5.76),
        (2, 2, "token", "token"): (39.88, 18.29, 0.83),
        (2, 2, "channel", "channel"): (3.60, 0.27, 0.00),
        (2, 2, "token", "channel"): (1.30, 0.49, 0.08),
    },
}
# KIVI-2: the real cache, 2-bit, K per-channel, V per-token, G=32, R=128.
KIVI2 = {"Llama-2-13B": (66.23, 29.84, 20.77), "Llama-2-7B": (63.05, 33.95, 12.74)}
# Table 5 (Llama-2-13B, KIVI-2, GSM8K): group size at R=128, residual length at G=32.
TABLE5_GROUP = {32: 20.77, 64: 21.00, 128: 17.29}
TABLE5_RESIDUAL = {32: 20.62, 64: 19.86, 96: 20.55, 128: 20.77}

DEFAULT_MODEL = "Llama-2-13B"


def _bits(config: dict) -> tuple[int, int]:
    if config.get("bits") is not None:
        return int(config["bits"]), int(config["bits"])
    return int(config.get("key_bits", 16)), int(config.get("value_bits", 16))


def _axis(config: dict, name: str) -> str:
    return {"token": "T", "channel": "C"}[config.get(name, "token")]


def _nonint(config: dict) -> list[str]:
    """What puts a setting outside KIVI's recipe besides the knobs above: code formats other than `int` and
    transforms other than rope_pre (the field names of `report.cache_fields`)."""
    out = []
    for t in ("key", "value"):
        fmt = config.get(f"{t}_format", "int")
        if fmt != "int":
            out.append(f"{t}s {fmt}")
        extra = [x for x in config.get(f"{t}_transform") or () if x != "rope_pre"]
        if extra:
            out.append(f"{t}s {'+'.join(extra)}")
    return out


def row_name(config: dict) -> str:
    """The paper's way of naming a setting: `16bit`, `4bit (K-T, V-T)`, `2bit (K-C, V-T)`, `K3/V2 (K-C, V-T)`.
    `config`: the cache fields of a record (`report.cache_fields`) or a run config's flat knobs."""
    kb, vb = _bits(config)
    if kb >= 16 and vb >= 16:
        name = "16bit"
    else:
        bits = f"{kb}bit" if kb == vb else f"K{kb}/V{vb}bit"
        name = f"{bits} (K-{_axis(config, 'key_axis')}, V-{_axis(config, 'value_axis')})"
    extras = []
    if _caps(config, "stores_kv") and _caps(config, "residual_window"):  # KIVI's real cache: K/V, an exact window
        extras.append(f"real cache R={current(config).get('exact_window', 0)}")
    if config.get("group_size", 32) != 32:
        extras.append(f"G={config.get('group_size')}")
    if config.get("rope") == "pre":
        extras.append("pre-RoPE keys")
    if config.get("sink_tokens"):
        extras.append(f"{config['sink_tokens']} sinks")
    extras += _nonint(config)
    return name + (f", {', '.join(extras)}" if extras else "")


def paper_values(config: dict, model: str = DEFAULT_MODEL) -> dict[str, float]:
    """{benchmark: value} for the paper row matching `config` (a resolved run config), or {} when there is none."""
    kb, vb = _bits(config)
    ka, va = config.get("key_axis"), config.get("value_axis")
    g, r = config.get("group_size", 32), current(config).get("exact_window", 0)
    plain = config.get("rope", "post") == "post" and not config.get("sink_tokens") and not _nonint(config)
    if not plain:
        return {}
    if _caps(config, "fake_quant"):
        if g != 32 and not (kb >= 16 and vb >= 16):
            return {}
        key = (16, 16, None, None) if kb >= 16 and vb >= 16 else (kb, vb, ka, va)
        row = TABLE1[model].get(key)
        return dict(zip(BENCHMARKS, row, strict=True)) if row else {}
    if (kb, vb, ka, va) != (2, 2, "channel", "token"):
        return {}
    out: dict[str, float] = {}
    if g == 32 and r == 128:
        out.update(zip(BENCHMARKS, KIVI2[model], strict=True))
    if model == "Llama-2-13B":
        if r == 128 and g in TABLE5_GROUP:
            out["GSM8K"] = TABLE5_GROUP[g]
        if g == 32 and r in TABLE5_RESIDUAL:
            out["GSM8K"] = TABLE5_RESIDUAL[r]
    return out


def _caps(config: dict, name: str) -> bool:
    """Capability `name` (`kvq_lab.cache.modes.Capabilities`) of the config's mode (unset: simulated); False for a
    mode this code does not know."""
    return getattr(MODES.get(config.get("mode", "simulated")), name, False)
