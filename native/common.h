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
    GT_IQ4_NL = 20, GT_IQ4_XS = 23, GT_BF16 = 30, GT_COUNT = 31
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

MR_INLINE uint16_t mr_f32_to_f16(float f) { /* round to nearest even; used by tests of the f16 KV path only */
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

MR_INLINE uint16_t mr_rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
MR_INLINE uint32_t mr_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
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

extern const int8_t mr_kvalues_iq4nl[16];

/* ---- per-ISA kernel table ---- */

/* Dequantize `nblocks` consecutive blocks of `src` into dst (nblocks * block floats). */
typedef void (*mr_dq_fn)(const uint8_t *src, float *dst, int64_t nblocks);

/* Integer path: dots of one weight row (nb32 blocks of 32 elements) with nt (1..MR_NT_INT) tokens
 * whose activations were quantized per 32 elements: xq int16 (nt, xq_stride), xd scale and xs float
 * sum per block (nt, xb_stride). out[t] = dot. */
typedef void (*mr_vint_fn)(const uint8_t *w, int64_t nb32, const int16_t *xq, const float *xd,
                           const float *xs, int64_t xq_stride, int64_t xb_stride, int nt, float *out);

typedef struct {
    mr_dq_fn dq[GT_COUNT];
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
    /* Elementwise helpers (ops.c, compiled per ISA). */
    void (*rmsnorm)(const float *x, const float *w, float eps, int64_t n, float *out);
    void (*softmax)(float *x, int64_t n);
    float (*dot)(const float *a, const float *b, int64_t n);
    void (*axpy)(float a, const float *x, float *y, int64_t n);  /* y += a x */
    void (*f16_to_f32)(const uint16_t *src, float *dst, int64_t n);
} mr_kernels;

extern mr_kernels mr_kernels_scalar;
#ifdef MR_X86
extern mr_kernels mr_kernels_avx2;
extern mr_kernels mr_kernels_avx512;
#endif
#ifdef MR_ARM64
extern mr_kernels mr_kernels_neon;
#endif

void mr_fill_generic_scalar(mr_kernels *k);
#ifdef MR_X86
void mr_fill_generic_avx2(mr_kernels *k);
void mr_fill_generic_avx512(mr_kernels *k);
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
 * copied (ctx_size <= 256). commit != NULL makes the job stealable. */
int mr_parallel_for(mr_task_fn fn, mr_commit_fn commit, const void *ctx, size_t ctx_size, int64_t n_items,
                    int64_t buf_floats, int threads);
int mr_pool_threads_default(void);

/* Per-worker scratch memory, 64-byte aligned, grown on demand (never shrinks). */
void *mr_scratch(int worker, int slot, size_t bytes);
#define MR_MAX_WORKERS 64

#endif
