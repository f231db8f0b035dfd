"""The packed layer's side of the fused decode path: what it hands the decode kernels at each step.

Decode attention: with `QuantizedKVCache.for_model` on an `sdpa` model, the model's attention is routed through
`kvq_sdpa` (`kvq_lab.cache.routing.attention`), which hands ordinary tensors to SDPA unchanged and, on decode steps,
receives the layer itself (`PackedKV`) instead of K/V tensors. The layer's `decode_view()` (its stored segments as
plain tensors, `kvq_lab.kernels.view.DecodeView`) then goes to the backend's `decode_attention`
(`kvq_lab.cache.routing.backends`): `backend=cpu` (the CPU default) and `backend=triton` with a fused kernel that reads
the packed bytes (no buffer of the cache's size); `backend=torch`, the pure-PyTorch path
(`kvq_lab.kernels.torch_path`), builds each of K and V for this step in a reused fp32 workspace (sinks and window
copied, history unpacked and dequantized in place) and calls SDPA with the query heads grouped per kv head (no
repeat_kv). Nothing dequantized outlives the step. A left-padded batch decodes on the fused path where the backend
reads per-row layouts (`rows`: the CPU and Triton kernels), each row read with its own padding, sinks, history and
window.

Kept calls: a backend may keep its call over a view for the next steps (`Backend.keep`; the CPU kernel's
`KeptCall`, its argument block), and the layer keeps it while its stored tensors are the ones the view had
(`PackedStore.generation` unchanged, the same rope view), handing it each step only what moves (`moving`: N, sinks
attended, each stream's history length, window and sinks, and a left-padded batch's per-row layouts); a step it
cannot take it hands back, and the view is built. In the model that is ~2 ms of Python less per step at 30 layers
(`git show 8e8c818:experiments/cache_speed/README.md`); a padded batch of 4 at 512 tokens decodes ~5% faster with
it.

Transforms in the view (what the layer stores: `kvq_lab.cache.layers.packed`): under a foldable pipeline (hadamard) the
view carries the stored codes and window as they are and this step's sinks mapped into T's basis; `kvq_sdpa` maps
the query with T and the output back with T^-1 around the kernel, except that the CPU kernel makes both maps itself
for the `hadamard` transform alone (`DecodeView.hadamard`). Under rope_pre the PyTorch path reads the history
dequantized and re-rotated at its positions; rope_pre alone on the keys with a backend that rotates keys itself
(`Backend.features` has `rope`: the CPU and Triton kernels) gets the pre-RoPE codes with a `RopeView` (a cos/sin
table shared by the model's layers, `rope_table`, and the cache's position ids, `rope.PositionLog`), and the kernel
rotates each history key at its position.
"""

from __future__ import annotations

import functools
import weakref

import torch

from kvq_lab.kernels.view import DecodeView, RopeView

_ROPE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rotary module -> (cos, sin) [P, D/2]


