/* AVX-512 VNNI multi-row integer kernels for decode (1..4 tokens a pass; packed layout: 1..16):
 * y[t, r] = W[r, :] . x_t.
 *
 * Same arithmetic as the single-row kernels of x86_avx512.c (weights unpacked to int16, int16
 * activations per 32-block, vpdpwssd, each block's int32 sums scaled in float32) organised for speed
 * (Q3_K, Q2_K and TQ2_0 instead take int8 activations per 256, see "int8 activations" below):
 *
 * - several rows per pass (4 for 1..2 tokens, 2 for 3..4): the activation loads, the loop and the
 *   final reductions are shared, and the rows' independent accumulators hide the FMA latency;
 * - per-block scales come from a few word permutes per 16 blocks and one vector multiply by the
 *   activation scales (no per-block f16 conversion on the shuffle port);
 * - constant weight offsets (Q4_0's -8, Q6_K's -32) leave the inner loop: sum (q - o) * xq is
 *   computed as sum q * xq - o * sum xq, with sum xq from the activation quantization (exact in
 *   integers, so the result is the same as subtracting first);
 * - Q6_K's per-16 scales multiply the float partial sums (lanes 0..7 of a vpdpwssd hold the first
 *   16 elements) instead of the int16 weights;
 * - the kernels can software-prefetch their rows mr_pf_dist bytes ahead (MINIRT_PF; off by default:
 *   measured in decode on the packed layout, the hardware prefetcher keeps up with its one stream).
 *
 * Bounds: |w| <= 63 (Q6_K, unsigned here), |x| <= 32767: two products per int32 lane, no overflow. */
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

/* pidx[k] = [2k x 8, 2k+1 x 8]: spreads elements 2k, 2k+1 of a 16-float vector over the two halves */
static const int32_t pidx_tab[8][16] __attribute__((aligned(64))) = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},         {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},         {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},         {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
};
#define PIDX(k) _mm512_load_si512((const void *)pidx_tab[k])

/* The f16 fields at byte OFF of blocks 0..n-1 (n <= 16) of BYTES bytes each -> 16 floats (0 past n).
 * Word permutes over 128-byte windows (several blocks each) instead of a gather, which is slow on
 * many CPUs, or 16 scalar copies, whose store-to-load forwarding fails. Masked loads never touch
 * bytes past the n blocks. */
MR_INLINE __m512 scales16(const uint8_t *ws, const int BYTES, const int OFF, int64_t n) {
    const int M = (126 - OFF) / BYTES + 1; /* blocks per window */
    const __m512i base = _mm512_mullo_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                         7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi16((short)(BYTES / 2)));
    __m512i res = _mm512_setzero_si512();
    for (int64_t j0 = 0; j0 < n; j0 += M) {
        const uint8_t *p = ws + j0 * BYTES;
        const int64_t avail = (n - j0) * BYTES;
        const __mmask64 k0 = avail >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << avail) - 1;
        const __mmask64 k1 = avail >= 128 ? ~(__mmask64)0 : avail <= 64 ? 0 : ((__mmask64)1 << (avail - 64)) - 1;
        const __m512i lo = _mm512_maskz_loadu_epi8(k0, p), hi = _mm512_maskz_loadu_epi8(k1, p + 64);
        const __m512i idx = _mm512_add_epi16(base, _mm512_set1_epi16((short)((OFF - (int)j0 * BYTES) / 2)));
        const __mmask32 lanes = (__mmask32)((((uint32_t)1 << M) - 1) << j0);
        res = _mm512_mask_mov_epi16(res, lanes, _mm512_permutex2var_epi16(lo, idx, hi));
    }
    return _mm512_cvtph_ps(_mm512_castsi512_si256(res));
}

MR_INLINE __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* The e8m0 scales (byte 0) of blocks 0..n-1 (n <= 16) of BYTES bytes -> 16 floats, halved as
 * mr_e8m0_half does (0 past n). One masked dword gather: each lane reads bytes 0..3 of its own
 * block, so nothing past block n-1 is touched; a byte permute would need AVX512-VBMI. */
MR_INLINE __m512 e8m0_scales16(const uint8_t *ws, const int BYTES, int64_t n) {
    const __mmask16 k = mask16(n);
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(BYTES));
    const __m512i e = _mm512_and_si512(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, ws, 1),
                                       _mm512_set1_epi32(0xff));
    /* e >= 2: (e - 1) << 23 (a normal float); e < 2: the subnormals 0x00200000 << e */
    __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    bits = _mm512_mask_sllv_epi32(bits, _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)),
                                  _mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(k, bits));
}

/* prefetch the bytes [lo, hi) of base, clipped to end */
MR_INLINE void pf_range(const uint8_t *base, int64_t lo, int64_t hi, int64_t end) {
    if (hi > end) hi = end;
    for (int64_t o = lo & ~(int64_t)63; o < hi; o += 64) _mm_prefetch((const char *)base + o, _MM_HINT_T0);
}

/* ---------------------------------------------------------------- 32-element nibble types, in pairs
 * A pair of blocks a, b unpacks to lo = [a 0..15, b 0..15], hi = [a 16..31, b 16..31] (int16), the
 * order of xa->qp; int32 lanes 0..7 of the two dot products then belong to a, 8..15 to b. */
enum { K_Q4_0, K_Q4_1, K_Q5_0, K_Q5_1, K_IQ4NL, K_MXFP4 };

/* the codebook types: IQ4_NL (f16 scale @0, codes @2), MXFP4 (e8m0 scale @0, codes @1) */
#define CODEBOOK(KIND) ((KIND) == K_IQ4NL || (KIND) == K_MXFP4)
MR_INLINE __m512i lut16(const int KIND, __m256i nib) { /* int8 codebook lookup, widened to int16 */
    return _mm512_cvtepi8_epi16(KIND == K_MXFP4 ? mxfp4_lut(nib) : iq4_lut(nib));
}

MR_INLINE void unpack_pair(const int KIND, const uint8_t *a, const uint8_t *b, __m512i *lo, __m512i *hi) {
    const __m512i c16 = _mm512_set1_epi16(16);
    __mmask32 kl, kh;
    switch (KIND) {
    case K_Q4_0: nib_pair(a + 2, b + 2, lo, hi); break; /* raw 0..15; the -8 is folded out */
    case K_Q4_1: nib_pair(a + 4, b + 4, lo, hi); break;
    case K_Q5_0:
        nib_pair(a + 6, b + 6, lo, hi);
        hbits_pair(a + 2, b + 2, &kl, &kh);
        *lo = _mm512_mask_sub_epi16(*lo, (__mmask32)~kl, *lo, c16); /* (q | h << 4) - 16 */
        *hi = _mm512_mask_sub_epi16(*hi, (__mmask32)~kh, *hi, c16);
        break;
    case K_Q5_1:
        nib_pair(a + 8, b + 8, lo, hi);
        hbits_pair(a + 4, b + 4, &kl, &kh);
        *lo = _mm512_mask_add_epi16(*lo, kl, *lo, c16);
        *hi = _mm512_mask_add_epi16(*hi, kh, *hi, c16);
        break;
    default: { /* IQ4_NL, MXFP4 */
        const int q = KIND == K_MXFP4 ? 1 : 2;
        const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + q))),
                                                    _mm_loadu_si128((const __m128i *)(b + q)), 1);
        const __m256i m4 = _mm256_set1_epi8(15);
        *lo = lut16(KIND, _mm256_and_si256(raw, m4));
        *hi = lut16(KIND, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
    }
    }
}

/* one block in natural order (the odd last block of a row) */
MR_INLINE __m512i unpack_one(const int KIND, const uint8_t *b) {
    const int qoff = KIND == K_MXFP4 ? 1 : KIND == K_Q4_0 || KIND == K_IQ4NL ? 2 : KIND == K_Q4_1 ? 4 : KIND == K_Q5_0 ? 6 : 8;
    const __m128i r = _mm_loadu_si128((const __m128i *)(b + qoff));
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r, 4), r), _mm256_set1_epi8(15));
    if (CODEBOOK(KIND)) return lut16(KIND, nib);
    __m512i v = _mm512_cvtepu8_epi16(nib);
    if (KIND == K_Q5_0)
        v = _mm512_mask_sub_epi16(v, (__mmask32)~mr_rd32(b + 2), v, _mm512_set1_epi16(16));
    else if (KIND == K_Q5_1)
        v = _mm512_mask_add_epi16(v, (__mmask32)mr_rd32(b + 4), v, _mm512_set1_epi16(16));
    return v;
}

/* R rows (row stride rb) x NT tokens over nb blocks of BYTES bytes. Corrections per block (one
 * accumulator): types with a min add m * sum(x); Q4_0 subtracts 8 * d * sum(xq). */
/* Combined scales sc[r][t][i] = d_w(block s0+i of row r) * d_x(t, s0+i) of one segment of n <= 16
 * blocks, and the per-segment corrections (min * sum x, or d * sum xq for folded offsets). */
MR_INLINE void seg_scales(const uint8_t *w, int64_t rb, int64_t s0, int64_t n, const mr_xact *xa, const int NT,
                          const int R, const int BYTES, const int E8M0, const int HAS_MIN, const int HAS_OFF,
                          float sc[][MR_NT_INT][16],
                          __m512 cor[][MR_NT_INT]) {
    const __mmask16 k = mask16(n);
    for (int r = 0; r < R; r++) {
        const uint8_t *ws = w + r * rb + s0 * BYTES;
        const __m512 dw = E8M0 ? e8m0_scales16(ws, BYTES, n) : scales16(ws, BYTES, 0, n);
        const __m512 mw = HAS_MIN ? scales16(ws, BYTES, 2, n) : dw;
        for (int t = 0; t < NT; t++) {
            const int64_t o = t * xa->bs + s0;
            _mm512_store_ps(sc[r][t], _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(k, xa->d + o)));
            if (HAS_MIN || HAS_OFF)
                cor[r][t] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(k, (HAS_MIN ? xa->s : xa->sq) + o), cor[r][t]);
        }
    }
}

/* R rows (row stride rb) x NT tokens over nb blocks of BYTES bytes. The scales of the next segment
 * of 16 blocks are computed before the dot products of the current one, so their latency (loads,
 * permutes, conversion) overlaps useful work. Corrections per block (one accumulator): types with
 * a min add m * sum(x); Q4_0 subtracts 8 * d * sum(xq). */
