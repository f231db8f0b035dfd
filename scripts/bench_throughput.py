"""Decode throughput at equal cache memory: how many sequences fit a budget, and how many tokens/s they then produce.

    python scripts/bench_throughput.py                                   # SmolLM2-135M, 2 GiB, 4096 and 8192 tokens
    python scripts/bench_throughput.py --budget 8GiB --lengths 8192 --dtypes fp32 bf16 --json throughput.json
    python scripts/bench_throughput.py --quick                           # a smoke run: 256 tokens, 64 MiB, 4 steps

For each model dtype, context length L and cache, side by side in one process:
1. bytes per sequence: one sequence's cache after a prefill of L - 1 tokens and `--new-tokens` decode steps, as the
   cache counts itself (`nbytes()` for ours, every tensor held for the others: bench_cache.cache_bytes);
2. batch: the largest B with B x those bytes <= `--budget` (`--max-batch` caps it); the batched cache's own bytes
   are measured again at the end of the run and the row says whether they fit (`fits`);
3. prefill (`--prefill tile`, the default): the prompt's exact prefill (a DynamicCache forward of L - 1 tokens, batch
   1) is handed to a fresh cache as B identical rows, one layer at a time (KIVI's real cache: exact prefill, then
   quantized), timed (`quantize_s`); the forward is timed once at batch 1 (`prefill_forward_s`): prefill compute is
   linear in the rows, and a real batch-B forward of 8K-token prompts would take hours on a 2-core CPU. The prefill
   throughput shown is B (L - 1) / (B x prefill_forward_s + quantize_s). `--prefill full` prefills B prompts of
   mixed length (left-padded, as bench_cache's batch) through the cache inside `generate` instead (GPUs, small runs);
4. decode: `model.generate` from the filled cache (the last prompt token, then `--new-tokens` greedy steps; EOS
   ignored); each step timed by a logits processor; aggregate decode tokens/s = B / median step time, per-sequence
   = 1 / median step; peak RSS of the process while the cache existed (sampled every 20 ms).
Caches: DynamicCache (the baseline of `ratio`), transformers' QuantizedCache with quanto (2-bit, G, R; its default
axes), ours packed (auto backend: the C kernel on CPU, Triton on CUDA) int2 K-C/V-T, rope=post and rope=pre, int4
K-C/V-T and FP8 E4M3 K-C/V-T, all G=32, R=128. `--only` picks caches by label substring (DynamicCache always runs).
A progress bar (stderr) counts the caches measured. Rows of one (dtype, L) run one after the other; `--repeats` runs
each decode again from a freshly filled cache, and the median over all timed steps of all repeats is reported (the
spread, min and max of the per-repeat medians, beside it).

`--json PATH` writes {"rows": [...], "code": ..., "argv": [...], "budget_bytes": ...}, one row per (dtype, length,
cache): kind, label, dtype, length, batch, bytes_per_seq, cache_bytes (the batch's, measured), fits, decode_tok_s,
per_seq_tok_s, step_s (median), step_s_min, step_s_max (per-repeat medians), ratio (decode_tok_s / DynamicCache's),
batch_ratio (batch / DynamicCache's), prefill_forward_s, quantize_s, prefill_tok_s, peak_rss_bytes, same_tokens (every
row generated what batch 1 generates through the same cache; null with --prefill full), curve ([batch, aggregate
tok/s] pairs: with --curve the powers of two below the batch, one repeat each, then the batch itself).

Arguments are checked before the model loads, each in one line with exit status 2: a budget of at least one byte,
positive counts, and lengths from 2 tokens up to what the model's positions hold with the decode steps after them.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, QuantizedCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cache import TEXT, batch_prompt, cache_bytes, clock  # noqa: E402  (the sibling benchmark's helpers)
from cli_args import Parser, at_least, fail, within_model  # noqa: E402

from kvq_lab.cache import CacheConfig, QuantizedKVCache  # noqa: E402
from kvq_lab.cache.routing.backends import get_backend  # noqa: E402
from kvq_lab.models.loading import cache_kwarg, load_model  # noqa: E402
from kvq_lab.quant.spec import QuantSpec  # noqa: E402
from kvq_lab.records.provenance import code_version  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '2g', '1048576' -> bytes (binary units); at least one byte."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"--budget {text!r}: write a size such as 2GiB, 512MiB or 1073741824")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n < 1:
        raise argparse.ArgumentTypeError(f"--budget {text!r} holds no byte: a budget is more than 0, e.g. 2GiB")
    return n


def check_args(args) -> None:
    """Every argument the run depends on, before the model loads (one line, exit status 2 on the first bad one):
    counts that must be positive, and the lengths against the positions the model has (its files, read without
    loading: a context of L tokens and N decode steps feed L + N - 1 positions)."""
    at_least(args, repeats=1, max_batch=1, threads=1, new_tokens=2, warmup=0)
    if args.warmup >= args.new_tokens - 1:
        fail(f"--warmup {args.warmup} leaves no timed step of --new-tokens {args.new_tokens}: lower --warmup")
    # 2 tokens at least: L - 1 prefilled into the cache, the last one starts the decode
    within_model(args.model, args.lengths, args.new_tokens, shortest=2)


@dataclass
class Cache:
    """One cache of the benchmark: its name, kind and a factory of fresh (empty) caches."""

    kind: str
    label: str
    make: Callable


def make_caches(model, G: int = 32, R: int = 128) -> list[Cache]:
    auto = get_backend("auto").name

    def ours(bits: int, fmt: str = "int", rope: str = "post"):
        k, v = QuantSpec(bits, G, "channel", format=fmt), QuantSpec(bits, G, "token", format=fmt)
        cfg = CacheConfig(key=k, value=v, mode="packed", exact_window=R, backend="auto", rope=rope)
        return lambda: QuantizedKVCache.for_model(model, cfg)

    hf = dict(nbits=2, q_group_size=G, residual_length=R, axis_key=0, axis_value=0)
    return [
        Cache("dynamic", "DynamicCache", lambda: DynamicCache(config=model.config)),
        Cache("quanto", f"HF quanto 2b G{G} R{R}", lambda: QuantizedCache("quanto", model.config, **hf)),
        Cache("ours_packed", f"ours packed 2b K-C V-T G{G} R{R} ({auto})", ours(2)),
        Cache("ours_packed", f"ours packed 2b K-C V-T G{G} R{R} preRoPE ({auto})", ours(2, rope="pre")),
        Cache("ours_packed", f"ours packed 4b K-C V-T G{G} R{R} ({auto})", ours(4)),
        Cache("ours_packed", f"ours packed fp8_e4m3 K-C V-T G{G} R{R} ({auto})", ours(8, "fp8_e4m3")),
    ]


class StepClock(LogitsProcessor):
    """Called by generate once per step, after that step's forward: the times between calls are the step times."""

    def __init__(self, device: torch.device):
        self.device, self.marks = device, []

    def __call__(self, input_ids, scores):
        self.marks.append(clock(self.device))
        return scores


