/* Persistent thread pool: created once, grown on demand, never spins for long.
 *
 * Work is split by dynamic chunking: every participating thread (the caller is worker 0) takes the next
 * item from an atomic counter. Between jobs workers spin for a few microseconds (back-to-back calls
 * of one decoder step) and then sleep on a condition variable.
 *
 * Robustness against a busy machine: when another process preempts a worker in the middle of an
 * item, the caller does not wait for it. For "stealable" jobs workers compute each item into a
 * private buffer and publish it with a compare-and-swap; once the caller has run out of items it
 * waits a little (about twice its own average item time) and then recomputes any item still in
 * flight itself, straight into the output, after winning the same compare-and-swap. The late worker
 * then finds its item taken and drops its result. Everything a late worker may still read stays
 * valid: the job descriptor lives in a pool-owned ring; C buffers that jobs read are released with
 * mr_defer_free(), which frees them only once no worker is left in a job that could read them; the
 * entry points return how many items their callers took over (mr_pool_steals() counts them all,
 * nested jobs included), and when that is > 0 the Python wrapper keeps the caller's arrays alive until
 * mr_pool_quiescent() says no worker is left in that job. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sched_getaffinity, CPU_SET */
#endif
#include "common.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sched.h>
#include <stdio.h>
#endif

#if defined(MR_X86)
#include <immintrin.h>
#define MR_PAUSE() _mm_pause()
#elif defined(MR_ARM64)
#define MR_PAUSE() __asm__ __volatile__("yield")
#else
#define MR_PAUSE() ((void)0)
#endif

/* item states, tagged with the job generation in the upper bits: (gen << 3) | state */
enum { ST_FREE = 0, ST_CLAIMED = 1, ST_COMMIT = 2, ST_STOLEN = 3, ST_DONE = 4 };
#define TAG(g, s) (((uint64_t)(g) << 3) | (uint64_t)(s))

#define RING 8
#define CTX_MAX 2048

typedef struct {
    _Atomic uint64_t seq;           /* generation of the job stored here (seqlock: written last) */
    mr_task_fn fn;
    mr_commit_fn commit;            /* NULL: not stealable, workers write outputs directly */
    int64_t n_items;
    int64_t buf_floats;             /* private buffer per item (stealable jobs) */
    int active;                     /* workers with id <= active take part */
    _Alignas(64) unsigned char ctx[CTX_MAX];
    _Alignas(64) _Atomic int64_t next;
    _Atomic uint64_t *st;           /* item states, grow-only */
    int64_t st_cap;
} mr_job;

typedef struct {
    pthread_mutex_t m;
    pthread_cond_t cv_work;
    pthread_t th[MR_MAX_WORKERS];
    int n_workers;
    mr_job ring[RING];
    _Atomic uint64_t ticket;        /* latest published generation */
    _Atomic uint64_t busy_gen[MR_MAX_WORKERS + 1]; /* generation a worker is executing, 0 when idle */
    _Atomic int sleepers;
    int default_threads;
    int spin_iters;
    double steal_patience_ns;       /* < 0: adaptive (twice the caller's mean item time + 5 us) */
    double test_delay_ns;           /* testing knob: workers pause this long before each claimed item */
    uint64_t start_gen[MR_MAX_WORKERS + 1];
    uint64_t steals;                /* items callers took over since the start (under the call lock) */
} mr_pool;

static mr_pool P = {
    .m = PTHREAD_MUTEX_INITIALIZER,
    .cv_work = PTHREAD_COND_INITIALIZER,
};
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* ---------------- per-worker scratch ---------------- */
#define MR_SLOTS 5
static void *scratch_ptr[MR_MAX_WORKERS][MR_SLOTS];
static size_t scratch_size[MR_MAX_WORKERS][MR_SLOTS];

void *mr_scratch(int worker, int slot, size_t bytes) {
    if (scratch_size[worker][slot] < bytes) {
        free(scratch_ptr[worker][slot]);
        size_t sz = (bytes + 4095) & ~(size_t)4095;
        void *p = NULL;
        if (posix_memalign(&p, 64, sz) != 0) p = NULL;
        scratch_ptr[worker][slot] = p;
        scratch_size[worker][slot] = p ? sz : 0;
    }
    return scratch_ptr[worker][slot];
}

