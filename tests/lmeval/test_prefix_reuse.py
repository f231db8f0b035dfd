"""Prefix reuse (`prefix_reuse=true`): where `prefix_boundary` allows a cut, attention sees the same keys and values
for the tokens before it whether the cache got them alone or with the whole prompt, and the cache ends up the same;
a cut inside a per-channel group would change what the earlier tokens saw. The lm-eval wrapper that reuses
checkpoints generates what it generates without them."""

from __future__ import annotations

import pytest
import torch

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.quant import QuantSpec


def cfg_of(ka: str, va: str, sinks: int = 0, kg: int = 16, vg: int = 8, **kw) -> CacheConfig:
    return CacheConfig(key=QuantSpec(2, kg, ka), value=QuantSpec(3, vg, va), sink_tokens=sinks, **kw)


def fill(model, cfg: CacheConfig, k, v, cuts: list[int]):
    """Fill a fresh cache with k, v [1, H, T, D] in pieces cut at `cuts`, then one decode token; -> what every
    update returned (the keys and values attention sees)."""
    cache = QuantizedKVCache.for_model(model, cfg)
    T = k.shape[2] - 1
    out = []
    for a, b in zip([0, *cuts, T], [*cuts, T, T + 1], strict=True):
        if b > a:
            pos = torch.arange(a, b)[None]
            K, V = cache.update(k[:, :, a:b], v[:, :, a:b], 0, {"position_ids": pos})
            out.append((K.clone(), V.clone()))  # views of the cache's buffers, valid until its next update
    return out


AXES = [("channel", "token"), ("token", "channel"), ("channel", "channel"), ("token", "token")]


@pytest.mark.parametrize("ka,va", AXES)
@pytest.mark.parametrize("sinks", [0, 5])
@pytest.mark.parametrize("transform", [(), ("rope_pre", "hadamard")])
def test_cut_at_the_boundary_changes_nothing(tiny_model, ka, va, sinks, transform):
    cfg = cfg_of(ka, va, sinks, key_transform=transform)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 78, 64, generator=g), torch.randn(1, 2, 78, 64, generator=g)
    probe = QuantizedKVCache.for_model(tiny_model, cfg)
    cut = probe.prefix_boundary(60)
    assert 0 < cut <= 60
    step = 16 if ka == "channel" else 8 if va == "channel" else 1  # lcm of the token-grouped quantizers' G (16, 8)
    assert cut == sinks + (60 - sinks) // step * step
    whole = fill(tiny_model, cfg, k, v, [])
    parts = fill(tiny_model, cfg, k, v, [cut])
    # the tokens before the cut saw, when alone, what they see in the one-shot prefill
    assert torch.equal(parts[0][0], whole[0][0][:, :, :cut]) and torch.equal(parts[0][1], whole[0][1][:, :, :cut])
    # the end of the prefill and the decode step that follows see the same keys and values, bit for bit
    for (K1, V1), (K2, V2) in zip(whole, parts[1:], strict=True):
        assert torch.equal(K1, K2) and torch.equal(V1, V2)


@pytest.mark.parametrize("ka,va", [("channel", "token"), ("token", "channel")])
def test_cut_inside_a_token_group_changes_what_earlier_tokens_see(tiny_model, ka, va):
    """The test above would pass for a boundary that ignores groups: a cut that splits a per-channel group shows
    the tokens before it their group quantized without the tokens after it (zero-padded), unlike one prefill."""
    cfg = cfg_of(ka, va)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 78, 64, generator=g), torch.randn(1, 2, 78, 64, generator=g)
    cut = QuantizedKVCache.for_model(tiny_model, cfg).prefix_boundary(60) + 3
    whole, parts = fill(tiny_model, cfg, k, v, []), fill(tiny_model, cfg, k, v, [cut])
    same = [torch.equal(parts[0][i], whole[0][i][:, :, :cut]) for i in (0, 1)]
    assert not all(same)


def test_packed_cache_declares_no_cut(tiny_model):
    cfg = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed")
    assert QuantizedKVCache.for_model(tiny_model, cfg).prefix_boundary(100) == 0


def test_padded_simulated_cache_declares_no_cut(tiny_model):
    cache = QuantizedKVCache.for_model(tiny_model, cfg_of("channel", "token"))
    cache.set_padding(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    cache.update(torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64), 0)
    assert cache.layers[0].prefix_boundary(3) == 0


