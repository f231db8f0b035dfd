"""What the compiled decode-attention kernels are, for a Hopper GPU (sm_90), on a machine without one.

    python scripts/kernel_report.py                      # markdown table on stdout
    python scripts/kernel_report.py --out experiments/kernels/sm90_report.md --json experiments/kernels/sm90_report.json

Each configuration's decode step (`kvq_lab.kernels.triton.decode_attention`, the launch the cache makes) is captured
instead of run, compiled ahead of time with Triton's own compiler for sm_90, and its machine code read back with the
CUDA tools the triton wheel bundles (ptxas -v, cuobjdump -sass): registers per thread, spilled bytes, shared memory,
and instruction counts: tensor-core MMAs (HMMA / HGMMA), int-to-float conversions (I2F*), float-to-float
conversions (F2F*), global loads and how many of them are 128-bit wide, instructions in all. The tensor-core route
should show MMAs, no I2F and no spills; tests/kernels/test_triton_compile.py asserts that for every configuration
here. Runs in a fresh process: the Triton interpreter must be off when triton is imported (it is turned on after,
so the launchers accept CPU tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, model dtype, key (bits, G, axis), value (bits, G, axis), head dim, query heads per kv head, pads, mask)
CONFIGS = [
    ("KIVI-2 fp16 D128 GQA4", "float16", (2, 32, "channel"), (2, 32, "token"), 128, 4, None, False),
    ("KIVI-2 bf16 D128 GQA4", "bfloat16", (2, 32, "channel"), (2, 32, "token"), 128, 4, None, False),
    ("KIVI-2 fp16 D64 GQA8", "float16", (2, 32, "channel"), (2, 32, "token"), 64, 8, None, False),
    ("KIVI-2 fp16 D256 GQA4", "float16", (2, 32, "channel"), (2, 32, "token"), 256, 4, None, False),
    ("KIVI-2 fp16 D128 MHA", "float16", (2, 32, "channel"), (2, 32, "token"), 128, 1, None, False),
    ("KIVI-4 fp16 D128 GQA4", "float16", (4, 32, "channel"), (4, 32, "token"), 128, 4, None, False),
    ("K-T/V-T 2-bit fp16 D128 GQA4", "float16", (2, 32, "token"), (2, 32, "token"), 128, 4, None, False),
    ("K-C/V-C 2-bit fp16 D128 GQA4", "float16", (2, 32, "channel"), (2, 32, "channel"), 128, 4, None, False),
    ("K 8-bit/V 1-bit fp16 D128 GQA4", "float16", (8, 64, "channel"), (1, 32, "token"), 128, 4, None, False),
    ("KIVI-2 fp16 padded B4 + mask", "float16", (2, 32, "channel"), (2, 32, "token"), 128, 4, [0, 9, 40, 3], True),
    ("KIVI-2 bf16 padded B4 + mask", "bfloat16", (2, 32, "channel"), (2, 32, "token"), 128, 4, [0, 9, 40, 3], True),
]

SCRIPT = r"""
import json, os, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvq_lab.cache import CacheConfig
from kvq_lab.cache.layers.base import PaddingState
from kvq_lab.cache.layers.packed import PackedLayer
from kvq_lab.kernels.triton import attention, attention_tc
from kvq_lab.kernels.triton import common
from kvq_lab.quant.spec import QuantSpec

launches = []


class Capture:  # stands for a @triton.jit kernel: kernel[grid](...) records the call instead of running it
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kw: launches.append((self.fn, args, kw))


for module, name in ((attention, "_decode_attn_kernel"), (attention, "combine_kernel"),
                     (attention_tc, "_tc_decode_kernel")):
    setattr(module, name, Capture(getattr(module, name)))
os.environ["TRITON_INTERPRET"] = "1"  # now that the kernels are JIT functions: the launchers take CPU tensors

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8", torch.int8: "i8",
         torch.int32: "i32", torch.int64: "i64"}


def compile_launch(fn, args, kw):
    kw = dict(kw)
    options = {k: kw.pop(k) for k in ("enable_fp_fusion", "num_warps", "num_stages") if k in kw}
    if "FUSED" in kw:
        kw["FUSED"] = True  # what a CUDA launch passes (captured on CPU tensors)
    values = dict(zip(fn.arg_names, args), **kw)
    signature, constants, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        v = values[name]
        if param.is_constexpr:
            signature[name], constants[name] = "constexpr", v
            continue
        if isinstance(v, torch.Tensor):
            signature[name] = "*" + TYPES[v.dtype]
            aligned = v.data_ptr() % 16 == 0
        elif isinstance(v, float):
            signature[name], aligned = "fp32", False
        else:
            assert isinstance(v, int) and not isinstance(v, bool), (fn.__name__, name, v)
            signature[name] = "i32" if abs(v) < 2**31 else "i64"
            aligned = v % 16 == 0
        if aligned:  # what the launcher specializes on (pointers and integers divisible by 16): wide loads
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constants, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def layer_view(dtype, key, value, D, pads):
    cfg = CacheConfig(key=QuantSpec(*key), value=QuantSpec(*value), mode="packed", exact_window=128,
                      sink_tokens=4, backend="torch")
    B = len(pads) if pads else 1
    padding, kw = PaddingState(), {}
    if pads:
        real = torch.arange(600)[None] >= torch.tensor(pads)[:, None]
        padding.prompt_mask = real.long()
        kw = {"position_ids": (real.cumsum(1) - 1).clamp(min=0)}
    layer = PackedLayer(cfg, None, padding)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(B, 2, 600, D, generator=g).to(dtype) for _ in "kv")
    layer.update(k, v, **kw)
    return layer.view_for(frozenset({"rows"})), layer.N, B


