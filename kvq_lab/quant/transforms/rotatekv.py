"""`rotatekv`: outlier-aware per-head rotation (RotateKV, Su et al. 2025, "RotateKV: Accurate and Robust 2-Bit KV
Cache Quantization for LLMs via Outlier-Aware Adaptive Rotations", IJCAI 2025).

    x_t = (x P_h) H_n / sqrt(n)       per token, P_h a channel permutation of kv head h, H_n Hadamard on blocks of n

A Hadamard block spreads the channels it holds evenly, so the outlier energy each block carries decides its output
range. One shared rotation (`hadamard`) puts whatever channels happen to be neighbours into a block; RotateKV reorders
each head's channels by their magnitude on calibration data first, so every block gets its share of the outlier
channels: here the channels ranked 0, 1, 2, ... by calibration RMS are dealt to blocks 0, 1, ..., n_blocks - 1, 0, 1,
... (each block's first slot filled first). With one block (the whole head, the default) the order only permutes
the Hadamard's inputs; blocks smaller than the head (`rotatekv:<n>`) are where the reorder balances outliers.
The paper applies it to keys before RoPE (its "pre-RoPE" rotation): compose `key_transform=[rope_pre,rotatekv]`.

Not implemented from RotateKV, and why (its public code, github.com/ZunhaiSu/RotateKV, read for this):
- Grouped-head rotation: one Hadamard over g kv heads' channels at once (g = 4 heads of 128: 512 channels), then a
  reorder of all kv channels (every head's) ascending by their signed calibration sum, then per-token groups of 128
  of the reordered vector. It mixes heads, so it cannot fold into per-head attention (q_h · k_h is kept only by maps
  within a head): the code un-reorders and un-rotates the dequantized keys before RoPE at every step. On SmolLM2 the
  3 kv heads allow g = 1 (this transform's whole-head rotation) or g = 3 (192 channels, not a power of two: no
  Sylvester Hadamard or FWHT). Its reorder (after the rotation, contiguous groups by signed mean) differs from the
  one here (before the rotation, ranked by RMS, dealt across blocks), which follows the paper's text.
- Attention-sink-aware quantization: per layer and prompt, the tokens holding the 20 largest |entries| of the
  layer's input hidden states stay 16-bit at prefill. A cache sees keys and values, not hidden states, and keeps
  exact tokens only as a prefix (`sink_tokens`: the first S positions). On SmolLM2 the rule picks position 0 alone
  in layers 12-19 (what `sink_tokens=1` keeps) and 5-20 content tokens elsewhere
  (experiments/methods/massive_activations.py); the two combine as "exact if either keeps it", which needs exact
  tokens at arbitrary positions in the cache (not built).

Orthogonal and the same at every position, so it folds into attention like `hadamard` (the query is rotated with
its kv head's permutation, the output rotated back). Fitted (`fit`) by `kvq_lab.fit.calibration` once per layer; the
bare spelling has no permutation and is unusable. Elementwise butterflies (`fwht`): bits do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvq_lab.quant.spec import QuantConfigError
from kvq_lab.quant.transforms import Transform, register_fitted, register_transform
from kvq_lab.quant.transforms.hadamard import _is_pow2, block_arg, fwht
from kvq_lab.quant.transforms.innerq import digest, per_head


def deal(order, n_blocks: int):
    """order [H, D] (channels by decreasing magnitude) -> perm [H, D]: rank r goes to block r % n_blocks, slot
    r // n_blocks, so that x[..., perm] holds the reordered channels block after block."""
    import torch

    H, D = order.shape
    r = torch.arange(D)
    dest = (r % n_blocks) * (D // n_blocks) + r // n_blocks  # position of rank r in the reordered head
    perm = torch.empty_like(order)
    perm[:, dest] = order
    return perm


@register_transform("rotatekv")
@dataclass(frozen=True, eq=False)
class RotateKV(Transform):
    """Per-head channel reorder + Hadamard on blocks of `block` channels (None: the whole head); see the module
    docstring. perm: int64 [H_kv, D] (x_t channel j = x channel perm[h, j] before the rotation), None when bare."""

    block: int | None = None
    perm: Any = None

    foldable = True
    fitted = True

    @classmethod
    def parse(cls, arg):
        if arg is None:
            return cls()
        return cls(block_arg("rotatekv", arg, 16))

    def stored_bits(self, heads: int, head_dim: int) -> int:
        return 8 * heads * head_dim  # the channel order, one byte per (kv head, channel)

    def fit(self, x) -> RotateKV:
        """Fitted on x [B, H, T, D] as this transform sees it: each head's channels ranked by RMS over B, T, dealt to
        the Hadamard blocks (`deal`)."""
        import torch

        self.check_head_dim(x.shape[-1])
        rms = x.detach().float().pow(2).mean(dim=(0, 2))  # [H, D]
        order = rms.argsort(dim=-1, descending=True, stable=True)
        n = self.block or x.shape[-1]
        t = type(self)(self.block, deal(order, x.shape[-1] // n).cpu().to(torch.int64))
        register_fitted(t)
        return t

    @classmethod
    def example(cls) -> RotateKV:
        import torch

        x = torch.randn(1, 1, 256, 64, generator=torch.Generator().manual_seed(0))
        x[..., [5, 9]] *= 20
        return cls().fit(x)

    @property
    def spelling(self) -> str:
        bare = self.name if self.block is None else f"{self.name}:{self.block}"
        return bare if self.perm is None else f"{bare}@{digest(self.perm)}"

    @property
    def label(self) -> str:
        return "rkv" if self.block is None else f"rkv{self.block}"

    def check_head_dim(self, head_dim: int) -> None:
        n = self.block or head_dim
        if not _is_pow2(n) or head_dim % n:
            p = head_dim & -head_dim
            raise QuantConfigError(
                f"rotatekv needs Hadamard blocks of a power of two dividing head_dim={head_dim}; use rotatekv:{p}"
            )

    def _perm(self, x):
        if self.perm is None:
            raise QuantConfigError(
                "rotatekv has no fitted channel order: calibration fits it (run.py does; a cache built by hand needs a "
                "CacheConfig from kvq_lab.fit.calibration.calibrate)"
            )
        p = per_head(self.perm.to(x.device), x.shape[1])  # [H, D]
        return p[None, :, None, :].expand(x.shape)

    def forward(self, x, pos=None):
        n = self.block or x.shape[-1]
        y = x.float().gather(-1, self._perm(x))
        return (fwht(y, n) * n**-0.5).to(x.dtype)

    def inverse(self, x, pos=None):
        import torch

        n = self.block or x.shape[-1]
        y = fwht(x.float(), n) * n**-0.5  # H_n / sqrt(n) is its own inverse
        out = torch.empty_like(y)
        out.scatter_(-1, self._perm(x), y)
        return out.to(x.dtype)

    def fold_query(self, q):
        return self.forward(q)  # orthogonal: the query is mapped as the keys are

    def fold_output(self, o):
        return self.inverse(o)