MR_INLINE void gemv_pair_impl(const uint8_t *w, int64_t rb, int64_t nb, const mr_xact *xa, float *y, int64_t ys,
                              const int NT, const int R, const int BYTES, const int KIND) {
    const int HAS_MIN = KIND == K_Q4_1 || KIND == K_Q5_1, HAS_OFF = KIND == K_Q4_0, E8M0 = KIND == K_MXFP4;
    __m512 acc[4][MR_NT_INT], cor[4][MR_NT_INT];
    float sc[2][4][MR_NT_INT][16] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = cor[r][t] = _mm512_setzero_ps();
    seg_scales(w, rb, 0, nb < 16 ? nb : 16, xa, NT, R, BYTES, E8M0, HAS_MIN, HAS_OFF, sc[0], cor);
    int cur = 0;
    for (int64_t s0 = 0; s0 < nb; s0 += 16, cur ^= 1) {
        const int64_t n = nb - s0 < 16 ? nb - s0 : 16;
        if (s0 + 16 < nb)
            seg_scales(w, rb, s0 + 16, nb - s0 - 16 < 16 ? nb - s0 - 16 : 16, xa, NT, R, BYTES, E8M0, HAS_MIN, HAS_OFF,
                       sc[cur ^ 1], cor);
        int64_t b = 0;
        for (; b + 2 <= n; b += 2) {
            const __m512i pidx = PIDX(b >> 1);
            for (int r = 0; r < R; r++) {
                const uint8_t *wb = w + r * rb + (s0 + b) * BYTES;
                __m512i lo, hi;
                unpack_pair(KIND, wb, wb + BYTES, &lo, &hi);
                for (int t = 0; t < NT; t++) {
                    const int16_t *xt = xa->qp + t * xa->qs + 32 * (s0 + b);
                    __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)xt));
                    p = _mm512_dpwssd_epi32(p, hi, _mm512_loadu_si512((const void *)(xt + 32)));
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                                _mm512_permutexvar_ps(pidx, _mm512_load_ps(sc[cur][r][t])), acc[r][t]);
                }
            }
        }
        if (b < n) { /* odd last block: natural order, also in xa->qp */
            for (int r = 0; r < R; r++) {
                const __m512i wv = unpack_one(KIND, w + r * rb + (s0 + b) * BYTES);
                for (int t = 0; t < NT; t++) {
                    const int16_t *xt = xa->qp + t * xa->qs + 32 * (s0 + b);
                    const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512((const void *)xt));
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(sc[cur][r][t][b]), acc[r][t]);
                }
            }
        }
    }
    const float cmul = HAS_MIN ? 1.0f : -8.0f;
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++)
            y[t * ys + r] = _mm512_reduce_add_ps(acc[r][t]) + (HAS_MIN || HAS_OFF ? cmul * _mm512_reduce_add_ps(cor[r][t]) : 0.0f);
}

/* ---------------------------------------------------------------- Q8_0: one block per step, natural order */
MR_INLINE void gemv_q8_0_impl(const uint8_t *w, int64_t rb, int64_t nb, const mr_xact *xa, float *y, int64_t ys,
                              const int NT, const int R) {
    __m512 acc[4][MR_NT_INT], cor[4][MR_NT_INT];
    float sc[2][4][MR_NT_INT][16] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    seg_scales(w, rb, 0, nb < 16 ? nb : 16, xa, NT, R, 34, 0, 0, 0, sc[0], cor);
    int cur = 0;
    for (int64_t s0 = 0; s0 < nb; s0 += 16, cur ^= 1) {
        const int64_t n = nb - s0 < 16 ? nb - s0 : 16;
        if (s0 + 16 < nb)
            seg_scales(w, rb, s0 + 16, nb - s0 - 16 < 16 ? nb - s0 - 16 : 16, xa, NT, R, 34, 0, 0, 0, sc[cur ^ 1], cor);
        for (int64_t b = 0; b < n; b++) {
            for (int r = 0; r < R; r++) {
                const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + r * rb + (s0 + b) * 34 + 2)));
                for (int t = 0; t < NT; t++) {
                    const int16_t *xt = xa->q + t * xa->qs + 32 * (s0 + b);
                    const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512((const void *)xt));
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(sc[cur][r][t][b]), acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) y[t * ys + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* ---------------------------------------------------------------- 256-element super-blocks */
enum { K_Q4_K, K_Q5_K, K_Q6_K, K_IQ4XS, K_Q3_K, K_Q2_K, K_TQ2_0 };

/* Q4_K / Q5_K 6-bit scales and mins of one super-block as floats (ggml get_scale_min_k4, on words) */
MR_INLINE void k4_scales(const uint8_t *b, __m256 *sc, __m256 *mn) {
    uint32_t u[3], s[2], m2[2];
    memcpy(u, b + 4, 12);
    s[0] = u[0] & 0x3f3f3f3fu;
    s[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
    m2[0] = u[1] & 0x3f3f3f3fu;
    m2[1] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
    *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s)));
    *mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m2)));
}

/* Q3_K's 16 6-bit per-16 scales (offset 32 not removed) as bytes, from the 12 packed bytes (ggml's
 * layout, as mr_q3k_scales: low nibbles of bytes 0..7, their high nibbles, then 2-bit pairs in 8..11),
 * four at a time in 32-bit words */
MR_INLINE __m128i q3k_scales(const uint8_t *s12) {
    const uint32_t a0 = mr_rd32(s12), a1 = mr_rd32(s12 + 4), a2 = mr_rd32(s12 + 8);
    const uint32_t k4 = 0x0f0f0f0fu, k2 = 0x03030303u;
    return _mm_setr_epi32((int)((a0 & k4) | ((a2 & k2) << 4)), (int)((a1 & k4) | (((a2 >> 2) & k2) << 4)),
                          (int)(((a0 >> 4) & k4) | (((a2 >> 4) & k2) << 4)),
                          (int)(((a1 >> 4) & k4) | (((a2 >> 6) & k2) << 4)));
}

/* S0[g] = d * scale[g] for the 16 groups of 16 elements of a super-block (Q2_K, TQ2_0: d in every lane, Q2_K's
 * codes carry their group scales, see gemv_q8_impl); C0[g] the weight of group g's sum of x in the correction
 * (Q6_K, Q3_K: S0, for the folded offset; Q2_K: dmin * min[g]; TQ2_0: none, its -1 goes through the integer
 * sums) */
MR_INLINE void per16_scales(const int KIND, const uint8_t *b, __m512 *S0, __m512 *C0) {
    if (KIND == K_Q6_K) {
        *S0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))),
                            _mm512_set1_ps(f16s(b + 208)));
        *C0 = *S0;
    } else if (KIND == K_Q3_K) {
        *S0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepi8_epi32(q3k_scales(b + 96)),
                                                                _mm512_set1_epi32(32))),
                            _mm512_set1_ps(f16s(b + 108)));
        *C0 = *S0;
    } else if (KIND == K_Q2_K) {
        const __m512i sm = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        *S0 = _mm512_set1_ps(f16s(b + 80));
        *C0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(sm, 4)), _mm512_set1_ps(f16s(b + 82)));
    } else { /* TQ2_0 */
        *S0 = _mm512_set1_ps(f16s(b + 64));
        *C0 = _mm512_setzero_ps();
    }
}

/* 8 sub-blocks of int16 weights (sub-block j = elements 32j..32j+31) */
MR_INLINE void sb_unpack(const int KIND, const uint8_t *b, __m512i wv[8]) {
    const __m512i m4 = _mm512_set1_epi16(15);
    if (KIND == K_Q4_K) {
        for (int c = 0; c < 4; c++) {
            const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c)));
            wv[2 * c] = _mm512_and_si512(w16, m4);
            wv[2 * c + 1] = _mm512_srli_epi16(w16, 4);
        }
    } else if (KIND == K_Q5_K) {
        const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)));
        const __m512i c16 = _mm512_set1_epi16(16);
        for (int c = 0; c < 4; c++) {
            const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 48 + 32 * c)));
            const __m512i lo = _mm512_and_si512(w16, m4), hi = _mm512_srli_epi16(w16, 4);
            const __mmask32 k0 = _mm512_test_epi16_mask(qh, _mm512_set1_epi16((short)(1 << (2 * c))));
            const __mmask32 k1 = _mm512_test_epi16_mask(qh, _mm512_set1_epi16((short)(1 << (2 * c + 1))));
            wv[2 * c] = _mm512_mask_add_epi16(lo, k0, lo, c16);
            wv[2 * c + 1] = _mm512_mask_add_epi16(hi, k1, hi, c16);
        }
    } else if (KIND == K_Q6_K) { /* unsigned 0..63; the -32 is folded out */
        const __m512i m30 = _mm512_set1_epi16(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i A = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h)));
            const __m512i B = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)));
            const __m512i Q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            /* ternary logic 0xF8: a | (b & c) */
            wv[4 * h + 0] = _mm512_ternarylogic_epi32(_mm512_and_si512(A, m4), _mm512_slli_epi16(Q, 4), m30, 0xF8);
            wv[4 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(B, m4), _mm512_slli_epi16(Q, 2), m30, 0xF8);
            wv[4 * h + 2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(A, 4), Q, m30, 0xF8);
            wv[4 * h + 3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(B, 4), _mm512_srli_epi16(Q, 2), m30, 0xF8);
        }
    } else { /* IQ4_XS */
        for (int j = 0; j < 8; j++) {
            const __m128i r = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * j));
            wv[j] = lut16(K_IQ4NL, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r, 4), r), _mm256_set1_epi8(15)));
        }
    }
}

