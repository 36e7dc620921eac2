/* AVX-512 (F/BW/VL/DQ + VNNI) kernels, compiled under a target pragma so the library still loads on
 * CPUs without them (dispatch.c only calls these after checking CPUID).
 *
 * Integer path: weights are unpacked to int16 (32 per zmm) and dotted with int16 activations
 * (one scale per 32 elements) by vpdpwssd; each 32-block's int32 partial sums are converted to float
 * and scaled there, so no integer sum ever spans two scales and nothing can overflow:
 * |w| <= 4096 after folding Q6_K's int8 scale, |x| <= 32767, two products per lane < 2^31. */
#include "common.h"

#ifdef MR_X86
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

#define MR_SFX(name) name##_avx512
#define MR_VLEN 16
#include "generic_impl.h"

mr_kernels mr_kernels_avx512;

#include "x86_avx512_inl.h"

/* 16 bytes of packed nibbles -> 32 bytes [low nibbles (elements 0..15), high nibbles (16..31)] */
MR_INLINE __m256i nib32(const uint8_t *p) {
    const __m128i r = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r, 4), r), _mm256_set1_epi8(15));
}

/* dot of one 32-block of int16 weights with int16 activations, as 16 int32 lanes */
MR_INLINE __m512i dp32(__m512i w, const int16_t *x) {
    return _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512((const void *)x));
}

/* ---------------- 32-element block types ----------------
 * unpack: int16 weights w (32), scale d, offset m (value = d*w + m; m = 0 for symmetric types). */

MR_INLINE __m512i up_q4_0(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = 0.0f;
    return _mm512_cvtepi8_epi16(_mm256_sub_epi8(nib32(b + 2), _mm256_set1_epi8(8)));
}
MR_INLINE __m512i up_q4_1(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = f16s(b + 2);
    return _mm512_cvtepu8_epi16(nib32(b + 4));
}
MR_INLINE __m512i up_q5_0(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = 0.0f;
    const __m256i v = nib32(b + 6);
    const __mmask32 hb = (__mmask32)mr_rd32(b + 2);
    /* (nib | hbit << 4) - 16 == nib - 16 where the bit is clear, nib where it is set */
    return _mm512_cvtepi8_epi16(_mm256_mask_sub_epi8(v, (__mmask32)~hb, v, _mm256_set1_epi8(16)));
}
MR_INLINE __m512i up_q5_1(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = f16s(b + 2);
    const __m256i v = nib32(b + 8);
    const __mmask32 hb = (__mmask32)mr_rd32(b + 4);
    return _mm512_cvtepu8_epi16(_mm256_mask_add_epi8(v, hb, v, _mm256_set1_epi8(16)));
}
MR_INLINE __m512i up_q8_0(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = 0.0f;
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 2)));
}
MR_INLINE __m512i up_iq4_nl(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = 0.0f;
    return _mm512_cvtepi8_epi16(iq4_lut(nib32(b + 2)));
}
MR_INLINE __m512i up_mxfp4(const uint8_t *b, float *d, float *m) {
    *d = mr_e8m0_half(b[0]); *m = 0.0f;
    return _mm512_cvtepi8_epi16(mxfp4_lut(nib32(b + 1)));
}

/* Blocks per segment whose combined scales (weight d x activation d) are computed up front: the
 * weight scales of 16 blocks are gathered and converted in one go, so the inner loop takes its scale
 * with a memory-operand broadcast instead of a per-block f16 conversion on the shuffle port. */
#define SEG 256

/* f16 fields at byte `off` of n consecutive blocks of `bytes` bytes -> float */
MR_INLINE void load_f16_field(const uint8_t *w, int bytes, int off, int64_t n, float *d) {
    /* plain 16-bit copies use only the load/store ports (a gather, or per-block conversions, would
     * compete with the dot products for the two vector ports), then one conversion per 16 blocks */
    uint16_t h[SEG + 16];
    for (int64_t b = 0; b < n; b++) h[b] = mr_rd16(w + b * bytes + off);
    for (int64_t b = 0; b < n; b += 16)
        _mm512_storeu_ps(d + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + b))));
}

/* sc[t][b] = d[b] * xd_t[b]; returns sum_b m[b] * xs_t[b] per token in msum (when m != NULL) */
MR_INLINE void combine_scales(const float *d, const float *m, int64_t n, const float *xd, const float *xs,
                              int64_t xbs, const int NT, float sc[][SEG], float *msum) {
    for (int t = 0; t < NT; t++) {
        __m512 ms = _mm512_setzero_ps();
        for (int64_t b = 0; b < n; b += 16) {
            const __mmask16 k = n - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - b)) - 1);
            _mm512_mask_storeu_ps(sc[t] + b, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, d + b),
                                                             _mm512_maskz_loadu_ps(k, xd + t * xbs + b)));
            if (m) ms = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + b), _mm512_maskz_loadu_ps(k, xs + t * xbs + b), ms);
        }
        if (m) msum[t] += _mm512_reduce_add_ps(ms);
    }
}

/* Pair unpackers for the nibble types (nib_pair, hbits_pair: x86_avx512_inl.h). */
MR_INLINE void pr_q4_0(const uint8_t *a, const uint8_t *b, __m512i *lo, __m512i *hi) {
    nib_pair(a + 2, b + 2, lo, hi);
    *lo = _mm512_sub_epi16(*lo, _mm512_set1_epi16(8));
    *hi = _mm512_sub_epi16(*hi, _mm512_set1_epi16(8));
}
MR_INLINE void pr_q4_1(const uint8_t *a, const uint8_t *b, __m512i *lo, __m512i *hi) { nib_pair(a + 4, b + 4, lo, hi); }
MR_INLINE void pr_q5_0(const uint8_t *a, const uint8_t *b, __m512i *lo, __m512i *hi) {
    __mmask32 kl, kh;
    nib_pair(a + 6, b + 6, lo, hi);
    hbits_pair(a + 2, b + 2, &kl, &kh);
    const __m512i c16 = _mm512_set1_epi16(16);
    *lo = _mm512_mask_sub_epi16(*lo, (__mmask32)~kl, *lo, c16);   /* (q | h << 4) - 16 */
    *hi = _mm512_mask_sub_epi16(*hi, (__mmask32)~kh, *hi, c16);
}
MR_INLINE void pr_q5_1(const uint8_t *a, const uint8_t *b, __m512i *lo, __m512i *hi) {
    __mmask32 kl, kh;
    nib_pair(a + 8, b + 8, lo, hi);
    hbits_pair(a + 4, b + 4, &kl, &kh);
    const __m512i c16 = _mm512_set1_epi16(16);
    *lo = _mm512_mask_add_epi16(*lo, kl, *lo, c16);
    *hi = _mm512_mask_add_epi16(*hi, kh, *hi, c16);
}
MR_INLINE void pr_iq4_nl(const uint8_t *a, const uint8_t *b, __m512i *lo, __m512i *hi) {
    const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 2))),
                                                _mm_loadu_si128((const __m128i *)(b + 2)), 1);
    const __m256i m4 = _mm256_set1_epi8(15);
    *lo = _mm512_cvtepi8_epi16(iq4_lut(_mm256_and_si256(raw, m4)));
    *hi = _mm512_cvtepi8_epi16(iq4_lut(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4)));
}

