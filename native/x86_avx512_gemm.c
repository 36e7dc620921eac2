/* AVX-512 VNNI integer GEMM for many tokens (prefill, batched decode) on the packed P4 layouts:
 * y[t, r] = W[r, :] . x_t with the integer path's activations (int16 per 32-block, the same values
 * the decode kernels use, so a batch gets what each token gets alone up to float summation order).
 *
 * Why a second integer kernel: the decode kernels dot one row with a few tokens (vectors along the
 * columns, a reduction per row and token); with many tokens that reduction and the per-block
 * rescaling of every (row, token) pair dominate, and the float panel path (weights dequantized,
 * float FMAs) does 16 multiply-adds per instruction. Here the lanes are 16 tokens: each weight pair
 * (2 columns of one row, int16) is broadcast and vpdpwssd multiplies it with the activation pairs of
 * 16 tokens, 32 multiply-adds per instruction; after a 32-block each int32 sum is converted and
 * scaled once. int8 activations (vpdpbusd, twice the multiply-adds per instruction) were measured
 * too: about 2x faster again, but at llama.cpp's q8_0 precision, which made minirt's results no
 * better than llama.cpp's (the embedding checks against transformers tied or lost instead of won;
 * bench/RESULTS.md, 2026-12-02 midday). The AMX path's exact split of each int16 activation into a high and a low
 * byte does not help here: vpdpbusd multiplies unsigned by signed bytes only, and two of them per 4 columns are as
 * many instructions as two vpdpwssd. On Zen 4 a zmm vpdpwssd issues once per cycle, sharing the pipes with the
 * float FMAs (measured: 3.6 G/s per core alone, 1.8 G/s of each interleaved with as many FMAs), so the 16 products
 * and 3 scaling ops per row and 32-block bound this kernel at 84 % of 32 multiply-adds per cycle; measured 81 %
 * with data in L1.
 *
 * Shapes at the boundary:
 *   weights:  a row group is unpacked once per pass (gw[type]) into wu (nr <= 8 rows x cols, int16,
 *             natural column order, value = wd * wu - wm per 32-block; wm only for gw_min 1 types),
 *             wd and wm (nr x cols/32 floats); Q6_K (gw_min 2): value = wd * wu per 16 columns, wd
 *             (nr x cols/16 floats), no wm;
 *   activations: mr_xp (common.h): tokens in groups of 16, q (groups, blocks, 16 pairs, 16 tokens,
 *             2 int16), d and ds (groups, blocks, 16): scale and scale * integer sum of q.
 *
 * Bounds: |w| <= 128 (Q6_K's q - 32: 32), |x| <= 32767: a vpdpwssd adds 2 products < 2^22.1 per lane, a block 32 products,
 * < 2^27.1: far inside int32. */
#include "common.h"

#ifdef MR_X86
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

#include "x86_avx512_inl.h"

/* ---------------------------------------------------------------- activations */

static void gemm_xpanel(const float *x, int64_t nt, int64_t xs, int64_t cols, float *tmp, mr_xp *xp) {
    xp_panel(x, nt, xs, cols, tmp, xp, 0);
}

/* ---------------------------------------------------------------- weights (P4 tiles -> int16 rows) */

/* qword permutes: vectors k (32 bytes = qwords of blocks q 0..3) -> natural blocks (4 qwords each) */
MR_INLINE __m512i nat_lo_q8(__m512i a, __m512i b) {
    return _mm512_permutex2var_epi64(a, _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0), b);
}
MR_INLINE __m512i nat_hi_q8(__m512i a, __m512i b) {
    return _mm512_permutex2var_epi64(a, _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2), b);
}
/* nibble tiles: lo = vectors 0 | 2, hi = vectors 1 | 3 */
MR_INLINE __m512i nat_lo_nib(__m512i lo, __m512i hi) {
    return _mm512_permutex2var_epi64(lo, _mm512_set_epi64(13, 5, 9, 1, 12, 4, 8, 0), hi);
}
MR_INLINE __m512i nat_hi_nib(__m512i lo, __m512i hi) {
    return _mm512_permutex2var_epi64(lo, _mm512_set_epi64(15, 7, 11, 3, 14, 6, 10, 2), hi);
}

