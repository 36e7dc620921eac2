/* AVX2 + FMA + F16C kernels (any x86-64 since Haswell / Zen), under a target pragma.
 *
 * Integer path: int16 weights x int16 activations with vpmaddwd (pairs summed into int32), one
 * float scale per 32-block applied after converting the int32 partial sums, as on AVX-512. */
#include "common.h"

#ifdef MR_X86
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define MR_SFX(name) name##_avx2
#define MR_VLEN 8
#include "generic_impl.h"

mr_kernels mr_kernels_avx2;

MR_INLINE float f16s(const uint8_t *p) { return _cvtsh_ss(mr_rd16(p)); }

MR_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

MR_INLINE __m256i nib32(const uint8_t *p) {
    const __m128i r = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(r, 4), r), _mm256_set1_epi8(15));
}

/* bit i of the 32-bit word at p -> byte i = 0xff (ggml bytes_from_bits_32) */
MR_INLINE __m256i bits32(const uint8_t *p) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)mr_rd32(p)), shuf);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

/* 32 int8 weights (ymm) . 32 int16 activations -> 8 int32 lanes */
MR_INLINE __m256i dp32s(__m256i w8, const int16_t *x) {
    const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w8));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w8, 1));
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}
/* same with unsigned bytes */
MR_INLINE __m256i dp32u(__m256i w8, const int16_t *x) {
    const __m256i lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w8));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w8, 1));
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* unpack 32-blocks to 32 int8 weights (signed, or unsigned for the min types) */
MR_INLINE __m256i up_q4_0(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = 0.0f;
    return _mm256_sub_epi8(nib32(b + 2), _mm256_set1_epi8(8));
}
MR_INLINE __m256i up_q4_1(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = f16s(b + 2);
    return nib32(b + 4);
}
MR_INLINE __m256i up_q5_0(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = 0.0f;
    return _mm256_sub_epi8(nib32(b + 6), _mm256_andnot_si256(bits32(b + 2), _mm256_set1_epi8(16)));
}
MR_INLINE __m256i up_q5_1(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = f16s(b + 2);
    return _mm256_or_si256(nib32(b + 8), _mm256_and_si256(bits32(b + 4), _mm256_set1_epi8(16)));
}
MR_INLINE __m256i up_q8_0(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = 0.0f;
    return _mm256_loadu_si256((const __m256i *)(b + 2));
}
MR_INLINE __m256i up_iq4_nl(const uint8_t *b, float *d, float *m) {
    *d = f16s(b); *m = 0.0f;
    const __m128i t = _mm_loadu_si128((const __m128i *)mr_kvalues_iq4nl);
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib32(b + 2));
}

MR_INLINE __m256i up_mxfp4(const uint8_t *b, float *d, float *m) {
    *d = mr_e8m0_half(b[0]); *m = 0.0f;
    const __m128i t = _mm_loadu_si128((const __m128i *)mr_kvalues_mxfp4);
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib32(b + 1));
}

#define NACC(NT) ((NT) == 1 ? 4 : ((NT) == 2 ? 2 : 1))

#define DEF_VINT32(NAME, BYTES, UNPACK, DP, HAS_MIN)                                                         \
    MR_INLINE void NAME##_nt(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd,                 \
                             const float *xs, int64_t xqs, int64_t xbs, const int NT, float *out) {           \
        __m256 acc[MR_NT_INT][4];                                                                              \
        float msum[MR_NT_INT];                                                                                 \
        for (int t = 0; t < NT; t++) {                                                                         \
            msum[t] = 0.0f;                                                                                    \
            for (int a = 0; a < NACC(NT); a++) acc[t][a] = _mm256_setzero_ps();                                \
        }                                                                                                      \
        int64_t b = 0;                                                                                         \
        for (; b + NACC(NT) <= nb; b += NACC(NT)) {                                                            \
            for (int a = 0; a < NACC(NT); a++) {                                                               \
                float d, m;                                                                                    \
                const __m256i wv = UNPACK(w + (b + a) * BYTES, &d, &m);                                        \
                for (int t = 0; t < NT; t++) {                                                                 \
                    const __m256i p = DP(wv, xq + t * xqs + 32 * (b + a));                                     \
                    acc[t][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[t * xbs + b + a]), \
                                                acc[t][a]);                                                    \
                    if (HAS_MIN) msum[t] += m * xs[t * xbs + b + a];                                           \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (; b < nb; b++) {                                                                                  \
            float d, m;                                                                                        \
            const __m256i wv = UNPACK(w + b * BYTES, &d, &m);                                                  \
            for (int t = 0; t < NT; t++) {                                                                     \
                const __m256i p = DP(wv, xq + t * xqs + 32 * b);                                               \
                acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[t * xbs + b]), acc[t][0]); \
                if (HAS_MIN) msum[t] += m * xs[t * xbs + b];                                                   \
            }                                                                                                  \
        }                                                                                                      \
        for (int t = 0; t < NT; t++) {                                                                         \
            __m256 s = acc[t][0];                                                                              \
            for (int a = 1; a < NACC(NT); a++) s = _mm256_add_ps(s, acc[t][a]);                                \
            out[t] = hsum256(s) + msum[t];                                                                     \
        }                                                                                                      \
    }                                                                                                          \
    static void NAME(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd, const float *xs,        \
                     int64_t xqs, int64_t xbs, int nt, float *out) {                                           \
        switch (nt) {                                                                                          \
        case 1: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 1, out); break;                                         \
        case 2: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 2, out); break;                                         \
        case 3: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 3, out); break;                                         \
        default: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 4, out); break;                                        \
        }                                                                                                      \
    }

