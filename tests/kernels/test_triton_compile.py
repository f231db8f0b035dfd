"""The Triton kernels compiled for a GPU (sm_90, Hopper) on a machine without one.

tests/kernels/test_triton.py runs the kernels in the interpreter, which executes them with NumPy: it does not
type-check or lower them the way the GPU compiler does (integer literal types, loops with runtime bounds, 3-D
broadcasts, layouts). Here every launch the decode attention, dequantize and quantize+pack entry points make, for the
fast path's configurations, is captured instead of run and compiled ahead of time to a cubin with Triton's own ptxas, so
a kernel that cannot build for a GPU fails on CPU-only CI. It runs in a fresh process: the interpreter (which conftest
turns on without CUDA) must be off when triton is imported.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import os, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvq_lab.cache import CacheConfig
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.cache.routing.rope import RopeHelper
from kvq_lab.kernels import triton as tk
from kvq_lab.kernels.triton import attention, dequantize, quantize
from kvq_lab.quant.formats import default_bits
from kvq_lab.quant.spec import QuantSpec
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

launches = []


class Capture:  # stands for a @triton.jit kernel: kernel[grid](...) records the call instead of running it
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kw: launches.append((self.fn, args, kw))


for module, name in ((attention, "_decode_attn_kernel"), (attention, "combine_kernel"),
                     (dequantize, "_dequant_kernel"), (quantize, "_quantize_pack_kernel")):
    setattr(module, name, Capture(getattr(module, name)))
os.environ["TRITON_INTERPRET"] = "1"  # now that the kernels are JIT functions: supports() takes CPU tensors

def view_of(dtype, rope, pads, key, value, D):
    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D)
    helper = RopeHelper(LlamaRotaryEmbedding(cfg))
    spec = lambda f, ax: QuantSpec(2 if f == "int" else default_bits(f), 32, ax, f)
    cfg = CacheConfig(key=spec(key, "channel"), value=spec(value, "token"), mode="packed", exact_window=32,
                      sink_tokens=2, backend="torch", rope=rope)
    padding, ids, B = PaddingState(), None, len(pads)
    real = torch.arange(70)[None] >= torch.tensor(pads)[:, None]
    if any(pads):
        padding.prompt_mask = real.long()
        ids = (real.cumsum(1) - 1).clamp(min=0)
    layer = PackedLayer(cfg, helper, padding)
    k, v = torch.randn(B, 2, 80, D).to(dtype), torch.randn(B, 2, 80, D).to(dtype)
    layer.update(k[:, :, :70], v[:, :, :70], **({} if ids is None else {"position_ids": ids}))
    for n in range(70, 80):
        layer.update(k[:, :, n : n + 1], v[:, :, n : n + 1],
                     **({} if ids is None else {"position_ids": ids[:, -1:] + 1 + n - 70}))
    return layer.view_for(frozenset({"rope", "rows"})), layer.N

# (dtype, rope, pads per row, key format, value format, D, query heads per kv head, mask, positions per program)
for dtype, rope, pads, kf, vf, D, r, mask, chunk in [
    (torch.float32, "post", [0], "int", "int", 64, 3, None, None),
    (torch.float16, "pre", [0], "int", "int", 64, 3, None, 32),
    (torch.bfloat16, "pre", [0, 9], "int", "int", 128, 4, "bool", 32),
    (torch.float32, "post", [5, 0], "fp8_e4m3", "lut", 64, 1, "float", None),
    (torch.float16, "pre", [0], "nuq", "fp8_e5m2", 64, 3, None, None),
    (torch.float32, "post", [0], "q5_0", "q5_1", 64, 2, None, None),  # 40-bit words: int64 in load_codes
]:
    view, N = view_of(dtype, rope, pads, kf, vf, D)
    B = len(pads)
    q = torch.randn(B, 2 * r, 1, D).to(dtype)
    m = {None: None, "bool": torch.ones(B, 1, 1, N, dtype=torch.bool), "float": torch.zeros(B, 1, 1, N)}[mask]
    assert tk.supports(view, q, m), (dtype, rope, pads)
    tk.decode_attention(view, q, m, 0.125, chunk=chunk)
x = torch.randn(1, 2, 70, 64)
for spec in (QuantSpec(2, 32, "channel"), QuantSpec(3, 32, "token")):
    tk.quantize_into(torch.zeros(1, 2, 96, 64, dtype=torch.uint8), *(torch.zeros(1, 2, 70, 2, dtype=torch.float16)
                     if spec.axis == "token" else torch.zeros(1, 2, 3, 64, dtype=torch.float16) for _ in "sz"),
                     x, spec, 0)
    params = torch.zeros(1, 2, 70, 2) if spec.axis == "token" else torch.zeros(1, 2, 3, 64)
    tk.unpack_dequantize(torch.zeros(1, 2, 96, 64, dtype=torch.uint8), params.half(), params.half(), spec, 70)
tk.unpack_dequantize(torch.zeros(1, 2, 96, 64, dtype=torch.uint8), torch.zeros(1, 2, 70, 2).half(), None,
                     QuantSpec(8, 32, "token", "fp8_e4m3"), 70)
tk.unpack_dequantize(torch.zeros(1, 2, 60, 64, dtype=torch.uint8), torch.zeros(1, 2, 3, 64).half(),
                     torch.zeros(1, 2, 3, 64).half(), QuantSpec(5, 32, "channel", "q5_1"), 70)

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8", torch.int8: "i8",
         torch.int32: "i32", torch.int64: "i64"}
kinds = set()
for fn, args, kw in launches:
    options = {k: kw.pop(k) for k in ("enable_fp_fusion", "num_warps") if k in kw}
    values = dict(zip(fn.arg_names, args), **kw)
    signature, constants = {}, {}
    for name, param in zip(fn.arg_names, fn.params):
        v = values[name]
        if param.is_constexpr:
            signature[name], constants[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + TYPES[v.dtype]
        else:
            assert isinstance(v, int) and not isinstance(v, bool), (fn.__name__, name, v)
            signature[name] = "i32" if abs(v) < 2**31 else "i64"
    kernel = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"], fn.__name__
    kinds.add(fn.__name__)
print("compiled", len(launches), "launches of", sorted(kinds))
"""


