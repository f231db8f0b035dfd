"""Every embedded model (`kvq_lab.models.loading.EMBEDDED`), driven by the registry: a new row is covered with no
test edit. Each row finds its GGUF or says in one line what to install, conf/model/<name>.yaml states what the GGUF
holds, and the cache oracles hold on a tiny random-weight model of each one's architecture: its real config (model
class, query and KV heads (GQA, MQA), head dim, layer types with their RoPE) with one layer per layer type (at least
two), a narrow residual stream, a vocabulary of 256 and a sliding window shrunk to 16 tokens, so that a 40-token
prompt crosses it (Gemma-3-270M: 512)."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers_models import gen
from transformers import DynamicCache

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.common.errors import ConfigError
from kvq_lab.models import loading
from kvq_lab.models.files import facts
from kvq_lab.models.loading import (
    EMBEDDED,
    Assembled,
    Embedded,
    ModelNotFoundError,
    cache_dir,
    cache_kwarg,
    check_source,
    embedded_gguf,
    resolve,
)
from kvq_lab.quant import QuantSpec

REPO = Path(__file__).resolve().parents[2]
NAMES = sorted(EMBEDDED)
WINDOW = 16  # the tiny models' sliding window
PROMPT, STEPS = 40, 8  # a prefill that crosses the window, then decode steps
VOCAB = 256


# ---------------------------------------------------------------------------------------------------------------
# the registry: found, described, installed
# ---------------------------------------------------------------------------------------------------------------


def _hide(monkeypatch, tmp_path, package: str) -> None:
    """As if `package` were not installed and nothing had been cached: its module is not found and the model cache
    dir is an empty folder."""
    real = importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda n, *a: None if n == package else real(n, *a))
    monkeypatch.setenv("KVQ_MODEL_CACHE", str(tmp_path / "models"))


def _assert_install_line(message: str, name: str) -> None:
    row = EMBEDDED[name]
    assert "\n" not in message
    assert f"model={name}" in message and f"`pip install {row.install}`" in message, message
    assert f"model.path={row.hub_id}" in message, message


@pytest.mark.parametrize("name", NAMES)
def test_each_embedded_model_is_found_or_names_its_install(name, tmp_path, monkeypatch):
    """Installed (scripts/setup.sh): the row finds a GGUF whose header gives the head dim conf/model/<name>.yaml
    states. Not installed: `resolve` says in one line what to install, or which hub id loads it instead."""
    gguf = embedded_gguf(name)
    if gguf is None:
        monkeypatch.setenv("KVQ_MODEL_CACHE", str(tmp_path / "models"))  # no converted copy stands in for it
        with pytest.raises(ModelNotFoundError) as e:
            resolve(name)
        _assert_install_line(str(e.value), name)
        return
    conf = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
    assert conf["name"] == name and conf["path"] == name
    assert facts(str(gguf)).head_dim == conf["head_dim"]
    # the architecture the engine table keys llama.cpp's channel order on: the GGUF's, and the converted copy's
    arch = {"smollm2-135m": ("llama", "llama"), "gemma3-270m": ("gemma3", "gemma3_text")}[name]
    assert facts(str(gguf)).architecture == arch[0] and facts(resolve(name)).architecture in arch


@pytest.mark.parametrize("name", NAMES)
def test_a_missing_package_is_one_line_naming_the_install(name, tmp_path, monkeypatch):
    _hide(monkeypatch, tmp_path, EMBEDDED[name].package)
    assert embedded_gguf(name) is None
    with pytest.raises(ModelNotFoundError) as e:
        resolve(name)
    _assert_install_line(str(e.value), name)
    with pytest.raises(ConfigError) as e:  # what run.py prints before any load
        check_source({"name": name, "path": name})
    _assert_install_line(str(e.value), name)


@pytest.mark.parametrize("name", NAMES)
def test_setup_installs_every_embedded_model(name):
    assert f"pip install -q {EMBEDDED[name].install}\n" in (REPO / "scripts" / "setup.sh").read_text()


FAKE_PARTS = """
from pathlib import Path
CALLS, FAIL = [], None
def assemble(path):
    CALLS.append(path)
    if FAIL is not None:
        Path(path).write_bytes(b"GGUF half")  # what a failed join may leave behind
        raise FAIL
    Path(path).write_bytes(b"GGUF joined")
    return Path(path)
