"""Synthetic long-context retrieval (RULER-style), generated locally from a seed, answered through the cache.

Three kinds of sample, each a haystack of filler text of a chosen token length with something hidden in it:

- `passkey` (Mohtashami & Jaggi 2023; RULER's niah with noise): the filler is the repeated noise paragraph
  "The grass is green. The sky is blue. ...", and "The pass key is 71432. Remember it. 71432 is the pass key." is
  inserted at `depth`; the question asks for the pass key.
- `needle` (RULER niah_single_2): the filler is seeded random sentences over a small vocabulary (varied text, no
  digits), the needle "One of the special magic numbers for <key> is: <7 digits>." is inserted at `depth`; the
  question names the key.
- `variable_tracking` (RULER vt, one chain, answer form changed): "VAR ABCDE = 40213." at `depth`, then
  "VAR FGHIJ = VAR ABCDE." later in the noise filler; the question asks for the value of the last variable
  (RULER asks for every variable holding the value; a single number keeps the scoring exact-match for all kinds).

The prompt (`prompt=chat`, default: the model's chat template, for an instruct model) is: user turn = instruction,
blank line, the haystack, blank line, the question; then the assistant turn is opened with an answer prefix ("The
pass key is") so the first generated tokens are the answer. `prompt=plain` (a base model, which has no template):
the same instruction, haystack, question and answer prefix as plain text separated by blank lines, after the BOS
where the tokenizer adds one. `context_tokens` is the whole budget, prompt plus
`max_new_tokens`; the haystack is filled until the tokenized prompt is as long as the budget allows.

Score: exact match of the first run of digits in the response with the answer (`score`). Everything here is plain
Python over a tokenizer; generation is `run_retrieval`.

Options of `task=retrieval` in conf/task/retrieval.yaml.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq_lab.common.errors import ConfigError
from kvq_lab.common.metric import Metric
from kvq_lab.tasks.chunks import bos_to_add

from . import Task, TaskContext, register_task

if TYPE_CHECKING:  # built above the tasks (kvq_lab.preflight); tasks only read it
    from kvq_lab.contract import RunConfig

KINDS = ("passkey", "needle", "variable_tracking")
PROMPTS = ("chat", "plain")  # task.prompt; the first is the default (conf/task/retrieval.yaml states it too)
DEFAULT_PROMPT = PROMPTS[0]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INSTRUCTION = {
    "passkey": "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important information there.",
    "needle": "Some special magic numbers are hidden within the following text. Make sure to memorize them. I will "
    "quiz you about the numbers afterwards.",
    "variable_tracking": "Memorize and track the chain of variable assignments hidden in the following text.",
}

# needle filler: seeded sentences over a small vocabulary (no digits, so the only number is the needle's)
_ADJ = "quiet bright old small green heavy gentle distant narrow golden wooden sleepy busy empty warm".split()
_NOUN = "river garden village teacher window mountain library farmer bridge forest market lantern kitten road".split()
_VERB = "watched followed crossed painted visited remembered found carried passed opened".split()
_PLACE = "the harbor|the old mill|the hill|the station|the square|the orchard|the lake|the school".split("|")
_KEYS = "apple tiger violin comet saddle harbor pepper marble falcon walnut cactus anchor velvet thistle".split()


@dataclass(frozen=True)
class Sample:
    """One retrieval prompt: `prompt` is the text given to the model (chat template applied), `answer` the digits
    to find, `depth` where the hidden fact sits (0 = start of the haystack, 1 = end), `n_tokens` the prompt's
    length in tokens."""

    kind: str
    prompt: str
    answer: str
    depth: float
    n_tokens: int


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10**n))


def _var(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _filler_sentence(kind: str, rng: random.Random) -> str:
    if kind == "needle":
        a, b = rng.sample(_ADJ, 2)
        n1, n2 = rng.sample(_NOUN, 2)
        return f"The {a} {n1} {rng.choice(_VERB)} the {b} {n2} near {rng.choice(_PLACE)}."
    return NOISE


def _hidden(kind: str, rng: random.Random) -> tuple[list[str], str, str, str]:
    """-> (statements to hide, in order; question; answer prefix; answer)."""
    if kind == "passkey":
        key = _digits(rng, 5)
        fact = f"The pass key is {key}. Remember it. {key} is the pass key."
        return [fact], "What is the pass key?", "The pass key is", key
    if kind == "needle":
        key, value = rng.choice(_KEYS), _digits(rng, 7)
        fact = f"One of the special magic numbers for {key} is: {value}."
        question = f"What is the special magic number for {key} mentioned in the provided text?"
        return [fact], question, f"The special magic number for {key} mentioned in the provided text is", value
    if kind == "variable_tracking":
        a, b = _var(rng), _var(rng)
        while b == a:
            b = _var(rng)
        value = _digits(rng, 5)
        question = f"What is the value of VAR {b}? Follow the chain of assignments."
        return [f"VAR {a} = {value}.", f"VAR {b} = VAR {a}."], question, f"The value of VAR {b} is", value
    raise ValueError(f"task.kind={kind!r}; choose one of: {', '.join(KINDS)}")


def _assemble(
    tokenizer, kind: str, filler: list[str], hidden: list[str], at: list[int], question: str, prefix: str, prompt: str
):
    parts = list(filler)
    for i, stmt in sorted(zip(at, hidden, strict=True), key=lambda x: x[0], reverse=True):
        parts.insert(i, stmt)
    user = f"{INSTRUCTION[kind]}\n\n{' '.join(parts)}\n\n{question}"
    if prompt == "plain":
        bos = tokenizer.bos_token if bos_to_add(tokenizer) is not None else ""
        return f"{bos}{user}\n\n{prefix}"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    return text + prefix


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_sample(
    tokenizer, kind: str, budget: int, depth: float, rng: random.Random, prompt: str = DEFAULT_PROMPT
) -> Sample:
    """A prompt of at most `budget` tokens (as long as whole filler sentences allow) with the hidden statements at
    `depth` of the haystack (variable_tracking: the first at `depth`, the second halfway from there to the end)."""
    hidden, question, prefix, answer = _hidden(kind, rng)
    base = _n_tokens(tokenizer, _assemble(tokenizer, kind, [], hidden, [0] * len(hidden), question, prefix, prompt))
    if base >= budget:
        raise ValueError(
            f"task.context_tokens leaves {budget} tokens for the prompt; the {kind} prompt alone needs {base}"
        )
    # estimate how many sentences fit from the tokens of a sample of sentences, then trim to the exact budget
    probe = [_filler_sentence(kind, random.Random(rng.random())) for _ in range(8)]
    per = _n_tokens(tokenizer, " ".join(probe)) / len(probe)
    n = max(0, int((budget - base) / per) + 2)
    filler = [_filler_sentence(kind, rng) for _ in range(n)]

    def build(k: int) -> str:
        spots = [round(depth * k)] if len(hidden) == 1 else [round(depth * k), round((depth + (1 - depth) / 2) * k)]
        return _assemble(tokenizer, kind, filler[:k], hidden, spots, question, prefix, prompt)

    k = n
    text = build(k)
    size = _n_tokens(tokenizer, text)
    while size > budget and k > 0:  # drop sentences, a proportional step first, then one by one
        k = max(0, min(k - 1, k - math.floor((size - budget) / per)))
        text = build(k)
        size = _n_tokens(tokenizer, text)
    return Sample(kind, text, answer, depth, size)


def depths(samples: int, depth: float | None) -> list[float]:
    """Each sample's depth: the given one, or (None) evenly spread over [0, 1] as RULER's depth sweep does."""
    if depth is not None:
        return [float(depth)] * samples
    return [i / (samples - 1) if samples > 1 else 0.5 for i in range(samples)]


def make_samples(
    tokenizer,
    kind: str,
    context_tokens: int,
    samples: int,
    depth: float | None,
    seed: int,
    max_new_tokens: int,
    prompt: str = DEFAULT_PROMPT,
) -> list[Sample]:
    """`samples` prompts of `kind`, deterministic per (tokenizer, seed, settings): sample i uses its own
    `random.Random((seed, kind, i))`, so a sample does not change when `samples` grows (nor with `prompt`: the
    haystack and answer are the same in both formats)."""
    return [
        make_sample(tokenizer, kind, context_tokens - max_new_tokens, d, random.Random(f"{seed}/{kind}/{i}"), prompt)
        for i, d in enumerate(depths(samples, depth))
    ]


_NUMBER = re.compile(r"\d+")


def score(response: str, answer: str) -> bool:
    """Exact match: the first run of digits in the response is the answer (`"71432."` yes; `"7143"` or
    `"is 71432 1"` with a different first number, no)."""
    m = _NUMBER.search(response)
    return m is not None and m.group(0) == answer


def greedy(model, cache, logits, max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy decoding from a filled cache: logits [1, V] of the last prompt position -> generated ids (stops after
    an EOS id, which is kept, or after max_new_tokens). Each step attends to the cache as the quantizer left it."""
    import torch

    from kvq_lab.models.loading import cache_kwarg

    kw = cache_kwarg()
    out: list[int] = []
    for step in range(max_new_tokens):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        if nxt in eos or step + 1 == max_new_tokens:
            break
        x = torch.tensor([[nxt]], device=logits.device)
        logits = model(input_ids=x, **{kw: cache}, use_cache=True).logits[:, -1].float()
    return out


