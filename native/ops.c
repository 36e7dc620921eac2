/* Decoder-step helpers around the matmuls: RMSNorm, RoPE, softmax and single-query attention over
 * a KV cache. Deliberately simple loops (the matmuls dominate a step); inner dots use the ISA's
 * kernels. */
#include "common.h"

#include <stdlib.h>

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

void mr_rope_row(float *v, long long n_rot, const float *cs, const float *sn, int neox) {
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
            mr_rope_row(x + (t * n_heads + h) * head_dim, n_rot, cos_t + t * half, sin_t + t * half, neox);
    return MR_OK;
}

int mr_softmax(float *x, long long rows, long long n, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (rows < 0 || n <= 0) return MR_E_SHAPE;
    for (long long r = 0; r < rows; r++) K->softmax(x + r * n, n);
    return MR_OK;
}

/* Sampler statistics of one row of logits (the kernel: logit_stats in generic_impl.h). One call
 * per sampled token replaces numpy's max, exp, sum and argpartition over the whole vocabulary
 * (~151k entries: 0.3-0.7 ms per token in numpy, a tenth of a 16-stream decode step). */
int mr_logit_stats(const float *x, long long n, int k, float *out_max, double *out_lse, long long *top_idx,
                   float *top_val, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (n <= 0 || k < 0 || k > MR_TOPK_MAX) return MR_E_SHAPE;
    int64_t ti[MR_TOPK_MAX];
    const int cnt = K->logit_stats(x, n, k, out_max, out_lse, ti, top_val, K->vexp);
    for (int j = 0; j < cnt; j++) top_idx[j] = ti[j];
    return cnt;
}

int mr_attention_decode(const float *q, const void *k, const void *v, int type_k, int type_v, long long n_head, long long n_kv,
                        long long n_ctx, long long head_dim, long long n_past, float scale, long long window,
                        float softcap, const float *sinks, float *out, int threads, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (n_head <= 0 || n_kv <= 0 || n_head % n_kv || head_dim <= 0 || n_past <= 0 || n_past > n_ctx || window < 0)
        return MR_E_SHAPE;
    if (mr_kv_row_bytes(type_k, head_dim) < 0 || mr_kv_row_bytes(type_v, head_dim) < 0) return MR_E_QTYPE;
    const int64_t start = window > 0 && n_past > window ? n_past - window : 0, end = n_past, nc = n_ctx;
    mr_call_lock();
    const int rc = mr_attention_decode_batch(K, q, out, 1, &k, &v, &nc, &start, &end, n_head, n_kv, head_dim, type_k,
                                             type_v, scale, softcap, sinks, threads);
    mr_call_unlock();
    return rc;
}

int mr_act_mul(const float *g, const float *u, float *out, long long n, int act, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (n < 0 || act < 0 || act > 2) return MR_E_SHAPE;
    K->act_mul(g, u, out, n, act);
    return MR_OK;
}

/* ---------------------------------------------------------------- causal attention of many queries (prefill) */

#define AP_TILE 256 /* keys per tile: scores, converted keys and values of one tile stay in L2 */

typedef struct {
    const mr_kernels *K;
    const float *q;
    const void *k, *v;
    float *out;
    int64_t n, H, D, Hkv, n_ctx, p0, window, nqb, hpi; /* hpi: query heads per item (of one KV head) */
    int tk, tv;
    float scale, softcap;
} ap_ctx;

/* item = (hpi query heads sharing one KV head, block of 16 queries): queries as SIMD lanes over the
 * keys the block can see, in tiles of AP_TILE keys merged with an online softmax (flash-attention
 * style): memory per item is bounded by the tile, not by the context, and a stored type is converted
 * one tile at a time, once for all the item's heads (with grouped-query attention a KV head serves
 * several query heads: converting per query head cost Gemma3's f16 prefill 6% of its time) */