/* Two output forms (I8): the int16 GEMM's (rows of int16 at wu, row stride cols; scales wd[row * ns + k] for K
 * step k, ns steps per row: cols / 32, or cols / 16 for per-16 scales) and the AMX int8 GEMM's (x86_amx.c: rows of
 * int8 at (int8_t *)wu, row stride cols; scales by K step for 16 rows, wd[16 k + row], and so the mins). */
MR_INLINE int64_t sidx(int64_t row, int64_t k, int64_t ns, const int I8) { return I8 ? 16 * k + row : row * ns + k; }

/* 64 byte values minus off (the differences fit int8: byte arithmetic wraps to them) -> 64 elements from column c of
 * row `row` (int8, or sign-extended to int16: one byte subtraction instead of two int16 ones) */
MR_INLINE void st64(int16_t *wu, int64_t cols, int64_t row, int64_t c, __m512i v, int off, const int I8) {
    if (off) v = _mm512_sub_epi8(v, _mm512_set1_epi8((char)off));
    if (I8) {
        _mm512_storeu_si512((void *)((int8_t *)wu + row * cols + c), v);
        return;
    }
    int16_t *o = wu + row * cols + c;
    _mm512_storeu_si512((void *)o, _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v)));
    _mm512_storeu_si512((void *)(o + 32), _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1)));
}

/* the 16 f16 scales [4r + q] of a 32-block-type tile (4 rows from row0, blocks 4t + q) -> wd */
MR_INLINE void tile_scales16(const uint8_t *tile, float *wd, int64_t row0, int64_t nb, int64_t t, const int I8) {
    __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tile));
    /* four stores of four floats (sixteen scalar stores before): I8, for each block the four rows side by side (s
     * transposed), one block after the other; else each row's four blocks, one row after the other */
    if (I8) s = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
    float *d = wd + sidx(row0, 4 * t, nb, I8);
    const int64_t next = I8 ? 16 : nb;
    _mm_storeu_ps(d, _mm512_castps512_ps128(s));
    _mm_storeu_ps(d + next, _mm512_extractf32x4_ps(s, 1));
    _mm_storeu_ps(d + 2 * next, _mm512_extractf32x4_ps(s, 2));
    _mm_storeu_ps(d + 3 * next, _mm512_extractf32x4_ps(s, 3));
}

/* 64 bytes of P4 nibbles (vectors 0..3 of a quad) -> 128 values in natural order from column c, minus off;
 * hb: Q5_0's masks (bit set <=> the 5th bit is 0), the value is then nibble + 16 * 5th bit - off */
MR_INLINE void nib_rows(const uint8_t *src, int16_t *wu, int64_t cols, int64_t row, int64_t c, __mmask64 klo,
                        __mmask64 khi, int hb, int off, const int I8) {
    const __m512i m4 = _mm512_set1_epi8(15), z = _mm512_loadu_si512((const void *)src);
    __m512i lo = _mm512_and_si512(z, m4), hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
    if (hb) { /* nibble + 16 * 5th bit - 16: minus 16 where the bit is 0 (off is 16) */
        lo = _mm512_mask_sub_epi8(lo, klo, lo, _mm512_set1_epi8(16));
        hi = _mm512_mask_sub_epi8(hi, khi, hi, _mm512_set1_epi8(16));
        off = 0;
    }
    st64(wu, cols, row, c, nat_lo_nib(lo, hi), off, I8);
    st64(wu, cols, row, c + 64, nat_hi_nib(lo, hi), off, I8);
}

/* 32-element block types (tiles of 4 rows x 128 columns): the tile's 16 f16 scales, then each row */
MR_INLINE void gw_blocks32(const int T, const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols,
                           int16_t *wu, float *wd, const int I8) {
    const int64_t nb = cols / 32;
    for (int g = 0; g < ng; g++)
        for (int64_t t = 0; t < ntiles; t++) {
            const uint8_t *tile = wp + ((int64_t)g * ntiles + t) * tb;
            tile_scales16(tile, wd, 4 * g, nb, t, I8);
            for (int r = 0; r < 4; r++) {
                const int64_t row = 4 * g + r, c = 128 * t;
                if (T == GT_Q8_0) {
                    const uint8_t *s = tile + 32 + 128 * r;
                    const __m512i a = _mm512_loadu_si512((const void *)s), b = _mm512_loadu_si512((const void *)(s + 64));
                    st64(wu, cols, row, c, nat_lo_q8(a, b), 0, I8);
                    st64(wu, cols, row, c + 64, nat_hi_q8(a, b), 0, I8);
                } else if (T == GT_Q4_0) {
                    nib_rows(tile + 32 + 64 * r, wu, cols, row, c, 0, 0, 0, 8, I8);
                } else { /* Q5_0 */
                    const uint8_t *m = tile + 32 + 16 * r; /* (r, k) masks, 4 bytes each */
                    const __mmask64 klo = (__mmask64)mr_rd32(m) | (__mmask64)mr_rd32(m + 8) << 32;
                    const __mmask64 khi = (__mmask64)mr_rd32(m + 4) | (__mmask64)mr_rd32(m + 12) << 32;
                    nib_rows(tile + 96 + 64 * r, wu, cols, row, c, klo, khi, 1, 16, I8);
                }
            }
        }
}

