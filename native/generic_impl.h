/* Portable C kernels, compiled once per ISA: scalar.c, x86_avx2.c, x86_avx512.c and arm_neon.c include
 * this file after choosing a target, so the compiler vectorizes the same source for each ISA (loops
 * keep independent lane accumulators so no -ffast-math is needed). Before including, define
 * MR_SFX(name) to append the ISA suffix.
 *
 * The dequantizers are the executable spec of the block layouts, written after ggml's
 * dequantize_row_* (ggml-quants.c) and checked against gguf-py's gguf.quants in tests. */

#define MR_LANES 16

/* ---------------- dequantizers: nblocks blocks -> nblocks * block floats ---------------- */

static void MR_SFX(dq_f32)(const uint8_t *src, float *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }

static void MR_SFX(dq_f16)(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = mr_f16_to_f32(mr_rd16(src + 2 * i));
}

static void MR_SFX(dq_bf16)(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = mr_bf16_to_f32(mr_rd16(src + 2 * i));
}

/* Q4_0: d f16 | qs[16]; element j = (qs[j] & 15) - 8, element j+16 = (qs[j] >> 4) - 8. */
static void MR_SFX(dq_q4_0)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 18, y += 32) {
        const float d = mr_rdf16(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[2 + j] & 15) - 8);
            y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
    }
}

/* Q4_1: d f16 | m f16 | qs[16]; value = d * q + m. */
static void MR_SFX(dq_q4_1)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 20, y += 32) {
        const float d = mr_rdf16(b), m = mr_rdf16(b + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b[4 + j] & 15) + m;
            y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
    }
}

/* Q5_0: d f16 | qh u32 | qs[16]; the 5th bit of element j is bit j of qh; value = d * (q - 16). */
static void MR_SFX(dq_q5_0)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 22, y += 32) {
        const float d = mr_rdf16(b);
        const uint32_t qh = mr_rd32(b + 2);
        for (int j = 0; j < 16; j++) {
            const int lo = (b[6 + j] & 15) | (int)(((qh >> j) & 1) << 4);
            const int hi = (b[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
    }
}

/* Q5_1: d f16 | m f16 | qh u32 | qs[16]; value = d * q + m. */
static void MR_SFX(dq_q5_1)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 24, y += 32) {
        const float d = mr_rdf16(b), m = mr_rdf16(b + 2);
        const uint32_t qh = mr_rd32(b + 4);
        for (int j = 0; j < 16; j++) {
            const int lo = (b[8 + j] & 15) | (int)(((qh >> j) & 1) << 4);
            const int hi = (b[8 + j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
    }
}

/* Q8_0: d f16 | qs[32] int8. */
static void MR_SFX(dq_q8_0)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 34, y += 32) {
        const float d = mr_rdf16(b);
        for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
    }
}

/* Q2_K: scales[16] (lo nibble scale, hi nibble min) | qs[64] | d f16 | dmin f16.
 * Element 128*h + 32*s + l = (qs[32*h + l] >> 2s) & 3, group of 16 = element / 16. */
static void MR_SFX(dq_q2_k)(const uint8_t *b, float *y, int64_t nb) {
    /* loops ordered so that the innermost runs over 16 consecutive elements sharing one scale and
     * one shift: it vectorizes (the per-element form ran ~10x slower); same products, same order */
    for (int64_t i = 0; i < nb; i++, b += 84, y += 256) {
        const float d = mr_rdf16(b + 80), dmin = mr_rdf16(b + 82);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int half = 0; half < 2; half++) {
                    const int e0 = 128 * h + 32 * s + 16 * half;
                    const uint8_t sc = b[e0 >> 4];
                    const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
                    const uint8_t *q = b + 16 + 32 * h + 16 * half;
                    float *o = y + e0;
                    for (int l = 0; l < 16; l++) o[l] = dl * (float)((q[l] >> (2 * s)) & 3) - ml;
                }
    }
}

/* Q3_K: hmask[32] | qs[64] | scales[12] (16 x 6-bit, offset 32) | d f16.
 * Low bits as Q2_K; the high bit of element 32*i + l is bit i of hmask[l]; q = low - (hbit ? 0 : 4). */