DEF_VINT32(vint_q4_0, 18, up_q4_0, dp32s, 0)
DEF_VINT32(vint_q4_1, 20, up_q4_1, dp32u, 1)
DEF_VINT32(vint_q5_0, 22, up_q5_0, dp32s, 0)
DEF_VINT32(vint_q5_1, 24, up_q5_1, dp32u, 1)
DEF_VINT32(vint_q8_0, 34, up_q8_0, dp32s, 0)
DEF_VINT32(vint_iq4_nl, 18, up_iq4_nl, dp32s, 0)
DEF_VINT32(vint_mxfp4, 17, up_mxfp4, dp32s, 0)

/* ---------------- Q4_K and Q6_K ---------------- */

MR_INLINE void scales_q4k(const uint8_t *b, float *s, float *m) {
    const float d = f16s(b), dmin = f16s(b + 2);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, mn;
        mr_scale_min_k4(j, b + 4, &sc, &mn);
        s[j] = d * sc;
        m[j] = -dmin * mn;
    }
}

MR_INLINE void vint_q4_k_nt(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd, const float *xs,
                            int64_t xqs, int64_t xbs, const int NT, float *out) {
    __m256 acc[MR_NT_INT][2];
    float msum[MR_NT_INT];
    for (int t = 0; t < NT; t++) { acc[t][0] = acc[t][1] = _mm256_setzero_ps(); msum[t] = 0.0f; }
    for (int64_t ib = 0; ib < nb32 / 8; ib++) {
        const uint8_t *b = w + 144 * ib;
        float s[8], m[8];
        scales_q4k(b, s, m);
        for (int t = 0; t < NT; t++)
            for (int j = 0; j < 8; j++) msum[t] += m[j] * xs[t * xbs + 8 * ib + j];
        for (int c = 0; c < 4; c++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * c));
            const __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(15));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
            for (int t = 0; t < NT; t++) {
                const int16_t *xt = xq + t * xqs + 256 * ib + 64 * c;
                const float *dt = xd + t * xbs + 8 * ib + 2 * c;
                acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp32u(lo, xt)), _mm256_set1_ps(s[2 * c] * dt[0]), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp32u(hi, xt + 32)), _mm256_set1_ps(s[2 * c + 1] * dt[1]),
                                            acc[t][1]);
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum256(_mm256_add_ps(acc[t][0], acc[t][1])) + msum[t];
}

