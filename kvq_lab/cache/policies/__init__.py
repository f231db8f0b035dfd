"""Cache policies: which tokens a cache keeps, and at how many bits. The registry (`POLICIES`, `register_policy`) and
the base classes; `POLICIES` names the built-in ones ("module:Name", imported on first lookup).

A policy is one file in this folder plus its registry line in `POLICIES`, chosen with `policy=<name>` and its options
`policy.<field>=` (its dataclass fields, checked here with one-line errors). Two kinds:

- `kivi` (the default) adds nothing: the cache's mode stores every token as `mode` says (KIVI's streaming in packed
  mode: exact sinks and window, whole groups flushed; Table 1's fake quant of every token in simulated mode; the
  prompt's forward as `prefill` says). `fakequant` is Table 1's fake quant by name: simulated mode's layers, the
  prompt quantized on every task (`quantizes_prompt`), the packed cache and an exact prefill refused. Their `tiers`
  are None and the cache builds the mode's layers unchanged, so today's outputs are today's
  (tests/cache/test_policies.py checks them bit for bit against outputs saved before policies existed: KIVI's
  streaming through `kivi`, Table 1 through both).
- a `TokenPolicy` splits the prompt, once it has been through the model: the first `sink_tokens` and the last
  `window` tokens stay with the mode's own layer (which then takes the generated tokens too, streaming as `mode`
  says); the tokens between them are ranked by a score (`kvq_lab.cache.policies.scores`: `knorm`, `attention`,
  `snapkv`, `normalized`) and given to tiers in rank order, each tier a share of them stored by the mode's layer at
  the tier's quantizer, or dropped (`Tier.config` None). `kvq_lab.cache.layers.tiered.TieredLayer` is the one layer that
  carries this out, in both modes; the bit accounting (`kvq_lab.cache.accounting`) reads the same tiers.

Torch-free (config validation imports it); the scores and the layer import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from kvq_lab.common.registry import Registry
from kvq_lab.quant.spec import BITS, INT_BITS, QuantConfigError

# A `cache` argument below is a `kvq_lab.cache.config.CacheConfig`, which imports this module (policies sit below it).

DEFAULT_POLICY = "kivi"
# scores a token policy ranks by (kvq_lab.cache.policies.scores); the ones that read the prompt's queries need its
# forward through the model with the cache (attention routed through kvq_sdpa)
SCORES = ("knorm", "attention", "snapkv", "normalized")
QUERY_SCORES = ("attention", "snapkv", "normalized")


@dataclass(frozen=True)
class Tier:
    """`share` of the ranked tokens (the highest-ranked first), stored under `config` (None: dropped)."""

    share: float
    config: Any  # CacheConfig, or None: dropped


@dataclass(frozen=True)
class Policy:
    """A registered policy: its options are the dataclass fields (defaults = the policy's published setting)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for the README's policy table
    # options under which the policy keeps every token at the cache's own quantizer: with 16-bit caches it is then
    # DynamicCache (the registry-driven tests check it)
    lossless: ClassVar[dict] = {}
    modes: ClassVar[tuple[str, ...]] = ("simulated", "packed")  # the cache modes it runs in (`check` refuses others)
    # the prompt's forward reads the quantized K/V on every task (`CacheConfig.quantizes_prefill`), as
    # `prefill=quantized` says: tasks that would hand the cache exact K/V forward the prompt through it instead
    quantizes_prompt: ClassVar[bool] = False

    def tiers(self, cache) -> tuple[Tier, ...] | None:
        """The tiers of the ranked tokens, or None: the mode's layers store every token (kivi)."""
        return None

    def check(self, cache) -> None:
        """One-line QuantConfigError for a cache this policy cannot run with."""

    def stored_bits(self, cache, n_tokens: int, bits_of) -> float:
        """Stored bits per element of one layer's tensor over a prompt of n_tokens under this policy: the mode's
        layers store every token, so `bits_of(cache, n_tokens)` (the mode layer's count of one config)."""
        return bits_of(cache, n_tokens)

    def options(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))