MR_INLINE void gemv_sb_impl(const uint8_t *w, int64_t rb, int64_t nb32, const mr_xact *xa, float *y, int64_t ys,
                            const int NT, const int R, const int BYTES, const int KIND) {
    const int HAS_MIN = KIND == K_Q4_K || KIND == K_Q5_K;
    __m512 acc[4][MR_NT_INT][2], cor[4][MR_NT_INT];
    __m256 corm[4][MR_NT_INT];
    float sc[MR_NT_INT][16] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) {
            acc[r][t][0] = acc[r][t][1] = cor[r][t] = _mm512_setzero_ps();
            corm[r][t] = _mm256_setzero_ps();
        }
    /* dx per 32 spread over the per-16 groups: [d0, d0, d1, d1, ..., d7, d7] */
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const int64_t nsb = nb32 / 8;
    for (int64_t ib = 0; ib < nsb; ib++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *b = w + r * rb + ib * BYTES;
            __m512i wv[8];
            if (KIND == K_Q6_K) {
                __m512 S0, C0;
                per16_scales(KIND, b, &S0, &C0);
                for (int t = 0; t < NT; t++) {
                    const int64_t o = t * xa->bs + 8 * ib;
                    const __m512 dx = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(xa->d + o)));
                    _mm512_store_ps(sc[t], _mm512_mul_ps(S0, dx));
                    cor[r][t] = _mm512_fmadd_ps(C0, _mm512_loadu_ps(xa->sq16 + 2 * o), cor[r][t]);
                }
            } else {
                __m256 s8, m8;
                if (KIND == K_IQ4XS) {
                    const uint16_t sh = mr_rd16(b + 2);
                    float ls[8];
                    for (int j = 0; j < 8; j++)
                        ls[j] = (float)((((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32);
                    s8 = _mm256_mul_ps(_mm256_loadu_ps(ls), _mm256_set1_ps(f16s(b)));
                    m8 = _mm256_setzero_ps();
                } else {
                    k4_scales(b, &s8, &m8);
                    s8 = _mm256_mul_ps(s8, _mm256_set1_ps(f16s(b)));
                    m8 = _mm256_mul_ps(m8, _mm256_set1_ps(-f16s(b + 2)));
                }
                for (int t = 0; t < NT; t++) {
                    const int64_t o = t * xa->bs + 8 * ib;
                    _mm256_store_ps(sc[t], _mm256_mul_ps(s8, _mm256_loadu_ps(xa->d + o)));
                    if (HAS_MIN) corm[r][t] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xa->s + o), corm[r][t]);
                }
            }
            sb_unpack(KIND, b, wv);
            for (int t = 0; t < NT; t++) {
                const int16_t *xt = xa->q + t * xa->qs + 256 * ib;
                for (int j = 0; j < 8; j++) {
                    const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv[j],
                                                          _mm512_loadu_si512((const void *)(xt + 32 * j)));
                    const __m512 s = KIND == K_Q6_K ? _mm512_permutexvar_ps(PIDX(j), _mm512_load_ps(sc[t]))
                                                    : _mm512_set1_ps(sc[t][j]);
                    acc[r][t][j & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[r][t][j & 1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) {
            float v = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1]));
            if (KIND == K_Q6_K) v -= 32.0f * _mm512_reduce_add_ps(cor[r][t]); /* the folded offset */
            else if (HAS_MIN) v += hsum8(corm[r][t]);
            y[t * ys + r] = v;
        }
}

/* ---------------------------------------------------------------- int8 activations (MR_XL_Q8)
 * Q3_K, Q2_K, TQ2_0: the 64 code bytes of a super-block shifted by 2s hold, as unsigned bytes, the
 * elements of step s of mr_q8_order (Q3_K adds 4 where its hmask bit is set), so each step is one
 * vpdpbusd of 64 codes with 64 int8 activations; int32 lane k then sums 4 elements of group
 * qgrp_tab[s][k] and takes that group's float scale (Q3_K); Q2_K's codes are first multiplied by their
 * groups' 4-bit scales and TQ2_0 has one scale, so their four steps sum in one int32 lane. Q3_K's offset -4
 * and Q2_K's mins come out through the per-16 sums of the activations, as in the int16 kernels; TQ2_0's -1
 * through the block's integer activation sum.
 * Bounds: |x| <= 127 and byte weights <= 7 (Q3_K, one step) or <= 45 (Q2_K, four steps): |lane| <= 91440. */
static const int32_t qgrp_tab[4][16] __attribute__((aligned(64))) = {
    {0, 0, 0, 0, 1, 1, 1, 1, 8, 8, 8, 8, 9, 9, 9, 9},         {2, 2, 2, 2, 3, 3, 3, 3, 10, 10, 10, 10, 11, 11, 11, 11},
    {4, 4, 4, 4, 5, 5, 5, 5, 12, 12, 12, 12, 13, 13, 13, 13}, {6, 6, 6, 6, 7, 7, 7, 7, 14, 14, 14, 14, 15, 15, 15, 15},
};

/* Q2_K: vpshufb indices that put, in each 128-bit lane L of step s, the 4-bit scale of its group
 * (qgrp_tab[s][4L]) into the low byte of every 16-bit word (high bytes 0x80: zero) */
static const uint8_t q2k_sidx[4][64] __attribute__((aligned(64))) = {
#define Q2K_LANE(g) g, 0x80, g, 0x80, g, 0x80, g, 0x80, g, 0x80, g, 0x80, g, 0x80, g, 0x80
    {Q2K_LANE(0), Q2K_LANE(1), Q2K_LANE(8), Q2K_LANE(9)},
    {Q2K_LANE(2), Q2K_LANE(3), Q2K_LANE(10), Q2K_LANE(11)},
    {Q2K_LANE(4), Q2K_LANE(5), Q2K_LANE(12), Q2K_LANE(13)},
    {Q2K_LANE(6), Q2K_LANE(7), Q2K_LANE(14), Q2K_LANE(15)},
#undef Q2K_LANE
};

MR_INLINE void gemv_q8_impl(const uint8_t *w, int64_t rb, int64_t nb32, const mr_xact *xa, float *y, int64_t ys,
                            const int NT, const int R, const int BYTES, const int KIND) {
    const float off = KIND == K_Q3_K ? 4.0f : 1.0f;
    const int qo = KIND == K_Q3_K ? 32 : KIND == K_Q2_K ? 16 : 0;
    const int64_t nsb = nb32 / 8;
    __m512 acc[4][MR_NT_INT], cor[4][MR_NT_INT];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = cor[r][t] = _mm512_setzero_ps();
    const __m512i m3 = _mm512_set1_epi8(3), c4 = _mm512_set1_epi8(4);
    for (int64_t ib = 0; ib < nsb; ib++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *b = w + r * rb + ib * BYTES;
            __m512 S0, C0, Sv[4];
            per16_scales(KIND, b, &S0, &C0);
            const __m512i Q = _mm512_loadu_si512((const void *)(b + qo));
            const __m512i hm = KIND == K_Q3_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b)) : Q;
            /* Q2_K: the 4-bit scales as bytes in every 128-bit lane */
            const __m512i sc4 = KIND == K_Q2_K ? _mm512_and_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)b)),
                                                                  _mm512_set1_epi8(15))
                                               : Q;
            __m512i W[4];
            for (int s = 0; s < 4; s++) {
                if (KIND == K_Q3_K) Sv[s] = _mm512_permutexvar_ps(_mm512_load_si512((const void *)qgrp_tab[s]), S0);
                W[s] = _mm512_and_si512(_mm512_srli_epi16(Q, 2 * s), m3);
                /* Q2_K: each code times its group's scale (<= 3 * 15: the byte products cannot carry into the
                 * word's high byte), so the four steps sum in one int32 accumulator with the block's d only */
                if (KIND == K_Q2_K)
                    W[s] = _mm512_mullo_epi16(W[s], _mm512_shuffle_epi8(sc4, _mm512_load_si512((const void *)q2k_sidx[s])));
                if (KIND == K_Q3_K) { /* bytes 0..31: hmask bit s; 32..63: bit 4 + s */
                    const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << s)),
                                                           _mm256_set1_epi8((char)(1 << (4 + s))), 1);
                    W[s] = _mm512_mask_add_epi8(W[s], _mm512_test_epi8_mask(hm, bit), W[s], c4);
                }
            }
            for (int t = 0; t < NT; t++) {
                const int8_t *xt = xa->q8 + t * xa->qs + 256 * ib;
                if (KIND == K_TQ2_0 || KIND == K_Q2_K) {
                    /* one scale: the four steps sum in int32 (TQ2_0: from the offset -1 * (sum of the block's q8) in
                     * lane 0, the lanes are summed at the end), and the weight and activation scales multiply once */
                    __m512i p = KIND == K_TQ2_0 ? _mm512_maskz_set1_epi32(1, -xa->i8[t * (xa->bs / 8) + ib])
                                                : _mm512_setzero_si512();
                    for (int s = 0; s < 4; s++) p = _mm512_dpbusd_epi32(p, W[s], _mm512_loadu_si512((const void *)(xt + 64 * s)));
                    const __m512 sd = _mm512_mul_ps(S0, _mm512_set1_ps(xa->d8[t * (xa->bs / 8) + ib]));
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sd, acc[r][t]);
                } else {
                    __m512 a = _mm512_setzero_ps();
                    for (int s = 0; s < 4; s++) {
                        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[s],
                                                              _mm512_loadu_si512((const void *)(xt + 64 * s)));
                        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), Sv[s], a);
                    }
                    acc[r][t] = _mm512_fmadd_ps(a, _mm512_set1_ps(xa->d8[t * (xa->bs / 8) + ib]), acc[r][t]);
                }
                if (KIND != K_TQ2_0) /* offsets (Q3_K) and mins (Q2_K) */
                    cor[r][t] = _mm512_fmadd_ps(C0, _mm512_loadu_ps(xa->s8 + 2 * t * xa->bs + 16 * ib), cor[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++)
            y[t * ys + r] = _mm512_reduce_add_ps(acc[r][t]) - off * _mm512_reduce_add_ps(cor[r][t]);
}

/* The i-quants and TQ1_0 with int8 activations (MR_XL_Q8), as llama.cpp's q8_K kernels for them. Step s
 * of the activation layout is the 32-element groups s and s + 4 of a super-block: each type's block
 * decoder gives, per step, the 64 weights' magnitudes A[s] (unsigned bytes, group s in the low half),
 * their signs N[s] (bit j: weight j < 0) and the float scale of each 16-element group (S0, lane = group).
 * vpdpbusd multiplies unsigned by signed bytes, so it gets A[s] and x negated where N[s] is set (|x| <=
 * 127: exact); int32 lane k then sums 4 elements of 16-group qgrp_tab[s][k] and takes that group's scale.
 * The decoders use a gather of 8 grid entries per step and vector sign / scale arithmetic (the AVX2
 * row kernels' per-group decoders, scalar table lookups and a sign-apply per group, were unpack-bound
 * here: 0.4-0.7x llama.cpp).
 * Bounds: |w| <= 63, |x| <= 127: |lane| <= 4 * 63 * 127, no overflow. */

