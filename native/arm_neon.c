/* AArch64 build: Advanced SIMD is part of the base ISA, so the portable kernels compiled here are
 * vectorized with NEON by the compiler; float dots and the tile use explicit NEON FMA, and the
 * integer path (int16 activations, as on x86) uses widening multiply-accumulates. The int8 dot
 * instructions (sdot) would need int8 activations, which this runtime avoids for accuracy. */
#include "common.h"

#ifdef MR_ARM64
#include <arm_neon.h>

#define MR_SFX(name) name##_neon
#define MR_VLEN 4
#include "generic_impl.h"

mr_kernels mr_kernels_neon;

static void hv_dot_f32(const float *w, const float *x, int64_t xs, int64_t n, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const float *xt = x + t * xs;
        float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            a0 = vfmaq_f32(a0, vld1q_f32(w + i), vld1q_f32(xt + i));
            a1 = vfmaq_f32(a1, vld1q_f32(w + i + 4), vld1q_f32(xt + i + 4));
            a2 = vfmaq_f32(a2, vld1q_f32(w + i + 8), vld1q_f32(xt + i + 8));
            a3 = vfmaq_f32(a3, vld1q_f32(w + i + 12), vld1q_f32(xt + i + 12));
        }
        float s = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
        for (; i < n; i++) s += w[i] * xt[i];
        out[t] = s;
    }
}

/* 4 rows x 4 tokens of float32x4 accumulators */
static void hv_tile(const float *wt, int nr, const float *x, int64_t xs, int ntk, int64_t n, float *y,
                      int64_t ys, int acc) {
    int r = 0;
    for (; r + 4 <= nr; r += 4) {
        int t = 0;
        for (; t + 4 <= ntk; t += 4) {
            float32x4_t c[4][4];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) c[i][j] = vdupq_n_f32(0.0f);
            int64_t k = 0;
            for (; k + 4 <= n; k += 4) {
                float32x4_t xv[4];
                for (int j = 0; j < 4; j++) xv[j] = vld1q_f32(x + (t + j) * xs + k);
                for (int i = 0; i < 4; i++) {
                    const float32x4_t wv = vld1q_f32(wt + (int64_t)(r + i) * n + k);
                    for (int j = 0; j < 4; j++) c[i][j] = vfmaq_f32(c[i][j], wv, xv[j]);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    float s = vaddvq_f32(c[i][j]);
                    for (int64_t kk = k; kk < n; kk++) s += wt[(int64_t)(r + i) * n + kk] * x[(t + j) * xs + kk];
                    float *o = y + (t + j) * ys + r + i;
                    *o = acc ? *o + s : s;
                }
        }
        for (; t < ntk; t++)
            for (int i = 0; i < 4; i++) {
                float s;
                hv_dot_f32(wt + (int64_t)(r + i) * n, x + t * xs, xs, n, 1, &s);
                float *o = y + t * ys + r + i;
                *o = acc ? *o + s : s;
            }
    }
    for (; r < nr; r++)
        for (int t = 0; t < ntk; t++) {
            float s;
            hv_dot_f32(wt + (int64_t)r * n, x + t * xs, xs, n, 1, &s);
            float *o = y + t * ys + r;
            *o = acc ? *o + s : s;
        }
}

/* ---------------- integer path: int16 activations x int8-range weights (vmlal_s16) ----------------
 * Each 32-block: weights unpacked to 32 int8 values, widened to int16 and multiplied with the int16
 * activations into int32 lanes (8 products per lane at most: |sum| < 2^31), converted and scaled in
 * float per block, as the x86 kernels do. */

/* sum over 16 int8 weights x 16 int16 activations -> 4 int32 lanes (added to acc) */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t w, const int16_t *x) {
    const int16x8_t w0 = vmovl_s8(vget_low_s8(w)), w1 = vmovl_s8(vget_high_s8(w));
    const int16x8_t x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8);
    acc = vmlal_s16(acc, vget_low_s16(w0), vget_low_s16(x0));
    acc = vmlal_high_s16(acc, w0, x0);
    acc = vmlal_s16(acc, vget_low_s16(w1), vget_low_s16(x1));
    return vmlal_high_s16(acc, w1, x1);
}

static const uint8_t bitsel[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};

/* bits 16*half .. 16*half+15 of qh -> 16 bytes of 0x10 where set */
static inline uint8x16_t hbits16(uint32_t qh, int half) {
    const uint16_t b = (uint16_t)(qh >> (16 * half));
    const uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)(b & 0xff)), vdup_n_u8((uint8_t)(b >> 8)));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bitsel)), vdupq_n_u8(0x10));
}

static inline float f16n(const uint8_t *p) { return mr_f16_to_f32(mr_rd16(p)); }

