/* Small AVX-512 helpers shared by x86_avx512.c, x86_avx512_gemv.c and x86_avx512_gemm.c. Include after the target
 * pragma of the including file (the functions take its instruction set) and after immintrin.h. */
#ifndef MR_X86_AVX512_INL_H
#define MR_X86_AVX512_INL_H

MR_INLINE float f16s(const uint8_t *p) { return _cvtsh_ss(mr_rd16(p)); }

/* 32 codes (0..15) -> their int8 values in a 16-entry codebook (IQ4_NL's, MXFP4's) */
MR_INLINE __m256i codebook32(const int8_t *book, __m256i nib) {
    const __m128i t = _mm_loadu_si128((const __m128i *)book);
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nib);
}
MR_INLINE __m256i iq4_lut(__m256i nib) { return codebook32(mr_kvalues_iq4nl, nib); }
MR_INLINE __m256i mxfp4_lut(__m256i nib) { return codebook32(mr_kvalues_mxfp4, nib); }

/* horizontal sum of 8 floats */
MR_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The nibbles of two 32-element blocks a, b -> lo = [a 0..15, b 0..15], hi = [a 16..31, b 16..31]
 * as int16 (the activations are interleaved the same way). */
MR_INLINE void nib_pair(const uint8_t *qa, const uint8_t *qb, __m512i *lo, __m512i *hi) {
    const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)qa)),
                                                _mm_loadu_si128((const __m128i *)qb), 1);
    const __m512i w16 = _mm512_cvtepu8_epi16(raw);
    *lo = _mm512_and_si512(w16, _mm512_set1_epi16(15));
    *hi = _mm512_srli_epi16(w16, 4);
}

/* the 5th bits of a pair, split like the nibbles: bits 0..15 of each -> lo mask, 16..31 -> hi mask */
MR_INLINE void hbits_pair(const uint8_t *ha, const uint8_t *hb, __mmask32 *klo, __mmask32 *khi) {
    const uint32_t a = mr_rd32(ha), b = mr_rd32(hb);
    *klo = (__mmask32)((a & 0xffffu) | (b << 16));
    *khi = (__mmask32)((a >> 16) | (b & 0xffff0000u));
}

/* 16 x 16 transpose in registers (three shuffle stages) */
MR_INLINE void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
    }
    /* r[4i + j] holds, in 128-bit lane L, column 4L + j of rows 4i..4i+3: transpose the lanes */
    for (int j = 0; j < 4; j++) {
        const __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44), u3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
        t[j] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
        t[8 + j] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* 64 bytes of P4 nibbles (pack.c) -> the 4 int16 vectors of one quad: half h, byte j holds elements
 * P(2h, j) (low nibble) and P(2h + 1, j) (high) */
MR_INLINE void pk_nib(const uint8_t *nb, __m512i v[4]) {
    const __m512i h0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)nb));
    const __m512i h1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(nb + 32)));
    const __m512i m4 = _mm512_set1_epi16(15);
    v[0] = _mm512_and_si512(h0, m4);
    v[1] = _mm512_srli_epi16(h0, 4);
    v[2] = _mm512_and_si512(h1, m4);
    v[3] = _mm512_srli_epi16(h1, 4);
}

/* quad Q (0, 1) of row r of a P4 Q6_K tile -> its 4 int16 vectors (vector k, lane j: element E6(k, j)), the
 * unsigned 6-bit values 0..63 (the -32 not applied) */
MR_INLINE void pk_q6k_quad(const uint8_t *tw, int r, int Q, __m512i v[4]) {
    pk_nib(tw + 72 + 128 * r + 64 * Q, v);
    const __m512i H = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(tw + 584 + 64 * r + 32 * Q)));
    const __m512i m30 = _mm512_set1_epi16(0x30);
    /* ternary logic 0xF8: a | (b & c) -- bits 2k, 2k+1 of H become bits 4, 5 of vector k */
    v[0] = _mm512_ternarylogic_epi32(v[0], _mm512_slli_epi16(H, 4), m30, 0xF8);
    v[1] = _mm512_ternarylogic_epi32(v[1], _mm512_slli_epi16(H, 2), m30, 0xF8);
    v[2] = _mm512_ternarylogic_epi32(v[2], H, m30, 0xF8);
    v[3] = _mm512_ternarylogic_epi32(v[3], _mm512_srli_epi16(H, 2), m30, 0xF8);
}

/* The integer GEMM's activation panel (mr_xp, common.h): nt rows of x (stride xs) quantized by the integer path's
 * quant_x (the same int16 values and scales as the decode kernels get), regrouped per 16 tokens and 32-block into
 * 1024 bytes at xp->q + (g nb + b) * 512, with d and ds (16 each). BYTES 0, the AVX-512 GEMM's
 * (x86_avx512_gemm.c): 16 column pairs x 16 tokens x 2 int16; BYTES 1, the AMX int8 GEMM's (x86_amx.c): each value
 * split into 256 hi + lo, hi bytes (8 rows x 16 tokens x 4: row k, token j = columns 4k..4k+3) then lo bytes the
 * same way. tmp: 9 * cols floats of scratch; padding tokens of a last group are zero. */
MR_INLINE void xp_panel(const float *x, int64_t nt, int64_t xs, int64_t cols, float *tmp, mr_xp *xp, const int BYTES) {
    const int64_t nb = cols / 32, ng = (nt + 15) / 16;
    int16_t *q = (int16_t *)tmp;                 /* (16, cols) */
    float *d = tmp + 8 * cols, *s = d + 16 * nb; /* (16, nb) each */
    uint8_t *out = (uint8_t *)xp->q;
    for (int64_t g = 0; g < ng; g++) {
        for (int j = 0; j < 16; j++) {
            const int64_t t = 16 * g + j;
            if (t < nt) mr_kernels_avx512.quant_x(x + t * xs, cols, q + j * cols, d + j * nb, s + j * nb);
            else { /* padding token: contributes nothing (its outputs are not written) */
                memset(q + j * cols, 0, (size_t)cols * 2);
                memset(d + j * nb, 0, (size_t)nb * 4);
            }
        }
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = g * nb + b;
            __m512 r[16];
            float sq[16], dd[16];
            for (int j = 0; j < 16; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(q + j * cols + 32 * b));
                sq[j] = d[j * nb + b] * (float)_mm512_reduce_add_epi32(_mm512_madd_epi16(v, _mm512_set1_epi16(1)));
                dd[j] = d[j * nb + b];
                if (BYTES) { /* dwords 0..7: the hi bytes of the block's columns in order, 8..15 the lo bytes */
                    const __m256i hi = _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)), lo = _mm512_cvtepi16_epi8(v);
                    r[j] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(hi), lo, 1));
                } else {
                    r[j] = _mm512_castsi512_ps(v);
                }
            }
            transpose16(r); /* r[k] lane j = dword k of token j */
            for (int k = 0; k < 16; k++) _mm512_storeu_ps((float *)(void *)(out + i * 1024 + 64 * k), r[k]);
            _mm512_storeu_ps(xp->d + i * 16, _mm512_loadu_ps(dd));
            _mm512_storeu_ps(xp->ds + i * 16, _mm512_loadu_ps(sq));
        }
    }
    xp->nb = nb;
    xp->ng = ng;
}

/* the sums of 4 vectors */
MR_INLINE __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#endif