/* 8 grid entries (uint64) by 8 indices (int64 lanes) */
MR_INLINE __m512i grid_gather8(const uint64_t *grid, __m512i idx) {
    return _mm512_i64gather_epi64(idx, (const void *)grid, 8);
}
/* bytes p[0..3] and q[0..3] as 8 int64 lanes (the grid indices' low bits of groups s and s + 4) */
MR_INLINE __m512i idx_bytes8(const uint8_t *p, const uint8_t *q) {
    return _mm512_cvtepu8_epi64(_mm_setr_epi32((int)mr_rd32(p), (int)mr_rd32(q), 0, 0));
}
/* 2 words of each half -> their 16-group's scale: lanes 2g, 2g + 1 = nibbles of byte g of p8 */
MR_INLINE __m512i nib_scales16(const uint8_t *p8) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p8);
    const __m512i w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v, v));
    return _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0)),
                            _mm512_set1_epi32(15));
}
/* (2 v + 1) * f per lane */
MR_INLINE __m512 odd_scales(__m512i v, float f) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(v, v), _mm512_set1_epi32(1))),
                         _mm512_set1_ps(f));
}
/* bytes with the parity of their low 7 bits in bit 7 (the i-quants' sign bytes, ggml ksigns) */
MR_INLINE __m512i ksign_bytes(__m512i f) {
    __m512i p = _mm512_xor_si512(f, _mm512_srli_epi32(f, 4));
    p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 2));
    p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 1));
    return _mm512_or_si512(f, _mm512_slli_epi32(_mm512_and_si512(p, _mm512_set1_epi8(1)), 7));
}

/* TQ1_0's base-3 digit rows per step (as x86_avx2.c's g8_tq1_0, two groups per register): the
 * multiplier 3^n of each 16-bit lane; low half = group s (digit s of qs[0..32)), high half = group s + 4 */
static const int16_t tq1_pow[4][32] __attribute__((aligned(64))) = {
    {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81},
    {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3},
    {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 27, 27, 27, 27, 27, 27, 27, 27},
    {27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 27, 81, 81, 81, 81, 81, 81, 81, 81, 1, 1, 3, 3, 9, 9, 27, 27},
};
/* the n-th base-3 digit of each byte q: ((uint8_t)(q * 3^n) * 3) >> 8, 3^n per 16-bit lane of p */
MR_INLINE __m512i tq1_digits512(__m512i q, __m512i p) {
    const __m512i ev = _mm512_mullo_epi16(_mm512_and_si512(q, _mm512_set1_epi16(0x00FF)), p);
    const __m512i od = _mm512_mullo_epi16(_mm512_and_si512(q, _mm512_set1_epi16((short)0xFF00)), p);
    const __m512i de = _mm512_mulhi_epu16(_mm512_slli_epi16(ev, 8), _mm512_set1_epi16(3));
    const __m512i dod = _mm512_mulhi_epu16(od, _mm512_set1_epi16(3));
    return _mm512_or_si512(de, _mm512_slli_epi16(dod, 8));
}

/* Types whose decoders give unsigned weights w + o (TQ1_0's digits, IQ1_S's grid + 1, IQ1_M's w + 9) instead
 * of signs: the offset comes out through the activations' per-16 sums, with the weight C0 per 16-group. */
#define LB8_OFFSET(TYPE) ((TYPE) == GT_TQ1_0 || (TYPE) == GT_IQ1_S || (TYPE) == GT_IQ1_M)

MR_INLINE void lb8_block(const int TYPE, const uint8_t *b, __m512i A[4], __mmask64 N[4], __m512 *S0, __m512 *C0) {
    if (TYPE == GT_IQ2_XXS || TYPE == GT_IQ3_XXS) {
        /* IQ2_XXS: d | 8 x (4 index bytes, aux u32); IQ3_XXS: d | 64 index bytes | 8 aux u32. aux: 4 x 7
         * sign bits, scale in bits 28..31 */
        const float d = f16s(b);
        const __m256i aux = TYPE == GT_IQ2_XXS
                                ? _mm512_cvtepi64_epi32(_mm512_srli_epi64(_mm512_loadu_si512((const void *)(b + 2)), 32))
                                : _mm256_loadu_si256((const __m256i *)(b + 66));
        const __m512i a = _mm512_zextsi256_si512(aux);
        const __m512i m7 = _mm512_set1_epi32(0x7F);
        const __m512i f = _mm512_or_si512(
            _mm512_or_si512(_mm512_and_si512(a, m7), _mm512_and_si512(_mm512_slli_epi32(a, 1), _mm512_slli_epi32(m7, 8))),
            _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(a, 2), _mm512_slli_epi32(m7, 16)),
                            _mm512_and_si512(_mm512_slli_epi32(a, 3), _mm512_slli_epi32(m7, 24))));
        uint32_t sg[16] __attribute__((aligned(64)));
        _mm512_store_si512((void *)sg, ksign_bytes(f));
        const __m512i sc = _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                                    _mm512_srli_epi32(a, 28));
        *S0 = odd_scales(sc, TYPE == GT_IQ2_XXS ? d * 0.125f : d * 0.25f);
        for (int s = 0; s < 4; s++) {
            N[s] = (__mmask64)sg[s] | (__mmask64)sg[s + 4] << 32;
            if (TYPE == GT_IQ2_XXS) {
                A[s] = grid_gather8(mr_iq2xxs_grid, idx_bytes8(b + 2 + 8 * s, b + 2 + 8 * (s + 4)));
            } else { /* 4-byte entries: 16 indices per step */
                const __m512i ix = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)mr_rd64(b + 2 + 8 * (s + 4)), (long long)mr_rd64(b + 2 + 8 * s)));
                A[s] = _mm512_i32gather_epi32(ix, (const void *)mr_iq3xxs_grid, 4);
            }
        }
    } else if (TYPE == GT_IQ2_XS) { /* d | 32 x u16 (9-bit index, 7 sign bits) | 8 scale bytes */
        const float d = f16s(b);
        const __m512i q = _mm512_loadu_si512((const void *)(b + 2));
        const __m512i f = _mm512_srli_epi16(q, 9);
        uint8_t sg[32];
        _mm256_storeu_si256((__m256i *)sg, _mm512_cvtepi16_epi8(ksign_bytes(f))); /* parity stays inside a word's low byte */
        uint16_t ix[32];
        _mm512_storeu_si512((void *)ix, _mm512_and_si512(q, _mm512_set1_epi16(511)));
        *S0 = odd_scales(nib_scales16(b + 66), d * 0.125f);
        for (int s = 0; s < 4; s++) {
            N[s] = (__mmask64)mr_rd32(sg + 4 * s) | (__mmask64)mr_rd32(sg + 4 * (s + 4)) << 32;
            const __m512i idx = _mm512_cvtepu16_epi64(_mm_set_epi64x((long long)mr_rd64((const uint8_t *)(ix + 4 * s + 16)), (long long)mr_rd64((const uint8_t *)(ix + 4 * s))));
            A[s] = grid_gather8(mr_iq2xs_grid, idx);
        }
    } else if (TYPE == GT_IQ2_S || TYPE == GT_IQ3_S) {
        /* IQ2_S: d | qs[32] | signs[32] @34 | qh[8] @66 (2 high index bits each) | scales[8] @74;
         * IQ3_S: d | qs[64] | qh[8] @66 (1 high bit each) | signs[32] @74 | scales[4] @106 (per 32) */
        const float d = f16s(b);
        if (TYPE == GT_IQ2_S) {
            *S0 = odd_scales(nib_scales16(b + 74), d * 0.125f);
        } else {
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_setr_epi32((int)mr_rd32(b + 106), 0, 0, 0));
            const __m512i v = _mm512_permutexvar_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), sc);
            const __m512i n = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set_epi32(4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0)),
                                               _mm512_set1_epi32(15));
            *S0 = odd_scales(n, d);
        }
        const uint8_t *sgn = b + (TYPE == GT_IQ2_S ? 34 : 74);
        for (int s = 0; s < 4; s++) {
            N[s] = (__mmask64)mr_rd32(sgn + 4 * s) | (__mmask64)mr_rd32(sgn + 4 * (s + 4)) << 32;
            if (TYPE == GT_IQ2_S) {
                const __m512i h = _mm512_inserti64x4(_mm512_set1_epi64(b[66 + s]), _mm256_set1_epi64x(b[70 + s]), 1);
                const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(h, _mm512_set_epi64(6, 4, 2, 0, 6, 4, 2, 0)),
                                                    _mm512_set1_epi64(3));
                A[s] = grid_gather8(mr_iq2s_grid, _mm512_or_si512(idx_bytes8(b + 2 + 4 * s, b + 18 + 4 * s),
                                                                  _mm512_slli_epi64(hi, 8)));
            } else { /* 16 4-byte entries: index e of group g = qs[8g + e] | bit e of qh[g] */
                const __m512i lo = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)mr_rd64(b + 2 + 8 * (s + 4)), (long long)mr_rd64(b + 2 + 8 * s)));
                const __m512i h = _mm512_inserti64x4(_mm512_set1_epi32(b[66 + s]), _mm256_set1_epi32(b[70 + s]), 1);
                const __m512i hi = _mm512_and_si512(
                    _mm512_srlv_epi32(h, _mm512_set_epi32(7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4, 3, 2, 1, 0)), _mm512_set1_epi32(1));
                A[s] = _mm512_i32gather_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 8)), (const void *)mr_iq3s_grid, 4);
            }
        }
    } else if (TYPE == GT_IQ1_S || TYPE == GT_IQ1_M) {
        /* IQ1_S: d | qs[32] @2 | qh u16[8] @34 (3 high bits per index, scale, delta sign per group);
         * IQ1_M: qs[32] @0 | qh[16] @32 (a nibble per index: 3 high bits, delta sign) | scales @48.
         * w = 8 grid + delta (grid bytes -1, 0, 1; delta +-1). IQ1_S, one delta per group: A = grid + 1,
         * the dot scaled by 8 and (delta - 8) per group through the sums; IQ1_M, a delta per 8: A = w + 9 =
         * 8 (grid + 1) + (delta + 1) in 0..18, the 9 through the sums (no sign masks, no negated x) */
        const uint8_t *qs = b + (TYPE == GT_IQ1_S ? 2 : 0);
        if (TYPE == GT_IQ1_S) {
            const __m512i h = _mm512_cvtepu16_epi32(_mm256_permutexvar_epi16(
                _mm256_set_epi16(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + 34)))));
            const float d = f16s(b);
            const __m512 sc = odd_scales(_mm512_and_si512(_mm512_srli_epi32(h, 12), _mm512_set1_epi32(7)), d * 0.125f);
            *S0 = _mm512_mul_ps(sc, _mm512_set1_ps(8.0f));
            /* 8 - delta: 9 where the group's sign bit (15) is set, else 7 */
            *C0 = _mm512_mul_ps(sc, _mm512_mask_blend_ps(_mm512_test_epi32_mask(h, _mm512_set1_epi32(0x8000)),
                                                         _mm512_set1_ps(7.0f), _mm512_set1_ps(9.0f)));
        } else {
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_permutexvar_epi16(
                _mm256_set_epi16(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(b + 48)))));
            const __m512i v = _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_set_epi32(9, 6, 3, 0, 9, 6, 3, 0, 9, 6, 3, 0, 9, 6, 3, 0)),
                                               _mm512_set1_epi32(7));
            *S0 = odd_scales(v, mr_iq1m_d(b) * 0.125f);
            *C0 = _mm512_mul_ps(*S0, _mm512_set1_ps(9.0f));
        }
        const __m512i one = _mm512_set1_epi8(1);
        for (int s = 0; s < 4; s++) {
            __m512i hi, neg; /* per index (int64 lane): 3 high index bits; IQ1_M's delta sign (bit 3 set: -1) */
            if (TYPE == GT_IQ1_S) {
                const __m512i h = _mm512_inserti64x4(_mm512_set1_epi64(mr_rd16(b + 34 + 2 * s)),
                                                     _mm256_set1_epi64x(mr_rd16(b + 42 + 2 * s)), 1);
                hi = _mm512_and_si512(_mm512_srlv_epi64(h, _mm512_set_epi64(9, 6, 3, 0, 9, 6, 3, 0)), _mm512_set1_epi64(7));
                neg = hi; /* not read */
            } else {
                const __m512i h = _mm512_inserti64x4(_mm512_set1_epi64(mr_rd16(b + 32 + 2 * s)),
                                                     _mm256_set1_epi64x(mr_rd16(b + 40 + 2 * s)), 1);
                neg = _mm512_srlv_epi64(h, _mm512_set_epi64(12, 8, 4, 0, 12, 8, 4, 0));
                hi = _mm512_and_si512(neg, _mm512_set1_epi64(7));
            }
            const __m512i g = grid_gather8(mr_iq1s_grid, _mm512_or_si512(idx_bytes8(qs + 4 * s, qs + 16 + 4 * s),
                                                                         _mm512_slli_epi64(hi, 8)));
            if (TYPE == GT_IQ1_S) {
                A[s] = _mm512_add_epi8(g, one);
                N[s] = 0;
                continue;
            }
            /* delta + 1: 0 where the index's delta bit (3) is set (delta -1), else 2; (grid + 1) * 8 <= 16 stays
             * inside its byte under the 16-bit shift */
            const __mmask8 kn = _mm512_test_epi64_mask(neg, _mm512_set1_epi64(8));
            const __m512i d1 = _mm512_mask_blend_epi64(kn, _mm512_set1_epi8(2), _mm512_setzero_si512());
            A[s] = _mm512_add_epi8(_mm512_slli_epi16(_mm512_add_epi8(g, one), 3), d1);
            N[s] = 0;
        }
    } else if (TYPE == GT_TQ1_0) { /* qs[48] | qh[4] @48 | d @52: digits 0..2, the offset -1 through the sums */
        const __m256i X = _mm256_loadu_si256((const __m256i *)b);
        const __m128i y = _mm_loadu_si128((const __m128i *)(b + 32));
        const __m256i Y = _mm256_set_m128i(y, y), Z = _mm256_set_m128i(_mm_set1_epi32((int)mr_rd32(b + 48)), y);
        *S0 = *C0 = _mm512_set1_ps(f16s(b + 52));
        for (int s = 0; s < 4; s++) {
            const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(X), s == 0 ? X : s == 3 ? Z : Y, 1);
            A[s] = tq1_digits512(q, _mm512_load_si512((const void *)tq1_pow[s]));
            N[s] = 0;
        }
    }
}

