/* Packed weight layout ("P4") for the decode kernels, and its portable reference code.
 *
 * ggml stores each row as a sequence of blocks: scale, (5th bits), quants. A matrix-vector product
 * then spends much of its time on per-block bookkeeping (a scale conversion per block, 5th-bit
 * masks assembled in general registers, one memory stream per row). P4 stores the same bytes,
 * reordered once at load time, in tiles of 4 rows x C columns (C = 128 for the 32-element block
 * types, 256 for the k-quants), tile after tile along a group of 4 rows, group after group:
 *
 *   Q4_0  (C 128)  16 x f16 scales [4r + q] (row r, block q) | nibbles 4 x 64 B
 *   Q5_0  (C 128)  16 x f16 scales | masks 4 x 4 u32 | nibbles 4 x 64 B
 *   Q8_0  (C 128)  16 x f16 scales | int8 4 x 128 B (row r, vector k, lane j = element E(k, j))
 *   Q4_K  (C 256)  4 x f16 d | 4 x f16 dmin | 4 x (8 scales, 8 mins) bytes | nibbles 4 x 2 x 64 B
 *   Q6_K  (C 256)  4 x f16 d | 4 x 16 int8 scales | low nibbles 4 x 2 x 64 B | high 2 bits 4 x 2 x 32 B
 *
 * A 128-column "quad" (4 blocks or 4 sub-blocks) of one row unpacks to 4 vectors of 32 int16
 * weights; lane j of vector k holds element P(k, j) of the quad:
 *
 *   E(k, j)  = 32 * (j / 8) + 8 * k + j % 8                           (all but Q6_K)
 *   E6(k, j) = 16 * (j / 4) + 8 * ((j / 2) % 2) + 2 * k + j % 2         (Q6_K)
 *
 * so the vpdpwssd partial sums of int32 lane i stay inside one block (E: lanes 4q..4q+3 = block q)
 * or one 16-element scale group (E6: lanes 2g, 2g+1 = group g): one float conversion and one FMA
 * with a vector of per-lane scales serve a whole quad. Nibbles: row r, half h, byte j: low nibble =
 * element P(2h, j), high nibble = P(2h+1, j). Q5_0 masks (row r, vector k): bit j set <=> the 5th
 * bit of element P(k, j) is 0. Q6_K high bits: row r, quad, byte j: bits 2k, 2k+1 = element
 * P(k, j). The activations are permuted the same way within each 128-column quad (mr_pack_perm).
 *
 * A tile has exactly the bytes of its ggml blocks (Q4_K: 16 more per 4 rows, its 6-bit scales and
 * mins decoded to bytes, which unpacking encodes back exactly); rows of a last, incomplete group are
 * zero (scale 0). Other types, and matrices whose columns are not a multiple of C, stay in ggml layout. */
#include "common.h"

#include <stdlib.h>

int mr_pack_tile_bytes(int qtype) {
    switch (qtype) {
    case GT_Q4_0: return 32 + 256;
    case GT_Q5_0: return 32 + 64 + 256;
    case GT_Q8_0: return 32 + 512;
    case GT_Q4_K: return 4 * 144 + 16;
    case GT_Q6_K: return 4 * 210;
    default: return 0;
    }
}

int mr_pack_tile_cols(int qtype) { return qtype == GT_Q4_K || qtype == GT_Q6_K ? 256 : MR_P4_COLS; }

int mr_pack_supported(int qtype, long long rows, long long cols) {
    return mr_pack_tile_bytes(qtype) > 0 && rows > 0 && cols > 0 && cols % mr_pack_tile_cols(qtype) == 0;
}

long long mr_pack_size(int qtype, long long rows, long long cols) {
    if (!mr_pack_supported(qtype, rows, cols)) return 0;
    return (rows + 3) / 4 * (cols / mr_pack_tile_cols(qtype)) * mr_pack_tile_bytes(qtype);
}

MR_INLINE int elem_e(int k, int j) { return 32 * (j >> 3) + 8 * k + (j & 7); }
MR_INLINE int elem_e6(int k, int j) { return 16 * (j >> 2) + 8 * ((j >> 1) & 1) + 2 * k + (j & 1); }