#define NT_SWITCH(NAME)                                                                                      \
    static void NAME(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd, const float *xs,        \
                     int64_t xqs, int64_t xbs, int nt, float *out) {                                           \
        switch (nt) {                                                                                          \
        case 1: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 1, out); break;                                         \
        case 2: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 2, out); break;                                         \
        case 3: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 3, out); break;                                         \
        default: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 4, out); break;                                        \
        }                                                                                                      \
    }

/* nibble types: pairs of blocks per step (int32 lanes 0..7 belong to block a, 8..15 to block b) */
#define DEF_VPAIR(NAME, BYTES, PAIR, SINGLE, HAS_MIN)                                                        \
    MR_INLINE void NAME##_nt(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd,                 \
                             const float *xs, int64_t xqs, int64_t xbs, const int NT, float *out) {           \
        __m512 acc[MR_NT_INT];                                                                                 \
        float msum[MR_NT_INT], dsc[SEG + 16], mns[SEG + 16], sc[MR_NT_INT][SEG];                                         \
        for (int t = 0; t < NT; t++) { acc[t] = _mm512_setzero_ps(); msum[t] = 0.0f; }                         \
        const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);               \
        for (int64_t s0 = 0; s0 < nb; s0 += SEG) {                                                             \
            const int64_t n = nb - s0 < SEG ? nb - s0 : SEG;                                                   \
            const uint8_t *ws = w + s0 * BYTES;                                                                \
            load_f16_field(ws, BYTES, 0, n, dsc);                                                              \
            if (HAS_MIN) load_f16_field(ws, BYTES, 2, n, mns);                                                 \
            combine_scales(dsc, HAS_MIN ? mns : NULL, n, xd + s0, xs + s0, xbs, NT, sc, msum);                 \
            int64_t b = 0;                                                                                     \
            for (; b + 2 <= n; b += 2) {                                                                       \
                __m512i lo, hi;                                                                                \
                PAIR(ws + b * BYTES, ws + (b + 1) * BYTES, &lo, &hi);                                          \
                for (int t = 0; t < NT; t++) {                                                                 \
                    const int16_t *xt = xq + t * xqs + 32 * (s0 + b);                                          \
                    __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)xt)); \
                    p = _mm512_dpwssd_epi32(p, hi, _mm512_loadu_si512((const void *)(xt + 32)));               \
                    double s2d;                                                                                \
                    memcpy(&s2d, sc[t] + b, 8);                                                                \
                    const __m512 s2 = _mm512_castpd_ps(_mm512_set1_pd(s2d));                                   \
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(half, s2), acc[t]);  \
                }                                                                                              \
            }                                                                                                  \
            if (b < n) { /* an odd last block: natural layout */                                               \
                float d, m;                                                                                    \
                const __m512i wv = SINGLE(ws + b * BYTES, &d, &m);                                             \
                for (int t = 0; t < NT; t++) {                                                                 \
                    const __m512i p = dp32(wv, xq + t * xqs + 32 * (s0 + b));                                  \
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(sc[t][b]), acc[t]);         \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(acc[t]) + msum[t];                          \
    }                                                                                                          \
    NT_SWITCH(NAME)

DEF_VPAIR(vint_q4_0, 18, pr_q4_0, up_q4_0, 0)
DEF_VPAIR(vint_q4_1, 20, pr_q4_1, up_q4_1, 1)
DEF_VPAIR(vint_q5_0, 22, pr_q5_0, up_q5_0, 0)
DEF_VPAIR(vint_q5_1, 24, pr_q5_1, up_q5_1, 1)
DEF_VPAIR(vint_iq4_nl, 18, pr_iq4_nl, up_iq4_nl, 0)

/* Q8_0: one block per step; two accumulators per token hide the FMA latency */
MR_INLINE void vint_q8_0_nt(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd, const float *xs,
                            int64_t xqs, int64_t xbs, const int NT, float *out) {
    __m512 acc[MR_NT_INT][2];
    float msum[MR_NT_INT], dsc[SEG + 16], sc[MR_NT_INT][SEG];
    for (int t = 0; t < NT; t++) { acc[t][0] = acc[t][1] = _mm512_setzero_ps(); msum[t] = 0.0f; }
    for (int64_t s0 = 0; s0 < nb; s0 += SEG) {
        const int64_t n = nb - s0 < SEG ? nb - s0 : SEG;
        const uint8_t *ws = w + s0 * 34;
        load_f16_field(ws, 34, 0, n, dsc);
        combine_scales(dsc, NULL, n, xd + s0, xs + s0, xbs, NT, sc, msum);
        /* two blocks per step with constant accumulator indices (keeps them in registers) */
        for (int64_t b = 0; b < n; b += 2) {
            const int two = b + 1 < n;
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(ws + b * 34 + 2)));
            const __m512i w1 = two ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(ws + b * 34 + 36)))
                                   : _mm512_setzero_si512();
            for (int t = 0; t < NT; t++) {
                const int16_t *xt = xq + t * xqs + 32 * (s0 + b);
                acc[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp32(w0, xt)), _mm512_set1_ps(sc[t][b]), acc[t][0]);
                if (two)
                    acc[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp32(w1, xt + 32)), _mm512_set1_ps(sc[t][b + 1]),
                                                acc[t][1]);
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
}
NT_SWITCH(vint_q8_0)

/* ---------------- 256-element super-block types ----------------
 * unpack: 8 zmm of int16 weights (sub-block j = elements 32j..32j+31), per-sub float scales sc (value
 * = sc[j] * w, after any per-16 int scale was folded into w) and per-sub offsets mn (value += mn[j]). */

MR_INLINE void sb_q4_k(const uint8_t *b, __m512i wv[8], __m256 *sc, __m256 *mn) {
    const float d = f16s(b), dmin = f16s(b + 2);
    /* 8 x 6-bit scales and mins (ggml get_scale_min_k4, vectorized over j via 32-bit words) */
    uint32_t u[3], s[2], m2[2];
    memcpy(u, b + 4, 12);
    s[0] = u[0] & 0x3f3f3f3fu;
    s[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
    m2[0] = u[1] & 0x3f3f3f3fu;
    m2[1] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
    const __m256 sv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s)));
    const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m2)));
    *sc = _mm256_mul_ps(sv, _mm256_set1_ps(d));
    *mn = _mm256_mul_ps(mv, _mm256_set1_ps(-dmin));
    const uint8_t *q = b + 16;
    for (int c = 0; c < 4; c++) {
        const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * c)));
        wv[2 * c] = _mm512_and_si512(w16, _mm512_set1_epi16(15));
        wv[2 * c + 1] = _mm512_srli_epi16(w16, 4);
    }
}