MR_INLINE void gemv_lb8_impl(const uint8_t *w, int64_t rb, int64_t nb32, const mr_xact *xa, float *y, int64_t ys,
                             const int NT, const int R, const int BYTES, const int TYPE) {
    const int64_t nsb = nb32 / 8;
    __m512 acc[4][MR_NT_INT], cor[4][MR_NT_INT];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = cor[r][t] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t ib = 0; ib < nsb; ib++) {
        for (int r = 0; r < R; r++) {
            __m512i A[4];
            __mmask64 N[4];
            __m512 S0, C0 = _mm512_setzero_ps(), Sv[4];
            lb8_block(TYPE, w + r * rb + ib * BYTES, A, N, &S0, &C0);
            for (int s = 0; s < 4; s++) Sv[s] = _mm512_permutexvar_ps(_mm512_load_si512((const void *)qgrp_tab[s]), S0);
            for (int t = 0; t < NT; t++) {
                const int8_t *xt = xa->q8 + t * xa->qs + 256 * ib;
                __m512 a = _mm512_setzero_ps();
                for (int s = 0; s < 4; s++) {
                    __m512i xv = _mm512_loadu_si512((const void *)(xt + 64 * s));
                    if (!LB8_OFFSET(TYPE)) xv = _mm512_mask_sub_epi8(xv, N[s], zero, xv);
                    const __m512i p = _mm512_dpbusd_epi32(zero, A[s], xv);
                    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), Sv[s], a);
                }
                acc[r][t] = _mm512_fmadd_ps(a, _mm512_set1_ps(xa->d8[t * (xa->bs / 8) + ib]), acc[r][t]);
                if (LB8_OFFSET(TYPE))
                    cor[r][t] = _mm512_fmadd_ps(C0, _mm512_loadu_ps(xa->s8 + 2 * t * xa->bs + 16 * ib), cor[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) y[t * ys + r] = _mm512_reduce_add_ps(acc[r][t]) - _mm512_reduce_add_ps(cor[r][t]);
}

/* ---------------------------------------------------------------- packed layout (pack.c): 4 rows x 128 columns per tile */
enum { P_Q4_0, P_Q5_0, P_Q8_0 };

/* ridx[r] spreads the 4 block scales of row r (elements 4r..4r+3 of a tile's 16) over 4 lanes each */
static const int32_t ridx_tab[4][16] __attribute__((aligned(64))) = {
    {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},         {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
    {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11}, {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15},
};

/* the 4 int16 weight vectors of row r of a tile (vector k holds elements E(k, j), see pack.c) */
MR_INLINE void p_unpack(const int KIND, const uint8_t *tw, int r, __m512i v[4]) {
    if (KIND == P_Q8_0) {
        const uint8_t *q = tw + 32 + 128 * r;
        for (int k = 0; k < 4; k++) v[k] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * k)));
        return;
    }
    pk_nib(tw + (KIND == P_Q5_0 ? 96 : 32) + 64 * r, v);
    if (KIND == P_Q5_0) {
        const uint8_t *mk = tw + 32 + 16 * r;
        const __m512i c16 = _mm512_set1_epi16(16);
        for (int k = 0; k < 4; k++) v[k] = _mm512_mask_sub_epi16(v[k], _load_mask32((__mmask32 *)(mk + 4 * k)), v[k], c16);
    } else {
        const __m512i c8 = _mm512_set1_epi16(8);
        for (int k = 0; k < 4; k++) v[k] = _mm512_sub_epi16(v[k], c8);
    }
}

/* one row group (4 rows) x NT tokens (starting at token t0) over ntiles tiles -> y[t*ys + r] */
MR_INLINE void pg_group(const int KIND, const int TB, const uint8_t *gw, int64_t ntiles, const mr_xact *xa, int t0,
                        const int NT, float *y, int64_t ys) {
    __m512 acc[4][MR_NT_INT];
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < ntiles; i++) {
        const uint8_t *tw = gw + i * TB;
        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tw));
        __m512 S[MR_NT_INT];
        for (int t = 0; t < NT; t++)
            S[t] = _mm512_mul_ps(sw, _mm512_broadcast_f32x4(_mm_loadu_ps(xa->d + (t0 + t) * xa->bs + 4 * i)));
        for (int r = 0; r < 4; r++) {
            __m512i v[4];
            p_unpack(KIND, tw, r, v);
            const __m512i ri = _mm512_load_si512((const void *)ridx_tab[r]);
            for (int t = 0; t < NT; t++) {
                const int16_t *xt = xa->q + (t0 + t) * xa->qs + 128 * i;
                __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), v[0], _mm512_loadu_si512((const void *)xt));
                p = _mm512_dpwssd_epi32(p, v[1], _mm512_loadu_si512((const void *)(xt + 32)));
                p = _mm512_dpwssd_epi32(p, v[2], _mm512_loadu_si512((const void *)(xt + 64)));
                p = _mm512_dpwssd_epi32(p, v[3], _mm512_loadu_si512((const void *)(xt + 96)));
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(ri, S[t]), acc[r][t]);
            }
        }
    }
    for (int t = 0; t < NT; t++) _mm_storeu_ps(y + t * ys, reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
}

/* one tile -> floats in packed column order: out[r * os + 32k + j] */
MR_INLINE void pdq_impl(const int KIND, const uint8_t *tw, float *out, int64_t os) {
    const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tw));
    for (int r = 0; r < 4; r++) {
        __m512i v[4];
        p_unpack(KIND, tw, r, v);
        /* int16 lanes 0..15 belong to blocks 0, 1 and lanes 16..31 to blocks 2, 3 (8 each) */
        const __m512 slo = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * r), PIDX(0)), sw);
        const __m512 shi = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * r), PIDX(1)), sw);
        for (int k = 0; k < 4; k++) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v[k])));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v[k], 1)));
            _mm512_storeu_ps(out + r * os + 32 * k, _mm512_mul_ps(lo, slo));
            _mm512_storeu_ps(out + r * os + 32 * k + 16, _mm512_mul_ps(hi, shi));
        }
    }
}
static void pdq_q4_0(const uint8_t *tw, float *out, int64_t os) { pdq_impl(P_Q4_0, tw, out, os); }
static void pdq_q5_0(const uint8_t *tw, float *out, int64_t os) { pdq_impl(P_Q5_0, tw, out, os); }
static void pdq_q8_0(const uint8_t *tw, float *out, int64_t os) { pdq_impl(P_Q8_0, tw, out, os); }

