/* Fused decode attention over the packed cache, for the CPU (`backend=cpu`, built by cpu_kernel.py).

One call per layer and decode step: for every (batch row, kv head, chunk of positions) task, the scores of the
kv head's query heads over sinks | packed history | fp window, a softmax partial (max, sum) and the weighted sum
of the values; then the chunks are combined (flash-decoding). A task reads its positions in sub-blocks of 32 KB of
rows (`fill_rows`): runs of history rows are unpacked and dequantized straight from the packed bytes (`history_rows`:
indices advanced row by row, no integer division per row; parameters converted from fp16 once per row for per-token
groups, once per group of rows for per-channel groups), exact fp32 rows are read in place; then the dot products,
four rows per query head in one loop (`dot4`: eight independent add chains, the folds done four at a time with
vector shuffles; `dot` for the rows left over), the sums of exps of the query heads interleaved (`sums_of`), and for
values the weighted sum with 64 outputs held in registers across the sub-block (`weighted_sum`). Nothing of the
cache's size is ever written, so the step's memory traffic is the packed bytes, not a dequantized copy of K and V.
Sums keep their order (each output element adds its rows in position order, each score its 16 partial sums in a
fixed fold, each sum of exps its positions in order), so a restructuring of the loops changes no bit of the output
(checked against the previous version on SmolLM2's cache, the cache speed notes at 8e8c818). The dequantized
values are bit for bit those of the PyTorch path (`kvq_lab.kernels.torch_path._assemble`: `table[code] * scale +
zero` with two roundings, so the build uses -ffp-contract=off); scores, softmax and sums differ from SDPA's only in
fp32 rounding order.

Code formats (kvq_lab/quant/formats): every format dequantizes as `table[code] * scale + zero`, with an fp32 table of
2^bits entries and no zero point for some formats (fp8: `table[code] * scale`). A stream without a table is `int`,
whose codes are their own values: `code * scale + zero`, the loop this kernel had before formats (`deq_run`), kept
as it was so the int path stays as fast; formats with a table go through `deq_run_table`. A lookup does not
vectorise as such: with AVX-512 (AVX2 and F16C), tables of <= 16 entries (2-4 bit lut / nuq) are looked up 16 (8)
codes at a time by one lane permute of the table held in registers (two and a blend for 16 entries under AVX2), and
a 256-entry table that is bit for bit the fp8 e4m3fn or e5m2 decoding (the fp8 formats' tables; checked once per
call against every decoder used, `minifloat_of`) is computed from the codes' bits instead of read (`minifloat8` /
`minifloat16`: the bits moved into an fp16's fields and converted by F16C; a gather or 8 scalar loads is slower on
x86 cores such as AMD Zen 3, and decoding into fp32 with integer ops took twice the instructions); other tables keep
the scalar lookup. Every path gives exactly table[code] and the same two roundings.

Storage layout: see kvq_lab/quant/pack.py. Codes are packed along tokens in blocks of 32; a block is u planes
of m = 32/u tokens, and word (r, d) of a block holds the codes of tokens r, r + m, ... in `bits`-bit fields,
least significant first, as nb little-endian bytes in nb byte planes of m rows (nb = 1 at 1, 2, 4 and 8 bits; 3 at
3 bits, 5 at 5 bits: 8 codes in 40 bits):
    byte j of word (blk, r, d) = codes[blk * nb * m + j * m + r][d]
Parameters are fp16: per-token groups [T, D/G], per-channel groups [T/G, D].

Left-padded batches (kvq_lab/kernels/view.py): row b has pads[b] padding positions first (never read: score -inf,
weight 0), then its own sinks (j = p - pads[b] < s), then its stream positions; a stream's storage position of
absolute position p is p - starts[b], history while below counts[b], else the window row of p. Without padding,
pads = 0, starts = s and counts = n for every row, the layout this kernel had before.

rope=pre (keys quantized before RoPE, KVQuant): history keys are stored pre-RoPE; each history key row is rotated just
before its dot products (`rope_row`; one by one as they are dequantized, from a row on the stack still in L1, not from a
dequantized sub-block), from a shared table of the model's cos/sin at every position id ([P, D/2], the halves of
transformers' duplicated cos/sin), in the reference's order of operations: k*cos + rotate_half(k)*sin, two products and
one sum per element, no fma. A table read, not a sincos per row: the values the PyTorch path rotates with (it reads the
same table), and no transcendental per row (measured in the cache speed notes at 8e8c818). The rotation is split by
segment (KVQ_ROPE_SEG): the history rows of a segment, whose ids are base .. base + SEG - 1, are rotated at their
offsets id - base (the table's first SEG rows, which stay in the L1 / L2 cache) and the query, once per segment and
query head, by -base (`unrotate_query`): q . R(base + o) k = (R(base)^T q) . (R(o) k), since the rotations of one pair
of channels commute. Per position, that reads 256 bytes of table (D = 64) per SEG rows instead of per row: one table
pass per layer was more bytes than the 2-bit keys and values it rotates. SEG = 128 rows, not 32: with 32, the query
rotations (r per segment) and the score runs cut at every segment end cost about a third of rope=pre's extra time
(measured, the cache speed notes at 8e8c818). The factors are the model's own table rows, so the product differs from
the reference's row at base + o only by fp32 rounding of the angles (transformers computes each angle as one fp32
product inv_freq * id: up to half an ulp of it, ~2.4e-4 rad at ids near 8192 for the fastest pairs but the first, whose
inv_freq is 1): as close to exact RoPE as the table is, far below a 2-bit key's error; tested against the PyTorch path
and exact RoPE in fp64. A segment whose ids are not consecutive enough (ids kept as given) or leave the table is rotated
row by row at its ids. Sinks and window keys are exact post-RoPE keys, as the model made them (the cache applies
rope_pre to a window only when it quantizes it), read as they are, with the query unrotated.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVQ_BLOCK 32
#define KVQ_MAX_D 1024
#define KVQ_MAX_CHUNK 256
#define KVQ_SUB_FLOATS 8192 /* dequantized rows per sub-block of a task: 32 KB */
#define KVQ_MAX_R 32
#define KVQ_ROPE_SEG 128      /* rope=pre: history rows per rotation segment (their offset rows: 32 KB at D = 64) */
#define KVQ_QROT_FLOATS 4096  /* rope=pre: the rotated queries of a kv head's r heads (r * D floats) fit this */

/* One tensor (keys or values) of one layer. Every field is int64 so the Python side fills a flat array;
   pointers are addresses. Strides are in elements of the pointed-to type; the last dim has stride 1. */
typedef struct {
    int64_t codes, scale, zero;     /* uint8 packed codes, fp16 (uint16 bits) scale and zero point (0: none) */
    int64_t table;                  /* fp32 [2^bits] value of each code, or 0: the code is its value (int) */
    int64_t cb, ch, cr;             /* codes strides: batch, head, byte row */
    int64_t pb, ph, pt;             /* scale/zero strides: batch, head, row */
    int64_t n;                      /* quantized history tokens (positions s .. s + n - 1) */
    int64_t bits, nb, m, group, token_axis;
    int64_t win, wb, wh, wt, W, w;  /* window buffer [B, H, W, D]; its last w rows are positions N - w .. N - 1 */
    int64_t sink, sb, sh, st;       /* sinks [B, H, >= s, D] */
    int64_t xdt;                    /* window and sinks in the model's dtype: 0 fp32, 1 fp16, 2 bf16 */
    int64_t starts, counts;         /* padded batches: int64 [B] per row storage offset and history tokens, or 0 */
} Stream;