/* Q6_K: weights (q - 32) in int8, widened to int16 and multiplied by their per-16 int8 scale */
MR_INLINE void vint_q6_k_nt(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd, const float *xs,
                            int64_t xqs, int64_t xbs, const int NT, float *out) {
    (void)xs;
    __m256 acc[MR_NT_INT][2];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
    for (int64_t ib = 0; ib < nb32 / 8; ib++) {
        const uint8_t *b = w + 210 * ib;
        const float d = f16s(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++) {
            const __m256i A = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            const __m256i B = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i Q = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_and_si256(_mm256_slli_epi16(Q, 4), m30));
            q[1] = _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_and_si256(_mm256_slli_epi16(Q, 2), m30));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(Q, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4),
                                   _mm256_and_si256(_mm256_srli_epi16(Q, 2), m30));
            for (int i = 0; i < 4; i++) {
                const int j = 4 * h + i;
                const __m256i v = _mm256_sub_epi8(q[i], c32);
                const __m256i lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                                                      _mm256_set1_epi16(sc[2 * j]));
                const __m256i hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
                                                      _mm256_set1_epi16(sc[2 * j + 1]));
                for (int t = 0; t < NT; t++) {
                    const int16_t *xt = xq + t * xqs + 256 * ib + 32 * j;
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xt)),
                                                       _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xt + 16))));
                    acc[t][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[t * xbs + 8 * ib + j]),
                                                    acc[t][j & 1]);
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum256(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/* Q3_K (hmask[32] @0 | qs[64] @32 | scales[12] @96 | d @108): int8 q - 4 * (high bit clear), widened
 * and multiplied by the signed per-16 scale (|.| <= 128). */
MR_INLINE void vint_q3_k_nt(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd, const float *xs,
                            int64_t xqs, int64_t xbs, const int NT, float *out) {
    (void)xs;
    __m256 acc[MR_NT_INT][2];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3), c4 = _mm256_set1_epi8(4), zero = _mm256_setzero_si256();
    for (int64_t ib = 0; ib < nb32 / 8; ib++) {
        const uint8_t *b = w + 110 * ib;
        const float d = f16s(b + 108);
        int16_t sc[16];
        mr_q3k_scales(b + 96, sc);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        for (int h = 0; h < 2; h++) {
            const __m256i Q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int j = 4 * h + s;
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(Q, 2 * s), m3);
                const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, _mm256_set1_epi8((char)(1 << j))), zero);
                const __m256i v = _mm256_sub_epi8(q, _mm256_and_si256(clear, c4));
                const __m256i lo = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                                                      _mm256_set1_epi16(sc[2 * j]));
                const __m256i hi = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
                                                      _mm256_set1_epi16(sc[2 * j + 1]));
                for (int t = 0; t < NT; t++) {
                    const int16_t *xt = xq + t * xqs + 256 * ib + 32 * j;
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xt)),
                                                       _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xt + 16))));
                    acc[t][j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[t * xbs + 8 * ib + j]),
                                                    acc[t][j & 1]);
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum256(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/* Q2_K (scales[16] @0 | qs[64] @16 | d @80 | dmin @82): q * sc_g in int16, and the mins through a
 * second dot product of the activations with m_g (value = d * sc_g * q - dmin * m_g). */
MR_INLINE void vint_q2_k_nt(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd, const float *xs,
                            int64_t xqs, int64_t xbs, const int NT, float *out) {
    (void)xs;
    __m256 acc[MR_NT_INT][2];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t ib = 0; ib < nb32 / 8; ib++) {
        const uint8_t *b = w + 84 * ib;
        const float d = f16s(b + 80), dmin = f16s(b + 82);
        for (int h = 0; h < 2; h++) {
            const __m256i Q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int j = 4 * h + s;
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(Q, 2 * s), m3);
                const uint8_t g0 = b[2 * j], g1 = b[2 * j + 1];
                const __m256i lo = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), _mm256_set1_epi16(g0 & 15));
                const __m256i hi = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), _mm256_set1_epi16(g1 & 15));
                const __m256i mlo = _mm256_set1_epi16(g0 >> 4), mhi = _mm256_set1_epi16(g1 >> 4);
                for (int t = 0; t < NT; t++) {
                    const int16_t *xt = xq + t * xqs + 256 * ib + 32 * j;
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)xt), x1 = _mm256_loadu_si256((const __m256i *)(xt + 16));
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
                    const __m256i pm = _mm256_add_epi32(_mm256_madd_epi16(mlo, x0), _mm256_madd_epi16(mhi, x1));
                    const float xdt = xd[t * xbs + 8 * ib + j];
                    acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xdt), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * xdt), acc[t][1]);
                }
            }
        }
    }
    for (int t = 0; t < NT; t++) out[t] = hsum256(acc[t][0]) - hsum256(acc[t][1]);
}

#define DEF_SWITCH(NAME)                                                                                     \
    static void NAME(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd, const float *xs,        \
                     int64_t xqs, int64_t xbs, int nt, float *out) {                                           \
        switch (nt) {                                                                                          \
        case 1: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 1, out); break;                                         \
        case 2: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 2, out); break;                                         \
        case 3: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 3, out); break;                                         \
        default: NAME##_nt(w, nb, xq, xd, xs, xqs, xbs, 4, out); break;                                        \
        }                                                                                                      \
    }
DEF_SWITCH(vint_q4_k)
DEF_SWITCH(vint_q6_k)
DEF_SWITCH(vint_q3_k)
DEF_SWITCH(vint_q2_k)

