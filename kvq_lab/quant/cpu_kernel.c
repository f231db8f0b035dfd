/* Decode-step K/V assembly from the packed cache, for the CPU (`backend=cpu`, built by cpu_kernel.py).

One call per layer and decode step writes this step's fp32 K and V ([B, H, N, D] each, in reused workspaces)
from sinks | packed history | fp window, in one pass over each: every history row is unpacked and dequantized
straight from the packed bytes (no unpacked-code buffer, no per-op passes), parameters converted from fp16 once
per row (per-token groups) or once per group of rows (per-channel groups). Attention then runs in PyTorch's SDPA.
The values written are bit for bit those of the PyTorch path (`kvq_lab.cache.packed._assemble`): the
dequantization `code * scale + zero` keeps the reference's two roundings (build with -ffp-contract=off).

Storage layout: see kvq_lab/quant/pack.py. Codes are packed along tokens in blocks of 32; a block is u planes
of m = 32/u tokens, and word (r, d) of a block holds the codes of tokens r, r + m, ... in `bits`-bit fields,
least significant first, as nb little-endian bytes in nb byte planes of m rows:
    byte j of word (blk, r, d) = codes[blk * nb * m + j * m + r][d]
Parameters are fp16: per-token groups [T, D/G], per-channel groups [T/G, D].
*/
#include <stdint.h>
#include <string.h>

#define KVQ_BLOCK 32
#define KVQ_MAX_D 1024

/* One tensor (keys or values) of one layer. Every field is int64 so the Python side fills a flat array;
   pointers are addresses. Strides are in elements of the pointed-to type; the last dim has stride 1. */
typedef struct {
    int64_t out;                    /* fp32 [B, H, N, D], contiguous: what this call writes */
    int64_t codes, scale, zero;     /* uint8 packed codes, fp16 (uint16 bits) scale and zero point */
    int64_t cb, ch, cr;             /* codes strides: batch, head, byte row */
    int64_t pb, ph, pt;             /* scale/zero strides: batch, head, row */
    int64_t n;                      /* quantized history tokens (positions s .. s + n - 1) */
    int64_t bits, nb, m, group, token_axis;
    int64_t win, wb, wh, wt, W, w;  /* fp32 window buffer [B, H, W, D]; its last w rows are positions N - w .. N - 1 */
    int64_t sink, sb, sh, st;       /* fp32 sinks [B, H, >= s, D] */
} Stream;

typedef struct {
    int64_t B, H, D, N, s;          /* s: sink positions present */
    Stream k, v;
} Args;

int64_t kvq_args_size(void) { return (int64_t)sizeof(Args); }

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    float f;
    if (e == 0) {  /* zero or subnormal: man * 2^-24, exact */
        f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    bits = e == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((e + 112u) << 23) | (man << 13));
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* out[d] = code(row, plane) * s[d] + z[d], d < D (one byte plane: bits 1, 2, 4, 8) */
static inline void deq_row_1(float *restrict out, const uint8_t *restrict row, unsigned shift, unsigned mask,
                             const float *restrict s, const float *restrict z, int64_t D) {
    for (int64_t d = 0; d < D; d++) out[d] = (float)((row[d] >> shift) & mask) * s[d] + z[d];
}

/* the same for words of nb > 1 bytes (3-bit: 8 codes in 3 bytes); byte j of the word is `plane` rows below */
static inline void deq_row_n(float *restrict out, const uint8_t *restrict row, int64_t plane, int64_t nb,
                             unsigned shift, unsigned mask, const float *restrict s, const float *restrict z,
                             int64_t D) {
    for (int64_t d = 0; d < D; d++) {
        uint32_t word = 0;
        for (int64_t j = 0; j < nb; j++) word |= (uint32_t)row[j * plane + d] << (8 * j);
        out[d] = (float)((word >> shift) & mask) * s[d] + z[d];
    }
}

/* Rows (sinks, history, window) of (b, h) = divmod(bh, H) of one stream. */
static void assemble_one(const Args *a, const Stream *st, int64_t bh) {
    const int64_t D = a->D, N = a->N, S = a->s, n = st->n, G = st->group, m = st->m, nb = st->nb;
    const unsigned mask = (1u << st->bits) - 1u;
    float sbuf[KVQ_MAX_D], zbuf[KVQ_MAX_D];
    {
        const int64_t b = bh / a->H, h = bh % a->H;
        {
            float *out = (float *)st->out + (b * a->H + h) * N * D;
            const float *sink = (const float *)st->sink + b * st->sb + h * st->sh;
            for (int64_t p = 0; p < S; p++) memcpy(out + p * D, sink + p * st->st, D * sizeof(float));
            const uint8_t *codes = (const uint8_t *)st->codes + b * st->cb + h * st->ch;
            const uint16_t *sc = (const uint16_t *)st->scale + b * st->pb + h * st->ph;
            const uint16_t *zp = (const uint16_t *)st->zero + b * st->pb + h * st->ph;
            int64_t group = -1;
            for (int64_t t = 0; t < n; t++) {
                if (st->token_axis) {  /* parameters of this row: D/G groups of G channels */
                    for (int64_t g = 0; g < D / G; g++) {
                        const float s = half_to_float(sc[t * st->pt + g]), z = half_to_float(zp[t * st->pt + g]);
                        for (int64_t d = g * G; d < (g + 1) * G; d++) {
                            sbuf[d] = s;
                            zbuf[d] = z;
                        }
                    }
                } else if (t / G != group) {  /* a new group of G rows: its D parameters */
                    group = t / G;
                    for (int64_t d = 0; d < D; d++) {
                        sbuf[d] = half_to_float(sc[group * st->pt + d]);
                        zbuf[d] = half_to_float(zp[group * st->pt + d]);
                    }
                }
                const int64_t tt = t % KVQ_BLOCK, plane = tt / m;
                const uint8_t *row = codes + ((t / KVQ_BLOCK) * nb * m + tt % m) * st->cr;
                const unsigned shift = (unsigned)(st->bits * plane);
                if (nb == 1)
                    deq_row_1(out + (S + t) * D, row, shift, mask, sbuf, zbuf, D);
                else
                    deq_row_n(out + (S + t) * D, row, m * st->cr, nb, shift, mask, sbuf, zbuf, D);
            }
            const float *win = (const float *)st->win + b * st->wb + h * st->wh + (st->W - st->w) * st->wt;
            for (int64_t p = 0; p < st->w; p++) memcpy(out + (N - st->w + p) * D, win + p * st->wt, D * sizeof(float));
        }
    }
}

/* The 2 * B * H (stream, batch row, head) tasks, keys first, over `threads` OpenMP threads. Built with -fopenmp
   and loaded after PyTorch, the library binds to the libgomp PyTorch already loaded (same soname), so these
   threads are PyTorch's own intra-op pool: a second pool would compete with PyTorch's spinning workers. */
void kvq_assemble(const Args *a, int64_t threads) {
    const int64_t bh = a->B * a->H, tasks = 2 * bh;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < tasks; i++) assemble_one(a, i < bh ? &a->k : &a->v, i % bh);
}