#define GW32(name, T, I8)                                                                                        \
    static void name(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu, float *wd, \
                     float *wm) {                                                                                \
        (void)wm;                                                                                                \
        gw_blocks32(T, wp, ntiles, tb, ng, cols, wu, wd, I8);                                                    \
    }
GW32(gw_q4_0, GT_Q4_0, 0)
GW32(gw_q5_0, GT_Q5_0, 0)
GW32(gw_q8_0, GT_Q8_0, 0)
GW32(gw8_q4_0, GT_Q4_0, 1)
GW32(gw8_q5_0, GT_Q5_0, 1)
GW32(gw8_q8_0, GT_Q8_0, 1)

/* four rows of 16 floats (v[r]) -> column j's four values side by side at lo + 16 j (j < 8), hi + 16 (j - 8) (j >= 8):
 * four rows' scales in gw8's by-K-step form (wd[16 k + row]) as 16 stores (64 scalar ones before) */
MR_INLINE void st_cols4(const __m512 v[4], float *lo, float *hi) {
    /* a 4 x 4 transpose in every 128-bit lane: x[k] lane L = column 4L + k */
    const __m512 a = _mm512_unpacklo_ps(v[0], v[1]), b = _mm512_unpackhi_ps(v[0], v[1]);
    const __m512 c = _mm512_unpacklo_ps(v[2], v[3]), e = _mm512_unpackhi_ps(v[2], v[3]);
    __m512 x[4];
    x[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(c)));
    x[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(c)));
    x[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b), _mm512_castps_pd(e)));
    x[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b), _mm512_castps_pd(e)));
    for (int k = 0; k < 4; k++) {
        _mm_storeu_ps(lo + 16 * k, _mm512_castps512_ps128(x[k]));
        _mm_storeu_ps(lo + 16 * (4 + k), _mm512_extractf32x4_ps(x[k], 1));
        _mm_storeu_ps(hi + 16 * k, _mm512_extractf32x4_ps(x[k], 2));
        _mm_storeu_ps(hi + 16 * (4 + k), _mm512_extractf32x4_ps(x[k], 3));
    }
}

/* a Q4_K tile's scales and mins (4 rows from row0, sub-blocks 8t..8t+7) -> d * sc at wd, dmin * m at wm, as vectors
 * (they were 64 scalar stores a tile). Row r's bytes at tile + 16 + 16r: 8 scales, 8 mins (decoded 6-bit values);
 * d, dmin at tile + 2r, tile + 8 + 2r (f16). */
MR_INLINE void q4k_scales(const uint8_t *tile, float *wd, float *wm, int64_t row0, int64_t nb, int64_t t, const int I8) {
    const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tile)); /* d0..d3, dmin0..dmin3 */
    __m512 v[4]; /* row r: 8 scales then 8 mins, scaled */
    for (int r = 0; r < 4; r++) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + 16 + 16 * r))));
        const __m512 m = _mm512_permutexvar_ps(_mm512_setr_epi32(r, r, r, r, r, r, r, r, 4 + r, 4 + r, 4 + r, 4 + r,
                                                                 4 + r, 4 + r, 4 + r, 4 + r),
                                               _mm512_castps256_ps512(dd));
        v[r] = _mm512_mul_ps(f, m);
    }
    if (!I8) { /* each row's 8 scales, 8 mins side by side */
        for (int r = 0; r < 4; r++) {
            _mm256_storeu_ps(wd + (row0 + r) * nb + 8 * t, _mm512_castps512_ps256(v[r]));
            _mm256_storeu_ps(wm + (row0 + r) * nb + 8 * t, _mm512_extractf32x8_ps(v[r], 1));
        }
        return;
    }
    st_cols4(v, wd + 16 * 8 * t + row0, wm + 16 * 8 * t + row0); /* scales of sub-blocks 0..7, then their mins */
}