/* ---------------- i-quants, TQ1_0 and TQ2_0: 32 int8 weights per 32-element group ----------------
 * (see x86_avx512.c: the same groups, signs applied with vpsignb from a bit mask) */

MR_INLINE __m256i lb_signed8(__m256i mag, uint32_t neg) {
    const __m256i bits = _mm256_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128,
                                          1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)neg),
                                              _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                               2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i is_neg = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bits), bits);
    return _mm256_sign_epi8(mag, _mm256_or_si256(is_neg, _mm256_set1_epi8(1)));
}
MR_INLINE __m256i grid64x4(const uint64_t *grid, int i0, int i1, int i2, int i3) {
    return _mm256_set_epi64x((long long)grid[i3], (long long)grid[i2], (long long)grid[i1], (long long)grid[i0]);
}
MR_INLINE float iq_half4(float d, int s) { return d * (0.5f + (float)s) * 0.25f; }
MR_INLINE uint32_t ksigns4(uint32_t aux) {
    return (uint32_t)mr_iq_ksign(aux, 0) | (uint32_t)mr_iq_ksign(aux, 1) << 8 | (uint32_t)mr_iq_ksign(aux, 2) << 16 |
           (uint32_t)mr_iq_ksign(aux, 3) << 24;
}
MR_INLINE __m256i iq1_w8(__m256i grid8, __m256i off) { /* 8 * grid (-1, 0, 1) + off, in bytes */
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(grid8, 3), _mm256_set1_epi8((char)0xF8)), off);
}

MR_INLINE __m256i g8_iq2_xxs(const uint8_t *b, int g, float d, float *s0, float *s1) {
    const uint8_t *q = b + 2 + 8 * g;
    const uint32_t aux = mr_rd32(q + 4);
    *s0 = *s1 = iq_half4(d, (int)(aux >> 28));
    return lb_signed8(grid64x4(mr_iq2xxs_grid, q[0], q[1], q[2], q[3]), ksigns4(aux));
}
MR_INLINE __m256i g8_iq2_xs(const uint8_t *b, int g, float d, float *s0, float *s1) {
    *s0 = iq_half4(d, b[66 + g] & 15);
    *s1 = iq_half4(d, b[66 + g] >> 4);
    int gi[4];
    uint32_t neg = 0;
    for (int l = 0; l < 4; l++) {
        const uint16_t q = mr_rd16(b + 2 + 2 * (4 * g + l));
        const uint32_t v = q >> 9;
        gi[l] = q & 511;
        neg |= (v | ((uint32_t)__builtin_parity(v) << 7)) << (8 * l);
    }
    return lb_signed8(grid64x4(mr_iq2xs_grid, gi[0], gi[1], gi[2], gi[3]), neg);
}
MR_INLINE __m256i g8_iq2_s(const uint8_t *b, int g, float d, float *s0, float *s1) {
    *s0 = iq_half4(d, b[74 + g] & 15);
    *s1 = iq_half4(d, b[74 + g] >> 4);
    const int qh = b[66 + g];
    const uint8_t *q = b + 2 + 4 * g;
    return lb_signed8(grid64x4(mr_iq2s_grid, q[0] | (qh & 3) << 8, q[1] | ((qh >> 2) & 3) << 8,
                               q[2] | ((qh >> 4) & 3) << 8, q[3] | ((qh >> 6) & 3) << 8),
                      mr_rd32(b + 34 + 4 * g));
}
MR_INLINE __m256i g8_iq3_xxs(const uint8_t *b, int g, float d, float *s0, float *s1) {
    const uint32_t aux = mr_rd32(b + 66 + 4 * g);
    *s0 = *s1 = d * (0.5f + (float)(aux >> 28)) * 0.5f;
    const uint8_t *q = b + 2 + 8 * g;
    const __m256i mag = _mm256_set_epi32((int)mr_iq3xxs_grid[q[7]], (int)mr_iq3xxs_grid[q[6]], (int)mr_iq3xxs_grid[q[5]],
                                         (int)mr_iq3xxs_grid[q[4]], (int)mr_iq3xxs_grid[q[3]], (int)mr_iq3xxs_grid[q[2]],
                                         (int)mr_iq3xxs_grid[q[1]], (int)mr_iq3xxs_grid[q[0]]);
    return lb_signed8(mag, ksigns4(aux));
}
MR_INLINE __m256i g8_iq3_s(const uint8_t *b, int g, float d, float *s0, float *s1) {
    *s0 = *s1 = d * (float)(1 + 2 * ((b[106 + g / 2] >> (4 * (g % 2))) & 15));
    const uint8_t *q = b + 2 + 8 * g;
    const int qh = b[66 + g];
    int e[8];
    for (int k = 0; k < 8; k++) e[k] = (int)mr_iq3s_grid[q[k] | ((qh >> k) & 1) << 8];
    return lb_signed8(_mm256_set_epi32(e[7], e[6], e[5], e[4], e[3], e[2], e[1], e[0]), mr_rd32(b + 74 + 4 * g));
}
MR_INLINE __m256i g8_iq1_s(const uint8_t *b, int g, float d, float *s0, float *s1) {
    const uint16_t h = mr_rd16(b + 34 + 2 * g);
    *s0 = *s1 = d * (float)(2 * ((h >> 12) & 7) + 1) * 0.125f;
    const uint8_t *q = b + 2 + 4 * g;
    return iq1_w8(grid64x4(mr_iq1s_grid, q[0] | (h & 7) << 8, q[1] | ((h >> 3) & 7) << 8, q[2] | ((h >> 6) & 7) << 8,
                           q[3] | ((h >> 9) & 7) << 8),
                  _mm256_set1_epi8(h & 0x8000 ? -1 : 1));
}
MR_INLINE __m256i g8_iq1_m(const uint8_t *b, int g, float d, float *s0, float *s1) {
    const uint16_t s = mr_rd16(b + 48 + 2 * (g / 2));
    const int k = 2 * g;
    *s0 = d * (float)(2 * ((s >> (3 * (k % 4))) & 7) + 1) * 0.125f;
    *s1 = d * (float)(2 * ((s >> (3 * ((k + 1) % 4))) & 7) + 1) * 0.125f;
    const uint8_t *q = b + 4 * g;
    const int n0 = b[32 + 2 * g] & 15, n1 = b[32 + 2 * g] >> 4, n2 = b[33 + 2 * g] & 15, n3 = b[33 + 2 * g] >> 4;
    const __m256i off = _mm256_set_epi64x(n3 & 8 ? -1LL : 0x0101010101010101LL, n2 & 8 ? -1LL : 0x0101010101010101LL,
                                          n1 & 8 ? -1LL : 0x0101010101010101LL, n0 & 8 ? -1LL : 0x0101010101010101LL);
    return iq1_w8(grid64x4(mr_iq1s_grid, q[0] | (n0 & 7) << 8, q[1] | (n1 & 7) << 8, q[2] | (n2 & 7) << 8,
                           q[3] | (n3 & 7) << 8),
                  off);
}
MR_INLINE __m256i g8_tq2_0(const uint8_t *b, int g, float d, float *s0, float *s1) {
    *s0 = *s1 = d;
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 32 * (g / 4)));
    return _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(raw, 2 * (g % 4)), _mm256_set1_epi8(3)), _mm256_set1_epi8(1));
}
/* TQ1_0 (qs[48] @0 | qh[4] @48 | d @52): the n-th base-3 digit of a byte q is ((uint8_t)(q * 3^n) * 3) >> 8.
 * Per 16-bit lane p holds 3^n for both of its bytes; the products wrap at 256 in the byte that keeps them. */