static void ap_task(const void *c_, int64_t item, int worker, float *buf) {
    (void)buf;
    const ap_ctx *c = (const ap_ctx *)c_;
    const int64_t hg = item / c->nqb, i0 = (item % c->nqb) * 16, D = c->D, G = c->hpi;
    const int64_t h0 = hg * G; /* first query head of the item; all G share KV head kvh */
    const int nq = (int)(c->n - i0 < 16 ? c->n - i0 : 16);
    const int64_t kvh = h0 / (c->H / c->Hkv), pq0 = c->p0 + i0;
    const int64_t lo = c->window > 0 && pq0 - c->window + 1 > 0 ? pq0 - c->window + 1 : 0;
    const int64_t nk = pq0 + nq - lo;
    int64_t first[16], last[16];
    for (int i = 0; i < 16; i++) {
        const int64_t p = pq0 + i;
        first[i] = i < nq ? (c->window > 0 && p - c->window + 1 > lo ? p - c->window + 1 : lo) - lo : 1;
        last[i] = i < nq ? p - lo : 0;
    }
    const int64_t tile = nk < AP_TILE ? nk : AP_TILE;
    /* per head: Qt and Ot (D x 16 each), M and L (16 each); shared: Oc, S, the converted tile, ml */
    float *Qt = (float *)mr_scratch(worker, 2, (size_t)(G * (2 * 16 * D + 32) + 16 * D + 16 * tile + 2 * tile * D + 32) * 4);
    float *Ot = Qt + G * 16 * D, *ML = Ot + G * 16 * D, *Oc = ML + G * 32, *S = Oc + 16 * D, *Kf = S + 16 * tile,
          *Vf = Kf + tile * D, *ml = Vf + tile * D;
    for (int64_t g = 0; g < G; g++) {
        float *qt = Qt + g * 16 * D;
        for (int64_t d = 0; d < D; d++)
            for (int i = 0; i < 16; i++) qt[d * 16 + i] = i < nq ? c->q[((i0 + i) * c->H + h0 + g) * D + d] * c->scale : 0.0f;
        for (int i = 0; i < 16; i++) {
            ML[g * 32 + i] = -INFINITY; /* running max */
            ML[g * 32 + 16 + i] = 0.0f; /* running sum */
        }
    }
    memset(Ot, 0, (size_t)(G * 16 * D) * 4);
    const int64_t rbk = mr_kv_row_bytes(c->tk, D), rbv = mr_kv_row_bytes(c->tv, D);
    const uint8_t *kh = (const uint8_t *)c->k + kvh * c->n_ctx * rbk, *vh = (const uint8_t *)c->v + kvh * c->n_ctx * rbv;
    for (int64_t c0 = 0; c0 < nk; c0 += AP_TILE) {
        const int64_t n = nk - c0 < AP_TILE ? nk - c0 : AP_TILE;
        int64_t f[16], l[16];
        int any = 0, in[16];
        for (int i = 0; i < 16; i++) {
            f[i] = first[i] - c0 > 0 ? first[i] - c0 : 0;
            l[i] = last[i] - c0 < n - 1 ? last[i] - c0 : n - 1;
            in[i] = i < nq && f[i] <= l[i];
            any |= in[i];
            if (!in[i]) {
                f[i] = 1;
                l[i] = 0;
            }
        }
        if (!any) continue;
        const float *Kr = mr_kv_rows(c->K, c->tk, kh, lo + c0, n, D, Kf);
        const float *Vr = mr_kv_rows(c->K, c->tv, vh, lo + c0, n, D, Vf);
        for (int64_t g = 0; g < G; g++) {
            float *ot = Ot + g * 16 * D, *M = ML + g * 32, *L = M + 16;
            c->K->attn_block(Qt + g * 16 * D, Kr, Vr, D, n, f, l, c->softcap, S, Oc, ml, c->K->vexp);
            float a[16], w[16]; /* the weights of the running sums and of the tile's, per query */
            for (int i = 0; i < 16; i++) {
                a[i] = 1.0f;
                w[i] = 0.0f;
                if (!in[i]) continue;
                const float m = ml[i], nm = m > M[i] ? m : M[i];
                a[i] = M[i] == -INFINITY ? 0.0f : expf(M[i] - nm);
                w[i] = expf(m - nm);
                L[i] = L[i] * a[i] + ml[16 + i] * w[i];
                M[i] = nm;
            }
            for (int64_t d = 0; d < D; d++) /* contiguous over the 16 queries: vectorizes (Oc of a query
                                               * not in the tile is not read: it may be anything) */
                for (int i = 0; i < 16; i++) ot[d * 16 + i] = in[i] ? ot[d * 16 + i] * a[i] + Oc[d * 16 + i] * w[i] : ot[d * 16 + i];
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float *ot = Ot + g * 16 * D, *L = ML + g * 32 + 16;
        for (int i = 0; i < nq; i++) {
            float *o = c->out + (i0 + i) * c->H * D + (h0 + g) * D;
            const float inv = L[i] > 0.0f ? 1.0f / L[i] : 0.0f;
            for (int64_t d = 0; d < D; d++) o[d] = ot[d * 16 + i] * inv;
        }
    }
}

/* query heads per item: a whole group when that still leaves every thread several items (converting
 * a tile once per group), else fewer, down to one head per item (short prompts keep both threads busy) */
static int64_t ap_heads_per_item(int64_t H, int64_t Hkv, int64_t nqb, int threads) {
    const int64_t grp = H / Hkv, want = 4 * (int64_t)(threads > 0 ? threads : mr_pool_threads_default());
    int64_t best = 1;
    for (int64_t s = 1; s <= grp; s++)
        if (grp % s == 0 && (H / s) * nqb >= want) best = s;
    return best;
}

int mr_attention_prefill(const float *q, long long n, long long n_head, long long head_dim, const void *k, const void *v,
                         int type_k, int type_v, long long n_kv, long long n_ctx, long long p0, float scale,
                         long long window, float softcap, float *out, int threads, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (n <= 0 || n_head <= 0 || n_kv <= 0 || n_head % n_kv || head_dim <= 0 || p0 < 0 || p0 + n > n_ctx || window < 0)
        return MR_E_SHAPE;
    if (mr_kv_row_bytes(type_k, head_dim) < 0 || mr_kv_row_bytes(type_v, head_dim) < 0) return MR_E_QTYPE;
    const int64_t nqb = (n + 15) / 16, hpi = ap_heads_per_item(n_head, n_kv, nqb, threads);
    const ap_ctx c = {K, q, k, v, out, n, n_head, head_dim, n_kv, n_ctx, p0, window, nqb, hpi, type_k, type_v,
                      scale, softcap};
    mr_call_lock();
    const int rc = mr_parallel_for(ap_task, NULL, &c, sizeof c, n_head / hpi * nqb, 0, threads);
    mr_call_unlock();
    return rc;
}

/* ---------------------------------------------------------------- decode attention (one query per sequence) */

#define AD_MAX_SEQ 16
#define AD_CHUNK 256 /* keys per item: long contexts spread over threads, merged with log-sum-exp */

typedef struct {
    const mr_kernels *K;
    const float *q; /* (B, H, D) */
    float *part;    /* per item: Ot (D x 16) unnormalized, then max (16) and sum (16) */
    int64_t B, H, Hkv, D, groups_per_kv, gsize;
    int tk, tv;
    float scale, softcap;
    const void *k[AD_MAX_SEQ], *v[AD_MAX_SEQ];
    int64_t n_ctx[AD_MAX_SEQ], start[AD_MAX_SEQ], end[AD_MAX_SEQ], item0[AD_MAX_SEQ + 1];
} ad_ctx;

/* item -> (sequence b, lane group of kv head kvh, key chunk); writes the chunk's unnormalized output
 * (lane i = query head) as Ot (D x 16) and per-lane max / sum of exponentials */
static void ad_task(const void *c_, int64_t item, int worker, float *buf) {
    (void)buf;
    const ad_ctx *c = (const ad_ctx *)c_;
    int64_t b = 0;
    while (item >= c->item0[b + 1]) b++;
    const int64_t nchunk = (c->end[b] - c->start[b] + AD_CHUNK - 1) / AD_CHUNK;
    const int64_t r = item - c->item0[b], ch = r % nchunk, grp = r / nchunk;
    const int64_t kvh = grp / c->groups_per_kv, lane0 = (grp % c->groups_per_kv) * 16;
    const int64_t D = c->D, g = c->H / c->Hkv, nl = g - lane0 < 16 ? g - lane0 : 16;
    const int64_t k0 = c->start[b] + ch * AD_CHUNK, nk = c->end[b] - k0 < AD_CHUNK ? c->end[b] - k0 : AD_CHUNK;
    /* an f16 cache goes to attn_dec_h as stored; other types are converted to float rows first */
    const int f16 = c->tk == GT_F16 && c->tv == GT_F16 && c->K->attn_dec_h && D % 64 == 0;
    float *Qt = (float *)mr_scratch(worker, 2, ((size_t)(32 * D + 16 * (nk + 16) + (f16 ? 0 : 2 * nk * D))) * 4);
    float *S = Qt + 16 * D, *Ob = S + 16 * (nk + 16), *Kf = Ob + 16 * D, *Vf = Kf + nk * D;
    const float *qb = c->q + (b * c->H + kvh * g + lane0) * D;
    const int64_t row0 = kvh * c->n_ctx[b] + k0;
    float *P = c->part + item * (16 * D + 32);
    /* the chunk's rows of this KV head, converted from the stored type (a pointer into the cache for f32) */
    const float *Kr = f16 ? NULL : mr_kv_rows(c->K, c->tk, c->k[b], row0, nk, D, Kf);
    const float *Vr = f16 ? NULL : mr_kv_rows(c->K, c->tv, c->v[b], row0, nk, D, Vf);
    if (f16 || (c->K->attn_dec && D % 64 == 0)) { /* head dimension in the lanes */
        for (int64_t i = 0; i < nl; i++)
            for (int64_t d = 0; d < D; d++) Qt[i * D + d] = qb[i * D + d] * c->scale;
        if (f16)
            c->K->attn_dec_h(Qt, (int)nl, (const uint16_t *)c->k[b] + row0 * D, (const uint16_t *)c->v[b] + row0 * D,
                             D, nk, c->softcap, S, Ob, P + 16 * D);
        else c->K->attn_dec(Qt, (int)nl, Kr, Vr, D, nk, c->softcap, S, Ob, P + 16 * D);
        for (int64_t i = 0; i < nl; i++)
            for (int64_t d = 0; d < D; d++) P[d * 16 + i] = Ob[i * D + d];
        return;
    }
    /* per query head: dots, exponentials, weighted sum of value rows (ISAs without attn_dec) */
    for (int64_t i = 0; i < nl; i++) {
        const float *qh = qb + i * D;
        float *sc = S, *o = Ob;
        float m = -INFINITY;
        for (int64_t j = 0; j < nk; j++) {
            float v = c->K->dot(qh, Kr + j * D, D) * c->scale;
            if (c->softcap > 0.0f) v = c->softcap * tanhf(v / c->softcap);
            sc[j] = v;
            m = v > m ? v : m;
        }
        for (int64_t j = 0; j < nk; j++) sc[j] -= m;
        c->K->vexp(sc, nk);
        float l = 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t j = 0; j < nk; j++) {
            l += sc[j];
            c->K->axpy(sc[j], Vr + j * D, o, D);
        }
        for (int64_t d = 0; d < D; d++) P[d * 16 + i] = o[d];
        P[16 * D + i] = m;
        P[16 * D + 16 + i] = l;
    }
}

