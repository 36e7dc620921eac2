/* Shared internals of the minirt native kernels: ggml type ids, block sizes, fp16/bf16 conversion,
 * the per-ISA kernel table and the target pragmas that let one shared library carry several ISAs. */
#ifndef MINIRT_COMMON_H
#define MINIRT_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#include "api.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define MR_X86 1
#endif
#if defined(__aarch64__)
#define MR_ARM64 1
#endif

#define MR_INLINE static inline __attribute__((always_inline))
#define MR_RESTRICT __restrict__

/* ggml type ids (ggml.h) */
enum {
    GT_F32 = 0, GT_F16 = 1, GT_Q4_0 = 2, GT_Q4_1 = 3, GT_Q5_0 = 6, GT_Q5_1 = 7, GT_Q8_0 = 8,
    GT_Q2_K = 10, GT_Q3_K = 11, GT_Q4_K = 12, GT_Q5_K = 13, GT_Q6_K = 14,
    GT_IQ2_XXS = 16, GT_IQ2_XS = 17, GT_IQ3_XXS = 18, GT_IQ1_S = 19, GT_IQ4_NL = 20, GT_IQ3_S = 21, GT_IQ2_S = 22,
    GT_IQ4_XS = 23, GT_IQ1_M = 29, GT_BF16 = 30, GT_TQ1_0 = 34, GT_TQ2_0 = 35, GT_MXFP4 = 39, GT_COUNT = 40
};

#define QK 32      /* elements per small block and per activation-quantization block */
#define QKK 256    /* elements per k-quant super-block */

/* Tile of the float (prefill) path: MR_TR rows x MR_TT tokens of accumulators; the K loop is cut
 * into chunks of at most MR_KC elements so the dequantized rows (MR_TR * MR_KC floats) stay in L1. */
#define MR_TR 8
#define MR_TT 3
#define MR_KC 1024

/* Panel path: MR_PR rows per panel, K cut into chunks of MR_KP (a multiple of every block size). */
#define MR_PR 32
#define MR_KP 256

/* The integer path handles up to MR_NT_INT tokens per pass over a weight row. */
#define MR_NT_INT 4
/* Packed weights: tokens up to which the integer kernels are used (all of them in one pass over each
 * row group); also the most sequences mr_decode_layers takes at once. */
#define MR_PACKED_INT_MAX 16
/* Most elements mr_logit_stats ranks (a sampler's top-k / top_logprobs beyond this use numpy). */
#define MR_TOPK_MAX 64
/* phases timed by mr_profile_enable (layer.c), plus a layer count */
#define MR_PROF_PHASES 8

typedef struct {
    int block;      /* elements per block (1 for float types) */
    int bytes;      /* bytes per block */
} mr_type_info;

extern const mr_type_info mr_types[GT_COUNT];

MR_INLINE int mr_type_ok(int t) { return t >= 0 && t < GT_COUNT && mr_types[t].block > 0; }

/* ---- scalar conversions ---- */
MR_INLINE float mr_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

MR_INLINE uint16_t mr_f32_to_f16(float f) { /* round to nearest even (the f16 KV cache) */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t man = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        man |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = 1u << (shift - 1);
        uint32_t r = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((uint32_t)exp << 10) | (man >> 13);
    uint32_t rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(sign | r);
}

MR_INLINE float mr_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* erf(x) by Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7 (the formula of minirt.blocks.erf; the
 * SIMD erf-GELU kernels evaluate the same polynomial) */
MR_INLINE float mr_erf_as(float x) {
    const float a = fabsf(x), t = 1.0f / (1.0f + 0.3275911f * a);
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    const float y = 1.0f - poly * expf(-a * a);
    return x < 0.0f ? -y : y;
}

MR_INLINE uint16_t mr_rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
MR_INLINE uint32_t mr_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
MR_INLINE uint64_t mr_rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
MR_INLINE float mr_rdf16(const uint8_t *p) { return mr_f16_to_f32(mr_rd16(p)); }

