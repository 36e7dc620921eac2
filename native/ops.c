/* Decoder-step helpers around the matmuls: RMSNorm, RoPE, softmax and single-query attention over
 * a KV cache. Deliberately simple loops (the matmuls dominate a step); inner dots use the ISA's
 * kernels. */
#include "common.h"

#include <stdlib.h>

void mr_call_lock(void);
void mr_call_unlock(void);

int mr_rmsnorm(const float *x, const float *weight, float eps, long long rows, long long n, float *out, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (rows < 0 || n <= 0) return MR_E_SHAPE;
    for (long long r = 0; r < rows; r++) K->rmsnorm(x + r * n, weight, eps, n, out + r * n);
    return MR_OK;
}

MR_INLINE void rot_pair(float *a, float *b, float c, float s) {
    const float x0 = *a, x1 = *b;
    *a = x0 * c - x1 * s;
    *b = x0 * s + x1 * c;
}

static void rope_row(float *v, long long n_rot, const float *cs, const float *sn, int neox) {
    const long long half = n_rot / 2;
    if (neox)
        for (long long i = 0; i < half; i++) rot_pair(v + i, v + i + half, cs[i], sn[i]);
    else
        for (long long i = 0; i < half; i++) rot_pair(v + 2 * i, v + 2 * i + 1, cs[i], sn[i]);
}

int mr_rope_cs(float *x, long long n_tokens, long long n_heads, long long head_dim, long long n_rot,
               const float *cos_t, const float *sin_t, int neox, int isa) {
    if (!mr_get_kernels(isa)) return MR_E_ISA;
    if (n_tokens < 0 || n_heads < 0 || n_rot < 0 || n_rot > head_dim || (n_rot & 1)) return MR_E_SHAPE;
    const long long half = n_rot / 2;
    for (long long t = 0; t < n_tokens; t++)
        for (long long h = 0; h < n_heads; h++)
            rope_row(x + (t * n_heads + h) * head_dim, n_rot, cos_t + t * half, sin_t + t * half, neox);
    return MR_OK;
}

int mr_rope(float *x, long long n_tokens, long long n_heads, long long head_dim, long long n_rot, const int *pos,
            const float *freqs, int neox, int isa) {
    if (!mr_get_kernels(isa)) return MR_E_ISA;
    if (n_tokens < 0 || n_heads < 0 || n_rot < 0 || n_rot > head_dim || (n_rot & 1)) return MR_E_SHAPE;
    const long long half = n_rot / 2;
    float cbuf[512], sbuf[512];
    float *cs = half <= 512 ? cbuf : (float *)malloc((size_t)half * 4);
    float *sn = half <= 512 ? sbuf : (float *)malloc((size_t)half * 4);
    if (!cs || !sn) {
        if (cs != cbuf) free(cs);
        if (sn != sbuf) free(sn);
        return MR_E_NOMEM;
    }
    for (long long t = 0; t < n_tokens; t++) {
        for (long long i = 0; i < half; i++) {
            /* angle in double: positions reach 1e5 and float angles would lose digits of sin/cos */
            const double th = (double)pos[t] * (double)freqs[i];
            cs[i] = (float)cos(th);
            sn[i] = (float)sin(th);
        }
        for (long long h = 0; h < n_heads; h++) rope_row(x + (t * n_heads + h) * head_dim, n_rot, cs, sn, neox);
    }
    if (cs != cbuf) free(cs);
    if (sn != sbuf) free(sn);
    return MR_OK;
}

int mr_softmax(float *x, long long rows, long long n, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (rows < 0 || n <= 0) return MR_E_SHAPE;
    for (long long r = 0; r < rows; r++) K->softmax(x + r * n, n);
    return MR_OK;
}

typedef struct {
    const mr_kernels *K;
    const float *q;
    const void *k, *v;
    int kv_f16;
    int64_t n_head, group, n_ctx, hd, start, end;
    float scale, softcap;
    float *out;
} att_ctx;

static void att_task(const void *c_, int64_t h, int worker, float *buf) {
    (void)buf;
    const att_ctx *c = (const att_ctx *)c_;
    const int64_t kvh = h / c->group, n = c->end - c->start;
    float *sc = (float *)mr_scratch(worker, 2, (size_t)(n + c->hd) * 4);
    float *row = sc + n; /* head_dim floats: one converted f16 row */
    const float *qh = c->q + h * c->hd;
    for (int64_t j = 0; j < n; j++) {
        const int64_t off = (kvh * c->n_ctx + c->start + j) * c->hd;
        const float *kr;
        if (c->kv_f16) {
            c->K->f16_to_f32((const uint16_t *)c->k + off, row, c->hd);
            kr = row;
        } else {
            kr = (const float *)c->k + off;
        }
        float s = c->K->dot(qh, kr, c->hd) * c->scale;
        if (c->softcap > 0.0f) s = c->softcap * tanhf(s / c->softcap);
        sc[j] = s;
    }
    c->K->softmax(sc, n);
    float *o = c->out + h * c->hd;
    for (int64_t i = 0; i < c->hd; i++) o[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const int64_t off = (kvh * c->n_ctx + c->start + j) * c->hd;
        const float *vr;
        if (c->kv_f16) {
            c->K->f16_to_f32((const uint16_t *)c->v + off, row, c->hd);
            vr = row;
        } else {
            vr = (const float *)c->v + off;
        }
        c->K->axpy(sc[j], vr, o, c->hd);
    }
}

int mr_attention_decode(const float *q, const void *k, const void *v, int kv_f16, long long n_head, long long n_kv,
                        long long n_ctx, long long head_dim, long long n_past, float scale, long long window,
                        float softcap, float *out, int threads, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (n_head <= 0 || n_kv <= 0 || n_head % n_kv || head_dim <= 0 || n_past <= 0 || n_past > n_ctx || window < 0)
        return MR_E_SHAPE;
    att_ctx c = {K, q, k, v, kv_f16, n_head, n_head / n_kv, n_ctx, head_dim, 0, n_past, scale, softcap, out};
    if (window > 0 && n_past > window) c.start = n_past - window;
    /* small problems: threads cost more than they save */
    if ((n_past - c.start) * head_dim * n_head < 65536) threads = 1;
    mr_call_lock();
    const int rc = mr_parallel_for(att_task, NULL, &c, sizeof c, n_head, 0, threads);
    mr_call_unlock();
    return rc;
}