MR_INLINE void gw_q4_k_(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu, float *wd,
                        float *wm, const int I8) {
    const int64_t nb = cols / 32;
    for (int g = 0; g < ng; g++)
        for (int64_t t = 0; t < ntiles; t++) {
            const uint8_t *tile = wp + ((int64_t)g * ntiles + t) * tb;
            q4k_scales(tile, wd, wm, 4 * g, nb, t, I8);
            for (int r = 0; r < 4; r++)
                for (int Q = 0; Q < 2; Q++)
                    nib_rows(tile + 80 + 128 * r + 64 * Q, wu, cols, 4 * g + r, 256 * t + 128 * Q, 0, 0, 0, 0, I8);
        }
}
static void gw_q4_k(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu, float *wd,
                    float *wm) {
    gw_q4_k_(wp, ntiles, tb, ng, cols, wu, wd, wm, 0);
}
static void gw8_q4_k(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu, float *wd,
                     float *wm) {
    gw_q4_k_(wp, ntiles, tb, ng, cols, wu, wd, wm, 1);
}

/* Q6_K (tiles of 4 rows x 256 columns, pack.c): q - 32 in natural order, and the per-16 scales d * sc (2 * cols / 32
 * K steps per row). Quad Q of row r unpacks as the decode kernels do (pk_q6k_quad: vector k, lane j
 * holds element E6(k, j)); two rounds of word permutes put it in column order: A = vectors 0, 1 and B = 2, 3
 * split by lane halves (j < 16 | j >= 16, q6_idx[0..1]), then natural vector m takes its 32 columns from A and B
 * (q6_idx[2 + m]). */
static int16_t q6_idx[8][32] __attribute__((aligned(64)));

static void q6_init(void) {
    for (int p = 0; p < 32; p++) {
        q6_idx[0][p] = (int16_t)(p < 16 ? p : 32 + p - 16); /* lanes 0..15 of both sources */
        q6_idx[1][p] = (int16_t)(p < 16 ? 16 + p : 32 + p); /* lanes 16..31 */
    }
    for (int m = 0; m < 4; m++)
        for (int i = 0; i < 32; i++) {
            const int c = 32 * m + i, k = (c % 8) / 2, j = 4 * (c / 16) + 2 * ((c % 16) / 8) + c % 2;
            q6_idx[2 + m][i] = (int16_t)((k < 2 ? 0 : 32) + (k % 2) * 16 + j % 16);
        }
}

MR_INLINE void gw_q6_k_(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu, float *wd,
                        const int I8) {
    const int64_t ns = cols / 16;
    const __m512i c32 = _mm512_set1_epi16(32);
    const __m512i i0 = _mm512_load_si512((const void *)q6_idx[0]), i1 = _mm512_load_si512((const void *)q6_idx[1]);
    for (int g = 0; g < ng; g++)
        for (int64_t t = 0; t < ntiles; t++) {
            const uint8_t *tile = wp + ((int64_t)g * ntiles + t) * tb;
            __m512 s[4]; /* row r: its 16 scales d * sc */
            for (int r = 0; r < 4; r++)
                s[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(tile + 8 + 16 * r)))),
                                     _mm512_set1_ps(f16s(tile + 2 * r)));
            if (I8) st_cols4(s, wd + 16 * 16 * t + 4 * g, wd + 16 * (16 * t + 8) + 4 * g);
            else
                for (int r = 0; r < 4; r++) _mm512_storeu_ps(wd + (4 * g + r) * ns + 16 * t, s[r]);
            for (int r = 0; r < 4; r++) {
                const int64_t row = 4 * g + r;
                for (int Q = 0; Q < 2; Q++) {
                    __m512i v[4];
                    pk_q6k_quad(tile, r, Q, v);
                    const __m512i alo = _mm512_permutex2var_epi16(v[0], i0, v[1]), ahi = _mm512_permutex2var_epi16(v[0], i1, v[1]);
                    const __m512i blo = _mm512_permutex2var_epi16(v[2], i0, v[3]), bhi = _mm512_permutex2var_epi16(v[2], i1, v[3]);
                    const int64_t c = 256 * t + 128 * Q;
                    for (int m = 0; m < 4; m++) {
                        const __m512i im = _mm512_load_si512((const void *)q6_idx[2 + m]);
                        const __m512i n = _mm512_sub_epi16(m < 2 ? _mm512_permutex2var_epi16(alo, im, blo)
                                                                 : _mm512_permutex2var_epi16(ahi, im, bhi), c32);
                        if (I8) _mm256_storeu_si256((__m256i *)(void *)((int8_t *)wu + row * cols + c + 32 * m), _mm512_cvtepi16_epi8(n));
                        else _mm512_storeu_si512((void *)(wu + row * cols + c + 32 * m), n);
                    }
                }
            }
        }
}
static void gw_q6_k(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu, float *wd,
                    float *wm) {
    (void)wm;
    gw_q6_k_(wp, ntiles, tb, ng, cols, wu, wd, 0);
}
static void gw8_q6_k(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu, float *wd,
                     float *wm) {
    (void)wm;
    gw_q6_k_(wp, ntiles, tb, ng, cols, wu, wd, 1);
}

