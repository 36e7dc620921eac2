/* The low-bit types MXFP4, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0, plus
 * Q2_K and Q3_K's integer kernels: one unpacker per type, shared by its dequantizer and its integer
 * decode kernel. Included by generic_impl.h (so compiled once per ISA, MR_SFX naming the copy); the
 * block layouts are documented with the numpy specs (minirt/quants/iquants.py, ternary.py, mxfp4.py,
 * kquants.py), written after ggml's dequantize_row_* (ggml-quants.c).
 *
 * An unpacker turns one block (256 elements; 32 for MXFP4) into small integer weights w[] (int16)
 * with a float scale per 16 elements sc[] and, for Q2_K only, a float offset per 16 mn[]:
 * value[i] = sc[i / 16] * w[i] - mn[i / 16]. The products are the spec's own float32 operations
 * (signs and powers of two applied exactly), so the dequantizers are bit-identical to the specs. The
 * IQ1 types' +-1/8 offsets are folded in exactly: dl * (g +- 1/8) == (dl / 8) * (8 g +- 1).
 *
 * Integer decode: the int16 weights are dotted with the int16 activations (mr_xact, natural order)
 * 16 at a time in int32 (|w| <= 128, |x| <= 32767: no overflow), each 16-sum scaled by sc x the
 * activation's 32-block scale; Q2_K's offsets use the per-16 sums of the quantized activations
 * (xa->sq16), so the result is the dot of the dequantized weights with the quantized activations. */

MR_INLINE void MR_SFX(lb_signs8)(int16_t *w, const uint8_t *g, uint8_t signs, int n) {
    for (int j = 0; j < n; j++) w[j] = (int16_t)((signs >> j) & 1 ? -(int)g[j] : (int)g[j]);
}


/* Q2_K: scales[16] @0 | qs[64] @16 | d @80 | dmin @82 */
MR_INLINE void MR_SFX(up_q2_k)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    const float d = mr_rdf16(b + 80), dmin = mr_rdf16(b + 82);
    for (int g = 0; g < 16; g++) {
        sc[g] = d * (float)(b[g] & 15);
        mn[g] = dmin * (float)(b[g] >> 4);
    }
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) w[128 * h + 32 * s + l] = (int16_t)((b[16 + 32 * h + l] >> (2 * s)) & 3);
}

/* Q3_K: hmask[32] @0 | qs[64] @32 | scales[12] @96 | d @108 */
MR_INLINE void MR_SFX(up_q3_k)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b + 108);
    int16_t s16[16];
    mr_q3k_scales(b + 96, s16);
    for (int g = 0; g < 16; g++) sc[g] = d * (float)s16[g];
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++)
                w[128 * h + 32 * s + l] = (int16_t)(((b[32 + 32 * h + l] >> (2 * s)) & 3) - (((b[l] >> (4 * h + s)) & 1) ? 0 : 4));
}

/* IQ2_XXS: d @0 | 8 x (grid idx u8[4], aux u32) @2 */
MR_INLINE void MR_SFX(up_iq2_xxs)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b);
    for (int g = 0; g < 8; g++) {
        const uint8_t *q = b + 2 + 8 * g;
        const uint32_t aux = mr_rd32(q + 4);
        sc[2 * g] = sc[2 * g + 1] = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++)
            MR_SFX(lb_signs8)(w + 32 * g + 8 * l, (const uint8_t *)&mr_iq2xxs_grid[q[l]], mr_iq_ksign(aux, l), 8);
    }
}

/* IQ2_XS: d @0 | qs u16[32] @2 | scales[8] @66 */
MR_INLINE void MR_SFX(up_iq2_xs)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b);
    for (int k = 0; k < 16; k++) sc[k] = d * (0.5f + (float)((b[66 + k / 2] >> (4 * (k % 2))) & 15)) * 0.25f;
    for (int i = 0; i < 32; i++) {
        const uint16_t q = mr_rd16(b + 2 + 2 * i);
        const uint32_t v = q >> 9;
        MR_SFX(lb_signs8)(w + 8 * i, (const uint8_t *)&mr_iq2xs_grid[q & 511],
                          (uint8_t)(v | ((uint32_t)__builtin_parity(v) << 7)), 8);
    }
}