int mr_attention_fast(int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    return K && K->attn_dec ? 1 : 0;
}

static float *ad_part;
static size_t ad_cap;

/* Attention of one new query per sequence (q (B, H, D), B <= 16) over each sequence's cache
 * (Hkv, n_ctx[b], D) at k[b], v[b], positions [start[b], end[b]); out (B, H * D). The query heads
 * of a KV head are SIMD lanes; keys come in chunks of AD_CHUNK, one work item each, merged here
 * (sinks (H) or NULL: a logit per head added to the merged denominator only). Caller holds the call lock. */
int mr_attention_decode_batch(const mr_kernels *K, const float *q, float *out, int64_t B, const void *const *k,
                              const void *const *v, const int64_t *n_ctx, const int64_t *start, const int64_t *end,
                              int64_t H, int64_t Hkv, int64_t D, int type_k, int type_v, float scale, float softcap,
                              const float *sinks, int threads) {
    if (B <= 0 || B > AD_MAX_SEQ || H % Hkv) return MR_E_SHAPE;
    if (mr_kv_row_bytes(type_k, D) < 0 || mr_kv_row_bytes(type_v, D) < 0) return MR_E_QTYPE;
    ad_ctx c;
    memset(&c, 0, sizeof c);
    c.K = K;
    c.q = q;
    c.B = B;
    c.H = H;
    c.Hkv = Hkv;
    c.D = D;
    c.gsize = H / Hkv;
    c.groups_per_kv = (c.gsize + 15) / 16;
    c.tk = type_k;
    c.tv = type_v;
    c.scale = scale;
    c.softcap = softcap;
    int64_t items = 0, work = 0;
    for (int64_t b = 0; b < B; b++) {
        if (end[b] <= start[b] || end[b] > n_ctx[b]) return MR_E_SHAPE;
        c.k[b] = k[b];
        c.v[b] = v[b];
        c.n_ctx[b] = n_ctx[b];
        c.start[b] = start[b];
        c.end[b] = end[b];
        c.item0[b] = items;
        items += Hkv * c.groups_per_kv * ((end[b] - start[b] + AD_CHUNK - 1) / AD_CHUNK);
        work += (end[b] - start[b]) * H * D;
    }
    c.item0[B] = items;
    const size_t need = (size_t)(items * (16 * D + 32));
    if (need > ad_cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, need * 2 * 4) != 0) return MR_E_NOMEM;
        mr_defer_free(ad_part);
        ad_part = (float *)p;
        ad_cap = need * 2;
    }
    c.part = ad_part;
    /* short contexts: one thread does it faster than a hand-off */
    const int rc = mr_parallel_for(ad_task, NULL, &c, sizeof c, items, 0, work < 65536 ? 1 : threads);
    if (rc != MR_OK) return rc;
    /* merge the chunks of each (sequence, lane group) */
    for (int64_t b = 0; b < B; b++) {
        const int64_t nchunk = (end[b] - start[b] + AD_CHUNK - 1) / AD_CHUNK;
        for (int64_t grp = 0; grp < Hkv * c.groups_per_kv; grp++) {
            const int64_t kvh = grp / c.groups_per_kv, lane0 = (grp % c.groups_per_kv) * 16;
            const int64_t nl = c.gsize - lane0 < 16 ? c.gsize - lane0 : 16;
            const float *P0 = c.part + (c.item0[b] + grp * nchunk) * (16 * D + 32);
            for (int64_t i = 0; i < nl; i++) {
                float M = -INFINITY;
                for (int64_t ch = 0; ch < nchunk; ch++) {
                    const float m = P0[ch * (16 * D + 32) + 16 * D + i];
                    M = m > M ? m : M;
                }
                float L = 0.0f, wgt[64];
                float *o = out + (b * H + kvh * c.gsize + lane0 + i) * D;
                for (int64_t ch = 0; ch < nchunk; ch++) {
                    const float *Pc = P0 + ch * (16 * D + 32);
                    const float w = nchunk == 1 ? 1.0f : expf(Pc[16 * D + i] - M);
                    if (ch < 64) wgt[ch] = w;
                    L += w * Pc[16 * D + 16 + i];
                }
                if (sinks) /* scores and sink in one softmax: exp(sink - M) joins the denominator (overflow: out 0) */
                    L += expf(sinks[kvh * c.gsize + lane0 + i] - M);
                const float inv = L > 0.0f ? 1.0f / L : 0.0f;
                for (int64_t d = 0; d < D; d++) {
                    float a = 0.0f;
                    for (int64_t ch = 0; ch < nchunk; ch++) {
                        const float *Pc = P0 + ch * (16 * D + 32);
                        const float w = ch < 64 ? wgt[ch] : expf(Pc[16 * D + i] - M);
                        a += w * Pc[d * 16 + i];
                    }
                    o[d] = a * inv;
                }
            }
        }
    }
    return MR_OK;
}