/* ---------------------------------------------------------------- the kernel */

/* acc + the int16 pairs of xv times weight pair u of row w, broadcast (columns 2u, 2u + 1). GCC loads the pair with a
 * separate vpbroadcastd; as vpdpwssd's embedded broadcast from a base register and a constant offset the kernel
 * ran 6 % faster (Zen 4, one core, data in L1: 90 -> 96 G multiply-adds/s, 8 alternating runs each; through
 * native.matmul, one thread, 16 / 256 tokens: 1.2x). The "m" operand tells the compiler which bytes it reads. */
MR_INLINE __m512i gt_dot(__m512i acc, __m512i xv, const int16_t *w, const int u) {
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vpdpwssd %c3(%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(xv), "r"(w), "i"(4 * u), "m"(*(const int16_t(*)[32])w));
    return acc;
#else
    return _mm512_dpwssd_epi32(acc, xv, _mm512_set1_epi32((int)mr_rd32((const uint8_t *)(w + 2 * u))));
#endif
}

/* R (4 or 8) rows x token group g (16 tokens): y[(16 g + j) * ys + r] for r < nr, tokens < nt. The accumulators are
 * named variables (arrays of them, indexed in unrolled loops, cost a register copy of every accumulator per column
 * pair and stack stores in the inner loop: a 16-token group ran at 0.4-0.7x this speed) and the weight pair is the
 * broadcast memory operand of vpdpwssd. One group at a time: a tile of 8 rows x 32 tokens needs 32 accumulators
 * and spills; for long prompts the same speed as that tile was measured (pp64 / pp300 / pp512 within the noise).
 * S16: wd holds a scale per 16 columns (row stride 2 nb): each half of a 32-block is scaled on its own.
 * pf / pfn: the packed tiles of the next row group, prefetched a slice per 32-block (they come from DRAM while this
 * group's products run). */
#define GT_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
MR_INLINE void gemm_tile(const int16_t *wu, int64_t cols, const float *wd, const float *wm, const mr_xp *x, int64_t g,
                         int64_t nt, int nr, float *y, int64_t ys, const uint8_t *pf, int64_t pfn, const int R,
                         const int MIN, const int S16) {
    const int64_t nb = x->nb, pstep = ((pfn + nb - 1) / nb + 63) & ~(int64_t)63;
    const __m512 zf = _mm512_setzero_ps();
#define GT_F(r) __m512 f##r = zf;
    GT_ROWS(GT_F)
#undef GT_F
    for (int64_t b = 0; b < nb; b++) {
        if (pfn > 0)
            for (int64_t o = b * pstep; o < (b + 1) * pstep && o < pfn; o += 64) _mm_prefetch((const char *)pf + o, _MM_HINT_T0);
        const int16_t *xq = x->q + (g * nb + b) * 512;
        const int16_t *wb = wu + 32 * b;
        const __m512i zi = _mm512_setzero_si512();
#define GT_A(r) __m512i a##r = zi;
        GT_ROWS(GT_A)
#undef GT_A
        const __m512 dx = _mm512_loadu_ps(x->d + (g * nb + b) * 16);
#define GT_FLUSH(r, SW)                                                                                        \
    if (r < R) {                                                                                                \
        f##r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a##r), _mm512_mul_ps(dx, _mm512_set1_ps(SW)), f##r);          \
        a##r = zi;                                                                                              \
    }
#pragma GCC unroll 16
        for (int u = 0; u < 16; u++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + 32 * u));
#define GT_DOT(r) if (r < R) a##r = gt_dot(a##r, xv, wb + r * cols, u);
            GT_ROWS(GT_DOT)
#undef GT_DOT
            if (S16 && u == 7) { /* columns 0..15 of the block: their own scale */
#define GT_H(r) GT_FLUSH(r, wd[r * 2 * nb + 2 * b])
                GT_ROWS(GT_H)
#undef GT_H
            }
        }
