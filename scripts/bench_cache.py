"""Decode speed and memory of KV caches, side by side, on one model and prompt (CPU or GPU).

    python scripts/bench_cache.py                      # SmolLM2-135M, prompts of 512, 4096 and 8192 tokens
    python scripts/bench_cache.py --json cache_speed.json   # the same, and one JSON object per row
    python scripts/bench_cache.py --quick              # a short smoke run (256 tokens, 1 repeat, 12 new tokens)
    python scripts/bench_cache.py --lengths 512 --repeats 2 --new-tokens 24 --settings fp32-b1
    python scripts/bench_cache.py --device cuda --only "ours packed"   # on a GPU (auto: the Triton kernels)

Settings (`--settings`): the model's dtype and batch. `fp32-b1` (the full comparison), `bf16-b1` (the model in bf16)
and `fp32-b4` (a left-padded batch of 4 prompts of L, 7L/8, 6L/8 and 5L/8 tokens, L the prompt length). Each setting
has its own DynamicCache row, the baseline of its `ratio`.
Caches: DynamicCache (fp), ours packed (2-bit, K per-channel, V per-token, G=32, R=128) with the default backend
(`auto`: the C kernel on CPU, Triton on CUDA) for rope=post and rope=pre, with the pure-PyTorch path
(`backend=torch`), with FP8 E4M3 codes and with lut codes (the format's default codebook; K per-channel, V
per-token, same G and R), and with the hadamard transform on keys and values; ours simulated (same
quantizers, fake quant), ours recompute (XQuant-like: the attention input X projected on `--recompute-rank`
singular vectors of [W_k; W_v], per-channel groups at the same bits, G and R, K and V rebuilt at every step), and
transformers' QuantizedCache with the quanto and hqq backends at the same bits, group size and residual length (their
default axes, 0); the hqq row runs where hqq is installed (`pip install -e ".[hqq]"`, not in the default setup).
The bf16 and batch-4 settings run DynamicCache and ours packed (auto, rope=post and pre).
Caches alternate step by step: every cache of a setting and length is prefilled, then they decode in turn, one step
each, so that load from other processes hits every cache alike (the machine's speed drifts by 10-30% over minutes
here, while a step takes a fraction of a second); the order changes from round to round (`step_orders`: A, B, C, then
B, C, A, ...; every cache at every place and after every other cache equally often), since a fixed order made the
cache right after DynamicCache 3-6% faster than the same cache later in the round; `--repeats` does it again with
fresh caches.

Decode tokens/s: rows per step over the median step time, pooled over the repeats' greedy steps after `--warmup`
steps, each step one forward of one token per row (batch rows count once: a step of batch 4 is 4 tokens), prefill
excluded. Prefill is timed on its own. Peak cache bytes: the
largest size the cache reached during the run (walked tensors, counted once each); "fp16" is the same tokens as an
fp16 K/V cache. For ours packed, "arith" is the size the storage arithmetic predicts from the token counts:
quantized elements at the format's code bits + 16 bits per stored parameter per group of G (int: scale and zero;
fp8: scale), sinks and the windows' fixed buffers (R + R/16 rows each, `streams.spare_rows`) at the model dtype's size,
and rope=pre's position ids (int32).

`--json PATH` writes {"rows": [...], "code": ..., "argv": [...]}: the package's code version
(`kvq_lab.records.provenance.code_version`), the command's arguments, and one object per cache, setting and prompt
length, with the keys kind      dynamic | ours_packed | ours_simulated | ours_recompute | quanto | hqq label     the
row's name in the tables          backend  auto's choice, torch, ... (null: not ours) rope      post | pre
dtype    float32 | bfloat16 (the model's) batch     rows decoded together                 format   int | fp8_e4m3 | lut
(null: DynamicCache) transform hadamard on keys and values, or null length    prompt tokens (the padded length for a
batch) tok_s     decode tokens/s (median step)         ratio    tok_s / DynamicCache's at the same length, dtype, batch
paired_ratio  DynamicCache's step time / this cache's, in the same round, median over rounds (`paired_ratio`)
pre_over_post, paired_pre_over_post  rope=pre rows of ours: tok_s / the rope=post row's, and the same paired; else null
prefill_s seconds (median)                      peak_bytes  the cache's peak bytes (last repeat) measured_over_arith
peak bytes / storage arithmetic (ours packed; else null)"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, QuantizedCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import Parser, at_least, fail, within_model  # noqa: E402  (the scripts' one-line argument errors)

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.cache.routing.backends import get_backend
from kvq_lab.models.loading import cache_kwarg, load_model
from kvq_lab.quant.formats import bits_per_element
from kvq_lab.quant.reference import code_format
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.records.provenance import code_version

# transformers' hqq backend: opt-in (pyproject's `hqq` extra), since installing it slows every transformers import
HQQ = importlib.util.find_spec("hqq") is not None

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made it possible "
    "to reproduce books quickly and cheaply. Within decades, presses spread across Europe, and the number of books "
    "in circulation grew from thousands to millions. Scholars argue about how much this changed the way people "
    "thought, but few doubt that it changed what they could read. "
)


@dataclass
class Row:
    """One cache of the benchmark: its JSON fields and a factory of fresh caches."""

    kind: str
    label: str
    make: Callable
    backend: str | None = None
    rope: str = "post"
    format: str | None = "int"
    transform: str | None = None


SETTINGS = {"fp32-b1": (torch.float32, 1), "bf16-b1": (torch.bfloat16, 1), "fp32-b4": (torch.float32, 4)}


def make_caches(model, bits: int, G: int, R: int, rank: int = 128, full: bool = True) -> list[Row]:
    """The rows of one setting; `full`: every cache (else DynamicCache and ours packed, rope=post and pre)."""
    spec_k, spec_v = QuantSpec(bits, G, "channel"), QuantSpec(bits, G, "token")
    auto = get_backend("auto").name

    def packed(backend="auto", rope="post", k=spec_k, v=spec_v, transform=()):
        cfg = CacheConfig(key=k, value=v, mode="packed", exact_window=R, backend=backend, rope=rope,
                          key_transform=transform, value_transform=transform)  # fmt: skip
        return lambda: QuantizedKVCache.for_model(model, cfg)

    name = f"ours packed {bits}b K-C V-T G{G} R{R}"
    rows = [
        Row("dynamic", "DynamicCache", lambda: DynamicCache(config=model.config), format=None),
        Row("ours_packed", f"{name} ({auto})", packed(), auto),
        Row("ours_packed", f"{name} preRoPE ({auto})", packed(rope="pre"), auto, "pre"),
    ]
    if not full:
        return rows
    fp8_k, fp8_v = (QuantSpec(8, G, ax, format="fp8_e4m3") for ax in ("channel", "token"))
    lut_k, lut_v = (QuantSpec(bits, G, ax, format="lut") for ax in ("channel", "token"))
    simulated = CacheConfig(key=spec_k, value=spec_v, mode="simulated")
    # one tensor (X's projection) under the key quantizer: the value spec must equal it
    recompute = CacheConfig(key=spec_k, value=spec_k, mode="recompute", exact_window=R, recompute_rank=rank)
    hf = dict(nbits=bits, q_group_size=G, residual_length=R, axis_key=0, axis_value=0)
    return rows + [
        Row("ours_packed", f"{name} (torch)", packed("torch"), "torch"),
        Row("ours_packed", f"ours packed fp8_e4m3 K-C V-T G{G} R{R} ({auto})", packed(k=fp8_k, v=fp8_v), auto,
            format="fp8_e4m3"),
        Row("ours_packed", f"ours packed lut {bits}b K-C V-T G{G} R{R} ({auto})", packed(k=lut_k, v=lut_v), auto,
            format="lut"),
        Row("ours_packed", f"{name} hadamard ({auto})", packed(transform=("hadamard",)), auto,
            transform="hadamard"),
        Row("ours_simulated", f"ours simulated {bits}b K-C V-T G{G}",
            lambda: QuantizedKVCache.for_model(model, simulated), "torch"),
        Row("ours_recompute", f"ours recompute {bits}b X-C G{G} R{R} rank {rank} ({auto})",
            lambda: QuantizedKVCache.for_model(model, recompute), auto),
        Row("quanto", f"HF quanto {bits}b G{G} R{R}", lambda: QuantizedCache("quanto", model.config, **hf)),
    ] + [Row("hqq", f"HF hqq {bits}b G{G} R{R}", lambda: QuantizedCache("hqq", model.config, **hf))] * HQQ  # fmt: skip


def tensor_bytes(obj, seen: set, depth: int = 0) -> int:
    """Bytes of every tensor reachable from obj's attributes (each storage counted once)."""
    if depth > 6:
        return 0
    if isinstance(obj, torch.Tensor):
        total = 0
        inner = getattr(obj, "__tensor_flatten__", None)
        if inner is not None and type(obj) is not torch.Tensor:  # quanto's packed tensor subclasses
            for name in inner()[0]:
                total += tensor_bytes(getattr(obj, name), seen, depth + 1)
            return total
        key = (obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes())
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def cache_bytes(cache) -> tuple[int, int]:
    """(stored, fp16-equivalent) bytes of a cache."""
    if isinstance(cache, QuantizedKVCache) and cache.cfg.caps.packed_storage:
        nb = cache.nbytes()
        return nb["stored"], nb["fp16"]
    # others: every tensor the layers hold (the simulated cache keeps exact K/V plus its dequantized copy)
    stored = sum(tensor_bytes(layer, set()) for layer in cache.layers)
    n = cache.get_seq_length()
    cfg = cache_bytes.text_cfg
    keys = getattr(cache.layers[0], "keys", None)
    B = keys.shape[0] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 1  # batch rows
    fp16 = 2 * B * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * n * 2
    return stored, fp16


