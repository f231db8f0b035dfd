"""Why a prompt prefilled in two pieces can answer differently at 2 bits, though the cache is cut where nothing changes.

    python experiments/kivi_axis_table/prefill_cut.py [--quant 2bit_KC_VT] [--story 0]

One CoQA story prompt (its first turn), simulated cache, SmolLM2: prefill it once, and again in two pieces cut where
the cache allows (`prefix_boundary`, as prefix reuse does). Per layer: the largest difference of the exact (not yet
quantized) keys and values the model produced, the number of integer codes that differ, and how close the
differing elements sit to a rounding boundary in A (|frac((x - zero) / scale) - 0.5|, in steps: 0 = on it). Layer 0
sees the same token embeddings; from then on the model's arithmetic on two shorter GEMMs differs in the last bits,
and each code that flips moves its element by a whole 2-bit step.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.models.loading import cache_kwarg, load_model
from kvq_lab.quant import QuantSpec
from kvq_lab.quant.reference import dequantize, quantize, step_size

QUANT = {  # conf/quant presets used by the axis table
    "2bit_KC_VT": ("channel", "token", 2),
    "2bit_KT_VT": ("token", "token", 2),
    "4bit_KT_VT": ("token", "token", 4),
}


def prompt(story: int) -> str:
    data = Path(os.environ.get("KVQ_DATA_DIR", "../shared/data")) / "coqa/coqa-validation.first20.lm_eval.jsonl"
    doc = json.loads(data.read_text().splitlines()[story])
    return f"{doc['story']}\n\nQ: {doc['questions']['input_text'][0]}\n\nA:"  # lm-eval's CoQA prompt, first turn


def flips(a: torch.Tensor, b: torch.Tensor, spec: QuantSpec) -> tuple[int, float]:
    """(codes that differ between a and b [1, H, T, D], the largest distance to a rounding boundary among them)."""
    qa, qb = quantize(a, spec), quantize(b, spec)
    T = a.shape[2]
    diff = qa.codes[:, :, :T] != qb.codes[:, :, :T]
    if not diff.any():
        return 0, float("nan")
    # int codes are round((x - zero) / scale): per element, zero = dequantize(code 0), scale = step_size
    zero = dequantize(replace(qa, codes=torch.zeros_like(qa.codes), dtype=torch.float32))
    u = (a.float() - zero) / step_size(qa)
    dist = (u - u.floor() - 0.5).abs()
    return int(diff.sum()), float(dist[diff].max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="2bit_KC_VT", choices=sorted(QUANT))
    ap.add_argument("--story", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ka, va, bits = QUANT[args.quant]
    cfg = CacheConfig(key=QuantSpec(bits, 32, ka), value=QuantSpec(bits, 32, va))
    model, tok = load_model("smollm2-135m")
    ids = tok(prompt(args.story), return_tensors="pt").input_ids
    kw = cache_kwarg()
    with torch.no_grad():
        one = QuantizedKVCache.for_model(model, cfg)
        la = model(input_ids=ids, **{kw: one}, use_cache=True).logits[0, -1]
        two = QuantizedKVCache.for_model(model, cfg)
        cut = two.prefix_boundary(ids.shape[1] - 8)
        model(input_ids=ids[:, :cut], **{kw: two}, use_cache=True, logits_to_keep=1)
        lb = model(input_ids=ids[:, cut:], **{kw: two}, use_cache=True).logits[0, -1]
    print(f"{args.quant}, story {args.story}: {ids.shape[1]} prompt tokens, cut at {cut}")
    print("| layer | max abs diff, exact K | max abs diff, exact V | key codes flipped | value codes flipped | "
          "max distance to a rounding boundary of a flipped code (steps) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for i, (a, b) in enumerate(zip(one.layers, two.layers, strict=True)):
        nk, dk = flips(a.keys, b.keys, cfg.key)
        nv, dv = flips(a.values, b.values, cfg.value)
        d = max(x for x in (dk, dv) if x == x) if nk + nv else float("nan")
        dK, dV = (a.keys - b.keys).abs().max().item(), (a.values - b.values).abs().max().item()
        print(f"| {i} | {dK:.1e} | {dV:.1e} | {nk} | {nv} | {d:.1e} |")
    same = int(la.argmax()) == int(lb.argmax())
    print(f"last-position logits: max abs diff {(la - lb).abs().max().item():.3f}; same greedy token: {same}")


if __name__ == "__main__":
    main()
