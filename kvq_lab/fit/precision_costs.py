"""Layer-wise mixed precision, the bytes: what each choice of bits costs one unit (a layer, or one KV head of a
layer), counted as `nbytes()` counts it. The search (`kvq_lab.fit.precision`) budgets with these costs; the check
before the load (`kvq_lab.preflight.model`) reads the same bytes from the model's files.

Bytes, "everything counted as `nbytes()` counts": one packed-cache layer with the run's residual window, sinks,
transforms and the model's (heads, head dim, dtype) is filled with `precision.tokens` tokens per choice, and its
key and value streams' `nbytes()` (codes, fp16 parameters, exact window) plus its sinks are what a choice costs.
Simulated-mode runs store nothing; they are budgeted as the packed cache with the same quantizers (R = 0) would
store them. The budget is in bits per cached K/V element: stored bits / (2 L H_kv T D).

`precision.granularity=head`: the bytes of a one-head layer (a layer's streams, sinks and window are per head, so
H_kv of them are the layer's, checked on every measurement).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvq_lab.cache.config import CacheConfig


@dataclass
class Costs:
    """Bytes of one unit (a layer, or at head granularity one KV head of a layer) at T tokens: `key[b]`, `value[b]`
    for each choice b (that tensor's stream as stored), and `fixed` (sinks and other state, the same for every
    choice); `shared`: bytes a cache holds once for all its layers (rope=pre's position ids). `elements`: 2 H T D, K
    and V, H the unit's heads. `heads`: units per layer (1, or H_kv at head granularity)."""

    key: dict[int, int]
    value: dict[int, int]
    fixed: int
    elements: int
    layers: int
    shared: int = 0
    heads: int = 1

    @property
    def units(self) -> int:
        return self.layers * self.heads

    def bits(self, key_bits: list, value_bits: list) -> float:
        """Stored bits per K/V element of an assignment (per layer, or per layer a list per head), as `nbytes()`
        counts them."""
        kb, vb = flat(key_bits), flat(value_bits)
        streams = sum(self.key[k] + self.value[v] for k, v in zip(kb, vb, strict=True))
        total = self.units * self.fixed + self.shared + streams
        return 8 * total / (self.units * self.elements)


def flat(bits: list) -> list[int]:
    """Per-layer bits, or per-layer lists of per-head bits, as one list of units."""
    return [b for x in bits for b in (x if isinstance(x, list) else [x])]


def measure_costs(model, cache: CacheConfig, choices: list[int], tokens: int, granularity: str = "layer") -> Costs:
    """`shape_costs` with the loaded model's shape, dtype, device and rotary module."""
    text_cfg = model.config.get_text_config(decoder=True)
    D = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    w = next(model.parameters())
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    shape = (text_cfg.num_hidden_layers, text_cfg.num_key_value_heads, D)
    return shape_costs(shape, w.dtype, cache, choices, tokens, granularity, w.device, rotary)


class _AnyRope:
    """A rotary module for counting bytes before the model loads (`rope=pre`): standard RoPE cos/sin [B, T, D]; the
    bytes stored do not depend on the frequencies."""

    def __init__(self, head_dim: int):
        self.D = head_dim

    def __call__(self, x, position_ids):
        import torch

        inv = 10000.0 ** (-torch.arange(0, self.D, 2, dtype=torch.float32, device=x.device) / self.D)
        ang = position_ids.float()[..., None] * inv
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos(), emb.sin()


def shape_costs(
    shape: tuple[int, int, int],
    dtype,
    cache: CacheConfig,
    choices: list[int],
    tokens: int,
    granularity: str = "layer",
    device="cpu",
    rotary=None,
) -> Costs:
    """Fill one packed layer of a model of `shape` (decoder layers, KV heads, head dim) and `dtype` (a torch dtype or
    its name) with `tokens` random tokens per choice and read its streams' bytes (module docstring); granularity=head:
    a one-head layer's, checked to be 1/H_kv of the layer's. Needs no model: the check before the load reads the
    same bytes from the model's files (`check_budget`); `rotary` (rope=pre): the model's rotary module, else one
    that counts the same."""
    import torch

    from kvq_lab.cache import QuantizedKVCache

    L, H, D = shape
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    R = cache.exact_window  # 0 in a mode without a window: budgeted as the packed cache without one
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, H, tokens, D, generator=gen).to(device, dtype)
    v = torch.randn(1, H, tokens, D, generator=gen).to(device, dtype)
    if cache.rope == "pre" and rotary is None:
        rotary = _AnyRope(D)

    def one(heads: int) -> tuple[dict, dict, int, int]:
        key, value, fixed = {}, {}, None
        for b in choices:
            c = replace(cache, mode="packed", prefill=None, exact_window=R, backend="torch", layers=())
            c = replace(c, key=replace(c.key, bits=b), value=replace(c.value, bits=b))
            c.check_head_dim(D)
            layer = QuantizedKVCache(c, 1, rotary_emb=rotary).layers[0]
            layer.update(k[:, :heads], v[:, :heads])
            key[b], value[b] = layer.k_stream.nbytes(), layer.v_stream.nbytes()
            shared = 0 if layer._log is None else layer._log.nbytes_for(layer)  # counted by this layer, held once
            f = layer.nbytes()[0] - key[b] - value[b] - shared
            if fixed is not None and f != fixed:
                raise RuntimeError(f"the packed layer's fixed bytes changed with the bits ({fixed} vs {f})")
            fixed = f
        return key, value, fixed, shared

    key, value, fixed, shared = one(H)
    if granularity == "layer":
        return Costs(key, value, fixed, 2 * H * tokens * D, L, shared)
    hk, hv, hf, _ = one(1)
    if (
        [H * hk[b] for b in choices] != [key[b] for b in choices]
        or H * hf != fixed
        or [H * hv[b] for b in choices] != [value[b] for b in choices]
    ):
        raise RuntimeError(
            "a packed layer's bytes are not H_kv times a one-head layer's: per-head costs would be wrong"
        )
    return Costs(hk, hv, hf, 2 * tokens * D, L, shared, heads=H)