#define GT_E(r) GT_FLUSH(r, S16 ? wd[r * 2 * nb + 2 * b + 1] : wd[r * nb + b])
        GT_ROWS(GT_E)
#undef GT_E
#undef GT_FLUSH
        if (MIN) {
            const __m512 ds = _mm512_loadu_ps(x->ds + (g * nb + b) * 16);
#define GT_M(r) if (r < R) f##r = _mm512_fnmadd_ps(ds, _mm512_set1_ps(wm[r * nb + b]), f##r);
            GT_ROWS(GT_M)
#undef GT_M
        }
    }
    float o[8][16] __attribute__((aligned(64)));
#define GT_S(r) if (r < R) _mm512_store_ps(o[r], f##r);
    GT_ROWS(GT_S)
#undef GT_S
    const int n = (int)(nt - 16 * g < 16 ? nt - 16 * g : 16);
    for (int j = 0; j < n; j++)
        for (int r = 0; r < R && r < nr; r++) y[(16 * g + j) * ys + r] = o[r][j];
}

/* token group g through the tile compiled for R rows and the matrix's scale form (a min, per-16 scales, or neither) */
MR_INLINE void gemm_group(const int16_t *wu, const float *wd, const float *wm, int nr, int64_t cols, const mr_xp *x,
                          int64_t g, int64_t nt, float *y, int64_t ys, int s16, const uint8_t *pf, int64_t pfn,
                          const int R) {
    if (wm) gemm_tile(wu, cols, wd, wm, x, g, nt, nr, y, ys, pf, pfn, R, 1, 0);
    else if (s16) gemm_tile(wu, cols, wd, wd, x, g, nt, nr, y, ys, pf, pfn, R, 0, 1); /* wm: not read */
    else gemm_tile(wu, cols, wd, wd, x, g, nt, nr, y, ys, pf, pfn, R, 0, 0);
}

/* nr <= 8 unpacked rows (wu, wd, wm as gw_* wrote them; wm NULL: no min; s16: wd per 16) x all nt tokens of x; the
 * first group prefetches the next row group's packed tiles (pf, pfn) */
static void gemm_rows(const int16_t *wu, const float *wd, const float *wm, int nr, int64_t cols, const mr_xp *x,
                      int64_t nt, float *y, int64_t ys, int s16, const uint8_t *pf, int64_t pfn) {
    for (int64_t g = 0; g < x->ng; g++) {
        const uint8_t *p = g ? NULL : pf;
        const int64_t pn = g ? 0 : pfn;
        if (nr > 4) gemm_group(wu, wd, wm, nr, cols, x, g, nt, y, ys, s16, p, pn, 8);
        else gemm_group(wu, wd, wm, nr, cols, x, g, nt, y, ys, s16, p, pn, 4);
    }
}

void mr_init_avx512_gemm(mr_kernels *k) {
    k->gemm_xpanel = gemm_xpanel;
    k->gemm_rows = gemm_rows;
    k->gw[GT_Q4_0] = gw_q4_0;
    k->gw[GT_Q5_0] = gw_q5_0;
    k->gw[GT_Q8_0] = gw_q8_0;
    k->gw[GT_Q4_K] = gw_q4_k;
    k->gw_min[GT_Q4_K] = 1;
    q6_init();
    k->gw[GT_Q6_K] = gw_q6_k;
    k->gw_min[GT_Q6_K] = 2;
    k->gw8[GT_Q4_0] = gw8_q4_0;
    k->gw8[GT_Q5_0] = gw8_q5_0;
    k->gw8[GT_Q8_0] = gw8_q8_0;
    k->gw8[GT_Q4_K] = gw8_q4_k;
    k->gw8[GT_Q6_K] = gw8_q6_k;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif
