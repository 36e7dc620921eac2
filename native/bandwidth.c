/* Memory-bandwidth probe: a streaming read of a large buffer on the thread pool.
 *
 * Each item sums (wrapping, as uint64) the 64-bit words of one contiguous slice with the widest
 * integer adds the ISA has, four independent accumulators so the adds never limit the loads. An
 * integer add per 8 bytes is far below what a core can issue, so the time is the memory's (a
 * float64 sum in numpy is not: its dependent float adds cap one thread well below the bus). The
 * sum makes the read observable (the compiler cannot drop it) and lets a test check every byte
 * was read. */
#include "common.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(MR_X86)
#include <immintrin.h>
#elif defined(MR_ARM64)
#include <arm_neon.h>
#endif


typedef uint64_t (*rb_fn)(const uint8_t *p, int64_t n_words);

static uint64_t rb_tail(const uint8_t *p, int64_t n_words) {
    uint64_t s = 0;
    for (int64_t i = 0; i < n_words; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8);
        s += w;
    }
    return s;
}

static uint64_t rb_scalar(const uint8_t *p, int64_t n_words) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, w[4];
    int64_t i = 0;
    for (; i + 4 <= n_words; i += 4) {
        memcpy(w, p + 8 * i, 32);
        a0 += w[0];
        a1 += w[1];
        a2 += w[2];
        a3 += w[3];
    }
    return a0 + a1 + a2 + a3 + rb_tail(p + 8 * i, n_words - i);
}

#if defined(MR_X86)
__attribute__((target("avx2"))) static uint64_t rb_avx2(const uint8_t *p, int64_t n_words) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 16 <= n_words; i += 16) { /* 128 bytes per iteration */
        const __m256i *q = (const __m256i *)(p + 8 * i);
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(q));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(q + 1));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(q + 2));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(q + 3));
    }
    const __m256i a = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t lane[4];
    _mm256_storeu_si256((__m256i *)lane, a);
    return lane[0] + lane[1] + lane[2] + lane[3] + rb_tail(p + 8 * i, n_words - i);
}

__attribute__((target("avx512f"))) static uint64_t rb_avx512(const uint8_t *p, int64_t n_words) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n_words; i += 32) { /* 256 bytes (four cache lines) per iteration */
        const uint8_t *q = p + 8 * i;
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(q));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(q + 64));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(q + 128));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(q + 192));
    }
    const __m512i a = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
    return (uint64_t)_mm512_reduce_add_epi64(a) + rb_tail(p + 8 * i, n_words - i);
}
#endif

#if defined(MR_ARM64)
static uint64_t rb_neon(const uint8_t *p, int64_t n_words) {
    uint64x2_t a0 = vdupq_n_u64(0), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 8 <= n_words; i += 8) { /* 64 bytes per iteration */
        const uint64_t *q = (const uint64_t *)(p + 8 * i);
        a0 = vaddq_u64(a0, vld1q_u64(q));
        a1 = vaddq_u64(a1, vld1q_u64(q + 2));
        a2 = vaddq_u64(a2, vld1q_u64(q + 4));
        a3 = vaddq_u64(a3, vld1q_u64(q + 6));
    }
    return vaddvq_u64(vaddq_u64(vaddq_u64(a0, a1), vaddq_u64(a2, a3))) + rb_tail(p + 8 * i, n_words - i);
}
#endif

static rb_fn rb_for(int isa) {
    switch (isa) {
#if defined(MR_X86)
    case MR_ISA_AVX512:
    case MR_ISA_AVX512_AMX: return rb_avx512;
    case MR_ISA_AVX2: return rb_avx2;
#endif
#if defined(MR_ARM64)
    case MR_ISA_NEON:
    case MR_ISA_NEON_DOT: return rb_neon;
#endif
    default: return rb_scalar;
    }
}

#define RB_SLICE_WORDS ((int64_t)1 << 18) /* 2 MiB per item: many items for dynamic balance, few calls */

typedef struct {
    rb_fn fn;
    const uint8_t *p;
    int64_t n_words;
    uint64_t *partial; /* one per item: no shared counter between the threads */
} rb_ctx;

static void rb_task(const void *c_, int64_t item, int worker, float *buf) {
    (void)worker;
    (void)buf;
    const rb_ctx *c = (const rb_ctx *)c_;
    const int64_t w0 = item * RB_SLICE_WORDS;
    const int64_t nw = c->n_words - w0 < RB_SLICE_WORDS ? c->n_words - w0 : RB_SLICE_WORDS;
    c->partial[item] = c->fn(c->p + 8 * w0, nw);
}

double mr_read_bandwidth(const void *p, long long n_bytes, int threads, int reps, int isa, unsigned long long *sum) {
    const int id = mr_resolve_isa(isa);
    if (id < 0) return MR_E_ISA;
    if (!p || n_bytes <= 0 || n_bytes % 8 || reps <= 0 || !sum) return MR_E_SHAPE;
    const int64_t n_words = n_bytes / 8, n_items = (n_words + RB_SLICE_WORDS - 1) / RB_SLICE_WORDS;
    uint64_t *partial = (uint64_t *)calloc((size_t)n_items, sizeof(uint64_t));
    if (!partial) return MR_E_NOMEM;
    const rb_ctx c = {rb_for(id), (const uint8_t *)p, n_words, partial};
    double best = 1e300;
    int rc = MR_OK;
    mr_call_lock();
    for (int r = 0; r < reps && rc == MR_OK; r++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        rc = mr_parallel_for(rb_task, NULL, &c, sizeof c, n_items, 0, threads);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
        if (ns < best) best = ns;
    }
    mr_call_unlock();
    /* non-stealable job: every item is done when mr_parallel_for returns, but a worker may still be
     * leaving the job; partial must outlive it */
    const unsigned long long g = mr_pool_generation();
    while (!mr_pool_quiescent(g)) {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    uint64_t s = 0;
    for (int64_t i = 0; i < n_items; i++) s += partial[i];
    free(partial);
    if (rc != MR_OK) return rc;
    *sum = s;
    return best;
}