def _requests(tok):
    """CoQA-shaped prompts: two stories, three turns each, every turn's prompt a prefix of the next one's."""
    from lm_eval.api.instance import Instance

    gen = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    out = []
    for s, story in enumerate(["The cat sat on the mat. " * 12, "A boat sailed north past the old lighthouse. " * 9]):
        text = story + "\n\n"
        for t, (q, a) in enumerate([("Who sat?", "the cat"), ("Where?", "on the mat"), ("When?", "today")]):
            text += f"Q: {q}\n\nA:"
            out.append(Instance("generate_until", {}, (text, gen), idx=len(out), metadata=("t", s * 3 + t, 1)))
            text += f" {a}\n\n"
    return out[::-1]  # longest first, as lm-eval hands them over: the wrapper orders them itself


@pytest.mark.parametrize("ka,va", [("channel", "token"), ("token", "token")])
def test_lm_wrapper_generates_the_same_with_and_without_reuse(tiny_model_dir, ka, va):
    from transformers import AutoTokenizer

    from kvq_lab.lmeval.wrapper import QuantCacheLM
    from kvq_lab.models.loading import load_model

    model, _ = load_model(str(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = cfg_of(ka, va, kg=32, vg=32)
    outs, served = [], []
    for reuse in (False, True):
        lm = QuantCacheLM(model, tok, lambda: QuantizedKVCache.for_model(model, cfg), prefix_reuse=reuse)
        outs.append(lm.generate_until(_requests(tok), disable_tqdm=True))
        served.append(lm.prefix_tokens)
        assert lm.generate_calls == 6
    assert outs[0] == outs[1]
    assert served[0] == 0 and served[1] > 100  # 4 of the 6 prompts extend a checkpoint of their story


def test_lm_wrapper_with_a_wrong_boundary_generates_differently(tiny_model_dir, monkeypatch):
    """The test above could pass with reuse that never happens or never matters: cut anywhere (splitting
    per-channel groups), the same prompts must generate something else."""
    from transformers import AutoTokenizer

    from kvq_lab.cache.layers.simulated import SimulatedLayer
    from kvq_lab.lmeval.wrapper import QuantCacheLM
    from kvq_lab.models.loading import load_model

    model, _ = load_model(str(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = cfg_of("channel", "token", kg=32, vg=32)
    right = QuantCacheLM(model, tok, lambda: QuantizedKVCache.for_model(model, cfg), prefix_reuse=False)
    expected = right.generate_until(_requests(tok), disable_tqdm=True)
    monkeypatch.setattr(SimulatedLayer, "prefix_boundary", lambda self, n: n)
    wrong = QuantCacheLM(model, tok, lambda: QuantizedKVCache.for_model(model, cfg), prefix_reuse=True)
    assert wrong.generate_until(_requests(tok), disable_tqdm=True) != expected


def _filled(model, cfg: CacheConfig, k, v):
    """A batch-1 cache, every layer filled with k, v [1, H, T, D] (prefill, then two single tokens)."""
    cache = QuantizedKVCache.for_model(model, cfg)
    T = k.shape[2]
    for a, b in [(0, T - 2), (T - 2, T - 1), (T - 1, T)]:
        for i in range(len(cache.layers)):
            cache.update(k[:, :, a:b], v[:, :, a:b], i, kwargs={"position_ids": torch.arange(a, b)[None]})
    return cache


@pytest.mark.parametrize("ka,va", AXES)
@pytest.mark.parametrize("sinks", [0, 5])
@pytest.mark.parametrize("transform", [(), ("rope_pre", "hadamard")])
@pytest.mark.parametrize("lengths", [[70, 37, 53], [41, 41]])
def test_stacked_rows_decode_as_they_would_alone(tiny_model, ka, va, sinks, transform, lengths, monkeypatch):
    """`QuantizedKVCache.stack`: a batch of caches of different lengths decodes, row by row, bit for bit what each
    cache decodes alone (its own groups, sinks and positions), for 18 more tokens: every row fills and opens groups
    of 16 and 8. Untransformed tensors take the one-call step of all rows (`FakeQuantStream.step_rows`, counted)."""
    from kvq_lab.cache.layers.simulated_stream import FakeQuantStream

    calls = []
    step_rows = FakeQuantStream.step_rows
    monkeypatch.setattr(FakeQuantStream, "step_rows", lambda *a: calls.append(step_rows(*a)) or calls[-1])
    cfg = cfg_of(ka, va, sinks, key_transform=transform)
    g = torch.Generator().manual_seed(5)
    steps = 18
    kv = [
        (torch.randn(1, 2, n + steps, 64, generator=g), torch.randn(1, 2, n + steps, 64, generator=g)) for n in lengths
    ]
    alone = [_filled(tiny_model, cfg, k[:, :, :n], v[:, :, :n]) for (k, v), n in zip(kv, lengths, strict=True)]
    batch = QuantizedKVCache.stack(
        [_filled(tiny_model, cfg, k[:, :, :n], v[:, :, :n]) for (k, v), n in zip(kv, lengths, strict=True)]
    )
    T = max(lengths)
    for step in range(steps):
        k_new = torch.cat([k[:, :, n + step : n + step + 1] for (k, _), n in zip(kv, lengths, strict=True)])
        v_new = torch.cat([v[:, :, n + step : n + step + 1] for (_, v), n in zip(kv, lengths, strict=True)])
        pos = torch.tensor([[n + step] for n in lengths])
        K, V = batch.update(k_new, v_new, 0, kwargs={"position_ids": pos})  # as the attention layer passes them
        for b, n in enumerate(lengths):
            K1, V1 = alone[b].update(k_new[b : b + 1], v_new[b : b + 1], 0, kwargs={"position_ids": pos[b : b + 1]})
            real = slice(T - n, None)
            assert torch.equal(K[b : b + 1, :, real], K1) and torch.equal(V[b : b + 1, :, real], V1)
    # the comparison can fail: the first row's keys are not the last row's
    assert not torch.equal(K[0:1, :, -5:], K1[:, :, -5:])
    # values always, keys where no transform wraps them: every step in one call
    assert calls.count(True) == steps * (1 if transform else 2) and False not in calls


@pytest.mark.parametrize("keys", ["16-bit", "outliers"])
def test_stacked_rows_off_the_one_call_step_decode_as_alone(tiny_model, keys):
    """16-bit keys take the one-call step (a copy of the new column); values with outliers kept exact run row by row
    (`step_rows` declines): both decode bit for bit as the rows alone."""
    from dataclasses import replace

    key = QuantSpec(16, 16, "channel") if keys == "16-bit" else QuantSpec(2, 16, "channel")
    cfg = replace(cfg_of("channel", "token"), key=key)
    if keys == "outliers":
        cfg = replace(cfg, value_outliers=0.05)
    g = torch.Generator().manual_seed(6)
    lengths = [45, 20]
    kv = [(torch.randn(1, 2, n + 18, 64, generator=g), torch.randn(1, 2, n + 18, 64, generator=g)) for n in lengths]
    alone = [_filled(tiny_model, cfg, k[:, :, :n], v[:, :, :n]) for (k, v), n in zip(kv, lengths, strict=True)]
    batch = QuantizedKVCache.stack(
        [_filled(tiny_model, cfg, k[:, :, :n], v[:, :, :n]) for (k, v), n in zip(kv, lengths, strict=True)]
    )
    for step in range(18):
        k_new = torch.cat([k[:, :, n + step : n + step + 1] for (k, _), n in zip(kv, lengths, strict=True)])
        v_new = torch.cat([v[:, :, n + step : n + step + 1] for (_, v), n in zip(kv, lengths, strict=True)])
        pos = torch.tensor([[n + step] for n in lengths])
        K, V = batch.update(k_new, v_new, 0, kwargs={"position_ids": pos})
        for b, n in enumerate(lengths):
            K1, V1 = alone[b].update(k_new[b : b + 1], v_new[b : b + 1], 0, kwargs={"position_ids": pos[b : b + 1]})
            real = slice(max(lengths) - n, None)
            assert torch.equal(K[b : b + 1, :, real], K1) and torch.equal(V[b : b + 1, :, real], V1)


def test_stack_refuses_padded_or_empty_rows(tiny_model):
    cfg = cfg_of("channel", "token")
    padded = QuantizedKVCache.for_model(tiny_model, cfg)
    padded.set_padding(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    padded.update(torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64), 0)
    with pytest.raises(ValueError, match="unpadded"):
        QuantizedKVCache.stack([padded, padded])
    with pytest.raises(ValueError, match="filled"):
        QuantizedKVCache.stack([QuantizedKVCache.for_model(tiny_model, cfg)])
    packed = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed")
    assert QuantizedKVCache.for_model(tiny_model, cfg).stackable
    assert not QuantizedKVCache.for_model(tiny_model, packed).stackable


@pytest.mark.parametrize("ka,va", [("channel", "token"), ("token", "token")])
def test_lm_wrapper_batches_with_reuse_as_batch_one(tiny_model_dir, ka, va, monkeypatch):
    """Continuous batching with prefix reuse, batch_size=3: each request prefilled alone from the checkpoint, the first
    three stacked, each later one taking a finished row's place in the running batch (answers of 2 to 7 tokens, so
    rows end at different steps): the same answers as batch 1 without reuse, one fresh cache per request, and the
    checkpoint serves."""
    from transformers import AutoTokenizer

    from kvq_lab.lmeval.wrapper import QuantCacheLM
    from kvq_lab.models.loading import load_model

    model, _ = load_model(str(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = cfg_of(ka, va, kg=32, vg=32)
    make = lambda: QuantizedKVCache.for_model(model, cfg)  # noqa: E731

    def requests():
        out = _requests(tok)
        for r in out:  # a budget per request: rows leave the batch at different steps
            r.arguments = (r.args[0], {**r.args[1], "max_gen_toks": 2 + r.idx % 6})
        return out

    expected = QuantCacheLM(model, tok, make, prefix_reuse=False).generate_until(requests(), disable_tqdm=True)
    assert len({len(tok(a)["input_ids"]) for a in expected}) > 2
    admitted = []
    admit = QuantizedKVCache.admit
    monkeypatch.setattr(QuantizedKVCache, "admit", lambda self, b, row: admitted.append(b) or admit(self, b, row))
    lm = QuantCacheLM(model, tok, make, batch_size=3, prefix_reuse=True)
    assert lm.generate_until(requests(), disable_tqdm=True) == expected
    assert len(admitted) == 3 and lm.generate_calls == 6 and lm.prefix_tokens > 100


@pytest.mark.parametrize("ka,va", [("channel", "token"), ("token", "channel")])
@pytest.mark.parametrize("sinks", [0, 5])
@pytest.mark.parametrize("transform", [(), ("rope_pre", "hadamard")])
def test_admitted_rows_decode_as_they_would_alone(tiny_model, ka, va, sinks, transform):
    """Continuous batching (`QuantizedKVCache.admit`, `trim_padding`): rows put into a running batch in place of
    finished ones, longer than the batch (every other row padded further) or shorter, decode bit for bit what they
    decode alone, and so do the rows already there; dropping the columns that became padding everywhere changes
    nothing either."""
    cfg = cfg_of(ka, va, sinks, key_transform=transform)
    g = torch.Generator().manual_seed(7)
    lengths = {"a": 70, "b": 37, "c": 90, "d": 20, "e": 30}
    kv = {
        r: (torch.randn(1, 2, n + 40, 64, generator=g), torch.randn(1, 2, n + 40, 64, generator=g))
        for r, n in lengths.items()
    }
    fed = dict(lengths)  # tokens each row's cache holds

    def row(r):
        (k, v), n = kv[r], lengths[r]
        return _filled(tiny_model, cfg, k[:, :, :n], v[:, :, :n])

    alone = {r: row(r) for r in lengths}
    batch = QuantizedKVCache.stack([row("a"), row("b")])
    slots = ["a", "b"]

    def steps(n):
        for _ in range(n):
            k_new = torch.cat([kv[r][0][:, :, fed[r] : fed[r] + 1] for r in slots])
            v_new = torch.cat([kv[r][1][:, :, fed[r] : fed[r] + 1] for r in slots])
            pos = torch.tensor([[fed[r]] for r in slots])
            for i in range(1, len(batch.layers)):  # every layer steps, as in a forward pass; layer 0 is compared
                batch.update(k_new, v_new, i, kwargs={"position_ids": pos})
            K, V = batch.update(k_new, v_new, 0, kwargs={"position_ids": pos})
            mask = batch.batch_mask()
            for b, r in enumerate(slots):
                K1, V1 = alone[r].update(k_new[b : b + 1], v_new[b : b + 1], 0, kwargs={"position_ids": pos[b : b + 1]})
                fed[r] += 1
                real = mask[b].bool()
                assert int(real.sum()) == fed[r]
                assert torch.equal(K[b][:, real], K1[0]) and torch.equal(V[b][:, real], V1[0])

    steps(3)
    batch.admit(1, row("c"))  # longer than the batch: 17 more padding columns before "a"
    slots[1] = "c"
    assert batch.get_seq_length() == lengths["c"]
    steps(3)
    batch.admit(0, row("d"))  # shorter
    slots[0] = "d"
    steps(18)  # across groups of 16 and 8
    batch.admit(1, row("e"))  # the longest row leaves: leading columns are padding everywhere
    slots[1] = "e"
    before = batch.get_seq_length()
    dropped = batch.trim_padding()
    assert dropped > 0 and batch.get_seq_length() == before - dropped == max(fed["d"], fed["e"])
    steps(5)
    with pytest.raises(ValueError, match="slot 2"):
        batch.admit(2, row("a"))