def run_retrieval(ctx) -> dict[str, float]:
    """Task entry point: for each sample, prefill (`task.prompt_forward=exact`: exact attention, K/V handed to a fresh
    cache as KIVI's real cache does, memoized across the runs of a sweep; `cache`: the prefill through the cache
    itself), then greedy decoding through the cache. Metrics `retrieval/acc` (%), `retrieval/n`,
    `retrieval/prompt_tokens` (mean); per-sample responses go to samples.json."""
    import torch
    from transformers import DynamicCache

    from kvq_lab.tasks.decode import prefill

    t = ctx.cfg.task
    n = int(t.samples) if ctx.limit is None else min(int(t.samples), ctx.limit)
    depth = None if t.get("depth") is None else float(t.depth)
    max_new = int(t.max_new_tokens)
    prompt = str(t.get("prompt", DEFAULT_PROMPT))
    items = make_samples(ctx.tokenizer, str(t.kind), int(t.context_tokens), n, depth, int(t.seed), max_new, prompt)
    eos = {ctx.tokenizer.eos_token_id} | set(_as_list(ctx.model.generation_config.eos_token_id))
    ctx.progress.unit, ctx.progress.total = "samples", n
    rows, hits = [], 0
    for i, s in enumerate(items):
        ids = torch.tensor([ctx.tokenizer(s.prompt, add_special_tokens=False)["input_ids"]], device=ctx.model.device)
        cache = ctx.make_cache() or DynamicCache()
        logits = prefill(ctx.model, cache, ids, exact=str(t.prompt_forward) == "exact")
        new = greedy(ctx.model, cache, logits, max_new, eos)
        response = ctx.tokenizer.decode(new, skip_special_tokens=True)
        ok = score(response, s.answer)
        hits += ok
        rows.append(
            {
                "doc_id": i,
                "depth": round(s.depth, 4),
                "prompt_tokens": s.n_tokens,
                "target": s.answer,
                "response": response,
                "correct": bool(ok),
            }
        )
        ctx.progress.done = i + 1
    ctx.artifacts["samples"] = rows
    return {
        "retrieval/acc": 100.0 * hits / n,
        "retrieval/n": n,
        "retrieval/prompt_tokens": sum(s.n_tokens for s in items) / n,
    }


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