class PeakRSS:
    """The process's largest resident set size while the block runs (sampled every 20 ms by a thread)."""

    def __enter__(self):
        self.proc, self.peak, self.done = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self.done.wait(0.02)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


@torch.no_grad()
def exact_prefill(model, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """ids [1, T] -> per-layer exact (keys, values) [1, H_kv, T, D] of a DynamicCache forward, and its seconds."""
    dyn = DynamicCache()
    t0 = clock(model.device)
    model(input_ids=ids, **{cache_kwarg(): dyn}, use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in dyn.layers], clock(model.device) - t0


@torch.no_grad()
def tiled(make: Callable, kv, batch: int):
    """A fresh cache holding `kv` (one sequence's exact prefill) as `batch` identical rows, filled layer by layer
    (the batch's exact K/V of all layers never exist at once); -> (cache, seconds)."""
    cache = make()
    t0 = clock(kv[0][0].device)
    for i, (k, v) in enumerate(kv):
        cache.update(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous(), i, {})
    return cache, clock(kv[0][0].device) - t0


@torch.no_grad()
def decode(model, cache, ids: torch.Tensor, mask: torch.Tensor | None, new_tokens: int) -> tuple[list[float], list]:
    """generate from `cache` (ids [B, L]; the cache holds the first L - 1 positions, or none: then generate prefills
    them, untimed) for `new_tokens` steps -> (step seconds after the first step, generated ids per row)."""
    steps = StepClock(model.device)
    if mask is None:
        mask = torch.ones_like(ids)
    if isinstance(cache, QuantizedKVCache) and cache.get_seq_length() == 0:
        cache.set_padding(mask)
    out = model.generate(
        input_ids=ids, attention_mask=mask, **{cache_kwarg(): cache}, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, logits_processor=LogitsProcessorList([steps]),
        pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    times = [b - a for a, b in zip(steps.marks, steps.marks[1:], strict=False)]
    return times, out[:, ids.shape[1] :].tolist()


def measure(model, c: Cache, ids1, kv, forward_s, L, budget, args) -> dict:
    """One cache at one length: bytes per sequence, the batch that fits, its decode (see the module docstring)."""
    one, _ = tiled(c.make, kv, 1)
    _, tokens1 = decode(model, one, ids1, None, args.new_tokens)
    per_seq = cache_bytes(one)[0]
    del one
    batch = max(1, min(budget // per_seq, args.max_batch or 10**9))
    with PeakRSS() as rss:
        if args.prefill == "tile":
            cache, quantize_s = tiled(c.make, kv, batch)
            ids, mask = ids1.expand(batch, -1), None
        else:
            text = ids1.new_tensor(ids1[0].tolist() * 2)[None]
            ids, mask = batch_prompt(text, L, batch)
            cache, quantize_s = c.make(), float("nan")
        medians, steps, tokens = [], [], None
        for r in range(args.repeats):
            if r:  # a fresh cache, filled again, decoded again from the prompt's end
                cache, _ = tiled(c.make, kv, batch) if args.prefill == "tile" else (c.make(), 0.0)
            times, tokens = decode(model, cache, ids, mask, args.new_tokens)
            timed = times[args.warmup :]
            steps += timed
            medians.append(statistics.median(timed))
        stored = cache_bytes(cache)[0]
        del cache
    curve = []  # aggregate tok/s at smaller batches (powers of two), one repeat each: the figure's lines
    for b in (2**i for i in range(batch.bit_length()) if 2**i < batch) if args.curve and args.prefill == "tile" else ():
        small, _ = tiled(c.make, kv, b)
        times, _ = decode(model, small, ids1.expand(b, -1), None, args.new_tokens)
        curve.append([b, b / statistics.median(times[args.warmup :])])
        del small
    step = statistics.median(steps)
    curve.append([int(batch), batch / step])
    same = all(row == tokens1[0] for row in tokens) if args.prefill == "tile" else None
    prefill_s = batch * forward_s + quantize_s
    return {
        "kind": c.kind, "label": c.label, "length": L, "batch": int(batch), "bytes_per_seq": int(per_seq),
        "cache_bytes": int(stored), "fits": stored <= budget, "decode_tok_s": batch / step, "per_seq_tok_s": 1 / step,
        "step_s": step, "step_s_min": min(medians), "step_s_max": max(medians), "prefill_forward_s": forward_s,
        "quantize_s": quantize_s, "prefill_tok_s": batch * (L - 1) / prefill_s, "peak_rss_bytes": int(rss.peak),
        "same_tokens": same, "curve": curve,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", type=parse_bytes, default=None, help="cache memory budget (default 2GiB)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="context tokens (default 4096 8192)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    ap.add_argument("--new-tokens", type=int, default=None, help="decode steps per repeat (default 16; --quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps of each repeat (default 3; --quick 1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=None, help="cap the batch (default: what the budget holds)")
    ap.add_argument("--prefill", choices=["tile", "full"], default="tile")
    ap.add_argument("--curve", action="store_true", help="also decode at the powers of two below each batch")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of cache labels (DynamicCache always runs)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 256 tokens, 64 MiB, 4 steps, 1 repeat")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    budget = args.budget if args.budget is not None else 64 * 2**20 if args.quick else 2 * 2**30
    lengths = args.lengths = args.lengths or ([256] if args.quick else [4096, 8192])
    args.new_tokens = args.new_tokens if args.new_tokens is not None else 4 if args.quick else 16
    args.warmup = args.warmup if args.warmup is not None else 1 if args.quick else 3
    args.repeats = 1 if args.quick else args.repeats
    check_args(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device}: this machine has no CUDA GPU; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    where = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else platform.processor() or platform.machine()
    given = argv if argv is not None else sys.argv[1:]
    ram = psutil.virtual_memory().total / 2**30
    print(
        f"# {args.model} on {dev} ({where}, {torch.get_num_threads()} threads, {ram:.0f} GiB), torch "
        f"{torch.__version__}; cache budget {budget / 2**30:.3g} GiB; {args.new_tokens} decode steps "
        f"({args.warmup} untimed) x {args.repeats} repeat(s); prefill {args.prefill}\n"
        f"# command: python scripts/bench_throughput.py {shlex.join(given)}\n# code: {code_version()}"
    )
    rows: list[dict] = []
    model = tok = None
    bar = tqdm(desc="caches measured", unit="cache", file=sys.stderr)
    for name in args.dtypes:
        dtype = DTYPES[name]
        if model is None:
            model, tok = load_model(args.model, dtype=dtype, device=dev)
            cache_bytes.text_cfg = model.config.get_text_config(decoder=True)
        model = model.to(dtype)
        caches = make_caches(model)
        if args.only:
            caches = [c for c in caches if c.kind == "dynamic" or any(s in c.label for s in args.only)]
        bar.total = len(args.dtypes) * len(lengths) * len(caches)  # the same caches for every dtype
        bar.refresh()
        text = tok(TEXT * (40 + max(lengths) // 20), return_tensors="pt").input_ids.to(dev)
        for L in lengths:
            ids1 = text[:, :L]
            kv, forward_s = exact_prefill(model, ids1[:, :-1])
            out = []
            for c in caches:
                bar.set_postfix_str(f"{name} {L} tokens: {c.label}")
                try:
                    out.append({"dtype": name, **measure(model, c, ids1, kv, forward_s, L, budget, args)})
                except Exception as e:  # noqa: BLE001  (a cache that does not run here, e.g. quanto's kernels)
                    print(f"  {c.label}: did not run ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                bar.update()
            del kv
            base = next(r for r in out if r["kind"] == "dynamic")
            print(f"\n## {name}, context {L} tokens, budget {budget / 2**30:.3g} GiB\n")
            print("| cache | MiB / seq | batch | x seqs | decode tok/s (min-max) | x Dynamic | tok/s / seq | "
                  "prefill tok/s | peak RSS GiB | fits | same tokens |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for r in out:
                r["ratio"], r["batch_ratio"] = r["decode_tok_s"] / base["decode_tok_s"], r["batch"] / base["batch"]
                lo, hi = r["batch"] / r["step_s_max"], r["batch"] / r["step_s_min"]
                print(
                    f"| {r['label']} | {r['bytes_per_seq'] / 2**20:.1f} | {r['batch']} | {r['batch_ratio']:.1f}x | "
                    f"{r['decode_tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | {r['ratio']:.2f}x | {r['per_seq_tok_s']:.2f} | "
                    f"{r['prefill_tok_s']:.0f} | {r['peak_rss_bytes'] / 2**30:.2f} | {r['fits']} | "
                    f"{r['same_tokens']} |"
                )
            rows += out
    bar.close()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        record = {"rows": rows, "code": code_version(), "argv": list(given), "budget_bytes": budget}
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(args.json)
        print(f"\nwrote {len(rows)} rows to {args.json}")
    return rows


if __name__ == "__main__":
    main()
