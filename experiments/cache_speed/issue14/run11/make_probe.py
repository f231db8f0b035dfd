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


# --chunk: the recurrence once per (chunk, batch row) for all kv heads. Each OpenMP thread keeps the cos/sin of its
# latest chunk's positions (tasks are chunk-major: a thread's consecutive tasks are the heads of one chunk) in a buffer
# indexed by position, which the chunk's key rows then read in place of the table (through a local Args whose "ids"
# are the positions' offsets in the buffer).
CHUNK_STATE = """/* PROBE --chunk: per thread, the latest chunk's cos/sin by position; key: table, ids, row, span */
static __thread float kvq_tc[KVQ_MAX_CHUNK * KVQ_MAX_D / 2], kvq_ts[KVQ_MAX_CHUNK * KVQ_MAX_D / 2];
static __thread int32_t kvq_off[KVQ_MAX_CHUNK];
static __thread int64_t kvq_key[5] = {-1, -1, -1, -1, -1};

/* 1 when the buffer holds (or now holds) the cos/sin of positions [q0, p1) of row b, 0 where an id is outside the
   table (the caller then reads the table itself) */
static int chunk_trig(const Args *a, int64_t b, int64_t q0, int64_t p1) {
    const int64_t key[5] = {a->rcos, a->pos, b, q0, p1};
    if (!memcmp(key, kvq_key, sizeof key)) return 1;
    const int64_t h = a->D / 2;
    const int32_t *pos = (const int32_t *)a->pos + b * a->pb;
    const float *c1 = (const float *)a->rcos + h, *s1 = (const float *)a->rsin + h;
    int64_t prev = -2, since = 0;
    for (int64_t p = q0; p < p1; p++) {
        const int64_t id = pos[p], j = p - q0;
        if (id < 0 || id >= a->P) {
            kvq_key[0] = -1;
            return 0;
        }
        float *rc = kvq_tc + j * h, *rs = kvq_ts + j * h;
        if (id == prev + 1 && since < KVQ_RESYNC && a->P > 1) {
            const float *pc = rc - h, *ps = rs - h;
            for (int64_t i = 0; i < h; i++) {
                rc[i] = pc[i] * c1[i] - ps[i] * s1[i];
                rs[i] = ps[i] * c1[i] + pc[i] * s1[i];
            }
            since++;
        } else {
            memcpy(rc, (const float *)a->rcos + id * h, (size_t)h * sizeof *rc);
            memcpy(rs, (const float *)a->rsin + id * h, (size_t)h * sizeof *rs);
            since = 0;
        }
        kvq_off[j] = (int32_t)j;
        prev = id;
    }
    memcpy(kvq_key, key, sizeof key);
    return 1;
}

"""
ATTEND = "static int64_t attend_chunk(const Args *a, const int mf[2], int64_t b, int64_t h, int64_t p0, int64_t p1,"
KEYS = "        bad += fill_rows(a, &a->k, mf[0], b, h, pa, pb, pad, buf, a->rcos != 0, rows);"
KEYS_CHUNK = "        bad += fill_rows(ka, &a->k, mf[0], b, h, pa, pb, pad, buf, a->rcos != 0, rows);"
LOOP = (
    "    for (int64_t pa = q0; pa < p1; pa += sub) {\n"
    "        const int64_t pb = pa + sub < p1 ? pa + sub : p1;\n" + KEYS
)
LOOP_CHUNK = (
    "    Args la;\n"
    "    const Args *ka = a;\n"
    "    if (a->rcos && q0 < p1 && chunk_trig(a, b, q0, p1)) {\n"
    "        la = *a;\n"
    "        la.rcos = (int64_t)kvq_tc, la.rsin = (int64_t)kvq_ts, la.pos = (int64_t)(kvq_off - q0), la.pb = 0;\n"
    "        la.P = INT64_MAX;\n"
    "        ka = &la;\n"
    "    }\n" + LOOP.replace(KEYS, KEYS_CHUNK)
)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--chunk"]
    if len(args) != 1:
        raise SystemExit("usage: make_probe.py [--chunk] OUT.c")
    src = KERNEL.read_text()
    if "--chunk" in sys.argv:
        if ATTEND not in src or LOOP not in src:
            raise SystemExit(f"{KERNEL} no longer has the lines this probe edits: update make_probe.py")
        out = HEADER + src.replace(ATTEND, CHUNK_STATE + ATTEND, 1).replace(LOOP, LOOP_CHUNK, 1)
    else:
        if DECL not in src or FUSED not in src:
            raise SystemExit(f"{KERNEL} no longer has the lines this probe edits: update make_probe.py")
        out = HEADER + src.replace(DECL, DECL + STATE).replace(FUSED, ADVANCED)
    Path(args[0]).write_text(out)


if __name__ == "__main__":
    main()
