"""llama.cpp's side of the parity study: `llama-perplexity --kl-divergence` on the embedded GGUF and the CoQA stories,
for every KV cache type, with llama.cpp's Hadamard rotation on and off (LLAMA_ATTN_ROT_DISABLE=1).

    python scripts/llama_cpp.py build                     # once
    python experiments/llama_cpp_parity/llama_cpp_runs.py [--n-ctx 512 2048] [--threads 1]
    python experiments/llama_cpp_parity/llama_cpp_runs.py --n-ctx 512 --types q4_0/f16 f16/q4_0 --rotation off \
        --out checks                                      # one-sided caches, for the differences' causes
    python experiments/llama_cpp_parity/llama_cpp_runs.py --n-ctx 512 --base-ubatch 8 --out vector_base
                                                          # against an f16 base on the quantized caches' kernel

Writes <out>/<n_ctx>_<ctk>_<ctv>_<rot|norot>.log here (kept: they are the records of this side; a run whose log
already holds its final statistics is not run again) and <out>/results.json (one row per log: the statistics it
reports). The 16-bit base logits
(`--kl-divergence-base`, hundreds of MB) go to a scratch folder, not here. The text is exactly what kvq_lab's
`task.source=coqa_stories` reads (written to the scratch folder first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvq_lab.report.studies.llama_cpp_parity import parse  # the logs' statistics, as the table reads them

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TYPES = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_1", "q4_1"), ("q5_0", "q5_0"), ("q5_1", "q5_1"),
         ("iq4_nl", "iq4_nl"), ("q8_0", "q4_0")]  # fmt: skip


def text_file(scratch: Path) -> Path:
    """The CoQA stories as kvq_lab's task.source=coqa_stories reads them."""
    from kvq_lab.tasks.text import coqa_text

    out = scratch / "coqa_stories.txt"
    out.write_text(coqa_text(Path(os.environ.get("KVQ_DATA_DIR", REPO.parent / "shared" / "data"))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-ctx", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", nargs="+", default=[f"{k}/{v}" for k, v in TYPES], help="K/V cache type pairs")
    ap.add_argument("--rotation", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--out", default="llama_cpp", help="folder under experiments/llama_cpp_parity for the logs")
    ap.add_argument("--base-ubatch", type=int, default=None,
                    help="ubatch of the f16 base run (8: llama.cpp's vector flash-attention kernel, the one every "
                         "quantized cache runs, instead of its tiled one)")  # fmt: skip
    args = ap.parse_args()
    binary = subprocess.run([sys.executable, str(REPO / "scripts" / "llama_cpp.py"), "path"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    if not binary:
        print("error: llama-perplexity is not built; run: python scripts/llama_cpp.py build", file=sys.stderr)
        return 2
    from kvq_lab.models.loading import embedded_gguf

    gguf = str(embedded_gguf("smollm2-135m"))
    out_dir = HERE / args.out
    out_dir.mkdir(exist_ok=True)
    pairs = [tuple(t.split("/")) for t in args.types]

    def todo(n_ctx: int) -> list[tuple[str, str, bool, Path]]:
        runs = []
        for ctk, ctv in pairs:
            for rot in [r == "on" for r in args.rotation]:
                if (ctk, ctv) == ("f16", "f16") and not rot:
                    continue  # llama.cpp rotates only quantized caches: f16 is one run
                log = out_dir / f"{n_ctx}_{ctk}_{ctv}_{'rot' if rot else 'norot'}.log"
                if not (log.is_file() and "kl_mean" in parse(log.read_text())):
                    runs.append((ctk, ctv, rot, log))
        return runs

    version = subprocess.run([binary, "--version"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="kvq_parity_") as tmp:
        scratch = Path(tmp)
        text = text_file(scratch)
        for n_ctx in args.n_ctx:
            runs = todo(n_ctx)
            if not runs:
                continue
            base = scratch / f"base{n_ctx}.kld"
            common = [binary, "-m", gguf, "-c", str(n_ctx), "-b", str(n_ctx), "-fa", "on", "-t", str(args.threads)]
            t0 = time.time()
            ub = ["-ub", str(args.base_ubatch)] if args.base_ubatch else []
            subprocess.run([*common, *ub, "-f", str(text), "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base",
                            str(base)], check=True, capture_output=True)  # fmt: skip
            print(f"n_ctx {n_ctx}: base logits in {time.time() - t0:.0f} s", flush=True)
            for ctk, ctv, rot, log in runs:
                env = {**os.environ} if rot else {**os.environ, "LLAMA_ATTN_ROT_DISABLE": "1"}
                cmd = [*common, "-ctk", ctk, "-ctv", ctv, "--kl-divergence-base", str(base), "--kl-divergence"]
                t0 = time.time()
                p = subprocess.run(cmd, env=env, capture_output=True, text=True)
                log.write_text(p.stdout + p.stderr)
                row = parse(p.stdout + p.stderr)
                print(f"{log.stem}: {row.get('ln_ppl_ratio')} KLD {row.get('kl_mean')} ({time.time() - t0:.0f} s)",
                      flush=True)  # fmt: skip
    rows = []
    for log in sorted(out_dir.glob("*.log")):
        n_ctx, rest = log.stem.split("_", 1)
        rot = rest.endswith("_rot")
        kv = rest.rsplit("_", 1)[0]
        rows.append({"log": log.name, "n_ctx": int(n_ctx), "cache": kv, "rotation": rot, **parse(log.read_text())})
    meta = {"binary_version": (version.stdout + version.stderr).strip().splitlines()[-1:], "gguf": Path(gguf).name,
            "threads": args.threads, "flash_attention": "on", "rows": rows}  # fmt: skip
    (out_dir / "results.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
