"""Five throwaway plug-ins, each the way a contributor adds one (one class, one registry line): a code format that
stores a table, a fitted transform, a task with headline metrics, a probe error metric, and a cache policy. Loaded
only by tests/test_throwaway_plugins.py, in a fresh process (`pytest -p throwaway_plugins`), so the real registries
of the main test session never see them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvq_lab.cache.policies import Tier, TokenPolicy, register_policy
from kvq_lab.common.metric import Metric
from kvq_lab.probes.metrics import ErrorMetric, register_error
from kvq_lab.quant.formats import register_format
from kvq_lab.quant.formats.lut import LUTFormat
from kvq_lab.quant.spec import QuantConfigError
from kvq_lab.quant.transforms import Transform, register_fitted, register_transform
from kvq_lab.quant.transforms.innerq import digest, per_head
from kvq_lab.tasks import Task, TaskContext, register_task

FORMAT, TRANSFORM, TASK, ERROR, POLICY = "tw_table", "tw_scale", "tw_task", "tw_maxabs", "tw_tiers"


@register_policy
@dataclass(frozen=True)
class HalfAtLowBits(TokenPolicy):
    """The prompt's lower half by key norm at `low_bits`, the upper half at the cache's quantizer."""

    name = POLICY
    lossless = {"low_bits": 16}
    score: str = "knorm"
    low_bits: int = 1

    def tiers(self, cache):
        return (Tier(0.5, self.tier_config(cache)), Tier(0.5, self.tier_config(cache, self.low_bits)))


@register_format(FORMAT)
@dataclass(frozen=True)
class TableFormat(LUTFormat):
    """A 2-bit codebook format: lut's arithmetic, its table (16 bytes, fp32) stored once per layer."""

    name: str = FORMAT
    supported_bits = (2,)
    default_bits = 2


@register_transform(TRANSFORM)
@dataclass(frozen=True, eq=False)
class ChannelScale(Transform):
    """x / s per (kv head, channel), s the calibration absmax (fitted, fp16 per channel stored), undone after."""

    scale: Any = None
    fitted = True

    def fit(self, x):
        s = x.detach().float().abs().amax(dim=(0, 2)).clamp(min=1e-6).cpu()
        t = type(self)(s)
        register_fitted(t)
        return t

    @classmethod
    def example(cls):
        import torch

        return cls().fit(torch.randn(1, 1, 64, 64, generator=torch.Generator().manual_seed(0)))

    @property
    def spelling(self) -> str:
        return self.name if self.scale is None else f"{self.name}@{digest(self.scale)}"

    def stored_bits(self, heads: int, head_dim: int) -> int:
        return 16 * heads * head_dim

    def _s(self, x):
        if self.scale is None:
            raise QuantConfigError(f"{self.name} has no fitted scales: calibration fits them")
        return per_head(self.scale.to(x.device), x.shape[1])[:, None, :]

    def forward(self, x, pos=None):
        return (x.float() / self._s(x)).to(x.dtype)

    def inverse(self, x, pos=None):
        return (x.float() * self._s(x)).to(x.dtype)


class PromptLengthTask(Task):
    """Runs one short prompt through the cache; reports the last token's log-probability of the top choice."""

    name = TASK
    headline = (Metric(f"{TASK}/top_logprob", "TW top logprob", "higher"),)

    def run(self, ctx: TaskContext) -> dict[str, float]:
        import torch

        ids = ctx.tokenizer("The cache stores keys and values", return_tensors="pt").input_ids
        with torch.no_grad():
            logits = ctx.model(ids, past_key_values=ctx.make_cache(), use_cache=True).logits[0, -1]
        return {f"{TASK}/top_logprob": float(logits.float().log_softmax(-1).max()), f"{TASK}/n": 1}


register_task(PromptLengthTask())
register_error(
    ErrorMetric(ERROR, lambda x, xq, dims, eps: (x.float() - xq.float()).abs().amax(dim=dims), table="max err")
)
