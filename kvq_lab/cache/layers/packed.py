"""Packed ("real") cache layer: low-bit codes in memory, KIVI's streaming, exact prefill attention.

What is stored, per layer (positions are absolute cache positions 0..N-1; row b of a left-padded batch has
`p_b` padding positions first, then its real tokens j = 0, 1, ...):
    sinks    the first `sink_tokens` real tokens of each row, exact (post-RoPE keys, as the model made them).
    history  quantized tokens, codes bit-packed along tokens (`kvq_lab.quant.pack`), scale/zero per group at the
             format's stored width (fp16; one byte for nvfp4's and mxfp4's scales), widened when read.
    window   the most recent tokens in full precision, a fixed buffer of `exact_window` (R) tokens (and R/16
             spare rows it moves through, one row copied per step: `streams._Window`).

Streaming follows the grouping axis of each tensor (so any axis works for keys or values):
    per-channel (groups of G tokens, KIVI's keys): the window fills to R (or G when R = 0), then all of it is
        quantized at once, R/G whole groups; after a prefill of L tokens, (L - sinks) mod R stay full precision.
    per-token (groups of G channels, KIVI's values): a sliding window of the last R tokens; the oldest token is
        quantized as it leaves. R = 0 quantizes every token on arrival.
Quantized history is never re-quantized: a step quantizes at most one new block and writes its bits next to the
older ones (per-channel: the R-token window; per-token: the packing block of 32 tokens that the leaving token
opens, coded at once because per-token codes depend on the token alone; its other tokens are still in the
window, attended exactly, and their codes are read only once they leave).

Prefill attention runs on the exact keys and values (the model's own attention on what it just computed); the
cache quantizes afterwards, as KIVI does. `prefill=quantized` hands the prompt's forward the stored cache instead
(sinks and window exact, history dequantized), as llama.cpp does.

Left-padded batches: per-channel groups are aligned on each row's *real* tokens (row b's groups start at its
first non-sink token, position p_b + sink_tokens), and each row keeps its own count of quantized tokens and
window tokens, so every row stores exactly what it would store alone, for every axis, sink and window setting
(tested bit for bit). A batch then generates what each prompt generates alone as far as the model's own
batched arithmetic (masked SDPA over padding, batched matmuls) reproduces the single-prompt K/V: it did in the
tests; a last-bit difference there could in principle flip a code or a near-tied greedy token.
Per-token groups never span tokens, so they need no alignment: their history and window are
indexed by absolute position for all rows (a row's padding and sink positions hold unused zero codes). Pad
positions never enter a group's min/max. A backend that reads per-row layouts (`rows`: the CPU and Triton
kernels) decodes ragged batches on the fused path (next paragraph), each row read with its own padding, sinks,
history and window; others assemble full K/V per step with one gather (slower than the batch-1 path, exact).

Decode attention: with `QuantizedKVCache.for_model` on an `sdpa` model, the model's attention is routed through
`kvq_sdpa` (`kvq_lab.cache.routing.attention`); on decode steps `update` hands it the layer itself (`PackedKV`), whose
view of the stored segments goes to the backend's kernel (`kvq_lab.cache.layers.packed_decode`: the view, kept calls).
Nothing dequantized outlives the step; `nbytes()` counts only what is stored. Without the routing (another attention
implementation, or a cache built directly), `update` returns dequantized K/V and the model's attention runs as
usual.

Transforms (`key_transform`, `value_transform`; `kvq_lab.quant.transforms`): the quantizer sees T(x) for every token
after the sinks; sinks stay exact. A pipeline that folds into attention (hadamard: an orthogonal map of the head dim)
is applied as tokens arrive, so the window holds T(x) too: fused decode steps never undo it (`packed_decode`);
`materialize` inverts every stream position. A pipeline that does not fold (rope_pre: position-dependent) is applied
as tokens are quantized (the streams' `encode`, a window or prompt at once): the window holds the tokens as the model
made them, exact and read as they are, and only the history is undone, dequantized and re-rotated at its positions
(or rotated by a kernel that reads pre-RoPE codes: `packed_decode`). Decode steps then pay no transform per token:
the rotations happen once per window flush, on the quantizer's side.

Roles: this module is the layer (what is stored where, per step); `packed_decode` what it hands the decode kernels,
`store` holds the bits, `streams` the per-axis streaming policies, `backends` the kernels' selection, `attention`
the routing.
"""