def arithmetic_bytes(cache: QuantizedKVCache) -> int:
    """Storage arithmetic for our packed cache from its token counts (see the module docstring)."""
    total = 0
    for layer in cache.layers:
        B, H, _, D = layer.sink_k.shape
        el = layer.sink_k.element_size()
        N, S = layer.N, layer.cfg.sink_tokens
        for stream in (layer.k_stream, layer.v_stream):
            spec = stream.spec
            q = stream.n_quantized(N)
            per_element = bits_per_element(code_format(spec), spec.group_size, spec.axis)  # codes + parameters
            total += B * H * D * (q * per_element / 8 + stream.window_slots * el)
        total += 2 * B * H * S * D * el
    # rope=pre: the position ids the keys are re-rotated at, one buffer for the cache's layers (per device)
    logs = {id(layer._log): layer._log.ids for layer in cache.layers if layer._log is not None}
    total += sum(t.numel() * t.element_size() for t in logs.values() if t is not None)
    return int(total)


def batch_prompt(text_ids: torch.Tensor, L: int, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [batch, L] and attention mask (None for batch 1): row i holds L - i L/8 tokens of the text (starting i*97
    tokens in, so rows differ), left-padded to L."""
    if batch == 1:
        return text_ids[:, :L], None
    ids = torch.zeros(batch, L, dtype=text_ids.dtype)
    mask = torch.zeros(batch, L, dtype=torch.long)
    for i in range(batch):
        n = L - i * L // 8
        ids[i, L - n :] = text_ids[0, i * 97 : i * 97 + n]
        mask[i, L - n :] = 1
    return ids, mask


def clock(device: torch.device) -> float:
    """perf_counter once the device's queued work is done (CUDA runs asynchronously: time the work, not its launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Run:
    """One cache's greedy generation, advanced a step at a time so that the caches of a comparison alternate step by
    step: prefill ids [B, L] (mask: left padding, or None) at creation (timed), then `step()`: one forward of one token
    per row (timed), the cache's size checked after each (untimed)."""

    @torch.no_grad()
    def __init__(self, model, make, ids, mask):
        self.model, self.cache = model, make()
        dev = self.dev = model.device
        self.kw = {cache_kwarg(): self.cache, "use_cache": True}
        self.mask = self.pos = None
        if mask is not None:  # a left-padded batch: the mask and the position ids generate would pass
            if isinstance(self.cache, QuantizedKVCache):
                self.cache.set_padding(mask)
            self.mask = mask.to(dev)
            self.pos = (self.mask.cumsum(1) - 1).clamp(min=0)
            self.kw.update(attention_mask=self.mask, position_ids=self.pos)
        ids = ids.to(dev)
        t0 = clock(dev)
        out = model(ids, **self.kw)
        self.prefill = clock(dev) - t0
        self.nxt = out.logits[:, -1:].argmax(-1)
        self.peak = cache_bytes(self.cache)
        self.steps: list[float] = []
        self.tokens = [self.nxt[:, 0].tolist()]
        self.batch = ids.shape[0]

    @torch.no_grad()
    def step(self) -> None:
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], 1)
            self.pos = self.pos[:, -1:] + 1
            self.kw.update(attention_mask=self.mask, position_ids=self.pos)
        t0 = clock(self.dev)
        out = self.model(self.nxt, **self.kw)
        self.nxt = out.logits[:, -1:].argmax(-1)
        self.steps.append(clock(self.dev) - t0)
        self.tokens.append(self.nxt[:, 0].tolist())
        b = cache_bytes(self.cache)
        if b[0] > self.peak[0]:
            self.peak = b

    def result(self, warmup: int) -> dict:
        res = {"prefill_s": self.prefill, "step_s": self.steps[warmup:], "peak": self.peak, "tokens": self.tokens}
        if isinstance(self.cache, QuantizedKVCache) and self.cache.cfg.caps.fused_decode:
            res["arith"] = arithmetic_bytes(self.cache)
        return res


