"""Each llama.cpp setting a frontier report recommends, run through llama.cpp on the model's GGUF and set beside
kvq_lab's number for the same cache, with the parity study's criterion (experiments/llama_cpp_parity).

    python scripts/llama_cpp.py build                                        # once
    python experiments/frontier/llama_cpp_check.py --model smollm2-135m      # after the model's frontier search
    python -m kvq_lab.report frontier                                        # check.md again from what this wrote

The settings are the report's "Best per engine" rows for llama.cpp (per budget, the ranked candidate of least KL that
llama.cpp runs). llama.cpp's perplexity tool cannot run the search's rank protocol (a context prefilled exactly, then
decoded tokens scored), so both sides run llama-perplexity's: the CoQA stories cut into chunks of `--n-ctx` tokens,
each one forward pass whose attention reads the quantized cache, the second half scored, KLD against each side's own
16-bit run (kvq_lab: `experiment=llama_cpp_parity`, task.protocol=chunks). Beside each setting, the q8_0 cache with
the same rotation: llama.cpp's q8_0 KLD less kvq_lab's is its kernel floor (the parity study's finding 2), which
kvq_lab + floor must match.

Writes llama_cpp_check/<model>/ here: llama.cpp's logs (`<n_ctx>_<ctk>_<ctv>_<rot|norot>.log`, kept: a log holding its
final statistics is not run again) and kvq_lab's records (runs/, resumed by run key); the table (check.md) is the
frontier study's (kvq_lab/report/studies/frontier.py, `llama_cpp_check`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (as scripts/cli_args.py)
        fail(f"{message} (see --help)")


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the model whose frontier report names the settings")
    ap.add_argument("--gguf", default=None, help="the model's GGUF (default: the embedded model's)")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="threads of both sides (the parity study's: 1)")
    args = ap.parse_args()
    if args.n_ctx < 16:
        fail(f"--n-ctx {args.n_ctx}: give at least 16 tokens a chunk (the parity study used 512 and 2048)")
    if args.threads < 1:
        fail(f"--threads {args.threads}: give 1 or more")

    from kvq_lab.models.loading import EMBEDDED, embedded_gguf
    from kvq_lab.report.engines import cli_value
    from kvq_lab.report.studies import frontier

    gguf = args.gguf or (str(embedded_gguf(args.model) or "") if args.model in EMBEDDED else "")
    if not gguf or not Path(gguf).is_file():
        fail(f"--model {args.model}: no GGUF (give --gguf <file>; embedded models: {', '.join(EMBEDDED)})")
    recs = frontier.records(HERE)
    if args.model not in recs:
        fail(f"--model {args.model}: no frontier search here ({', '.join(recs) or 'none'}); run it first")
    plan, stages, _ = recs[args.model]
    todo = frontier.llama_cpp_settings(plan, stages)
    if not todo:
        print(f"{args.model}: the report recommends no llama.cpp setting; nothing to check")
        return 0
    binary = subprocess.run([sys.executable, str(REPO / "scripts" / "llama_cpp.py"), "path"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    if not binary:
        fail("llama-perplexity is not built; run: python scripts/llama_cpp.py build")

    out = HERE / "llama_cpp_check" / args.model
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    data = os.environ.get("KVQ_DATA_DIR", "../shared/data")  # relative to the repository, as the study commands
    for s in todo:  # kvq_lab's side: ordinary records, resumed by run key
        knobs = [f"{k}={cli_value(v)}" for k, v in s.overrides.items()]
        cmd = [sys.executable, "run.py", "experiment=llama_cpp_parity", f"model={args.model}", *knobs,
               f"task.n_ctx={args.n_ctx}", f"results_dir={out.relative_to(REPO)}", f"data_dir={data}", "logger=none",
               "experiment_name=frontier-llama_cpp_check", f"run_name={s.candidate}"]  # fmt: skip
        print(f"kvq_lab: {s.candidate} ({s.flags})", flush=True)
        subprocess.run(cmd, cwd=REPO, env=env, check=True)

    from kvq_lab.report.studies.llama_cpp_parity import parse

    runs = [s for s in todo if not _done(out / s.log(args.n_ctx), parse)]
    if runs:
        with tempfile.TemporaryDirectory(prefix="kvq_frontier_llama_") as tmp:
            from kvq_lab.tasks.text import coqa_text

            text = Path(tmp) / "coqa_stories.txt"
            text.write_text(coqa_text(REPO / data))  # task.source=coqa_stories; an absolute KVQ_DATA_DIR stays itself
            base = Path(tmp) / "base.kld"
            common = [binary, "-m", gguf, "-c", str(args.n_ctx), "-b", str(args.n_ctx), "-fa", "on", "-t",
                      str(args.threads), "-f", str(text)]  # fmt: skip
            t0 = time.time()
            subprocess.run([*common, "-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(base)], check=True,
                           capture_output=True)  # fmt: skip
            print(f"llama.cpp: 16-bit base logits in {time.time() - t0:.0f} s", flush=True)
            for s in runs:
                run_env = {**os.environ} if s.rotation else {**os.environ, "LLAMA_ATTN_ROT_DISABLE": "1"}
                cmd = [*common, "-ctk", s.ctk, "-ctv", s.ctv, "--kl-divergence-base", str(base), "--kl-divergence"]
                t0 = time.time()
                p = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
                (out / s.log(args.n_ctx)).write_text(p.stdout + p.stderr)
                row = parse(p.stdout + p.stderr)
                print(f"llama.cpp: {s.flags}: KLD {row.get('kl_mean')} ({time.time() - t0:.0f} s)", flush=True)
    recs = frontier.records(HERE)
    table = frontier.llama_cpp_check(*recs[args.model])
    (out / "check.md").write_text(table)
    print(table)
    return 0


def _done(log: Path, parse) -> bool:
    return log.is_file() and "kl_mean" in parse(log.read_text())


if __name__ == "__main__":
    raise SystemExit(main())