def rope_table(rotary_emb: torch.nn.Module, P: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's RoPE at position ids [0, >= P): fp32 cos, sin [P', D/2], contiguous, on like's device, one per
    rotary module (shared by its layers), grown by doubling. Computed by the module itself (attention scaling and
    frequency variants included), in the call the PyTorch path makes, so the values are the ones it rotates with;
    kept as one half of transformers' duplicated [cos, cos] layout. None where a table cannot stand for the module:
    frequencies that depend on the sequence length (`dynamic`, `longrope`), or halves that differ."""
    if getattr(rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return None
    have = _ROPE_TABLES.get(rotary_emb)
    if have is not None and have[0].shape[0] >= P and have[0].device == like.device:
        return have
    size = max(P, 1024, 2 * have[0].shape[0] if have is not None else 0)
    with torch.no_grad(), torch.inference_mode(False):  # usable in and out of inference mode, as workspaces
        ids = torch.arange(size, device=like.device)[None]
        cos, sin = (t.float()[0] for t in rotary_emb(torch.empty(0, device=like.device), ids))
        h = cos.shape[-1] // 2
        if not (torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:])):
            return None
        table = (cos[:, :h].contiguous(), sin[:, :h].contiguous())
    _ROPE_TABLES[rotary_emb] = table
    return table


class PackedDecode:
    """The decode-path methods of `kvq_lab.cache.layers.packed.PackedLayer`, over what the layer holds: `cfg`,
    `backend`, `rope`, `k_stream`, `v_stream`, `sink_k`, `sink_v`, `N`, `pads`, `uniform`, `k_pipe`, `v_pipe`, the
    position log `_log`, the latest rope view `_rope`, the kept call `_kept`, and `_undo` (a non-foldable pipeline
    undone at stored positions)."""

    def decode_view(self) -> DecodeView:
        """Both streams quantized: the stored segments as plain tensors for the kernels, with the extensions this
        layer's backend reads (see the module docstring for what transforms change; a padded batch needs `rows`)."""
        return self.view_for(self.backend.features)

    def view_for(self, features: frozenset[str]) -> DecodeView:
        """`decode_view` for a reader of `features` (`Backend.features`; empty: the PyTorch path's plain view)."""
        rope = self._rope_view() if "rope" in features else None
        k = self._stream_view(self.k_stream, self.sink_k, None if rope is not None else self.k_pipe)
        v = self._stream_view(self.v_stream, self.sink_v, self.v_pipe)
        pads = None if self.uniform else torch.tensor(self.pads, device=self.sink_k.device)
        # the hadamard maps of the query and output in the kernel, unless a history is dequantized (the PyTorch path)
        had = self._hadamard if "hadamard" in features and k.history is None and v.history is None else None
        return DecodeView(k, v, self.N, self.cfg.sink_tokens, rope, pads, had)

    @functools.cached_property
    def _hadamard(self) -> tuple[int, int] | None:
        """`DecodeView.hadamard` for a kernel that maps query and output itself: the Hadamard block of the keys' and
        of the values' pipeline where that pipeline is the `hadamard` transform alone, 0 where it is not (another
        or no transform: a foldable one is then mapped by `kvq_sdpa`); None when neither is. Computed once (the
        pipelines and head size are fixed)."""
        D = self.sink_k.shape[-1]

        def block(pipe) -> int:
            t = _in_kernel(pipe, "hadamard")
            return 0 if t is None else t.block or D

        nk, nv = block(self.k_pipe), block(self.v_pipe)
        return (nk, nv) if nk or nv else None

    @property
    def _rows_fused(self) -> bool:
        """A left-padded batch decodes through the backend's kernel: it reads per-row layouts (`rows`), and nothing
        is left to undo on a dequantized history (no sparse outliers or residual corrections; transforms fold, or
        rope=pre in the kernel). Else `update` returns the materialized K/V (the model's SDPA over the padded batch)."""
        ok = self.__dict__.get("_rows_ok")
        if ok is None:
            kp, vp = self.k_pipe, self.v_pipe
            ok = (
                "rows" in self.backend.features
                and not _reads_dequantized(self.k_stream)
                and not _reads_dequantized(self.v_stream)
                and (vp is None or vp.foldable)
                and (kp is None or kp.foldable or ("rope" in self.backend.features and self._rope_view() is not None))
            )
            self._rows_ok = ok
        return ok

    def _rope_view(self) -> RopeView | None:
        """Keys under rope_pre alone (values: no transform or a foldable one), a model whose RoPE tabulates: the
        kernel rotates the pre-RoPE keys itself. None otherwise. The latest view is given again while it holds: the
        same position buffer, a table that covers every id in it."""
        rv, log = self._rope, self._log
        if rv is not None and rv.pos is log.ids and log.top < rv.cos.shape[0]:
            return rv
        kp, vp = self.k_pipe, self.v_pipe
        if _in_kernel(kp, "rope") is None or self.rope is None:
            return None
        if vp is not None and not vp.foldable:
            return None
        table = rope_table(self.rope.rotary_emb, log.top + 1, self.sink_k)
        self._rope = None if table is None else RopeView(*table, log.ids)
        return self._rope

    def _stream_view(self, stream, sink, pipe):
        if pipe is None or pipe.foldable:
            return stream.view(self.N, self._view_sink(sink, pipe), self.pads, None)
        # undone for the PyTorch path: the history as it is dequantized (the stream calls back); the window is exact
        return stream.view(self.N, sink, self.pads, lambda x, a: self._undo(pipe, x, a))

    def _view_sink(self, sink, pipe):
        """The sinks a view carries: as stored, or, under a foldable pipeline, mapped into its basis for this step:
        attention runs there (kvq_sdpa maps the query and the output), history and window are stored in it (a few
        tokens; a padded row's sinks are its own first tokens, all S of them mapped)."""
        if pipe is None or not pipe.foldable:
            return sink
        s = min(self.cfg.sink_tokens, self.N) if self.uniform else self.cfg.sink_tokens
        return pipe.forward(sink[:, :, :s]) if s else sink

    # -- kept decode calls ---------------------------------------------------------------------------------------
    def keep(self, view: DecodeView, query, fold_query: bool, fold_output: bool) -> None:
        """Keep the backend's call over `view` (this step's, which the backend has just read) for the next steps
        (`Backend.keep`: the CPU kernel's `KeptCall`), with whether `kvq_sdpa` mapped the query and the output around
        it. Nothing is kept where the backend keeps no call or cannot for this view."""
        keep = getattr(self.backend, "keep", None)
        call = keep(view, query) if keep is not None else None
        gens = (self.k_stream.store.generation, self.v_stream.store.generation)
        self._kept = None if call is None else (call, fold_query, fold_output, gens, view.rope)

    def kept_call(self):
        """The record `keep` made, (call, fold query, fold output, stores' generations, rope view), while this layer's
        stored tensors are the ones its call was made over (no store has grown, the same rope table and position ids),
        else None. The call takes `moving()`."""
        k = self._kept
        if k is None or k[3] != (self.k_stream.store.generation, self.v_stream.store.generation):
            return None
        if k[4] is not None and self._rope_view() is not k[4]:
            return None
        return k

    def moving(self) -> tuple:
        """What this decode step moves in the layer's view (a kept call's arguments, `KeptCall.__call__`): N, the
        sinks attended, and per stream (history n, window w, window tensor, sinks tensor, per-row layout of a
        left-padded batch or None)."""
        N, pads = self.N, self.pads  # the streams give per-row layouts where a row is padded
        kpipe = None if self._kept[4] is not None else self.k_pipe  # rope=pre in the kernel: keys' sinks as stored
        (kn, kw, kwin, krows), (vn, vw, vwin, vrows) = self.k_stream.moving(N, pads), self.v_stream.moving(N, pads)
        return (
            N, min(self.cfg.sink_tokens, N),
            (kn, kw, kwin, self._view_sink(self.sink_k, kpipe), krows),
            (vn, vw, vwin, self._view_sink(self.sink_v, self.v_pipe), vrows),
        )  # fmt: skip


def _in_kernel(pipe, feature: str):
    """The pipeline's transform when it is the only one and the kernel feature `feature` applies it
    (`Transform.kernel_feature`), else None."""
    if pipe is None or len(pipe.transforms) != 1 or pipe.transforms[0].kernel_feature != feature:
        return None
    return pipe.transforms[0]


def _reads_dequantized(stream) -> bool:
    """The stream stores what a kernel cannot read from codes (`PackedStore.reads_dequantized`); an exact one does
    not."""
    store = getattr(stream, "store", None)
    return store is not None and store.reads_dequantized
