"""Does llama.cpp's quantized query explain its larger KL on unrotated 4-bit keys?

llama.cpp's CPU flash attention reads a quantized K cache with the key type's dot product, which takes the query
converted to q8_0 (q8_1 for q4_1/q5_1: the same values) in blocks of 32 along the head dim; kvq_lab's simulated
attention multiplies the fp32 query with the dequantized keys. This runs kvq_lab's fidelity rows on the chunks
protocol twice, with the query as it is and with it rounded through kvq_lab's q8_0 format (ggml's exact arithmetic)
just before attention (the 16-bit reference untouched), and writes checks/query_q8_0.json.

    python experiments/llama_cpp_parity/query_q8_0.py [--n-ctx 512] [--quant llamacpp_q4_0 ...] [--k-only] [--q8-only]
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CALLS = [0]  # attention calls whose query went through q8_0
KEEP = ("kl_mean", "kl_mean_unc", "ln_ppl_ratio", "ln_ppl_ratio_unc", "top1_agree")


def q8_0(x):
    """x [B, H, T, D] through q8_0 in blocks of 32 along D (D a multiple of 32), back in x's dtype."""
    from kvq_lab.quant import QuantSpec
    from kvq_lab.quant.reference import fake_quant

    CALLS[0] += 1
    return fake_quant(x.float(), QuantSpec(8, 32, "token", format="q8_0")).to(x.dtype)


@contextmanager
def quantized_query(active: list[bool]):
    """Within the block, every `sdpa` attention call sees its query through q8_0 while active[0] is true."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registry = ALL_ATTENTION_FUNCTIONS
    original = registry._global_mapping["sdpa"]

    def attention(module, query, key, value, attention_mask, **kwargs):
        return original(module, q8_0(query) if active[0] else query, key, value, attention_mask, **kwargs)

    registry["sdpa"] = attention
    try:
        yield
    finally:
        del registry["sdpa"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--quant", nargs="+", default=["llamacpp_q4_0", "llamacpp_q4_1"])
    ap.add_argument("--k-only", action="store_true", help="values kept at 16 bits (llama.cpp's -ctv f16)")
    ap.add_argument("--q8-only", action="store_true", help="only the q8_0-query runs (the fp32 ones are the study's)")
    ap.add_argument("--out", default=str(HERE / "checks" / "query_q8_0.json"))
    args = ap.parse_args()
    from hydra import compose, initialize_config_dir

    from kvq_lab.run.config import register_schema
    from kvq_lab.run.runner import run
    from kvq_lab.tasks import fidelity

    register_schema()
    active = [False]
    reference = fidelity.reference_chunk_logprobs

    def exact_reference(*a, **k):  # the 16-bit reference keeps the exact query
        was, active[0] = active[0], False
        try:
            return reference(*a, **k)
        finally:
            active[0] = was

    fidelity.reference_chunk_logprobs = exact_reference
    rows = []
    out = Path(args.out)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None), quantized_query(active):
        for quant in args.quant:
            for q8 in (True,) if args.q8_only else (False, True):
                overrides = [
                    "experiment=llama_cpp_parity",
                    f"quant={quant}",
                    f"task.n_ctx={args.n_ctx}",
                    "logger=none",
                    "resume=false",
                    f"results_dir={out.parent / 'query_q8_0_runs'}",
                ]
                if args.k_only:
                    overrides += ["format=null", f"key_format={quant.removeprefix('llamacpp_')}", "value_bits=16"]
                cfg = compose(config_name="config", overrides=overrides)
                active[0], CALLS[0] = q8, 0
                m = {k.split("/")[1]: v for k, v in run(cfg).items()}
                row = {"quant": quant, "k_only": args.k_only, "query": "q8_0" if q8 else "fp32", "n_ctx": args.n_ctx}
                row["quantized_attention_calls"] = CALLS[0]
                row.update({k: m[k] for k in KEEP})
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
    prev = json.loads(out.read_text()) if out.is_file() else []
    keep = [r for r in prev if not any((r["quant"], r["k_only"], r["query"], r["n_ctx"]) ==
                                       (n["quant"], n["k_only"], n["query"], n["n_ctx"]) for n in rows)]  # fmt: skip
    out.write_text(json.dumps(keep + rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
