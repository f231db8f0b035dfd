"""task.protocol=chunks (llama.cpp's perplexity protocol, kvq_lab/tasks/chunks.py) against hand-computed references on
a tiny model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from kvq_lab.cache import CacheConfig, QuantizedKVCache
from kvq_lab.quant.spec import QuantSpec
from kvq_lab.tasks import Progress
from kvq_lab.tasks import chunks as C


def test_chunks_cut_the_text_and_replace_each_first_token_by_bos():
    ids = list(range(10, 21))  # 11 tokens, n_ctx 4: two whole chunks, the rest dropped
    assert C.make_chunks(ids, 4, None, None).tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert C.make_chunks(ids, 4, None, 1).tolist() == [[1, 11, 12, 13], [1, 15, 16, 17]]  # replaced, not prepended
    assert C.make_chunks(ids, 4, 1, None).tolist() == [[10, 11, 12, 13]]
    with pytest.raises(ValueError, match="needs >= 2 \\* n_ctx = 12"):
        C.make_chunks(ids, 6, None, None)
    assert C.first_scored(512) == 256 and C.first_scored(5) == 2


def test_bos_is_added_only_where_the_tokenizer_adds_one():
    assert C.bos_to_add(SimpleNamespace(add_bos_token=True, bos_token_id=2)) == 2
    assert C.bos_to_add(SimpleNamespace(add_bos_token=False, bos_token_id=1)) is None  # SmolLM2's GGUF: no BOS
    assert C.bos_to_add(SimpleNamespace(bos_token_id=1)) is None

    class PostProcessed(SimpleNamespace):  # add_bos_token says no, its post-processor adds one (Gemma 3)
        def __call__(self, text):
            return {"input_ids": [self.bos_token_id, 99]}

    assert C.bos_to_add(PostProcessed(add_bos_token=False, bos_token_id=2)) == 2
    assert C.bos_to_add(PostProcessed(add_bos_token=False, bos_token_id=None)) is None


def _ctx(model, make_cache, ids: list[int], n_ctx: int, tmp_path):
    """A TaskContext-like object for run_chunks_ppl whose tokenizer returns `ids` for any text."""
    tok = type("Tok", (), {"add_bos_token": False, "bos_token_id": None, "__call__": lambda self, text, **k: {
        "input_ids": ids}})()  # fmt: skip
    cfg = SimpleNamespace(task=OmegaConf.create({"source": "file", "path": str(tmp_path / "t.txt"), "n_ctx": n_ctx,
                                                 "chunks": None}))  # fmt: skip
    (tmp_path / "t.txt").write_text("text")
    return SimpleNamespace(model=model, tokenizer=tok, make_cache=make_cache, cfg=cfg, data_dir=None, limit=None,
                           progress=Progress(), artifacts={})  # fmt: skip


@torch.inference_mode()
def test_chunk_ppl_is_the_second_half_of_each_chunk_scored_by_one_forward(tiny_model, tmp_path):
    ids = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    n_ctx = 32  # two chunks, 6 tokens left over
    nll = []
    for c in range(2):  # by hand: one full forward per chunk, logits 16..30 predict tokens 17..31
        chunk = torch.tensor([ids[c * n_ctx : (c + 1) * n_ctx]])
        logp = torch.log_softmax(tiny_model(chunk).logits[0].float(), dim=-1)
        nll += [-float(logp[t, chunk[0, t + 1]]) for t in range(16, 31)]
    want = math.exp(sum(nll) / len(nll))
    ctx = _ctx(tiny_model, lambda: None, ids, n_ctx, tmp_path)
    got = C.run_chunks_ppl(ctx)
    assert got["ppl/n_tokens"] == 30 and got["ppl/chunks"] == 2 and ctx.progress.done == 2
    assert got["ppl/ppl"] == pytest.approx(want, rel=1e-5)
    sd = math.sqrt(sum(x * x for x in nll) / 30 - (sum(nll) / 30) ** 2)
    assert got["ppl/ppl_unc"] == pytest.approx(want * sd / math.sqrt(29), rel=1e-4)  # llama.cpp's estimate
    exact16 = lambda: QuantizedKVCache.for_model(tiny_model, CacheConfig(QuantSpec(16, 32), QuantSpec(16, 32)))  # noqa: E731
    assert C.run_chunks_ppl(_ctx(tiny_model, exact16, ids, n_ctx, tmp_path))["ppl/ppl"] == pytest.approx(want, rel=1e-5)


@torch.inference_mode()
def test_the_prompt_itself_is_read_quantized(tiny_model, tmp_path):
    """As llama.cpp's quantized cache: the chunk's own K/V are quantized before attention reads them, so a 2-bit
    cache moves the score of a single forward (an exact prefill would leave it untouched)."""
    ids = torch.randint(3, 256, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    two = lambda: QuantizedKVCache.for_model(  # noqa: E731
        tiny_model, CacheConfig(QuantSpec(2, 32, "token"), QuantSpec(2, 32, "token"))
    )
    exact = C.run_chunks_ppl(_ctx(tiny_model, lambda: None, ids, 32, tmp_path))["ppl/ppl"]
    q = C.run_chunks_ppl(_ctx(tiny_model, two, ids, 32, tmp_path))["ppl/ppl"]
    assert abs(math.log(q / exact)) > 1e-3