MR_INLINE __m256i tq1_digits(__m256i q, __m256i p) {
    const __m256i ev = _mm256_mullo_epi16(_mm256_and_si256(q, _mm256_set1_epi16(0x00FF)), p);
    const __m256i od = _mm256_mullo_epi16(_mm256_and_si256(q, _mm256_set1_epi16((short)0xFF00)), p);
    const __m256i de = _mm256_mulhi_epu16(_mm256_slli_epi16(ev, 8), _mm256_set1_epi16(3));
    const __m256i dod = _mm256_mulhi_epu16(od, _mm256_set1_epi16(3));
    return _mm256_or_si256(de, _mm256_slli_epi16(dod, 8));
}
/* Groups 0-4: digit g of qs[0..32); 5 and 6: digits 2g-10 and 2g-9 of qs[32..48) in the low and high
 * lane; 7: digit 4 of qs[32..48), then qh's digits 0-3 (element 240 + 4n + j is digit n of qh[j]). */
MR_INLINE __m256i g8_tq1_0(const uint8_t *b, int g, float d, float *s0, float *s1) {
    static const short pw3[5] = {1, 3, 9, 27, 81};
    *s0 = *s1 = d;
    __m256i q, p;
    if (g < 5) {
        q = _mm256_loadu_si256((const __m256i *)b);
        p = _mm256_set1_epi16(pw3[g]);
    } else if (g < 7) {
        q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 32)));
        p = _mm256_set_m128i(_mm_set1_epi16(pw3[2 * g - 9]), _mm_set1_epi16(pw3[2 * g - 10]));
    } else {
        q = _mm256_set_m128i(_mm_set1_epi32((int)mr_rd32(b + 48)), _mm_loadu_si128((const __m128i *)(b + 32)));
        p = _mm256_setr_epi16(81, 81, 81, 81, 81, 81, 81, 81, 1, 1, 3, 3, 9, 9, 27, 27);
    }
    return _mm256_sub_epi8(tq1_digits(q, p), _mm256_set1_epi8(1));
}

