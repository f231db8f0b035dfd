"""Table of experiments/recompute from its run records (python -m kvq_lab.report recompute).

Rows: recompute (bits x rank) and the packed KV cache (bits), with decode ppl and the bytes each stores per token
and layer, measured with the cache's own nbytes() after a prefill of TOKENS tokens (the ppl windows' length) on
SmolLM2, and the same as bits per K/V element (2 x 3 KV heads x 64 = 384 K/V values per token and layer).

The bytes are measured on the model's first decoder layer alone (the model cut to it, logits of the last position
only): every layer of SmolLM2 has the same shapes and the same cache, and what a layer stores depends on its shapes
and the token count, not on the values, so one layer's bytes per token are every layer's (the whole model, 30x the
work, gave the same table). Records: SmolLM2-135M's decode-ppl runs, read through `kvq_lab.report.study.read` (each
checked against its digest); the newest completed record of a cache wins.
"""

from __future__ import annotations

from pathlib import Path

from kvq_lab.common.spellings import current
from kvq_lab.report.studies.frame import frame
from kvq_lab.report.study import read

MODELS = ("smollm2-135m",)
TOKENS = 768  # the ppl windows' length (512 prefilled + 256 scored): where the bytes are counted


def records(folder: Path) -> list[dict]:
    return read(folder, MODELS, where={"config.task.name": "ppl"})


def one_layer_model():
    """SmolLM2 cut to its first decoder layer (see the module docstring); refuses a model whose layers differ."""
    from kvq_lab.models.loading import load_model

    model, _ = load_model(MODELS[0])
    cfg = model.config
    shapes = {tuple(p.shape for p in layer.self_attn.parameters()) for layer in model.model.layers}
    if len(shapes) != 1 or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]):
        raise SystemExit("recompute: the model's layers differ; one layer's bytes do not stand for all")
    model.model.layers = model.model.layers[:1]
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    return model


def tables(recs: list[dict], model=None, tokens: int = TOKENS) -> dict[str, str]:
    """{file name here: its text}: table.md (`model`: `one_layer_model()`, made here when not given)."""
    import torch

    from kvq_lab.cache import CacheConfig, QuantizedKVCache
    from kvq_lab.models.loading import cache_kwarg
    from kvq_lab.quant.spec import QuantSpec

    model = model or one_layer_model()
    L = model.config.num_hidden_layers
    rows = {}
    for r in recs:
        if "ppl/ppl" not in r["metrics"]:
            continue
        cc = current(r["cache_config"])  # records written before exact_window was renamed say residual_length
        k, v = cc["key"], cc["value"]
        cfg = CacheConfig(
            key=QuantSpec(k["bits"], k["group_size"], k["axis"], k["format"]),
            value=QuantSpec(v["bits"], v["group_size"], v["axis"], v["format"]),
            mode=cc["mode"],
            exact_window=cc["exact_window"],
            sink_tokens=cc["sink_tokens"],
            recompute_rank=cc.get("recompute_rank"),
            backend="torch",
        )
        rows[cfg.label()] = (cfg, r["metrics"]["ppl/ppl"])
    out = [
        "| cache | mode | bits | rank | bytes / token / layer | bits per K/V element | decode ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    ids = torch.randint(3, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    res = []
    for label, (cfg, ppl) in rows.items():
        cache = QuantizedKVCache.for_model(model, cfg)
        with torch.no_grad():
            model(ids, **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1)
        nb = cache.nbytes()
        per_tok = nb["stored"] / (tokens * L)
        bits = 8 * nb["stored"] / (nb["fp16"] / 2)
        rank = "-" if cfg.caps.stores_kv else cfg.recompute_rank  # a rank only where X is stored
        cells = [f"`{label}`", cfg.mode, cfg.key.bits, rank or "X (576)", f"{per_tok:.0f}", f"{bits:.2f}", f"{ppl:.2f}"]
        res.append((bits, "| " + " | ".join(map(str, cells)) + " |"))
    out += [line for _, line in sorted(res, key=lambda t: t[0])]
    return {"table.md": "\n".join(out) + "\n"}


def rows(recs: list[dict]):
    """One line per decode-ppl record: its cache, mode, bits, rank and perplexity (the bytes need the model: tables)."""
    return frame(
        {"cache": r["cache"], "mode": r["cache_config"]["mode"], "bits": r["cache_config"]["key"]["bits"],
         "rank": r["cache_config"].get("recompute_rank"), "ppl": r["metrics"]["ppl/ppl"]}
        for r in recs if "ppl/ppl" in r["metrics"]
    )  # fmt: skip