typedef struct {
    int64_t q, qb, qh;              /* fp32 query (the model's dtype converted in Python: one row per head) [B, Hq, (1,) D]: rows at q + b * qb + head * qh, D contiguous */
    int64_t out, ob, oh;            /* fp32 output [B, Hq, D] */
    int64_t mask, mb;               /* fp32 additive mask [B, N], or 0 */
    int64_t partial;                /* fp32 scratch [B * Hkv * chunks, r, D + 2] */
    int64_t B, Hq, Hkv, D, N, s;    /* s: sink positions present */
    int64_t chunk;                  /* positions per task (<= KVQ_MAX_CHUNK) */
    int64_t rcos, rsin, P;          /* rope=pre: fp32 cos/sin tables [P, D/2], or 0 (keys stored as attended) */
    int64_t pos, pb;                /* rope=pre: int32 position ids [B, >= N], row stride pb */
    int64_t pads;                   /* padded batches: int64 [B] padding positions per row, or 0 (none) */
    int64_t qn, on;                 /* hadamard: the query / output in the Walsh-Hadamard basis of blocks of qn / on
                                       channels (kvq_fwht, times n^-1/2), or 0 */
    Stream k, v;
} Args;

int64_t kvq_args_size(void) { return (int64_t)sizeof(Args); }

#if (defined(__F16C__) || defined(__AVX2__)) && !defined(KVQ_PORTABLE)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__F16C__) && !defined(KVQ_PORTABLE)
#define KVQ_AVX2 1 /* table lookups of 8 codes at once (deq_run_table) */
#endif

#if defined(__F16C__) && !defined(KVQ_PORTABLE)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); } /* one instruction (x86 F16C) */
#else
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
#endif

/* out[d] = code(d) * s[d] + z[d] for d < n, codes `shift` bits up in the words of `row` (nb bytes each, byte j
   `plane` bytes below byte 0; a word of several bytes is assembled in a uint64_t: 24 bits for 3-bit codes, 40 for
   5-bit ones, whose top code starts at bit 35); s and z either per channel (ds = 1) or one value for all n channels
   (ds = 0). */
static inline void deq_run(float *restrict out, const uint8_t *restrict row, int64_t plane, int64_t nb,
                           unsigned shift, unsigned mask, const float *restrict s, const float *restrict z,
                           int64_t ds, int64_t n) {
    if (nb == 1 && ds)
        for (int64_t d = 0; d < n; d++) out[d] = (float)((row[d] >> shift) & mask) * s[d] + z[d];
    else if (nb == 1) {
        const float s0 = s[0], z0 = z[0];
        for (int64_t d = 0; d < n; d++) out[d] = (float)((row[d] >> shift) & mask) * s0 + z0;
    } else
        for (int64_t d = 0; d < n; d++) {
            uint64_t word = 0;
            for (int64_t j = 0; j < nb; j++) word |= (uint64_t)row[j * plane + d] << (8 * j);
            out[d] = (float)((word >> shift) & mask) * s[ds * d] + z[ds * d];
        }
}

#if KVQ_AVX2
/* The codes of bytes row[0 .. 8) (`shift` bits up, under `mask`), one per 32-bit lane */
static inline __m256i codes8(const uint8_t *row, unsigned shift, unsigned mask) {
    __m128i bytes;
    memcpy(&bytes, row, 8); /* the upper 8 bytes are never used */
    return _mm256_and_si256(_mm256_srl_epi32(_mm256_cvtepu8_epi32(bytes), _mm_cvtsi32_si128((int)shift)),
                            _mm256_set1_epi32((int)mask));
}

/* table[code] for 8 codes of a table of <= 16 entries, exact: <= 8 entries are one register and a lane permute;
   16, two permutes and a select on the code's bit 3 (t0, t1: entries 0-7, 8-15). */
static inline __m256 lookup8(__m256i code, unsigned mask, __m256 t0, __m256 t1) {
    if (mask < 8) return _mm256_permutevar8x32_ps(t0, code);
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, code), _mm256_permutevar8x32_ps(t1, code),
                            _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}

/* The values of the 8 fp8 codes at row[0 .. 8) with m mantissa bits (3: e4m3fn, 2: e5m2), exactly: each code's sign,
   7 - m exponent bits and m mantissa bits moved into an fp16's fields (mantissa bits 9 .. 10 - m, exponent from bit
   10: a code's subnormals land on fp16 subnormals) and converted by F16C in one instruction; e5m2's exponent bias is
   fp16's (15), e4m3fn's is 7, so its fp16 is 2^-8 of the value and the product by 2^8 (exact) makes it up. The
   non-finite patterns (magnitudes from 0x7f for e4m3fn, 0x7c for e5m2) are +0.0, as in fp8.py's tables. About half
   the instructions of decoding the bits into an fp32 with integer ops (normals and subnormals apart, then a blend). */
static inline __m256 minifloat8(const uint8_t *row, int m) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)row)); /* 8 codes, one per 16-bit lane */
    const __m128i mag = _mm_and_si128(x, _mm_set1_epi16(0x7f));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_srli_epi16(x, 7), 15),  /* sign, then exponent and mantissa */
                                   _mm_sll_epi16(mag, _mm_cvtsi32_si128(10 - m)));
    const __m128i finite = _mm_cmplt_epi16(mag, _mm_set1_epi16(m == 3 ? 0x7f : 0x7c));
    const __m256 v = _mm256_cvtph_ps(_mm_and_si128(h, finite));
    return m == 3 ? _mm256_mul_ps(v, _mm256_set1_ps(256.0f)) : v;
}

#if defined(__AVX512F__)
#define KVQ_AVX512 1 /* 16 channels at once in deq_run_table (one permute for a table of <= 16 entries) */
/* minifloat8 for the 16 codes at row[0 .. 16) */
static inline __m512 minifloat16(const uint8_t *row, int m) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)row));
    const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_srli_epi16(x, 7), 15),
                                      _mm256_sll_epi16(mag, _mm_cvtsi32_si128(10 - m)));
    const __m256i finite = _mm256_cmpgt_epi16(_mm256_set1_epi16(m == 3 ? 0x7f : 0x7c), mag);
    const __m512 v = _mm512_cvtph_ps(_mm256_and_si256(h, finite));
    return m == 3 ? _mm512_mul_ps(v, _mm512_set1_ps(256.0f)) : v;
}

/* table[code] for the 16 codes of bytes row[0 .. 16) (`shift` bits up, under `mask` < 16), t: the table's 16 entries */
static inline __m512 lookup16(const uint8_t *row, unsigned shift, unsigned mask, __m512 t) {
    const __m512i code = _mm512_and_si512(
        _mm512_srl_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)row)), _mm_cvtsi32_si128((int)shift)),
        _mm512_set1_epi32((int)mask));
    return _mm512_permutexvar_ps(code, t);
}
#endif

/* m (3 or 2) where a stream's table is bit for bit minifloat8's (and, in AVX-512 builds, minifloat16's) e4m3fn or
   e5m2 decoding of its 256 codes (the fp8 formats' tables), so that deq_run_table computes its values instead of
   looking them up (a lookup of 8 codes from 256 entries is 8 loads, or a gather, which is no faster on some x86
   cores); else 0. Once per call and stream. */