/* IQ2_S: d @0 | qs[32] @2 | signs[32] @34 | qh[8] @66 | scales[8] @74 */
MR_INLINE void MR_SFX(up_iq2_s)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b);
    for (int k = 0; k < 16; k++) sc[k] = d * (0.5f + (float)((b[74 + k / 2] >> (4 * (k % 2))) & 15)) * 0.25f;
    for (int i = 0; i < 32; i++) {
        const int gi = b[2 + i] | (((b[66 + i / 4] >> (2 * (i % 4))) & 3) << 8);
        MR_SFX(lb_signs8)(w + 8 * i, (const uint8_t *)&mr_iq2s_grid[gi], b[34 + i], 8);
    }
}

/* IQ3_XXS: d @0 | qs[64] @2 | aux u32[8] @66 */
MR_INLINE void MR_SFX(up_iq3_xxs)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b);
    for (int g = 0; g < 8; g++) {
        const uint32_t aux = mr_rd32(b + 66 + 4 * g);
        sc[2 * g] = sc[2 * g + 1] = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; l++) {
            uint8_t g8[8];
            memcpy(g8, &mr_iq3xxs_grid[b[2 + 8 * g + 2 * l]], 4);
            memcpy(g8 + 4, &mr_iq3xxs_grid[b[2 + 8 * g + 2 * l + 1]], 4);
            MR_SFX(lb_signs8)(w + 32 * g + 8 * l, g8, mr_iq_ksign(aux, l), 8);
        }
    }
}

/* IQ3_S: d @0 | qs[64] @2 | qh[8] @66 | signs[32] @74 | scales[4] @106 */
MR_INLINE void MR_SFX(up_iq3_s)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b);
    for (int g = 0; g < 8; g++) sc[2 * g] = sc[2 * g + 1] = d * (float)(1 + 2 * ((b[106 + g / 2] >> (4 * (g % 2))) & 15));
    for (int i = 0; i < 32; i++) { /* 8 elements: grid entries 2i, 2i+1 */
        uint8_t g8[8];
        for (int h = 0; h < 2; h++) {
            const int e = 2 * i + h;
            const int gi = b[2 + e] | (((b[66 + e / 8] >> (e % 8)) & 1) << 8);
            memcpy(g8 + 4 * h, &mr_iq3s_grid[gi], 4);
        }
        MR_SFX(lb_signs8)(w + 8 * i, g8, b[74 + i], 8);
    }
}

/* 8 IQ1 weights 8 g +- 1 from an iq1s grid entry (int8 bytes -1, 0, 1) */
MR_INLINE void MR_SFX(lb_iq1)(int16_t *w, int gi, int neg) {
    const int8_t *g = (const int8_t *)&mr_iq1s_grid[gi];
    for (int j = 0; j < 8; j++) w[j] = (int16_t)(8 * g[j] + (neg ? -1 : 1));
}

/* IQ1_S: d @0 | qs[32] @2 | qh u16[8] @34 */
MR_INLINE void MR_SFX(up_iq1_s)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b);
    for (int g = 0; g < 8; g++) {
        const uint16_t h = mr_rd16(b + 34 + 2 * g);
        sc[2 * g] = sc[2 * g + 1] = d * (float)(2 * ((h >> 12) & 7) + 1) * 0.125f;
        for (int l = 0; l < 4; l++) MR_SFX(lb_iq1)(w + 32 * g + 8 * l, b[2 + 4 * g + l] | (((h >> (3 * l)) & 7) << 8), h & 0x8000);
    }
}

/* IQ1_M: qs[32] @0 | qh[16] @32 | scales u16[4] @48 (the f16 d in their top nibbles) */
MR_INLINE void MR_SFX(up_iq1_m)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    uint16_t s[4];
    for (int k = 0; k < 4; k++) s[k] = mr_rd16(b + 48 + 2 * k);
    const float d = mr_iq1m_d(b);
    for (int k = 0; k < 16; k++) sc[k] = d * (float)(2 * ((s[k / 4] >> (3 * (k % 4))) & 7) + 1) * 0.125f;
    for (int i = 0; i < 32; i++) {
        const int nib = (b[32 + i / 2] >> (4 * (i % 2))) & 15;
        MR_SFX(lb_iq1)(w + 8 * i, b[i] | ((nib & 7) << 8), nib & 8);
    }
}

