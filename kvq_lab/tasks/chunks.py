"""llama.cpp's perplexity protocol (`task.protocol=chunks`; tools/perplexity/perplexity.cpp, `perplexity()` and
`kl_divergence()`), so that kvq_lab's numbers and `llama-perplexity`'s are computed on the same tokens the same way:

1. the text is tokenized once, with the tokenizer's special tokens (a BOS first where the model asks for one);
2. it is cut into `n_chunks = len // n_ctx` consecutive chunks of `n_ctx` tokens (`task.chunks` takes the first N);
   where the model adds a BOS, each chunk's first token is replaced by it (replaced, not prepended, as llama.cpp);
3. each chunk is one forward pass with a fresh cache, through the cache: the prompt's own K/V are quantized before
   attention reads them, as in llama.cpp (no exact prefill);
4. only the second half is scored: the logits at positions first = n_ctx // 2 .. n_ctx - 2 predict tokens
   first + 1 .. n_ctx - 1, so each chunk scores n_ctx - 1 - first tokens.

`chunk_logprobs` yields each chunk's log-probabilities over those positions; `task=ppl` sums their NLL
(`run_chunks_ppl`), `task=fidelity` compares them with the 16-bit model's on the same chunks
(kvq_lab/tasks/fidelity.py). The decode protocol (kvq_lab/tasks/decode.py) stays the default.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when the task runs, not when validation imports the task registry
    import torch

PROTOCOLS = ("decode", "chunks")
MIN_N_CTX = 4


def bos_to_add(tokenizer) -> int | None:
    """The BOS id llama.cpp would put at each chunk's start (the tokenizer adds one), else None. Asked of the
    tokenizer itself where it can be called: transformers 5 reports `add_bos_token=False` for tokenizers whose
    post-processor adds the BOS anyway (Gemma 3's)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    if getattr(tokenizer, "add_bos_token", False):
        return int(bos)
    if callable(tokenizer):
        ids = tokenizer("a")["input_ids"]
        return int(bos) if ids and ids[0] == bos else None
    return None


def make_chunks(ids: list[int], n_ctx: int, n_chunks: int | None, bos: int | None) -> torch.Tensor:
    """ids (the whole text, tokenized once) -> [C, n_ctx]: consecutive chunks, C = len // n_ctx (at most
    `n_chunks`), each chunk's first token replaced by `bos` when given."""
    import torch

    most = len(ids) // n_ctx
    if most < 2:
        raise ValueError(f"the text has {len(ids)} tokens; llama.cpp's protocol needs >= 2 * n_ctx = {2 * n_ctx}")
    c = most if n_chunks is None else min(n_chunks, most)
    out = torch.tensor(ids[: c * n_ctx]).view(c, n_ctx).clone()
    if bos is not None:
        out[:, 0] = bos
    return out


def first_scored(n_ctx: int) -> int:
    """Position of the first logit scored in a chunk (it predicts the token after it)."""
    return n_ctx // 2


def chunk_logprobs(model, make_cache, chunks: torch.Tensor, progress=None, desc: str = "chunks") -> Iterator:
    """chunks [C, n_ctx] -> yields (c, log-probs [n_ctx - 1 - first, V] of the scored positions, their targets
    [n_ctx - 1 - first]); each chunk one forward through a fresh cache from `make_cache()` (None: exact attention,
    no cache). NaN/inf logits raise, naming the chunk."""
    import torch
    from tqdm.auto import tqdm

    from kvq_lab.cache import NonFiniteError
    from kvq_lab.models.loading import cache_kwarg

    n_ctx = chunks.shape[1]
    first = first_scored(n_ctx)
    keep = n_ctx - first  # logits of positions first .. n_ctx - 1; the last predicts past the chunk
    for c in tqdm(range(chunks.shape[0]), desc=desc, leave=False, mininterval=10):
        ids = chunks[c : c + 1]
        cache = make_cache()
        kw = {cache_kwarg(): cache, "use_cache": True} if cache is not None else {"use_cache": False}
        logits = model(input_ids=ids, logits_to_keep=keep, **kw).logits[0, :-1].float()
        if not torch.isfinite(logits).all():
            raise NonFiniteError(f"non-finite logits (NaN/inf) in chunk {c} of the chunks protocol")
        yield c, torch.log_softmax(logits, dim=-1), ids[0, first + 1 :]
        if progress is not None:
            progress.done = c + 1


def text_chunks(ctx) -> torch.Tensor:
    """The run's chunks: its text (`task.source`), its tokenizer, `task.n_ctx`, `task.chunks` capped by `limit`."""
    from kvq_lab.tasks.text import source_text

    t = ctx.cfg.task
    n = t.get("chunks")
    n = n if ctx.limit is None else (ctx.limit if n is None else min(int(n), ctx.limit))
    ids = ctx.tokenizer(source_text(t, ctx.data_dir), add_special_tokens=True)["input_ids"]
    return make_chunks(ids, int(t.n_ctx), n, bos_to_add(ctx.tokenizer)).to(ctx.model.device)


def run_chunks_ppl(ctx) -> dict[str, float]:
    """`task=ppl task.protocol=chunks`: `ppl/ppl` over the scored halves, its uncertainty as llama.cpp's final
    estimate (PPL * sqrt((E[nll^2] - E[nll]^2) / (N - 1))), `ppl/nll`, `ppl/n_tokens`, `ppl/chunks`."""
    import torch

    from kvq_lab.tasks.kld_stats import mean_and_uncertainty

    chunks = text_chunks(ctx)
    ctx.progress.unit, ctx.progress.total = "chunks", chunks.shape[0]
    nll = []
    for _, logp, target in chunk_logprobs(ctx.model, ctx.make_cache, chunks, ctx.progress):
        nll.append(-logp.gather(1, target[:, None])[:, 0])
    flat = torch.cat(nll).double().cpu().numpy()
    mean, unc = mean_and_uncertainty(flat)
    ctx.artifacts["ppl_per_chunk"] = [round(math.exp(float(x.mean())), 4) for x in nll]
    ppl = math.exp(mean)
    return {"ppl/ppl": ppl, "ppl/ppl_unc": ppl * unc, "ppl/nll": mean, "ppl/n_tokens": int(flat.size),
            "ppl/chunks": int(chunks.shape[0])}  # fmt: skip
