/* KV cache element types: storing new key/value rows and reading chunks of stored rows.
 *
 * A cache layer is (n_kv, n_ctx, row) where a row holds one head's head_dim values in the cache's
 * type: float32, f16 or bf16 bits, or ggml blocks of 32 (q8_0, q4_0, q4_1, q5_0, q5_1) — the block
 * layouts are those of the weight dequantizers (generic_impl.h). Quantizing a row follows ggml's
 * reference quantizers (quantize_row_*_ref in ggml-quants.c, the same rounding as gguf-py's
 * gguf.quants), so a cache written here holds the bytes llama.cpp would write for the same values.
 *
 * Attention never dequantizes a whole cache: it converts the chunk of rows it is about to use
 * (at most a few hundred keys, in the worker's L2 scratch) with the ISA's block dequantizer. */
#include "common.h"

#include <math.h>

int mr_kv_type_ok(int type) {
    switch (type) {
    case GT_F32: case GT_F16: case GT_BF16: case GT_Q8_0: case GT_Q4_0: case GT_Q4_1: case GT_Q5_0: case GT_Q5_1:
        return 1;
    default:
        return 0;
    }
}

long long mr_kv_row_bytes(int type, long long n) {
    if (!mr_kv_type_ok(type) || n <= 0 || n % mr_types[type].block) return -1;
    return n / mr_types[type].block * mr_types[type].bytes;
}

/* The Hadamard rotation a block-quantized cache stores attention rows under (llama.cpp's
 * attn_rot_k / attn_rot_v; the rule and its reason: KVType.rotation in minirt/kv_types.py): keys
 * in runs of the largest power of two >= 64 dividing head_dim, values in runs of 64; 0 = none. */
int mr_kv_rotation(int type, long long head_dim, int keys) {
    if (!mr_kv_type_ok(type) || mr_types[type].block == 1 || head_dim <= 0 || head_dim % 64) return 0;
    if (!keys) return 64;
    int n = 64;
    while (head_dim % (2 * n) == 0) n *= 2;
    return n;
}

/* x (len floats, len a multiple of n, n a power of two): each run of n values multiplied by the
 * orthonormal Walsh-Hadamard matrix in natural order, in place (its own inverse). The butterflies
 * and the final scale are those of kv_types.rotate, so both give the same floats. */
void mr_kv_rotate(float *x, int64_t len, int64_t n) {
    if (n <= 1) return;
    const mr_kernels *K = mr_get_kernels(-1);
    if (n >= 16 && K && K->fwht) { /* SIMD butterflies (x86_avx512.c): about 20x the loop below */
        K->fwht(x, len, n);
        return;
    }
    const float s = 1.0f / sqrtf((float)n);
    for (int64_t r = 0; r + n <= len; r += n) {
        float *y = x + r;
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        for (int64_t j = 0; j < n; j++) y[j] *= s;
    }
}

int mr_kv_rotate_rows(float *x, long long len, long long n) {
    if (!x || len < 0 || n < 1 || n > 4096 || (n & (n - 1)) || len % n) return MR_E_SHAPE;
    mr_kv_rotate(x, len, n);
    return MR_OK;
}

MR_INLINE uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays a (quiet) NaN, as ggml */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

MR_INLINE void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* value and index of the element of largest magnitude (the first of equal ones, as numpy's argmax) */
MR_INLINE float absmax_signed(const float *x, int n, float *amax) {
    float best = 0.0f, v = 0.0f;
    for (int j = 0; j < n; j++) {
        const float a = fabsf(x[j]);
        if (a > best) {
            best = a;
            v = x[j];
        }
    }
    *amax = best;
    return v;
}

MR_INLINE void min_max(const float *x, int n, float *mn, float *mx) {
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < n; j++) {
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
    }
    *mn = lo;
    *mx = hi;
}