/* ---------------------------------------------------------------- packed k-quants: 4 rows x 256 columns per tile */
enum { P_Q4_K = 16, P_Q6_K }; /* distinct from the P_Q4_0.. kinds: p_group tells them apart */

/* quad Q of row r of a packed k-quant tile -> 4 int16 vectors (Q6_K: unsigned 0..63, the -32 is folded out) */
MR_INLINE void pk_unpack(const int KIND, const uint8_t *tw, int r, int Q, __m512i v[4]) {
    if (KIND == P_Q4_K) {
        pk_nib(tw + 80 + 128 * r + 64 * Q, v);
        return;
    }
    pk_q6k_quad(tw, r, Q, v);
}

/* per-row scales of a k-quant tile: Q4_K s8 = d * scale_j, m8 = -dmin * min_j (8 sub-blocks);
 * Q6_K S16 = d * scale_g (16 groups of 16) */
MR_INLINE void pk_scales_q4k(const uint8_t *tw, int r, __m256 *s8, __m256 *m8) {
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tw + 16 + 16 * r))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tw + 24 + 16 * r))));
    *s8 = _mm256_mul_ps(sc, _mm256_set1_ps(f16s(tw + 2 * r)));
    *m8 = _mm256_mul_ps(mn, _mm256_set1_ps(-f16s(tw + 8 + 2 * r)));
}
MR_INLINE __m512 pk_scales_q6k(const uint8_t *tw, int r) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(tw + 8 + 16 * r)))),
                         _mm512_set1_ps(f16s(tw + 2 * r)));
}

MR_INLINE void pgk_group(const int KIND, const int TB, const uint8_t *gw, int64_t ntiles, const mr_xact *xa, int t0,
                         const int NT, float *y, int64_t ys) {
    __m512 acc[4][MR_NT_INT], cor[4][MR_NT_INT];
    __m256 corm[4][MR_NT_INT];
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < NT; t++) {
            acc[r][t] = cor[r][t] = _mm512_setzero_ps();
            corm[r][t] = _mm256_setzero_ps();
        }
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i dup8 = _mm512_add_epi32(dup, _mm512_set1_epi32(8));
    for (int64_t i = 0; i < ntiles; i++) {
        const uint8_t *tw = gw + i * TB;
        for (int r = 0; r < 4; r++) {
            __m512 Sq[2][MR_NT_INT];
            if (KIND == P_Q4_K) {
                __m256 s8, m8;
                pk_scales_q4k(tw, r, &s8, &m8);
                for (int t = 0; t < NT; t++) {
                    const int64_t o = (t0 + t) * xa->bs + 8 * i;
                    const __m512 S = _mm512_castps256_ps512(_mm256_mul_ps(s8, _mm256_loadu_ps(xa->d + o)));
                    Sq[0][t] = _mm512_permutexvar_ps(_mm512_load_si512((const void *)ridx_tab[0]), S);
                    Sq[1][t] = _mm512_permutexvar_ps(_mm512_load_si512((const void *)ridx_tab[1]), S);
                    corm[r][t] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xa->s + o), corm[r][t]);
                }
            } else {
                const __m512 S0 = pk_scales_q6k(tw, r);
                for (int t = 0; t < NT; t++) {
                    const int64_t o = (t0 + t) * xa->bs + 8 * i;
                    const __m512 dx = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(xa->d + o)));
                    const __m512 S = _mm512_mul_ps(S0, dx);
                    Sq[0][t] = _mm512_permutexvar_ps(dup, S);
                    Sq[1][t] = _mm512_permutexvar_ps(dup8, S);
                    cor[r][t] = _mm512_fmadd_ps(S0, _mm512_loadu_ps(xa->sq16 + 2 * o), cor[r][t]);
                }
            }
            for (int Q = 0; Q < 2; Q++) {
                __m512i v[4];
                pk_unpack(KIND, tw, r, Q, v);
                for (int t = 0; t < NT; t++) {
                    const int16_t *xt = xa->q + (t0 + t) * xa->qs + 256 * i + 128 * Q;
                    __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), v[0], _mm512_loadu_si512((const void *)xt));
                    p = _mm512_dpwssd_epi32(p, v[1], _mm512_loadu_si512((const void *)(xt + 32)));
                    p = _mm512_dpwssd_epi32(p, v[2], _mm512_loadu_si512((const void *)(xt + 64)));
                    p = _mm512_dpwssd_epi32(p, v[3], _mm512_loadu_si512((const void *)(xt + 96)));
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), Sq[Q][t], acc[r][t]);
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) {
        __m128 v = reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]);
        if (KIND == P_Q4_K) {
            v = _mm_add_ps(v, _mm_setr_ps(hsum8(corm[0][t]), hsum8(corm[1][t]), hsum8(corm[2][t]), hsum8(corm[3][t])));
        } else {
            v = _mm_sub_ps(v, _mm_mul_ps(_mm_set1_ps(32.0f), reduce4(cor[0][t], cor[1][t], cor[2][t], cor[3][t])));
        }
        _mm_storeu_ps(y + t * ys, v);
    }
}

/* ---------------------------------------------------------------- packed, 5..16 tokens
 * One pass over a row group for up to MR_PACKED_INT_MAX tokens (the 1..4-token kernels above, taking
 * 4 at a time, unpacked every weight 4 times for 16 tokens and loaded every activation vector once
 * per row). Per 128-column quad the 4 rows' weights are unpacked once into 16 registers, then each
 * token's 4 activation vectors are loaded once and serve the 4 rows; the accumulators acc[r][t] (too
 * many for registers) live in a small L1 buffer: their load and store go to the load/store ports,
 * which this loop barely uses otherwise, while the vector units stay the bottleneck: 7 of their
 * uops per (row, token, quad) (4 dot products, conversion, scale product, FMA) plus the unpacking
 * once per (row, quad), against about 10 before (measured: 1.2-1.5x faster at 16 tokens).
 *
 * The combined per-lane scale of (row r, token t, quad) is split as row part x token part, each
 * permuted once (per row and quad / per token and quad) instead of once per (row, token): for every
 * kind, lane l of a quad covers activation block 4q + l / 4 (q: quad index in the row), and its
 * product with the weight scale of that lane is the same float product as in the kernels above,
 * which accumulate in the same order: the results are bit-identical to the 1..4-token kernels. */

/* The row part of the scales of tile tw, row r: pg: the tile's 16 block scales d (row r: lanes
 * 4r..4r+3); Q4_K: d * scale of the 8 sub-blocks (lanes 0..7; *m8 = -dmin * min); Q6_K: d * scale
 * of the 16 groups. pw_ridx(KIND, r, Q) spreads it over the lanes of quad Q. */
MR_INLINE __m512 pw_row_scales(const int KIND, const uint8_t *tw, int r, __m256 *m8) {
    if (KIND == P_Q4_K) {
        __m256 s8;
        pk_scales_q4k(tw, r, &s8, m8);
        return _mm512_castps256_ps512(s8);
    }
    *m8 = _mm256_setzero_ps();
    if (KIND == P_Q6_K) return pk_scales_q6k(tw, r);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)tw));
}
MR_INLINE __m512i pw_ridx(const int KIND, int r, int Q) {
    if (KIND == P_Q6_K) /* groups 8Q..8Q+7, 2 lanes each */
        return _mm512_add_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_set1_epi32(8 * Q));
    return _mm512_load_si512((const void *)ridx_tab[KIND == P_Q4_K ? Q : r]);
}

/* one row group (4 rows, ntiles tiles of TB bytes, NQ quads each) x nt (<= MR_PACKED_INT_MAX) tokens
 * starting at token t0 -> y[t*ys + r] */
MR_INLINE void pw_group(const int KIND, const int TB, const uint8_t *gw, int64_t ntiles, const mr_xact *xa, int t0,
                        int nt, float *y, int64_t ys) {
    const int NQ = KIND == P_Q4_K || KIND == P_Q6_K ? 2 : 1, KQ = NQ == 2;
    float acc[4][MR_PACKED_INT_MAX][16] __attribute__((aligned(64)));
    float cor[4][MR_PACKED_INT_MAX][16] __attribute__((aligned(64))); /* k-quants: min / offset sums */
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < nt; t++) {
            _mm512_store_ps(acc[r][t], _mm512_setzero_ps());
            if (KQ) _mm512_store_ps(cor[r][t], _mm512_setzero_ps());
        }
    const __m512i ri0 = _mm512_load_si512((const void *)ridx_tab[0]);
    for (int64_t i = 0; i < ntiles; i++) {
        const uint8_t *tw = gw + i * TB;
        __m512 rsc[4];
        __m256 m8[4];
        for (int r = 0; r < 4; r++) rsc[r] = pw_row_scales(KIND, tw, r, &m8[r]);
        for (int Q = 0; Q < NQ; Q++) {
            const int64_t q = NQ * i + Q;
            __m512 rs[4];
            __m512i v[4][4];
            for (int r = 0; r < 4; r++) {
                rs[r] = _mm512_permutexvar_ps(pw_ridx(KIND, r, Q), rsc[r]);
                if (KQ) pk_unpack(KIND, tw, r, Q, v[r]);
                else p_unpack(KIND, tw, r, v[r]);
            }
            for (int t = 0; t < nt; t++) {
                const int16_t *xt = xa->q + (t0 + t) * xa->qs + 128 * q;
                const __m512i x0 = _mm512_loadu_si512((const void *)xt), x1 = _mm512_loadu_si512((const void *)(xt + 32));
                const __m512i x2 = _mm512_loadu_si512((const void *)(xt + 64)), x3 = _mm512_loadu_si512((const void *)(xt + 96));
                /* lane l: activation scale of block 4q + l / 4 */
                const __m512 ts = _mm512_permutexvar_ps(ri0, _mm512_castps128_ps512(_mm_loadu_ps(xa->d + (t0 + t) * xa->bs + 4 * q)));
                for (int r = 0; r < 4; r++) {
                    /* vpmaddwd = vpdpwssd into zero (both wrap), without a zeroed register to copy */
                    __m512i p = _mm512_madd_epi16(v[r][0], x0);
                    p = _mm512_dpwssd_epi32(p, v[r][1], x1);
                    p = _mm512_dpwssd_epi32(p, v[r][2], x2);
                    p = _mm512_dpwssd_epi32(p, v[r][3], x3);
                    _mm512_store_ps(acc[r][t], _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(rs[r], ts),
                                                               _mm512_load_ps(acc[r][t])));
                }
            }
        }
        if (KIND == P_Q4_K) {
            for (int r = 0; r < 4; r++)
                for (int t = 0; t < nt; t++)
                    _mm256_store_ps(cor[r][t], _mm256_fmadd_ps(m8[r], _mm256_loadu_ps(xa->s + (t0 + t) * xa->bs + 8 * i),
                                                               _mm256_load_ps(cor[r][t])));
        } else if (KIND == P_Q6_K) {
            for (int r = 0; r < 4; r++)
                for (int t = 0; t < nt; t++)
                    _mm512_store_ps(cor[r][t], _mm512_fmadd_ps(rsc[r], _mm512_loadu_ps(xa->sq16 + 2 * ((t0 + t) * xa->bs + 8 * i)),
                                                               _mm512_load_ps(cor[r][t])));
        }
    }
    for (int t = 0; t < nt; t++) {
        __m128 s = reduce4(_mm512_load_ps(acc[0][t]), _mm512_load_ps(acc[1][t]), _mm512_load_ps(acc[2][t]),
                           _mm512_load_ps(acc[3][t]));
        if (KIND == P_Q4_K)
            s = _mm_add_ps(s, _mm_setr_ps(hsum8(_mm256_load_ps(cor[0][t])), hsum8(_mm256_load_ps(cor[1][t])),
                                          hsum8(_mm256_load_ps(cor[2][t])), hsum8(_mm256_load_ps(cor[3][t]))));
        else if (KIND == P_Q6_K)
            s = _mm_sub_ps(s, _mm_mul_ps(_mm_set1_ps(32.0f), reduce4(_mm512_load_ps(cor[0][t]), _mm512_load_ps(cor[1][t]),
                                                                     _mm512_load_ps(cor[2][t]), _mm512_load_ps(cor[3][t]))));
        _mm_storeu_ps(y + t * ys, s);
    }
}