static int minifloat_of(const Stream *st) {
    const float *table = (const float *)st->table;
    if (!table || st->bits != 8) return 0;
    uint8_t codes[256];
    for (int c = 0; c < 256; c++) codes[c] = (uint8_t)c;
    for (int m = 3; m >= 2; m--) {
        int same = 1;
        for (int c = 0; c < 256 && same; c += 8) {
            const __m256i want = _mm256_loadu_si256((const __m256i *)(table + c));
            same = _mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_castps_si256(minifloat8(codes + c, m)), want)) == -1;
        }
#if KVQ_AVX512
        for (int c = 0; c < 256 && same; c += 16)  /* the 16-wide decoder too */
            same = _mm512_cmpneq_epi32_mask(_mm512_castps_si512(minifloat16(codes + c, m)),
                                            _mm512_loadu_si512((const void *)(table + c))) == 0;
#endif
        if (same) return m;
    }
    return 0;
}
#endif

/* The same for a format with a table: out[d] = table[code(d)] * s[d] (+ z[d] where z is not NULL: formats without
   a zero point store none and add nothing, so -0.0 stays -0.0 as in the reference). `table` has 2^bits entries, and
   at least 16 readable ones (zero-padded) for bits <= 4. AVX-512 builds take 16 channels at a time, then AVX2 builds
   8, where nb == 1 and the table has <= 16 entries (lookup16: one register; lookup8: two) or is an fp8 decoding (mf,
   from minifloat_of: minifloat16 / minifloat8),
   with the same two roundings (a product, then a sum); the scalar loops below are the portable path and take the
   channels left over and every other table. */
static inline void deq_run_table(float *restrict out, const uint8_t *restrict row, int64_t plane, int64_t nb,
                                 unsigned shift, unsigned mask, const float *restrict table, int mf,
                                 const float *restrict s, const float *restrict z, int64_t ds, int64_t n) {
    int64_t d = 0;
#if KVQ_AVX2
    if (nb == 1 && (mask < 16 || mf)) {
#if KVQ_AVX512
        const __m512 t16 = mask < 16 ? _mm512_loadu_ps(table) : _mm512_setzero_ps();
        for (; d + 16 <= n; d += 16) {
            __m512 v = _mm512_mul_ps(mf ? minifloat16(row + d, mf) : lookup16(row + d, shift, mask, t16),
                                     ds ? _mm512_loadu_ps(s + d) : _mm512_set1_ps(s[0]));
            if (z) v = _mm512_add_ps(v, ds ? _mm512_loadu_ps(z + d) : _mm512_set1_ps(z[0]));
            _mm512_storeu_ps(out + d, v);
        }
#endif
        const __m256 t0 = mask < 16 ? _mm256_loadu_ps(table) : _mm256_setzero_ps();
        const __m256 t1 = mask < 16 ? _mm256_loadu_ps(table + 8) : _mm256_setzero_ps();
        for (; d + 8 <= n; d += 8) {  /* mf: 8-bit codes, so shift is 0 */
            __m256 v = _mm256_mul_ps(mf ? minifloat8(row + d, mf) : lookup8(codes8(row + d, shift, mask), mask, t0, t1),
                                     ds ? _mm256_loadu_ps(s + d) : _mm256_set1_ps(s[0]));
            if (z) v = _mm256_add_ps(v, ds ? _mm256_loadu_ps(z + d) : _mm256_set1_ps(z[0]));
            _mm256_storeu_ps(out + d, v);
        }
    }
#else
    (void)mf;
#endif
    if (nb == 1 && ds) {  /* per-channel parameters (z: per channel too) */
        if (z)
            for (; d < n; d++) out[d] = table[(row[d] >> shift) & mask] * s[d] + z[d];
        else
            for (; d < n; d++) out[d] = table[(row[d] >> shift) & mask] * s[d];
    } else if (nb == 1) {  /* one group: one scale (and zero point) for all n */
        const float s0 = s[0];
        if (z) {
            const float z0 = z[0];
            for (; d < n; d++) out[d] = table[(row[d] >> shift) & mask] * s0 + z0;
        } else
            for (; d < n; d++) out[d] = table[(row[d] >> shift) & mask] * s0;
    } else
        for (; d < n; d++) {
            uint64_t word = 0;
            for (int64_t j = 0; j < nb; j++) word |= (uint64_t)row[j * plane + d] << (8 * j);
            const float v = table[(word >> shift) & mask] * s[ds * d];
            out[d] = z ? v + z[ds * d] : v;
        }
}

/* out = k rotated by RoPE at one position: c, s the table rows [D/2] of its position id; rotate_half's pairing
   (i, i + D/2), each output k[i]*c[i] -/+ k[partner]*s[i] with the reference's two roundings and one sum. dir = -1
   rotates back (R^T: the sines negated, exactly); a constant at each call, folded by the compiler. */
static inline void rope_row(const float *restrict k, const float *restrict c, const float *restrict s, float dir,
                            int64_t D, float *restrict out) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        out[i] = k[i] * c[i] - k[i + h] * (dir * s[i]);
        out[i + h] = k[i + h] * c[i] + k[i] * (dir * s[i]);
    }
}

/* deq_run (one byte per word, per-channel parameters) and rope_row in one pass: out = the dequantized row rotated by
   the table rows c, sn of its position id. The same operations in the same order as the two (two roundings each
   for the dequantization, two products and one sum for the rotation: bit for bit), without the row's round trip
   through a buffer. */
static inline void deq_rope_run(float *restrict out, const uint8_t *restrict row, unsigned shift, unsigned mask,
                                const float *restrict s, const float *restrict z, const float *restrict c,
                                const float *restrict sn, int64_t D) {
    const int64_t h = D / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = (float)((row[i] >> shift) & mask) * s[i] + z[i];
        const float b = (float)((row[i + h] >> shift) & mask) * s[i + h] + z[i + h];
        out[i] = a * c[i] - b * sn[i];
        out[i + h] = b * c[i] + a * sn[i];
    }
}

/* out = k rotated at position id `id` of the call's rope table (rope_row); an id outside the table leaves k as it is
   and returns 1 (counted: the call's result is refused), else 0. */
static inline int64_t rope_at(const Args *a, int64_t id, const float *restrict k, int64_t D, float *restrict out) {
    if (id < 0 || id >= a->P) {
        memcpy(out, k, (size_t)D * sizeof *out);
        return 1;
    }
    rope_row(k, (const float *)a->rcos + id * (D / 2), (const float *)a->rsin + id * (D / 2), 1.0f, D, out);
    return 0;
}

/* The base of a rope segment of n rows with position ids ids[0 .. n-1]: ids[0] when every id is in the table and
   in ids[0] .. ids[0] + KVQ_ROPE_SEG - 1 (rows rotated at id - base, the query by -base), else -1 (rows rotated at
   their own ids, the query as it is). */
static inline int64_t segment_base(const Args *a, const int32_t *ids, int64_t n) {
    const int32_t base = ids[0];
    int32_t lo = base, hi = base;
    for (int64_t i = 1; i < n; i++) {  /* no early exit: a loop the compiler vectorises */
        lo = ids[i] < lo ? ids[i] : lo;
        hi = ids[i] > hi ? ids[i] : hi;
    }
    return base >= 0 && lo == base && (int64_t)hi - base < KVQ_ROPE_SEG && hi < a->P ? base : -1;
}