static void q8_0_block(const float *x, uint8_t *b) {
    float amax;
    (void)absmax_signed(x, 32, &amax);
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    wr16(b, mr_f32_to_f16(d));
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

static void q4_0_block(const float *x, uint8_t *b) {
    float amax;
    const float mx = absmax_signed(x, 32, &amax);
    const float d = mx / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    wr16(b, mr_f32_to_f16(d));
    for (int j = 0; j < 16; j++) {
        int lo = (int)(x[j] * id + 8.5f), hi = (int)(x[j + 16] * id + 8.5f);
        lo = lo < 0 ? 0 : lo > 15 ? 15 : lo;
        hi = hi < 0 ? 0 : hi > 15 ? 15 : hi;
        b[2 + j] = (uint8_t)(lo | (hi << 4));
    }
}

static void q4_1_block(const float *x, uint8_t *b) {
    float mn, mx;
    min_max(x, 32, &mn, &mx);
    const float d = (mx - mn) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    wr16(b, mr_f32_to_f16(d));
    wr16(b + 2, mr_f32_to_f16(mn));
    for (int j = 0; j < 16; j++) {
        int lo = (int)((x[j] - mn) * id + 0.5f), hi = (int)((x[j + 16] - mn) * id + 0.5f);
        lo = lo < 0 ? 0 : lo > 15 ? 15 : lo;
        hi = hi < 0 ? 0 : hi > 15 ? 15 : hi;
        b[4 + j] = (uint8_t)(lo | (hi << 4));
    }
}

/* q5_0 / q5_1: low nibbles in qs, the 5th bit of element j in bit j of qh */
static void q5_pack(const int *q, uint8_t *qh4, uint8_t *qs) {
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t)((q[j] & 15) | ((q[j + 16] & 15) << 4));
        qh |= (uint32_t)((q[j] >> 4) & 1) << j;
        qh |= (uint32_t)((q[j + 16] >> 4) & 1) << (j + 16);
    }
    for (int i = 0; i < 4; i++) qh4[i] = (uint8_t)(qh >> (8 * i));
}

static void q5_0_block(const float *x, uint8_t *b) {
    float amax;
    const float mx = absmax_signed(x, 32, &amax);
    const float d = mx / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int q[32];
    for (int j = 0; j < 32; j++) {
        const int v = (int)(x[j] * id + 16.5f);
        q[j] = v < 0 ? 0 : v > 31 ? 31 : v;
    }
    wr16(b, mr_f32_to_f16(d));
    q5_pack(q, b + 2, b + 6);
}

static void q5_1_block(const float *x, uint8_t *b) {
    float mn, mx;
    min_max(x, 32, &mn, &mx);
    const float d = (mx - mn) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int q[32];
    for (int j = 0; j < 32; j++) {
        const int v = (int)((x[j] - mn) * id + 0.5f);
        q[j] = v < 0 ? 0 : v > 31 ? 31 : v;
    }
    wr16(b, mr_f32_to_f16(d));
    wr16(b + 2, mr_f32_to_f16(mn));
    q5_pack(q, b + 4, b + 8);
}

/* n floats of x (n a multiple of the type's block) into dst in the cache type */
void mr_kv_store(int type, const float *x, int64_t n, void *dst) {
    uint8_t *b = (uint8_t *)dst;
    switch (type) {
    case GT_F32: memcpy(dst, x, (size_t)n * 4); return;
    case GT_F16: for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = mr_f32_to_f16(x[i]); return;
    case GT_BF16: for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_to_bf16(x[i]); return;
    case GT_Q8_0: for (int64_t i = 0; i < n; i += 32, b += 34) q8_0_block(x + i, b); return;
    case GT_Q4_0: for (int64_t i = 0; i < n; i += 32, b += 18) q4_0_block(x + i, b); return;
    case GT_Q4_1: for (int64_t i = 0; i < n; i += 32, b += 20) q4_1_block(x + i, b); return;
    case GT_Q5_0: for (int64_t i = 0; i < n; i += 32, b += 22) q5_0_block(x + i, b); return;
    case GT_Q5_1: for (int64_t i = 0; i < n; i += 32, b += 24) q5_1_block(x + i, b); return;
    default: return;
    }
}

/* nrows stored rows of D values starting at row0 of a head's rows at base, as float32: a pointer
 * into the cache itself for float32, else `scratch` (nrows * D floats) filled by the dequantizer */
const float *mr_kv_rows(const mr_kernels *K, int type, const void *base, int64_t row0, int64_t nrows, int64_t D,
                        float *scratch) {
    if (type == GT_F32) return (const float *)base + row0 * D;
    const mr_type_info ti = mr_types[type];
    const int64_t rb = D / ti.block * ti.bytes;
    const uint8_t *src = (const uint8_t *)base + row0 * rb;
    if (type == GT_F16) K->f16_to_f32((const uint16_t *)src, scratch, nrows * D);
    else K->dq[type](src, scratch, nrows * D / ti.block);
    return scratch;
}

int mr_kv_quantize(int type, const float *x, long long n, unsigned char *dst) {
    if (mr_kv_row_bytes(type, n) < 0) return MR_E_QTYPE;
    mr_kv_store(type, x, n, dst);
    return MR_OK;
}

int mr_kv_dequantize(int type, const unsigned char *src, long long n, float *dst) {
    const mr_kernels *K = mr_get_kernels(-1);
    if (!K) return MR_E_ISA;
    if (mr_kv_row_bytes(type, n) < 0) return MR_E_QTYPE;
    const float *r = mr_kv_rows(K, type, src, 0, 1, n, dst);
    if (r != dst) memcpy(dst, r, (size_t)n * 4);
    return MR_OK;
}