MR_INLINE float lb_d(const uint8_t *b, const int TYPE) {
    if (TYPE == GT_TQ2_0) return f16s(b + 64);
    if (TYPE == GT_TQ1_0) return f16s(b + 52);
    if (TYPE == GT_IQ1_M) return mr_iq1m_d(b);
    return f16s(b);
}

#define DEF_VLB(NAME, BYTES, TYPE, GROUP)                                                                    \
    MR_INLINE void NAME##_nt(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd,               \
                             const float *xs, int64_t xqs, int64_t xbs, const int NT, float *out) {           \
        (void)xs;                                                                                              \
        __m256 acc[MR_NT_INT][2];                                                                              \
        for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();                              \
        for (int64_t ib = 0; ib < nb32 / 8; ib++) {                                                            \
            const uint8_t *b = w + ib * BYTES;                                                                 \
            const float d = lb_d(b, TYPE);                                                                     \
            for (int g = 0; g < 8; g++) {                                                                      \
                float s0, s1;                                                                                  \
                const __m256i v = GROUP(b, g, d, &s0, &s1);                                                    \
                const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));                            \
                const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));                       \
                for (int t = 0; t < NT; t++) {                                                                 \
                    const int16_t *xt = xq + t * xqs + 256 * ib + 32 * g;                                      \
                    const float xdt = xd[t * xbs + 8 * ib + g];                                                \
                    const __m256i p0 = _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xt));         \
                    const __m256i p1 = _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xt + 16)));  \
                    acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(s0 * xdt), acc[t][0]);  \
                    acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(s1 * xdt), acc[t][1]);  \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int t = 0; t < NT; t++) out[t] = hsum256(_mm256_add_ps(acc[t][0], acc[t][1]));                  \
    }                                                                                                          \
    DEF_SWITCH(NAME)

DEF_VLB(vint_iq2_xxs, 66, GT_IQ2_XXS, g8_iq2_xxs)
DEF_VLB(vint_iq2_xs, 74, GT_IQ2_XS, g8_iq2_xs)
DEF_VLB(vint_iq2_s, 82, GT_IQ2_S, g8_iq2_s)
DEF_VLB(vint_iq3_xxs, 98, GT_IQ3_XXS, g8_iq3_xxs)
DEF_VLB(vint_iq3_s, 110, GT_IQ3_S, g8_iq3_s)
DEF_VLB(vint_iq1_s, 50, GT_IQ1_S, g8_iq1_s)
DEF_VLB(vint_iq1_m, 56, GT_IQ1_M, g8_iq1_m)
DEF_VLB(vint_tq1_0, 54, GT_TQ1_0, g8_tq1_0)
DEF_VLB(vint_tq2_0, 66, GT_TQ2_0, g8_tq2_0)

/* ---------------- float kernels ---------------- */

static void hv_dq_f16(const uint8_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(mr_rd16(src + 2 * i));
}

#define DEF_DQ32(NAME, BYTES, UNPACK, CVT)                                                                   \
    static void NAME(const uint8_t *b, float *y, int64_t nb) {                                                 \
        for (int64_t i = 0; i < nb; i++) {                                                                     \
            float d, m;                                                                                        \
            const __m256i w = UNPACK(b + i * BYTES, &d, &m);                                                   \
            const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);                                       \
            for (int k = 0; k < 4; k++) {                                                                      \
                const __m128i part = k < 2 ? _mm256_castsi256_si128(w) : _mm256_extracti128_si256(w, 1);       \
                const __m128i p8 = (k & 1) ? _mm_srli_si128(part, 8) : part;                                   \
                const __m256 f = _mm256_cvtepi32_ps(CVT(p8));                                                  \
                _mm256_storeu_ps(y + 32 * i + 8 * k, _mm256_fmadd_ps(f, dv, mv));                              \
            }                                                                                                  \
        }                                                                                                      \
    }