MR_INLINE void sb_q5_k(const uint8_t *b, __m512i wv[8], __m256 *sc, __m256 *mn) {
    const float d = f16s(b), dmin = f16s(b + 2);
    uint32_t u[3], s[2], m2[2];
    memcpy(u, b + 4, 12);
    s[0] = u[0] & 0x3f3f3f3fu;
    s[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);
    m2[0] = u[1] & 0x3f3f3f3fu;
    m2[1] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u);
    const __m256 sv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s)));
    const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m2)));
    *sc = _mm256_mul_ps(sv, _mm256_set1_ps(d));
    *mn = _mm256_mul_ps(mv, _mm256_set1_ps(-dmin));
    const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)));
    const uint8_t *q = b + 48;
    const __m512i c16 = _mm512_set1_epi16(16);
    for (int c = 0; c < 4; c++) {
        const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * c)));
        const __m512i lo = _mm512_and_si512(w16, _mm512_set1_epi16(15));
        const __m512i hi = _mm512_srli_epi16(w16, 4);
        const __mmask32 k0 = _mm512_test_epi16_mask(qh, _mm512_set1_epi16((short)(1 << (2 * c))));
        const __mmask32 k1 = _mm512_test_epi16_mask(qh, _mm512_set1_epi16((short)(1 << (2 * c + 1))));
        wv[2 * c] = _mm512_mask_add_epi16(lo, k0, lo, c16);
        wv[2 * c + 1] = _mm512_mask_add_epi16(hi, k1, hi, c16);
    }
}

/* Q6_K: per-16 int8 scales are folded into the int16 weights ((q - 32) * scale, |.| <= 4096). */
MR_INLINE void sb_q6_k(const uint8_t *b, __m512i wv[8], __m256 *sc, __m256 *mn) {
    const float d = f16s(b + 208);
    *sc = _mm256_set1_ps(d);
    *mn = _mm256_setzero_ps();
    const __m512i scl = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))));
    const __m512i m4 = _mm512_set1_epi16(15), m30 = _mm512_set1_epi16(0x30), c32 = _mm512_set1_epi16(32);
    for (int h = 0; h < 2; h++) {
        const __m512i A = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h)));
        const __m512i B = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32)));
        const __m512i Q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        __m512i q[4];
        q[0] = _mm512_or_si512(_mm512_and_si512(A, m4), _mm512_and_si512(_mm512_slli_epi16(Q, 4), m30));
        q[1] = _mm512_or_si512(_mm512_and_si512(B, m4), _mm512_and_si512(_mm512_slli_epi16(Q, 2), m30));
        q[2] = _mm512_or_si512(_mm512_srli_epi16(A, 4), _mm512_and_si512(Q, m30));
        q[3] = _mm512_or_si512(_mm512_srli_epi16(B, 4), _mm512_and_si512(_mm512_srli_epi16(Q, 2), m30));
        for (int i = 0; i < 4; i++) {
            const int j = 4 * h + i; /* sub-block: elements 32j..32j+31, scales 2j (first 16), 2j+1 */
            const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)),
                                                   _mm256_set1_epi16((short)(2 * j + 1)), 1);
            const __m512i s = _mm512_permutexvar_epi16(idx, scl);
            wv[j] = _mm512_mullo_epi16(_mm512_sub_epi16(q[i], c32), s);
        }
    }
}

/* Q3_K (hmask[32] @0 | qs[64] @32 | scales[12] @96 | d @108): 2-bit q and a high bit (clear: -4),
 * the signed 6-bit per-16 scales folded into the int16 weights (|q * s| <= 4 * 32). */
MR_INLINE void sb_q3_k(const uint8_t *b, __m512i wv[8], __m256 *sc, __m256 *mn) {
    *sc = _mm256_set1_ps(f16s(b + 108));
    *mn = _mm256_setzero_ps();
    int16_t s16[16] __attribute__((aligned(32)));
    mr_q3k_scales(b + 96, s16);
    const __m512i scl = _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)s16));
    const __m512i hm = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)b));
    const __m512i m3 = _mm512_set1_epi16(3), c4 = _mm512_set1_epi16(4);
    for (int h = 0; h < 2; h++) {
        const __m512i Q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h)));
        for (int s = 0; s < 4; s++) {
            const int j = 4 * h + s; /* sub-block: elements 32j..32j+31 = bits 2s of qs[32h..], hmask bit j */
            const __m512i q = _mm512_and_si512(_mm512_srli_epi16(Q, 2 * s), m3);
            const __mmask32 hb = _mm512_test_epi16_mask(hm, _mm512_set1_epi16((short)(1 << j)));
            const __m512i w = _mm512_mask_sub_epi16(q, (__mmask32)~hb, q, c4);
            const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)),
                                                   _mm256_set1_epi16((short)(2 * j + 1)), 1);
            wv[j] = _mm512_mullo_epi16(w, _mm512_permutexvar_epi16(idx, scl));
        }
    }
}

MR_INLINE void sb_iq4_xs(const uint8_t *b, __m512i wv[8], __m256 *sc, __m256 *mn) {
    const float d = f16s(b);
    const uint16_t sh = mr_rd16(b + 2);
    float ls[8];
    for (int j = 0; j < 8; j++)
        ls[j] = (float)((((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32);
    *sc = _mm256_mul_ps(_mm256_loadu_ps(ls), _mm256_set1_ps(d));
    *mn = _mm256_setzero_ps();
    for (int j = 0; j < 8; j++) wv[j] = _mm512_cvtepi8_epi16(iq4_lut(nib32(b + 8 + 16 * j)));
}

#define DEF_VINT256(NAME, BYTES, UNPACK, HAS_MIN)                                                            \
    MR_INLINE void NAME##_nt(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd,               \
                             const float *xs, int64_t xqs, int64_t xbs, const int NT, float *out) {           \
        __m512 acc[MR_NT_INT][2];                                                                              \
        __m256 accm[MR_NT_INT];                                                                                \
        for (int t = 0; t < NT; t++) {                                                                         \
            acc[t][0] = acc[t][1] = _mm512_setzero_ps();                                                       \
            accm[t] = _mm256_setzero_ps();                                                                     \
        }                                                                                                      \
        const int64_t nsb = nb32 / 8;                                                                          \
        for (int64_t ib = 0; ib < nsb; ib++) {                                                                 \
            __m512i wv[8];                                                                                     \
            __m256 sc, mn;                                                                                     \
            UNPACK(w + ib * BYTES, wv, &sc, &mn);                                                              \
            for (int t = 0; t < NT; t++) {                                                                     \
                const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(xd + t * xbs + 8 * ib))); \
                if (HAS_MIN) accm[t] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(xs + t * xbs + 8 * ib), accm[t]);   \
                const int16_t *xt = xq + t * xqs + 256 * ib;                                                   \
                for (int j = 0; j < 8; j++) {                                                                  \
                    const __m512i p = dp32(wv[j], xt + 32 * j);                                                \
                    acc[t][j & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),                                     \
                                                    _mm512_permutexvar_ps(_mm512_set1_epi32(j), s), acc[t][j & 1]); \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int t = 0; t < NT; t++)                                                                           \
            out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1])) + (HAS_MIN ? hsum8(accm[t]) : 0.0f); \
    }                                                                                                          \
    NT_SWITCH(NAME)

