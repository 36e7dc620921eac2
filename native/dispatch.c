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

void mr_call_lock(void);
void mr_call_unlock(void);
unsigned long long mr_pool_steals(void);
#ifdef MR_X86
void mr_init_avx2(mr_kernels *k);
void mr_init_avx512(mr_kernels *k);
#endif
#ifdef MR_ARM64
void mr_init_neon(mr_kernels *k);
#endif

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
        tables[MR_ISA_AVX512] = &mr_kernels_avx512;
    }
#endif
#ifdef MR_ARM64
    m |= 1 << MR_ISA_NEON; /* Advanced SIMD is mandatory on AArch64 */
    mr_init_neon(&mr_kernels_neon);
    tables[MR_ISA_NEON] = &mr_kernels_neon;
#endif
    isa_mask_v = m;
    isa_sel = best_isa(m);
    const char *e = getenv("MINIRT_ISA");
    if (e && *e) {
        int want = -1;
        if (!strcmp(e, "scalar")) want = MR_ISA_SCALAR;
        else if (!strcmp(e, "avx2")) want = MR_ISA_AVX2;
        else if (!strcmp(e, "avx512")) want = MR_ISA_AVX512;
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
#define MR_INT_MAX_TOKENS 4
/* From this many tokens on, the panel path (when the ISA has one) beats the dot-product tile. */
#define MR_PANEL_MIN_TOKENS 12
/* Tokens per block of the tile path: keeps X (tokens x MR_KC floats) in L2. */
#define MR_TOKEN_BLOCK 96
/* Tokens per block of the panel path (X: tokens x MR_KP floats); each weight panel is dequantized
 * once per block, so larger blocks amortize it better. */
#define MR_PANEL_TOKEN_BLOCK 240

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
    const int16_t *xq;
    const float *xd, *xsum;
    int64_t nb32;
} mm_ctx;

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
    (void)worker;
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    OUT_TARGET
    const mr_vint_fn f = c->K->vint[c->qtype];
    float out[MR_NT_INT];
    const int64_t ahead = c->rb >= MR_PREFETCH_BYTES ? 1 : (MR_PREFETCH_BYTES + c->rb - 1) / c->rb;
    prefetch_rows(c->w, c->rb, r0, r1 - r0 < ahead ? r1 - r0 : ahead);
    for (int64_t r = r0; r < r1; r++) {
        if (r + ahead < r1) prefetch_rows(c->w, c->rb, r + ahead, 1);
        const uint8_t *wr = c->w + r * c->rb;
        for (int64_t t0 = 0; t0 < c->nt; t0 += MR_NT_INT) {
            const int n = (int)(c->nt - t0 < MR_NT_INT ? c->nt - t0 : MR_NT_INT);
            f(wr, c->nb32, c->xq + t0 * c->cols, c->xd + t0 * c->nb32, c->xsum + t0 * c->nb32, c->cols, c->nb32,
              n, out);
            for (int t = 0; t < n; t++) yy[(t0 + t) * yys + (r - r0)] = out[t];
        }
    }
}

static void task_fdot(const void *c_, int64_t item, int worker, float *buf) {
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    OUT_TARGET
    const mr_type_info ti = mr_types[c->qtype];
    float *row = c->qtype == GT_F32 ? NULL : (float *)mr_scratch(worker, 0, (size_t)c->cols * 4);
    float out[MR_NT_INT];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = c->w + r * c->rb;
        const float *wf;
        if (c->qtype == GT_F32) {
            wf = (const float *)(const void *)wr;
        } else {
            c->K->dq[c->qtype](wr, row, c->cols / ti.block);
            wf = row;
        }
        for (int64_t t0 = 0; t0 < c->nt; t0 += MR_NT_INT) {
            const int n = (int)(c->nt - t0 < MR_NT_INT ? c->nt - t0 : MR_NT_INT);
            c->K->dot_f32(wf, c->x + t0 * c->xs, c->xs, c->cols, n, out);
            for (int t = 0; t < n; t++) yy[(t0 + t) * yys + (r - r0)] = out[t];
        }
    }
}