# The built-in policies: one registry line each, imported on first lookup (kvq_lab.common.registry).
POLICIES: Registry[type[Policy]] = Registry(
    "policy",
    lazy={
        "evict": "kvq_lab.cache.policies.evict:Evict",
        "fakequant": "kvq_lab.cache.policies.fakequant:FakeQuant",
        "kivi": "kvq_lab.cache.policies.kivi:Kivi",
        "mikv": "kvq_lab.cache.policies.mikv:MiKV",
        "saliency": "kvq_lab.cache.policies.saliency:Saliency",
    },
    unknown="{kind}={name!r} is not a cache policy; choose one of: {known}",
)


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: `policy=<cls.name>` selects it (a name another class holds is refused)."""
    return POLICIES.register(cls.name, cls)


def get_policy(name: str, options: dict | None = None) -> Policy:
    """The policy `name` with `options` (one-line QuantConfigError naming `policy.<field>` for a bad one). The
    registry names its built-in plug-ins and imports one when it is looked up."""
    cls = POLICIES[name]  # one-line error naming the known policies
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(options or {}) - set(allowed))
    if unknown:
        have = ", ".join(allowed) or "none"
        raise QuantConfigError(f"policy.{unknown[0]} is not an option of policy={name}; its options: {have}")
    return cls(**(options or {}))


def _fraction(name: str, v, lo_open: bool = True) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (0 < v <= 1 if lo_open else 0 <= v <= 1)
    if not ok:
        raise QuantConfigError(f"policy.{name}={v!r} must be a fraction in (0, 1], e.g. 0.5")


def _count(name: str, v, lo: int = 0) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise QuantConfigError(f"policy.{name}={v!r} must be an integer >= {lo}")


def _bits(name: str, v) -> None:
    if isinstance(v, bool) or v not in BITS:
        raise QuantConfigError(f"policy.{name}={v!r}; choose one of: {', '.join(map(str, BITS))} (16 = exact)")


@dataclass(frozen=True)
class TokenPolicy(Policy):
    """Ranks the prompt's middle tokens by `score` and stores them in tiers (the module docstring).

    score: what ranks a token (`SCORES`); window: the prompt's last tokens kept with the mode's layer whatever their
    score (SnapKV's observation window: the queries `snapkv` reads)."""

    score: str = "snapkv"
    window: int = 32

    def __post_init__(self):
        if self.score not in SCORES:
            raise QuantConfigError(f"policy.score={self.score!r}; choose one of: {', '.join(SCORES)}")
        _count("window", self.window, lo=1)

    @property
    def needs_queries(self) -> bool:
        return self.score in QUERY_SCORES

    def check(self, cache) -> None:
        what = f"policy={self.name}"
        if not cache.caps.token_policies:
            raise QuantConfigError(
                f"{what} splits K/V tokens into tiers; mode={cache.mode} caches X: use simulated/packed"
            )
        if cache.rope == "pre":
            raise QuantConfigError(
                f"{what} stores tokens apart from their neighbours, so keys must carry their positions: use rope=post"
            )
        if cache.prefill == "quantized":
            raise QuantConfigError(
                f"{what} splits the prompt after its forward (exact attention, as SnapKV and MiKV do): "
                "prefill=quantized does not apply; unset it"
            )
        self.tiers(cache)  # each tier's config is checked as it is made

    def stored_bits(self, cache, n_tokens: int, bits_of) -> float:
        """The sinks and last `window` tokens at the cache's own cost, the tokens between them dealt to the tiers in
        their shares, each at its tier's cost (nothing for a dropped tier), over the n_tokens of the prompt.
        `bits_of(config, n)`: bits per element the mode's layer stores for n tokens under that config."""
        tiers = self.tiers(cache)
        main = min(n_tokens, cache.sink_tokens + self.window)
        mid = n_tokens - main
        plain = replace(cache, policy=DEFAULT_POLICY, policy_options=())
        bits = bits_of(plain, main) * main if main else 0.0
        for tier, size in zip(tiers, deal([t.share for t in tiers], mid), strict=True):
            if tier.config is not None and size:
                bits += bits_of(tier.config, size) * size
        return bits / n_tokens

    def tier_config(self, cache, bits: int | None = None, group: int | None = None):
        """A tier's config: the cache's quantizers (axes, format, transforms), at `bits` / `group` where given, with
        no sinks or window of its own and its stored K/V what attention reads."""
        key, value = cache.key, cache.value
        if bits is not None:
            key, value = replace(key, bits=bits), replace(value, bits=bits)
        if group is not None:
            key, value = replace(key, group_size=group), replace(value, group_size=group)
        return replace(
            cache, key=key, value=value, sink_tokens=0, exact_window=0, prefill="quantized", policy=DEFAULT_POLICY,
            policy_options=(), layers=(), skip_layers=(),
        )  # fmt: skip


def deal(shares: list[float], n: int) -> list[int]:
    """n ranked tokens dealt to tiers in the given shares (summing to 1): each tier up to the floor of its running
    total, the last one the rest, so the sizes sum to n (the layer and the bit accounting both deal this way)."""
    out, total, acc = [], 0, 0.0
    for i, share in enumerate(shares):
        acc += share
        upto = n if i == len(shares) - 1 else min(n, math.floor(acc * n + 1e-9))
        out.append(upto - total)
        total = upto
    return out


def check_tier_bits(name: str, bits) -> None:
    """A tier's `bits` option: a width of the int format (or 16)."""
    _bits(name, bits)
    if bits != 16 and bits not in INT_BITS:
        raise QuantConfigError(f"policy.{name}={bits}: int codes take {', '.join(map(str, INT_BITS))} bits")


__all__ = [
    "DEFAULT_POLICY", "POLICIES", "QUERY_SCORES", "SCORES", "Policy", "Tier", "TokenPolicy", "deal", "get_policy",
    "register_policy",
]  # fmt: skip