/* The 6-bit scale / min pair j (0..7) of a Q4_K / Q5_K super-block (ggml get_scale_min_k4). */
MR_INLINE void mr_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* The 16 signed 6-bit per-16 scales of a Q3_K super-block from its 12 packed bytes (ggml's layout:
 * low nibbles of bytes 0..7 then their high nibbles, high bit pairs in bytes 8..11). */
MR_INLINE void mr_q3k_scales(const uint8_t *s12, int16_t *out) {
    for (int g = 0; g < 16; g++) {
        const int lo = g < 8 ? (s12[g] & 15) : (s12[g - 8] >> 4);
        const int hi = (s12[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
        out[g] = (int16_t)((lo | (hi << 4)) - 32);
    }
}

/* IQ2_XXS / IQ3_XXS: the sign byte of 8 weights l (0..3) from a group's aux word: 7 stored bits
 * and their parity as the 8th (ggml ksigns_iq2xs) */
MR_INLINE uint8_t mr_iq_ksign(uint32_t aux, int l) {
    const uint32_t v = (aux >> (7 * l)) & 127;
    return (uint8_t)(v | ((uint32_t)__builtin_parity(v) << 7));
}

/* IQ1_M's block scale: an f16 spread over the top nibbles of its four u16 scale words @48 */
MR_INLINE float mr_iq1m_d(const uint8_t *b) {
    const uint16_t s0 = mr_rd16(b + 48), s1 = mr_rd16(b + 50), s2 = mr_rd16(b + 52), s3 = mr_rd16(b + 54);
    return mr_f16_to_f32((uint16_t)((s0 >> 12) | ((s1 >> 8) & 0xf0) | ((s2 >> 4) & 0xf00) | (s3 & 0xf000)));
}

extern const int8_t mr_kvalues_iq4nl[16];
/* MXFP4 (32 elements: e8m0 scale @0 | qs[16] @1): element codes -> 2 x the FP4 value, and the
 * scale halved to match: d = 2^(e-128) from bits (ggml_e8m0_to_fp32_half) */
extern const int8_t mr_kvalues_mxfp4[16];
MR_INLINE float mr_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    return d;
}
/* i-quant grids (iq_grids.c, from ggml-common.h): 8 (uint64) or 4 (uint32) grid bytes per entry */
extern const uint64_t mr_iq2xxs_grid[256], mr_iq2xs_grid[512], mr_iq2s_grid[1024], mr_iq1s_grid[2048];
extern const uint32_t mr_iq3xxs_grid[256], mr_iq3s_grid[512];

/* ---- per-ISA kernel table ---- */

/* Dequantize `nblocks` consecutive blocks of `src` into dst (nblocks * block floats). */
typedef void (*mr_dq_fn)(const uint8_t *src, float *dst, int64_t nblocks);

/* Integer path: dots of one weight row (nb32 blocks of 32 elements) with nt (1..MR_NT_INT) tokens
 * whose activations were quantized per 32 elements: xq int16 (nt, xq_stride), xd scale and xs float
 * sum per block (nt, xb_stride). out[t] = dot. */
typedef void (*mr_vint_fn)(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd,
                           const float *xs, int64_t xq_stride, int64_t xb_stride, int nt, float *out);

/* Integer GEMM activations (x86_avx512_gemm.c): the integer path's int16 activations regrouped by
 * 16 tokens; per group and 32-block: q (16 pairs x 16 tokens x 2 int16), d (16 scales), ds (16 values
 * scale * integer sum of q, for the types with a min). Padding tokens are all zero. */
typedef struct {
    int16_t *q;
    float *d, *ds;
    int64_t nb, ng;
} mr_xp;

/* Activations of the integer path, quantized once per call (dispatch.c). Token t's data start at
 * q + t*qs (int16, natural order), qp + t*qs (the same values with each pair of 32-blocks interleaved
 * by 16-element halves, see xpair; NULL when no kernel of the call needs it), and d + t*bs, s + t*bs,
 * sq + t*bs (per 32-block: scale, float sum of x, scale * integer sum of q), sq16 + 2*t*bs (per
 * 16 elements: scale * integer sum of q). sq/sq16 let kernels fold a constant weight offset (Q4_0's
 * -8, Q6_K's -32) out of the inner loop exactly: sum (q - o) * xq == sum q * xq - o * sum xq. */
typedef struct {
    const int16_t *q, *qp;
    const float *d, *s, *sq, *sq16;
    int64_t qs, bs;
    mr_xp xp; /* the same activations as a GEMM panel (MR_XL_PANEL), else xp.q == NULL; by value: a
               * late worker of a finished job reads its own copy (see pool.c) */
    /* MR_XL_Q8 (cols a multiple of 256): int8 per 256-element super-block, as llama.cpp's q8_K for
     * the K-quants. Token t: q8 + t*qs (bytes; each super-block in the 2-bit order, see
     * mr_q8_order), d8 + t*bs/8 (scale per super-block), s8 + 2*t*bs (per 16 elements in natural
     * order: scale * integer sum of q8). NULL when no kernel of the call needs them. */
    const int8_t *q8;
    const float *d8, *s8;
    const int32_t *i8; /* MR_XL_Q8: i8 + t*bs/8: integer sum of q8 per super-block (TQ2_0's offset) */
} mr_xact;

/* The order of a super-block's 256 int8 activations in MR_XL_Q8: the 64 bytes of step s (0..3) are
 * elements 32s..32s+31 then 128+32s..128+32s+31 — the elements that bits 2s of the 64 code bytes of
 * Q2_K / Q3_K / TQ2_0 hold, so one shifted 64-byte load of codes meets one 64-byte load of x. */
static inline int mr_q8_order(int i) { /* position i (0..255) -> element */
    const int s = i / 64, k = i % 64;
    return 32 * s + (k < 32 ? k : 128 + k - 32);
}

/* Multi-row integer kernel: y[t*ys + r] = dot(row r of w, x_t) for r < nrows, t < nt (nt <= MR_NT_INT);
 * rows have rb bytes, nb32 32-element blocks. The kernel prefetches its own rows ahead. */
typedef void (*mr_gemv_fn)(const uint8_t *w, int64_t rb, int64_t nrows, int64_t nb32, const mr_xact *xa, int nt,
                           float *y, int64_t ys);

/* Packed kernels (pack.c, layout "P4": tiles of 4 rows x mr_pack_tile_cols columns):
 * y[t*ys + 4g + r] for the 4 rows r of each of ngroups row groups (padding rows included: y must
 * have room), t < nt (any count: up to MR_NT_INT tokens with accumulators in registers, more up to
 * MR_PACKED_INT_MAX at a time per row group with accumulators in L1). xa->q holds the activations
 * permuted within each 128-column quad (mr_pack_perm); xa->d, s, sq, sq16 keep the natural order. */
#define MR_P4_COLS 128
typedef void (*mr_pgemv_fn)(const uint8_t *wp, int64_t ngroups, int64_t ntiles, const mr_xact *xa, int nt, float *y,
                            int64_t ys);
int mr_pack_tile_bytes(int qtype);
int mr_pack_tile_cols(int qtype);
int mr_pack_supported(int qtype, long long rows, long long cols);
int mr_pack_perm(int qtype, int p);
void mr_pack_dq_tile(int qtype, const uint8_t *tile, float *out, int64_t os);

/* Software prefetch distance of the gemv kernels in bytes (MINIRT_PF; default 0 = off). */
extern int mr_pf_dist;

typedef struct {
    mr_dq_fn dq[GT_COUNT];
    /* Multi-row integer kernels (preferred over vint when set); gemv_pair: wants xa->qp. */
    mr_gemv_fn gemv[GT_COUNT];
    uint8_t gemv_pair[GT_COUNT];
    uint8_t gemv_q8[GT_COUNT]; /* 1: the gemv kernel reads int8 activations (MR_XL_Q8) */
    /* Tokens up to which this type's integer kernels beat the float paths (0: the default, 4) */
    uint16_t int_tokens[GT_COUNT];
    /* Packed-layout integer kernels and tile dequantizers (NULL: portable fallback). */
    mr_pgemv_fn pgemv[GT_COUNT];
    void (*pdq[GT_COUNT])(const uint8_t *tile, float *out, int64_t os);
    mr_vint_fn vint[GT_COUNT];
    /* 1: the integer kernel wants each pair of 32-blocks of activations interleaved by 16-element
     * halves (a[0:16] b[0:16] a[16:32] b[16:32]), the order nibble unpacking produces. */
    uint8_t xpair[GT_COUNT];
    /* Quantize n (multiple of 32) floats to int16 per 32-block: q, d (scale), s (float sum). */
    void (*quant_x)(const float *x, int64_t n, int16_t *q, float *d, float *s);
    /* Float dots: out[t] = dot(w[0:n], x[t*xs : t*xs + n]) for t < nt (nt <= MR_NT_INT). */
    void (*dot_f32)(const float *w, const float *x, int64_t xs, int64_t n, int nt, float *out);
    /* Tile: y[t*ys + r] (+)= dot(wt[r*n : (r+1)*n], x[t*xs :]) for r < nr, t < ntk. acc: add to y. */
    void (*tile)(const float *wt, int nr, const float *x, int64_t xs, int ntk, int64_t n,
                 float *y, int64_t ys, int acc);
    /* Panel path for many tokens (NULL where the ISA has none): pack() transposes nr <= MR_PR rows
     * (row stride n) into P[k * MR_PR + r] (rows >= nr zero); panel() then computes
     * y[t*ys + r] (+)= sum_k P[k*MR_PR + r] * x[t*xs + k] for r < nr, t < ntk, as outer products. */
    void (*pack)(const float *a, int nr, int64_t n, float *P);
    void (*panel)(const float *P, int nr, const float *x, int64_t xs, int ntk, int64_t n, float *y, int64_t ys,
                  int acc);
    /* Integer GEMM for many tokens on packed matrices (NULL where the ISA has none): gemm_xpanel
     * quantizes nt rows of x as quant_x does into a panel (tmp: 9 * cols floats of scratch);
     * gw[type] unpacks ng 4-row groups of tiles into int16 rows wu (row stride cols), per-32 scales wd
     * and mins wm (gw_min 1), or per-16 scales wd (gw_min 2: 2 * cols / 32 per row, where wm would be); gemm_rows
     * then computes y[t * ys + r] for r < nr <= 8 (16 with gemm_i8), t < nt (s16: wd per 16, wm NULL), and may
     * prefetch the pfn bytes at pf (the packed tiles unpacked next) on the way. */
    void (*gemm_xpanel)(const float *x, int64_t nt, int64_t xs, int64_t cols, float *tmp, mr_xp *xp);
    void (*gw[GT_COUNT])(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu, float *wd,
                         float *wm);
    uint8_t gw_min[GT_COUNT];
    void (*gemm_rows)(const int16_t *wu, const float *wd, const float *wm, int nr, int64_t cols, const mr_xp *x,
                      int64_t nt, float *y, int64_t ys, int s16, const uint8_t *pf, int64_t pfn);
    /* gw8[type]: gw's unpacking in the AMX int8 GEMM's form (x86_avx512_gemm.c: int8 rows, scales and mins by K
     * step, 16 rows each); gemm_i8: this table's gemm_xpanel / gemm_rows are that GEMM's (16 rows per call) */
    void (*gw8[GT_COUNT])(const uint8_t *wp, int64_t ntiles, int64_t tb, int ng, int64_t cols, int16_t *wu,
                          float *wd, float *wm);
    int gemm_i8;
    uint8_t gemm_min_t[GT_COUNT]; /* the GEMM from this many tokens (0: MR_GEMM_MIN_TOKENS) */
    /* AMX path for many tokens (x86_amx.c; NULL where the ISA has none): amx_prep_x splits nt float rows into
     * bf16 hi / lo rows (padded to 16 tokens), amx_prep_w nr <= 32 float rows into the tile layout of amx_rows,
     * which computes y[t * ys + r] for t < nt, r < nr. */
    void (*amx_prep_x)(const float *x, int64_t nt, int64_t xs, int64_t cols, uint16_t *xh, uint16_t *xl);
    void (*amx_prep_w)(const float *w, int nr, int64_t cols, uint16_t *wt);
    void (*amx_rows)(const uint16_t *wt, int nr, int64_t cols, const uint16_t *xh, const uint16_t *xl, int64_t nt,
                     float *y, int64_t ys);
    /* Elementwise helpers (ops.c, compiled per ISA). */
    void (*rmsnorm)(const float *x, const float *w, float eps, int64_t n, float *out);
    void (*softmax)(float *x, int64_t n);
    float (*dot)(const float *a, const float *b, int64_t n);
    void (*axpy)(float a, const float *x, float *y, int64_t n);  /* y += a x */
    void (*f16_to_f32)(const uint16_t *src, float *dst, int64_t n);
    /* out[i] = act(g[i]) * u[i] (u NULL: act(g[i])); act 0 SiLU x / (1 + e^-x), 1 tanh GELU, 2 erf GELU */
    void (*act_mul)(const float *g, const float *u, float *out, int64_t n, int act);
    /* x[i] = e^x[i] in place (e^-inf = 0). */
    void (*vexp)(float *x, int64_t n);
    /* One token of one Mamba-2 head: each row p of S (P x N) becomes dA * S_p + (dt * x_p) * B, and
     * y_p = S_p . C. */
    void (*ssm_rows)(float *S, const float *x, const float *B, const float *C, float dA, float dt, int64_t P,
                     int64_t N, float *y);
    /* One token of the gated delta rule for one value head (mr_delta_step below, compiled for the ISA). */
    void (*delta_step)(float *S, const float *q, const float *k, const float *v, float decay, float beta, float *o,
                       int64_t Dk, int64_t Dv, float *kv, float *delta);
    /* Sampler statistics of one row (mr_logit_stats in api.h); returns how many top entries. */
    int (*logit_stats)(const float *x, int64_t n, int k, float *out_max, double *out_lse, int64_t *ti, float *tv,
                       void (*vexp)(float *, int64_t));
    /* Attention of up to 16 queries (SIMD lanes) over nk keys (attn_block in generic_impl.h);
     * ml != NULL: Ot left unnormalized, ml[0..15] = per-lane max score, ml[16..31] = sum of e^(s - max). */
    void (*attn_block)(const float *Qt, const float *Kr, const float *Vr, int64_t D, int64_t nk, const int64_t *first,
                       const int64_t *last, float softcap, float *S, float *Ot, float *ml, void (*vexp)(float *, int64_t));
    /* Decode attention of g <= 16 queries Q (g, D) (pre-scaled, D a multiple of 64) over all nk keys:
     * O (g, D) unnormalized, ml[i] = max score of query i, ml[16 + i] = its sum of e^(s - max);
     * S: scratch (nk, 16). NULL where the ISA has none (attn_block is used instead). */
    void (*attn_dec)(const float *Q, int g, const float *Kr, const float *Vr, int64_t D, int64_t nk, float softcap,
                     float *S, float *O, float *ml);
    /* attn_dec over float16 rows Kh, Vh (nk, D) as the cache stores them; NULL where the ISA has none. */
    void (*attn_dec_h)(const float *Q, int g, const uint16_t *Kh, const uint16_t *Vh, int64_t D, int64_t nk,
                       float softcap, float *S, float *O, float *ml);
    /* mr_kv_rotate for power-of-two n >= 16 (the same floats); NULL: the portable loop in kvcache.c. */
    void (*fwht)(float *x, int64_t len, int64_t n);
} mr_kernels;

/* A weight matrix as the integer kernels see it (dispatch.c). */
typedef struct {
    int qtype, packed;
    const uint8_t *w;
    int64_t rows, cols, rb; /* rb: bytes per ggml row */
    int64_t tb, ntiles;     /* packed: bytes per tile, tiles per row group */
} mr_mat;
/* Bytes of weights per row of a packed matrix: a tile holds tb bytes of 4 rows, ntiles tiles per row group. */
static inline int64_t mr_packed_row_bytes(int64_t tb, int64_t ntiles) { return tb * ntiles / 4; }
/* Bytes of weights per row of m, packed or not. */
static inline int64_t mr_mat_row_bytes(const mr_mat *m) { return m->packed ? mr_packed_row_bytes(m->tb, m->ntiles) : m->rb; }

/* Activation layouts (bit masks): natural order, pair-interleaved, packed permutations E / E6. */
enum { MR_XL_NAT = 1, MR_XL_PAIR = 2, MR_XL_PERM = 4, MR_XL_PERM6 = 8, MR_XL_PANEL = 16, MR_XL_Q8 = 32 };
typedef struct {
    mr_xact nat, pair, perm, perm6, q8;
} mr_xacts;
/* The layout the integer kernels want for m (0: no integer kernel for it on this ISA). */
int mr_mat_xlayout(const mr_kernels *K, const mr_mat *m);
/* Quantize nt rows of x into the scratch buffers in every layout of the mask (call lock held). */
int mr_prepare_x(const mr_kernels *K, const float *x, int64_t nt, int64_t x_stride, int64_t cols, int layouts,
                 mr_xacts *xs);
const mr_xact *mr_xact_for(const mr_xacts *xs, int layout);
/* 1: rows of m for nt tokens take the integer GEMM (packed, a type with gw kernels, enough tokens);
 * their activations then need MR_XL_PANEL, and mr_mat_rows a worker for its scratch. */
int mr_mat_gemm(const mr_kernels *K, const mr_mat *m, int64_t nt);
/* Rows [r0, r1) of m for nt tokens: yy[t * yys + (r - r0)]; packed: r0 a multiple of 4. */
void mr_mat_rows(const mr_kernels *K, const mr_mat *m, const mr_xact *xa, int64_t nt, int64_t r0, int64_t r1, float *yy,
                 int64_t yys, int worker);
/* Rows per parallel item of a matrix product: about 16 items per thread within [lo, hi], a multiple of 8,
 * but at least MR_ITEM_BYTES of weights per token (rb: bytes per row, nt tokens) unless that would leave a
 * thread without an item. Claiming and publishing an item costs a few contended atomics and breaks the
 * thread's memory stream: measured in decode (2 threads, interleaved runs), items of 256 KiB instead of the
 * 16-per-thread rule made steps 10-25 % faster on the small matrices of a 2.7B MoE (768 x 2048 experts),
 * Gemma3-270M and Qwen2.5-0.5B; 64 KiB gave half of that, 1-8 MiB no more. */
#define MR_ITEM_BYTES 262144
int64_t mr_pick_chunk(int64_t rows, int64_t rb, int64_t nt, int threads, int64_t lo, int64_t hi);

/* ops.c helpers shared with layer.c */
int mr_attention_decode_batch(const mr_kernels *K, const float *q, float *out, int64_t B, const void *const *k,
                              const void *const *v, const int64_t *n_ctx, const int64_t *start, const int64_t *end,
                              int64_t H, int64_t Hkv, int64_t D, int type_k, int type_v, float scale, float softcap,
                              const float *sinks, int threads);

/* KV cache element types (kvcache.c): ggml ids F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.
 * mr_kv_store writes n values (a multiple of the block) as ggml's reference quantizer does;
 * mr_kv_rows returns nrows rows of D values from row0 of `base` as float32 (into scratch unless f32). */
void mr_kv_store(int type, const float *x, int64_t n, void *dst);
/* runs of n values of x (len) through the orthonormal Hadamard rotation, in place (mr_kv_rotation) */
void mr_kv_rotate(float *x, int64_t len, int64_t n);
const float *mr_kv_rows(const mr_kernels *K, int type, const void *base, int64_t row0, int64_t nrows, int64_t D,
                        float *scratch);
void mr_rope_row(float *v, long long n_rot, const float *cs, const float *sn, int neox);



extern mr_kernels mr_kernels_scalar;
#ifdef MR_X86
extern mr_kernels mr_kernels_avx2;
extern mr_kernels mr_kernels_avx512;
extern mr_kernels mr_kernels_amx;
#endif
#ifdef MR_ARM64
extern mr_kernels mr_kernels_neon;
#endif

void mr_fill_generic_scalar(mr_kernels *k);
#ifdef MR_X86
void mr_fill_generic_avx2(mr_kernels *k);
void mr_fill_generic_avx512(mr_kernels *k);
/* x86_avx2.c: the AVX2 row kernels of the low-bit types, which the AVX-512 table uses too */
void mr_avx2_lowbit_rows(mr_kernels *k);
#endif
#ifdef MR_ARM64
void mr_fill_generic_neon(mr_kernels *k);
#endif

const mr_kernels *mr_get_kernels(int isa);   /* NULL when isa not supported */
int mr_resolve_isa(int isa);                 /* -1 -> selected; returns -1 when unsupported */

/* ---- thread pool (pool.c) ---- */
/* One item of a job. buf == NULL: write the outputs in place; else write them to buf (buf_floats
 * floats) for commit() to copy out (stealable jobs, see pool.c). */
typedef void (*mr_task_fn)(const void *ctx, int64_t item, int worker, float *buf);
typedef void (*mr_commit_fn)(const void *ctx, int64_t item, const float *buf);
/* Run fn for items [0, n_items) on `threads` threads (the caller is worker 0). The ctx bytes are
 * copied (ctx_size <= 2048). commit != NULL makes the job stealable. */
int mr_parallel_for(mr_task_fn fn, mr_commit_fn commit, const void *ctx, size_t ctx_size, int64_t n_items,
                    int64_t buf_floats, int threads);
int mr_pool_threads_default(void);
/* The call lock: one caller of the pool at a time (the caller is worker 0 and owns the shared scratch). */
void mr_call_lock(void);
void mr_call_unlock(void);
/* free(p) once no worker can still be inside a job that reads p (a late worker of a stolen item). Caller
 * holds the call lock. */
void mr_defer_free(void *p);
/* An entry point's success return: mr_pool_steals() (api.h) - s0, s0 read under the call lock when the call
 * began, so that the steals of nested jobs count too; clamped to 1000000. */
int mr_steals_since(unsigned long long s0);

/* gpt-oss' clamped SwiGLU, as ggml's swiglu_oai, in place in g: g' = min(g, limit), g' * sigmoid(alpha g') *
 * (clamp(u, -limit, limit) + 1) */
MR_INLINE void mr_swiglu_oai(float *g, const float *u, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i] < limit ? g[i] : limit;
        float y = u[i] < -limit ? -limit : u[i];
        y = y > limit ? limit : y;
        g[i] = x / (1.0f + expf(-alpha * x)) * (y + 1.0f);
    }
}