static void MR_SFX(dq_q3_k)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 110, y += 256) {
        const float d = mr_rdf16(b + 108);
        const uint8_t *sc = b + 96;
        float dl[16];
        for (int g = 0; g < 16; g++) {
            const int lo = g < 8 ? (sc[g] & 15) : (sc[g - 8] >> 4);
            const int hi = (sc[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
            dl[g] = d * (float)((lo | (hi << 4)) - 32);
        }
        for (int h = 0; h < 2; h++)  /* innermost over 16 elements of one scale: vectorizes */
            for (int s = 0; s < 4; s++)
                for (int half = 0; half < 2; half++) {
                    const int e0 = 128 * h + 32 * s + 16 * half, bit = 4 * h + s;
                    const float scale = dl[e0 >> 4];
                    const uint8_t *q = b + 32 + 32 * h + 16 * half, *hm = b + 16 * half;
                    float *o = y + e0;
                    for (int l = 0; l < 16; l++)
                        o[l] = scale * (float)(((q[l] >> (2 * s)) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4));
                }
    }
}

/* Q4_K: d f16 | dmin f16 | scales[12] (8 x 6-bit scale, 8 x 6-bit min) | qs[128].
 * Sub-block 2c = low nibbles of qs[32c .. 32c+31], 2c+1 = high nibbles; value = d*sc*q - dmin*m. */
static void MR_SFX(dq_q4_k)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 144, y += 256) {
        const float d = mr_rdf16(b), dmin = mr_rdf16(b + 2);
        const uint8_t *q = b + 16;
        for (int c = 0; c < 4; c++) {
            uint8_t s0, m0, s1, m1;
            mr_scale_min_k4(2 * c, b + 4, &s0, &m0);
            mr_scale_min_k4(2 * c + 1, b + 4, &s1, &m1);
            const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
            for (int l = 0; l < 32; l++) {
                y[64 * c + l] = d0 * (float)(q[32 * c + l] & 15) - n0;
                y[64 * c + 32 + l] = d1 * (float)(q[32 * c + l] >> 4) - n1;
            }
        }
    }
}

/* Q5_K: d | dmin | scales[12] | qh[32] | qs[128]; the 5th bit of sub-block j, element l is bit j of qh[l]. */
static void MR_SFX(dq_q5_k)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 176, y += 256) {
        const float d = mr_rdf16(b), dmin = mr_rdf16(b + 2);
        const uint8_t *qh = b + 16, *q = b + 48;
        for (int c = 0; c < 4; c++) {
            uint8_t s0, m0, s1, m1;
            mr_scale_min_k4(2 * c, b + 4, &s0, &m0);
            mr_scale_min_k4(2 * c + 1, b + 4, &s1, &m1);
            const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
            for (int l = 0; l < 32; l++) {
                const int lo = (q[32 * c + l] & 15) | (((qh[l] >> (2 * c)) & 1) << 4);
                const int hi = (q[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
                y[64 * c + l] = d0 * (float)lo - n0;
                y[64 * c + 32 + l] = d1 * (float)hi - n1;
            }
        }
    }
}

/* Q6_K: ql[128] | qh[64] | scales[16] int8 | d f16.
 * Element 128*h + 64*s + k: low nibble s of ql[64*h + k]; element 128*h + 32*s2 + l: 2 high bits
 * (qh[32*h + l] >> 2*s2) & 3; value = d * scale[e/16] * (q - 32). */
static void MR_SFX(dq_q6_k)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 210, y += 256) {
        const float d = mr_rdf16(b + 208);
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++) {
            for (int l = 0; l < 32; l++) {
                const int q1 = (ql[64 * h + l] & 15) | (((qh[32 * h + l] >> 0) & 3) << 4);
                const int q2 = (ql[64 * h + 32 + l] & 15) | (((qh[32 * h + l] >> 2) & 3) << 4);
                const int q3 = (ql[64 * h + l] >> 4) | (((qh[32 * h + l] >> 4) & 3) << 4);
                const int q4 = (ql[64 * h + 32 + l] >> 4) | (((qh[32 * h + l] >> 6) & 3) << 4);
                const int e = 128 * h + l;
                y[e] = d * sc[e >> 4] * (float)(q1 - 32);
                y[e + 32] = d * sc[(e + 32) >> 4] * (float)(q2 - 32);
                y[e + 64] = d * sc[(e + 64) >> 4] * (float)(q3 - 32);
                y[e + 96] = d * sc[(e + 96) >> 4] * (float)(q4 - 32);
            }
        }
    }
}

