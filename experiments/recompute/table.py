"""Table of experiments/recompute from its run records (python experiments/recompute/table.py).

Rows: recompute (bits x rank) and the packed KV cache (bits), with decode ppl and the bytes each stores per token
and layer, measured with the cache's own nbytes() after a prefill of `--tokens` tokens (the ppl windows' length) on
SmolLM2, and the same as bits per K/V element (2 x 3 KV heads x 64 = 384 K/V values per token and layer).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))


def main() -> None:
    import torch

    from kvq_lab.cache import CacheConfig, QuantizedKVCache
    from kvq_lab.models.loading import cache_kwarg, load_model
    from kvq_lab.quant.spec import QuantSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=768, help="prefill length at which bytes are counted")
    args = ap.parse_args()
    model, _ = load_model("smollm2-135m")
    L = model.config.num_hidden_layers
    rows = {}
    for p in sorted((HERE / "runs").glob("*/record.json")):
        r = json.loads(p.read_text())
        if r.get("status") != "ok" or "ppl/ppl" not in r["metrics"]:
            continue
        cc = r["cache_config"]
        k, v = cc["key"], cc["value"]
        cfg = CacheConfig(
            key=QuantSpec(k["bits"], k["group_size"], k["axis"], k["format"]),
            value=QuantSpec(v["bits"], v["group_size"], v["axis"], v["format"]),
            mode=cc["mode"],
            residual_length=cc["residual_length"],
            sink_tokens=cc["sink_tokens"],
            recompute_rank=cc.get("recompute_rank"),
            backend="torch",
        )
        rows[cfg.label()] = (cfg, r["metrics"]["ppl/ppl"])
    out = [
        "| cache | mode | bits | rank | bytes / token / layer | bits per K/V element | decode ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    ids = torch.randint(3, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    res = []
    for label, (cfg, ppl) in rows.items():
        cache = QuantizedKVCache.for_model(model, cfg)
        with torch.no_grad():
            model(ids, **{cache_kwarg(): cache}, use_cache=True)
        nb = cache.nbytes()
        per_tok = nb["stored"] / (args.tokens * L)
        bits = 8 * nb["stored"] / (nb["fp16"] / 2)
        rank = cfg.recompute_rank if cfg.mode == "recompute" else "-"
        cells = [f"`{label}`", cfg.mode, cfg.key.bits, rank or "X (576)", f"{per_tok:.0f}", f"{bits:.2f}", f"{ppl:.2f}"]
        res.append((bits, "| " + " | ".join(map(str, cells)) + " |"))
    out += [line for _, line in sorted(res, key=lambda t: t[0])]
    table = "\n".join(out)
    print(table)
    (HERE / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