def step_orders(n: int) -> list[list[int]]:
    """The orders in which n caches take their steps, one order per round, used in turn: a Williams design (each
    order a row of a Latin square whose first row is 0, 1, n-1, 2, n-2, ...; for odd n its mirror rows too), so over
    the orders every cache takes every place in the round equally often and comes right after every other cache
    equally often; the orders are put in a cycle where no round starts with the cache that ended the one before, so
    no cache ever takes two steps in a row. Why: with one fixed order (A, B, C, A, B, C, ...) the same cache measured
    3-6% faster right after DynamicCache than later in the round (an A/A test, the benchmark notes, `git show
    8e8c818:experiments/cache_speed/README.md`), a bias that the ratios between caches carried."""
    if n < 3:  # one cache, or two that alternate (each always after the other: balanced already)
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]

    def chain(done: list[list[int]], left: list[list[int]]) -> list[list[int]] | None:
        """`done` continued by every row of `left`, each starting where the previous does not end (a cycle)"""
        if not left:
            return done if done[-1][-1] != done[0][0] else None
        for i, row in enumerate(left):
            if row[0] != done[-1][-1]:
                found = chain(done + [row], left[:i] + left[i + 1 :])
                if found:
                    return found
        return None

    return chain(rows[:1], rows[1:]) or rows


