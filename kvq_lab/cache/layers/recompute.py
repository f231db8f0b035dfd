"""Recompute ("XQuant-like") cache layer: cache the attention block's input X, rematerialize K and V at decode.

XQuant (Tomar et al. 2025, arXiv:2508.10395) caches the quantized normalized layer input X (what `k_proj` and
`v_proj` read) instead of K and V, and recomputes K = RoPE(X W_k^T + b_k) and V = X W_v^T + b_v for every cached
token at each decode step: more arithmetic, fewer bytes. For GQA models X is wider than K and V together (SmolLM2:
576 vs 2 * 3 * 64 = 384 values per token and layer), so XQuant caches a low-rank projection instead:

    W = [W_k; W_v]  [(H_k + H_v) D, d]  =  U S V^T,   V_r = the top-r right singular vectors  [d, r]
    stored    Z = X V_r                    [B, 1, T, r]   (r = d, i.e. `rank=None`: Z = X, no projection)
    rebuilt   K_pre = Z (W_k V_r)^T + b_k,  V = Z (W_v V_r)^T + b_v,  K = RoPE(K_pre) at the tokens' positions

With r = rank(W) (<= (H_k + H_v) D) the projection loses nothing (W's rows lie in the span of V_r); below it,
the smallest singular directions of W are dropped.

Storage: Z is one `[B, 1, T, r]` tensor under the key quantizer (`cfg.key`: bits, format, group size, axis) with
the packed cache's streaming and storage (`kvq_lab.cache.storage.streams`: sinks exact, residual window exact, history
bit-packed). The value quantizer must equal the key's (`CacheConfig` checks). Prefill attention reads the exact K/V
the model computed (as the packed cache does); decode steps read K/V rebuilt from the stored Z. Positions are not
stored: each row's positions are its token order after its left padding (what `generate` passes; checked at every
update), so `nbytes()` is Z's codes, parameters, window and sinks.

Capture: `prepare_model` (called by `QuantizedKVCache.for_model`) installs one forward pre-hook on each attention
module, once per model. The hook finds the cache in the attention's kwargs and, when that cache's layer is a
`RecomputeLayer`, hands it the module's `hidden_states` (X) before `cache.update` runs; other caches are untouched.
The first update checks the rebuilt K/V against the model's own (an attention that is not `k_proj`/`v_proj` +
Llama RoPE fails there, in one line, instead of generating from wrong keys).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvq_lab.cache.layers.base import PaddingState, QuantizedLayerBase, register_layer
from kvq_lab.cache.routing.backends import get_backend
from kvq_lab.cache.routing.rope import position_ids_from
from kvq_lab.cache.storage.rows import left_padded_sinks
from kvq_lab.cache.storage.store import tensor_bytes
from kvq_lab.cache.storage.streams import make_stream
from kvq_lab.quant.spec import QuantConfigError
from kvq_lab.quant.transforms.rope_pre import rotate

log = logging.getLogger("kvq_lab")
_HOOK = "_kvq_recompute_hook"  # attribute marking an attention module whose X is captured
_PROJ = "_kvq_recompute_proj"  # per-module memo of projections by rank (an SVD per layer, once per model)


class RecomputeError(QuantConfigError):
    """The model cannot be served by mode=recompute; the message names the module and the fix."""


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of each decoder layer, in layer order; RecomputeError (one line) unless every one has
    separate `k_proj` and `v_proj` linear maps and no key norm (what the rematerialization assumes)."""
    found = {}
    for name, m in model.named_modules():
        if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int):
            found.setdefault(m.layer_idx, (name, m))
    if not found:
        raise RecomputeError(
            f"mode=recompute: {type(model).__name__} has no attention modules with a layer_idx (Llama-style "
            "decoder layers); use mode=packed or mode=simulated"
        )
    mods = [found[i] for i in sorted(found)]
    for name, m in mods:
        kp, vp = getattr(m, "k_proj", None), getattr(m, "v_proj", None)
        if not (isinstance(kp, nn.Linear) and isinstance(vp, nn.Linear)):
            raise RecomputeError(
                f"mode=recompute needs separate k_proj/v_proj linear maps; {name} ({type(m).__name__}) has none "
                "(a fused QKV projection); use mode=packed or mode=simulated"
            )
        if getattr(m, "k_norm", None) is not None:
            raise RecomputeError(
                f"mode=recompute rebuilds K as RoPE(X W_k^T); {name} ({type(m).__name__}) normalizes keys (k_norm); "
                "use mode=packed or mode=simulated"
            )
    return [m for _, m in mods]


def kv_widths(attn: nn.Module) -> tuple[int, int]:
    """(d, K+V output width) of one attention module: X's width and the rows of [W_k; W_v]."""
    return attn.k_proj.in_features, attn.k_proj.out_features + attn.v_proj.out_features