/* ---------------- physical cores ---------------- */
int mr_physical_cores(void) {
    static int cached = 0;
    if (cached > 0) return cached;
    int n = 0;
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        /* count distinct (package, core) pairs among the CPUs we may run on */
        long keys[1024];
        int nk = 0;
        for (int c = 0; c < CPU_SETSIZE && nk < 1024; c++) {
            if (!CPU_ISSET(c, &set)) continue;
            char path[128];
            long core = -1, pkg = 0;
            snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/core_id", c);
            FILE *f = fopen(path, "r");
            if (f) { if (fscanf(f, "%ld", &core) != 1) core = -1; fclose(f); }
            snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c);
            f = fopen(path, "r");
            if (f) { if (fscanf(f, "%ld", &pkg) != 1) pkg = 0; fclose(f); }
            long key = core < 0 ? -1 - c : pkg * 100000 + core;
            int seen = 0;
            for (int i = 0; i < nk; i++) if (keys[i] == key) { seen = 1; break; }
            if (!seen) keys[nk++] = key;
        }
        n = nk;
    }
#endif
    if (n <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? (int)c : 1;
    }
    if (n > MR_MAX_WORKERS) n = MR_MAX_WORKERS;
    cached = n;
    return n;
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

/* ---------------- workers ---------------- */

/* Items of job j (generation g) for worker `id` (> 0): claim, compute, publish. */
static void worker_items(mr_job *j, uint64_t g, const mr_task_fn fn, const mr_commit_fn commit,
                         const void *ctx, int64_t n, int64_t buf_floats, int id) {
    float *buf = commit ? (float *)mr_scratch(id, 4, (size_t)buf_floats * 4) : NULL;
    _Atomic uint64_t *st = j->st;
    for (;;) {
        const int64_t i = atomic_fetch_add(&j->next, 1);
        if (i >= n) break;
        uint64_t e = TAG(g, ST_FREE);
        if (!atomic_compare_exchange_strong(&st[i], &e, TAG(g, ST_CLAIMED))) continue; /* stale or taken */
        if (P.test_delay_ns > 0.0) { /* as a worker descheduled right after its claim */
            struct timespec ts = {(time_t)(P.test_delay_ns / 1e9), (long)((int64_t)P.test_delay_ns % 1000000000)};
            nanosleep(&ts, NULL);
        }
        if (commit) {
            fn(ctx, i, id, buf);
            e = TAG(g, ST_CLAIMED);
            if (atomic_compare_exchange_strong(&st[i], &e, TAG(g, ST_COMMIT))) {
                commit(ctx, i, buf);
                atomic_store(&st[i], TAG(g, ST_DONE));
            } /* else: the caller took it over; drop ours */
        } else {
            fn(ctx, i, id, NULL);
            atomic_store(&st[i], TAG(g, ST_DONE));
        }
        if ((atomic_load(&P.ticket)) != g && commit) break; /* the caller has finished without us */
    }
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    /* the generation current when the thread was created: the job published right after creation
     * has a newer one, even if this thread starts running late */
    uint64_t seen = P.start_gen[id];
    unsigned char ctx[CTX_MAX] __attribute__((aligned(64)));
    for (;;) {
        uint64_t g = atomic_load_explicit(&P.ticket, memory_order_acquire);
        for (int s = 0; g == seen && s < P.spin_iters; s++) {
            MR_PAUSE();
            g = atomic_load_explicit(&P.ticket, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&P.m);
            atomic_fetch_add(&P.sleepers, 1);
            while ((g = atomic_load(&P.ticket)) == seen) pthread_cond_wait(&P.cv_work, &P.m);
            atomic_fetch_sub(&P.sleepers, 1);
            pthread_mutex_unlock(&P.m);
        }
        seen = g;
        mr_job *j = &P.ring[g % RING];
        /* seqlock read of the descriptor: if the slot was reused meanwhile we were too late anyway */
        if (atomic_load_explicit(&j->seq, memory_order_acquire) != g) continue;
        atomic_store(&P.busy_gen[id], g);
        const mr_task_fn fn = j->fn;
        const mr_commit_fn commit = j->commit;
        const int64_t n = j->n_items, bf = j->buf_floats;
        const int active = j->active;
        memcpy(ctx, j->ctx, CTX_MAX);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load(&j->seq) == g && id <= active) worker_items(j, g, fn, commit, ctx, n, bf, id);
        atomic_store(&P.busy_gen[id], 0);
    }
    return NULL;
}

static void pool_reset_after_fork(void) {
    /* the child has no worker threads: start over */
    pthread_mutex_init(&P.m, NULL);
    pthread_cond_init(&P.cv_work, NULL);
    pthread_mutex_init(&call_lock, NULL);
    P.n_workers = 0;
    atomic_store(&P.sleepers, 0);
    for (int i = 0; i <= MR_MAX_WORKERS; i++) atomic_store(&P.busy_gen[i], 0);
}

static void pool_init(void) {
    P.default_threads = mr_physical_cores();
    const char *e = getenv("MINIRT_THREADS");
    if (e && atoi(e) > 0) P.default_threads = atoi(e) > MR_MAX_WORKERS ? MR_MAX_WORKERS : atoi(e);
    /* ~30 us of spinning between back-to-back jobs (a pause is ~40-140 cycles) */
    P.spin_iters = 2000;
    e = getenv("MINIRT_SPIN");
    if (e && atoi(e) >= 0) P.spin_iters = atoi(e);
    /* testing knob: steal in-flight items after this many ns (0: at once) */
    P.steal_patience_ns = -1.0;
    e = getenv("MINIRT_STEAL_PATIENCE_NS");
    if (e && *e) P.steal_patience_ns = atof(e);
    /* testing knob: every worker sleeps this many ns after claiming an item (a late worker on demand) */
    e = getenv("MINIRT_TEST_WORKER_DELAY_NS");
    if (e && *e) P.test_delay_ns = atof(e);
    pthread_atfork(NULL, NULL, pool_reset_after_fork);
}

static int pool_grow(int n_workers) {
    while (P.n_workers < n_workers) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        int id = P.n_workers + 1;
        P.start_gen[id] = atomic_load(&P.ticket);
        int rc = pthread_create(&P.th[id - 1], &attr, worker_main, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (rc != 0) return MR_E_THREADS;
        P.n_workers++;
    }
    return MR_OK;
}

int mr_pool_threads_default(void) {
    pthread_once(&pool_once, pool_init);
    return P.default_threads;
}

int mr_get_threads(void) { return mr_pool_threads_default(); }

int mr_set_threads(int n) {
    pthread_once(&pool_once, pool_init);
    if (n <= 0) n = mr_physical_cores();
    if (n > MR_MAX_WORKERS) n = MR_MAX_WORKERS;
    P.default_threads = n;
    return n;
}

void mr_call_lock(void) { pthread_once(&pool_once, pool_init); pthread_mutex_lock(&call_lock); }
void mr_call_unlock(void) { pthread_mutex_unlock(&call_lock); }

unsigned long long mr_pool_generation(void) { return (unsigned long long)atomic_load(&P.ticket); }

int mr_pool_quiescent(unsigned long long gen) {
    for (int i = 1; i <= P.n_workers; i++) {
        const uint64_t b = atomic_load(&P.busy_gen[i]);
        if (b != 0 && b <= gen) return 0;
    }
    return 1;
}

unsigned long long mr_pool_steals(void) { return (unsigned long long)P.steals; }

/* ---------------- deferred frees ---------------- */
/* Buffers that jobs read, released while a late worker may still be inside one of those jobs: each is
 * freed once the pool is quiescent up to the generation current when it was released. Guarded by the
 * call lock. */
#define DEFER_MAX 256
static struct { void *p; uint64_t gen; } deferred[DEFER_MAX];
static int n_deferred;

static void reap_deferred(void) {
    int k = 0;
    for (int i = 0; i < n_deferred; i++) {
        if (mr_pool_quiescent(deferred[i].gen)) free(deferred[i].p);
        else deferred[k++] = deferred[i];
    }
    n_deferred = k;
}

