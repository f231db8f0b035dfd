"""Shared fixtures: tiny seeded random Llama models (GQA, RoPE) for fast tests; the real model for `slow` ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("KVQ_DATA_DIR", REPO.parent / "shared" / "data"))
os.environ.setdefault("WANDB_MODE", "offline")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one of `make test`'s workers (one per core): one thread each, and so for the runs it starts (a test that sets
    # its own thread count still does); two threads per worker made twice the threads of the cores, and ~20% slower
    _cores = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _threads = max(1, (os.cpu_count() or 1) // _cores)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(min(2, _threads))
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))
# MKL in the mode every run computes in (kvq_lab.models.numerics), before any test's first product: otherwise a
# session's numbers would depend on whether a test that pins it (run, validate, load_model) came first
from kvq_lab.models.numerics import pin_blas  # noqa: E402

pin_blas()
if not torch.cuda.is_available():
    # Triton reads this when it is first imported: on CPU its kernels run in the interpreter
    # (tests/kernels/test_triton.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _reference_cache(tmp_path_factory):
    """The 16-bit references task=fidelity keeps (kvq_lab/tasks/reference.py) go to a temporary folder during the
    tests (and their subprocesses), not to the user's cache."""
    before = os.environ.get("KVQ_REFERENCE_CACHE")
    os.environ["KVQ_REFERENCE_CACHE"] = str(tmp_path_factory.mktemp("reference"))
    yield
    if before is None:
        os.environ.pop("KVQ_REFERENCE_CACHE", None)
    else:
        os.environ["KVQ_REFERENCE_CACHE"] = before


def pytest_collection_modifyitems(config, items):
    """`slurm` tests start a local SLURM cluster and wait out its requeue delays (minutes): they run when asked for
    (`make test-slurm`, i.e. `-m slurm`), and are skipped, saying so, otherwise."""
    if "slurm" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="starts a local SLURM cluster and takes minutes: make test-slurm (-m slurm)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


def tiny_llama(
    seed: int = 0,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = 256,
    hidden: int = 128,
):
    """A seeded random LlamaForCausalLM in eval mode (GQA: heads/kv_heads query heads per KV head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Random init gives tiny logits and near-uniform attention; scale up so quantization error shows in the
    # generations (otherwise every cache would agree trivially).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(8.0)
            layer.self_attn.q_proj.weight.mul_(8.0)
        model.lm_head.weight.mul_(20.0)
    return model


def left_padded_prompts(lengths: list[int], seed: int = 13, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of these lengths as a left-padded batch for a `tiny_llama`: (ids [B, T] with pad token 0 on the
    left, mask [B, T] long, 1 = token), T the longest length."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None] >= T - torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def spy_cpu_kernel(monkeypatch, what=lambda view: True) -> list:
    """Record what(view) for every call of the CPU kernel's decode attention (the kernel still runs): the list fills
    as the test generates. A kept call (`cpu_kernel.KeptCall`, the layer's next steps) counts with the view it was
    made from, when it runs (not when it hands the step back: the layer then calls `decode_attention`)."""
    from kvq_lab.kernels import cpu_kernel

    seen = []
    real = cpu_kernel.decode_attention
    monkeypatch.setattr(cpu_kernel, "decode_attention", lambda view, *a: seen.append(what(view)) or real(view, *a))
    spy_kept_calls(monkeypatch, lambda call: seen.append(what(call.view)))
    return seen


def spy_kept_calls(monkeypatch, record) -> None:
    """Call record(call) for every decode step a kept CPU kernel call (`cpu_kernel.KeptCall`) ran (the kernel still
    runs), not for a step it handed back."""
    from kvq_lab.kernels import cpu_kernel

    real = cpu_kernel.KeptCall.__call__

    def kept(self, *a):
        out = real(self, *a)
        if out is not None:
            record(self)
        return out

    monkeypatch.setattr(cpu_kernel.KeptCall, "__call__", kept)


def padded_packed_cache(model, mask: torch.Tensor, rope: str, backend: str):
    """A 2-bit K-C/V-T packed cache (G=32, R=32, 2 sinks) for `model`, declared the batch's padding `mask`: the fast
    paths' left-padded-generation tests compare backends on it."""
    from kvq_lab.cache import CacheConfig, QuantizedKVCache
    from kvq_lab.quant import QuantSpec

    cfg = CacheConfig(key=QuantSpec(2, 32, "channel"), value=QuantSpec(2, 32, "token"), mode="packed",
                      exact_window=32, sink_tokens=2, rope=rope, backend=backend)  # fmt: skip
    cache = QuantizedKVCache.for_model(model, cfg)
    cache.set_padding(mask)
    return cache


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def smol():
    """The real SmolLM2-135M-Instruct and tokenizer (for `slow` tests)."""
    from kvq_lab.models.loading import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A folder holding a tiny random Llama with SmolLM2's tokenizer: a real `model.path=` for run.py tests."""
    from transformers import AutoTokenizer

    from kvq_lab.models.loading import load_model, resolve

    src = resolve("smollm2-135m")
    if src.endswith(".gguf"):  # first use converts the GGUF once; later sessions reuse the cached copy
        load_model("smollm2-135m")
        src = resolve("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(src)
    out = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(vocab=len(tok)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def data_dir():
    if not (DATA_DIR / "coqa").is_dir():
        pytest.fail(f"no data folder at {DATA_DIR}; set KVQ_DATA_DIR to the shared data folder")
    return DATA_DIR


@pytest.fixture(scope="module")
def tiny():
    """A small peaked Llama for cache tests (`helpers_models.peaked_llama`), one per test module."""
    from helpers_models import peaked_llama

    return peaked_llama()