"""


def test_an_assembled_gguf_is_joined_once_and_only_when_whole(tmp_path, monkeypatch):
    """`Assembled`: the package's `assemble` writes the file under a temporary name, renamed once checked; a later
    call finds it without joining again. A missing part reads as not installed; a failed digest is one line naming
    the reinstall; neither leaves a file behind."""
    (tmp_path / "fake_parts_pkg.py").write_text(FAKE_PARTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_parts_pkg", raising=False)
    monkeypatch.setenv("KVQ_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.setitem(EMBEDDED, "fake", Embedded("fake_parts_pkg", Assembled("fake.gguf"), "fake-parts", "org/fake"))
    pkg = importlib.import_module("fake_parts_pkg")
    folder = cache_dir() / "gguf"

    pkg.FAIL = FileNotFoundError("Missing chunk files: part2")
    assert embedded_gguf("fake") is None and list(folder.iterdir()) == []
    with pytest.raises(ModelNotFoundError, match=r"run `pip install fake-parts`"):
        resolve("fake")
    pkg.FAIL = ValueError("Assembled file sha256 did not match expected value")
    with pytest.raises(ModelNotFoundError, match=r"fails its sha256; reinstall them: pip install --force-reinstall"):
        embedded_gguf("fake")
    assert list(folder.iterdir()) == []

    pkg.FAIL, pkg.CALLS[:] = None, []
    path = embedded_gguf("fake")
    assert path == folder / "fake.gguf" and path.read_bytes() == b"GGUF joined"
    assert [p.name for p in folder.iterdir()] == ["fake.gguf"] and pkg.CALLS[0] != path  # joined under another name
    assert embedded_gguf("fake") == path and resolve("fake") == str(path) and len(pkg.CALLS) == 1


# ---------------------------------------------------------------------------------------------------------------
# the cache oracles on each architecture
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def real_config(name: str):
    """The embedded model's transformers config: the converted copy's config.json when there (instant), else read
    from its GGUF (transformers parses the whole header, vocabulary included: Gemma-3-270M's 262k tokens take ~12 s,
    once per session)."""
    from transformers import AutoConfig

    folder = cache_dir() / name
    if (folder / "config.json").exists():
        return AutoConfig.from_pretrained(folder)
    gguf = embedded_gguf(name)
    if gguf is None:
        pytest.fail(f"model={name} is not installed: pip install {EMBEDDED[name].install} (scripts/setup.sh does)")
    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


@functools.cache
def tiny_of(name: str):
    """A seeded random model of `name`'s architecture (see the module docstring), SDPA attention, in eval mode."""
    from transformers import AutoModelForCausalLM

    real = real_config(name)
    head_dim = getattr(real, "head_dim", None) or real.hidden_size // real.num_attention_heads
    kinds = list(dict.fromkeys(getattr(real, "layer_types", None) or []))  # each layer type once, in order
    layers = max(2, len(kinds))
    small = {
        "num_hidden_layers": layers,
        "hidden_size": 16 * real.num_attention_heads,  # some configs require a multiple of the head count
        "intermediate_size": 128,
        "vocab_size": VOCAB,
        "head_dim": head_dim,
        "initializer_range": 0.1,  # peaked logits: greedy choices far from ties
    }
    if kinds:
        small["layer_types"] = (kinds * layers)[:layers]
    if getattr(real, "sliding_window", None):
        small["sliding_window"] = WINDOW
    cfg = type(real).from_dict({**real.to_dict(), **small})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _per_type_rope(model) -> bool:
    """RoPE whose frequencies depend on the layer type (Gemma 3: theta 1e4 on sliding layers, 1e6 on global ones)."""
    rotary = getattr(model.model, "rotary_emb", None)
    return rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters


def _xfail_rope_pre(request, model, rope: str) -> None:
    """rope=pre below 16 bits on a model with per-layer-type RoPE fails: `kvq_lab.cache.routing.rope.RopeHelper` calls
    the rotary module without a layer type (a TypeError in the run). Strict: the test says when it starts to work."""
    if rope == "pre" and _per_type_rope(model):
        request.applymarker(
            pytest.mark.xfail(raises=TypeError, strict=True, reason="rope=pre: RopeHelper has no per-layer-type RoPE")
        )


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """[1 + STEPS, vocab]: the prompt's last logits, then those of each later token fed alone (teacher forcing)."""
    kw = {cache_kwarg(): cache}
    with torch.no_grad():
        out = [model(ids[:, :PROMPT], **kw).logits[:, -1]]
        for t in range(PROMPT, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], **kw).logits[:, -1])
    return torch.cat(out)


def _cfg(bits: int, mode: str, backend: str, rope: str = "post", key_axis: str = "channel", **kw) -> CacheConfig:
    k, v = QuantSpec(bits, 32, key_axis), QuantSpec(bits, 32, "token")
    return CacheConfig(key=k, value=v, mode=mode, backend=backend, rope=rope, **kw)


MODES = [("simulated", "torch"), ("packed", "torch"), ("packed", "cpu")]


