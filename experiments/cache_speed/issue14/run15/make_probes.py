"""Write run 15's probe kernels: `kvq_lab/kernels/cpu_kernel.c` with one part of rope=pre's work taken out each, to
tell what rope=pre's extra kernel time is made of (`run8/kernel_alone.py`, paired rope=pre / rope=post). Each probe
is wrong on purpose under rope=pre (keys left unrotated); rope=post is untouched.

    python experiments/cache_speed/issue14/run15/make_probes.py /tmp/probes
    python experiments/cache_speed/issue14/run8/kernel_alone.py --length 8192 --calls 150 \\
        kvq_lab/kernels/cpu_kernel.c /tmp/probes/{norot,deq_run,no_history_rope,no_rope}.c

norot            deq_rope_run without the rotation's arithmetic (dequantized rows stored as they are)
deq_run          the rope path's bookkeeping (segments, ids, bases per row) kept, rows dequantized by rope=post's loop
no_history_rope  history rows dequantized as under rope=post, every row's base -1: attend_chunk's per-row runs kept
no_rope          attend_chunk without rope=pre's runs too: rope=post's work on rope=pre's arguments
"""

from __future__ import annotations

import sys
from pathlib import Path

KERNEL = Path(__file__).resolve().parents[4] / "kvq_lab" / "kernels" / "cpu_kernel.c"

ROTATION = "        out[i] = a * c[i] - b * sn[i];\n        out[i + h] = b * c[i] + a * sn[i];"
FUSED_CALL = (
    "                deq_rope_run(out + i * D, row, shift, mask, sbuf, zbuf, (const float *)ra->rcos + id * (D / 2),\n"
    "                             (const float *)ra->rsin + id * (D / 2), D);"
)
HISTORY_CALL = (
    "            bad += history_rows(st, mf, based ? a : 0, pos ? pos + p : 0, based ? based + i : 0, b, h, t, n, D, "
    "slot);"
)
ROPE_FLAG = "    const int rope = a->rcos != 0;"

PROBES = {
    "norot": [(ROTATION, "        out[i] = a;\n        out[i + h] = b;")],
    "deq_run": [
        (FUSED_CALL, "                (void)id;\n"
                     "                deq_run(out + i * D, row, plane, nb, shift, mask, sbuf, zbuf, 1, D);"),
    ],
    "no_history_rope": [
        (HISTORY_CALL, "            bad += history_rows(st, mf, 0, 0, 0, b, h, t, n, D, slot);\n"
                       "            if (based) for (int64_t k = 0; k < n; k++) based[i + k] = -1;"),
    ],
}  # fmt: skip
PROBES["no_rope"] = PROBES["no_history_rope"] + [(ROPE_FLAG, "    const int rope = 0;")]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    src = KERNEL.read_text()
    for name, edits in PROBES.items():
        text = f"/* PROBE (issue 14, run 15: {name}), not the shipped kernel */\n" + src
        for old, new in edits:
            if text.count(old) != 1:
                raise SystemExit(f"{name}: the kernel no longer has the text this probe edits: {old.strip()[:60]!r}")
            text = text.replace(old, new)
        (out / f"{name}.c").write_text(text)
        print(out / f"{name}.c")


if __name__ == "__main__":
    main()