/* One 4-row group of any packed type: the k-quant kinds have their own group kernel (KIND is a
 * compile-time constant in every caller, so the branch folds away). */
MR_INLINE void p_group(const int KIND, const int TB, const uint8_t *gw, int64_t ntiles, const mr_xact *xa, int t0,
                       const int NT, float *y, int64_t ys) {
    if (KIND == P_Q4_K || KIND == P_Q6_K)
        pgk_group(KIND, TB, gw, ntiles, xa, t0, NT, y, ys);
    else
        pg_group(KIND, TB, gw, ntiles, xa, t0, NT, y, ys);
}

MR_INLINE void pgemv_impl(const uint8_t *wp, int64_t ngroups, int64_t ntiles, const mr_xact *xa, int nt, float *y,
                          int64_t ys, const int KIND, const int TB) {
    const int64_t gb = ntiles * TB, end = ngroups * gb, pf = mr_pf_dist;
    if (pf > 0) pf_range(wp, 0, pf, end);
    for (int64_t g = 0; g < ngroups; g++) {
        const uint8_t *gw = wp + g * gb;
        if (pf > 0) pf_range(wp, g * gb + pf, (g + 1) * gb + pf, end);
        if (nt > MR_NT_INT) {
            for (int t0 = 0; t0 < nt; t0 += MR_PACKED_INT_MAX)
                pw_group(KIND, TB, gw, ntiles, xa, t0, nt - t0 < MR_PACKED_INT_MAX ? nt - t0 : MR_PACKED_INT_MAX,
                         y + t0 * ys + 4 * g, ys);
            continue;
        }
        for (int t0 = 0; t0 < nt; t0 += MR_NT_INT) {
            float *yg = y + t0 * ys + 4 * g;
            switch (nt - t0) {
            case 1: p_group(KIND, TB, gw, ntiles, xa, t0, 1, yg, ys); break;
            case 2: p_group(KIND, TB, gw, ntiles, xa, t0, 2, yg, ys); break;
            case 3: p_group(KIND, TB, gw, ntiles, xa, t0, 3, yg, ys); break;
            default: p_group(KIND, TB, gw, ntiles, xa, t0, 4, yg, ys); break;
            }
        }
    }
}

static void pgemv_q4_0(const uint8_t *wp, int64_t ng, int64_t nti, const mr_xact *xa, int nt, float *y, int64_t ys) {
    pgemv_impl(wp, ng, nti, xa, nt, y, ys, P_Q4_0, 288);
}
static void pgemv_q5_0(const uint8_t *wp, int64_t ng, int64_t nti, const mr_xact *xa, int nt, float *y, int64_t ys) {
    pgemv_impl(wp, ng, nti, xa, nt, y, ys, P_Q5_0, 352);
}
static void pgemv_q8_0(const uint8_t *wp, int64_t ng, int64_t nti, const mr_xact *xa, int nt, float *y, int64_t ys) {
    pgemv_impl(wp, ng, nti, xa, nt, y, ys, P_Q8_0, 544);
}
static void pgemv_q4_k(const uint8_t *wp, int64_t ng, int64_t nti, const mr_xact *xa, int nt, float *y, int64_t ys) {
    pgemv_impl(wp, ng, nti, xa, nt, y, ys, P_Q4_K, 592);
}
static void pgemv_q6_k(const uint8_t *wp, int64_t ng, int64_t nti, const mr_xact *xa, int nt, float *y, int64_t ys) {
    pgemv_impl(wp, ng, nti, xa, nt, y, ys, P_Q6_K, 840);
}

/* one k-quant tile -> floats in packed column order: out[r * os + 128Q + 32k + j] */
MR_INLINE void pdqk_impl(const int KIND, const uint8_t *tw, float *out, int64_t os) {
    for (int r = 0; r < 4; r++) {
        __m512 sc, mn = _mm512_setzero_ps();
        if (KIND == P_Q4_K) {
            __m256 s8, m8;
            pk_scales_q4k(tw, r, &s8, &m8);
            sc = _mm512_castps256_ps512(s8);
            mn = _mm512_castps256_ps512(m8);
        } else {
            sc = pk_scales_q6k(tw, r);
        }
        for (int Q = 0; Q < 2; Q++) {
            __m512i v[4];
            pk_unpack(KIND, tw, r, Q, v);
            /* int16 lanes 0..15 / 16..31: Q4_K sub-blocks (4Q, 4Q+1) / (4Q+2, 4Q+3), 8 lanes each;
             * Q6_K groups 8Q + lane / 4 */
            const __m512i ilo = KIND == P_Q4_K ? PIDX(2 * Q) : _mm512_load_si512((const void *)ridx_tab[2 * Q]);
            const __m512i ihi = KIND == P_Q4_K ? PIDX(2 * Q + 1) : _mm512_load_si512((const void *)ridx_tab[2 * Q + 1]);
            const __m512 slo = _mm512_permutexvar_ps(ilo, sc), shi = _mm512_permutexvar_ps(ihi, sc);
            const __m512 mlo = _mm512_permutexvar_ps(ilo, mn), mhi = _mm512_permutexvar_ps(ihi, mn);
            const __m512i off = _mm512_set1_epi32(KIND == P_Q6_K ? 32 : 0);
            for (int k = 0; k < 4; k++) {
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v[k])), off));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v[k], 1)), off));
                _mm512_storeu_ps(out + r * os + 128 * Q + 32 * k, _mm512_fmadd_ps(lo, slo, mlo));
                _mm512_storeu_ps(out + r * os + 128 * Q + 32 * k + 16, _mm512_fmadd_ps(hi, shi, mhi));
            }
        }
    }
}
static void pdq_q4_k(const uint8_t *tw, float *out, int64_t os) { pdqk_impl(P_Q4_K, tw, out, os); }
static void pdq_q6_k(const uint8_t *tw, float *out, int64_t os) { pdqk_impl(P_Q6_K, tw, out, os); }

/* ---------------------------------------------------------------- entry points: row groups + prefetch */

#define GEMV_ENTRY(NAME, CALL)                                                                               \
    static void NAME(const uint8_t *w, int64_t rb, int64_t nrows, int64_t nb32, const mr_xact *xa, int nt,    \
                     float *y, int64_t ys) {                                                                   \
        const int64_t end = nrows * rb, pf = mr_pf_dist;                                                       \
        if (pf > 0) pf_range(w, 0, pf, end);                                                                   \
        int64_t r = 0;                                                                                         \
        if (nt <= 2) {                                                                                         \
            for (; r + 4 <= nrows; r += 4) {                                                                   \
                if (pf > 0) pf_range(w, r * rb + pf, (r + 4) * rb + pf, end);                                  \
                if (nt == 1) CALL(w + r * rb, rb, nb32, xa, y + r, ys, 1, 4);                                  \
                else CALL(w + r * rb, rb, nb32, xa, y + r, ys, 2, 4);                                          \
            }                                                                                                  \
        } else {                                                                                               \
            for (; r + 2 <= nrows; r += 2) {                                                                   \
                if (pf > 0) pf_range(w, r * rb + pf, (r + 2) * rb + pf, end);                                  \
                if (nt == 3) CALL(w + r * rb, rb, nb32, xa, y + r, ys, 3, 2);                                  \
                else CALL(w + r * rb, rb, nb32, xa, y + r, ys, 4, 2);                                          \
            }                                                                                                  \
        }                                                                                                      \
        for (; r < nrows; r++) {                                                                               \
            switch (nt) {                                                                                      \
            case 1: CALL(w + r * rb, rb, nb32, xa, y + r, ys, 1, 1); break;                                    \
            case 2: CALL(w + r * rb, rb, nb32, xa, y + r, ys, 2, 1); break;                                    \
            case 3: CALL(w + r * rb, rb, nb32, xa, y + r, ys, 3, 1); break;                                    \
            default: CALL(w + r * rb, rb, nb32, xa, y + r, ys, 4, 1); break;                                   \
            }                                                                                                  \
        }                                                                                                      \
    }