/* TQ1_0: qs[48] @0 | qh[4] @48 | d @52; base-3 digits, see ternary.py */
MR_INLINE void MR_SFX(up_tq1_0)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b + 52);
    for (int g = 0; g < 16; g++) sc[g] = d;
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    for (int n = 0; n < 5; n++) {
        for (int m = 0; m < 32; m++) w[32 * n + m] = (int16_t)((((uint8_t)(b[m] * pow3[n])) * 3 >> 8) - 1);
        for (int m = 0; m < 16; m++) w[160 + 16 * n + m] = (int16_t)((((uint8_t)(b[32 + m] * pow3[n])) * 3 >> 8) - 1);
    }
    for (int n = 0; n < 4; n++)
        for (int m = 0; m < 4; m++) w[240 + 4 * n + m] = (int16_t)((((uint8_t)(b[48 + m] * pow3[n])) * 3 >> 8) - 1);
}

/* TQ2_0: qs[64] @0 | d @64 */
MR_INLINE void MR_SFX(up_tq2_0)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    const float d = mr_rdf16(b + 64);
    for (int g = 0; g < 16; g++) sc[g] = d;
    for (int j = 0; j < 2; j++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) w[128 * j + 32 * s + l] = (int16_t)(((b[32 * j + l] >> (2 * s)) & 3) - 1);
}

/* MXFP4 (32 elements): e @0 | qs[16] @1 (common.h: mr_kvalues_mxfp4, mr_e8m0_half) */
MR_INLINE void MR_SFX(up_mxfp4)(const uint8_t *b, int16_t *w, float *sc, float *mn) {
    (void)mn;
    sc[0] = sc[1] = mr_e8m0_half(b[0]);
    for (int l = 0; l < 16; l++) {
        w[l] = mr_kvalues_mxfp4[b[1 + l] & 15];
        w[16 + l] = mr_kvalues_mxfp4[b[1 + l] >> 4];
    }
}