/* IQ4_NL: d f16 | qs[16]; as Q4_0 with a non-linear codebook. */
static void MR_SFX(dq_iq4_nl)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 18, y += 32) {
        const float d = mr_rdf16(b);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)mr_kvalues_iq4nl[b[2 + j] & 15];
            y[j + 16] = d * (float)mr_kvalues_iq4nl[b[2 + j] >> 4];
        }
    }
}

/* IQ4_XS: d f16 | scales_h u16 | scales_l[4] | qs[128]; sub-block j: 6-bit scale
 * (scales_l[j/2] >> 4*(j%2) & 15) | ((scales_h >> 2j) & 3) << 4, minus 32; 16 bytes of nibbles each. */
static void MR_SFX(dq_iq4_xs)(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 136, y += 256) {
        const float d = mr_rdf16(b);
        const uint16_t sh = mr_rd16(b + 2);
        const uint8_t *q = b + 8;
        for (int j = 0; j < 8; j++) {
            const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
            const float dl = d * (float)(ls - 32);
            for (int l = 0; l < 16; l++) {
                y[32 * j + l] = dl * (float)mr_kvalues_iq4nl[q[16 * j + l] & 15];
                y[32 * j + 16 + l] = dl * (float)mr_kvalues_iq4nl[q[16 * j + l] >> 4];
            }
        }
    }
}

/* ---------------- activation quantization (int path): int16 per 32-block ---------------- */

/* x (n floats, n % 32 == 0) -> q int16 with |q| <= 32767, d = max|x| / 32767, s = sum of x (float). */
static void MR_SFX(quant_x)(const float *x, int64_t n, int16_t *q, float *d, float *s) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
            sum += xb[j];
        }
        const float db = amax / 32767.0f;
        const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int j = 0; j < 32; j++) {
            float v = xb[j] * id;
            v = v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v);
            q[32 * b + j] = (int16_t)lrintf(v);
        }
        d[b] = isfinite(sum) ? db : NAN; /* a NaN / infinity reaches y */
        s[b] = sum;
    }
}

/* ---------------- float kernels (lane arrays: the compiler maps them to SIMD registers) ---------------- */

