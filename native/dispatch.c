/* Runtime ISA selection and the matmul driver.
 *
 * One shared library carries every ISA's kernels (each compiled under its own target pragma); the
 * CPU's features pick one at first use, MINIRT_ISA=scalar|avx2|avx512|neon forces a lower one. */
#include "common.h"

#include <pthread.h>
#include <stdlib.h>
#if defined(MR_ARM64) && defined(__linux__)
#include <sys/auxv.h>
#endif

#ifdef MR_X86
void mr_init_avx2(mr_kernels *k);
void mr_init_avx512(mr_kernels *k);
void mr_init_avx512_gemv(mr_kernels *k);
void mr_init_avx512_gemm(mr_kernels *k);
int mr_init_amx(mr_kernels *k, const mr_kernels *avx512);
#endif
#ifdef MR_ARM64
void mr_init_neon(mr_kernels *k);
#endif

int mr_pf_dist = 0;
static int perm128[MR_P4_COLS], perm128_q6k[MR_P4_COLS]; /* packed position -> column within a quad */
static int isa_mask_v = 1 << MR_ISA_SCALAR;
static int isa_sel = MR_ISA_SCALAR;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static mr_kernels *tables[MR_N_ISA];

static int best_isa(int mask) {
    for (int i = MR_N_ISA - 1; i >= 0; i--)
        if (mask & (1 << i)) return i;
    return MR_ISA_SCALAR;
}

static void init(void) {
    int m = 1 << MR_ISA_SCALAR;
    mr_fill_generic_scalar(&mr_kernels_scalar);
    tables[MR_ISA_SCALAR] = &mr_kernels_scalar;
#ifdef MR_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        m |= 1 << MR_ISA_AVX2;
        mr_init_avx2(&mr_kernels_avx2);
        tables[MR_ISA_AVX2] = &mr_kernels_avx2;
    }
    if ((m & (1 << MR_ISA_AVX2)) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni")) {
        m |= 1 << MR_ISA_AVX512;
        mr_init_avx512(&mr_kernels_avx512);
        mr_init_avx512_gemv(&mr_kernels_avx512);
        mr_init_avx512_gemm(&mr_kernels_avx512);
        tables[MR_ISA_AVX512] = &mr_kernels_avx512;
        if (mr_init_amx(&mr_kernels_amx, &mr_kernels_avx512)) {
            m |= 1 << MR_ISA_AVX512_AMX;
            tables[MR_ISA_AVX512_AMX] = &mr_kernels_amx;
        }
    }
#endif
#ifdef MR_ARM64
    m |= 1 << MR_ISA_NEON; /* Advanced SIMD is mandatory on AArch64 */
    mr_init_neon(&mr_kernels_neon);
    tables[MR_ISA_NEON] = &mr_kernels_neon;
#endif
    isa_mask_v = m;
    isa_sel = best_isa(m);
    for (int i = 0; i < MR_P4_COLS; i++) {
        perm128[i] = mr_pack_perm(GT_Q8_0, i);
        perm128_q6k[i] = mr_pack_perm(GT_Q6_K, i);
    }
    const char *pf = getenv("MINIRT_PF");
    if (pf && *pf) mr_pf_dist = atoi(pf) < 0 ? 0 : atoi(pf);
    const char *e = getenv("MINIRT_ISA");
    if (e && *e) {
        int want = -1;
        if (!strcmp(e, "scalar")) want = MR_ISA_SCALAR;
        else if (!strcmp(e, "avx2")) want = MR_ISA_AVX2;
        else if (!strcmp(e, "avx512")) want = MR_ISA_AVX512;
        else if (!strcmp(e, "avx512_amx")) want = MR_ISA_AVX512_AMX;
        else if (!strcmp(e, "neon")) want = MR_ISA_NEON;
        if (want >= 0 && (m & (1 << want))) isa_sel = want;
    }
}

int mr_isa_mask(void) { pthread_once(&init_once, init); return isa_mask_v; }
int mr_isa_selected(void) { pthread_once(&init_once, init); return isa_sel; }

int mr_set_isa(int isa) {
    pthread_once(&init_once, init);
    if (isa < 0) { isa_sel = best_isa(isa_mask_v); return isa_sel; }
    if (isa >= MR_N_ISA || !(isa_mask_v & (1 << isa))) return MR_E_ISA;
    isa_sel = isa;
    return isa;
}

int mr_resolve_isa(int isa) {
    pthread_once(&init_once, init);
    if (isa < 0) return isa_sel;
    if (isa >= MR_N_ISA || !(isa_mask_v & (1 << isa))) return -1;
    return isa;
}

const mr_kernels *mr_get_kernels(int isa) {
    int i = mr_resolve_isa(isa);
    return i < 0 ? NULL : tables[i];
}

/* ---------------------------------------------------------------- matmul driver */

enum { PATH_NONE = 0, PATH_INT = 1, PATH_FLOAT = 2 };

/* Tokens per pass of the integer path before the float tile path wins (measured on AVX-512 VNNI:
 * the tile path dequantizes each weight once for every token and runs at FMA peak). */
#define MR_INT_MAX_TOKENS 4 /* unless the ISA's table says otherwise for a type (int_tokens) */
/* From this many tokens on, the panel path (when the ISA has one) beats the dot-product tile. */
#define MR_PANEL_MIN_TOKENS 12
/* From this many tokens on, packed matrices of the types with an integer GEMM take it instead of the
 * decode kernels (measured on AVX-512 VNNI, Zen 4, 2 threads, a group of 16 tokens costing the same for 11..16:
 * at 12 tokens level with them, at 10 2 % behind in a 10-sequence decode step, at 16 tokens 1.2-1.5x faster). */