DEF_VINT256(vint_q4_k, 144, sb_q4_k, 1)
DEF_VINT256(vint_q5_k, 176, sb_q5_k, 1)
DEF_VINT256(vint_q6_k, 210, sb_q6_k, 0)
DEF_VINT256(vint_iq4_xs, 136, sb_iq4_xs, 0)

/* Q2_K (scales[16] @0 | qs[64] @16 | d @80 | dmin @82): value = d * sc_g * q - dmin * m_g per 16
 * elements g (sc_g, m_g the low / high nibble of scales[g]), q = bits 2s of qs[32h + l] for element
 * 128h + 32s + l. (Its decode kernel takes int8 activations: x86_avx512_gemv.c.) */
MR_INLINE __m512i q2k_sub(const __m512i Q, int s) { return _mm512_and_si512(_mm512_srli_epi16(Q, 2 * s), _mm512_set1_epi16(3)); }

/* dequantized exactly as the spec: (d * sc_g) * q - dmin * m_g, one rounding (the products are exact) */
static void dqv_q2_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 84, y += 256) {
        const float d = f16s(b + 80), dmin = f16s(b + 82);
        for (int h = 0; h < 2; h++) {
            const __m512i Q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h)));
            for (int s = 0; s < 4; s++) {
                const int j = 4 * h + s;
                const __m512i q = q2k_sub(Q, s);
                for (int half = 0; half < 2; half++) {
                    const int g = 2 * j + half;
                    const __m256i q16 = half ? _mm512_extracti64x4_epi64(q, 1) : _mm512_castsi512_si256(q);
                    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(q16));
                    _mm512_storeu_ps(y + 32 * j + 16 * half,
                                     _mm512_fmsub_ps(f, _mm512_set1_ps(d * (float)(b[g] & 15)),
                                                     _mm512_set1_ps(dmin * (float)(b[g] >> 4))));
                }
            }
        }
    }
}

/* ---------------- float kernels ---------------- */

static void hv_dq_f16(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(mr_rd16(src + 2 * i));
}

static void hv_dq_bf16(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 2 * i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
    for (; i < n; i++) dst[i] = mr_bf16_to_f32(mr_rd16(src + 2 * i));
}

/* 32-block types: dequantize through the integer unpackers (one zmm of int16 per block). */
#define DEF_DQ32(NAME, BYTES, UNPACK)                                                                        \
    static void NAME(const uint8_t *b, float *y, int64_t nb) {                                                 \
        for (int64_t i = 0; i < nb; i++) {                                                                     \
            float d, m;                                                                                        \
            const __m512i w = UNPACK(b + i * BYTES, &d, &m);                                                   \
            const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);                                       \
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));           \
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));     \
            _mm512_storeu_ps(y + 32 * i, _mm512_fmadd_ps(lo, dv, mv));                                         \
            _mm512_storeu_ps(y + 32 * i + 16, _mm512_fmadd_ps(hi, dv, mv));                                    \
        }                                                                                                      \
    }
DEF_DQ32(dqv_q4_0, 18, up_q4_0)
DEF_DQ32(dqv_mxfp4, 17, up_mxfp4)
DEF_DQ32(dqv_q4_1, 20, up_q4_1)
DEF_DQ32(dqv_q5_0, 22, up_q5_0)
DEF_DQ32(dqv_q5_1, 24, up_q5_1)
DEF_DQ32(dqv_q8_0, 34, up_q8_0)
DEF_DQ32(dqv_iq4_nl, 18, up_iq4_nl)

#define DEF_DQ256(NAME, BYTES, UNPACK)                                                                       \
    static void NAME(const uint8_t *b, float *y, int64_t nb) {                                                 \
        for (int64_t i = 0; i < nb; i++) {                                                                     \
            __m512i wv[8];                                                                                     \
            __m256 sc, mn;                                                                                     \
            UNPACK(b + i * BYTES, wv, &sc, &mn);                                                               \
            float s[8], m[8];                                                                                  \
            _mm256_storeu_ps(s, sc);                                                                           \
            _mm256_storeu_ps(m, mn);                                                                           \
            for (int j = 0; j < 8; j++) {                                                                      \
                const __m512 dv = _mm512_set1_ps(s[j]), mv = _mm512_set1_ps(m[j]);                             \
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(wv[j])));   \
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(wv[j], 1))); \
                _mm512_storeu_ps(y + 256 * i + 32 * j, _mm512_fmadd_ps(lo, dv, mv));                           \
                _mm512_storeu_ps(y + 256 * i + 32 * j + 16, _mm512_fmadd_ps(hi, dv, mv));                      \
            }                                                                                                  \
        }                                                                                                      \
    }
DEF_DQ256(dqv_q4_k, 144, sb_q4_k)
DEF_DQ256(dqv_q5_k, 176, sb_q5_k)
DEF_DQ256(dqv_q6_k, 210, sb_q6_k)
DEF_DQ256(dqv_q3_k, 110, sb_q3_k)
DEF_DQ256(dqv_iq4_xs, 136, sb_iq4_xs)

/* out[t] = dot(w, x_t) for t < nt <= 4; two accumulators per token */
static void hv_dot_f32(const float *w, const float *x, int64_t xs, int64_t n, int nt, float *out) {
    __m512 a0[MR_NT_INT], a1[MR_NT_INT];
    for (int t = 0; t < MR_NT_INT; t++) a0[t] = a1[t] = _mm512_setzero_ps();
    int64_t i = 0;
    if (nt == 1) {
        for (; i + 32 <= n; i += 32) {
            a0[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0[0]);
            a1[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1[0]);
        }
    } else {
        for (; i + 32 <= n; i += 32) {
            const __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + i + 16);
            for (int t = 0; t < nt; t++) {
                a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * xs + i), a0[t]);
                a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * xs + i + 16), a1[t]);
            }
        }
    }
    for (; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 w0 = _mm512_maskz_loadu_ps(k, w + i);
        for (int t = 0; t < nt; t++) a0[t] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(k, x + t * xs + i), a0[t]);
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
}

/* 8 zmm accumulators -> 8 sums */
MR_INLINE __m256 reduce8(const __m512 *a) {
    __m256 h[8];
    for (int r = 0; r < 8; r++) h[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1));
    const __m256 h01 = _mm256_hadd_ps(h[0], h[1]), h23 = _mm256_hadd_ps(h[2], h[3]);
    const __m256 h45 = _mm256_hadd_ps(h[4], h[5]), h67 = _mm256_hadd_ps(h[6], h[7]);
    const __m256 l = _mm256_hadd_ps(h01, h23), u = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(l, u, 0x20), _mm256_permute2f128_ps(l, u, 0x31));
}