static float MR_SFX(dot)(const float *a, const float *b, int64_t n) {
    float acc[MR_LANES] = {0};
    int64_t i = 0;
    for (; i + MR_LANES <= n; i += MR_LANES)
        for (int j = 0; j < MR_LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < MR_LANES; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void MR_SFX(dot_f32)(const float *w, const float *x, int64_t xs, int64_t n, int nt, float *out) {
    for (int t = 0; t < nt; t++) out[t] = MR_SFX(dot)(w, x + t * xs, n);
}

static void MR_SFX(tile)(const float *wt, int nr, const float *x, int64_t xs, int ntk, int64_t n,
                         float *y, int64_t ys, int acc) {
    for (int t = 0; t < ntk; t++)
        for (int r = 0; r < nr; r++) {
            const float v = MR_SFX(dot)(wt + (int64_t)r * n, x + t * xs, n);
            y[t * ys + r] = acc ? y[t * ys + r] + v : v;
        }
}

static void MR_SFX(axpy)(float a, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void MR_SFX(rmsnorm)(const float *x, const float *w, float eps, int64_t n, float *out) {
    /* sum of squares in double: n is a few thousand, this is not the hot loop */
    double ss = 0.0;
    float acc[MR_LANES] = {0};
    int64_t i = 0;
    for (; i + MR_LANES <= n; i += MR_LANES)
        for (int j = 0; j < MR_LANES; j++) acc[j] += x[i + j] * x[i + j];
    for (int j = 0; j < MR_LANES; j++) ss += acc[j];
    for (; i < n; i++) ss += (double)x[i] * x[i];
    const float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    if (w)
        for (int64_t k = 0; k < n; k++) out[k] = x[k] * r * w[k];
    else
        for (int64_t k = 0; k < n; k++) out[k] = x[k] * r;
}

static void MR_SFX(vexp)(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = expf(x[i]);
}

/* softmax with the exponentials from `vexp` (the ISA's vectorized one where there is one) */
MR_INLINE void MR_SFX(softmax_with)(float *x, int64_t n, void (*vexp)(float *, int64_t)) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    if (mx == -INFINITY) { /* all masked: define as uniform zero row */
        for (int64_t i = 0; i < n; i++) x[i] = 0.0f;
        return;
    }
    for (int64_t i = 0; i < n; i++) x[i] -= mx;
    vexp(x, n);
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += x[i];
    const float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

static void MR_SFX(softmax)(float *x, int64_t n) { MR_SFX(softmax_with)(x, n, MR_SFX(vexp)); }

/* ---------------- sampler statistics of one row of logits (mr_logit_stats) ----------------
 * Written on GCC/clang vectors of the including unit's width (MR_VLEN floats): plain loops with a
 * select or a NaN test stay scalar without -ffast-math, and wider vectors than the unit's ISA has
 * are lowered element by element. */
#ifndef MR_VLEN
#define MR_VLEN 4
#endif
typedef float MR_SFX(vf) __attribute__((vector_size(4 * MR_VLEN)));
typedef int32_t MR_SFX(vi) __attribute__((vector_size(4 * MR_VLEN)));

MR_INLINE MR_SFX(vf) MR_SFX(vload)(const float *p) {
    MR_SFX(vf) v;
    memcpy(&v, p, sizeof v);
    return v;
}

MR_INLINE int MR_SFX(vany)(MR_SFX(vi) m) {
    uint32_t w[MR_VLEN], a = 0;
    memcpy(w, &m, sizeof w);
    for (int j = 0; j < MR_VLEN; j++) a |= w[j];
    return a != 0;
}

/* insert (v, i) into the k best so far, value descending, index ascending among equal values (the
 * scan visits indices in increasing order, so an equal value never moves ahead of an earlier one) */
MR_INLINE void MR_SFX(topk_insert)(float v, int64_t i, int *cnt, int k, int64_t *ti, float *tv) {
    int p = *cnt < k ? (*cnt)++ : k - 1;
    for (; p > 0 && tv[p - 1] < v; p--) {
        tv[p] = tv[p - 1];
        ti[p] = ti[p - 1];
    }
    tv[p] = v;
    ti[p] = i;
}

/* x (n): *out_max, *out_lse = log(sum e^x) and the k largest (see api.h); returns how many */
static int MR_SFX(logit_stats)(const float *x, int64_t n, int k, float *out_max, double *out_lse, int64_t *ti,
                               float *tv, void (*vexp)(float *, int64_t)) {
    typedef MR_SFX(vf) vf;
    typedef MR_SFX(vi) vi;
    /* BLK: the any-test is scalar (~30 instructions at 16 lanes): once per 256 floats there, a row of 151936
     * logits 97 -> 85 us on AVX-512 */
    enum { L = MR_VLEN, CHUNK = 2048, BLK = 16 * MR_VLEN };
    /* maximum and NaN test */
    vf m = (vf){0} - INFINITY;
    vi bad = (vi){0};
    int64_t i = 0;
    for (; i + L <= n; i += L) {
        const vf v = MR_SFX(vload)(x + i);
        const vi gt = v > m;
        m = (vf)(((vi)v & gt) | ((vi)m & ~gt));
        bad |= v != v;
    }
    float mx = -INFINITY;
    int nan = MR_SFX(vany)(bad);
    for (int j = 0; j < L; j++) mx = m[j] > mx ? m[j] : mx;
    for (; i < n; i++) {
        mx = x[i] > mx ? x[i] : mx;
        nan |= x[i] != x[i];
    }
    if (nan || !isfinite(mx)) { /* nothing sane to sample: the caller reports it */
        *out_max = nan ? NAN : mx;
        *out_lse = nan ? NAN : mx;
        return 0;
    }
    *out_max = mx;
    /* log-sum-exp: e^(x - max) through the ISA's vectorized exponential, a chunk at a time (in L1) */
    float buf[CHUNK] __attribute__((aligned(64)));
    double sum = 0.0;
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
        const int64_t nn = n - i0 < CHUNK ? n - i0 : CHUNK;
        for (int64_t j = 0; j < nn; j++) buf[j] = x[i0 + j] - mx;
        vexp(buf, nn);
        vf s = (vf){0};
        int64_t j = 0;
        for (; j + L <= nn; j += L) s += MR_SFX(vload)(buf + j);
        for (int q = 0; q < L; q++) sum += s[q];
        for (; j < nn; j++) sum += buf[j];
    }
    *out_lse = (double)mx + log(sum);
    /* top k: a block is looked at element by element only when one of its values beats the k-th best */
    int cnt = 0;
    if (k <= 0) return 0;
    for (int64_t b = 0; b < n; b += BLK) {
        const int64_t e = n - b < BLK ? n : b + BLK;
        if (cnt == k && e - b == BLK) {
            const vf thr = (vf){0} + tv[k - 1];
            vi above = (vi){0};
            for (int q = 0; q < BLK / L; q++) above |= MR_SFX(vload)(x + b + q * L) > thr;
            if (!MR_SFX(vany)(above)) continue;
        }
        for (int64_t j = b; j < e; j++)
            if (cnt < k || x[j] > tv[k - 1]) MR_SFX(topk_insert)(x[j], j, &cnt, k, ti, tv);
    }
    return cnt;
}

/* Attention of nq <= 16 queries held as SIMD lanes. Qt (D x 16): query i in lane i, pre-scaled;
 * keys / values: rows j < nk of D floats (Kr, Vr); query i sees keys first[i] <= j <= last[i]
 * (lanes past nq: first > last). S: scratch (nk x 16). Ot (D x 16): the softmax-weighted values,
 * lane i = query i. softcap > 0: scores = softcap * tanh(scores / softcap). ml != NULL: Ot is left
 * unnormalized and ml[i] / ml[16 + i] receive lane i's largest score and its sum of exponentials
 * (for merging blocks of keys). */
static void MR_SFX(attn_block)(const float *Qt, const float *Kr, const float *Vr, int64_t D, int64_t nk,
                               const int64_t *first, const int64_t *last, float softcap, float *S, float *Ot, float *ml,
                               void (*vexp)(float *, int64_t)) {
    float mx[16], sum[16];
    /* scores, 4 keys per step (independent accumulators keep the FMA units busy) */
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) {
        float a0[16] = {0}, a1[16] = {0}, a2[16] = {0}, a3[16] = {0};
        const float *k0 = Kr + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
        for (int64_t d = 0; d < D; d++) {
            const float *qd = Qt + d * 16;
            const float x0 = k0[d], x1 = k1[d], x2 = k2[d], x3 = k3[d];
            for (int i = 0; i < 16; i++) {
                a0[i] += qd[i] * x0;
                a1[i] += qd[i] * x1;
                a2[i] += qd[i] * x2;
                a3[i] += qd[i] * x3;
            }
        }
        for (int i = 0; i < 16; i++) {
            S[j * 16 + i] = a0[i];
            S[(j + 1) * 16 + i] = a1[i];
            S[(j + 2) * 16 + i] = a2[i];
            S[(j + 3) * 16 + i] = a3[i];
        }
    }
    for (; j < nk; j++) {
        float a0[16] = {0};
        const float *k0 = Kr + j * D;
        for (int64_t d = 0; d < D; d++)
            for (int i = 0; i < 16; i++) a0[i] += Qt[d * 16 + i] * k0[d];
        for (int i = 0; i < 16; i++) S[j * 16 + i] = a0[i];
    }
    /* cap, mask, softmax over the keys of each lane */
    for (int i = 0; i < 16; i++) mx[i] = -INFINITY;
    for (j = 0; j < nk; j++)
        for (int i = 0; i < 16; i++) {
            float s = S[j * 16 + i];
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            s = j >= first[i] && j <= last[i] ? s : -INFINITY;
            S[j * 16 + i] = s;
            mx[i] = s > mx[i] ? s : mx[i];
        }
    for (int i = 0; i < 16; i++) mx[i] = mx[i] == -INFINITY ? 0.0f : mx[i];
    for (j = 0; j < nk; j++)
        for (int i = 0; i < 16; i++) S[j * 16 + i] -= mx[i];
    vexp(S, nk * 16);
    for (int i = 0; i < 16; i++) sum[i] = 0.0f;
    for (j = 0; j < nk; j++)
        for (int i = 0; i < 16; i++) sum[i] += S[j * 16 + i];
    if (ml) {
        for (int i = 0; i < 16; i++) {
            ml[i] = mx[i];
            ml[16 + i] = sum[i];
            sum[i] = 1.0f;
        }
    } else {
        for (int i = 0; i < 16; i++) sum[i] = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
    }
    /* weighted values: one output dim at a time, the 16 lanes accumulated over all keys */
    for (int64_t d = 0; d < D; d++) {
        float o[16] = {0};
        for (j = 0; j < nk; j++) {
            const float v = Vr[j * D + d], *p = S + j * 16;
            for (int i = 0; i < 16; i++) o[i] += p[i] * v;
        }
        for (int i = 0; i < 16; i++) Ot[d * 16 + i] = o[i] * sum[i];
    }
}

static void MR_SFX(act_mul)(const float *g, const float *u, float *out, int64_t n, int act) {
    if (act == 0) {
        for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * (u ? u[i] : 1.0f);
    } else if (act == 1) {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        for (int64_t i = 0; i < n; i++) {
            const float x = g[i];
            out[i] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * (u ? u[i] : 1.0f);
        }
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = 0.5f * g[i] * (1.0f + mr_erf_as(g[i] * 0.70710678118654752f)) * (u ? u[i] : 1.0f);
    }
}

/* mr_delta_step (common.h) compiled for this unit's ISA: its loops over Dv vectorize at the unit's width */
static void MR_SFX(delta_step)(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                               float *o, int64_t Dk, int64_t Dv, float *kv, float *delta) {
    mr_delta_step(S, q, k, v, decay, beta, o, Dk, Dv, kv, delta);
}

static void MR_SFX(ssm_rows)(float *S, const float *x, const float *B, const float *C, float dA, float dt, int64_t P,
                             int64_t N, float *y) {
    for (int64_t p = 0; p < P; p++) {
        float *s = S + p * N;
        const float xd = x[p] * dt;
        float acc[MR_LANES] = {0};
        int64_t i = 0;
        for (; i + MR_LANES <= N; i += MR_LANES)
            for (int l = 0; l < MR_LANES; l++) {
                const float v = s[i + l] * dA + xd * B[i + l];
                s[i + l] = v;
                acc[l] += v * C[i + l];
            }
        float tot = 0.0f;
        for (; i < N; i++) {
            s[i] = s[i] * dA + xd * B[i];
            tot += s[i] * C[i];
        }
        for (int l = 0; l < MR_LANES; l++) tot += acc[l];
        y[p] = tot;
    }
}

static void MR_SFX(f16_to_f32)(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = mr_f16_to_f32(src[i]);
}

#include "lowbit_impl.h"

void MR_SFX(mr_fill_generic)(mr_kernels *k) {
    memset(k, 0, sizeof(*k));
    k->dq[GT_F32] = MR_SFX(dq_f32);
    k->dq[GT_F16] = MR_SFX(dq_f16);
    k->dq[GT_BF16] = MR_SFX(dq_bf16);
    k->dq[GT_Q4_0] = MR_SFX(dq_q4_0);
    k->dq[GT_Q4_1] = MR_SFX(dq_q4_1);
    k->dq[GT_Q5_0] = MR_SFX(dq_q5_0);
    k->dq[GT_Q5_1] = MR_SFX(dq_q5_1);
    k->dq[GT_Q8_0] = MR_SFX(dq_q8_0);
    k->dq[GT_Q2_K] = MR_SFX(dq_q2_k);
    k->dq[GT_Q3_K] = MR_SFX(dq_q3_k);
    k->dq[GT_Q4_K] = MR_SFX(dq_q4_k);
    k->dq[GT_Q5_K] = MR_SFX(dq_q5_k);
    k->dq[GT_Q6_K] = MR_SFX(dq_q6_k);
    k->dq[GT_IQ4_NL] = MR_SFX(dq_iq4_nl);
    k->dq[GT_IQ4_XS] = MR_SFX(dq_iq4_xs);
    k->quant_x = MR_SFX(quant_x);
    k->dot_f32 = MR_SFX(dot_f32);
    k->tile = MR_SFX(tile);
    k->rmsnorm = MR_SFX(rmsnorm);
    k->softmax = MR_SFX(softmax);
    k->dot = MR_SFX(dot);
    k->axpy = MR_SFX(axpy);
    k->f16_to_f32 = MR_SFX(f16_to_f32);
    k->act_mul = MR_SFX(act_mul);
    k->vexp = MR_SFX(vexp);
    k->ssm_rows = MR_SFX(ssm_rows);
    k->delta_step = MR_SFX(delta_step);
    k->logit_stats = MR_SFX(logit_stats);
    k->attn_block = MR_SFX(attn_block);
    /* integer kernels where the unit targets a SIMD ISA (the scalar build dots in float) */
    MR_SFX(lb_register)(k, MR_VLEN >= 8);
}