#define MR_GEMM_MIN_TOKENS 11
/* From this many tokens on, an ISA with the AMX path (x86_amx.c) takes it for every type... */
#define MR_AMX_MIN_TOKENS 64
/* ...but packed matrices with the int8-tile GEMM (gemm_i8, gemm_min_t set) keep it below this many (2 threads,
 * 64 / 128 / 512 tokens, int8 tiles against bf16: Q5_0 4864x896 1.65x / 1.27x / 0.89x, Q4_K 896x4864 1.56x / 1.52x /
 * 1.19x, Q8_0 8192x896 1.64x / 1.15x / 1.0x) */
#define MR_AMX_INT8_MAX_TOKENS 256
/* Tokens per block of the tile path: keeps X (tokens x MR_KC floats) in L2. */
#define MR_TOKEN_BLOCK 96
/* Tokens per block of the panel path: each weight panel is dequantized once per block, so the block
 * covers a whole prefill chunk (the x rows of one k-chunk, tokens x 128..256 floats, stay in L2). */
#define MR_PANEL_TOKEN_BLOCK 1024

typedef struct {
    const mr_kernels *K;
    int qtype;
    const uint8_t *w;
    int64_t rows, cols, rb;
    const float *x;
    int64_t nt, xs;
    float *y;
    int64_t ys;
    int64_t chunk;
    mr_xact xa;     /* integer path: quantized activations */
    int64_t nb32;
    int packed;     /* w is in the P4 layout (pack.c): tb bytes per tile, ntiles tiles per row group */
    int64_t tb, ntiles;
} mm_ctx;

/* Weights of rows [p, p + nr) x columns [k0, k0 + kn) as floats, row stride kn. Packed: p is a
 * multiple of 4, k0 and kn of the tile width (MR_KC and MR_KP are multiples of 256), the columns
 * come in packed order (the caller permuted x to match) and whole row groups are written (out has
 * room for nr rounded up to 4 rows). */
static void dq_rows(const mm_ctx *c, int64_t p, int nr, int64_t k0, int64_t kn, float *out) {
    if (!c->packed) {
        const mr_type_info ti = mr_types[c->qtype];
        for (int i = 0; i < nr; i++)
            c->K->dq[c->qtype](c->w + (p + i) * c->rb + (k0 / ti.block) * ti.bytes, out + (int64_t)i * kn, kn / ti.block);
        return;
    }
    void (*pdq)(const uint8_t *, float *, int64_t) = c->K->pdq[c->qtype];
    const int64_t tc = c->cols / c->ntiles;
    for (int64_t g = p / 4; 4 * g < p + nr; g++)
        for (int64_t t = k0 / tc; t < (k0 + kn) / tc; t++) {
            const uint8_t *tile = c->w + (g * c->ntiles + t) * c->tb;
            float *o = out + (4 * g - p) * kn + (t * tc - k0);
            if (pdq) pdq(tile, o, kn);
            else mr_pack_dq_tile(c->qtype, tile, o, kn);
        }
}

/* where an item's outputs go: y itself, or the worker's private buffer (nt, r1 - r0) */
#define OUT_TARGET                                                                                           \
    float *yy = buf ? buf : c->y + r0;                                                                         \
    const int64_t yys = buf ? r1 - r0 : c->ys;

static void commit_rows(const void *c_, int64_t item, const float *buf) {
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    for (int64_t t = 0; t < c->nt; t++) memcpy(c->y + t * c->ys + r0, buf + t * (r1 - r0), (size_t)(r1 - r0) * 4);
}

/* Software prefetch of weight rows ahead of the one being dotted. Decode streams every weight from
 * DRAM exactly once; the hardware prefetcher restarts at each 4 KiB page and the kernels touch a row's
 * scales before its quants, so without this each row waits a full memory latency (measured: Q5_0
 * rows of 616 bytes streamed at ~5 GB/s with 2 threads, cache-resident ones at ~18). */
#define MR_PREFETCH_BYTES 2048

MR_INLINE void prefetch_rows(const uint8_t *w, int64_t rb, int64_t r, int64_t n) {
    const char *p = (const char *)(w + r * rb);
    for (int64_t o = 0; o < n * rb; o += 64) __builtin_prefetch(p + o, 0, 3);
}

static void task_int(const void *c_, int64_t item, int worker, float *buf) {
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    OUT_TARGET
    const mr_mat m = {c->qtype, c->packed, c->w, c->rows, c->cols, c->rb, c->tb, c->ntiles};
    mr_mat_rows(c->K, &m, &c->xa, c->nt, r0, r1, yy, yys, worker);
}

static void task_fdot(const void *c_, int64_t item, int worker, float *buf) {
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    OUT_TARGET
    const int step = c->packed ? 4 : 1;
    float *rowbuf = c->qtype == GT_F32 && !c->packed ? NULL : (float *)mr_scratch(worker, 0, (size_t)(c->cols * step) * 4);
    float out[MR_NT_INT];
    for (int64_t r = r0; r < r1; r += step) {
        const int nr = (int)(r1 - r < step ? r1 - r : step);
        const float *wf;
        if (rowbuf) {
            dq_rows(c, r, nr, 0, c->cols, rowbuf);
            wf = rowbuf;
        } else {
            wf = (const float *)(const void *)(c->w + r * c->rb);
        }
        for (int i = 0; i < nr; i++)
            for (int64_t t0 = 0; t0 < c->nt; t0 += MR_NT_INT) {
                const int n = (int)(c->nt - t0 < MR_NT_INT ? c->nt - t0 : MR_NT_INT);
                c->K->dot_f32(wf + (int64_t)i * c->cols, c->x + t0 * c->xs, c->xs, c->cols, n, out);
                for (int t = 0; t < n; t++) yy[(t0 + t) * yys + (r + i - r0)] = out[t];
            }
    }
}