/* Dequantize history rows t0 .. t0 + n - 1 (storage positions) of stream st at (b, h) into out[n][D] (mf: the
   stream's minifloat_of, deq_run_table's); with `ra` (rope=pre keys: the call's Args; 0 otherwise), each row is
   dequantized into a row on the stack and rotated from there into out (rope_at, while the row is in registers or
   L1): by segments of KVQ_ROPE_SEG storage positions, at id - base where the segment has a base (segment_base),
   else at its id; based[i] gets row i's base (-1: none), and the rows outside the rope table are counted
   (returned; else 0). The run's indices advance row by row (block, plane, row within the plane; per-channel
   parameters reloaded as a group starts), so no row pays an integer division. */
static inline __attribute__((always_inline)) int64_t history_rows_dg(const Stream *st, int mf, const Args *ra,
                                                                      const int32_t *ids, int64_t *based, int64_t b,
                                                                      int64_t h, int64_t t0, int64_t n, int64_t D,
                                                                      int64_t G, float *restrict out) {
    const int64_t m = st->m, nb = st->nb, u = KVQ_BLOCK / m;
    const uint16_t *sc = (const uint16_t *)st->scale + b * st->pb + h * st->ph;
    const uint16_t *zp = st->zero ? (const uint16_t *)st->zero + b * st->pb + h * st->ph : 0;
    const float *table = (const float *)st->table;  /* 0 for int (then zp is never 0: checked in Python) */
    float small[16] = {0};  /* a table of <= 16 entries, zero-padded to 16 (deq_run_table's contract) */
    if (table && st->bits <= 4) {
        memcpy(small, table, sizeof(float) << st->bits);
        table = small;
    }
    const uint8_t *codes = (const uint8_t *)st->codes + b * st->cb + h * st->ch;
    const int64_t plane = m * st->cr;
    const unsigned mask = (1u << st->bits) - 1u;
    int64_t blk = t0 / KVQ_BLOCK, k = (t0 % KVQ_BLOCK) / m, rr = (t0 % KVQ_BLOCK) % m;
    int64_t g_end = 0;  /* per-channel groups: the first row after the loaded group */
    float sbuf[KVQ_MAX_D], zbuf[KVQ_MAX_D], krow[KVQ_MAX_D];
    int64_t bad = 0, seg_end = 0, off = 0;  /* rope: the current segment's end (row index) and its rows' id shift */
    /* segments need the call's rotated queries to fit attend_chunk's buffer; else every row is rotated at its id */
    const int segments = ra && (ra->Hq / ra->Hkv) * D <= KVQ_QROT_FLOATS;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = t0 + i;
        if (ra && i >= seg_end) {  /* a new rope segment: storage positions up to the next multiple of SEG */
            const int64_t next = i + KVQ_ROPE_SEG - t % KVQ_ROPE_SEG;
            seg_end = next < n ? next : n;
            const int64_t base = segments ? segment_base(ra, ids + i, seg_end - i) : -1;
            for (int64_t k = i; k < seg_end; k++) based[k] = base;
            off = base < 0 ? 0 : base;
        }
        const uint8_t *row = codes + (blk * nb * m + rr) * st->cr;
        const unsigned shift = (unsigned)(st->bits * k);
        float *o = ra ? krow : out + i * D;  /* 0 once the row is in out, rotated (deq_rope_run) */
        if (st->token_axis) {  /* D/G groups of G channels, one scale (and zero point) each */
            for (int64_t g = 0; g < D / G; g++) {
                const float s = half_to_float(sc[t * st->pt + g]), z = zp ? half_to_float(zp[t * st->pt + g]) : 0.0f;
                if (table)
                    deq_run_table(o + g * G, row + g * G, plane, nb, shift, mask, table, mf, &s, zp ? &z : 0, 0, G);
                else
                    deq_run(o + g * G, row + g * G, plane, nb, shift, mask, &s, &z, 0, G);
            }
        } else {
            if (t >= g_end) {  /* a new group of G rows (the first row too: g_end starts at 0): its D parameters */
                const int64_t g = t / G;
                g_end = (g + 1) * G;
                if (zp)
                    for (int64_t d = 0; d < D; d++) {
                        sbuf[d] = half_to_float(sc[g * st->pt + d]);
                        zbuf[d] = half_to_float(zp[g * st->pt + d]);
                    }
                else
                    for (int64_t d = 0; d < D; d++) sbuf[d] = half_to_float(sc[g * st->pt + d]);
            }
            if (ra && !table && nb == 1 && ids[i] - off >= 0 && ids[i] - off < ra->P) {  /* int <= 8 bits: fused */
                const int64_t id = ids[i] - off;
                deq_rope_run(out + i * D, row, shift, mask, sbuf, zbuf, (const float *)ra->rcos + id * (D / 2),
                             (const float *)ra->rsin + id * (D / 2), D);
                o = 0;
            } else if (table)
                deq_run_table(o, row, plane, nb, shift, mask, table, mf, sbuf, zp ? zbuf : 0, 1, D);
            else
                deq_run(o, row, plane, nb, shift, mask, sbuf, zbuf, 1, D);
        }
        if (ra && o) bad += rope_at(ra, ids[i] - off, krow, D, out + i * D);
        if (++rr == m) {  /* next row of the block: the next plane row, then the next field, then the next block */
            rr = 0;
            if (++k == u) {
                k = 0;
                blk++;
            }
        }
    }
    return bad;
}

/* history_rows_dg with the head size and group size as constants for the common shapes (64 / 128 channels, groups
   of 32 / 64 / 128), so the compiler unrolls the dequantization loops; any other shape takes the general loops. */
static int64_t history_rows(const Stream *st, int mf, const Args *ra, const int32_t *ids, int64_t *based, int64_t b,
                            int64_t h, int64_t t0, int64_t n, int64_t D, float *restrict out) {
    const int64_t G = st->group;
#define KVQ_SHAPE(d, g) \
    if (D == d && G == g) return history_rows_dg(st, mf, ra, ids, based, b, h, t0, n, d, g, out);
    KVQ_SHAPE(64, 32) KVQ_SHAPE(64, 64) KVQ_SHAPE(128, 32) KVQ_SHAPE(128, 64) KVQ_SHAPE(128, 128)
#undef KVQ_SHAPE
    return history_rows_dg(st, mf, ra, ids, based, b, h, t0, n, D, G, out);
}

/* Row `i` (element offset) of an exact buffer in the model's dtype: fp32 in place, fp16 / bf16 converted into buf
   (exact: every fp16 and bf16 value is an fp32 value; bf16 is the top half of an fp32). */
static inline const float *exact_row(int64_t base, int64_t i, int64_t xdt, int64_t D, float *restrict buf) {
    if (xdt == 0) return (const float *)base + i;
    const uint16_t *x = (const uint16_t *)base + i;
    if (xdt == 1)
        for (int64_t d = 0; d < D; d++) buf[d] = half_to_float(x[d]);
    else
        for (int64_t d = 0; d < D; d++) {
            const uint32_t bits = (uint32_t)x[d] << 16;
            memcpy(buf + d, &bits, sizeof bits);
        }
    return buf;
}