/* 32-block types: w0 = elements 0..15, w1 = 16..31; value = d * w + m */
static inline void unpack32(int type, const uint8_t *b, int8x16_t *w0, int8x16_t *w1, float *d, float *m) {
    *m = 0.0f;
    *d = 0.0f;
    *w0 = *w1 = vdupq_n_s8(0);
    uint8x16_t lo, hi, v;
    switch (type) {
    case GT_Q8_0:
        *d = f16n(b);
        *w0 = vld1q_s8((const int8_t *)(b + 2));
        *w1 = vld1q_s8((const int8_t *)(b + 18));
        return;
    case GT_Q4_0:
    case GT_IQ4_NL:
        *d = f16n(b);
        v = vld1q_u8(b + 2);
        lo = vandq_u8(v, vdupq_n_u8(15));
        hi = vshrq_n_u8(v, 4);
        if (type == GT_Q4_0) {
            *w0 = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(8));
            *w1 = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(8));
        } else {
            const int8x16_t t = vld1q_s8(mr_kvalues_iq4nl);
            *w0 = vqtbl1q_s8(t, lo);
            *w1 = vqtbl1q_s8(t, hi);
        }
        return;
    case GT_Q4_1:
        *d = f16n(b);
        *m = f16n(b + 2);
        v = vld1q_u8(b + 4);
        *w0 = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15)));
        *w1 = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
        return;
    case GT_Q5_0:
    case GT_Q5_1: {
        const int off = type == GT_Q5_0 ? 2 : 4;
        *d = f16n(b);
        if (type == GT_Q5_1) *m = f16n(b + 2);
        const uint32_t qh = mr_rd32(b + off);
        v = vld1q_u8(b + off + 4);
        lo = vorrq_u8(vandq_u8(v, vdupq_n_u8(15)), hbits16(qh, 0));
        hi = vorrq_u8(vshrq_n_u8(v, 4), hbits16(qh, 1));
        if (type == GT_Q5_0) {
            *w0 = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(16));
            *w1 = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(16));
        } else {
            *w0 = vreinterpretq_s8_u8(lo);
            *w1 = vreinterpretq_s8_u8(hi);
        }
        return;
    }
    default:
        return;
    }
}

static void vint32_neon(int type, int bytes, const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd,
                        const float *xs, int64_t xqs, int64_t xbs, int nt, float *out) {
    float32x4_t acc[MR_NT_INT];
    float msum[MR_NT_INT];
    for (int t = 0; t < nt; t++) { acc[t] = vdupq_n_f32(0.0f); msum[t] = 0.0f; }
    for (int64_t b = 0; b < nb; b++) {
        int8x16_t w0, w1;
        float d, m;
        unpack32(type, w + b * bytes, &w0, &w1, &d, &m);
        for (int t = 0; t < nt; t++) {
            const int16_t *x = xq + t * xqs + 32 * b;
            const int32x4_t p = dot16(dot16(vdupq_n_s32(0), w0, x), w1, x + 16);
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(p), d * xd[t * xbs + b]);
            msum[t] += m * xs[t * xbs + b];
        }
    }
    for (int t = 0; t < nt; t++) out[t] = vaddvq_f32(acc[t]) + msum[t];
}

#define DEF_V32(NAME, TYPE, BYTES)                                                                           \
    static void NAME(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd, const float *xs,        \
                     int64_t xqs, int64_t xbs, int nt, float *out) {                                           \
        vint32_neon(TYPE, BYTES, w, nb, xq, xd, xs, xqs, xbs, nt, out);                                        \
    }
DEF_V32(vint_q4_0, GT_Q4_0, 18)
DEF_V32(vint_q4_1, GT_Q4_1, 20)
DEF_V32(vint_q5_0, GT_Q5_0, 22)
DEF_V32(vint_q5_1, GT_Q5_1, 24)
DEF_V32(vint_q8_0, GT_Q8_0, 34)
DEF_V32(vint_iq4_nl, GT_IQ4_NL, 18)