void mr_defer_free(void *p) {
    if (!p) return;
    reap_deferred();
    const uint64_t g = atomic_load(&P.ticket);
    while (n_deferred == DEFER_MAX && !mr_pool_quiescent(g)) { /* full: wait for the late workers (rare) */
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    if (n_deferred == DEFER_MAX) reap_deferred();
    if (mr_pool_quiescent(g)) {
        free(p);
        return;
    }
    deferred[n_deferred].p = p;
    deferred[n_deferred].gen = g;
    n_deferred++;
}

/* Caller must hold call_lock (mr_call_lock). */
int mr_parallel_for(mr_task_fn fn, mr_commit_fn commit, const void *ctx, size_t ctx_size, int64_t n_items,
                    int64_t buf_floats, int threads) {
    if (n_deferred) reap_deferred();
    if (threads <= 0) threads = P.default_threads;
    if (threads > MR_MAX_WORKERS) threads = MR_MAX_WORKERS;
    if ((int64_t)threads > n_items) threads = (int)(n_items > 0 ? n_items : 1);
    if (ctx_size > CTX_MAX) return MR_E_SHAPE;
    if (threads <= 1) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i, 0, NULL);
        return MR_OK;
    }
    if (P.n_workers < threads - 1 && pool_grow(threads - 1) != MR_OK) {
        if (P.n_workers == 0) {
            for (int64_t i = 0; i < n_items; i++) fn(ctx, i, 0, NULL);
            return MR_OK;
        }
        threads = P.n_workers + 1;
    }
    const uint64_t g = atomic_load(&P.ticket) + 1;
    mr_job *j = &P.ring[g % RING];
    atomic_store(&j->seq, 0); /* invalidate the slot for late readers while it is rewritten */
    atomic_thread_fence(memory_order_release); /* (seqlock) the invalidation is seen before the new fields */
    if (j->st_cap < n_items) {
        /* grow-only: a late worker of an older job may still touch the old array, so keep it */
        int64_t cap = n_items < 256 ? 256 : n_items * 2;
        _Atomic uint64_t *st = (_Atomic uint64_t *)calloc((size_t)cap, sizeof(uint64_t));
        if (!st) return MR_E_NOMEM;
        j->st = st;
        j->st_cap = cap;
    }
    for (int64_t i = 0; i < n_items; i++) atomic_store_explicit(&j->st[i], TAG(g, ST_FREE), memory_order_relaxed);
    j->fn = fn;
    j->commit = commit;
    j->n_items = n_items;
    j->buf_floats = buf_floats;
    j->active = threads - 1;
    memcpy(j->ctx, ctx, ctx_size);
    atomic_store(&j->next, 0);
    atomic_store_explicit(&j->seq, g, memory_order_release);
    atomic_store_explicit(&P.ticket, g, memory_order_seq_cst); /* publish */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.m);
        pthread_cond_broadcast(&P.cv_work);
        pthread_mutex_unlock(&P.m);
    }
    const void *jctx = j->ctx;
    _Atomic uint64_t *st = j->st;

    /* the caller's own share, timed to know how long an item takes */
    double t_items = 0.0;
    int64_t n_own = 0;
    for (;;) {
        const int64_t i = atomic_fetch_add(&j->next, 1);
        if (i >= n_items) break;
        uint64_t e = TAG(g, ST_FREE);
        if (!atomic_compare_exchange_strong(&st[i], &e, TAG(g, ST_CLAIMED))) continue;
        const double t0 = now_ns();
        fn(jctx, i, 0, NULL);
        t_items += now_ns() - t0;
        n_own++;
        atomic_store(&st[i], TAG(g, ST_DONE));
    }
    /* wait for items still in flight; take over stealable ones whose worker seems descheduled */
    const double patience = P.steal_patience_ns >= 0.0 ? P.steal_patience_ns
                                                        : (n_own ? 2.0 * t_items / (double)n_own : 20000.0) + 5000.0;
    const double t_wait = now_ns();
    uint64_t steals = 0;
    int64_t first = 0;
    for (int spins = 0;; spins++) {
        while (first < n_items && atomic_load(&st[first]) == TAG(g, ST_DONE)) first++;
        if (first >= n_items) break;
        const int late = (spins & 63) == 0 && now_ns() - t_wait >= patience;
        for (int64_t i = first; i < n_items; i++) {
            uint64_t s = atomic_load(&st[i]);
            if (s == TAG(g, ST_FREE)) { /* fetched by a worker that gave up on it: ours now */
                if (atomic_compare_exchange_strong(&st[i], &s, TAG(g, ST_STOLEN))) {
                    fn(jctx, i, 0, NULL);
                    atomic_store(&st[i], TAG(g, ST_DONE));
                }
            } else if (late && commit && s == TAG(g, ST_CLAIMED)) {
                if (atomic_compare_exchange_strong(&st[i], &s, TAG(g, ST_STOLEN))) {
                    fn(jctx, i, 0, NULL);
                    atomic_store(&st[i], TAG(g, ST_DONE));
                    steals++;
                }
            }
        }
        if (spins > P.spin_iters && !commit) {
            /* a non-stealable job with a descheduled worker: let this core go idle so the
             * scheduler can move that worker here */
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        } else {
            MR_PAUSE();
        }
    }
    P.steals += steals;
    return MR_OK;
}