DEF_DQ32(dqv_q4_0, 18, up_q4_0, _mm256_cvtepi8_epi32)
DEF_DQ32(dqv_q4_1, 20, up_q4_1, _mm256_cvtepu8_epi32)
DEF_DQ32(dqv_q5_0, 22, up_q5_0, _mm256_cvtepi8_epi32)
DEF_DQ32(dqv_q5_1, 24, up_q5_1, _mm256_cvtepu8_epi32)
DEF_DQ32(dqv_q8_0, 34, up_q8_0, _mm256_cvtepi8_epi32)
DEF_DQ32(dqv_iq4_nl, 18, up_iq4_nl, _mm256_cvtepi8_epi32)
DEF_DQ32(dqv_mxfp4, 17, up_mxfp4, _mm256_cvtepi8_epi32)

static void hv_dot_f32(const float *w, const float *x, int64_t xs, int64_t n, int nt, float *out) {
    __m256 a0[MR_NT_INT], a1[MR_NT_INT];
    for (int t = 0; t < MR_NT_INT; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int t = 0; t < nt; t++) {
            a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * xs + i), a0[t]);
            a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * xs + i + 8), a1[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        float s = hsum256(_mm256_add_ps(a0[t], a1[t]));
        for (int64_t k = i; k < n; k++) s += w[k] * x[t * xs + k];
        out[t] = s;
    }
}

/* 4 rows x 3 tokens register tile (12 ymm accumulators of the 16) */
MR_INLINE void micro_4x3(const float *wt, const float *x, int64_t xs, int64_t n, float *y, int64_t ys, int acc) {
    __m256 c[4][3];
    for (int r = 0; r < 4; r++) c[r][0] = c[r][1] = c[r][2] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(x + k), v1 = _mm256_loadu_ps(x + xs + k), v2 = _mm256_loadu_ps(x + 2 * xs + k);
        for (int r = 0; r < 4; r++) {
            const __m256 wr = _mm256_loadu_ps(wt + r * n + k);
            c[r][0] = _mm256_fmadd_ps(wr, v0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(wr, v1, c[r][1]);
            c[r][2] = _mm256_fmadd_ps(wr, v2, c[r][2]);
        }
    }
    for (int t = 0; t < 3; t++)
        for (int r = 0; r < 4; r++) {
            float s = hsum256(c[r][t]);
            for (int64_t kk = k; kk < n; kk++) s += wt[r * n + kk] * x[t * xs + kk];
            y[t * ys + r] = acc ? y[t * ys + r] + s : s;
        }
}

static void hv_tile(const float *wt, int nr, const float *x, int64_t xs, int ntk, int64_t n, float *y,
                      int64_t ys, int acc) {
    int r = 0;
    for (; r + 4 <= nr; r += 4) {
        int t = 0;
        for (; t + 3 <= ntk; t += 3) micro_4x3(wt + (int64_t)r * n, x + t * xs, xs, n, y + t * ys + r, ys, acc);
        for (; t < ntk; t++)
            for (int i = 0; i < 4; i++) {
                float o;
                hv_dot_f32(wt + (int64_t)(r + i) * n, x + t * xs, xs, n, 1, &o);
                y[t * ys + r + i] = acc ? y[t * ys + r + i] + o : o;
            }
    }
    for (; r < nr; r++)
        for (int t = 0; t < ntk; t++) {
            float o;
            hv_dot_f32(wt + (int64_t)r * n, x + t * xs, xs, n, 1, &o);
            y[t * ys + r] = acc ? y[t * ys + r] + o : o;
        }
}

/* e^x, |relative error| < 2e-7 (Cephes expf polynomial); 0 below e^-87 */
MR_INLINE __m256 exp256(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

static void hv_vexp(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp256(_mm256_loadu_ps(x + i)));
    if (i < n) {
        float t[8] = {0};
        memcpy(t, x + i, (size_t)(n - i) * 4);
        _mm256_storeu_ps(t, exp256(_mm256_loadu_ps(t)));
        memcpy(x + i, t, (size_t)(n - i) * 4);
    }
}

static void hv_softmax(float *x, int64_t n) { softmax_with_avx2(x, n, hv_vexp); }

static void hv_quant_x(const float *x, int64_t n, int16_t *q, float *d, float *s) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4], mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v[k], absmask));
            sm = _mm256_add_ps(sm, v[k]);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const __m256 iv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        __m256i qi[4];
        for (int k = 0; k < 4; k++) qi[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], iv));
        /* packs interleaves 128-bit lanes: fix the order with a permute */
        const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xd8);
        const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xd8);
        _mm256_storeu_si256((__m256i *)(q + 32 * b), p01);
        _mm256_storeu_si256((__m256i *)(q + 32 * b + 16), p23);
        s[b] = hsum256(sm);
        d[b] = isfinite(s[b]) ? amax / 32767.0f : NAN; /* a NaN / infinity (lost by max) reaches y */
    }
}