#define CALL_Q4_0(w, rb, nb, xa, y, ys, NT, R) gemv_pair_impl(w, rb, nb, xa, y, ys, NT, R, 18, K_Q4_0)
#define CALL_Q4_1(w, rb, nb, xa, y, ys, NT, R) gemv_pair_impl(w, rb, nb, xa, y, ys, NT, R, 20, K_Q4_1)
#define CALL_Q5_0(w, rb, nb, xa, y, ys, NT, R) gemv_pair_impl(w, rb, nb, xa, y, ys, NT, R, 22, K_Q5_0)
#define CALL_Q5_1(w, rb, nb, xa, y, ys, NT, R) gemv_pair_impl(w, rb, nb, xa, y, ys, NT, R, 24, K_Q5_1)
#define CALL_IQ4NL(w, rb, nb, xa, y, ys, NT, R) gemv_pair_impl(w, rb, nb, xa, y, ys, NT, R, 18, K_IQ4NL)
#define CALL_MXFP4(w, rb, nb, xa, y, ys, NT, R) gemv_pair_impl(w, rb, nb, xa, y, ys, NT, R, 17, K_MXFP4)
#define CALL_Q8_0(w, rb, nb, xa, y, ys, NT, R) gemv_q8_0_impl(w, rb, nb, xa, y, ys, NT, R)
#define CALL_Q4_K(w, rb, nb, xa, y, ys, NT, R) gemv_sb_impl(w, rb, nb, xa, y, ys, NT, R, 144, K_Q4_K)
#define CALL_Q5_K(w, rb, nb, xa, y, ys, NT, R) gemv_sb_impl(w, rb, nb, xa, y, ys, NT, R, 176, K_Q5_K)
#define CALL_Q6_K(w, rb, nb, xa, y, ys, NT, R) gemv_sb_impl(w, rb, nb, xa, y, ys, NT, R, 210, K_Q6_K)
#define CALL_IQ4XS(w, rb, nb, xa, y, ys, NT, R) gemv_sb_impl(w, rb, nb, xa, y, ys, NT, R, 136, K_IQ4XS)
#define CALL8_Q3_K(w, rb, nb, xa, y, ys, NT, R) gemv_q8_impl(w, rb, nb, xa, y, ys, NT, R, 110, K_Q3_K)
#define CALL8_Q2_K(w, rb, nb, xa, y, ys, NT, R) gemv_q8_impl(w, rb, nb, xa, y, ys, NT, R, 84, K_Q2_K)
#define CALL8_TQ2_0(w, rb, nb, xa, y, ys, NT, R) gemv_q8_impl(w, rb, nb, xa, y, ys, NT, R, 66, K_TQ2_0)
#define CALL8_IQ2_XXS(w, rb, nb, xa, y, ys, NT, R) gemv_lb8_impl(w, rb, nb, xa, y, ys, NT, R, 66, GT_IQ2_XXS)
#define CALL8_IQ2_XS(w, rb, nb, xa, y, ys, NT, R) gemv_lb8_impl(w, rb, nb, xa, y, ys, NT, R, 74, GT_IQ2_XS)
#define CALL8_IQ2_S(w, rb, nb, xa, y, ys, NT, R) gemv_lb8_impl(w, rb, nb, xa, y, ys, NT, R, 82, GT_IQ2_S)
#define CALL8_IQ3_XXS(w, rb, nb, xa, y, ys, NT, R) gemv_lb8_impl(w, rb, nb, xa, y, ys, NT, R, 98, GT_IQ3_XXS)
#define CALL8_IQ3_S(w, rb, nb, xa, y, ys, NT, R) gemv_lb8_impl(w, rb, nb, xa, y, ys, NT, R, 110, GT_IQ3_S)
#define CALL8_IQ1_S(w, rb, nb, xa, y, ys, NT, R) gemv_lb8_impl(w, rb, nb, xa, y, ys, NT, R, 50, GT_IQ1_S)
#define CALL8_IQ1_M(w, rb, nb, xa, y, ys, NT, R) gemv_lb8_impl(w, rb, nb, xa, y, ys, NT, R, 56, GT_IQ1_M)
#define CALL8_TQ1_0(w, rb, nb, xa, y, ys, NT, R) gemv_lb8_impl(w, rb, nb, xa, y, ys, NT, R, 54, GT_TQ1_0)

GEMV_ENTRY(gemv_q4_0, CALL_Q4_0)
GEMV_ENTRY(gemv_q4_1, CALL_Q4_1)
GEMV_ENTRY(gemv_q5_0, CALL_Q5_0)
GEMV_ENTRY(gemv_q5_1, CALL_Q5_1)
GEMV_ENTRY(gemv_iq4_nl, CALL_IQ4NL)
GEMV_ENTRY(gemv_mxfp4, CALL_MXFP4)
GEMV_ENTRY(gemv_q8_0, CALL_Q8_0)
GEMV_ENTRY(gemv_q4_k, CALL_Q4_K)
GEMV_ENTRY(gemv_q5_k, CALL_Q5_K)
GEMV_ENTRY(gemv_q6_k, CALL_Q6_K)
GEMV_ENTRY(gemv_iq4_xs, CALL_IQ4XS)
GEMV_ENTRY(gemv8_q3_k, CALL8_Q3_K)
GEMV_ENTRY(gemv8_q2_k, CALL8_Q2_K)
GEMV_ENTRY(gemv8_tq2_0, CALL8_TQ2_0)
GEMV_ENTRY(gemv8_iq2_xxs, CALL8_IQ2_XXS)
GEMV_ENTRY(gemv8_iq2_xs, CALL8_IQ2_XS)
GEMV_ENTRY(gemv8_iq2_s, CALL8_IQ2_S)
GEMV_ENTRY(gemv8_iq3_xxs, CALL8_IQ3_XXS)
GEMV_ENTRY(gemv8_iq3_s, CALL8_IQ3_S)
GEMV_ENTRY(gemv8_iq1_s, CALL8_IQ1_S)
GEMV_ENTRY(gemv8_iq1_m, CALL8_IQ1_M)
GEMV_ENTRY(gemv8_tq1_0, CALL8_TQ1_0)

void mr_init_avx512_gemv(mr_kernels *k) {
    k->gemv[GT_Q4_0] = gemv_q4_0;
    k->gemv[GT_Q4_1] = gemv_q4_1;
    k->gemv[GT_Q5_0] = gemv_q5_0;
    k->gemv[GT_Q5_1] = gemv_q5_1;
    k->gemv[GT_IQ4_NL] = gemv_iq4_nl;
    k->gemv[GT_MXFP4] = gemv_mxfp4;
    k->gemv[GT_Q8_0] = gemv_q8_0;
    k->gemv[GT_Q4_K] = gemv_q4_k;
    k->gemv[GT_Q5_K] = gemv_q5_k;
    k->gemv[GT_Q6_K] = gemv_q6_k;
    k->gemv[GT_IQ4_XS] = gemv_iq4_xs;
    k->gemv[GT_Q3_K] = gemv8_q3_k;
    k->gemv[GT_Q2_K] = gemv8_q2_k;
    k->gemv[GT_TQ2_0] = gemv8_tq2_0;
    k->gemv_q8[GT_Q3_K] = k->gemv_q8[GT_Q2_K] = k->gemv_q8[GT_TQ2_0] = 1;
    k->gemv[GT_IQ2_XXS] = gemv8_iq2_xxs;
    k->gemv[GT_IQ2_XS] = gemv8_iq2_xs;
    k->gemv[GT_IQ2_S] = gemv8_iq2_s;
    k->gemv[GT_IQ3_XXS] = gemv8_iq3_xxs;
    k->gemv[GT_IQ3_S] = gemv8_iq3_s;
    k->gemv[GT_IQ1_S] = gemv8_iq1_s;
    k->gemv[GT_IQ1_M] = gemv8_iq1_m;
    k->gemv[GT_TQ1_0] = gemv8_tq1_0;
    k->gemv_q8[GT_IQ2_XXS] = k->gemv_q8[GT_IQ2_XS] = k->gemv_q8[GT_IQ2_S] = k->gemv_q8[GT_IQ3_XXS] =
        k->gemv_q8[GT_IQ3_S] = k->gemv_q8[GT_IQ1_S] = k->gemv_q8[GT_IQ1_M] = k->gemv_q8[GT_TQ1_0] = 1;
    /* prefills these kernels take instead of the float tile / panel (Intel Xeon, 4096 x 14336, 2 threads): Q2_K
     * and TQ2_0 at any count (one int32 sum per super-block: 292 / 392 GFLOP/s at 512 tokens against the panel's
     * 272 / 253), Q3_K up to 64 tokens (1.1-1.2x the panel there; the panel wins at 256); MXFP4 / IQ4_NL up to
     * 8 (1.6x the tile at 8, even at 16) */
    k->int_tokens[GT_Q3_K] = 64;
    k->int_tokens[GT_Q2_K] = k->int_tokens[GT_TQ2_0] = 65535;
    k->int_tokens[GT_MXFP4] = k->int_tokens[GT_IQ4_NL] = 8;
    /* the i-quants and TQ1_0 (int8, 4096 x 4096, 2 threads): 0.17-0.27 ms per token at any count, the
     * float panel (slow dequantizers) 0.26-0.35 at 64 tokens, 0.19-0.23 at 128; IQ1_M's crosses at ~50 */
    k->int_tokens[GT_IQ2_XXS] = k->int_tokens[GT_IQ2_XS] = k->int_tokens[GT_IQ2_S] = k->int_tokens[GT_IQ3_XXS] =
        k->int_tokens[GT_IQ3_S] = k->int_tokens[GT_IQ1_S] = k->int_tokens[GT_TQ1_0] = 64;
    k->int_tokens[GT_IQ1_M] = 48;
    k->pgemv[GT_Q4_0] = pgemv_q4_0;
    k->pgemv[GT_Q5_0] = pgemv_q5_0;
    k->pgemv[GT_Q8_0] = pgemv_q8_0;
    k->pdq[GT_Q4_0] = pdq_q4_0;
    k->pdq[GT_Q5_0] = pdq_q5_0;
    k->pdq[GT_Q8_0] = pdq_q8_0;
    k->pgemv[GT_Q4_K] = pgemv_q4_k;
    k->pgemv[GT_Q6_K] = pgemv_q6_k;
    k->pdq[GT_Q4_K] = pdq_q4_k;
    k->pdq[GT_Q6_K] = pdq_q6_k;
    k->gemv_pair[GT_Q4_0] = k->gemv_pair[GT_Q4_1] = k->gemv_pair[GT_Q5_0] = k->gemv_pair[GT_Q5_1] =
        k->gemv_pair[GT_IQ4_NL] = k->gemv_pair[GT_MXFP4] = 1;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif /* MR_X86 */