/* Rows of positions [pa, pb) of one stream at (b, h), each p >= pads[b] (j = p - pad, its index among row b's real
   tokens): rows[i] points at the D floats of position pa + i. fp32 sinks and window rows are read in place; history
   rows are dequantized (a run of consecutive rows at once) and fp16 / bf16 rows converted into slot i of buf
   ([pb - pa][D]); with `based` (keys under rope=pre), history rows are rotated as they are dequantized
   (history_rows), and based[i] is the id row i was rotated from (its segment's base: the query must be rotated back
   by it), or -1 (rotated at its own id, or a sink or window row, post-RoPE already). Returns the rows whose position
   id is outside the rope table (their rows are left unrotated; the call's result is refused). */
static int64_t fill_rows(const Args *a, const Stream *st, int mf, int64_t b, int64_t h, int64_t pa, int64_t pb,
                         int64_t pad, float *restrict buf, int64_t *based, const float **rows) {
    const int64_t D = a->D, xdt = st->xdt;
    const int64_t start = st->starts ? ((const int64_t *)st->starts)[b] : a->s;
    const int64_t count = st->counts ? ((const int64_t *)st->counts)[b] : st->n;
    const int32_t *pos = based ? (const int32_t *)a->pos + b * a->pb : 0;
    int64_t bad = 0;
    for (int64_t p = pa; p < pb;) {
        const int64_t i = p - pa, j = p - pad;
        float *slot = buf + i * D;
        if (j < a->s) {  /* a sink: exact, as the model made it (post-RoPE) */
            rows[i] = exact_row(st->sink, b * st->sb + h * st->sh + j * st->st, xdt, D, slot);
            if (based) based[i] = -1;
            p++;
            continue;
        }
        const int64_t t = p - start;
        if (t < count) {  /* a run of history rows, dequantized (and rotated) at once */
            const int64_t n = (start + count < pb ? start + count : pb) - p;
            bad += history_rows(st, mf, based ? a : 0, pos ? pos + p : 0, based ? based + i : 0, b, h, t, n, D, slot);
            for (int64_t k = 0; k < n; k++) rows[i + k] = slot + k * D;
            p += n;
            continue;
        }
        rows[i] = exact_row(st->win, b * st->wb + h * st->wh + (st->W - (a->N - p)) * st->wt, xdt, D, slot);
        if (based) based[i] = -1;
        p++;
    }
    return bad;
}

/* Eight floats as one value (GCC / clang vector extension: one AVX register, or what the target has); loads and
   stores through memcpy, so any alignment. Arithmetic on them is elementwise fp32, the same roundings as scalars. */
typedef float v8f __attribute__((vector_size(32)));
static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* c + a * b with one rounding (a fused multiply-add) where the target has FMA, else a product and a sum: the dot
   products' and weighted sums' step (madd1 in their scalar tails). Their orders of additions are the kernel's own,
   not the reference's (results equal to fp32 rounding, tested), so fusing changes no contract; it halves their
   arithmetic instructions, the kernel's largest cost (about 10% of a call, measured). The dequantization keeps its
   two roundings (-ffp-contract=off: bit for bit the reference's). Fused wherever the target has FMA, KVQ_PORTABLE
   builds included (they test the table lookups against the AVX2 ones, bit for bit); a target without FMA gives
   results that differ in the last bits. */
#if defined(__FMA__)
#include <immintrin.h>
static inline v8f madd8(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
static inline float madd1(float a, float b, float c) { return fmaf(a, b, c); }
#else
static inline v8f madd8(v8f a, v8f b, v8f c) { return c + a * b; }
static inline float madd1(float a, float b, float c) { return c + a * b; }
#endif

/* a . b with 16 independent partial sums (lane j adds the products at d = j mod 16; a single running sum would be a
   serial chain), folded in a fixed order */
static inline float dot(const float *restrict a, const float *restrict b, int64_t D) {
    v8f lo = {0}, hi = {0};
    float tail = 0.0f, acc[8];
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        lo = madd8(load8(a + d), load8(b + d), lo);
        hi = madd8(load8(a + d + 8), load8(b + d + 8), hi);
    }
    for (; d < D; d++) tail = madd1(a[d], b[d], tail);
    store8(acc, lo + hi);
    for (int j = 0; j < 4; j++) acc[j] += acc[j + 4];
    return (acc[0] + acc[2]) + (acc[1] + acc[3]) + tail;
}

/* dot(q, rows[k], D) for k < 4, bit for bit (each dot's own 16 partial sums, products and fold order), the four
   computed in one loop: eight independent add chains instead of two, and q loaded once for the four rows. The folds
   are done four at a time with vector shuffles: lane k of (unpacklo + unpackhi) then (movelh + movehl) is
   (acc[0] + acc[2]) + (acc[1] + acc[3]) of row k, the scalar fold's additions in its order. out[k] = dot(..) *
   scaling + add[k] (add: the mask's four values, or NULL for none: + 0.0f, as attend_chunk adds). */
static inline void dot4(const float *restrict q, const float *const *rows, int64_t D, float scaling,
                        const float *add, float *restrict out) {
    const float *r0 = rows[0], *r1 = rows[1], *r2 = rows[2], *r3 = rows[3];
    v8f l0 = {0}, h0 = {0}, l1 = {0}, h1 = {0}, l2 = {0}, h2 = {0}, l3 = {0}, h3 = {0};
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        const v8f ql = load8(q + d), qh = load8(q + d + 8);
        l0 = madd8(ql, load8(r0 + d), l0);
        h0 = madd8(qh, load8(r0 + d + 8), h0);
        l1 = madd8(ql, load8(r1 + d), l1);
        h1 = madd8(qh, load8(r1 + d + 8), h1);
        l2 = madd8(ql, load8(r2 + d), l2);
        h2 = madd8(qh, load8(r2 + d + 8), h2);
        l3 = madd8(ql, load8(r3 + d), l3);
        h3 = madd8(qh, load8(r3 + d + 8), h3);
    }
    for (; d < D; d++) {
        t[0] = madd1(q[d], r0[d], t[0]);
        t[1] = madd1(q[d], r1[d], t[1]);
        t[2] = madd1(q[d], r2[d], t[2]);
        t[3] = madd1(q[d], r3[d], t[3]);
    }
#if KVQ_AVX2
    __m256 x0, x1, x2, x3;
    const v8f s0 = l0 + h0, s1 = l1 + h1, s2 = l2 + h2, s3 = l3 + h3;
    memcpy(&x0, &s0, 32);
    memcpy(&x1, &s1, 32);
    memcpy(&x2, &s2, 32);
    memcpy(&x3, &s3, 32);
    /* y_k[j] = acc[j] + acc[j + 4] of row k (j < 4) */
    const __m128 y0 = _mm_add_ps(_mm256_castps256_ps128(x0), _mm256_extractf128_ps(x0, 1));
    const __m128 y1 = _mm_add_ps(_mm256_castps256_ps128(x1), _mm256_extractf128_ps(x1, 1));
    const __m128 y2 = _mm_add_ps(_mm256_castps256_ps128(x2), _mm256_extractf128_ps(x2, 1));
    const __m128 y3 = _mm_add_ps(_mm256_castps256_ps128(x3), _mm256_extractf128_ps(x3, 1));
    /* [y0[0] + y0[2], y1[0] + y1[2], y0[1] + y0[3], y1[1] + y1[3]], and the same for rows 2, 3 */
    const __m128 a01 = _mm_add_ps(_mm_unpacklo_ps(y0, y1), _mm_unpackhi_ps(y0, y1));
    const __m128 a23 = _mm_add_ps(_mm_unpacklo_ps(y2, y3), _mm_unpackhi_ps(y2, y3));
    __m128 v = _mm_add_ps(_mm_movelh_ps(a01, a23), _mm_movehl_ps(a23, a01));
    v = _mm_add_ps(v, _mm_loadu_ps(t));
    v = _mm_mul_ps(v, _mm_set1_ps(scaling));
    v = _mm_add_ps(v, add ? _mm_loadu_ps(add) : _mm_setzero_ps());
    _mm_storeu_ps(out, v);
#else
    const v8f s[4] = {l0 + h0, l1 + h1, l2 + h2, l3 + h3};
    for (int k = 0; k < 4; k++) {
        float acc[8];
        store8(acc, s[k]);
        for (int j = 0; j < 4; j++) acc[j] += acc[j + 4];
        out[k] = ((acc[0] + acc[2]) + (acc[1] + acc[3]) + t[k]) * scaling + (add ? add[k] : 0.0f);
    }
#endif
}