/* 8 rows x 3 tokens register tile over n elements; wt rows have stride n */
MR_INLINE void micro_8x3(const float *wt, const float *x, int64_t xs, int64_t n, float *y, int64_t ys, int acc) {
    __m512 c0[8], c1[8], c2[8];
    for (int r = 0; r < 8; r++) c0[r] = c1[r] = c2[r] = _mm512_setzero_ps();
    const float *x0 = x, *x1 = x + xs, *x2 = x + 2 * xs;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __m512 v0 = _mm512_loadu_ps(x0 + k), v1 = _mm512_loadu_ps(x1 + k), v2 = _mm512_loadu_ps(x2 + k);
        for (int r = 0; r < 8; r++) {
            const __m512 wr = _mm512_loadu_ps(wt + r * n + k);
            c0[r] = _mm512_fmadd_ps(wr, v0, c0[r]);
            c1[r] = _mm512_fmadd_ps(wr, v1, c1[r]);
            c2[r] = _mm512_fmadd_ps(wr, v2, c2[r]);
        }
    }
    if (k < n) {
        const __mmask16 m = (__mmask16)((1u << (n - k)) - 1);
        const __m512 v0 = _mm512_maskz_loadu_ps(m, x0 + k), v1 = _mm512_maskz_loadu_ps(m, x1 + k),
                     v2 = _mm512_maskz_loadu_ps(m, x2 + k);
        for (int r = 0; r < 8; r++) {
            const __m512 wr = _mm512_maskz_loadu_ps(m, wt + r * n + k);
            c0[r] = _mm512_fmadd_ps(wr, v0, c0[r]);
            c1[r] = _mm512_fmadd_ps(wr, v1, c1[r]);
            c2[r] = _mm512_fmadd_ps(wr, v2, c2[r]);
        }
    }
    __m256 s0 = reduce8(c0), s1 = reduce8(c1), s2 = reduce8(c2);
    if (acc) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(y));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(y + ys));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(y + 2 * ys));
    }
    _mm256_storeu_ps(y, s0);
    _mm256_storeu_ps(y + ys, s1);
    _mm256_storeu_ps(y + 2 * ys, s2);
}

static void hv_tile(const float *wt, int nr, const float *x, int64_t xs, int ntk, int64_t n, float *y,
                        int64_t ys, int acc) {
    int t = 0;
    if (nr == 8)
        for (; t + 3 <= ntk; t += 3) micro_8x3(wt, x + t * xs, xs, n, y + t * ys, ys, acc);
    for (; t < ntk; t += MR_NT_INT) {
        const int nt = ntk - t < MR_NT_INT ? ntk - t : MR_NT_INT;
        for (int r = 0; r < nr; r++) {
            float o[MR_NT_INT];
            hv_dot_f32(wt + (int64_t)r * n, x + t * xs, xs, n, nt, o);
            for (int i = 0; i < nt; i++) y[(t + i) * ys + r] = acc ? y[(t + i) * ys + r] + o[i] : o[i];
        }
    }
}

/* ---------------- panel path (many tokens): outer products over a transposed weight panel ---------------- */

static void hv_pack(const float *a, int nr, int64_t n, float *P) {
    for (int rg = 0; rg < MR_PR; rg += 16) {
        for (int64_t k = 0; k < n; k += 16) {
            const __mmask16 m = n - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - k)) - 1);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = rg + i < nr ? _mm512_maskz_loadu_ps(m, a + (int64_t)(rg + i) * n + k) : _mm512_setzero_ps();
            transpose16(r);
            const int kk = n - k >= 16 ? 16 : (int)(n - k);
            for (int i = 0; i < kk; i++) _mm512_storeu_ps(P + (k + i) * MR_PR + rg, r[i]);
        }
    }
}

/* T tokens x 32 rows of accumulators (2T zmm, T <= 12) */
MR_INLINE void panel_t(const float *P, const float *x, int64_t xs, int64_t n, float *y, int64_t ys, int acc,
                       __mmask16 m0, __mmask16 m1, const int T) {
    __m512 c0[12], c1[12];
    for (int t = 0; t < T; t++) c0[t] = c1[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k++) {
        const __m512 w0 = _mm512_loadu_ps(P + k * MR_PR), w1 = _mm512_loadu_ps(P + k * MR_PR + 16);
        for (int t = 0; t < T; t++) {
            const __m512 xb = _mm512_set1_ps(x[t * xs + k]);
            c0[t] = _mm512_fmadd_ps(w0, xb, c0[t]);
            c1[t] = _mm512_fmadd_ps(w1, xb, c1[t]);
        }
    }
    for (int t = 0; t < T; t++) {
        float *yt = y + t * ys;
        if (acc) {
            c0[t] = _mm512_add_ps(c0[t], _mm512_maskz_loadu_ps(m0, yt));
            c1[t] = _mm512_add_ps(c1[t], _mm512_maskz_loadu_ps(m1, yt + 16));
        }
        _mm512_mask_storeu_ps(yt, m0, c0[t]);
        _mm512_mask_storeu_ps(yt + 16, m1, c1[t]);
    }
}

static void hv_panel(const float *P, int nr, const float *x, int64_t xs, int ntk, int64_t n, float *y, int64_t ys,
                     int acc) {
    const __mmask16 m0 = nr >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1);
    const __mmask16 m1 = nr >= 32 ? (__mmask16)0xffff : (nr <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nr - 16)) - 1));
    int t = 0;
    for (; t + 12 <= ntk; t += 12) panel_t(P, x + t * xs, xs, n, y + t * ys, ys, acc, m0, m1, 12);
    const int rest = ntk - t;
    const float *xr = x + t * xs;
    float *yr = y + t * ys;
    switch (rest) {
    case 1: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 1); break;
    case 2: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 2); break;
    case 3: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 3); break;
    case 4: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 4); break;
    case 5: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 5); break;
    case 6: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 6); break;
    case 7: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 7); break;
    case 8: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 8); break;
    case 9: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 9); break;
    case 10: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 10); break;
    case 11: panel_t(P, xr, xs, n, yr, ys, acc, m0, m1, 11); break;
    default: break;
    }
}

static void hv_quant_x(const float *x, int64_t n, int16_t *q, float *d, float *s) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < n / 32; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
        const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        const __m512 iv = _mm512_set1_ps(id);
        /* |v * id| <= 32767 up to rounding; the saturating pack clamps the rest */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm512_cvtsepi32_epi16(q0));
        _mm256_storeu_si256((__m256i *)(q + 32 * b + 16), _mm512_cvtsepi32_epi16(q1));
        s[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        d[b] = isfinite(s[b]) ? amax / 32767.0f : NAN; /* a NaN / infinity (lost by max) reaches y */
    }
}

static void hv_f16_to_f32(const uint16_t *src, float *dst, int64_t n) { hv_dq_f16((const uint8_t *)src, dst, n); }

