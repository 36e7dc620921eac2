/* Routed experts of a mixture-of-experts feed-forward (see mr_moe_experts in api.h).
 *
 * The router runs before (the caller passes each token's chosen experts and weights). Here the
 * tokens are grouped by expert and each chosen expert runs once, over all the tokens that chose it:
 *   xe = x[rows of e]                      (cnt, n_embd)  gathered
 *   a  = act(Wg_e xe + bg) * (Wu_e xe + bu) (cnt, n_ff)    two matmuls (mr_matmul / mr_matmul_packed)
 *   ye = Wd_e a + bd                       (cnt, n_embd)  one matmul
 *   out[t] += w[t, j] * ye[t]              scattered
 * Expert e's weights are its rows of the 3-D GGUF tensor (or their packed copy), so only the
 * chosen experts' bytes are read. The matmuls are the library's own (same results as a per-op
 * forward); this file knows no architecture. */
#include "common.h"

#include <stdlib.h>

static int moe_mm(const mr_weight *W, const float *x, int64_t n, float *y, int threads, int isa) {
    int rc;
    if (W->packed)
        rc = mr_matmul_packed(W->qtype, W->data, W->rows, W->cols, x, n, W->cols, y, W->rows, threads, isa);
    else
        rc = mr_matmul(W->qtype, W->data, W->rows, W->cols, W->row_bytes, x, n, W->cols, y, W->rows, threads, isa);
    if (rc >= 0 && W->bias)
        for (int64_t t = 0; t < n; t++)
            for (int64_t r = 0; r < W->rows; r++) y[t * W->rows + r] += W->bias[r];
    return rc;
}

int mr_moe_experts(const mr_weight *gate, const mr_weight *up, const mr_weight *down, long long n_expert,
                   const float *x, long long n_tok, long long n_embd, const long long *ids, const float *w,
                   long long n_used, int act, float alpha, float limit, float *out, int threads, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (n_expert <= 0 || n_tok < 0 || n_embd <= 0 || n_used <= 0 || act < 0 || act > 4 || act == 2) return MR_E_SHAPE;
    if (act == 4 && gate) return MR_E_SHAPE; /* squared ReLU: ungated experts only */
    int64_t ff = 0;
    for (long long e = 0; e < n_expert; e++) {
        const int64_t F = up[e].rows;
        if (up[e].cols != n_embd || down[e].rows != n_embd || down[e].cols != F || !up[e].data || !down[e].data)
            return MR_E_SHAPE;
        if (gate && (gate[e].rows != F || gate[e].cols != n_embd || !gate[e].data)) return MR_E_SHAPE;
        if (F > ff) ff = F;
    }
    for (long long i = 0; i < n_tok * n_used; i++)
        if (ids[i] < 0 || ids[i] >= n_expert) return MR_E_SHAPE;
    memset(out, 0, (size_t)(n_tok * n_embd) * 4);
    if (n_tok == 0) return MR_OK;
    /* counting sort of the (token, choice) pairs by expert */
    const int64_t np = n_tok * n_used;
    int64_t *start = (int64_t *)calloc((size_t)n_expert + 1, sizeof(int64_t));
    int64_t *pair = (int64_t *)malloc((size_t)np * sizeof(int64_t));
    int64_t cmax = 0;
    if (!start || !pair) {
        free(start);
        free(pair);
        return MR_E_NOMEM;
    }
    for (int64_t i = 0; i < np; i++) start[ids[i] + 1]++;
    for (long long e = 0; e < n_expert; e++) {
        if (start[e + 1] > cmax) cmax = start[e + 1];
        start[e + 1] += start[e];
    }
    {
        int64_t *fill = (int64_t *)malloc((size_t)n_expert * sizeof(int64_t));
        if (!fill) {
            free(start);
            free(pair);
            return MR_E_NOMEM;
        }
        memcpy(fill, start, (size_t)n_expert * sizeof(int64_t));
        for (int64_t i = 0; i < np; i++) pair[fill[ids[i]]++] = i; /* token order within each expert */
        free(fill);
    }
    /* scratch: xe, ye (cmax, n_embd); g, u (cmax, ff) */
    float *buf = (float *)malloc((size_t)(cmax * (2 * n_embd + 2 * ff)) * 4);
    if (!buf) {
        free(start);
        free(pair);
        return MR_E_NOMEM;
    }
    float *xe = buf, *ye = xe + cmax * n_embd, *g = ye + cmax * n_embd, *u = g + cmax * ff;
    int rc = MR_OK;
    long long steals = 0;
    for (long long e = 0; e < n_expert && rc >= 0; e++) {
        const int64_t n = start[e + 1] - start[e];
        if (!n) continue; /* an expert no token chose: its bytes are not touched */
        const int64_t *pe = pair + start[e], F = up[e].rows;
        for (int64_t i = 0; i < n; i++) memcpy(xe + i * n_embd, x + (pe[i] / n_used) * n_embd, (size_t)n_embd * 4);
        rc = moe_mm(&up[e], xe, n, u, threads, isa);
        if (rc < 0) break;
        steals += rc;
        if (gate) {
            rc = moe_mm(&gate[e], xe, n, g, threads, isa);
            if (rc < 0) break;
            steals += rc;
            if (act == 3) mr_swiglu_oai(g, u, n * F, alpha, limit);
            else K->act_mul(g, u, g, n * F, act);
        } else {
            mr_expert_act(K, u, g, n * F, act);
        }
        rc = moe_mm(&down[e], g, n, ye, threads, isa);
        if (rc < 0) break;
        steals += rc;
        for (int64_t i = 0; i < n; i++) {
            const float wt = w[pe[i]];
            float *o = out + (pe[i] / n_used) * n_embd;
            const float *y = ye + i * n_embd;
            for (int64_t c = 0; c < n_embd; c++) o[c] += wt * y[c];
        }
    }
    /* xe and g are inputs of matmul jobs a late worker may still be in */
    mr_call_lock();
    mr_defer_free(buf);
    mr_call_unlock();
    free(start);
    free(pair);
    if (rc < 0) return rc;
    return steals > 1000000 ? 1000000 : (int)steals;
}
