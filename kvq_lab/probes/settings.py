"""Probe settings and the names of what the probes measure. No torch here: config validation imports this."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KIVI_EPS = 0.01

ERROR_QUANTITIES = (
    "key",
    "value",
    "attn_score",
    "attn_score_decode",
    "attn_out_k",
    "attn_out_k_decode",
    "attn_out_v",
    "attn_out_v_decode",
    "attn_out",
    "attn_out_decode",
)
KV_QUANTITIES = ("key", "value")  # measured per KV head


@dataclass(frozen=True)
class ProbeSettings:
    """Probe options (conf/task/probe.yaml for task=probe; the `probes:` block of conf/config.yaml for probe=true).

    n_prompts: prompts measured; max_tokens: each prompt truncated to this many tokens; source: where prompts come
    from (`coqa` stories; task=probe also `gsm8k`, long pieces of GSM8K's test text; probe=true also `task` = the
    running task's own prompts, falling back to coqa);
    kivi_eps: guard of `kivi_ratio`; sparsity_rel: a weight below sparsity_rel x row max counts as sparse;
    topk: k of `top{k}_mass`; figures: write heat-map PNGs next to the record.
    """

    n_prompts: int = 8
    max_tokens: int = 512
    source: str = "coqa"
    kivi_eps: float = DEFAULT_KIVI_EPS
    sparsity_rel: float = 0.01
    topk: int = 16
    figures: bool = True

    @classmethod
    def from_dict(cls, d) -> ProbeSettings:
        d = {k: v for k, v in dict(d or {}).items() if k != "name"}  # `name` is the task's registry name
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown probe setting(s) {unknown}; known: {', '.join(cls.__dataclass_fields__)}")
        s = cls(**d)
        for name in ("n_prompts", "max_tokens", "topk"):
            v = getattr(s, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"probe setting {name}={v!r} must be an integer >= 1")
        if not isinstance(s.figures, bool):
            raise ValueError(f"probe setting figures={s.figures!r} must be true or false")
        return s

    def quantities(self) -> tuple[str, ...]:
        k = f"top{self.topk}_mass"
        return ERROR_QUANTITIES + ("sparsity", "sparsity_decode", k, f"{k}_decode")