from __future__ import annotations

import torch

from kvq_lab.cache.accounting import kv_bits
from kvq_lab.cache.layers.base import QuantizedLayerBase, register_layer
from kvq_lab.cache.layers.packed_decode import PackedDecode
from kvq_lab.cache.routing.attention import PackedKV, route_model
from kvq_lab.cache.routing.backends import get_backend
from kvq_lab.cache.routing.rope import PositionLog, step_position_ids
from kvq_lab.cache.storage.rows import left_padded_sinks
from kvq_lab.cache.storage.store import tensor_bytes
from kvq_lab.cache.storage.streams import make_stream
from kvq_lab.kernels.view import RopeView


@register_layer("packed")
class PackedLayer(PackedDecode, QuantizedLayerBase):
    """One attention layer's packed cache (see the module docstring for the storage and streaming rules).

    sink_k, sink_v: [B, H, S, D] exact (the first S real tokens of each row); k_stream, v_stream: the tokens after
    them (`kvq_lab.cache.storage.streams`); N: cached positions, padding included; pads: left-padding positions per row.
    """

    @staticmethod
    def stored_bits(cfg, n_tokens: int, shape) -> tuple[float, float]:
        """(keys, values) bits per element one layer stores after n_tokens: sinks and window exact, the rest as codes
        and parameters, and what outliers, residuals, codebooks and transforms add (`kvq_lab.cache.accounting`)."""
        return kv_bits(cfg, n_tokens, shape)

    def __init__(self, cfg, rope=None, padding=None):
        super().__init__(cfg, rope, padding)
        self._args = (cfg, rope, padding)
        self.backend = get_backend(cfg.backend, (cfg.key, cfg.value))  # formats a kernel cannot read: torch
        if cfg.reads_dequantized():
            self.backend = get_backend("torch")  # outliers, residuals: the PyTorch path reads the dequantized history
        self.all_finite = self.backend.all_finite  # the check of each new key and value: the backend's
        self.fused = False  # set by `prepare_model` when the model's attention is routed through kvq_sdpa
        self.N = 0
        self.pads: list[int] = []
        self.sink_k = self.sink_v = None
        R, S = cfg.exact_window, cfg.sink_tokens
        self.k_stream = make_stream(cfg.key, R, S, self.backend, cfg.outliers("key"), cfg.residual("key"))
        self.v_stream = make_stream(cfg.value, R, S, self.backend, cfg.outliers("value"), cfg.residual("value"))
        self._fold_pair = self.k_pipe is not None and self.k_pipe.foldable and self.k_pipe == self.v_pipe
        for stream, pipe in ((self.k_stream, self.k_pipe), (self.v_stream, self.v_pipe)):
            if pipe is not None and not pipe.foldable:  # applied as tokens are quantized (the module docstring)
                stream.encode = self._encoder(pipe)
        # position ids (int32) of cache positions [0, N), kept for position-dependent transforms: the cache's log on
        # this layer's device, shared by its layers (set at the first update)
        self._log: PositionLog | None = None
        self._rope: RopeView | None = None  # the latest `_rope_view`
        self._kept = None  # (kept call, fold query, fold output, stores' generations, rope view): `kept_call`

    # -- hooks ---------------------------------------------------------------------------------------------------
    @staticmethod
    def prepare_model(model, cache) -> None:
        """Route an `sdpa` model's attention through `kvq_sdpa`, so decode steps read the packed cache directly."""
        route_model(model, cache.layers)

    def get_seq_length(self) -> int:
        return self.N

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.N + query_length, 0

    @property
    def uniform(self) -> bool:
        """No padding: every row has the same layout, so K/V segments are plain slices."""
        return not any(self.pads)

    # -- update --------------------------------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        B, H, n, D = key_states.shape
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_finite(key_states, value_states)
        if self.positional:
            if self._log is None:
                self._log = self.rope.log(key_states.device) if self.rope is not None else PositionLog()
            self._log.keep(step_position_ids(self.rope, kwargs, B, self.N, n, key_states.device), self.N, self)
        # what the streams store: foldable transforms applied now, the others as tokens are quantized (`encode`)
        if self._fold_pair:  # keys and values under one foldable pipeline: both at once (hadamard: one call)
            tk, tv = self.k_pipe.forward_pair(key_states, value_states, out=self._slots(key_states))
        else:
            tk = key_states if self.k_pipe is None or not self.k_pipe.foldable else self.k_pipe.forward(key_states)
            tv = value_states if self.v_pipe is None or not self.v_pipe.foldable else self.v_pipe.forward(value_states)
        if not (self.k_stream.quantized or self.v_stream.quantized):  # 16 bits: DynamicCache (bitwise, untransformed)
            self.k_stream.step(tk, self.N, self.pads, None)
            self.v_stream.step(tv, self.N, self.pads, None)
            self.N += n
            return self.materialize()

        if self.N == 0:
            self._prefill(key_states, tk, value_states, tv)
            # prefill attention runs on exactly what the model computed, or (prefill=quantized) on what is stored
            return self.materialize() if self.cfg.prefill == "quantized" else (key_states, value_states)
        if n > 1:
            # several new tokens on a non-empty cache (chunked prefill): absorbed one by one, attention on the
            # dequantized cache
            for t in range(n):
                one = slice(t, t + 1)
                self._step(key_states[:, :, one], tk[:, :, one], value_states[:, :, one], tv[:, :, one])
            return self.materialize()
        self._step(key_states, tk, value_states, tv)
        if self.fused and self.k_stream.quantized and self.v_stream.quantized and (self.uniform or self._rows_fused):
            handle = PackedKV(self)
            return handle, handle
        return self.materialize()

    def _slots(self, x: torch.Tensor):
        """Where a decode step's transformed key and value go in the streams' window buffers (`Stream.slot`), for a
        transform that can write them there (the streams' `step` then copies nothing), or None: not a one-token step
        on a filled cache, a window that is not fp32 (the transforms return the model's dtype), or no window."""
        if self.N == 0 or x.shape[2] != 1 or x.dtype is not torch.float32:
            return None
        ks, vs = self.k_stream.slot(), self.v_stream.slot()
        return None if ks is None or vs is None else (ks, vs)

    def _prefill(self, k, tk, v, tv):
        """k, v [B, H, N, D] as the model made them (the sinks' source); tk, tv: transformed, for the streams."""
        # sinks: the first S real tokens of each row, exact
        self.pads, (self.sink_k, self.sink_v) = left_padded_sinks(
            self.padding, self.cfg.sink_tokens, k, v, what="the packed cache"
        )
        self.N = k.shape[2]
        self.k_stream.prefill(tk, self.pads)
        self.v_stream.prefill(tv, self.pads)

    def _step(self, k, tk, v, tv):
        N, S = self.N, self.cfg.sink_tokens
        self.N = N + 1
        owns = None  # the common case: every row owns the new token as history
        if not (self.uniform and N >= S):
            j = [N - p for p in self.pads]  # the new token's index among each row's real tokens
            for b, jj in enumerate(j):  # sinks still filling (prompts shorter than sink_tokens): at most S steps
                if jj < S:
                    self.sink_k[b, :, jj] = k[b, :, 0]
                    self.sink_v[b, :, jj] = v[b, :, 0]
            owns = [jj >= S for jj in j]
        self.k_stream.step(tk, N, self.pads, owns)
        self.v_stream.step(tv, N, self.pads, owns)

    # -- transforms at stored positions; full K/V ----------------------------------------------------------------
    def _encoder(self, pipe):
        """A stream's `encode` for an unfoldable pipeline: pipe applied to tokens [B, H, n, D] at absolute cache
        positions [B, n]."""
        return lambda x, abs_pos: pipe.forward(x, self._positions_at(pipe, x, abs_pos))

    def _undo(self, pipe, x: torch.Tensor, abs_pos: torch.Tensor) -> torch.Tensor:
        """Undo `pipe` on stored tokens x [B, H, n, D] at absolute cache positions abs_pos [B, n] (fp32 in, fp32
        out; the model's dtype in, the model's dtype out)."""
        return pipe.inverse(x, self._positions_at(pipe, x, abs_pos))

    def _positions_at(self, pipe, x: torch.Tensor, abs_pos: torch.Tensor):
        """What a positional `pipe` reads for tokens x at absolute cache positions [B, n] (their position ids' RoPE),
        or None for a pipeline that reads no positions."""
        if not pipe.positional:
            return None
        return self.positions(x, self._log.ids.gather(1, abs_pos.clamp(0, self.N - 1)).long())

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Full K, V [B, H, N, D] in the model's dtype: sinks exact, history dequantized, window exact, transforms
        undone."""
        return self._read(self.k_stream, self.sink_k, self.k_pipe), self._read(self.v_stream, self.sink_v, self.v_pipe)

    def _read(self, stream, sink, pipe) -> torch.Tensor:
        if pipe is None or not pipe.foldable:  # the history undone as it is dequantized; sinks and window exact
            undo = None if pipe is None else lambda x, a: self._undo(pipe, x, a)
            return stream.materialize(self.N, sink, self.pads, undo)
        x = stream.materialize(self.N, sink, self.pads, None)
        B, N, S = x.shape[0], self.N, self.cfg.sink_tokens
        a = torch.arange(N, device=x.device).expand(B, N)
        if not stream.quantized:  # an exact stream holds every position, its sinks included
            return self._undo(pipe, x, a)
        if self.uniform:  # positions [S, N) came from the stream
            s = min(S, N)
            return torch.cat([x[:, :, :s], self._undo(pipe, x[:, :, s:], a[:, s:])], 2)
        # padded rows: a row's stream positions are its real tokens after its sinks; sinks and padding as they are
        j = a - torch.tensor(self.pads, device=x.device)[:, None]
        return torch.where((j >= S)[:, None, :, None], self._undo(pipe, x, a), x)

    # -- accounting ----------------------------------------------------------------------------------------------
    def nbytes(self) -> tuple[int, int]:
        """(stored, fp16): bytes this layer holds, and the same tokens as an fp16 K/V cache."""
        if not self.is_initialized or self.N == 0:
            return 0, 0
        stored = tensor_bytes(self.sink_k) + tensor_bytes(self.sink_v)
        stored += 0 if self._log is None else self._log.nbytes_for(self)  # the cache's position ids: counted once
        stored += self.k_stream.nbytes() + self.v_stream.nbytes()
        B, H, D = self.keys.shape[0], self.keys.shape[1], self.keys.shape[3]
        return stored, 2 * B * H * self.N * D * 2

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        # shape-only placeholders: DynamicLayer code reads self.keys for batch, heads and head_dim
        self.keys = key_states.new_empty(key_states.shape[0], key_states.shape[1], 0, key_states.shape[3])
        self.values = self.keys

    def reset(self) -> None:
        """Forget everything stored (the routing to kvq_sdpa and the layer index are kept)."""
        fused, idx = self.fused, self.layer_idx
        self.__init__(*self._args)
        self.fused, self.layer_idx = fused, idx

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("the packed cache does not support beam search / batch expansion")

    def batch_select_indices(self, indices):
        raise NotImplementedError("the packed cache does not support batch selection")

    def crop(self, max_length):
        raise NotImplementedError("the packed cache cannot be cropped (quantized history is final)")
