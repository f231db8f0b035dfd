"""What a quantized KV cache does: one frozen record, built from the run config, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvq_lab.cache.labels import label
from kvq_lab.cache.modes import MODES, Capabilities, capabilities
from kvq_lab.cache.policies import get_policy
from kvq_lab.quant.residuals import Chain, build_chain, check_residuals
from kvq_lab.quant.residuals import check_head_dim as check_residual_head_dim
from kvq_lab.quant.spec import BITS, INT_BITS, QuantConfigError, QuantSpec
from kvq_lab.quant.transforms import Pipeline, build_pipeline, check_head_dim, check_transforms

ROPE = ("post", "pre")
BACKENDS = ("auto", "torch", "cpu", "triton")
PREFILL = ("exact", "quantized")
SLIDING_WINDOW = "sliding_window"  # skip_layers: the model's sliding-window layers


def check_format(spec: QuantSpec, bits_name: str = "bits", format_name: str = "format") -> None:
    """One-line QuantConfigError unless the spec's code format exists, takes its bits (fp8: 8) and its options
    (lut: a codebook). `int` without options at one of its widths (`INT_BITS`) needs no registry, so the default
    config stays free of torch; other formats (and int at a width it does not take) look the format up in
    the registry, which imports its plugin (torch) here."""
    if spec.is_identity or (spec.format == "int" and not spec.format_options() and spec.bits in INT_BITS):
        return
    from kvq_lab.quant.formats import get_format

    get_format(spec.format, spec.bits, bits_name, format_name, **spec.format_options())


@dataclass(frozen=True)
class CacheConfig:
    """Independent key and value quantizers plus the cache policy.

    mode:
        `simulated` -> KIVI Table 1 "fake quant": every cached token, prefill included, is quantized and
                       dequantized; attention sees the result. Partial per-channel groups are zero-padded.
        `packed`    -> the real cache: low-bit codes stored, KIVI streaming (exact prefill, fp residual window).
        `recompute` -> XQuant-like: the attention block's normalized input X is cached instead of K and V, with the
                       key quantizer and the packed cache's streaming; K and V are rematerialized at each decode
                       step (`kvq_lab.cache.layers.recompute`). The value quantizer must equal the key's (one tensor).
    prefill: what attention reads in the prompt's forward (the first update of an empty cache): `exact` (the K/V as
        the model computed them; the cache quantizes them afterwards) or `quantized` (what the cache stores). None:
        the mode's own (simulated quantized, packed and recompute exact), and tasks that prefill on their own
        (`task.prompt_forward=exact`: exact K/V handed to the cache) keep doing so.
    exact_window: R, the full-precision window of the packed cache (a multiple of the key group size).
    sink_tokens: the first N tokens of every sequence are kept in full precision (both modes).
    rope: `post` quantizes keys after RoPE (KIVI); `pre` quantizes them before RoPE and re-rotates the
        dequantized keys at their positions (KVQuant): an alias of `rope_pre` first in `key_transform`.
    key_transform, value_transform: transforms around each quantizer (`kvq_lab.quant.transforms`), canonical
        spellings in order, e.g. ("rope_pre", "hadamard"); a name, `none` or a list is accepted and normalised.
    key.format, value.format: each quantizer's code format (`QuantSpec.format`: int, fp8_e4m3, fp8_e5m2, lut, nuq,
        nvfp4, ...: `kvq_lab.quant.formats`), checked here against its bits (fp8: 8 only) and options.
    key_outliers, value_outliers: the fraction of elements kept exact in a sparse structure (`kvq_lab.quant.outliers`:
        per-channel thresholds for keys, the top |v| of each token for values), in [0, 0.5).
    key_residual, value_residual: corrections of each quantizer's error (`kvq_lab.quant.residuals`: `qjl:<m>`,
        `sparse:<frac>`), canonical spellings in order; stored per token beside the codes and counted in `nbytes()`.
    key_outlier_thresholds: the fitted per-channel key thresholds of one layer (H * D floats), set by calibration.
    policy, policy_options: which tokens are stored and at how many bits (`kvq_lab.cache.policies`: `kivi`, the
        default, stores every token as `mode` says; token policies split the prompt into tiers), with every option of
        the policy (its defaults filled in).
    skip_layers: decoder layers left unquantized (16 bits, stored as the model made them): layer indices, or
        `sliding_window` until `resolve_layers` names that model's sliding-window layers.
    layers: one config per decoder layer, fitted by calibration (`kvq_lab.fit.calibration`: nuq codebooks as lut specs,
        fitted transforms, key outlier thresholds) or set by the per-layer bits search (`kvq_lab.fit.precision`);
        empty when nothing is fitted. `for_layer(i)` picks one.
    head_bits: one layer's (key bits, value bits) per KV head, set by the bits search at head granularity
        (`precision.granularity=head`); empty: every head at `key.bits` / `value.bits`. `head_groups()` gives the
        heads of each width, which `kvq_lab.cache.layers.heads.HeadsLayer` stores as one layer each.
    """

    key: QuantSpec = field(default_factory=lambda: QuantSpec(2, 32, "channel"))
    value: QuantSpec = field(default_factory=lambda: QuantSpec(2, 32, "token"))
    mode: str = "simulated"
    prefill: str | None = None
    exact_window: int = 0
    sink_tokens: int = 0
    rope: str = "post"
    backend: str = "auto"
    key_transform: tuple[str, ...] = ()
    value_transform: tuple[str, ...] = ()
    recompute_rank: int | None = None  # mode=recompute: cache X's projection on the top-r right singular vectors
    key_outliers: float = 0.0
    value_outliers: float = 0.0
    key_residual: tuple[str, ...] = ()
    value_residual: tuple[str, ...] = ()
    key_outlier_thresholds: tuple[float, ...] | None = None
    layers: tuple[CacheConfig, ...] = ()
    skip_layers: tuple[int, ...] | str = ()
    policy: str = "kivi"
    policy_options: tuple[tuple[str, Any], ...] = ()
    head_bits: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise QuantConfigError(f"mode={self.mode!r} is not allowed; choose one of: {', '.join(MODES)}")
        if self.prefill is not None and self.prefill not in PREFILL:
            raise QuantConfigError(
                f"prefill={self.prefill!r} is not allowed; choose exact, quantized or null (the mode's own)"
            )
        if not self.caps.quantized_prefill and self.prefill == "quantized":
            raise QuantConfigError(
                f"prefill=quantized with mode={self.mode}: the cache rebuilds K and V from X at decode steps only, its "
                "prefill attention reads the model's own K/V; use prefill=exact or mode=simulated/packed"
            )
        if self.rope not in ROPE:
            raise QuantConfigError(f"rope={self.rope!r} is not allowed; choose one of: {', '.join(ROPE)}")
        kt = check_transforms(self.key_transform, "key", "key_transform")
        if self.rope == "pre" and "rope_pre" not in kt:
            kt = ("rope_pre", *kt)  # rope=pre is the alias; rope_pre must come first, so it goes first
        object.__setattr__(self, "key_transform", kt)
        object.__setattr__(self, "value_transform", check_transforms(self.value_transform, "value", "value_transform"))
        object.__setattr__(self, "rope", "pre" if "rope_pre" in kt else "post")  # one config, however it was spelled
        if self.backend not in BACKENDS:
            raise QuantConfigError(f"backend={self.backend!r} is not allowed; choose one of: {', '.join(BACKENDS)}")
        for tensor, spec in (("key", self.key), ("value", self.value)):
            check_format(spec, f"{tensor}_bits", f"{tensor}_format")
        for name in ("exact_window", "sink_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise QuantConfigError(f"{name}={v!r} must be an integer >= 0")
        for name in ("key_outliers", "value_outliers"):
            f = getattr(self, name)
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 0.5:
                raise QuantConfigError(f"{name}={f!r} must be a fraction in [0, 0.5) (e.g. 0.01: 1% kept exact)")
            object.__setattr__(self, name, float(f))
        for tensor, spec in (("key", self.key), ("value", self.value)):
            knob = f"{tensor}_residual"
            spellings = check_residuals(getattr(self, knob), knob)
            object.__setattr__(self, knob, spellings)
            if spellings and spec.is_identity:
                raise QuantConfigError(
                    f"{knob}={','.join(spellings)} corrects a quantizer's error, but {tensor}s are not quantized "
                    f"({tensor}_bits=16): unset {knob} or quantize {tensor}s"
                )
        if self.key_outlier_thresholds is not None:
            object.__setattr__(self, "key_outlier_thresholds", tuple(map(float, self.key_outlier_thresholds)))
        object.__setattr__(self, "layers", tuple(self.layers))
        self._check_skip_layers()
        self._check_policy()
        self._check_head_bits()
        if not self.caps.residual_window and self.exact_window:
            raise QuantConfigError(
                f"exact_window={self.exact_window} applies to mode=packed only: simulated mode quantizes every "
                "cached token (KIVI Table 1); set exact_window=0 or mode=packed"
            )
        self._check_recompute()
        if self.caps.residual_window and self.exact_window % self.key.group_size and not self.key.is_identity:
            raise QuantConfigError(
                f"exact_window={self.exact_window} must be a multiple of the key group size "
                f"{self.key.group_size} (keys are flushed in whole groups); e.g. exact_window="
                f"{max(self.key.group_size, self.exact_window // self.key.group_size * self.key.group_size)}"
            )
        self._check_residual_units()

    def _check_policy(self) -> None:
        policy = get_policy(self.policy, dict(self.policy_options))
        object.__setattr__(self, "policy_options", policy.options())
        policy.check(self)

    def _check_head_bits(self) -> None:
        v = self.head_bits
        pairs = [tuple(p) for p in v] if isinstance(v, (list, tuple)) else None
        if pairs is None or any(len(p) != 2 or any(isinstance(b, bool) or b not in BITS for b in p) for p in pairs):
            raise QuantConfigError(
                f"head_bits={v!r} must list (key bits, value bits) per KV head, bits among {', '.join(map(str, BITS))}"
            )
        object.__setattr__(self, "head_bits", tuple(pairs))
        if not pairs:
            return
        if not self.caps.per_layer_precision:
            raise QuantConfigError(f"per-head bits with mode={self.mode}: X is one tensor for all heads; use packed")
        if self.splits_tokens:
            raise QuantConfigError(
                f"per-head bits with policy={self.policy}: a token policy's tiers hold every head at one width; use "
                "policy=kivi or per-layer bits (precision.granularity=layer)"
            )
        if self.layers:
            raise QuantConfigError("head_bits belong to one layer's config, not to a cache of per-layer configs")
        for h in range(len(pairs)):  # each width checked against the formats (fp8: 8 bits only)
            try:
                self.for_head(h)
            except QuantConfigError as e:
                raise QuantConfigError(f"head_bits: head {h} at {pairs[h]}: {e}") from None

    def for_head(self, h: int) -> CacheConfig:
        """KV head h's config: this one at its (key bits, value bits), without per-head bits."""
        kb, vb = self.head_bits[h]
        return replace(self, key=replace(self.key, bits=kb), value=replace(self.value, bits=vb), head_bits=())

    def head_groups(self) -> list[tuple[CacheConfig, list[int]]]:
        """[(config, KV heads)] per (key bits, value bits) pair of `head_bits`, in order of first appearance; [] for a
        config without them."""
        if not self.head_bits:
            return []
        groups: dict[tuple[int, int], list[int]] = {}
        for h, pair in enumerate(self.head_bits):
            groups.setdefault(pair, []).append(h)
        return [(self.for_head(idx[0]), idx) for idx in groups.values()]

    def check_heads(self, kv_heads: int, where: str = "the model") -> None:
        """One-line QuantConfigError where a layer's `head_bits` do not name every KV head of the model."""
        for i in range(max(1, len(self.layers))):
            c = self.layers[i] if self.layers else self
            if c.head_bits and len(c.head_bits) != kv_heads:
                raise QuantConfigError(
                    f"per-head bits give layer {i} {len(c.head_bits)} heads but {where} has {kv_heads} KV heads; "
                    "search again for this model (precision=search precision.granularity=head)"
                )

    @property
    def caps(self) -> Capabilities:
        """What this config's mode supports (`kvq_lab.cache.modes`): checks ask it, not the mode's name."""
        return capabilities(self.mode)

    def token_policy(self):
        """The policy (`kvq_lab.cache.policies.Policy`) with its options."""
        return get_policy(self.policy, dict(self.policy_options))

    def tiers(self):
        """The token policy's tiers (`kvq_lab.cache.policies.Tier`), or None (kivi, fakequant: the mode stores every
        token)."""
        return self.token_policy().tiers(self) if self.policy != "kivi" else None

    @property
    def splits_tokens(self) -> bool:
        """A token policy (`kvq_lab.cache.policies.TokenPolicy`): the prompt split into tiers after its forward,
        one prompt at a time (`kvq_lab.cache.layers.tiered`)."""
        from kvq_lab.cache.policies import TokenPolicy

        return isinstance(self.token_policy(), TokenPolicy)

    def _check_skip_layers(self) -> None:
        v = self.skip_layers
        if isinstance(v, str):
            if v != SLIDING_WINDOW:
                raise QuantConfigError(
                    f"skip_layers={v!r}; allowed: none, {SLIDING_WINDOW} or a list of layer indices, e.g. [0,1]"
                )
        else:
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in v):
                raise QuantConfigError(f"skip_layers={list(v)} must list layer indices >= 0, e.g. [0,1]")
            object.__setattr__(self, "skip_layers", tuple(sorted(set(v))))
        if v and not self.caps.per_layer_precision:
            raise QuantConfigError(
                f"skip_layers with mode={self.mode}: every layer caches X, not K/V; unset skip_layers or use "
                "mode=packed"
            )

    def resolve_layers(self, sliding_layers: tuple[int, ...] | None, n_layers: int, model: str = "the model"):
        """This config with `skip_layers` naming layer indices of a model with n_layers decoder layers whose
        sliding-window layers are `sliding_layers` (None: not known). One-line QuantConfigError for a model without
        sliding-window layers given `sliding_window`, or an index past its last layer."""
        v = self.skip_layers
        if v == SLIDING_WINDOW:
            if sliding_layers is None:
                raise QuantConfigError(f"skip_layers=sliding_window: which layers of {model} slide is not known")
            if not sliding_layers:
                raise QuantConfigError(
                    f"skip_layers=sliding_window: {model} has no sliding-window layers (every layer attends to the "
                    "whole context); use skip_layers=none or a list of layers, e.g. [0,1]"
                )
            return replace(self, skip_layers=tuple(sliding_layers))
        if v and max(v) >= n_layers:
            raise QuantConfigError(
                f"skip_layers={list(v)}: {model} has {n_layers} decoder layers (0..{n_layers - 1}); layer {max(v)} "
                "is not one of them"
            )
        return self

    def _check_residual_units(self) -> None:
        """Packed mode flushes a per-channel tensor's window whole: a block correction (`lowrank`) needs whole blocks
        in each flush (per-token tensors keep an incomplete block's error until it completes)."""
        if not self.caps.residual_window:
            return
        for tensor, spec in (("key", self.key), ("value", self.value)):
            chain = self.residual(tensor)
            if chain is None or spec.axis != "channel" or spec.is_identity:
                continue
            window = self.exact_window or spec.group_size
            if window % chain.block:
                raise QuantConfigError(
                    f"{tensor}_residual={','.join(getattr(self, f'{tensor}_residual'))} stores blocks of {chain.block} "
                    f"tokens, but per-channel {tensor}s are flushed {window} at a time "
                    f"(exact_window={self.exact_window}, group_size={spec.group_size}): make exact_window "
                    f"a multiple of {chain.block}"
                )

    def _check_recompute(self) -> None:
        """mode=recompute: one tensor (X) under the key quantizer, no transforms; `recompute_rank` >= 1 or None."""
        r = self.recompute_rank
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise QuantConfigError(f"recompute.rank={r!r} must be an integer >= 1, or null to cache X itself")
        if self.caps.stores_kv:
            if r is not None:
                raise QuantConfigError(f"recompute.rank={r} applies to mode=recompute only; set mode=recompute")
            return
        k, v = self.key, self.value
        if (k.bits, k.format, k.format_options()) != (v.bits, v.format, v.format_options()):
            raise QuantConfigError(
                f"mode=recompute stores one tensor, X, with the key quantizer: the value quantizer ({v.short()}) must "
                f"have the key's bits and format ({k.short()}); set bits= (and format=) for both"
            )
        if self.key_transform or self.value_transform or self.layers or self.key_residual or self.value_residual:
            raise QuantConfigError(
                "mode=recompute quantizes X before the projections: transforms (rope=pre, key_transform, "
                "value_transform), residual corrections and per-layer configs do not apply; unset them"
            )

    def check_head_dim(self, head_dim: int) -> None:
        if not self.caps.stores_kv:  # X's width (hidden size or rank) is checked against the model by the layer
            return
        self.key.check_head_dim(head_dim, "group_size (keys)")
        self.value.check_head_dim(head_dim, "group_size (values)")
        check_head_dim(self.key_transform, head_dim, "key_transform")
        check_head_dim(self.value_transform, head_dim, "value_transform")
        check_residual_head_dim(self.key_residual, head_dim, "key_residual")
        check_residual_head_dim(self.value_residual, head_dim, "value_residual")
        for tier in self.tiers() or ():
            if tier.config is not None:
                tier.config.check_head_dim(head_dim)

    def pipelines(self) -> tuple[Pipeline | None, Pipeline | None]:
        """(keys, values): the transforms each tensor's quantizer is wrapped in, None where none applies (a 16-bit
        quantizer drops those that would only add rounding, e.g. rope_pre)."""
        return (
            build_pipeline(self.key_transform, not self.key.is_identity),
            build_pipeline(self.value_transform, not self.value.is_identity),
        )

    @property
    def quantizes_prefill(self) -> bool:
        """The prompt's forward reads the cache's quantized K/V, set explicitly (`prefill=quantized`, or a policy that
        means it: `policy=fakequant`), with anything quantized: tasks that prefill on their own then forward the
        prompt through the cache."""
        asked = self.prefill == "quantized" or self.token_policy().quantizes_prompt
        return asked and not (self.key.is_identity and self.value.is_identity)

    @property
    def exact_prefill(self) -> bool:
        """The prompt's forward reads the K/V the model computed: `prefill=exact`, or unset outside simulated mode."""
        return self.prefill == "exact" or (self.prefill is None and self.caps.exact_prefill)

    def for_layer(self, i: int) -> CacheConfig:
        """The config of decoder layer i: 16 bits where `skip_layers` names it, else the fitted one where calibration
        made them (`layers`), else this one."""
        if self.skip_layers == SLIDING_WINDOW:
            raise ValueError("skip_layers=sliding_window names no layers until resolve_layers() is given the model's")
        if i in self.skip_layers:
            return self.exact_layer()
        if not self.layers:
            return self
        if not 0 <= i < len(self.layers):
            raise ValueError(f"the calibrated cache config has {len(self.layers)} layers; layer {i} asked")
        return self.layers[i]

    def exact_layer(self) -> CacheConfig:
        """A skipped layer's config: the same cache at 16 bits, nothing stored besides the K/V (DynamicCache's)."""
        k, v = QuantSpec(16, self.key.group_size, self.key.axis), QuantSpec(16, self.value.group_size, self.value.axis)
        keep = {f: getattr(self, f) for f in ("mode", "prefill", "exact_window", "sink_tokens", "backend")}
        return CacheConfig(key=k, value=v, **keep)

    def unfitted(self) -> CacheConfig:
        """This config without its per-layer fits (what the run config describes)."""
        return replace(self, layers=()) if self.layers else self

    def outliers(self, tensor: str):
        """The dense-and-sparse split of `tensor` ("key" / "value", `kvq_lab.quant.outliers.Outliers`), or None."""
        from kvq_lab.quant.outliers import Outliers

        if tensor == "key":
            f = self.key_outliers
            return Outliers(f, "channel", self.key_outlier_thresholds) if f and not self.key.is_identity else None
        f = self.value_outliers
        return Outliers(f, "token") if f and not self.value.is_identity else None

    def reads_dequantized(self) -> bool:
        """The packed cache stores what kernels cannot read from codes (sparse outliers, residual corrections): its
        history is read dequantized, in PyTorch."""
        has = (self.outliers(t) is not None or self.residual(t) is not None for t in ("key", "value"))
        return any(has)

    def residual(self, tensor: str) -> Chain | None:
        """The corrections of `tensor`'s ("key" / "value") quantizer error (`kvq_lab.quant.residuals.Chain`), or
        None."""
        return build_chain(getattr(self, f"{tensor}_residual"))

    def label(self) -> str:
        """e.g. `K2b-C32_V2b-T32_sim`, `K2b-T32_V2b-T32_pac_R32_preRoPE_Khad` (`kvq_lab.cache.labels`)."""
        return label(self)