static void hv_f16_to_f32(const uint16_t *src, float *dst, int64_t n) { hv_dq_f16((const uint8_t *)src, dst, n); }

/* The row kernels of the low-bit types (they replace the portable multi-row kernels). The AVX-512
 * table takes them too: on an AMD EPYC (Zen 4) they beat 512-bit versions of
 * the same algorithms for MXFP4 (1.9x), Q3_K (1.7x) and the i-quants (1.0-1.25x), 1 and 2 threads
 * (bench/kernels.py --shape 4096x14336). For MXFP4 (int16) and Q3_K, Q2_K, TQ2_0 (int8 activations)
 * the AVX-512 table has multi-row decode kernels (x86_avx512_gemv.c) that beat these. */
void mr_avx2_lowbit_rows(mr_kernels *k) {
    k->vint[GT_MXFP4] = vint_mxfp4;
    k->vint[GT_Q3_K] = vint_q3_k;
    k->vint[GT_Q2_K] = vint_q2_k;
    k->vint[GT_IQ2_XXS] = vint_iq2_xxs;
    k->vint[GT_IQ2_XS] = vint_iq2_xs;
    k->vint[GT_IQ2_S] = vint_iq2_s;
    k->vint[GT_IQ3_XXS] = vint_iq3_xxs;
    k->vint[GT_IQ3_S] = vint_iq3_s;
    k->vint[GT_IQ1_S] = vint_iq1_s;
    k->vint[GT_IQ1_M] = vint_iq1_m;
    k->vint[GT_TQ1_0] = vint_tq1_0;
    k->vint[GT_TQ2_0] = vint_tq2_0;
    const int types[] = {GT_MXFP4, GT_Q3_K, GT_Q2_K, GT_IQ2_XXS, GT_IQ2_XS, GT_IQ2_S, GT_IQ3_XXS, GT_IQ3_S,
                         GT_IQ1_S, GT_IQ1_M, GT_TQ1_0, GT_TQ2_0};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        k->gemv[types[i]] = NULL; /* dispatch prefers a gemv kernel: drop the portable one */
        k->xpair[types[i]] = 0;   /* natural activation order */
    }
    /* the i-quants and TQ1_0 dequantize slowly: these row kernels beat the float tile / panel up to 16
     * tokens (2x at 16, 0.6x at 64; Intel Xeon, 1 thread, 4096 x 14336; the AVX-512 table then sets its
     * int8 kernels' own limits) */
    const int slow_dq[] = {GT_IQ2_XXS, GT_IQ2_XS, GT_IQ2_S, GT_IQ3_XXS, GT_IQ3_S, GT_IQ1_S, GT_IQ1_M, GT_TQ1_0};
    for (size_t i = 0; i < sizeof slow_dq / sizeof slow_dq[0]; i++) k->int_tokens[slow_dq[i]] = 16;
}

void mr_init_avx2(mr_kernels *k) {
    mr_fill_generic_avx2(k);
    k->dq[GT_F16] = hv_dq_f16;
    k->dq[GT_Q4_0] = dqv_q4_0;
    k->dq[GT_Q4_1] = dqv_q4_1;
    k->dq[GT_Q5_0] = dqv_q5_0;
    k->dq[GT_Q5_1] = dqv_q5_1;
    k->dq[GT_Q8_0] = dqv_q8_0;
    k->dq[GT_IQ4_NL] = dqv_iq4_nl;
    k->vint[GT_Q4_0] = vint_q4_0;
    k->vint[GT_Q4_1] = vint_q4_1;
    k->vint[GT_Q5_0] = vint_q5_0;
    k->vint[GT_Q5_1] = vint_q5_1;
    k->vint[GT_Q8_0] = vint_q8_0;
    k->vint[GT_IQ4_NL] = vint_iq4_nl;
    k->vint[GT_Q4_K] = vint_q4_k;
    k->vint[GT_Q6_K] = vint_q6_k;
    k->dq[GT_MXFP4] = dqv_mxfp4;
    mr_avx2_lowbit_rows(k);
    k->quant_x = hv_quant_x;
    k->vexp = hv_vexp;
    k->softmax = hv_softmax;
    k->dot_f32 = hv_dot_f32;
    k->tile = hv_tile;
    k->f16_to_f32 = hv_f16_to_f32;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif /* MR_X86 */