def test_every_kernel_launch_compiles_for_sm90():
    """Every launch of the fast path's configurations (fp32 / fp16 / bf16, rope=pre, padded rows, bool and additive
    masks, chunks merged, GQA 1-4, D 64 and 128, int / fp8 / lut / nuq / q5 codes; dequantize, quantize+pack) compiles
    to sm_90 machine code."""
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"  # in the triton wheel
    if not (bundled.exists() or os.environ.get("TRITON_PTXAS_PATH")):
        pytest.skip(f"no ptxas in this triton install ({bundled})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice (the launches set it themselves)
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    kernels = "['_decode_attn_kernel', '_dequant_kernel', '_quantize_pack_kernel', 'combine_kernel']"
    assert f"compiled 14 launches of {kernels}" in r.stdout, r.stdout


def test_tensor_core_route_machine_code(monkeypatch):
    """The tensor-core route's decode kernel, compiled for sm_90a in every configuration of scripts/kernel_report.py
    (fp16 and bf16, D 64/128/256, MHA to GQA 8, KIVI-2/4, K-T/V-T, K-C/V-C, 8- and 1-bit codes, padded rows with a
    mask) and read back from its machine code: it multiplies on tensor cores (HMMA), converts no integer to a float
    inside any loop (codes become halves by bit operations), spills no register and touches no local memory."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell").exists():
        pytest.skip("no ptxas / cuobjdump in this triton install")
    from helpers_models import script_module

    kernel_report = script_module("kernel_report", monkeypatch)
    rows = kernel_report.report(routes=("tensor_cores",))
    assert len(rows) == len(kernel_report.CONFIGS)
    for r in rows:
        assert r["kernel"] == "_tc_decode_kernel", r
        assert r["mma"] > 0 and r["main_loop"]["mma"] > 0, r
        assert r["loop_i2f"] == 0 and r["spill_bytes"] == 0 and r["local"] == 0, r