MIN_PROMPT = 128  # tokens left for the prompt after max_new_tokens: the instruction and question alone take ~100
PROMPT_FORWARD = ("exact", "cache")  # the prompt's forward: the model alone (K/V handed over) | through the cache


def _int(t, key: str, lo: int) -> int:
    v = t.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"task.{key}={v!r} must be an integer >= {lo}")
    return v


class RetrievalTask(Task):
    """Exact-match accuracy of a hidden number found in a long generated haystack (RULER-style)."""

    name = "retrieval"
    chat = True
    plain_prompt = "task.prompt=plain"
    headline = (Metric("retrieval/acc", "retrieval EM", "higher", "%"),)
    options = (
        "name",
        "kind",
        "context_tokens",
        "depth",
        "samples",
        "seed",
        "max_new_tokens",
        "prompt_forward",
        "prompt",
    )
    limit_unit = "samples"

    def uses_chat(self, task_cfg) -> bool:
        return task_cfg.get("prompt", DEFAULT_PROMPT) == "chat"

    def check_options(self, cfg: RunConfig) -> None:
        super().check_options(cfg)
        t = cfg.task
        if t.get("kind") not in KINDS:
            raise ConfigError(f"task.kind={t.get('kind')!r}; choose one of: {', '.join(KINDS)}")
        samples = _int(t, "samples", 1)
        _int(t, "seed", 0)
        new = _int(t, "max_new_tokens", 1)
        _int(t, "context_tokens", new + MIN_PROMPT)  # and against the model's positions: `check_positions`
        depth = t.get("depth")
        if depth is not None and (
            isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1
        ):
            raise ConfigError(f"task.depth={depth!r} must be a number in [0, 1] or null (spread over the samples)")
        if t.get("prompt_forward") not in PROMPT_FORWARD:
            raise ConfigError(
                f"task.prompt_forward={t.get('prompt_forward')!r}; choose one of: {', '.join(PROMPT_FORWARD)}"
            )
        if t.get("prompt", DEFAULT_PROMPT) not in PROMPTS:
            raise ConfigError(f"task.prompt={t.get('prompt')!r}; choose one of: {', '.join(PROMPTS)}")
        limit = cfg.limit
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > samples:
            raise ConfigError(f"limit={limit} but task.samples={samples}; use limit<={samples} or limit=null")

    def inputs(self, cfg: RunConfig, data_dir: Path | None) -> dict[str, Any]:
        t = cfg.task
        keys = ("kind", "context_tokens", "depth", "samples", "seed", "max_new_tokens", "prompt")
        return {"source": "generated", "generator": "kvq_lab.tasks.retrieval", **{k: t.get(k) for k in keys}}

    def positions(self, task_cfg) -> tuple[int, str]:
        return task_cfg.get("context_tokens"), "task.context_tokens"

    def prompt_prefill(self, task_cfg, cache) -> str:
        """As task=ppl's: task.prompt_forward=exact hands the cache exact K/V unless the cache quantizes the prompt."""
        if task_cfg.get("prompt_forward") == "exact" and not cache.quantizes_prefill:
            return "exact"
        return super().prompt_prefill(task_cfg, cache)

    def run(self, ctx: TaskContext) -> dict[str, float]:
        return run_retrieval(ctx)


RETRIEVAL = register_task(RetrievalTask())
