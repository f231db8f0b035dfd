"""Write the run-11 probe kernel: the shipped `kvq_lab/kernels/cpu_kernel.c` with rope=pre's cos/sin per history row
advanced from the previous row's by angle addition (cos/sin of one step: the table's row 1) along runs of consecutive
position ids, reloaded from the table every KVQ_RESYNC rows and where ids jump: the table's bytes read shrink ~16
times, at a few fp32 roundings of error per step. Not the shipped kernel: a probe for `run6/inmodel_ab.py` and
`run8/kernel_alone.py`, written from the kernel as it is (run 11 ran the probe this writes at commit 4caf095, where
it was committed as probe_rope_recurrence.c).

    python experiments/cache_speed/issue14/run11/make_probe.py /tmp/probe_rope_recurrence.c
"""

from __future__ import annotations

import sys
from pathlib import Path

KERNEL = Path(__file__).resolve().parents[4] / "kvq_lab" / "kernels" / "cpu_kernel.c"

HEADER = """/* PROBE (issue 14, run 11), not the shipped kernel: experiments/cache_speed/issue14/run11/make_probe.py */
#ifndef KVQ_RESYNC
#define KVQ_RESYNC 16
#endif
"""
DECL = "    float sbuf[KVQ_MAX_D], zbuf[KVQ_MAX_D], krow[KVQ_MAX_D];\n"
STATE = """    float rc[KVQ_MAX_D / 2], rs[KVQ_MAX_D / 2]; /* PROBE: the rotation's cos/sin of the latest row */
    int64_t prev = -2, since = 0;
"""
FUSED = """                const int64_t id = ids[i];
                deq_rope_run(out + i * D, row, shift, mask, sbuf, zbuf, (const float *)ra->rcos + id * (D / 2),
                             (const float *)ra->rsin + id * (D / 2), D);"""
ADVANCED = """                const int64_t id = ids[i], h = D / 2;
                if (id == prev + 1 && since < KVQ_RESYNC && ra->P > 1) {
                    const float *c1 = (const float *)ra->rcos + h, *s1 = (const float *)ra->rsin + h;
                    for (int64_t j = 0; j < h; j++) {
                        const float c = rc[j], s = rs[j];
                        rc[j] = c * c1[j] - s * s1[j];
                        rs[j] = s * c1[j] + c * s1[j];
                    }
                    since++;
                } else {
                    memcpy(rc, (const float *)ra->rcos + id * h, (size_t)h * sizeof *rc);
                    memcpy(rs, (const float *)ra->rsin + id * h, (size_t)h * sizeof *rs);
                    since = 0;
                }
                prev = id;
                deq_rope_run(out + i * D, row, shift, mask, sbuf, zbuf, rc, rs, D);"""


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_probe.py OUT.c")
    src = KERNEL.read_text()
    if DECL not in src or FUSED not in src:
        raise SystemExit(f"{KERNEL} no longer has the lines this probe edits: update make_probe.py")
    Path(sys.argv[1]).write_text(HEADER + src.replace(DECL, DECL + STATE).replace(FUSED, ADVANCED))


if __name__ == "__main__":
    main()