/* e^x, |relative error| < 2e-7 (Cephes expf polynomial; 2^n applied with scalef) */
MR_INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* the 16 sums of 16 vectors: out lane i = sum of v[i] */
MR_INLINE __m512 reduce16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int k = 0; k < 8; k++) w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)
        x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], 0x44), _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], 0xEE));
    /* x[k], 128-bit lane L: partial sums (over lane L) of v[4k..4k+3] */
    const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

static void hv_vexp(float *x, int64_t n) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
        /* below e^-87 (and -inf): 0, so masked scores contribute nothing and no denormals appear */
        _mm512_mask_storeu_ps(x + i, k, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, lo, _CMP_GT_OQ), exp512(v)));
    }
}

static void hv_softmax(float *x, int64_t n) { softmax_with_avx512(x, n, hv_vexp); }

/* Keys ahead that decode attention prefetches. From memory the rows do not come fast enough by the
 * hardware prefetcher alone: at a 16k context (Gemma3's 4 x 256 heads, f16, 2 threads, interleaved
 * runs) prefetching keys 8 ahead, and their values into L2 for the weighted sum, took a layer from
 * 1.6-1.7 ms to 1.15 ms (4 and 16 ahead: 1.2 ms). */
#define AD_PF 8
/* 16 elements of a cache row at element offset off: float32 rows, or float16 rows (H16) converted in
 * registers, so an f16 cache is read as stored (no float copy of the chunk written and read back) */
MR_INLINE __m512 kv_ld(const void *base, int64_t off, const int H16) {
    return H16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)))
               : _mm512_loadu_ps((const float *)base + off);
}

/* o[i][c] += p[j][i] * v_j[c] for GI queries and 4 vectors of 16 dims, all keys (registers throughout);
 * S is (nk, 16): row j holds the queries' weights of key j */
MR_INLINE void dec_pv(const float *S, int i0, const void *Vr, int64_t D, int64_t nk, int64_t c0, float *O, const int GI,
                      const int H16) {
    __m512 o[7][4];
    for (int i = 0; i < GI; i++)
        for (int c = 0; c < 4; c++) o[i][c] = _mm512_setzero_ps();
    const int es = H16 ? 2 : 4; /* bytes per element */
    for (int64_t j = 0; j < nk; j++) {
        __m512 vr[4];
        if (j + AD_PF < nk) /* the slice of a row AD_PF keys ahead: rows are D apart, too far for the prefetcher */
            for (int l = 0; l < es; l++) /* 64 elements: 2 cache lines (f16) or 4 */
                _mm_prefetch((const char *)Vr + ((j + AD_PF) * D + 16 * c0) * es + 64 * l, _MM_HINT_T0);
        for (int c = 0; c < 4; c++) vr[c] = kv_ld(Vr, j * D + 16 * (c0 + c), H16);
        for (int i = 0; i < GI; i++) {
            const __m512 p = _mm512_set1_ps(S[j * 16 + i0 + i]);
            for (int c = 0; c < 4; c++) o[i][c] = _mm512_fmadd_ps(p, vr[c], o[i][c]);
        }
    }
    for (int i = 0; i < GI; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(O + (i0 + i) * D + 16 * (c0 + c), o[i][c]);
}

/* Decode attention with the head dimension in the lanes (few queries: no idle lanes). Scores in
 * tiles of 4 queries x 4 keys (each key vector loaded once per 4 queries), the 16 dot products of a
 * tile reduced together; then weighted values with up to 7 queries x 64 dims in registers.
 * D must be a multiple of 64 here (else attn_block serves). Kr, Vr: (nk, D) float32, or float16 if H16. */
MR_INLINE void attn_dec_rows(const float *Q, int g, const void *Kr, const void *Vr, int64_t D, int64_t nk,
                             float softcap, float *S, float *O, float *ml, const int H16) {
    const int64_t nc = D / 16, es = H16 ? 2 : 4; /* es: bytes per element */
    /* lane a*4+b of a reduced tile = (query a, key b); this permutation makes it b*4+a */
    const __m512i tr = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < nk; j0 += 4) {
        const int nb = nk - j0 < 4 ? (int)(nk - j0) : 4;
        int64_t kr[4];
        for (int b = 0; b < 4; b++) kr[b] = (j0 + (b < nb ? b : nb - 1)) * D; /* tail: repeat the last key */
        if (j0 + AD_PF + 4 <= nk) /* the 4 rows AD_PF keys ahead; their values into L2 for the passes below */
            for (int64_t o = 0; o < 4 * D * es; o += 64) {
                _mm_prefetch((const char *)Kr + (j0 + AD_PF) * D * es + o, _MM_HINT_T0);
                _mm_prefetch((const char *)Vr + (j0 + AD_PF) * D * es + o, _MM_HINT_T1);
            }
        for (int i0 = 0; i0 < g; i0 += 4) {
            const float *qr[4];
            for (int a = 0; a < 4; a++) qr[a] = Q + (i0 + a < g ? i0 + a : g - 1) * D;
            __m512 acc[16];
            for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
            for (int64_t c = 0; c < nc; c++) {
                __m512 kv[4];
                for (int b = 0; b < 4; b++) kv[b] = kv_ld(Kr, kr[b] + 16 * c, H16);
                for (int a = 0; a < 4; a++) {
                    const __m512 qv = _mm512_loadu_ps(qr[a] + 16 * c);
                    for (int b = 0; b < 4; b++) acc[a * 4 + b] = _mm512_fmadd_ps(qv, kv[b], acc[a * 4 + b]);
                }
            }
            __m512 sv = _mm512_permutexvar_ps(tr, reduce16(acc)); /* lane b*4+a: query a, key b */
            if (softcap > 0.0f) {
                float t[16];
                _mm512_storeu_ps(t, sv);
                for (int u = 0; u < 16; u++) t[u] = softcap * tanhf(t[u] / softcap);
                sv = _mm512_loadu_ps(t);
            }
            float t4[16];
            _mm512_storeu_ps(t4, sv);
            for (int b = 0; b < nb; b++) memcpy(S + (j0 + b) * 16 + i0, t4 + 4 * b, 16);
        }
    }
    /* softmax over the keys of each query (lane), keys past nk do not exist */
    const __mmask16 qm = (__mmask16)((1u << g) - 1);
    __m512 mx = ninf;
    for (int64_t j = 0; j < nk; j++) mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(qm, S + j * 16));
    __m512 sum = _mm512_setzero_ps();
    const __m512 lo = _mm512_set1_ps(-87.0f);
    for (int64_t j = 0; j < nk; j++) {
        const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(qm, S + j * 16), mx);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, lo, _CMP_GT_OQ) & qm, exp512(v));
        _mm512_storeu_ps(S + j * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(ml, mx);
    _mm512_storeu_ps(ml + 16, sum);
    for (int i0 = 0; i0 < g; i0 += 7) {
        const int gi = g - i0 < 7 ? g - i0 : 7;
        for (int64_t c0 = 0; c0 < nc; c0 += 4) {
            switch (gi) {
            case 1: dec_pv(S, i0, Vr, D, nk, c0, O, 1, H16); break;
            case 2: dec_pv(S, i0, Vr, D, nk, c0, O, 2, H16); break;
            case 3: dec_pv(S, i0, Vr, D, nk, c0, O, 3, H16); break;
            case 4: dec_pv(S, i0, Vr, D, nk, c0, O, 4, H16); break;
            case 5: dec_pv(S, i0, Vr, D, nk, c0, O, 5, H16); break;
            case 6: dec_pv(S, i0, Vr, D, nk, c0, O, 6, H16); break;
            default: dec_pv(S, i0, Vr, D, nk, c0, O, 7, H16); break;
            }
        }
    }
}
static void hv_attn_dec(const float *Q, int g, const float *Kr, const float *Vr, int64_t D, int64_t nk, float softcap,
                        float *S, float *O, float *ml) {
    attn_dec_rows(Q, g, Kr, Vr, D, nk, softcap, S, O, ml, 0);
}
static void hv_attn_dec_h(const float *Q, int g, const uint16_t *Kh, const uint16_t *Vh, int64_t D, int64_t nk,
                          float softcap, float *S, float *O, float *ml) {
    attn_dec_rows(Q, g, Kh, Vh, D, nk, softcap, S, O, ml, 1);
}