/* packed position p (0..127, = 32k + j) of a quad -> column within the quad */
int mr_pack_perm(int qtype, int p) { return qtype == GT_Q6_K ? elem_e6(p >> 5, p & 31) : elem_e(p >> 5, p & 31); }

/* ---------------------------------------------------------------- 32-element block types */

static void pack_tile32(int qtype, const uint8_t *const blk[4][4], uint8_t *tile) {
    static const uint8_t zero[34] = {0};
    const uint64_t lo4 = 0x0F0F0F0F0F0F0F0FULL;
    for (int r = 0; r < 4; r++)
        for (int q = 0; q < 4; q++) {
            const uint8_t *b = blk[r][q] ? blk[r][q] : zero;
            memcpy(tile + 2 * (4 * r + q), b, 2);
            if (qtype == GT_Q8_0) { /* vector k, lanes 8q..8q+7 = elements 8k..8k+7 */
                for (int k = 0; k < 4; k++) memcpy(tile + 32 + 128 * r + 32 * k + 8 * q, b + 2 + 8 * k, 8);
                continue;
            }
            /* byte i of half 0 = elements i, 8+i (low nibbles of qs[i], qs[8+i]); half 1 = their high nibbles */
            const uint8_t *qs = b + (qtype == GT_Q5_0 ? 6 : 2);
            uint64_t A, B;
            memcpy(&A, qs, 8);
            memcpy(&B, qs + 8, 8);
            const uint64_t h0 = (A & lo4) | ((B & lo4) << 4), h1 = ((A >> 4) & lo4) | (B & ~lo4);
            uint8_t *nb = tile + (qtype == GT_Q5_0 ? 96 : 32) + 64 * r + 8 * q;
            memcpy(nb, &h0, 8);
            memcpy(nb + 32, &h1, 8);
            if (qtype == GT_Q5_0) { /* mask (r, k) byte q: bit i set <=> the 5th bit of element 8k + i is 0 */
                const uint32_t qh = blk[r][q] ? mr_rd32(b + 2) : 0xffffffffu;
                for (int k = 0; k < 4; k++) tile[32 + 16 * r + 4 * k + q] = (uint8_t)~(qh >> (8 * k));
            }
        }
}

/* value (without scale) of packed row r, position p = 32k + j of a 32-block-type tile */
static int p32_value(int qtype, const uint8_t *tile, int r, int k, int j) {
    if (qtype == GT_Q8_0) return (int8_t)tile[32 + 128 * r + 32 * k + j];
    const uint8_t byte = tile[(qtype == GT_Q5_0 ? 96 : 32) + 64 * r + 32 * (k >> 1) + j];
    const int n = (k & 1) ? byte >> 4 : byte & 15;
    if (qtype == GT_Q4_0) return n - 8;
    return n - (((tile[32 + 16 * r + 4 * k + (j >> 3)] >> (j & 7)) & 1) ? 16 : 0);
}

/* ---------------------------------------------------------------- k-quants (one super-block per row and tile) */

/* 6-bit q6 value of element e (0..255) of a Q6_K block: low 4 bits and high 2 bits */
MR_INLINE void q6_parts(const uint8_t *b, int e, int *lo, int *hi) {
    const int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
    const uint8_t qlb = b[64 * h + 32 * (s & 1) + l];
    *lo = s >= 2 ? qlb >> 4 : qlb & 15;
    *hi = (b[128 + 32 * h + l] >> (2 * s)) & 3;
}