static void task_tile(const void *c_, int64_t item, int worker, float *buf) {
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    OUT_TARGET
    const int64_t kc_max = c->cols < MR_KC ? c->cols : MR_KC;
    float *wbuf = (float *)mr_scratch(worker, 1, (size_t)MR_TR * (size_t)kc_max * 4);
    for (int64_t t0 = 0; t0 < c->nt; t0 += MR_TOKEN_BLOCK) {
        const int ntk = (int)(c->nt - t0 < MR_TOKEN_BLOCK ? c->nt - t0 : MR_TOKEN_BLOCK);
        for (int64_t p = r0; p < r1; p += MR_TR) {
            const int nr = (int)(r1 - p < MR_TR ? r1 - p : MR_TR);
            for (int64_t k0 = 0; k0 < c->cols; k0 += MR_KC) {
                const int64_t kn = c->cols - k0 < MR_KC ? c->cols - k0 : MR_KC;
                dq_rows(c, p, nr, k0, kn, wbuf); /* (nr, kn) floats, row stride kn */
                c->K->tile(wbuf, nr, c->x + t0 * c->xs + k0, c->xs, ntk, kn, yy + t0 * yys + (p - r0), yys, k0 > 0);
            }
        }
    }
}

/* Many tokens: outer products over a transposed panel of MR_PR dequantized rows (no reductions,
 * each weight loaded once per 12 tokens, each activation broadcast once per 32 rows). */
static void task_panel(const void *c_, int64_t item, int worker, float *buf) {
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    OUT_TARGET
    /* k-quant blocks and packed tiles are 256 columns wide; the others dequantize in narrower chunks
     * (the panel P and the x rows of 12 tokens then stay in L1 together) */
    const int64_t unit = c->packed ? c->cols / c->ntiles : mr_types[c->qtype].block;
    const int64_t kpw = unit > 128 ? 256 : 128;
    const int64_t kp = c->cols < kpw ? c->cols : kpw;
    float *a = (float *)mr_scratch(worker, 1, (size_t)MR_PR * (size_t)kp * 4);
    float *P = (float *)mr_scratch(worker, 3, (size_t)MR_PR * (size_t)kp * 4);
    for (int64_t t0 = 0; t0 < c->nt; t0 += MR_PANEL_TOKEN_BLOCK) {
        const int ntk = (int)(c->nt - t0 < MR_PANEL_TOKEN_BLOCK ? c->nt - t0 : MR_PANEL_TOKEN_BLOCK);
        for (int64_t p = r0; p < r1; p += MR_PR) {
            const int nr = (int)(r1 - p < MR_PR ? r1 - p : MR_PR);
            for (int64_t k0 = 0; k0 < c->cols; k0 += kp) {
                const int64_t kn = c->cols - k0 < kp ? c->cols - k0 : kp;
                dq_rows(c, p, nr, k0, kn, a);
                c->K->pack(a, nr, kn, P);
                c->K->panel(P, nr, c->x + t0 * c->xs + k0, c->xs, ntk, kn, yy + t0 * yys + (p - r0), yys, k0 > 0);
            }
        }
    }
}

/* GEMM activation panel, guarded by the call lock; grown like the buffers below */
static uint8_t *xp_panel_buf;
static size_t xp_panel_cap;

static int prepare_panel(const mr_kernels *K, const float *x, int64_t nt, int64_t xs, int64_t cols, mr_xp *xp) {
    const int64_t nb = cols / 32, ng = (nt + 15) / 16;
    const size_t nq = (size_t)(ng * nb * 1024), nv = (size_t)(ng * nb * 16) * 4, nt_ = (size_t)(9 * cols) * 4;
    const size_t need = nq + 2 * nv + nt_;
    if (need > xp_panel_cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, need * 2) != 0) return MR_E_NOMEM;
        mr_defer_free(xp_panel_buf);
        xp_panel_buf = (uint8_t *)p;
        xp_panel_cap = need * 2;
    }
    xp->q = (int16_t *)xp_panel_buf;
    xp->d = (float *)(xp_panel_buf + nq);
    xp->ds = (float *)(xp_panel_buf + nq + nv);
    K->gemm_xpanel(x, nt, xs, cols, (float *)(xp_panel_buf + nq + 2 * nv), xp);
    return MR_OK;
}

/* activation scratch (int path), guarded by the call lock */
static int16_t *xq_buf;
static float *xf_buf, *x8f_buf;
static int8_t *x8_buf;
static size_t xq_cap, xf_cap, x8_cap, x8f_cap;

/* Grown to twice the need; the old buffer goes through mr_defer_free: a worker descheduled in an old
 * job may still read it (its result is discarded, see pool.c). */
static int grow(void **buf, size_t *cap, size_t need, size_t elsize) {
    if (need <= *cap) return MR_OK;
    void *p = NULL;
    if (posix_memalign(&p, 64, need * 2 * elsize + 64) != 0) return MR_E_NOMEM;
    mr_defer_free(*buf);
    *buf = p;
    *cap = need * 2;
    return MR_OK;
}

static int ensure_xq(size_t nq, size_t nf) {
    const int rc = grow((void **)&xq_buf, &xq_cap, nq, 2);
    return rc != MR_OK ? rc : grow((void **)&xf_buf, &xf_cap, nf, 4);
}

/* MR_XL_Q8: each 256-element super-block of each token to int8 with one scale (max |x| -> 127,
 * rounded to nearest, as llama.cpp's quantize_row_q8_K), stored in the mr_q8_order; per-16 sums. */