/* ---------------------------------------------------------------- gated delta rule (Qwen3.5's linear attention) */

typedef struct {
    const mr_kernels *K;
    const float *q, *k, *v, *decay, *beta;
    float *S, *o;
    int64_t n, H, Dk, Dv;
} dr_ctx;

/* item = one value head: its state S_h (Dk x Dv, row i = key dimension i) stays in L1/L2 over the n
 * tokens; two passes over it per token (decay + S^T k, then the rank-1 update + S^T q) */
static void dr_task(const void *c_, int64_t h, int worker, float *buf) {
    (void)worker;
    (void)buf;
    const dr_ctx *c = (const dr_ctx *)c_;
    const int64_t H = c->H, Dk = c->Dk, Dv = c->Dv;
    float *S = c->S + h * Dk * Dv;
    float kv[MR_DR_MAX_DV], delta[MR_DR_MAX_DV];
    for (int64_t t = 0; t < c->n; t++) {
        const float *q = c->q + (t * H + h) * Dk, *k = c->k + (t * H + h) * Dk, *v = c->v + (t * H + h) * Dv;
        const float d = c->decay[t * H + h], b = c->beta[t * H + h];
        c->K->delta_step(S, q, k, v, d, b, c->o + (t * H + h) * Dv, Dk, Dv, kv, delta);
    }
}