/* attn_block (generic_impl.h) with the 16 queries in one zmm: 8 keys per step for the scores,
 * 16 output dims held in registers over all keys for the weighted values */
static void hv_attn_block(const float *Qt, const float *Kr, const float *Vr, int64_t D, int64_t nk, const int64_t *first,
                          const int64_t *last, float softcap, float *S, float *Ot, float *ml,
                          void (*vexp)(float *, int64_t)) {
    (void)vexp;
    int64_t j = 0;
    for (; j + 8 <= nk; j += 8) {
        __m512 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm512_setzero_ps();
        const float *kr = Kr + j * D;
        for (int64_t d = 0; d < D; d++) {
            const __m512 q = _mm512_loadu_ps(Qt + d * 16);
            for (int u = 0; u < 8; u++) a[u] = _mm512_fmadd_ps(q, _mm512_set1_ps(kr[u * D + d]), a[u]);
        }
        for (int u = 0; u < 8; u++) _mm512_storeu_ps(S + (j + u) * 16, a[u]);
    }
    for (; j < nk; j++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        const float *kr = Kr + j * D;
        int64_t d = 0;
        for (; d + 2 <= D; d += 2) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(Qt + d * 16), _mm512_set1_ps(kr[d]), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(Qt + d * 16 + 16), _mm512_set1_ps(kr[d + 1]), a1);
        }
        if (d < D) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(Qt + d * 16), _mm512_set1_ps(kr[d]), a0);
        _mm512_storeu_ps(S + j * 16, _mm512_add_ps(a0, a1));
    }
    /* lanes' visible keys: first[i] <= j <= last[i] */
    const __m512i f0 = _mm512_loadu_si512((const void *)first), f1 = _mm512_loadu_si512((const void *)(first + 8));
    const __m512i l0 = _mm512_loadu_si512((const void *)last), l1 = _mm512_loadu_si512((const void *)(last + 8));
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mx = ninf;
    for (j = 0; j < nk; j++) {
        const __m512i jv = _mm512_set1_epi64(j);
        const __mmask8 k0 = _mm512_cmple_epi64_mask(f0, jv) & _mm512_cmpge_epi64_mask(l0, jv);
        const __mmask8 k1 = _mm512_cmple_epi64_mask(f1, jv) & _mm512_cmpge_epi64_mask(l1, jv);
        const __mmask16 keep = (__mmask16)(k0 | ((unsigned)k1 << 8));
        __m512 sv = _mm512_loadu_ps(S + j * 16);
        if (softcap > 0.0f) {
            float t[16];
            _mm512_storeu_ps(t, sv);
            for (int i = 0; i < 16; i++) t[i] = softcap * tanhf(t[i] / softcap);
            sv = _mm512_loadu_ps(t);
        }
        sv = _mm512_mask_mov_ps(ninf, keep, sv);
        _mm512_storeu_ps(S + j * 16, sv);
        mx = _mm512_max_ps(mx, sv);
    }
    mx = _mm512_mask_mov_ps(mx, _mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < nk; j++) {
        const __m512 v = _mm512_sub_ps(_mm512_loadu_ps(S + j * 16), mx);
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), exp512(v));
        _mm512_storeu_ps(S + j * 16, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f), sum);
    if (ml) {
        _mm512_storeu_ps(ml, mx);
        _mm512_storeu_ps(ml + 16, sum);
        inv = _mm512_set1_ps(1.0f);
    }
    int64_t d0 = 0;
    for (; d0 + 16 <= D; d0 += 16) {
        __m512 o[16];
        for (int u = 0; u < 16; u++) o[u] = _mm512_setzero_ps();
        for (j = 0; j < nk; j++) {
            const __m512 p = _mm512_loadu_ps(S + j * 16);
            const float *vr = Vr + j * D + d0;
            for (int u = 0; u < 16; u++) o[u] = _mm512_fmadd_ps(p, _mm512_set1_ps(vr[u]), o[u]);
        }
        for (int u = 0; u < 16; u++) _mm512_storeu_ps(Ot + (d0 + u) * 16, _mm512_mul_ps(o[u], inv));
    }
    for (; d0 < D; d0++) {
        __m512 o = _mm512_setzero_ps();
        for (j = 0; j < nk; j++) o = _mm512_fmadd_ps(_mm512_loadu_ps(S + j * 16), _mm512_set1_ps(Vr[j * D + d0]), o);
        _mm512_storeu_ps(Ot + d0 * 16, _mm512_mul_ps(o, inv));
    }
}

static void hv_act_mul(const float *g, const float *u, float *out, int64_t n, int act) {
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f), two = _mm512_set1_ps(2.0f);
    const __m512 c = _mm512_set1_ps(0.7978845608028654f), c3 = _mm512_set1_ps(0.044715f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(k, g + i), uu = u ? _mm512_maskz_loadu_ps(k, u + i) : one;
        __m512 a;
        if (act == 0) {
            a = _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        } else if (act == 1) { /* tanh(z) = 1 - 2 / (e^2z + 1) */
            const __m512 z = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(c3, x), _mm512_mul_ps(x, x), x));
            const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(exp512(_mm512_mul_ps(two, z)), one)));
            a = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, th));
        } else { /* erf GELU: mr_erf_as (A&S 7.1.26) of x / sqrt(2), 16 lanes at a time */
            const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
            const __m512 az = _mm512_abs_ps(z);
            const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), az, one));
            __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
            p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
            p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
            p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
            p = _mm512_mul_ps(p, t);
            const __m512 e = _mm512_fnmadd_ps(p, exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), az), az)), one);
            const __m512 erf = _mm512_mask_sub_ps(e, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ),
                                                  _mm512_setzero_ps(), e);
            a = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, erf));
        }
        _mm512_mask_storeu_ps(out + i, k, u ? _mm512_mul_ps(a, uu) : a);
    }
}