static int prepare_q8(const float *x, int64_t nt, int64_t x_stride, int64_t cols, mr_xact *xa) {
    const int64_t nsb = cols / 256, n16 = cols / 16;
    int rc = grow((void **)&x8_buf, &x8_cap, (size_t)(nt * cols), 1);
    if (rc == MR_OK) rc = grow((void **)&x8f_buf, &x8f_cap, (size_t)(nt * (2 * nsb + n16)), 4);
    if (rc != MR_OK) return rc;
    float *d8 = x8f_buf, *s8 = d8 + nt * nsb;
    int32_t *i8 = (int32_t *)(void *)(s8 + nt * n16); /* the same allocation, only ever read as int32 */
    for (int64_t t = 0; t < nt; t++)
        for (int64_t ib = 0; ib < nsb; ib++) {
            const float *xb = x + t * x_stride + 256 * ib;
            int8_t *qb = x8_buf + t * cols + 256 * ib;
            float amax = 0.0f, total = 0.0f;
            for (int i = 0; i < 256; i++) {
                amax = fmaxf(amax, fabsf(xb[i]));
                total += xb[i];
            }
            /* as the int16 quantizers: a NaN or infinity (which the max may lose) gives a NaN scale */
            const int finite = isfinite(total);
            const float id = finite && amax > 0.0f ? 127.0f / amax : 0.0f, d = finite ? amax / 127.0f : NAN;
            int32_t sum[16] = {0};
            for (int i = 0; i < 256; i++) {
                const int e = mr_q8_order(i);
                const int q = id == 0.0f ? 0 : (int)lrintf(xb[e] * id);
                qb[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
                sum[e / 16] += qb[i];
            }
            d8[t * nsb + ib] = d;
            int32_t total_q = 0;
            for (int g = 0; g < 16; g++) {
                s8[t * n16 + 16 * ib + g] = d * (float)sum[g];
                total_q += sum[g];
            }
            i8[t * nsb + ib] = total_q;
        }
    xa->q8 = x8_buf;
    xa->d8 = d8;
    xa->s8 = s8; /* qs, bs: the caller's (cols, cols / 32) */
    xa->i8 = i8;
    return MR_OK;
}

/* Quantize n_tokens rows of x (cols, a multiple of 32) for the integer kernels into the scratch
 * buffers (caller holds the call lock), in every layout of the mask (MR_XL_*). */
int mr_prepare_x(const mr_kernels *K, const float *x, int64_t nt, int64_t x_stride, int64_t cols, int layouts,
                 mr_xacts *xs) {
    const int64_t nb = cols / 32;
    mr_xp xp;
    memset(&xp, 0, sizeof xp);
    mr_xact q8 = {NULL, NULL, NULL, NULL, NULL, NULL, cols, nb, xp, NULL, NULL, NULL, NULL};
    if ((layouts & MR_XL_Q8) && cols % 256 == 0) {
        const int qrc = prepare_q8(x, nt, x_stride, cols, &q8);
        if (qrc != MR_OK) return qrc;
    }
    if (layouts & MR_XL_PANEL) {
        const int prc = prepare_panel(K, x, nt, x_stride, cols, &xp);
        if (prc != MR_OK) return prc;
        q8.xp = xp;
    }
    if (!(layouts & ~(MR_XL_PANEL | MR_XL_Q8))) { /* the GEMM and / or the int8 kernels only */
        const mr_xact only = {NULL, NULL, NULL, NULL, NULL, NULL, cols, nb, xp, NULL, NULL, NULL, NULL};
        xs->nat = xs->pair = xs->perm = xs->perm6 = only;
        xs->q8 = q8;
        return MR_OK;
    }
    const int rc = ensure_xq((size_t)(nt * cols * 4), (size_t)(nt * nb * 5));
    if (rc != MR_OK) return rc;
    int16_t *q = xq_buf, *qpair = q + nt * cols, *qperm = qpair + nt * cols, *qperm6 = qperm + nt * cols;
    float *d = xf_buf, *s = d + nt * nb, *sq = s + nt * nb, *sq16 = sq + nt * nb;
    for (int64_t t = 0; t < nt; t++) {
        int16_t *qt = q + t * cols;
        float *dt = d + t * nb, *sqt = sq + t * nb, *s16t = sq16 + 2 * t * nb;
        K->quant_x(x + t * x_stride, cols, qt, dt, s + t * nb);
        for (int64_t h = 0; h < 2 * nb; h++) {
            int32_t acc = 0;
            for (int i = 0; i < 16; i++) acc += qt[16 * h + i];
            s16t[h] = dt[h / 2] * (float)acc;
        }
        for (int64_t b = 0; b < nb; b++) {
            int32_t acc = 0;
            for (int i = 0; i < 32; i++) acc += qt[32 * b + i];
            sqt[b] = dt[b] * (float)acc;
        }
        if (layouts & (MR_XL_PERM | MR_XL_PERM6)) /* packed layouts: permute within each 128-column quad */
            for (int64_t g0 = 0; g0 + MR_P4_COLS <= cols; g0 += MR_P4_COLS)
                for (int i = 0; i < MR_P4_COLS; i++) {
                    if (layouts & MR_XL_PERM) qperm[t * cols + g0 + i] = qt[g0 + perm128[i]];
                    if (layouts & MR_XL_PERM6) qperm6[t * cols + g0 + i] = qt[g0 + perm128_q6k[i]];
                }
        if (layouts & MR_XL_PAIR) { /* swap the middle 16-element quarters of each pair of blocks */
            int16_t *pt = qpair + t * cols;
            int64_t b = 0;
            for (; b + 1 < nb; b += 2) {
                memcpy(pt + 32 * b, qt + 32 * b, 32);
                memcpy(pt + 32 * b + 16, qt + 32 * b + 32, 32);
                memcpy(pt + 32 * b + 32, qt + 32 * b + 16, 32);
                memcpy(pt + 32 * b + 48, qt + 32 * b + 48, 32);
            }
            if (b < nb) memcpy(pt + 32 * b, qt + 32 * b, 64);
        }
    }
    const mr_xact base = {q, NULL, d, s, sq, sq16, cols, nb, xp, NULL, NULL, NULL, NULL};
    xs->nat = xs->pair = xs->perm = xs->perm6 = base;
    xs->q8 = q8;
    xs->pair.qp = qpair;
    xs->perm.q = qperm;
    xs->perm6.q = qperm6;
    return MR_OK;
}

const mr_xact *mr_xact_for(const mr_xacts *xs, int layout) {
    switch (layout) {
    case MR_XL_PAIR: return &xs->pair;
    case MR_XL_PERM: return &xs->perm;
    case MR_XL_PERM6: return &xs->perm6;
    case MR_XL_Q8: return &xs->q8;
    default: return &xs->nat;
    }
}

int mr_mat_xlayout(const mr_kernels *K, const mr_mat *m) {
    if (m->packed) return K->pgemv[m->qtype] ? (m->qtype == GT_Q6_K ? MR_XL_PERM6 : MR_XL_PERM) : 0;
    if (m->cols % 32) return 0;
    if (K->gemv[m->qtype] && K->gemv_q8[m->qtype] && m->cols % 256 == 0) return MR_XL_Q8;
    if (K->gemv[m->qtype] && !K->gemv_q8[m->qtype]) return K->gemv_pair[m->qtype] ? MR_XL_PAIR : MR_XL_NAT;
    if (K->vint[m->qtype]) return K->xpair[m->qtype] ? MR_XL_PAIR : MR_XL_NAT;
    return 0;
}

static int64_t gemm_min(const mr_kernels *K, int qtype) {
    return K->gemm_min_t[qtype] ? K->gemm_min_t[qtype] : MR_GEMM_MIN_TOKENS;
}

int mr_mat_gemm(const mr_kernels *K, const mr_mat *m, int64_t nt) {
    return m->packed && K->gemm_rows && (K->gemm_i8 ? K->gw8 : K->gw)[m->qtype] && nt >= gemm_min(K, m->qtype);
}

/* integer GEMM rows [r0, r1): blocks of up to GEMM_WU_BYTES of unpacked rows (8-row groups, int16, worker scratch),
 * each multiplied with the tokens of the panel a slice at a time. The slice (GEMM_X_BYTES of activations) and
 * the block stay in a 2 MB L2 together: with the whole panel per 8 rows, a 512-token prefill of a 4608-column
 * down projection streamed its 4.7 MB panel from L3 for every 8 rows (229 GFLOP/s, now 300, as at 1024 columns;
 * a 384 KB slice was slower at 1024 columns: 270 against 298). Results are those of the whole-panel order. */
#define GEMM_WU_BYTES (512 * 1024)
#define GEMM_X_BYTES (1024 * 1024)
/* the packed tiles of the rows from p (a multiple of 4) on */
static const uint8_t *rows_tiles(const mr_mat *m, int64_t p) { return m->w + (p / 4) * m->ntiles * m->tb; }

/* K->gemm_i8 (AMX): gw8's form, 16 rows per group (int8 rows, then scales and mins by K step, see x86_avx512_gemm.c) */
static void gemm_rows(const mr_kernels *K, const mr_mat *m, const mr_xp *xp, int64_t nt, int64_t r0, int64_t r1,
                      float *yy, int64_t yys, int worker) {
    const int64_t cols = m->cols, nb = cols / 32, R = K->gemm_i8 ? 16 : 8;
    const int64_t gstride = R * cols + 4 * R * nb; /* int16 units per R-row group: wu, then wd and wm (floats) */
    const int64_t wdo = K->gemm_i8 ? R * cols / 2 : R * cols; /* where wd starts (int16 units) */
    const int64_t ns = K->gw_min[m->qtype] == 2 ? 2 * nb : nb; /* scales per row */
    void (*gw)(const uint8_t *, int64_t, int64_t, int, int64_t, int16_t *, float *, float *) =
        K->gemm_i8 ? K->gw8[m->qtype] : K->gw[m->qtype];
    const int64_t tg_max = GEMM_X_BYTES / (16 * cols * 2); /* token groups of 16 per slice, even (pairs of tiles) */
    const int64_t tg = tg_max < 2 ? 2 : tg_max & ~(int64_t)1;
    if (xp->ng <= tg) { /* one slice of tokens: each group is multiplied once, while the next one is unpacked
                         * (in L1, and its stores are done by the time the kernel reads it), and the kernel
                         * prefetches the packed tiles of the one after (measured, AMX: a 16-sequence decode
                         * step of Qwen2.5-0.5B 60 -> 56 ms; the unpacking waited on DRAM) */
        int16_t *buf = (int16_t *)mr_scratch(worker, 1, (size_t)(2 * gstride * 2));
        for (int64_t p = r0, i = 0; p < r1 + R; p += R, i++) {
            if (p < r1) {
                const int nr = (int)(r1 - p < R ? r1 - p : R);
                int16_t *wu = buf + (i & 1) * gstride;
                gw(rows_tiles(m, p), m->ntiles, m->tb, (nr + 3) / 4, cols, wu, (float *)(wu + wdo),
                   (float *)(wu + wdo) + R * ns);
            }
            if (p > r0) {
                const int64_t q = p - R;
                const int nr = (int)(r1 - q < R ? r1 - q : R);
                const int16_t *wu = buf + ((i - 1) & 1) * gstride;
                const float *wd = (const float *)(wu + wdo), *wm = wd + R * ns;
                const int64_t n4 = p + R < r1 ? (r1 - p - R < R ? r1 - p - R + 3 : R) / 4 : 0; /* groups of 4 */
                K->gemm_rows(wu, wd, K->gw_min[m->qtype] == 1 ? wm : NULL, nr, cols, xp, nt, yy + (q - r0), yys,
                             K->gw_min[m->qtype] == 2, rows_tiles(m, p + R), n4 * m->ntiles * m->tb);
            }
        }
        return;
    }
    int64_t groups = GEMM_WU_BYTES / (gstride * 2);
    if (groups < 1) groups = 1;
    int16_t *buf = (int16_t *)mr_scratch(worker, 1, (size_t)(groups * gstride * 2));
    for (int64_t b0 = r0; b0 < r1; b0 += R * groups) {
        const int64_t b1 = r1 - b0 < R * groups ? r1 : b0 + R * groups;
        for (int64_t p = b0; p < b1; p += R) { /* unpack the block once */
            const int nr = (int)(b1 - p < R ? b1 - p : R);
            int16_t *wu = buf + (p - b0) / R * gstride;
            float *wd = (float *)(wu + wdo), *wm = wd + R * ns;
            gw(rows_tiles(m, p), m->ntiles, m->tb, (nr + 3) / 4, cols, wu, wd, wm);
        }
        for (int64_t g0 = 0; g0 < xp->ng; g0 += tg) {
            const mr_xp sl = {xp->q + g0 * nb * 512, xp->d + g0 * nb * 16, xp->ds ? xp->ds + g0 * nb * 16 : NULL, nb,
                              xp->ng - g0 < tg ? xp->ng - g0 : tg};
            for (int64_t p = b0; p < b1; p += R) {
                const int nr = (int)(b1 - p < R ? b1 - p : R);
                const int16_t *wu = buf + (p - b0) / R * gstride;
                const float *wd = (const float *)(wu + wdo), *wm = wd + R * ns;
                K->gemm_rows(wu, wd, K->gw_min[m->qtype] == 1 ? wm : NULL, nr, cols, &sl, nt - 16 * g0,
                             yy + 16 * g0 * yys + (p - r0), yys, K->gw_min[m->qtype] == 2, NULL, 0);
            }
        }
    }
}

void mr_mat_rows(const mr_kernels *K, const mr_mat *m, const mr_xact *xa, int64_t nt, int64_t r0, int64_t r1, float *yy,
                 int64_t yys, int worker) {
    if (xa->xp.q && mr_mat_gemm(K, m, nt)) {
        gemm_rows(K, m, &xa->xp, nt, r0, r1, yy, yys, worker);
        return;
    }
    if (m->packed) {
        const mr_pgemv_fn f = K->pgemv[m->qtype];
        const int64_t full = (r1 - r0) / 4;
        const uint8_t *wp = rows_tiles(m, r0);
        if (full) f(wp, full, m->ntiles, xa, (int)nt, yy, yys);
        if (r1 - r0 > 4 * full) { /* a last group with padding rows goes through a small buffer */
            float tmp[4 * MR_PACKED_INT_MAX];
            f(wp + full * m->ntiles * m->tb, 1, m->ntiles, xa, (int)nt, tmp, 4);
            for (int64_t t = 0; t < nt; t++)
                for (int64_t r = 4 * full; r < r1 - r0; r++) yy[t * yys + r] = tmp[4 * t + (r - 4 * full)];
        }
        return;
    }
    const int64_t nb32 = m->cols / 32;
    /* an int8 gemv needs its layout (mr_mat_xlayout gives it whenever cols allow; else the row kernel) */
    const mr_gemv_fn g = K->gemv_q8[m->qtype] && !xa->q8 ? NULL : K->gemv[m->qtype];
    if (g) {
        for (int64_t t0 = 0; t0 < nt; t0 += MR_NT_INT) {
            const int n = (int)(nt - t0 < MR_NT_INT ? nt - t0 : MR_NT_INT);
            mr_xact x = *xa;
            if (x.q) {
                x.q += t0 * x.qs;
                x.d += t0 * x.bs;
                x.s += t0 * x.bs;
                x.sq += t0 * x.bs;
                x.sq16 += 2 * t0 * x.bs;
            }
            if (x.qp) x.qp += t0 * x.qs;
            if (x.q8) {
                x.q8 += t0 * x.qs;
                x.d8 += t0 * (x.bs / 8);
                x.s8 += 2 * t0 * x.bs;
                x.i8 += t0 * (x.bs / 8);
            }
            g(m->w + r0 * m->rb, m->rb, r1 - r0, nb32, &x, n, yy + t0 * yys, yys);
        }
        return;
    }
    const mr_vint_fn f = K->vint[m->qtype];
    const int16_t *xq = K->xpair[m->qtype] ? xa->qp : xa->q;
    float out[MR_NT_INT];
    const int64_t ahead = m->rb >= MR_PREFETCH_BYTES ? 1 : (MR_PREFETCH_BYTES + m->rb - 1) / m->rb;
    prefetch_rows(m->w, m->rb, r0, r1 - r0 < ahead ? r1 - r0 : ahead);
    for (int64_t r = r0; r < r1; r++) {
        if (r + ahead < r1) prefetch_rows(m->w, m->rb, r + ahead, 1);
        const uint8_t *wr = m->w + r * m->rb;
        for (int64_t t0 = 0; t0 < nt; t0 += MR_NT_INT) {
            const int n = (int)(nt - t0 < MR_NT_INT ? nt - t0 : MR_NT_INT);
            f(wr, nb32, xq + t0 * m->cols, xa->d + t0 * nb32, xa->s + t0 * nb32, m->cols, nb32, n, out);
            for (int t = 0; t < n; t++) yy[(t0 + t) * yys + (r - r0)] = out[t];
        }
    }
}

/* the success return of the entry points: chunks the caller recomputed since s0 = mr_pool_steals() was read
 * under the call lock (see api.h), clamped */
int mr_steals_since(unsigned long long s0) {
    const unsigned long long st = mr_pool_steals() - s0;
    return st > 1000000ULL ? 1000000 : (int)st;
}

/* Whether a matmul takes the AMX path: rows of whole 32-column blocks (cols 0: a path query, which knows no
 * shape); F32 weights keep the float32 paths, AMX's bf16 pairs hold 16 of their 24 bits */
static int amx_taken(const mr_kernels *K, int qtype, int64_t nt, int64_t cols) {
    return K->amx_rows && qtype != GT_F32 && nt >= MR_AMX_MIN_TOKENS && cols % 32 == 0;
}

static int choose_path(const mr_kernels *K, int qtype, int64_t nt) {
    if (!mr_type_ok(qtype) || !K->dq[qtype]) return PATH_NONE;
    const int64_t int_max = K->int_tokens[qtype] ? K->int_tokens[qtype] : MR_INT_MAX_TOKENS;
    if ((K->vint[qtype] || K->gemv[qtype]) && nt <= int_max) return PATH_INT;
    return PATH_FLOAT;
}

int mr_matmul_path(int qtype, long long n_tokens, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (!mr_type_ok(qtype)) return MR_E_QTYPE;
    const int p = choose_path(K, qtype, n_tokens);
    if (p != PATH_NONE && amx_taken(K, qtype, n_tokens, 0)) return 7; /* AMX (where cols % 32 == 0) */
    if (p == PATH_INT && K->gemv[qtype] && K->gemv_q8[qtype]) return 6; /* int8 activations */
    if (p == PATH_FLOAT && K->panel && n_tokens >= MR_PANEL_MIN_TOKENS) return 4; /* float panel */
    return p == PATH_FLOAT && n_tokens > 2 ? 3 : p; /* 3: float tile, 2: float row dots */
}

int64_t mr_pick_chunk(int64_t rows, int64_t rb, int64_t nt, int threads, int64_t lo, int64_t hi) {
    const int64_t T = threads > 0 ? threads : 1;
    int64_t c = rows / (T * 16);
    if (c < lo) c = lo;
    if (c > hi) c = hi;
    if (rb > 0 && nt > 0) {
        int64_t cb = (MR_ITEM_BYTES / nt + rb - 1) / rb; /* rows that make an item worth its claim */
        const int64_t share = (rows + T - 1) / T;       /* but every thread still gets one */
        if (cb > share) cb = share;
        if (cb > c) c = cb;
    }
    c = (c + 7) & ~(int64_t)7;
    return c;
}

/* AMX: 32 dequantized rows at a time into the tile layout, times every token's bf16 rows (amx_x, c->x unused) */
static uint16_t *amx_x;
static size_t amx_cap;

static void task_amx(const void *c_, int64_t item, int worker, float *buf) {
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    OUT_TARGET
    const int64_t cols = c->cols, ntp = (c->nt + 15) & ~(int64_t)15;
    float *a = (float *)mr_scratch(worker, 1, (size_t)(32 * cols) * 4);
    uint16_t *wt = (uint16_t *)mr_scratch(worker, 3, (size_t)(128 * cols));
    for (int64_t p = r0; p < r1; p += 32) {
        const int nr = (int)(r1 - p < 32 ? r1 - p : 32);
        dq_rows(c, p, nr, 0, cols, a); /* (nr, cols) floats */
        c->K->amx_prep_w(a, nr, cols, wt);
        c->K->amx_rows(wt, nr, cols, amx_x, amx_x + ntp * cols, c->nt, yy + (p - r0), yys);
    }
}

/* The float paths (weights dequantized, float32 products) for c->nt tokens; caller holds the lock. */
static int run_float(mm_ctx *c, int threads) {
    const int64_t rows = c->rows, nt = c->nt;
    if (amx_taken(c->K, c->qtype, nt, c->cols)) {
        const int64_t ntp = (nt + 15) & ~(int64_t)15;
        const int rc = grow((void **)&amx_x, &amx_cap, (size_t)(2 * ntp * c->cols), 2);
        if (rc != MR_OK) return rc;
        c->K->amx_prep_x(c->x, nt, c->xs, c->cols, amx_x, amx_x + ntp * c->cols);
        c->chunk = rows >= 64 * threads * 4 ? 64 : 32;
        return mr_parallel_for(task_amx, commit_rows, c, sizeof *c, (rows + c->chunk - 1) / c->chunk, c->chunk * nt, threads);
    }
    if (nt <= 2) {
        c->chunk = mr_pick_chunk(rows, 0, 0, threads, 8, 256);
        return mr_parallel_for(task_fdot, commit_rows, c, sizeof *c, (rows + c->chunk - 1) / c->chunk, c->chunk * nt, threads);
    }
    if (c->K->panel && nt >= MR_PANEL_MIN_TOKENS) {
        c->chunk = rows >= 64 * threads * 4 ? 64 : MR_PR;
        return mr_parallel_for(task_panel, commit_rows, c, sizeof *c, (rows + c->chunk - 1) / c->chunk, c->chunk * nt, threads);
    }
    c->chunk = mr_pick_chunk(rows, 0, 0, threads, 16, 64);
    return mr_parallel_for(task_tile, commit_rows, c, sizeof *c, (rows + c->chunk - 1) / c->chunk, c->chunk * nt, threads);
}

int mr_matmul(int qtype, const unsigned char *w, long long rows, long long cols, long long row_bytes,
              const float *x, long long n_tokens, long long x_stride, float *y, long long y_stride,
              int threads, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (!mr_type_ok(qtype) || !K->dq[qtype]) return MR_E_QTYPE;
    const mr_type_info ti = mr_types[qtype];
    if (rows < 0 || cols <= 0 || n_tokens < 0 || cols % ti.block) return MR_E_SHAPE;
    if (row_bytes < cols / ti.block * ti.bytes || x_stride < cols || y_stride < rows) return MR_E_SHAPE;
    if (rows == 0 || n_tokens == 0) return MR_OK;
    if (threads <= 0) threads = mr_pool_threads_default();

    mm_ctx c = {K, qtype, w, rows, cols, row_bytes, x, n_tokens, x_stride, y, y_stride, 0, {0}, 0, 0, 0, 0};
    const int path = amx_taken(K, qtype, n_tokens, cols) ? PATH_FLOAT : choose_path(K, qtype, n_tokens);
    int rc = MR_OK;
    mr_call_lock();
    const unsigned long long s0 = mr_pool_steals();
    if (path == PATH_INT) {
        c.nb32 = cols / 32;
        const mr_mat m = {qtype, 0, w, rows, cols, row_bytes, 0, 0};
        const int lay = mr_mat_xlayout(K, &m);
        mr_xacts xs;
        rc = mr_prepare_x(K, x, n_tokens, x_stride, cols, lay, &xs);
        c.xa = *mr_xact_for(&xs, lay);
        if (rc == MR_OK) {
            c.chunk = mr_pick_chunk(rows, row_bytes, n_tokens, threads, 8, 256);
            rc = mr_parallel_for(task_int, commit_rows, &c, sizeof c, (rows + c.chunk - 1) / c.chunk, c.chunk * n_tokens, threads);
        }
    } else {
        rc = run_float(&c, threads);
    }
    if (rc == MR_OK) rc = mr_steals_since(s0);
    mr_call_unlock();
    return rc;
}

/* permuted float activations of the packed float paths (grow-only, guarded by the call lock) */
static float *xp_buf;
static size_t xp_cap;

int mr_pack_preferred(int qtype, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    return K && mr_type_ok(qtype) && mr_pack_tile_bytes(qtype) && K->pgemv[qtype] ? 1 : 0;
}

int mr_matmul_packed_path(int qtype, long long n_tokens, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (!mr_pack_tile_bytes(qtype)) return MR_E_QTYPE;
    const int i8 = K->gemm_i8 && K->gemm_min_t[qtype] && n_tokens < MR_AMX_INT8_MAX_TOKENS;
    if (amx_taken(K, qtype, n_tokens, 0) && !i8) return 7; /* AMX, through run_float (packed rows: whole tiles) */
    if (K->gemm_rows && (K->gemm_i8 ? K->gw8 : K->gw)[qtype] && n_tokens >= gemm_min(K, qtype))
        return K->gemm_i8 ? 8 : 5; /* = mr_mat_gemm (8: on AMX int8 tiles) */
    if (K->pgemv[qtype] && n_tokens <= MR_PACKED_INT_MAX) return 1;
    if (K->panel && n_tokens >= MR_PANEL_MIN_TOKENS) return 4;
    return n_tokens > 2 ? 3 : 2;
}

int mr_matmul_packed(int qtype, const unsigned char *wp, long long rows, long long cols, const float *x,
                     long long n_tokens, long long x_stride, float *y, long long y_stride, int threads, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (!mr_pack_tile_bytes(qtype)) return MR_E_QTYPE;
    if (!mr_pack_supported(qtype, rows, cols) || n_tokens < 0 || x_stride < cols || y_stride < rows) return MR_E_SHAPE;
    if (n_tokens == 0) return MR_OK;
    if (threads <= 0) threads = mr_pool_threads_default();
    mm_ctx c = {K, qtype, wp, rows, cols, 0, x, n_tokens, x_stride, y, y_stride, 0, {0}, 0, 1, mr_pack_tile_bytes(qtype),
                cols / mr_pack_tile_cols(qtype)};
    const int path = mr_matmul_packed_path(qtype, n_tokens, isa);
    int rc = MR_OK;
    mr_call_lock();
    const unsigned long long s0 = mr_pool_steals();
    if (path == 1) {
        c.nb32 = cols / 32;
        const int lay = qtype == GT_Q6_K ? MR_XL_PERM6 : MR_XL_PERM;
        mr_xacts xs;
        rc = mr_prepare_x(K, x, n_tokens, x_stride, cols, lay, &xs);
        c.xa = *mr_xact_for(&xs, lay);
        if (rc == MR_OK) {
            c.chunk = mr_pick_chunk(rows, mr_packed_row_bytes(c.tb, c.ntiles), n_tokens, threads, 8, 256);
            rc = mr_parallel_for(task_int, commit_rows, &c, sizeof c, (rows + c.chunk - 1) / c.chunk, c.chunk * n_tokens,
                                 threads);
        }
    } else if (path == 5 || path == 8) {
        mr_xacts xs;
        rc = mr_prepare_x(K, x, n_tokens, x_stride, cols, MR_XL_PANEL, &xs);
        c.xa = xs.nat;
        if (rc == MR_OK) {
            c.chunk = mr_pick_chunk(rows, mr_packed_row_bytes(c.tb, c.ntiles), n_tokens, threads, 8, 256);
            rc = mr_parallel_for(task_int, commit_rows, &c, sizeof c, (rows + c.chunk - 1) / c.chunk, c.chunk * n_tokens,
                                 threads);
        }
    } else {
        rc = grow((void **)&xp_buf, &xp_cap, (size_t)(n_tokens * cols), 4);
        if (rc == MR_OK) {
            const int *perm = qtype == GT_Q6_K ? perm128_q6k : perm128;
            for (int64_t t = 0; t < n_tokens; t++)
                for (int64_t g0 = 0; g0 < cols; g0 += MR_P4_COLS)
                    for (int i = 0; i < MR_P4_COLS; i++) xp_buf[t * cols + g0 + i] = x[t * x_stride + g0 + perm[i]];
            c.x = xp_buf;
            c.xs = cols;
            rc = run_float(&c, threads);
        }
    }
    if (rc == MR_OK) rc = mr_steals_since(s0);
    mr_call_unlock();
    return rc;
}

int mr_dequantize(int qtype, const unsigned char *src, long long n, float *dst) {
    const mr_kernels *K = mr_get_kernels(-1);
    if (!mr_type_ok(qtype) || !K->dq[qtype]) return MR_E_QTYPE;
    const mr_type_info ti = mr_types[qtype];
    if (n < 0 || n % ti.block) return MR_E_SHAPE;
    K->dq[qtype](src, dst, n / ti.block);
    return MR_OK;
}

#include <time.h>
double mr_bench_matmul(int qtype, const unsigned char *w, long long rows, long long cols, long long row_bytes,
                       const float *x, long long n_tokens, float *y, int threads, int isa, int reps) {
    double best = 1e300;
    for (int r = 0; r < reps; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        const int rc = mr_matmul(qtype, w, rows, cols, row_bytes, x, n_tokens, cols, y, rows, threads, isa);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (rc < 0) return (double)rc;
        const double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
        if (ns < best) best = ns;
    }
    /* the caller may free w and x right after: wait until no late worker can still read them */
    const unsigned long long g = mr_pool_generation();
    while (!mr_pool_quiescent(g)) {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    return best;
}