@pytest.mark.parametrize("rope", ["post", "pre"])
@pytest.mark.parametrize("mode,backend", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_16_bits_equals_dynamic_cache(name, mode, backend, rope):
    """Prefill past the sliding window, then decode: bit for bit the logits of a DynamicCache that keeps every token
    of every layer (the mask applies the window, as ours keep every token too), and to float rounding those of
    transformers' own cache for the config (its sliding layers keep only the last window - 1 tokens: SDPA then sums
    over fewer columns; the prefill is the same bits)."""
    model, ids = tiny_of(name), _ids()
    ours = _logits(model, ids, QuantizedKVCache.for_model(model, _cfg(16, mode, backend, rope)))
    assert torch.equal(ours, _logits(model, ids, DynamicCache()))
    own = DynamicCache(config=model.config)
    ref = _logits(model, ids, own)
    assert torch.equal(ours[0], ref[0])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    windowed = [layer for layer in own.layers if getattr(layer, "is_sliding", False)]
    assert all(layer.keys.shape[2] < ids.shape[1] for layer in windowed)  # the window was crossed


@pytest.mark.parametrize("rope", ["post", "pre"])
@pytest.mark.parametrize("mode,backend", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_2_bits_changes_the_logits(request, name, mode, backend, rope):
    """The oracle above would pass for a cache that ignores its quantizer; this one would not."""
    model, ids = tiny_of(name), _ids()
    _xfail_rope_pre(request, model, rope)
    ours = _logits(model, ids, QuantizedKVCache.for_model(model, _cfg(2, mode, backend, rope)))
    exact = _logits(model, ids, DynamicCache())
    assert ours.isfinite().all() and not torch.allclose(ours[1:], exact[1:], atol=1e-3)


def _spy_updates(cache: QuantizedKVCache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: the K, V its latest `update` returned}, filled as the model runs."""
    seen = {}
    for i, layer in enumerate(cache.layers):

        def update(*a, _real=layer.update, _i=i, **kw):
            seen[_i] = _real(*a, **kw)
            return seen[_i]

        layer.update = update
    return seen


@pytest.mark.parametrize("key_axis", ["channel", "token"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_packed_stores_what_simulated_stores(name, key_axis):
    """Where both modes quantize the same tokens with the same groups they hold the same bits: 2-bit, R = 0, per-token
    values everywhere and per-channel keys on whole groups. Through the model that is the first layer only: simulated
    mode quantizes the prompt before its attention reads it, packed mode attends to it exactly, so deeper layers see
    other inputs (cache level for every layer: tests/cache/test_packed.py::test_packed_agrees_with_simulated)."""
    model, ids = tiny_of(name), _ids()
    sim = QuantizedKVCache.for_model(model, _cfg(2, "simulated", "torch", key_axis=key_axis))
    seen = _spy_updates(sim)
    packed = QuantizedKVCache.for_model(model, _cfg(2, "packed", "torch", key_axis=key_axis))
    _logits(model, ids, sim)
    _logits(model, ids, packed)
    (ks, vs), (kp, vp) = seen[0], packed.layers[0].materialize()
    N = ids.shape[1]
    whole = N // 32 * 32 if key_axis == "channel" else N  # packed keeps a partial per-channel group exact
    assert vs.shape == (1, model.config.num_key_value_heads, N, model.config.head_dim)
    assert torch.equal(ks[:, :, :whole], kp[:, :, :whole]) and torch.equal(vs, vp)
    exact = DynamicCache()
    _logits(model, ids, exact)
    assert not torch.allclose(vs, exact.layers[0].values, atol=1e-3)  # quantized: the equality is not vacuous


LENGTHS = (45, 30, 19)  # left-padded to 45


@pytest.mark.parametrize("rope", ["post", "pre"])
@pytest.mark.parametrize("mode", ["simulated", "packed"])
@pytest.mark.parametrize("name", NAMES)
def test_padded_rows_cache_what_each_prompt_caches_alone(request, name, mode, rope):
    """Cache level, the model's K/V shapes ([B, H_kv, T, head dim]) and its RoPE: prefill of three left-padded rows,
    then decode steps; on its real positions each row holds bit for bit what a cache of that prompt alone holds.
    Padding holds 1e4, which would show in any group it entered."""
    model = tiny_of(name)
    _xfail_rope_pre(request, model, rope)
    H, D = model.config.num_key_value_heads, model.config.head_dim
    cfg = _cfg(2, mode, "torch", rope, sink_tokens=2, exact_window=32 if mode == "packed" else 0)
    rotary, steps, T0 = model.model.rotary_emb, 12, max(LENGTHS)
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(len(LENGTHS), H, T0 + steps, D, generator=g) for _ in "kv")
    k[..., 5] *= 20  # an outlier channel: per-channel groups matter
    mask = torch.stack([(torch.arange(T0) >= T0 - n) for n in LENGTHS]).long()
    pad = (1 - mask)[:, None, :, None].bool()
    batch = QuantizedKVCache(cfg, num_layers=1, rotary_emb=rotary)  # not routed: update returns the K/V it holds
    batch.set_padding(mask)
    alone = [QuantizedKVCache(cfg, num_layers=1, rotary_emb=rotary) for _ in LENGTHS]
    pos = (mask.cumsum(1) - 1).clamp_min(0)  # what generate passes: each row's real tokens at 0, 1, ...
    got = batch.update(k[..., :T0, :].masked_fill(pad, 1e4), v[..., :T0, :].masked_fill(pad, -1e4), 0,
                       kwargs={"position_ids": pos})  # fmt: skip
    rows = [(k[b : b + 1, :, T0 - n :], v[b : b + 1, :, T0 - n :]) for b, n in enumerate(LENGTHS)]  # row b's tokens
    want = [c.update(rk[..., :n, :], rv[..., :n, :], 0, kwargs={"position_ids": torch.arange(n)[None]})
            for c, (rk, rv), n in zip(alone, rows, LENGTHS, strict=True)]  # fmt: skip
    for t in range(steps + 1):
        for b, n in enumerate(LENGTHS):
            assert torch.equal(got[0][b : b + 1, :, T0 - n :], want[b][0]), ("K", b, t)
            assert torch.equal(got[1][b : b + 1, :, T0 - n :], want[b][1]), ("V", b, t)
        if t == steps:
            break
        sk, sv = k[..., T0 + t : T0 + t + 1, :], v[..., T0 + t : T0 + t + 1, :]
        got = batch.update(sk, sv, 0, kwargs={"position_ids": pos[:, -1:] + t + 1})
        want = [c.update(sk[b : b + 1], sv[b : b + 1], 0, kwargs={"position_ids": torch.tensor([[n + t]])})
                for b, (c, n) in enumerate(zip(alone, LENGTHS, strict=True))]  # fmt: skip
    assert not torch.allclose(got[1][:1, :, 2:16], v[:1, :, 2:16], atol=1e-2)  # quantized: the equality is not vacuous


@pytest.mark.parametrize("mode", ["simulated", "packed"])
@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_generates_what_each_prompt_generates_alone(name, mode):
    """Model level, past the sliding window: a left-padded batch through the cache (the CPU kernel in packed mode)
    generates for each row the tokens its prompt generates alone."""
    model = tiny_of(name)
    cfg = _cfg(2, mode, "cpu", sink_tokens=2, exact_window=32 if mode == "packed" else 0)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]
    T0 = max(LENGTHS)
    mask = torch.stack([(torch.arange(T0) >= T0 - n) for n in LENGTHS]).long()
    ids = torch.zeros(len(LENGTHS), T0, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T0 - len(p) :] = p
    cache = QuantizedKVCache.for_model(model, cfg)
    cache.set_padding(mask)
    out = gen(model, cache, ids, 20, mask)
    for b, p in enumerate(prompts):
        assert torch.equal(out[b : b + 1], gen(model, QuantizedKVCache.for_model(model, cfg), p[None], 20)), b


@pytest.mark.parametrize("name", NAMES)
def test_probes_recompute_each_layers_own_attention(name):
    """The error probes recompute attention from the captured q/k/v: on every layer type (a sliding-window layer
    past its window included) that must be the attention the model computed, and a 16-bit cache must measure zero
    error everywhere."""
    from kvq_lab.probes import capture_qkv, probe_model
    from kvq_lab.probes.errors import reference_output
    from kvq_lab.probes.settings import ERROR_QUANTITIES

    model, ids = tiny_of(name), _ids()[:, :PROMPT]
    caps = capture_qkv(model, ids)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(caps)
    assert [c.window for c in caps] == [WINDOW if t == "sliding_attention" else None for t in types]
    for c in caps:
        torch.testing.assert_close(reference_output(c), c.output, rtol=1e-4, atol=1e-5)
    res = probe_model(model, [ids], _cfg(16, "simulated", "torch"))
    assert res.windows == [c.window for c in caps]
    assert all((res.tables[q]["rel_fro"] == 0).all() for q in ERROR_QUANTITIES)


@pytest.mark.slow  # seconds (make check leaves it to make test)
def test_what_a_models_files_say_it_cannot_do_is_refused_before_load(data_dir):
    """A base model's GGUF has no chat template (retrieval and behavior prompt through one), and Gemma 3's RoPE differs
    between layer types (rope=pre does not model that yet): both refused in one line from the files, before any load."""
    from helpers_models import compose

    from kvq_lab.run.config import validate

    if loading.embedded_gguf("gemma3-270m") is None:
        pytest.skip("gemma3-270m is not installed (scripts/setup.sh)")
    args = ["model=gemma3-270m", f"data_dir={data_dir}", "logger=none"]
    with pytest.raises(
        ConfigError, match=r"^task=retrieval prompts through the model's chat template.*task.prompt=plain"
    ):
        validate(compose([*args, "task=retrieval"]))
    validate(compose([*args, "task=retrieval", "task.prompt=plain"]))
    with pytest.raises(ConfigError, match=r"^rope=pre \(rope_pre\) on model=gemma3-270m: .*use rope=post"):
        validate(compose([*args, "rope=pre"]))
    validate(compose([*args, "rope=pre", "bits=16"]))  # nothing quantized: nothing rotated
    validate(compose(["model=smollm2-135m", f"data_dir={data_dir}", "logger=none", "task=retrieval", "rope=pre"]))