int mr_delta_rule(float *S, const float *q, const float *k, const float *v, const float *decay, const float *beta,
                  float *o, long long n, long long n_head, long long dk, long long dv, int threads) {
    if (n < 0 || n_head <= 0 || dk <= 0 || dv <= 0 || dv > MR_DR_MAX_DV) return MR_E_SHAPE;
    if (n == 0) return MR_OK;
    const mr_kernels *K = mr_get_kernels(-1);
    if (!K) return MR_E_ISA;
    const dr_ctx c = {K, q, k, v, decay, beta, S, o, n, n_head, dk, dv};
    mr_call_lock();
    const int rc = mr_parallel_for(dr_task, NULL, &c, sizeof c, n_head, 0, threads);
    mr_call_unlock();
    return rc;
}

/* ---------------------------------------------------------------- causal depthwise convolution */

typedef struct {
    const float *rows, *w_t, *bias;
    float *out;
    int64_t n, c, taps;
} cconv_ctx;

enum { CCONV_CHUNK = 256 }; /* channels per work item: the inner loops run over contiguous channels */

static void cconv_task(const void *c_, int64_t item, int worker, float *buf) {
    (void)worker;
    (void)buf;
    const cconv_ctx *c = (const cconv_ctx *)c_;
    const int64_t C = c->c, c0 = item * CCONV_CHUNK, c1 = c0 + CCONV_CHUNK < C ? c0 + CCONV_CHUNK : C;
    for (int64_t t = 0; t < c->n; t++) {
        float *o = c->out + t * C;
        for (int64_t k = c0; k < c1; k++) o[k] = c->bias ? c->bias[k] : 0.0f;
        for (int64_t j = 0; j < c->taps; j++) {
            const float *r = c->rows + (t + j) * C, *w = c->w_t + j * C;
            for (int64_t k = c0; k < c1; k++) o[k] += r[k] * w[k];
        }
    }
}