static void pack_tile_k(int qtype, const uint8_t *const blk[4], uint8_t *tile) {
    static const uint8_t zero[210] = {0};
    const uint64_t lo4 = 0x0F0F0F0F0F0F0F0FULL;
    for (int r = 0; r < 4; r++) {
        const uint8_t *b = blk[r] ? blk[r] : zero;
        if (qtype == GT_Q4_K) {
            memcpy(tile + 2 * r, b, 2);
            memcpy(tile + 8 + 2 * r, b + 2, 2);
            for (int s8 = 0; s8 < 8; s8++) mr_scale_min_k4(s8, b + 4, tile + 16 + 16 * r + s8, tile + 24 + 16 * r + s8);
            /* quad Q = sub-blocks 4Q..4Q+3; sub-block s = nibbles (s % 2) of qs[32 (s / 2) ..] */
            for (int Q = 0; Q < 2; Q++)
                for (int q = 0; q < 4; q++) {
                    const int s = 4 * Q + q, sh = 4 * (s & 1);
                    for (int h = 0; h < 2; h++) {
                        uint64_t A, B;
                        memcpy(&A, b + 16 + 32 * (s >> 1) + 16 * h, 8);
                        memcpy(&B, b + 16 + 32 * (s >> 1) + 16 * h + 8, 8);
                        const uint64_t v = ((A >> sh) & lo4) | (((B >> sh) & lo4) << 4);
                        memcpy(tile + 80 + 128 * r + 64 * Q + 32 * h + 8 * q, &v, 8);
                    }
                }
        } else { /* Q6_K */
            memcpy(tile + 2 * r, b + 208, 2);
            memcpy(tile + 8 + 16 * r, b + 192, 16);
            for (int Q = 0; Q < 2; Q++) {
                uint8_t lo[128], hi[128];
                for (int e = 0; e < 128; e++) {
                    int l4, h2;
                    q6_parts(b, 128 * Q + e, &l4, &h2);
                    lo[e] = (uint8_t)l4;
                    hi[e] = (uint8_t)h2;
                }
                uint8_t *nb = tile + 72 + 128 * r + 64 * Q, *hb = tile + 584 + 64 * r + 32 * Q;
                for (int j = 0; j < 32; j++) {
                    nb[j] = (uint8_t)(lo[elem_e6(0, j)] | lo[elem_e6(1, j)] << 4);
                    nb[32 + j] = (uint8_t)(lo[elem_e6(2, j)] | lo[elem_e6(3, j)] << 4);
                    hb[j] = (uint8_t)(hi[elem_e6(0, j)] | hi[elem_e6(1, j)] << 2 | hi[elem_e6(2, j)] << 4 |
                                      hi[elem_e6(3, j)] << 6);
                }
            }
        }
    }
}

/* dequantized element (row r, quad Q, position p = 32k + j) of a k-quant tile (reference) */
static float pk_value(int qtype, const uint8_t *tile, int r, int Q, int k, int j) {
    if (qtype == GT_Q4_K) {
        const float d = mr_rdf16(tile + 2 * r), dmin = mr_rdf16(tile + 8 + 2 * r);
        const int s = 4 * Q + (j >> 3);
        const uint8_t sc = tile[16 + 16 * r + s], m = tile[24 + 16 * r + s];
        const uint8_t byte = tile[80 + 128 * r + 64 * Q + 32 * (k >> 1) + j];
        const int n = (k & 1) ? byte >> 4 : byte & 15;
        return d * (float)sc * (float)n - dmin * (float)m;
    }
    const float d = mr_rdf16(tile + 2 * r);
    const int e = elem_e6(k, j), g = 8 * Q + (e >> 4);
    const uint8_t byte = tile[72 + 128 * r + 64 * Q + 32 * (k >> 1) + j];
    const int lo = (k & 1) ? byte >> 4 : byte & 15;
    const int hi = (tile[584 + 64 * r + 32 * Q + j] >> (2 * k)) & 3;
    return d * (float)(int8_t)tile[8 + 16 * r + g] * (float)((lo | hi << 4) - 32);
}

/* ---------------------------------------------------------------- whole matrices */

typedef struct {
    int qtype;
    const uint8_t *w;
    int64_t rows, rb, ntiles, tb;
    uint8_t *p;
} pack_ctx;

static void pack_task(const void *c_, int64_t g, int worker, float *buf) {
    (void)worker;
    (void)buf;
    const pack_ctx *c = (const pack_ctx *)c_;
    const int bytes = mr_types[c->qtype].bytes, kq = mr_types[c->qtype].block == QKK;
    for (int64_t t = 0; t < c->ntiles; t++) {
        uint8_t *tile = c->p + (g * c->ntiles + t) * c->tb;
        if (kq) {
            const uint8_t *blk[4];
            for (int r = 0; r < 4; r++) blk[r] = 4 * g + r < c->rows ? c->w + (4 * g + r) * c->rb + t * bytes : NULL;
            pack_tile_k(c->qtype, blk, tile);
        } else {
            const uint8_t *blk[4][4];
            for (int r = 0; r < 4; r++)
                for (int q = 0; q < 4; q++)
                    blk[r][q] = 4 * g + r < c->rows ? c->w + (4 * g + r) * c->rb + (4 * t + q) * bytes : NULL;
            pack_tile32(c->qtype, blk, tile);
        }
    }
}