/* An ungated feed-forward's activation a = act(u) (a may be u): 0 SiLU, 1 GELU (tanh) as K->act_mul without
 * gate, 4 squared ReLU */
MR_INLINE void mr_expert_act(const mr_kernels *K, const float *u, float *a, int64_t n, int act) {
    if (act != 4) {
        K->act_mul(u, NULL, a, n, act);
        return;
    }
    for (int64_t i = 0; i < n; i++) a[i] = u[i] > 0.0f ? u[i] * u[i] : 0.0f;
}

/* softplus(v) = log(1 + e^v), as numpy's logaddexp(0, v) (no overflow for large v) */
MR_INLINE float mr_softplus(float v) { return v > 0.0f ? v + log1pf(expf(-v)) : log1pf(expf(v)); }

/* One token of the gated delta rule for one value head (mr_delta_rule, the fused decode step): its state S
 * (Dk x Dv, row i = key dimension i) becomes decay S + k (x) beta (v - (decay S)^T k) and o = S^T q; two
 * passes over S. kv, delta: scratch of Dv floats. */
MR_INLINE void mr_delta_step(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                             float *o, int64_t Dk, int64_t Dv, float *kv, float *delta) {
    for (int64_t j = 0; j < Dv; j++) kv[j] = 0.0f;
    for (int64_t i = 0; i < Dk; i++) {
        float *s = S + i * Dv;
        const float ki = k[i];
        for (int64_t j = 0; j < Dv; j++) {
            s[j] *= decay;
            kv[j] += ki * s[j];
        }
    }
    for (int64_t j = 0; j < Dv; j++) {
        delta[j] = (v[j] - kv[j]) * beta;
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < Dk; i++) {
        float *s = S + i * Dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < Dv; j++) {
            s[j] += ki * delta[j];
            o[j] += qi * s[j];
        }
    }
}

/* Per-worker scratch memory, 64-byte aligned, grown on demand (never shrinks). */
void *mr_scratch(int worker, int slot, size_t bytes);
#define MR_MAX_WORKERS 64

#endif