/* exp(x) for x <= 0, vectorisable: 2^n * P(r), r = x - n ln2 in [-ln2/2, ln2/2] (Cody-Waite split of ln2),
   P the degree-7 Taylor polynomial (relative error ~1e-7); x < -87 (below fp32's normal range) gives 0. */
static inline float exp_neg(float x) {
    const float fn = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - fn * 0.693359375f) - fn * -2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const float fc = fn < -127.0f ? -127.0f : fn;  /* -inf (masked scores) and the like: no overflow below */
    const uint32_t bits = (uint32_t)((int32_t)fc + 127) << 23;  /* 2^n as a float's exponent bits */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < -87.0f ? 0.0f : p * two_n;
}

/* The largest of s[0 .. T) (-inf for none), eight running maxima at a time (exact in any order) */
static inline float max_of(const float *restrict s, int64_t T) {
    float m8[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    float mx = -INFINITY;
    int64_t t = 0;
    for (; t + 8 <= T; t += 8)
        for (int j = 0; j < 8; j++) m8[j] = s[t + j] > m8[j] ? s[t + j] : m8[j];
    for (; t < T; t++) mx = s[t] > mx ? s[t] : mx;
    for (int j = 0; j < 8; j++) mx = m8[j] > mx ? m8[j] : mx;
    return mx;
}

/* s[t] = exp(s[t] - shift) for t < T (a loop of its own, so that it vectorises) */
static void exp_shifted(float *restrict s, int64_t T, float shift) {
    for (int64_t t = 0; t < T; t++) s[t] = exp_neg(s[t] - shift);
}

/* out[j] = s[j * T + 0] + s[j * T + 1] + ... + s[j * T + T - 1], added in t order from 0.0f, for the k <= 4 rows
   j < k of s: each a serial chain of T additions, so the k chains are interleaved in one loop. */
static inline void sums_of(const float *restrict s, int64_t T, int64_t k, float *restrict out) {
    const float *s0 = s, *s1 = s + T, *s2 = s + 2 * T, *s3 = s + 3 * T;
    float x0 = 0.0f, x1 = 0.0f, x2 = 0.0f, x3 = 0.0f;
    if (k == 4)
        for (int64_t t = 0; t < T; t++) {
            x0 += s0[t];
            x1 += s1[t];
            x2 += s2[t];
            x3 += s3[t];
        }
    else if (k == 3)
        for (int64_t t = 0; t < T; t++) {
            x0 += s0[t];
            x1 += s1[t];
            x2 += s2[t];
        }
    else if (k == 2)
        for (int64_t t = 0; t < T; t++) {
            x0 += s0[t];
            x1 += s1[t];
        }
    else
        for (int64_t t = 0; t < T; t++) x0 += s0[t];
    out[0] = x0;
    out[1] = x1;
    out[2] = x2;
    out[3] = x3;
}

/* acc[d] += w[i] * rows[i][d] over the n rows, in row order (each output element's sum stays sequential, as a
   row-at-a-time loop adds it), with 64 (then 32, 8, 1) output elements held in registers across the rows. */
static inline void weighted_sum(float *restrict acc, const float *restrict w, const float *const *rows, int64_t n,
                                int64_t D) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {  /* 64 outputs: eight add chains per row instead of four */
        v8f a0 = load8(acc + d0), a1 = load8(acc + d0 + 8), a2 = load8(acc + d0 + 16), a3 = load8(acc + d0 + 24);
        v8f a4 = load8(acc + d0 + 32), a5 = load8(acc + d0 + 40), a6 = load8(acc + d0 + 48), a7 = load8(acc + d0 + 56);
        for (int64_t i = 0; i < n; i++) {
            const float *v = rows[i] + d0;
            const v8f wi8 = (v8f){0} + w[i];
            a0 = madd8(wi8, load8(v), a0);
            a1 = madd8(wi8, load8(v + 8), a1);
            a2 = madd8(wi8, load8(v + 16), a2);
            a3 = madd8(wi8, load8(v + 24), a3);
            a4 = madd8(wi8, load8(v + 32), a4);
            a5 = madd8(wi8, load8(v + 40), a5);
            a6 = madd8(wi8, load8(v + 48), a6);
            a7 = madd8(wi8, load8(v + 56), a7);
        }
        store8(acc + d0, a0);
        store8(acc + d0 + 8, a1);
        store8(acc + d0 + 16, a2);
        store8(acc + d0 + 24, a3);
        store8(acc + d0 + 32, a4);
        store8(acc + d0 + 40, a5);
        store8(acc + d0 + 48, a6);
        store8(acc + d0 + 56, a7);
    }
    for (; d0 + 32 <= D; d0 += 32) {
        v8f a0 = load8(acc + d0), a1 = load8(acc + d0 + 8), a2 = load8(acc + d0 + 16), a3 = load8(acc + d0 + 24);
        for (int64_t i = 0; i < n; i++) {
            const float *v = rows[i] + d0;
            const v8f wi8 = (v8f){0} + w[i];
            a0 = madd8(wi8, load8(v), a0);
            a1 = madd8(wi8, load8(v + 8), a1);
            a2 = madd8(wi8, load8(v + 16), a2);
            a3 = madd8(wi8, load8(v + 24), a3);
        }
        store8(acc + d0, a0);
        store8(acc + d0 + 8, a1);
        store8(acc + d0 + 16, a2);
        store8(acc + d0 + 24, a3);
    }
    for (; d0 + 8 <= D; d0 += 8) {
        v8f a0 = load8(acc + d0);
        for (int64_t i = 0; i < n; i++) a0 = madd8((v8f){0} + w[i], load8(rows[i] + d0), a0);
        store8(acc + d0, a0);
    }
    for (; d0 < D; d0++) {
        float x = acc[d0];
        for (int64_t i = 0; i < n; i++) x = madd1(w[i], rows[i][d0], x);
        acc[d0] = x;
    }
}

/* sc[i * T + k] = dot(q + i * qs, rows[k]) * scaling + add[k] for query heads i < r and rows k < n (add: the
   mask's values from the first row's, or NULL for none: + 0.0f), four rows at a time (dot4, the same bits as dot) */
static inline void scores_of(const float *q, int64_t qs, int64_t r, const float *const *rows, int64_t n, int64_t D,
                             float scaling, const float *add, float *restrict sc, int64_t T) {
    int64_t k = 0;
    for (; k + 4 <= n; k += 4)
        for (int64_t i = 0; i < r; i++) dot4(q + i * qs, rows + k, D, scaling, add ? add + k : 0, sc + i * T + k);
    for (; k < n; k++)
        for (int64_t i = 0; i < r; i++) sc[i * T + k] = dot(q + i * qs, rows[k], D) * scaling + (add ? add[k] : 0.0f);
}