def check_rank(rank: int | None, d: int, kv_out: int) -> None:
    """rank within [1, min(d, K+V output dims)]: beyond that [W_k; W_v] has no more singular vectors."""
    if rank is None:
        return
    top = min(d, kv_out)
    if rank < 1 or rank > top:
        raise RecomputeError(
            f"recompute.rank={rank} is outside [1, {top}]: [W_k; W_v] is {kv_out} x {d} (K+V output dims x hidden "
            f"size), so it has {top} right singular vectors; pick 1..{top}, or null to cache X itself"
        )


def check_model_architecture(model: nn.Module, rank: int | None, spec=None) -> list[nn.Module]:
    """Every check of mode=recompute against a model (a loaded one, or one built on the meta device from its config
    before loading): separable K/V projections, the rank, and per-token groups tiling X's width."""
    mods = attention_modules(model)
    d, kv_out = kv_widths(mods[0])
    check_rank(rank, d, kv_out)
    if spec is not None:
        spec.check_head_dim(rank or d, "group_size (recompute: X's width)" if rank is None else "group_size (rank)")
    return mods


def check_model_config(path: str, rank: int | None, spec=None) -> None:
    """Check a model folder for mode=recompute before its weights load: the architecture is instantiated from its
    config.json on the meta device (no weights, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_model_architecture(model, rank, spec)


class Projection:
    """What one attention layer's cache stores of X and how K and V are rebuilt from it (see the module docstring).

    basis: V_r [d, r] in the model's dtype, or None (rank None: Z = X); wk [H_k D, r], wv [H_v D, r] and the biases
    map Z to pre-RoPE K and to V. Without a basis they are the module's own weights (the model's arithmetic)."""

    def __init__(self, attn: nn.Module, rank: int | None):
        self.heads = attn.k_proj.out_features // attn.head_dim
        self.head_dim = attn.head_dim
        wk, wv = attn.k_proj.weight.detach(), attn.v_proj.weight.detach()
        self.bk = None if attn.k_proj.bias is None else attn.k_proj.bias.detach()
        self.bv = None if attn.v_proj.bias is None else attn.v_proj.bias.detach()
        if rank is None:
            self.basis, self.wk, self.wv = None, wk, wv
            return
        # SVD in float64 on the CPU: the basis is a property of the weights, computed once per model and rank
        w = torch.cat([wk, wv]).double().cpu()
        _, _, vh = torch.linalg.svd(w, full_matrices=False)
        basis = vh[:rank].T  # [d, r], orthonormal columns
        self.basis = basis.to(wk.dtype).to(wk.device)
        self.wk = (wk.double().cpu() @ basis).to(wk.dtype).to(wk.device)  # W_k V_r [H_k D, r]
        self.wv = (wv.double().cpu() @ basis).to(wv.dtype).to(wv.device)

    @property
    def width(self) -> int:
        return self.wk.shape[1]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> Z [B, 1, T, r] (X itself where there is no basis)."""
        z = x if self.basis is None else x @ self.basis
        return z.unsqueeze(1)

    def decode(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Z [B, 1, N, r] -> (pre-RoPE K, V), each [B, H_k, N, D] (the attention layer's reshape)."""
        z = z[:, 0]
        B, N, _ = z.shape
        k = nn.functional.linear(z, self.wk, self.bk).view(B, N, self.heads, self.head_dim).transpose(1, 2)
        v = nn.functional.linear(z, self.wv, self.bv).view(B, N, self.heads, self.head_dim).transpose(1, 2)
        return k, v

    @classmethod
    def of(cls, attn: nn.Module, rank: int | None) -> Projection:
        memo = attn.__dict__.setdefault(_PROJ, {})
        if rank not in memo:
            memo[rank] = cls(attn, rank)
        return memo[rank]


def _capture_x(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of an attention module: hand X to the cache layer of a recompute cache (others: nothing)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", None)
    if not layers or module.layer_idx >= len(layers):
        return
    layer = layers[module.layer_idx]
    if isinstance(layer, RecomputeLayer):
        layer.pending_x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


@register_layer("recompute")
class RecomputeLayer(QuantizedLayerBase):
    """One attention layer's recompute cache: Z = X V_r stored (sinks, quantized history, exact window), K and V
    rebuilt from it at every decode step (module docstring). `proj` is set by `prepare_model`."""

    needs_forward = True  # `update` needs X from the attention's forward (`QuantizedKVCache.needs_forward`)

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self._args = (cfg, rope, padding)
        self.backend = get_backend(cfg.backend, (cfg.key,))
        self.stream = make_stream(cfg.key, cfg.exact_window, cfg.sink_tokens, self.backend)
        self.proj: Projection | None = None
        self.pending_x: torch.Tensor | None = None  # X [B, T, d] of the forward in progress, from the hook
        self.sink: torch.Tensor | None = None  # [B, 1, S, r] exact Z of each row's first S real tokens
        self.N = 0
        self.pads: list[int] = []
        self.checked = False

    # -- hooks ---------------------------------------------------------------------------------------------------
    @staticmethod
    def prepare_model(model, cache) -> None:
        """Give each layer its projection and capture X with a pre-hook on each attention module (once per model)."""
        mods = check_model_architecture(model, cache.cfg.recompute_rank, cache.cfg.key)
        if len(mods) != len(cache.layers):
            raise RecomputeError(f"the model has {len(mods)} attention modules for {len(cache.layers)} cache layers")
        for attn, layer in zip(mods, cache.layers, strict=True):
            layer.proj = Projection.of(attn, cache.cfg.recompute_rank)
            layer._fit_backend()
            if not hasattr(attn, _HOOK):
                setattr(attn, _HOOK, attn.register_forward_pre_hook(_capture_x, with_kwargs=True))

    def _fit_backend(self) -> None:
        """The Triton kernels take power-of-two widths only: X's (SmolLM2: 576) or an odd rank go to the PyTorch
        path under backend=auto (one warning), and fail here, before any token, under backend=triton."""
        w, G = self.proj.width, self.cfg.key.group_size
        if self.backend.name != "triton" or self.cfg.key.is_identity or not (w & (w - 1) or G & (G - 1)):
            return
        if self.cfg.backend == "triton":
            raise RecomputeError(
                f"backend=triton needs a power-of-two width of the cached X and group size (width {w}, G={G}); "
                "use recompute.rank=<a power of two> or backend=torch"
            )
        if self.layer_idx == 0:
            log.warning("mode=recompute: X's width %d is not a power of two; the PyTorch path stores it", w)
        self.backend = get_backend("torch")
        self.stream = make_stream(self.cfg.key, self.cfg.exact_window, self.cfg.sink_tokens, self.backend)

    def get_seq_length(self) -> int:
        return self.N

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.N + query_length, 0

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        # shape-only placeholders: DynamicLayer code reads self.keys for batch, heads and head_dim
        self.keys = key_states.new_empty(key_states.shape[0], key_states.shape[1], 0, key_states.shape[3])
        self.values = self.keys

    # -- update --------------------------------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states [B, H_k, n, D] as the model made them (K after RoPE) -> K, V [B, H_k, N, D]:
        exact on the prefill, rebuilt from the stored Z otherwise."""
        x, self.pending_x = self.pending_x, None
        if x is None or self.proj is None:
            raise RuntimeError(
                "mode=recompute: the layer received no X; build the cache with QuantizedKVCache.for_model(model, cfg) "
                "so the attention modules are hooked"
            )
        B, _, n, _ = key_states.shape
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_finite(key_states, value_states)
        z = self.proj.encode(x)  # [B, 1, n, r]
        start = self.N
        if start == 0:
            self._prefill(z)
        else:
            for t in range(n):  # decode (n = 1), or chunked prefill absorbed token by token
                self._step(z[:, :, t : t + 1])
        self._check_positions(position_ids_from(kwargs, B, start, n, key_states.device), start)
        if not self.checked:
            self._check_rebuild(z, key_states, value_states, start)
        if start == 0:
            return key_states, value_states  # prefill attention reads what the model computed (as packed mode)
        return self.rebuild()

    def _prefill(self, z: torch.Tensor) -> None:
        """z [B, 1, N, r]: the prefill's Z; pads and exact sinks laid out as the packed cache lays them out."""
        self.pads, (self.sink,) = left_padded_sinks(self.padding, self.cfg.sink_tokens, z, what="the recompute cache")
        self.N = z.shape[2]
        self.stream.prefill(z, self.pads)

    def _step(self, z: torch.Tensor) -> None:
        N, S = self.N, self.cfg.sink_tokens
        self.N = N + 1
        owns = None
        if any(self.pads) or N < S:
            j = [N - p for p in self.pads]  # the new token's index among each row's real tokens
            for b, jj in enumerate(j):
                if jj < S:
                    self.sink[b, :, jj] = z[b, :, 0]
            owns = [jj >= S for jj in j]
        self.stream.step(z, N, self.pads, owns)

    def positions(self, like: torch.Tensor) -> torch.Tensor:
        """Position ids [B, N] of every cached position: each row's token order after its padding (0 on padding)."""
        a = torch.arange(self.N, device=like.device).expand(len(self.pads), self.N)
        return (a - torch.tensor(self.pads, device=like.device)[:, None]).clamp(min=0)

    def _check_positions(self, given: torch.Tensor, start: int) -> None:
        """RoPE is redone at positions implied by the token order; a caller that shifts positions is refused.
        given: the position ids [B, n] the model rotated this update's keys with."""
        n = given.shape[1]
        a = torch.arange(start, start + n, device=given.device)
        j = a[None, :] - torch.tensor(self.pads, device=given.device)[:, None]  # index among the row's real tokens
        real = j >= 0
        if not torch.equal(given.to(j.dtype)[real], j[real]):
            raise ValueError(
                "mode=recompute rebuilds keys at positions implied by the token order (after left padding); this "
                "call passed other position_ids (shifted or packed sequences are not supported)"
            )

    def _check_rebuild(self, z: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, start: int):
        """Once: K and V rebuilt from the exact Z of this update must be the model's (up to the projection's rank)."""
        k_pre, v = self.proj.decode(z)
        cos, sin = self._cos_sin(k_pre, start)
        k = rotate(k_pre, cos[:, :, start:], sin[:, :, start:])
        scale = max(float(key_states.abs().max()), float(value_states.abs().max()), 1e-6)
        err = max(float((k - key_states).abs().max()), float((v - value_states).abs().max())) / scale
        tol = 1e-2 if self.proj.basis is None else 1.0  # a low rank drops directions: only gross mismatches fail
        if err > tol:
            raise RecomputeError(
                f"mode=recompute: layer {self.layer_idx} rebuilt K/V differ from the model's by {err:.2g} (relative "
                "max); its attention is not k_proj/v_proj + Llama RoPE; use mode=packed or mode=simulated"
            )
        self.checked = True

    def _cos_sin(self, like: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, N, D] fp32 at every cached position (a model without RoPE: identity rotation)."""
        ids = self.positions(like)
        if self.rope is None:
            ones = torch.ones(*ids.shape, like.shape[-1], device=like.device).unsqueeze(1)
            return ones, torch.zeros_like(ones)
        return self.rope.cos_sin(like, ids)

    def rebuild(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K (RoPE at each position), V [B, H_k, N, D] in the model's dtype, from the stored Z (dequantized)."""
        z = self.stream.materialize(self.N, self.sink, self.pads, None)
        k_pre, v = self.proj.decode(z.to(self.proj.wk.dtype))
        cos, sin = self._cos_sin(k_pre, 0)
        return rotate(k_pre, cos, sin), v

    # -- accounting ----------------------------------------------------------------------------------------------
    @staticmethod
    def stored_bytes(cfg, n_tokens: int, shape) -> int:
        """Bytes one layer keeps after a prompt of n_tokens (batch 1): Z [1, 1, n, r] (r: the rank, else the model's
        hidden size) through this layer's own sinks and stream, in the model's dtype: what `nbytes()` counts."""
        width = cfg.recompute_rank or shape.hidden
        gen = torch.Generator().manual_seed(0)
        z = torch.randn(1, 1, n_tokens, width, generator=gen).to(shape.dtype)
        stream = make_stream(cfg.key, cfg.exact_window, cfg.sink_tokens, get_backend("torch"))
        pads, (sink,) = left_padded_sinks(PaddingState(), cfg.sink_tokens, z, what="the recompute cache")
        stream.prefill(z, pads)
        return tensor_bytes(sink) + stream.nbytes()

    @staticmethod
    def stored_bits(cfg, n_tokens: int, shape) -> tuple[float, float]:
        """Stored bits per K/V element of one layer (Z's bytes over the same tokens as K and V): one tensor, so one
        number for both."""
        b = 8 * RecomputeLayer.stored_bytes(cfg, n_tokens, shape) / (2 * shape.heads * n_tokens * shape.head_dim)
        return b, b

    def nbytes(self) -> tuple[int, int]:
        """(stored, fp16): bytes of Z as kept (sinks, codes and parameters, exact window), and the same tokens as
        an fp16 K/V cache."""
        if not self.is_initialized or self.N == 0:
            return 0, 0
        B, H, D = self.keys.shape[0], self.keys.shape[1], self.keys.shape[3]
        return tensor_bytes(self.sink) + self.stream.nbytes(), 2 * B * H * self.N * D * 2

    def reset(self) -> None:
        """Forget everything stored (the projection and the layer index are kept)."""
        proj, idx = self.proj, self.layer_idx
        self.__init__(*self._args)
        self.proj, self.layer_idx = proj, idx

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("the recompute cache does not support beam search / batch expansion")

    def batch_select_indices(self, indices):
        raise NotImplementedError("the recompute cache does not support batch selection")

    def crop(self, max_length):
        raise NotImplementedError("the recompute cache cannot be cropped (quantized history is final)")