def paired_ratio(a: list[dict], b: list[dict]) -> float:
    """The median over every timed round of every repeat of a's step time / b's step time in that round (`Run.result`s
    of two caches of one `run_alternating` per repeat): b's speed relative to a's, from steps taken side by side (one
    right after the other), so that a change of the machine's speed that lasts a round or more cancels. The `ratio`
    of medians compares steps of different rounds; on a machine whose speed moves by 20% from second to second the
    paired ratio is the steadier (two caches of one configuration: within 2% paired where the medians differed by up
    to 7%, the benchmark notes, `git show 8e8c818:experiments/cache_speed/README.md`)."""
    return statistics.median(
        ta / tb for ra, rb in zip(a, b, strict=True) for ta, tb in zip(ra["step_s"], rb["step_s"], strict=True)
    )


def post_counterpart(row: Row, rows: list[Row]) -> Row | None:
    """For a rope=pre row of ours, the row of the same cache with rope=post (the bar "rope=pre within 5% of rope=post"
    compares the two), or None."""
    if row.rope != "pre":
        return None
    return next((r for r in rows if r.rope == "post" and r.label == row.label.replace(" preRoPE", "")), None)


def run_alternating(model, rows: list[Row], ids, mask, new_tokens: int, warmup: int) -> dict[str, dict]:
    """Every cache of `rows` prefilled (one after the other), then decoded in turn, one step each, in rounds whose
    order changes from round to round (`step_orders`): A, B, C, then B, C, A, ... Load from elsewhere on the machine
    that lasts longer than a step hits every cache alike, and no cache always runs after the same one. Returns each
    label's `Run.result`."""
    runs = [Run(model, r.make, ids, mask) for r in rows]
    orders = step_orders(len(runs))
    for step in range(new_tokens):
        for i in orders[step % len(orders)]:
            runs[i].step()
    runs = dict(zip((r.label for r in rows), runs, strict=True))
    out = {label: run.result(warmup) for label, run in runs.items()}
    runs.clear()  # free the caches before the next repeat prefills
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, print its tables, write `--json`; returns the JSON rows."""
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths (default 512 4096 8192)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 256 tokens, 1 repeat, 12 new tokens")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--new-tokens", type=int, default=None, help="default 40 (--quick: 12)")
    ap.add_argument("--warmup", type=int, default=None, help="default 8 (--quick: 2)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--recompute-rank", type=int, default=128, help="rank of the recompute cache's projection of X")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of cache labels to run (DynamicCache always)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model and caches run")
    ap.add_argument("--json", type=Path, default=None, help='write {"rows": [...]} here (keys: module docstring)')
    args = ap.parse_args(argv)
    quick = args.quick
    lengths = args.lengths or ([256] if quick else [512, 4096, 8192])
    new_tokens = args.new_tokens if args.new_tokens is not None else 12 if quick else 40
    warmup = args.warmup if args.warmup is not None else 2 if quick else 8
    repeats = args.repeats if args.repeats is not None else 1 if quick else 3
    # before the model loads, one line each (exit status 2): counts, cache settings, lengths within the model
    at_least(args, new_tokens=2, warmup=0, repeats=1, threads=1, bits=1, group_size=1, residual=0, recompute_rank=1)
    if warmup >= new_tokens:
        fail(f"--warmup {warmup} leaves no timed step of --new-tokens {new_tokens}: lower --warmup")
    within_model(args.model, lengths, new_tokens)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not HQQ:
        print('hqq is not installed: no "HF hqq" row (pip install -e ".[hqq]" adds it)', file=sys.stderr)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device}: this machine has no CUDA GPU; use --device cpu")
    rows_out: list[dict] = []
    dev = args.device
    where = torch.cuda.get_device_name(dev) if dev.startswith("cuda") else platform.processor() or platform.machine()
    given = argv if argv is not None else sys.argv[1:]
    print(
        f"# {args.model} on {dev} ({where}, {torch.get_num_threads()} threads), "
        f"torch {torch.__version__}, greedy, {new_tokens} new tokens ({warmup} warm-up steps untimed), caches "
        f"alternating step by step, median step of {repeats} repeat(s)\n"
        f"# command: python scripts/bench_cache.py {shlex.join(given)}\n"
        f"# code: {code_version()}"
    )
    model = tok = None
    for setting in args.settings:
        dtype, batch = SETTINGS[setting]
        if model is None:
            model, tok = load_model(args.model, dtype=dtype, device=dev)
            cache_bytes.text_cfg = model.config.get_text_config(decoder=True)
        model = model.to(dtype)
        caches = make_caches(model, args.bits, args.group_size, args.residual, args.recompute_rank,
                             full=setting == "fp32-b1")  # fmt: skip
        if args.only:
            caches = [c for c in caches if c.kind == "dynamic" or any(s in c.label for s in args.only)]
        text_ids = tok(TEXT * (40 + max(lengths) // 20), return_tensors="pt").input_ids
        for L in lengths:
            ids, mask = batch_prompt(text_ids, L, batch)
            results = {c.label: [] for c in caches}
            for _ in range(repeats):
                for label, res in run_alternating(model, caches, ids, mask, new_tokens, warmup).items():
                    results[label].append(res)
            # decode tok/s: rows per step over the median timed step of all repeats
            tps_of = {k: batch / statistics.median(t for r in rs for t in r["step_s"]) for k, rs in results.items()}
            base = tps_of["DynamicCache"]
            post_of = {c.label: post_counterpart(c, caches) for c in caches}
            print(f"\n## {setting} ({str(dtype).removeprefix('torch.')}, batch {batch}), prompt {L} tokens\n")
            print(
                "| cache | decode tok/s | vs Dynamic | paired | prefill s | peak cache MB | / fp16 | measured / arith |"
            )
            print("|---|---|---|---|---|---|---|---|")
            for c in caches:
                rs = results[c.label]
                tps = tps_of[c.label]
                paired = paired_ratio(results["DynamicCache"], rs)
                post = post_of[c.label]
                vs_post = None if post is None else paired_ratio(results[post.label], rs)
                pre = statistics.median(r["prefill_s"] for r in rs)
                stored, fp16 = rs[-1]["peak"]
                ratio = stored / rs[-1]["arith"] if "arith" in rs[-1] else None
                shown = "" if ratio is None else f"{ratio:.3f}"
                print(
                    f"| {c.label} | {tps:.1f} | {tps / base:.3f}x | {paired:.3f}x | {pre:.2f} | "
                    f"{stored / 2**20:.2f} | {stored / fp16:.3f} | {shown} |"
                )
                rows_out.append({
                    "kind": c.kind, "label": c.label, "backend": c.backend, "rope": c.rope,
                    "dtype": str(dtype).removeprefix("torch."), "batch": batch, "format": c.format, "length": L,
                    "transform": c.transform, "tok_s": tps, "ratio": tps / base, "paired_ratio": paired,
                    "pre_over_post": None if post is None else tps / tps_of[post.label],
                    "paired_pre_over_post": vs_post,
                    "prefill_s": pre, "peak_bytes": int(stored), "measured_over_arith": ratio,
                })  # fmt: skip
            for c in caches:
                post = post_of[c.label]
                if post is not None:
                    print(
                        f"\nrope=pre / rope=post ({c.label}): {tps_of[c.label] / tps_of[post.label]:.3f} (medians), "
                        f"{paired_ratio(results[post.label], results[c.label]):.3f} (paired)"
                    )
            same = [c.label for c in caches if results[c.label][-1]["tokens"] == results["DynamicCache"][-1]["tokens"]]
            print(f"\nsame greedy tokens as DynamicCache: {', '.join(same)}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        record = {"rows": rows_out, "code": code_version(), "argv": list(given)}
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(args.json)  # atomic: a reader never sees half a file
        print(f"\nwrote {len(rows_out)} rows to {args.json}")
    return rows_out


if __name__ == "__main__":
    main()