/* out[i] = R(id)^T q_i for query heads i < r (q_i at q + i * qs; out rows of D contiguous floats): the query
   rotated by -id with c, s the table rows of id, pairs (j, j + D/2) as rope_row's, so that q_i . R(o) k (a key
   row rotated at its offset o in a rope segment of base id) is q_i . R(id + o) k */
static inline void unrotate_query(const float *q, int64_t qs, int64_t r, int64_t D, const float *restrict c,
                                  const float *restrict s, float *restrict out) {
    for (int64_t i = 0; i < r; i++) rope_row(q + i * qs, c, s, -1.0f, D, out + i * D);
}

/* One task: positions [p0, p1) of kv head h of batch row b, for its r query heads. Writes, per query head, the
   chunk's score max, its sum of exp(score - max), and the exp-weighted sum of value rows (D floats). Rows are read in
   sub-blocks of KVQ_SUB_FLOATS / D positions (fill_rows), so dequantized rows stay in the L1 cache. mf: the keys'
   and values' minifloat_of. Under rope=pre, the rows of a sub-block with one rope segment base take that base's
   rotated queries (unrotate_query, made once per base), the others the query as it is. */
static int64_t attend_chunk(const Args *a, const int mf[2], int64_t b, int64_t h, int64_t p0, int64_t p1,
                            float scaling, float *restrict part) {
    int64_t bad = 0;  /* position ids outside the rope table */
    const int64_t D = a->D, r = a->Hq / a->Hkv, T = p1 - p0;
    const int64_t sub = KVQ_SUB_FLOATS / D < KVQ_MAX_CHUNK ? KVQ_SUB_FLOATS / D : KVQ_MAX_CHUNK;
    float sc[KVQ_MAX_R * KVQ_MAX_CHUNK];
    float buf[KVQ_SUB_FLOATS];
    const float *rows[KVQ_MAX_CHUNK];
    int64_t based[KVQ_MAX_CHUNK], qbase = -1;  /* rope=pre: each row's segment base (fill_rows); qr's base */
    float qr[KVQ_QROT_FLOATS];
    const int rope = a->rcos != 0;
    const float *q = (const float *)a->q + b * a->qb + h * r * a->qh;
    const float *mask = a->mask ? (const float *)a->mask + b * a->mb : 0;
    const int64_t pad = a->pads ? ((const int64_t *)a->pads)[b] : 0;
    const int64_t q0 = p0 > pad ? p0 : pad;  /* positions before q0 are row b's padding: weight 0, never read */
    for (int64_t p = p0; p < q0 && p < p1; p++)
        for (int64_t i = 0; i < r; i++) sc[i * T + (p - p0)] = -INFINITY;
    for (int64_t pa = q0; pa < p1; pa += sub) {
        const int64_t pb = pa + sub < p1 ? pa + sub : p1;
        bad += fill_rows(a, &a->k, mf[0], b, h, pa, pb, pad, buf, rope ? based : 0, rows);
        for (int64_t p = pa; p < pb;) {  /* runs of rows with one base (one run without rope=pre) */
            const int64_t base = rope ? based[p - pa] : -1;
            int64_t e = rope ? p + 1 : pb;
            while (e < pb && based[e - pa] == base) e++;
            if (base >= 0 && base != qbase) {
                unrotate_query(q, a->qh, r, D, (const float *)a->rcos + base * (D / 2),
                               (const float *)a->rsin + base * (D / 2), qr);
                qbase = base;
            }
            scores_of(base >= 0 ? qr : q, base >= 0 ? D : a->qh, r, rows + (p - pa), e - p, D, scaling,
                      mask ? mask + p : 0, sc + (p - p0), T);
            p = e;
        }
    }
    for (int64_t i = 0; i < r; i++) {
        float *s = sc + i * T, mx = max_of(s, T);
        const float shift = mx == -INFINITY ? 0.0f : mx;  /* every position masked: weights 0 */
        exp_shifted(s, T, shift);
        float *pi = part + i * (D + 2);
        pi[0] = mx;
        for (int64_t d = 0; d < D; d++) pi[2 + d] = 0.0f;
    }
    for (int64_t i = 0; i < r; i += 4) {  /* the sums of exps, up to four query heads' chains at a time */
        const int64_t k = r - i < 4 ? r - i : 4;
        float sums[4];
        sums_of(sc + i * T, T, k, sums);
        for (int64_t j = 0; j < k; j++) part[(i + j) * (D + 2) + 1] = sums[j];
    }
    for (int64_t pa = q0; pa < p1; pa += sub) {
        const int64_t pb = pa + sub < p1 ? pa + sub : p1;
        fill_rows(a, &a->v, mf[1], b, h, pa, pb, pad, buf, 0, rows);
        for (int64_t i = 0; i < r; i++)
            weighted_sum(part + i * (D + 2) + 2, sc + i * T + (pa - p0), rows, pb - pa, D);
    }
    return bad;
}

/* What this build's table lookups use, for tests and benchmark headers: 16 (AVX-512: 16 channels at a time), 8 (AVX2
   and F16C: 8 at a time), 0 (plain C: one at a time). */
int64_t kvq_simd_width(void) {
#if KVQ_AVX512
    return 16;
#elif KVQ_AVX2
    return 8;
#else
    return 0;
#endif
}

/* minifloat_of for an fp32 table of 256 entries (an fp8 format's): 3 or 2 where this build computes the values from
   the codes' bits (e4m3fn, e5m2), 0 where it looks them up (another table, or a build without AVX2). */
int64_t kvq_fp8_decoding(int64_t table) {
#if KVQ_AVX2
    Stream st;
    memset(&st, 0, sizeof st);
    st.table = table, st.bits = 8;
    return minifloat_of(&st);
#else
    (void)table;
    return 0;
#endif
}

/* Whether any of n contiguous elements at x (dtype: 0 fp32, 1 fp16, 2 bf16, as `Stream.xdt`) is NaN or inf: its
   exponent bits all set. Exact for every value, no arithmetic on them; one pass the compiler vectorises. The caches'
   check of each new key and value (`all_finite`), one call per tensor instead of a sum and a conversion in PyTorch. */
int64_t kvq_any_nonfinite(int64_t x, int64_t n, int64_t dtype) {
    unsigned hit = 0;
    if (dtype == 0) {
        const uint32_t *p = (const uint32_t *)x;
        for (int64_t i = 0; i < n; i++) hit |= (p[i] & 0x7f800000u) == 0x7f800000u;
    } else {
        const uint16_t e = dtype == 1 ? 0x7c00u : 0x7f80u;
        const uint16_t *p = (const uint16_t *)x;
        for (int64_t i = 0; i < n; i++) hit |= (uint16_t)(p[i] & e) == e;
    }
    return hit;
}

/* The Walsh-Hadamard transform of each block of n channels of `rows` contiguous fp32 rows of D channels, in place,
   then times `scale`: the butterfly stages (a, b) -> (a + b, a - b) on pairs (i, i + h), h = 1, 2, ..., n/2, one
   fp32 sum or difference per element and stage, then one product: the operations of
   `kvq_lab.quant.transforms.hadamard.fwht` and its scaling, in the same order, so the same bits (tested); one call
   where PyTorch takes log2(n) stages of several ops each (the hadamard transform of each new key and value, every
   layer and decode step; and of the query and output inside kvq_decode_attention). */