int mr_pack(int qtype, const unsigned char *w, long long rows, long long cols, long long row_bytes, unsigned char *dst,
            int threads) {
    if (!mr_pack_supported(qtype, rows, cols)) return MR_E_SHAPE;
    const mr_type_info ti = mr_types[qtype];
    if (row_bytes < cols / ti.block * ti.bytes) return MR_E_SHAPE;
    pack_ctx c = {qtype, w, rows, row_bytes, cols / mr_pack_tile_cols(qtype), mr_pack_tile_bytes(qtype), dst};
    mr_call_lock();
    const int rc = mr_parallel_for(pack_task, NULL, &c, sizeof c, (rows + 3) / 4, 0, threads);
    mr_call_unlock();
    return rc;
}

/* Inverse of mr_pack (tests, tools): rebuilds every ggml block byte for byte. */
int mr_unpack(int qtype, const unsigned char *src, long long rows, long long cols, unsigned char *w, long long row_bytes) {
    if (!mr_pack_supported(qtype, rows, cols)) return MR_E_SHAPE;
    const mr_type_info ti = mr_types[qtype];
    if (row_bytes < cols / ti.block * ti.bytes) return MR_E_SHAPE;
    const int64_t tc = mr_pack_tile_cols(qtype), ntiles = cols / tc, tb = mr_pack_tile_bytes(qtype);
    for (int64_t row = 0; row < rows; row++) {
        const int64_t g = row / 4;
        const int r = (int)(row % 4);
        for (int64_t t = 0; t < ntiles; t++) {
            const uint8_t *tile = src + (g * ntiles + t) * tb;
            if (qtype == GT_Q4_K) {
                uint8_t *b = w + row * row_bytes + t * 144;
                memset(b, 0, 144);
                memcpy(b, tile + 2 * r, 2);
                memcpy(b + 2, tile + 8 + 2 * r, 2);
                const uint8_t *sc = tile + 16 + 16 * r, *mn = sc + 8;
                for (int j = 0; j < 4; j++) { /* the inverse of get_scale_min_k4 (all 96 bits are used) */
                    b[4 + j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
                    b[8 + j] = (uint8_t)(mn[j] | ((mn[j + 4] >> 4) << 6));
                    b[12 + j] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
                }
                for (int Q = 0; Q < 2; Q++)
                    for (int k = 0; k < 4; k++)
                        for (int j = 0; j < 32; j++) {
                            const uint8_t byte = tile[80 + 128 * r + 64 * Q + 32 * (k >> 1) + j];
                            const int n = (k & 1) ? byte >> 4 : byte & 15;
                            const int s = 4 * Q + (j >> 3), e = 8 * k + (j & 7);
                            b[16 + 32 * (s >> 1) + e] |= (uint8_t)(n << (4 * (s & 1)));
                        }
            } else if (qtype == GT_Q6_K) {
                uint8_t *b = w + row * row_bytes + t * 210;
                memset(b, 0, 210);
                memcpy(b + 208, tile + 2 * r, 2);
                memcpy(b + 192, tile + 8 + 16 * r, 16);
                for (int Q = 0; Q < 2; Q++)
                    for (int k = 0; k < 4; k++)
                        for (int j = 0; j < 32; j++) {
                            const uint8_t byte = tile[72 + 128 * r + 64 * Q + 32 * (k >> 1) + j];
                            const int lo = (k & 1) ? byte >> 4 : byte & 15;
                            const int hi = (tile[584 + 64 * r + 32 * Q + j] >> (2 * k)) & 3;
                            const int e = 128 * Q + elem_e6(k, j), h = e >> 7, s = (e >> 5) & 3, l = e & 31;
                            b[64 * h + 32 * (s & 1) + l] |= (uint8_t)(s >= 2 ? lo << 4 : lo);
                            b[128 + 32 * h + l] |= (uint8_t)(hi << (2 * s));
                        }
            } else {
                for (int q = 0; q < 4; q++) {
                    uint8_t *b = w + row * row_bytes + (4 * t + q) * ti.bytes;
                    memset(b, 0, (size_t)ti.bytes);
                    memcpy(b, tile + 2 * (4 * r + q), 2);
                    uint32_t qh = 0;
                    for (int k = 0; k < 4; k++)
                        for (int i = 0; i < 8; i++) {
                            const int j = 8 * q + i, e = 8 * k + i, v = p32_value(qtype, tile, r, k, j);
                            if (qtype == GT_Q8_0) {
                                b[2 + e] = (uint8_t)(int8_t)v;
                                continue;
                            }
                            const int u = v + (qtype == GT_Q5_0 ? 16 : 8);
                            uint8_t *qs = b + (qtype == GT_Q5_0 ? 6 : 2);
                            if (e < 16) qs[e] |= (uint8_t)(u & 15);
                            else qs[e - 16] |= (uint8_t)((u & 15) << 4);
                            qh |= (uint32_t)((u >> 4) & 1) << e;
                        }
                    if (qtype == GT_Q5_0) memcpy(b + 2, &qh, 4);
                }
            }
        }
    }
    return MR_OK;
}

/* Dequantized rows ids[0..n) of a packed matrix into out (n x cols float32, row i = matrix row ids[i]):
 * the embedding lookup of a model whose output head is its embedding, so that the lookup reads the
 * packed copy and the ggml copy's pages need not come back. The values equal those of mr_dequantize
 * on the ggml rows, bit for bit (same products in the same order). The caller checks
 * 0 <= ids[i] < rows; an id outside that range is MR_E_SHAPE. */
int mr_pack_rows(int qtype, const unsigned char *src, long long rows, long long cols, const long long *ids,
                 long long n, float *out) {
    if (!mr_pack_supported(qtype, rows, cols) || n < 0) return MR_E_SHAPE;
    const int kq = qtype == GT_Q4_K || qtype == GT_Q6_K;
    const int64_t tc = mr_pack_tile_cols(qtype), ntiles = cols / tc, tb = mr_pack_tile_bytes(qtype);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return MR_E_SHAPE;
    for (int64_t i = 0; i < n; i++) {
        const int64_t g = ids[i] / 4;
        const int r = (int)(ids[i] % 4);
        float *o = out + i * cols;
        for (int64_t t = 0; t < ntiles; t++, o += tc) {
            const uint8_t *tile = (const uint8_t *)src + (g * ntiles + t) * tb;
            if (kq) {
                for (int Q = 0; Q < 2; Q++)
                    for (int k = 0; k < 4; k++)
                        for (int j = 0; j < 32; j++)
                            o[128 * Q + (qtype == GT_Q6_K ? elem_e6(k, j) : elem_e(k, j))] = pk_value(qtype, tile, r, Q, k, j);
                continue;
            }
            for (int k = 0; k < 4; k++)
                for (int j = 0; j < 32; j++)
                    o[elem_e(k, j)] = mr_rdf16(tile + 2 * (4 * r + (j >> 3))) * (float)p32_value(qtype, tile, r, k, j);
        }
    }
    return MR_OK;
}

/* Reference dequantizer of one tile: out[r * os + c] for the 4 rows, c = packed column (quads of
 * 32k + j positions). */
void mr_pack_dq_tile(int qtype, const uint8_t *tile, float *out, int64_t os) {
    if (qtype == GT_Q4_K || qtype == GT_Q6_K) {
        for (int r = 0; r < 4; r++)
            for (int Q = 0; Q < 2; Q++)
                for (int k = 0; k < 4; k++)
                    for (int j = 0; j < 32; j++) out[r * os + 128 * Q + 32 * k + j] = pk_value(qtype, tile, r, Q, k, j);
        return;
    }
    for (int r = 0; r < 4; r++)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 32; j++)
                out[r * os + 32 * k + j] = mr_rdf16(tile + 2 * (4 * r + (j >> 3))) * (float)p32_value(qtype, tile, r, k, j);
}