static void task_tile(const void *c_, int64_t item, int worker, float *buf) {
    const mm_ctx *c = (const mm_ctx *)c_;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    OUT_TARGET
    const mr_type_info ti = mr_types[c->qtype];
    const int64_t kc_max = c->cols < MR_KC ? c->cols : MR_KC;
    float *wbuf = (float *)mr_scratch(worker, 1, (size_t)MR_TR * (size_t)kc_max * 4);
    for (int64_t t0 = 0; t0 < c->nt; t0 += MR_TOKEN_BLOCK) {
        const int ntk = (int)(c->nt - t0 < MR_TOKEN_BLOCK ? c->nt - t0 : MR_TOKEN_BLOCK);
        for (int64_t p = r0; p < r1; p += MR_TR) {
            const int nr = (int)(r1 - p < MR_TR ? r1 - p : MR_TR);
            for (int64_t k0 = 0; k0 < c->cols; k0 += MR_KC) {
                const int64_t kn = c->cols - k0 < MR_KC ? c->cols - k0 : MR_KC;
                /* (nr, kn) floats of dequantized weights, row stride kn */
                for (int i = 0; i < nr; i++)
                    c->K->dq[c->qtype](c->w + (p + i) * c->rb + (k0 / ti.block) * ti.bytes, wbuf + (int64_t)i * kn,
                                       kn / ti.block);
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
    const mr_type_info ti = mr_types[c->qtype];
    const int64_t kp = c->cols < MR_KP ? c->cols : MR_KP;
    float *a = (float *)mr_scratch(worker, 1, (size_t)MR_PR * (size_t)kp * 4);
    float *P = (float *)mr_scratch(worker, 3, (size_t)MR_PR * (size_t)kp * 4);
    for (int64_t t0 = 0; t0 < c->nt; t0 += MR_PANEL_TOKEN_BLOCK) {
        const int ntk = (int)(c->nt - t0 < MR_PANEL_TOKEN_BLOCK ? c->nt - t0 : MR_PANEL_TOKEN_BLOCK);
        for (int64_t p = r0; p < r1; p += MR_PR) {
            const int nr = (int)(r1 - p < MR_PR ? r1 - p : MR_PR);
            for (int64_t k0 = 0; k0 < c->cols; k0 += MR_KP) {
                const int64_t kn = c->cols - k0 < MR_KP ? c->cols - k0 : MR_KP;
                for (int i = 0; i < nr; i++)
                    c->K->dq[c->qtype](c->w + (p + i) * c->rb + (k0 / ti.block) * ti.bytes, a + (int64_t)i * kn,
                                       kn / ti.block);
                c->K->pack(a, nr, kn, P);
                c->K->panel(P, nr, c->x + t0 * c->xs + k0, c->xs, ntk, kn, yy + t0 * yys + (p - r0), yys, k0 > 0);
            }
        }
    }
}

/* activation scratch (int path), guarded by the call lock */
static int16_t *xq_buf;
static float *xd_buf;
static size_t xq_cap, xd_cap;

/* Grow-only and never freed: a worker descheduled in an old job may still read the old buffer
 * (its result is discarded, see pool.c). Doubling bounds what is kept to twice the largest need. */
static int ensure_xq(size_t nq, size_t nd) {
    if (nq > xq_cap) {
        void *p = NULL;
        const size_t cap = nq * 2;
        if (posix_memalign(&p, 64, cap * 2 + 64) != 0) return MR_E_NOMEM;
        xq_buf = (int16_t *)p;
        xq_cap = cap;
    }
    if (nd > xd_cap) {
        void *p = NULL;
        const size_t cap = nd * 2;
        if (posix_memalign(&p, 64, cap * 2 * 4 + 64) != 0) return MR_E_NOMEM;
        xd_buf = (float *)p;
        xd_cap = cap;
    }
    return MR_OK;
}

static int choose_path(const mr_kernels *K, int qtype, int64_t nt) {
    if (!mr_type_ok(qtype) || !K->dq[qtype]) return PATH_NONE;
    if (K->vint[qtype] && nt <= MR_INT_MAX_TOKENS) return PATH_INT;
    return PATH_FLOAT;
}

int mr_matmul_path(int qtype, long long n_tokens, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (!mr_type_ok(qtype)) return MR_E_QTYPE;
    const int p = choose_path(K, qtype, n_tokens);
    if (p == PATH_FLOAT && K->panel && n_tokens >= MR_PANEL_MIN_TOKENS) return 4; /* float panel */
    return p == PATH_FLOAT && n_tokens > 2 ? 3 : p; /* 3: float tile, 2: float row dots */
}

static int64_t pick_chunk(int64_t rows, int threads, int64_t lo, int64_t hi) {
    int64_t c = rows / ((int64_t)(threads > 0 ? threads : 1) * 16);
    if (c < lo) c = lo;
    if (c > hi) c = hi;
    c = (c + 7) & ~(int64_t)7;
    return c;
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

    mm_ctx c = {K, qtype, w, rows, cols, row_bytes, x, n_tokens, x_stride, y, y_stride, 0, NULL, NULL, NULL, 0};
    const int path = choose_path(K, qtype, n_tokens);
    int rc = MR_OK;
    mr_call_lock();
    if (path == PATH_INT) {
        c.nb32 = cols / 32;
        rc = ensure_xq((size_t)(n_tokens * cols), (size_t)(n_tokens * c.nb32));
        if (rc == MR_OK) {
            c.xq = xq_buf;
            c.xd = xd_buf;
            c.xsum = xd_buf + n_tokens * c.nb32;
            for (int64_t t = 0; t < n_tokens; t++) {
                int16_t *q = xq_buf + t * cols;
                K->quant_x(x + t * x_stride, cols, q, xd_buf + t * c.nb32, xd_buf + n_tokens * c.nb32 + t * c.nb32);
                if (K->xpair[qtype]) /* swap the middle 16-element quarters of each pair of blocks */
                    for (int64_t b = 0; b + 1 < c.nb32; b += 2) {
                        int16_t tmp[16];
                        memcpy(tmp, q + 32 * b + 16, 32);
                        memcpy(q + 32 * b + 16, q + 32 * b + 32, 32);
                        memcpy(q + 32 * b + 32, tmp, 32);
                    }
            }
            c.chunk = pick_chunk(rows, threads, 8, 256);
            rc = mr_parallel_for(task_int, commit_rows, &c, sizeof c, (rows + c.chunk - 1) / c.chunk, c.chunk * n_tokens, threads);
        }
    } else if (n_tokens <= 2) {
        c.chunk = pick_chunk(rows, threads, 8, 256);
        rc = mr_parallel_for(task_fdot, commit_rows, &c, sizeof c, (rows + c.chunk - 1) / c.chunk, c.chunk * n_tokens, threads);
    } else if (K->panel && n_tokens >= MR_PANEL_MIN_TOKENS) {
        c.chunk = rows >= 64 * threads * 4 ? 64 : MR_PR;
        rc = mr_parallel_for(task_panel, commit_rows, &c, sizeof c, (rows + c.chunk - 1) / c.chunk, c.chunk * n_tokens, threads);
    } else {
        c.chunk = pick_chunk(rows, threads, 16, 64);
        rc = mr_parallel_for(task_tile, commit_rows, &c, sizeof c, (rows + c.chunk - 1) / c.chunk, c.chunk * n_tokens, threads);
    }
    if (rc == MR_OK) {
        const unsigned long long st = mr_pool_steals();
        rc = st > 1000000ULL ? 1000000 : (int)st;
    }
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
