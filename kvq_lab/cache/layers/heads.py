"""The cache layer of per-head bits (`CacheConfig.head_bits`, set by `precision=search precision.granularity=head`).

A layer's KV heads are independent under attention (each query head reads its own KV head), so a layer whose heads
carry different (key bits, value bits) is stored as one layer of the cache's mode per width: the heads of each width
(`CacheConfig.head_groups`) go to their own layer, which stores, streams and counts them exactly as a layer of that
width would store a model with only those heads (sinks, window, groups, transforms: the mode's rules, unchanged).
`update` hands each its heads and puts what they return back in head order; bytes are the sum of theirs.

What attention reads is assembled each step (the packed layers return their K/V dequantized: the fused decode kernels
read one layer's stream at one width, so a per-head layer decodes on the PyTorch path, slower, exact). Batches
(left-padded, stacked, rows dropped and admitted) are each width's layer's own operations.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvq_lab.cache.layers.base import LAYERS, QuantizedLayerBase


class HeadsLayer(QuantizedLayerBase):
    """One attention layer with per-head bits (module docstring). `groups`: [(KV heads, layer of their width)]."""

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self.groups = [(idx, LAYERS[c.mode](c, rope, padding)) for c, idx in cfg.head_groups()]
        self.H = len(cfg.head_bits)

    @staticmethod
    def stored_bits(cfg, n_tokens: int, shape) -> tuple[float, float]:
        """(keys, values) bits per element of the layer: the heads-weighted mean of each width's layer, counted with
        its own heads (per-layer state, a codebook or a transform's parameters, once per width)."""
        H = len(cfg.head_bits)
        per = [(LAYERS[c.mode].stored_bits(c, n_tokens, replace(shape, heads=len(idx))), len(idx))
               for c, idx in cfg.head_groups()]  # fmt: skip
        return tuple(sum(bits[j] * h for bits, h in per) / H for j in (0, 1))

    @property
    def stackable(self) -> bool:
        return all(layer.stackable for _, layer in self.groups)

    @property
    def layer_idx(self) -> int:
        return self._layer_idx

    @layer_idx.setter
    def layer_idx(self, i: int) -> None:
        self._layer_idx = i
        for _, layer in getattr(self, "groups", ()):
            layer.layer_idx = i

    def get_seq_length(self) -> int:
        return self.groups[0][1].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.groups[0][1].get_mask_sizes(query_length)

    def update(self, key_states, value_states, *args, **kwargs):
        B, H, n, D = key_states.shape
        if H != self.H:
            raise ValueError(f"per-head bits name {self.H} KV heads; layer {self.layer_idx} has {H}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if len(self.groups) == 1:  # every head at one width: that layer's own
            out = self.groups[0][1].update(key_states, value_states, *args, **kwargs)
            self._placeholder()
            return out
        parts = [
            (idx, layer.update(key_states[:, idx], value_states[:, idx], *args, **kwargs)) for idx, layer in self.groups
        ]
        k0, v0 = parts[0][1]
        k = k0.new_empty(B, H, k0.shape[2], k0.shape[3])
        v = v0.new_empty(B, H, v0.shape[2], v0.shape[3])
        for idx, (pk, pv) in parts:
            k[:, idx], v[:, idx] = pk.to(k.dtype), pv.to(v.dtype)
        self._placeholder()
        return k, v

    def prefix_boundary(self, n: int) -> int:
        return min(layer.prefix_boundary(n) for _, layer in self.groups)

    def nbytes(self) -> tuple[int, int]:
        """(stored, fp16): the sums over the widths' layers (simulated layers store none)."""
        counts = [layer.nbytes() for _, layer in self.groups if hasattr(layer, "nbytes")]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self._placeholder(key_states)

    def _placeholder(self, like: torch.Tensor | None = None) -> None:
        """Shape-only `keys` / `values` ([B, H, 0, D]: what cache-level code reads of a layer's batch and device)."""
        like = like if like is not None else self.groups[0][1].keys
        self.keys = like.new_empty(like.shape[0], self.H, 0, like.shape[-1])
        self.values = self.keys

    # -- batches: each width's layer's own -----------------------------------------------------------------------
    @classmethod
    def stack(cls, rows: list, pads: list[int], padding):
        out = cls(rows[0].cfg, rows[0].rope, padding)
        out.groups = [
            (idx, type(layer).stack([r.groups[g][1] for r in rows], pads, padding))
            for g, (idx, layer) in enumerate(rows[0].groups)
        ]
        out.layer_idx = rows[0].layer_idx
        out.is_initialized, out.device = True, rows[0].device
        out._placeholder()
        return out

    def select_rows(self, rows: list[int], padding) -> None:
        self.padding = padding
        for _, layer in self.groups:
            layer.select_rows(rows, padding)
        self._placeholder()

    def admit(self, slot: int, row, grow: int, padding) -> None:
        self.padding = padding
        for g, (_, layer) in enumerate(self.groups):
            layer.admit(slot, row.groups[g][1], grow, padding)
        self._placeholder()

    def drop_left(self, k: int, padding) -> None:
        self.padding = padding
        for _, layer in self.groups:
            layer.drop_left(k, padding)
        self._placeholder()
