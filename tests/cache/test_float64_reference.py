"""Float64 as the reference for the cache's semantics on the real model (SmolLM2-135M, `model.dtype=float64`).

Two ways of feeding a prompt that the cache declares equivalent must give the same logits: a prefill in two pieces
cut where `prefix_boundary` allows (what CoQA's prefix reuse does) and the prompt in one piece; a row of a left-padded
batch and the same prompt alone. In float32 they do not, on this model: the two computations round differently in
the last bits (other GEMM shapes, masked SDPA over padding columns), 2-bit fake quant of every token turns a last-bit
difference into a whole step, and from layer 2-3 on the logits part (experiments/kivi_axis_table/prefill_cut.py).
In float64 the rounding differences are ~1e-16 relative, below float32's resolution where the quantizer reads its
input, so no code flips: what is left to differ is the semantics (a group cut in two, a padded position inside a
group, a sink or position placed wrongly), which the cut-inside-a-group check below shows breaks the comparison.
Simulated mode, 2-bit, G=32, keys per channel or per token, values per token (KIVI's Table 1 fake quant).
"""

from __future__ import annotations

import json

import pytest
import torch

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.quant import QuantSpec

pytestmark = pytest.mark.slow
DTYPE = "float64"  # in float32 both comparisons fail on these prompts (measured: logits apart by 0.6-37)

AXES = [("channel", "token"), ("token", "token")]  # 2-bit K-C/V-T and K-T/V-T
TOL = 1e-6  # logits of this model are O(10); float64 rounding leaves ~1e-12, one flipped 2-bit code O(0.1-1)
NEW = 3  # greedy decode steps after the prompt: they read the cache as the prefill filled it
KEEP = 16  # prefill positions whose logits are compared (the output head over every position would cost 20% more)


@pytest.fixture(scope="module")
def smol64():
    from kvq_lab.models.loading import load_model

    return load_model("smollm2-135m", dtype=DTYPE)


@pytest.fixture(scope="module")
def prompts(smol64):
    """Token ids of two CoQA prompts: story 0 with its first question (344 tokens), the last 190 of story 1's."""
    from conftest import DATA_DIR

    _, tok = smol64
    if not (DATA_DIR / "coqa").is_dir():
        pytest.fail(f"no data folder at {DATA_DIR}; set KVQ_DATA_DIR to the shared data folder")
    lines = (DATA_DIR / "coqa" / "coqa-validation.first20.lm_eval.jsonl").read_text().splitlines()
    docs = [json.loads(line) for line in lines[:2]]
    texts = [f"{d['story']}\n\nQ: {d['questions']['input_text'][0]}\n\nA:" for d in docs]
    ids = [tok(t, return_tensors="pt").input_ids[0] for t in texts]
    return [ids[0], ids[1][-190:]]  # neither a multiple of 32


@pytest.fixture(scope="module")
def alone(smol64, prompts):
    """(axes, prompt index) -> what the prompt gives alone, in one piece (computed once for the module)."""
    model, _ = smol64
    memo = {}

    def get(ka, va, i):
        if (ka, va, i) not in memo:
            with torch.inference_mode():
                memo[ka, va, i] = one_piece(model, cfg(ka, va), prompts[i])
        return memo[ka, va, i]

    return get


def cfg(ka: str, va: str) -> CacheConfig:
    return CacheConfig(key=QuantSpec(2, 32, ka), value=QuantSpec(2, 32, va))


def decode(model, cache, logits, mask=None, n=NEW):
    """logits [B, T, V] of a prefill's T positions, then n greedy steps -> (tokens [B, n], logits [B, T + n, V])."""
    toks, outs = [], [logits]
    pos = None if mask is None else mask.sum(1, keepdim=True) - 1
    for _ in range(n):
        nxt = outs[-1][:, -1:].argmax(-1)
        toks.append(nxt)
        kw = {}
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            pos = pos + 1
            kw = {"attention_mask": mask, "position_ids": pos}
        outs.append(model(nxt, past_key_values=cache, **kw).logits)
    return torch.cat(toks, 1), torch.cat(outs, 1)


def one_piece(model, c: CacheConfig, ids: torch.Tensor):
    cache = QuantizedKVCache.for_model(model, c)
    return decode(model, cache, model(ids[None], past_key_values=cache, logits_to_keep=KEEP).logits)


def two_pieces(model, c: CacheConfig, ids: torch.Tensor, cut: int):
    cache = QuantizedKVCache.for_model(model, c)
    model(ids[None, :cut], past_key_values=cache)
    pos = torch.arange(cut, len(ids))[None]
    logits = model(ids[None, cut:], past_key_values=cache, position_ids=pos, logits_to_keep=KEEP).logits
    return decode(model, cache, logits)


def padded_batch(model, c: CacheConfig, rows: list[torch.Tensor], tell_cache: bool = True):
    """The rows left-padded into one batch (the cache told where the padding is, unless not `tell_cache`) -> per row
    (tokens, logits at its real positions)."""
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r) :], mask[b, T - len(r) :] = r, 1
    cache = QuantizedKVCache.for_model(model, c)
    if tell_cache:
        cache.set_padding(mask)
    pos = (mask.cumsum(1) - 1).clamp_min(0)  # what generate passes: each row's real tokens at 0, 1, ...
    logits = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, logits_to_keep=KEEP).logits
    toks, outs = decode(model, cache, logits, mask)  # the last KEEP positions are real tokens in every row
    return [(toks[b : b + 1], outs[b : b + 1]) for b in range(len(rows))]


def same(a, b) -> bool:
    """Same greedy tokens, and logits within TOL at the last KEEP prompt positions and every decode step."""
    return torch.equal(a[0], b[0]) and (a[1] - b[1]).abs().max().item() < TOL


@pytest.mark.parametrize("ka,va", AXES)
def test_two_piece_prefill_at_a_group_boundary_is_the_one_piece_prefill(smol64, prompts, alone, ka, va):
    model, _ = smol64
    c = cfg(ka, va)
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            cut = QuantizedKVCache.for_model(model, c).prefix_boundary(len(ids) - 20)
            assert 0 < cut < len(ids) - 8
            assert same(alone(ka, va, i), two_pieces(model, c, ids, cut)), (len(ids), cut)


def test_a_cut_inside_a_key_group_breaks_the_comparison(smol64, prompts, alone):
    """The check above can fail: cut 5 tokens past the boundary, the per-channel key group around the cut is
    quantized in two parts (the first zero-padded), a semantic difference float64 does not hide."""
    model, _ = smol64
    c = cfg("channel", "token")
    cut = QuantizedKVCache.for_model(model, c).prefix_boundary(len(prompts[0]) - 20) + 5
    with torch.inference_mode():
        assert not same(alone("channel", "token", 0), two_pieces(model, c, prompts[0], cut))


@pytest.mark.parametrize("ka,va", AXES)
def test_a_left_padded_row_is_the_row_alone(smol64, prompts, alone, ka, va):
    model, _ = smol64
    with torch.inference_mode():
        batch = padded_batch(model, cfg(ka, va), prompts)
    for i, got in enumerate(batch):
        assert same(alone(ka, va, i), got), len(prompts[i])


def test_padding_inside_a_group_breaks_the_comparison(smol64, prompts, alone):
    """The check above can fail: a cache not told where the padding is puts the pad tokens' keys into the shorter
    row's per-channel groups."""
    model, _ = smol64
    with torch.inference_mode():
        batch = padded_batch(model, cfg("channel", "token"), prompts, tell_cache=False)
    assert not same(alone("channel", "token", 1), batch[1])