/* dequantizer of a type from its unpacker: BLK elements per block of BYTES bytes */
#define MR_LB_DQ(NAME, BYTES, BLK, HAS_MIN)                                                                  \
    static void MR_SFX(dq_##NAME)(const uint8_t *b, float *y, int64_t nb) {                                    \
        int16_t w[256];                                                                                        \
        float sc[16], mn[16];                                                                                  \
        for (int64_t i = 0; i < nb; i++, b += BYTES, y += BLK) {                                               \
            MR_SFX(up_##NAME)(b, w, sc, mn);                                                                   \
            for (int e = 0; e < BLK; e++) y[e] = HAS_MIN ? sc[e >> 4] * (float)w[e] - mn[e >> 4] : sc[e >> 4] * (float)w[e]; \
        }                                                                                                      \
    }

/* Integer decode kernel (mr_gemv_fn): rows of nb32 * 32 elements, nt <= MR_NT_INT tokens. */
#define MR_LB_GEMV(NAME, BYTES, BLK, HAS_MIN)                                                                \
    static void MR_SFX(gemv_##NAME)(const uint8_t *W, int64_t rb, int64_t nrows, int64_t nb32, const mr_xact *xa, \
                                     int nt, float *y, int64_t ys) {                                           \
        const int64_t nblk = nb32 * 32 / BLK;                                                                  \
        int16_t w[256] __attribute__((aligned(64)));                                                           \
        float sc[16], mn[16];                                                                                  \
        for (int64_t r = 0; r < nrows; r++) {                                                                  \
            float acc[MR_NT_INT] = {0};                                                                        \
            const uint8_t *row = W + r * rb;                                                                   \
            for (int64_t ib = 0; ib < nblk; ib++) {                                                            \
                MR_SFX(up_##NAME)(row + ib * BYTES, w, sc, mn);                                                \
                for (int t = 0; t < nt; t++) {                                                                 \
                    const int16_t *xq = xa->q + t * xa->qs + ib * BLK;                                         \
                    const float *xd = xa->d + t * xa->bs + ib * (BLK / 32);                                    \
                    const float *s16 = xa->sq16 + 2 * t * xa->bs + ib * (BLK / 16);                            \
                    float s = 0.0f;                                                                            \
                    for (int g = 0; g < BLK / 16; g++) {                                                       \
                        int32_t is = 0;                                                                        \
                        for (int i = 0; i < 16; i++) is += (int32_t)w[16 * g + i] * (int32_t)xq[16 * g + i];   \
                        s += sc[g] * xd[g >> 1] * (float)is;                                                   \
                        if (HAS_MIN) s -= mn[g] * s16[g];                                                      \
                    }                                                                                          \
                    acc[t] += s;                                                                               \
                }                                                                                              \
            }                                                                                                  \
            for (int t = 0; t < nt; t++) y[t * ys + r] = acc[t];                                               \
        }                                                                                                      \
    }

#define MR_LB_TYPE(NAME, BYTES, BLK, HAS_MIN) MR_LB_DQ(NAME, BYTES, BLK, HAS_MIN) MR_LB_GEMV(NAME, BYTES, BLK, HAS_MIN)
MR_LB_GEMV(q2_k, 84, 256, 1)
MR_LB_GEMV(q3_k, 110, 256, 0)
MR_LB_TYPE(iq2_xxs, 66, 256, 0)
MR_LB_TYPE(iq2_xs, 74, 256, 0)
MR_LB_TYPE(iq2_s, 82, 256, 0)
MR_LB_TYPE(iq3_xxs, 98, 256, 0)
MR_LB_TYPE(iq3_s, 110, 256, 0)
MR_LB_TYPE(iq1_s, 50, 256, 0)
MR_LB_TYPE(iq1_m, 56, 256, 0)
MR_LB_TYPE(tq1_0, 54, 256, 0)
MR_LB_TYPE(tq2_0, 66, 256, 0)
MR_LB_TYPE(mxfp4, 17, 32, 0)

/* Register the low-bit types' dequantizers (every ISA) and, where the ISA has SIMD integer dot
 * products (with_int), their integer decode kernels. */
MR_INLINE void MR_SFX(lb_register)(mr_kernels *k, int with_int) {
    k->dq[GT_IQ2_XXS] = MR_SFX(dq_iq2_xxs);
    k->dq[GT_IQ2_XS] = MR_SFX(dq_iq2_xs);
    k->dq[GT_IQ2_S] = MR_SFX(dq_iq2_s);
    k->dq[GT_IQ3_XXS] = MR_SFX(dq_iq3_xxs);
    k->dq[GT_IQ3_S] = MR_SFX(dq_iq3_s);
    k->dq[GT_IQ1_S] = MR_SFX(dq_iq1_s);
    k->dq[GT_IQ1_M] = MR_SFX(dq_iq1_m);
    k->dq[GT_TQ1_0] = MR_SFX(dq_tq1_0);
    k->dq[GT_TQ2_0] = MR_SFX(dq_tq2_0);
    k->dq[GT_MXFP4] = MR_SFX(dq_mxfp4);
    if (!with_int) return;
    k->gemv[GT_Q2_K] = MR_SFX(gemv_q2_k);
    k->gemv[GT_Q3_K] = MR_SFX(gemv_q3_k);
    k->gemv[GT_IQ2_XXS] = MR_SFX(gemv_iq2_xxs);
    k->gemv[GT_IQ2_XS] = MR_SFX(gemv_iq2_xs);
    k->gemv[GT_IQ2_S] = MR_SFX(gemv_iq2_s);
    k->gemv[GT_IQ3_XXS] = MR_SFX(gemv_iq3_xxs);
    k->gemv[GT_IQ3_S] = MR_SFX(gemv_iq3_s);
    k->gemv[GT_IQ1_S] = MR_SFX(gemv_iq1_s);
    k->gemv[GT_IQ1_M] = MR_SFX(gemv_iq1_m);
    k->gemv[GT_TQ1_0] = MR_SFX(gemv_tq1_0);
    k->gemv[GT_TQ2_0] = MR_SFX(gemv_tq2_0);
    k->gemv[GT_MXFP4] = MR_SFX(gemv_mxfp4);
}