void kvq_fwht(int64_t x, int64_t rows, int64_t D, int64_t n, float scale) {
    float *p = (float *)x;
    for (int64_t r = 0; r < rows * (D / n); r++) {
        float *restrict y = p + r * n;
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t s = 0; s < n; s += 2 * h)
                for (int64_t j = 0; j < h; j++) {
                    const float a = y[s + j], b = y[s + h + j];
                    y[s + j] = a + b;
                    y[s + h + j] = a - b;
                }
        for (int64_t i = 0; i < n; i++) y[i] *= scale;
    }
}

/* kvq_fwht of a copy: the rows of src (dtype: 0 fp32, 1 fp16, 2 bf16, as `Stream.xdt`), rows of D consecutive
   elements at src + i0 * s0 + i1 * s1 + i2 * s2 (element strides, i0 < n0, i1 < n1, i2 < n2), converted exactly to
   fp32 into the fp32 rows at dst + i0 * t0 + i1 * t1 + i2 * t2 (element strides, each row D consecutive floats),
   then transformed there (the same bits as kvq_fwht on a converted copy). One call where PyTorch made a contiguous
   fp32 copy first: the transform of each new key and value, every layer and decode step, written where the cache
   keeps it (a row of its window buffer). */
static void fwht_copy_to(int64_t src, int64_t dtype, int64_t n0, int64_t n1, int64_t n2, int64_t s0, int64_t s1,
                         int64_t s2, int64_t dst, int64_t t0, int64_t t1, int64_t t2, int64_t D, int64_t n,
                         float scale) {
    const int64_t esize = dtype == 0 ? 4 : 2;
    for (int64_t i0 = 0; i0 < n0; i0++)
        for (int64_t i1 = 0; i1 < n1; i1++)
            for (int64_t i2 = 0; i2 < n2; i2++) {
                float *out = (float *)dst + i0 * t0 + i1 * t1 + i2 * t2;
                const int64_t at = (int64_t)src + (i0 * s0 + i1 * s1 + i2 * s2) * esize;
                if (dtype == 0)
                    memcpy(out, (const float *)at, (size_t)D * sizeof *out);
                else
                    exact_row(at, 0, dtype, D, out);
                kvq_fwht((int64_t)out, 1, D, n, scale);
            }
}

/* fwht_copy_to into the contiguous rows of dst [n0][n1][n2][D] (the query's copy in kvq_decode_attention) */
static void kvq_fwht_copy(int64_t src, int64_t dtype, int64_t n0, int64_t n1, int64_t n2, int64_t s0, int64_t s1,
                          int64_t s2, int64_t dst, int64_t D, int64_t n, float scale) {
    fwht_copy_to(src, dtype, n0, n1, n2, s0, s1, s2, dst, n1 * n2 * D, n2 * D, D, D, n, scale);
}

/* fwht_copy_to of `count` tensors, the integer arguments of each in one int64 block of 14,
   {src, dst, dtype, n0, n1, n2, s0, s1, s2, D, n, t0, t1, t2}, the blocks consecutive at a: the form the caches
   call (a layer's new key and value at once, every decode step), where converting the ctypes arguments one by one
   took about as long as the transform. */
void kvq_fwht_blocks(const int64_t *a, int64_t count, float scale) {
    for (int64_t i = 0; i < count; i++, a += 14)
        fwht_copy_to(a[0], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[1], a[11], a[12], a[13], a[9], a[10], scale);
}

/* Tasks (chunk, b, kv head) over `threads` OpenMP threads, chunk-major: a thread's consecutive tasks cover the same
   positions for every row and head, so under rope=pre the table rows a chunk reads (its segments' bases; every row's
   where ids are not consecutive) are read from memory once per layer and then from the L1/L2 cache, where head-major
   order read them B * Hkv times (before rope segments, the whole table, 2 MB at 8192 tokens: ~60% of rope=pre's
   extra step time in a bf16 model at 8192, measured by pointing every id at one table row). Then the chunks of each
   query head are combined (the same order as before: the same bits). Built
   with -fopenmp and loaded after PyTorch, the library binds to the libgomp PyTorch already loaded (same soname),
   so these threads are PyTorch's own intra-op pool: a second pool would compete with its spinning workers.
   hadamard (qn, on): the query is mapped into the keys' basis first (a copy, kvq_fwht_copy) and each output row back
   from the values' basis at the end, the maps `kvq_sdpa` would make around the call, bit for bit in fp32.
   Returns the number of rope=pre key rows whose position id is outside the table (0: the output is valid; -1: no
   memory for the query's copy). */
int64_t kvq_decode_attention(const Args *args, int64_t threads, float scaling) {
    Args local = *args;  /* the query moved into the Hadamard basis is a copy: the caller's is read only */
    const Args *a = &local;
    float *qh = 0;
    if (args->qn) {
        const int64_t rows = args->B * args->Hq, D = args->D;
        qh = (float *)malloc((size_t)(rows * D) * sizeof *qh);
        if (!qh) return -1;
        kvq_fwht_copy(args->q, 0, 1, args->B, args->Hq, 0, args->qb, args->qh, (int64_t)qh, D, args->qn,
                      (float)pow((double)args->qn, -0.5));
        local.q = (int64_t)qh, local.qb = args->Hq * D, local.qh = D;
    }
    const int64_t D = a->D, r = a->Hq / a->Hkv, C = (a->N + a->chunk - 1) / a->chunk;
    const int64_t tasks = a->B * a->Hkv * C;
    float *partial = (float *)a->partial;
    int64_t bad = 0;
#if KVQ_AVX2
    const int mf[2] = {minifloat_of(&a->k), minifloat_of(&a->v)};
#else
    const int mf[2] = {0, 0};
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tasks > 1) reduction(+ : bad)
    for (int64_t i = 0; i < tasks; i++) {
        const int64_t BH = a->B * a->Hkv, c = i / BH, bh = i % BH;
        const int64_t p0 = c * a->chunk, p1 = p0 + a->chunk < a->N ? p0 + a->chunk : a->N;
        bad += attend_chunk(a, mf, bh / a->Hkv, bh % a->Hkv, p0, p1, scaling, partial + (bh * C + c) * r * (D + 2));
    }
    free(qh);
    if (bad) return bad;
    for (int64_t bq = 0; bq < a->B * a->Hq; bq++) {
        const int64_t b = bq / a->Hq, hq = bq % a->Hq, h = hq / r, i = hq % r;
        const float *p0 = partial + ((b * a->Hkv + h) * C) * r * (D + 2) + i * (D + 2);
        float mx = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < C; c++) mx = p0[c * r * (D + 2)] > mx ? p0[c * r * (D + 2)] : mx;
        float *o = (float *)a->out + b * a->ob + hq * a->oh;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t c = 0; c < C; c++) {
            const float *pc = p0 + c * r * (D + 2);
            if (pc[0] == -INFINITY) continue;
            const float f = exp_neg(pc[0] - mx);
            total += f * pc[1];
            for (int64_t d = 0; d < D; d++) o[d] += f * pc[2 + d];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
        if (a->on) kvq_fwht((int64_t)o, 1, D, a->on, (float)pow((double)a->on, -0.5));
    }
    return 0;
}