out = []
for name, dtype, key, value, D, r, pads, masked in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    view, N, B = layer_view(dtype, key, value, D, pads)
    q = torch.randn(B, 2 * r, 1, D).to(dtype)
    mask = torch.ones(B, 1, 1, N, dtype=torch.bool) if masked else None
    for route in json.loads(sys.argv[3]):
        launches.clear()
        if route == "tensor_cores":
            why = attention_tc.fast_route_reason(view, q)  # bf16 is refused here for the interpreter's sake only
            assert why is None or "interpreter" in why, (name, why)
            attention._tensor_cores(view, q, mask, D**-0.5, None)
        else:
            attention.decode_attention(view, q, mask, D**-0.5, route="general")
        fn, args, kw = next(l for l in launches if l[0].__name__ != "combine_kernel")
        k = compile_launch(fn, args, kw)
        path = os.path.join(sys.argv[2], f"{len(out)}.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        with open(path[:-6] + ".ptx", "w") as f:
            f.write(k.asm["ptx"])
        out.append(dict(config=name, route=route, kernel=fn.__name__, cubin=path, shared=k.metadata.shared,
                        num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages,
                        ptx_mma=sum(l.strip().startswith(("mma", "wgmma")) for l in k.asm["ptx"].splitlines())))
print(json.dumps(out))
"""


def triton_bin(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*([^;]*)")


def sass_counts(cubin: str) -> dict:
    """Instruction counts from the cubin's SASS (cuobjdump -sass), in all and inside loops (the ranges a backward
    branch closes): the main loop is the first, the history tiles' loop in both routes."""
    sass = subprocess.run([str(triton_bin("cuobjdump")), "-sass", cubin], capture_output=True, text=True, check=True)
    ins = [(int(m.group(1), 16), m.group(2), m.group(3), m.group(4)) for m in SASS_LINE.finditer(sass.stdout)]
    loops = []
    for addr, op, _, arg in ins:
        target = re.search(r"0x([0-9a-f]+)", arg) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))

    def count(rows):
        ops = Counter(op for _, op, _, _ in rows)
        return dict(
            instructions=len(rows),
            mma=ops["HMMA"] + ops["HGMMA"],
            i2f=sum(n for op, n in ops.items() if op.startswith("I2F")),
            f2f=sum(n for op, n in ops.items() if op.startswith(("F2F", "F2FP"))),
            ldg=ops["LDG"] + ops["LDGSTS"],
            ldg128=sum(op in ("LDG", "LDGSTS") and ".128" in mods for _, op, mods, _ in rows),
            local=ops["LDL"] + ops["STL"],
            barriers=ops["BAR"],
        )

    in_loops = [r for r in ins if any(lo <= r[0] <= hi for lo, hi in loops)]
    main = [r for r in ins if loops and loops[0][0] <= r[0] <= loops[0][1]]
    return dict(count(ins), loops=len(loops), loop_i2f=count(in_loops)["i2f"], main_loop=count(main))


def ptxas_usage(ptx: str) -> dict:
    """Registers and spill bytes from ptxas -v on the kernel's PTX (Triton targets sm_90a, with the newer of its two
    ptxas binaries: the one it builds the cubin with)."""
    r = subprocess.run([str(triton_bin("ptxas-blackwell")), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                       capture_output=True, text=True, check=True)  # fmt: skip
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=sum(spills))


def report(configs=CONFIGS, routes=("tensor_cores", "general")) -> list[dict]:
    """Compile every configuration's launch on each route and read its machine code: one row per (config, route)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(configs), tmp, json.dumps(list(routes))], env=env,
                           capture_output=True, text=True, timeout=1200)  # fmt: skip
        if r.returncode:
            raise RuntimeError(r.stdout[-3000:] + r.stderr[-6000:])
        rows = json.loads(r.stdout.strip().splitlines()[-1])
        for row in rows:
            row.update(sass_counts(row["cubin"]), **ptxas_usage(row["cubin"][:-6] + ".ptx"))
            del row["cubin"]
    return rows


def markdown(rows: list[dict]) -> str:
    import triton

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvq_lab/kernels"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    head = (
        f"Compiled for sm_90a (Hopper) by triton {triton.__version__} from commit {commit.strip() or 'unknown'}"
        f"{' (kernels edited since)' if dirty else ''}, read with the wheel's ptxas and cuobjdump "
        "(`python scripts/kernel_report.py`). Per kernel: registers per thread, spilled bytes, shared memory, SASS "
        "instructions, tensor-core MMAs (HMMA), int-to-float conversions (I2F: all / inside loops), float "
        "conversions (F2F, F2FP), global loads (LDG and async LDGSTS; those 128 bits wide); main loop: the history "
        "tile loop's instructions, MMAs and barriers per iteration.\n\n"
        "| configuration | route | regs | spill B | smem B | instr | MMA | I2F all / loops | F2F | loads (128-bit) "
        "| main loop instr / MMA / BAR |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['config']} | {r['route']} | {r['registers']} | {r['spill_bytes']} | {r['shared']} | {r['instructions']} "
        f"| {r['mma']} | {r['i2f']} / {r['loop_i2f']} | {r['f2f']} | {r['ldg']} ({r['ldg128']}) "
        f"| {r['main_loop']['instructions']} / {r['main_loop']['mma']} / {r['main_loop']['barriers']} |\n"
        for r in rows
    )
    return head + body


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the markdown table here (default: stdout)")
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not triton_bin("ptxas-blackwell").exists():
        raise SystemExit(f"kernel_report: no ptxas in this triton install ({triton_bin('ptxas-blackwell')})")
    rows = report()
    text = markdown(rows)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