int mr_causal_conv(const float *rows, const float *w_t, const float *bias, float *out, long long n, long long c,
                   long long taps, int threads) {
    if (n < 0 || c <= 0 || taps <= 0) return MR_E_SHAPE;
    if (n == 0) return MR_OK;
    const cconv_ctx x = {rows, w_t, bias, out, n, c, taps};
    mr_call_lock();
    const int rc = mr_parallel_for(cconv_task, NULL, &x, sizeof x, (c + CCONV_CHUNK - 1) / CCONV_CHUNK, 0, threads);
    mr_call_unlock();
    return rc;
}

/* ---------------------------------------------------------------- Mamba-2 selective scan */

typedef struct {
    const mr_kernels *K;
    const float *x, *dt, *a, *B, *C;
    float *S, *y;
    int64_t n, H, P, N, G;
} ssm_ctx;

/* item = one head: its state S_h (P x N, row p = head dimension p) stays in L1/L2 over the n tokens; one
 * pass over it per token (decay, rank-1 update and the dot with C fused per row, K->ssm_rows) */
static void ssm_task(const void *c_, int64_t h, int worker, float *buf) {
    (void)worker;
    (void)buf;
    const ssm_ctx *c = (const ssm_ctx *)c_;
    const int64_t H = c->H, P = c->P, N = c->N, G = c->G, g = h / (H / G);
    float *S = c->S + h * P * N;
    const float ah = c->a[h];
    for (int64_t t = 0; t < c->n; t++) {
        const float dt = c->dt[t * H + h];
        c->K->ssm_rows(S, c->x + (t * H + h) * P, c->B + (t * G + g) * N, c->C + (t * G + g) * N, expf(dt * ah), dt,
                       P, N, c->y + (t * H + h) * P);
    }
}

int mr_ssm_scan(float *S, const float *x, const float *dt, const float *a, const float *B, const float *C, float *y,
                long long n, long long n_head, long long head_dim, long long d_state, long long n_group, int threads,
                int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (n < 0 || n_head <= 0 || head_dim <= 0 || d_state <= 0 || n_group <= 0 || n_head % n_group) return MR_E_SHAPE;
    if (n == 0) return MR_OK;
    const ssm_ctx c = {K, x, dt, a, B, C, S, y, n, n_head, head_dim, d_state, n_group};
    mr_call_lock();
    const int rc = mr_parallel_for(ssm_task, NULL, &c, sizeof c, n_head, 0, threads);
    mr_call_unlock();
    return rc;
}