/* mr_kv_rotate for n >= 16: the same butterflies in the same order, so the same floats. Stages
 * h = 1, 2, 4, 8 inside each 16-float vector: t = y with lanes j and j ^ h swapped, then lane j is
 * t + y (= y[j] + y[j + h]) where bit h of j is clear and t - y (= y[j - h] - y[j]) where it is set;
 * stages h >= 16 between vectors; then the scale. x: len floats, len a multiple of n. */
static void hv_fwht(float *x, int64_t len, int64_t n) {
    const float s = 1.0f / sqrtf((float)n);
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t r = 0; r + n <= len; r += n) {
        float *y = x + r;
        for (int64_t j = 0; j < n; j += 16) {
            __m512 v = _mm512_loadu_ps(y + j);
            v = _mm512_mask_sub_ps(_mm512_add_ps(_mm512_permute_ps(v, 0xB1), v), 0xAAAA, _mm512_permute_ps(v, 0xB1), v);
            v = _mm512_mask_sub_ps(_mm512_add_ps(_mm512_permute_ps(v, 0x4E), v), 0xCCCC, _mm512_permute_ps(v, 0x4E), v);
            __m512 t = _mm512_shuffle_f32x4(v, v, 0xB1);
            v = _mm512_mask_sub_ps(_mm512_add_ps(t, v), 0xF0F0, t, v);
            t = _mm512_shuffle_f32x4(v, v, 0x4E);
            v = _mm512_mask_sub_ps(_mm512_add_ps(t, v), 0xFF00, t, v);
            _mm512_storeu_ps(y + j, v);
        }
        for (int64_t h = 16; h < n; h *= 2)
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j += 16) {
                    const __m512 a = _mm512_loadu_ps(y + j), b = _mm512_loadu_ps(y + j + h);
                    _mm512_storeu_ps(y + j, _mm512_add_ps(a, b));
                    _mm512_storeu_ps(y + j + h, _mm512_sub_ps(a, b));
                }
        for (int64_t j = 0; j < n; j += 16) _mm512_storeu_ps(y + j, _mm512_mul_ps(_mm512_loadu_ps(y + j), sv));
    }
}

/* K->ssm_rows (Mamba-2's scan, one token of one head; see generic_impl.h) with R rows at a time: each chunk
 * of B and C is loaded once for the R rows and the rows' accumulators are independent (one row alone waits
 * on the FMA latency: 0.26 s of Granite 4.0-H-350M's 1.5 s pp512 before), one 4-way reduction per 4 rows. */
MR_INLINE void ssm_rows_r(const int R, float *S, const float *x, const float *B, const float *C, float dA, float dt,
                          int64_t N, float *y) {
    __m512 acc[4], xd[4];
    const __m512 a = _mm512_set1_ps(dA);
    for (int r = 0; r < R; r++) {
        acc[r] = _mm512_setzero_ps();
        xd[r] = _mm512_set1_ps(x[r] * dt);
    }
    for (int64_t i = 0; i < N; i += 16) {
        const __mmask16 m = N - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - i)) - 1);
        const __m512 b = _mm512_maskz_loadu_ps(m, B + i), c = _mm512_maskz_loadu_ps(m, C + i);
        for (int r = 0; r < R; r++) {
            float *s = S + r * N + i;
            const __m512 v = _mm512_fmadd_ps(xd[r], b, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s), a));
            _mm512_mask_storeu_ps(s, m, v);
            acc[r] = _mm512_fmadd_ps(v, c, acc[r]);
        }
    }
    if (R == 4) _mm_storeu_ps(y, reduce4(acc[0], acc[1], acc[2], acc[3]));
    else
        for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(acc[r]);
}

static void ssm_rows4(float *S, const float *x, const float *B, const float *C, float dA, float dt, int64_t P,
                      int64_t N, float *y) {
    int64_t p = 0;
    for (; p + 4 <= P; p += 4) ssm_rows_r(4, S + p * N, x + p, B, C, dA, dt, N, y + p);
    for (; p < P; p++) ssm_rows_r(1, S + p * N, x + p, B, C, dA, dt, N, y + p);
}

void mr_init_avx512(mr_kernels *k) {
    mr_fill_generic_avx512(k);
    k->ssm_rows = ssm_rows4;
    k->dq[GT_F16] = hv_dq_f16;
    k->dq[GT_BF16] = hv_dq_bf16;
    k->dq[GT_Q4_0] = dqv_q4_0;
    k->dq[GT_Q4_1] = dqv_q4_1;
    k->dq[GT_Q5_0] = dqv_q5_0;
    k->dq[GT_Q5_1] = dqv_q5_1;
    k->dq[GT_Q8_0] = dqv_q8_0;
    k->dq[GT_IQ4_NL] = dqv_iq4_nl;
    k->dq[GT_Q4_K] = dqv_q4_k;
    k->dq[GT_Q5_K] = dqv_q5_k;
    k->dq[GT_Q6_K] = dqv_q6_k;
    k->dq[GT_IQ4_XS] = dqv_iq4_xs;
    k->vint[GT_Q4_0] = vint_q4_0;
    k->vint[GT_Q4_1] = vint_q4_1;
    k->vint[GT_Q5_0] = vint_q5_0;
    k->vint[GT_Q5_1] = vint_q5_1;
    k->vint[GT_Q8_0] = vint_q8_0;
    k->vint[GT_IQ4_NL] = vint_iq4_nl;
    k->vint[GT_Q4_K] = vint_q4_k;
    k->vint[GT_Q5_K] = vint_q5_k;
    k->vint[GT_Q6_K] = vint_q6_k;
    k->vint[GT_IQ4_XS] = vint_iq4_xs;
    k->dq[GT_MXFP4] = dqv_mxfp4;
    k->dq[GT_Q3_K] = dqv_q3_k;
    k->dq[GT_Q2_K] = dqv_q2_k;
    mr_avx2_lowbit_rows(k); /* the low-bit types' row kernels: the fallback where x86_avx512_gemv.c's
                             * kernels (all of these types) lack their activation layout */
    k->xpair[GT_Q4_0] = k->xpair[GT_Q4_1] = k->xpair[GT_Q5_0] = k->xpair[GT_Q5_1] = k->xpair[GT_IQ4_NL] = 1;
    k->quant_x = hv_quant_x;
    k->fwht = hv_fwht;
    k->dot_f32 = hv_dot_f32;
    k->tile = hv_tile;
    k->pack = hv_pack;
    k->panel = hv_panel;
    k->f16_to_f32 = hv_f16_to_f32;
    k->act_mul = hv_act_mul;
    k->vexp = hv_vexp;
    k->softmax = hv_softmax;
    k->attn_block = hv_attn_block;
    k->attn_dec = hv_attn_dec;
    k->attn_dec_h = hv_attn_dec_h;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif /* MR_X86 */