/* Q4_K / Q5_K: sub-block j (32 elements) = nibbles of qs[32*(j/2) ..], value d*sc_j*q - dmin*m_j */
static void vint_q45_k(int five, const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd, const float *xs,
                       int64_t xqs, int64_t xbs, int nt, float *out) {
    const int bytes = five ? 176 : 144;
    float32x4_t acc[MR_NT_INT];
    float msum[MR_NT_INT];
    for (int t = 0; t < nt; t++) { acc[t] = vdupq_n_f32(0.0f); msum[t] = 0.0f; }
    for (int64_t ib = 0; ib < nb32 / 8; ib++) {
        const uint8_t *b = w + ib * bytes;
        const float d = f16n(b), dmin = f16n(b + 2);
        const uint8_t *qs = b + (five ? 48 : 16), *qh = b + 16;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            mr_scale_min_k4(j, b + 4, &sc, &mn);
            const uint8x16_t r0 = vld1q_u8(qs + 32 * (j / 2)), r1 = vld1q_u8(qs + 32 * (j / 2) + 16);
            uint8x16_t u0 = (j & 1) ? vshrq_n_u8(r0, 4) : vandq_u8(r0, vdupq_n_u8(15));
            uint8x16_t u1 = (j & 1) ? vshrq_n_u8(r1, 4) : vandq_u8(r1, vdupq_n_u8(15));
            if (five) {
                const uint8x16_t bit = vdupq_n_u8((uint8_t)(1 << j));
                u0 = vorrq_u8(u0, vandq_u8(vtstq_u8(vld1q_u8(qh), bit), vdupq_n_u8(16)));
                u1 = vorrq_u8(u1, vandq_u8(vtstq_u8(vld1q_u8(qh + 16), bit), vdupq_n_u8(16)));
            }
            const int8x16_t w0 = vreinterpretq_s8_u8(u0), w1 = vreinterpretq_s8_u8(u1);
            for (int t = 0; t < nt; t++) {
                const int64_t blk = 8 * ib + j;
                const int16_t *x = xq + t * xqs + 32 * blk;
                const int32x4_t p = dot16(dot16(vdupq_n_s32(0), w0, x), w1, x + 16);
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(p), d * sc * xd[t * xbs + blk]);
                msum[t] -= dmin * mn * xs[t * xbs + blk];
            }
        }
    }
    for (int t = 0; t < nt; t++) out[t] = vaddvq_f32(acc[t]) + msum[t];
}
static void vint_q4_k(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd, const float *xs,
                      int64_t xqs, int64_t xbs, int nt, float *out) {
    vint_q45_k(0, w, nb, xq, xd, xs, xqs, xbs, nt, out);
}
static void vint_q5_k(const uint8_t *w, int64_t nb, const int16_t *xq, const float *xd, const float *xs,
                      int64_t xqs, int64_t xbs, int nt, float *out) {
    vint_q45_k(1, w, nb, xq, xd, xs, xqs, xbs, nt, out);
}

/* Q6_K: (q - 32) per 16 elements with its int8 scale, applied in float */
static void vint_q6_k(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd, const float *xs,
                      int64_t xqs, int64_t xbs, int nt, float *out) {
    (void)xs;
    float32x4_t acc[MR_NT_INT];
    for (int t = 0; t < nt; t++) acc[t] = vdupq_n_f32(0.0f);
    for (int64_t ib = 0; ib < nb32 / 8; ib++) {
        const uint8_t *b = w + ib * 210;
        const float d = f16n(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, i = j % 4; /* element 128h + 32i + l */
            const uint8_t *ql = b + 64 * h + 32 * (i & 1), *qh = b + 128 + 32 * h;
            int8x16_t q[2];
            for (int k = 0; k < 2; k++) {
                const uint8x16_t L = vld1q_u8(ql + 16 * k), H = vld1q_u8(qh + 16 * k);
                const uint8x16_t lo = (i & 2) ? vshrq_n_u8(L, 4) : vandq_u8(L, vdupq_n_u8(15));
                uint8x16_t hb;
                switch (i) {
                case 0: hb = vshlq_n_u8(H, 4); break;
                case 1: hb = vshlq_n_u8(H, 2); break;
                case 2: hb = H; break;
                default: hb = vshrq_n_u8(H, 2); break;
                }
                q[k] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, vandq_u8(hb, vdupq_n_u8(0x30)))), vdupq_n_s8(32));
            }
            for (int t = 0; t < nt; t++) {
                const int64_t blk = 8 * ib + j;
                const int16_t *x = xq + t * xqs + 32 * blk;
                const float s = d * xd[t * xbs + blk];
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(dot16(vdupq_n_s32(0), q[0], x)), s * sc[2 * j]);
                acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(dot16(vdupq_n_s32(0), q[1], x + 16)), s * sc[2 * j + 1]);
            }
        }
    }
    for (int t = 0; t < nt; t++) out[t] = vaddvq_f32(acc[t]);
}

void mr_init_neon(mr_kernels *k) {
    mr_fill_generic_neon(k);
    k->dot_f32 = hv_dot_f32;
    k->tile = hv_tile;
    k->vint[GT_Q4_0] = vint_q4_0;
    k->vint[GT_Q4_1] = vint_q4_1;
    k->vint[GT_Q5_0] = vint_q5_0;
    k->vint[GT_Q5_1] = vint_q5_1;
    k->vint[GT_Q8_0] = vint_q8_0;
    k->vint[GT_IQ4_NL] = vint_iq4_nl;
    k->vint[GT_Q4_K] = vint_q4_k;
    k->vint[GT_Q5_K] = vint_q5_k;
    k->vint[GT_Q6_K] = vint_q6_k;
}
#endif /* MR_ARM64 */
