/* Decoder layers for decode steps (one new token per sequence), natively: the whole stack in one
 * call, so a step costs a few thread hand-offs per layer instead of a dozen Python round trips.
 *
 * Per layer, as the block description says (minirt/blocks.py; this file knows no architecture):
 *   h = [norm](x) ; q, k, v = Wq h, Wk h, Wv h (+ bias)         one parallel job for the three
 *   [q, k rmsnorm per head or whole] ; [RoPE] ; k, v -> cache    caller thread (small)
 *   attention over each sequence's cache                        one parallel job (sequence x head)
 *   o = Wo att (+ bias) [post-norm] ; x += s * o                 one parallel job
 *   h = [norm](x) ; a = act(Wg h) * (Wu h)                       one parallel job (gate and up rows together)
 *   d = Wd a [post-norm] ; x += s * d                            one parallel job
 * A parallel block (Cohere) feeds the MLP the attention's h and adds both outputs at once.
 * The matrix products are the integer kernels of mr_matmul / mr_matmul_packed (same activation
 * quantization, same results); the elementwise steps are the ones of the Python forward pass. */
#include "common.h"

#include <math.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- multi-matrix jobs */

typedef struct {
    mr_mat m;
    mr_xact xa;
    int fl; /* float weights (F32 / F16 / BF16): rows dequantized and dotted with the float x */
    const float *bias;
    float *y; /* (nt, ys) */
    int64_t ys, chunk, item0, nitems;
} mj_mat;

typedef struct {
    const mr_kernels *K;
    int nm;
    int act; /* >= 0: mm[0] = gate, mm[1] = up over the same rows; y of mm[0] receives act(g) * u */
    int64_t nt;
    const float *x; /* (nt, cols) the float activations, for float weights */
    mj_mat mm[8]; /* up to 8 matrices of one input (the delta-net's 4, the gate / up of 4 chosen experts) */
} mj_ctx;
_Static_assert(sizeof(mj_ctx) <= 2048, "mj_ctx must fit the pool's copied job context");

/* Weights without an integer kernel that the stack still runs: the float types, as the per-op float
 * row-dot path of mr_matmul runs them for a few tokens (same dequantization, same dot_f32). */
static int float_weight(const mr_kernels *K, const mr_mat *m) {
    return !m->packed && (m->qtype == GT_F32 || m->qtype == GT_F16 || m->qtype == GT_BF16) && K->dq[m->qtype] &&
           m->rb >= m->cols * mr_types[m->qtype].bytes;
}

/* rows r0..r1 of a float-weight matrix for nt tokens of x (stride = cols) into out (nt, r1 - r0) */
static void float_rows(const mr_kernels *K, const mr_mat *m, const float *x, int64_t nt, int64_t r0, int64_t r1,
                       float *out, float *rowbuf) {
    const int64_t n = r1 - r0;
    float o[MR_NT_INT];
    for (int64_t r = r0; r < r1; r++) {
        const float *wf = (const float *)(const void *)(m->w + r * m->rb);
        if (m->qtype != GT_F32) {
            K->dq[m->qtype](m->w + r * m->rb, rowbuf, m->cols);
            wf = rowbuf;
        }
        for (int64_t t0 = 0; t0 < nt; t0 += MR_NT_INT) {
            const int k = (int)(nt - t0 < MR_NT_INT ? nt - t0 : MR_NT_INT);
            K->dot_f32(wf, x + t0 * m->cols, m->cols, m->cols, k, o);
            for (int t = 0; t < k; t++) out[(t0 + t) * n + (r - r0)] = o[t];
        }
    }
}

static const mj_mat *mj_find(const mj_ctx *c, int64_t item, int64_t *r0, int64_t *r1) {
    int i = 0;
    while (i + 1 < c->nm && item >= c->mm[i + 1].item0) i++;
    const mj_mat *M = &c->mm[i];
    *r0 = (item - M->item0) * M->chunk;
    *r1 = *r0 + M->chunk < M->m.rows ? *r0 + M->chunk : M->m.rows;
    return M;
}

static void mj_commit(const void *c_, int64_t item, const float *buf) {
    const mj_ctx *c = (const mj_ctx *)c_;
    int64_t r0, r1;
    const mj_mat *M = mj_find(c, item, &r0, &r1);
    const int64_t n = r1 - r0;
    for (int64_t t = 0; t < c->nt; t++) {
        float *y = M->y + t * M->ys + r0;
        if (c->act >= 0) {
            c->K->act_mul(buf + t * n, buf + (c->nt + t) * n, y, n, c->act);
        } else if (M->bias) {
            for (int64_t r = 0; r < n; r++) y[r] = buf[t * n + r] + M->bias[r0 + r];
        } else {
            memcpy(y, buf + t * n, (size_t)n * 4);
        }
    }
}

static void mj_task(const void *c_, int64_t item, int worker, float *buf) {
    const mj_ctx *c = (const mj_ctx *)c_;
    int64_t r0, r1;
    const mj_mat *M = mj_find(c, item, &r0, &r1);
    const int64_t n = r1 - r0;
    float *out = buf ? buf : (float *)mr_scratch(worker, 4, (size_t)(n * c->nt * 2) * 4);
    float *rowbuf = NULL;
    if (M->fl || (c->act >= 0 && c->mm[1].fl)) rowbuf = (float *)mr_scratch(worker, 0, (size_t)M->m.cols * 4); /* slot 0: the per-op row dots, not running now */
    for (int j = 0; j < (c->act >= 0 ? 2 : 1); j++) {
        const mj_mat *Mj = j ? &c->mm[1] : M;
        if (Mj->fl) float_rows(c->K, &Mj->m, c->x, c->nt, r0, r1, out + j * c->nt * n, rowbuf);
        else mr_mat_rows(c->K, &Mj->m, &Mj->xa, c->nt, r0, r1, out + j * c->nt * n, n, worker);
    }
    if (!buf) mj_commit(c_, item, out);
}

static mr_mat weight_mat(const mr_weight *w) {
    mr_mat m = {w->qtype, w->packed, w->data, w->rows, w->cols, w->row_bytes, 0, 0};
    if (w->packed) {
        m.tb = mr_pack_tile_bytes(w->qtype);
        m.ntiles = w->cols / mr_pack_tile_cols(w->qtype);
    }
    return m;
}

/* MR_OK when w holds a rows x cols matrix the stack can multiply (integer kernel or float rows), else MR_E_QTYPE */
static int mat_ok(const mr_kernels *K, const mr_weight *w, int64_t rows, int64_t cols) {
    const mr_mat m = weight_mat(w);
    if (!w->data || w->rows != rows || w->cols != cols) return MR_E_QTYPE;
    return mr_mat_xlayout(K, &m) || float_weight(K, &m) ? MR_OK : MR_E_QTYPE;
}

/* y_i = W_i x (+ bias_i) for the n weights (same input x: nt rows of cols); act >= 0: n == 2 and
 * y_0 = act(W_0 x) * (W_1 x). One parallel job; caller holds the call lock. */
static int run_mats(const mr_kernels *K, const mr_weight *const *w, float *const *y, int n, int act, const float *x,
                    int64_t nt, int threads) {
    mj_ctx c;
    memset(&c, 0, sizeof c);
    c.K = K;
    c.nm = act >= 0 ? 1 : n;
    c.act = act;
    c.nt = nt;
    c.x = x;
    int layouts = 0, any_int = 0;
    mr_mat mats[8];
    if (n < 1 || n > 8) return MR_E_SHAPE;
    for (int i = 0; i < n; i++) {
        mats[i] = weight_mat(w[i]);
        /* a matrix on the GEMM needs only the panel (quantizing its layout too would be wasted) */
        layouts |= mr_mat_gemm(K, &mats[i], nt) ? MR_XL_PANEL : mr_mat_xlayout(K, &mats[i]);
        any_int |= !float_weight(K, &mats[i]);
    }
    mr_xacts xs;
    memset(&xs, 0, sizeof xs);
    if (any_int) { /* activations quantized once for the integer kernels */
        const int rc = mr_prepare_x(K, x, nt, w[0]->cols, w[0]->cols, layouts, &xs);
        if (rc != MR_OK) return rc;
    }
    int64_t items = 0, bufn = 0;
    for (int i = 0; i < n; i++) {
        mj_mat *M = &c.mm[i];
        M->m = mats[i];
        M->fl = float_weight(K, &mats[i]);
        M->xa = *mr_xact_for(&xs, mr_mat_xlayout(K, &mats[i]));
        M->bias = w[i]->bias;
        M->y = y[i];
        M->ys = w[i]->rows;
        M->chunk = mr_pick_chunk(w[i]->rows, mr_mat_row_bytes(&mats[i]), nt, threads, 8, 256);
        M->item0 = items;
        M->nitems = (w[i]->rows + M->chunk - 1) / M->chunk;
        if (act < 0 || i == 0) items += M->nitems;
        const int64_t b = M->chunk * nt * (act >= 0 ? 2 : 1);
        if (b > bufn) bufn = b;
    }
    if (act >= 0) c.mm[1].chunk = c.mm[0].chunk;
    return mr_parallel_for(mj_task, mj_commit, &c, sizeof c, items, bufn, threads);
}

/* ---------------------------------------------------------------- the layer stack */

/* Optional phase timing of mr_decode_layers (mr_profile_enable): ns per phase, summed over layers. */
#include <time.h>
static int prof_on;
static double prof_ns[MR_PROF_PHASES];
static double prof_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}
#define PROF(i)                                                                                              \
    do {                                                                                                       \
        if (prof_on) {                                                                                         \
            const double t_ = prof_now();                                                                      \
            prof_ns[i] += t_ - prof_t;                                                                         \
            prof_t = t_;                                                                                       \
        }                                                                                                      \
    } while (0)

void mr_profile_enable(int on) { prof_on = on; }

int mr_profile_read(double *out, int n, int reset) {
    if (n > MR_PROF_PHASES) n = MR_PROF_PHASES;
    for (int i = 0; i < n; i++) out[i] = prof_ns[i];
    if (reset) memset(prof_ns, 0, sizeof prof_ns);
    return MR_PROF_PHASES;
}

static float *lbuf;
static size_t lbuf_cap;

/* 0 when the layer stack can run mixture M on n_embd d with scratch for n_ff (>= every expert's width) */
static int moe_check(const mr_kernels *K, const mr_moe *M, int64_t d, int64_t n_ff) {
    const int64_t E = M->n_expert;
    if (E <= 0 || M->n_used <= 0 || M->n_used > E || M->gating < 0 || M->gating > 2 || !M->up || !M->down ||
        (M->norm_topk != 0 && M->norm_topk != 1) || !(M->scale == M->scale))
        return MR_E_SHAPE;
    if (M->act != 0 && M->act != 1 && M->act != 3 && M->act != 4) return MR_E_SHAPE;
    if ((M->act == 4 && M->gate) || (M->act == 3 && !M->gate)) return MR_E_SHAPE;
    if (mat_ok(K, &M->router, E, d) != MR_OK) return MR_E_QTYPE;
    for (int64_t e = 0; e < E; e++) {
        const int64_t F = M->up[e].rows;
        if (F <= 0 || F > n_ff) return MR_E_SHAPE;
        if ((M->gate && mat_ok(K, &M->gate[e], F, d) != MR_OK) || mat_ok(K, &M->up[e], F, d) != MR_OK ||
            mat_ok(K, &M->down[e], d, F) != MR_OK)
            return MR_E_QTYPE;
    }
    if (M->sh_up.data) {
        const int64_t F = M->sh_up.rows;
        if (F <= 0 || F > n_ff || (M->sh_act != 0 && M->sh_act != 1 && M->sh_act != 4) ||
            (M->sh_act == 4 && M->sh_gate.data))
            return MR_E_SHAPE;
        if ((M->sh_gate.data && mat_ok(K, &M->sh_gate, F, d) != MR_OK) || mat_ok(K, &M->sh_up, F, d) != MR_OK ||
            mat_ok(K, &M->sh_down, d, F) != MR_OK)
            return MR_E_QTYPE;
    }
    if (M->sh_inp.data && (!M->sh_up.data || mat_ok(K, &M->sh_inp, 1, d) != MR_OK)) return MR_E_QTYPE;
    return MR_OK;
}

/* One token's routing (as blocks.route): the n_used experts of largest probability + sel_bias (ties: lower id
 * first) into ids, their weights into w. p: scratch of n_expert floats. */
static void moe_route(const mr_moe *M, const float *logits, int64_t *ids, float *w, float *p) {
    const int64_t E = M->n_expert, k = M->n_used;
    if (M->gating == 1) {
        for (int64_t e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-logits[e]));
    } else if (M->gating == 0) {
        float mx = logits[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(logits[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
    } else {
        for (int64_t e = 0; e < E; e++) p[e] = logits[e];
    }
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        float bs = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (taken) continue;
            const float s = M->sel_bias ? p[e] + M->sel_bias[e] : p[e];
            if (best < 0 || s > bs) best = e, bs = s;
        }
        ids[j] = best;
        w[j] = p[best];
    }
    if (M->gating == 2) { /* softmax among the chosen */
        float mx = w[0], sum = 0.0f;
        for (int64_t j = 1; j < k; j++) mx = w[j] > mx ? w[j] : mx;
        for (int64_t j = 0; j < k; j++) sum += w[j] = expf(w[j] - mx);
        for (int64_t j = 0; j < k; j++) w[j] /= sum;
    }
    if (M->norm_topk) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) sum += w[j];
        sum = sum > 6.103515625e-5f ? sum : 6.103515625e-5f; /* as llama.cpp: f16's min normal */
        for (int64_t j = 0; j < k; j++) w[j] /= sum;
    }
    if (M->scale != 1.0f)
        for (int64_t j = 0; j < k; j++) w[j] *= M->scale;
}

/* A gated expert's activation in place in g: act(g) * u, or gpt-oss' clamped SwiGLU (act 3) */
static void gated_act(const mr_kernels *K, const mr_moe *M, float *g, const float *u, int64_t n) {
    if (M->act == 3) mr_swiglu_oai(g, u, n, M->alpha, M->limit);
    else K->act_mul(g, u, g, n, M->act);
}

/* Expert e's down projection of its n activation rows a (n x F) into ye (n x d), then out[tok[i]] += wt[i] ye[i] */
static int expert_down(const mr_kernels *K, const mr_moe *M, int64_t e, const float *a, int64_t n, const int64_t *tok,
                       const float *wt, float *ye, float *out, int64_t d, int threads) {
    const mr_weight *ws[1] = {&M->down[e]};
    float *ys[1] = {ye};
    const int rc = run_mats(K, ws, ys, 1, -1, a, n, threads);
    for (int64_t i = 0; i < n && rc == MR_OK; i++)
        for (int64_t c = 0; c < d; c++) out[tok[i] * d + c] += wt[i] * ye[i * d + c];
    return rc;
}

/* The widest expert or shared expert of M */
static int64_t moe_width(const mr_moe *M) {
    int64_t f = M->sh_up.data ? M->sh_up.rows : 0;
    for (int64_t e = 0; e < M->n_expert; e++) f = M->up[e].rows > f ? M->up[e].rows : f;
    return f;
}

/* The mixture of experts of B tokens h (B x d) into out (B x d): router (reading hr, B x d), routing, each
 * chosen expert once over the tokens that chose it (gathered; expert order, as the per-op path), then the
 * shared expert. n_ff >= moe_width(M). */
static int moe_ffn(const mr_kernels *K, const mr_moe *M, const float *h, const float *hr, float *out, int64_t B,
                   int64_t d, int64_t n_ff, int threads) {
    const int64_t E = M->n_expert, k = M->n_used;
    float *buf = (float *)malloc((size_t)(B * E + E + B * k + 2 * B * d + 2 * B * n_ff + B + 8 * n_ff) * 4);
    int64_t *ids = (int64_t *)malloc((size_t)(B * k) * sizeof(int64_t));
    if (!buf || !ids) {
        free(buf);
        free(ids);
        return MR_E_NOMEM;
    }
    float *logits = buf, *p = logits + B * E, *w = p + E, *xe = w + B * k, *ye = xe + B * d, *g = ye + B * d,
          *u = g + B * n_ff, *sg = u + B * n_ff;
    int64_t tok[MR_PACKED_INT_MAX];
    float wt[MR_PACKED_INT_MAX];
    int rc;
    {
        const mr_weight *ws[1] = {&M->router};
        float *ys[1] = {logits};
        rc = run_mats(K, ws, ys, 1, -1, hr, B, threads);
    }
    for (int64_t b = 0; b < B && rc == MR_OK; b++) moe_route(M, logits + b * E, ids + b * k, w + b * k, p);
    if (M->expert_scale)
        for (int64_t i = 0; i < B * k; i++) w[i] *= M->expert_scale[ids[i]];
    memset(out, 0, (size_t)(B * d) * 4);
    if (rc == MR_OK && B == 1 && M->gate && k <= 4) { /* one token: all its experts' gate / up in one job */
        const mr_weight *ws[8];
        float *ys[8], *gu = sg + B; /* k pairs of n_ff floats */
        int64_t order[4];
        for (int64_t j = 0; j < k; j++) order[j] = j;
        for (int64_t a = 1; a < k; a++) /* by expert id: the order the loop below and the per-op path sum them */
            for (int64_t j = a; j > 0 && ids[order[j - 1]] > ids[order[j]]; j--) {
                const int64_t t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
        for (int64_t j = 0; j < k; j++) {
            ws[2 * j] = &M->gate[ids[order[j]]];
            ws[2 * j + 1] = &M->up[ids[order[j]]];
            ys[2 * j] = gu + 2 * j * n_ff;
            ys[2 * j + 1] = gu + (2 * j + 1) * n_ff;
        }
        rc = run_mats(K, ws, ys, (int)(2 * k), -1, h, 1, threads);
        for (int64_t j = 0; j < k && rc == MR_OK; j++) {
            const int64_t e = ids[order[j]], tok0 = 0;
            const float wj = w[order[j]];
            gated_act(K, M, ys[2 * j], ys[2 * j + 1], M->up[e].rows);
            rc = expert_down(K, M, e, ys[2 * j], 1, &tok0, &wj, ye, out, d, threads);
        }
    } else {
        for (int64_t e = 0; e < E && rc == MR_OK; e++) {
            int64_t n = 0;
            for (int64_t i = 0; i < B * k; i++)
                if (ids[i] == e) {
                    tok[n] = i / k;
                    wt[n] = w[i];
                    memcpy(xe + n * d, h + (i / k) * d, (size_t)d * 4);
                    n++;
                }
            if (!n) continue; /* an expert no token chose: its bytes are not touched */
            const int64_t F = M->up[e].rows;
            if (M->gate && M->act != 3) { /* a = act(Wg x) * (Wu x), one job */
                const mr_weight *ws[2] = {&M->gate[e], &M->up[e]};
                float *ys[2] = {g, g};
                rc = run_mats(K, ws, ys, 2, M->act, xe, n, threads);
            } else if (M->gate) { /* clamped SwiGLU */
                const mr_weight *ws[2] = {&M->gate[e], &M->up[e]};
                float *ys[2] = {g, u};
                rc = run_mats(K, ws, ys, 2, -1, xe, n, threads);
                if (rc == MR_OK) gated_act(K, M, g, u, n * F);
            } else {
                const mr_weight *ws[1] = {&M->up[e]};
                float *ys[1] = {u};
                rc = run_mats(K, ws, ys, 1, -1, xe, n, threads);
                if (rc == MR_OK) mr_expert_act(K, u, g, n * F, M->act);
            }
            if (rc == MR_OK) rc = expert_down(K, M, e, g, n, tok, wt, ye, out, d, threads);
        }
    }
    if (rc == MR_OK && M->sh_up.data) { /* the shared expert: out += [sigmoid(sh_inp h)] down(act(gate h) * up h) */
        const int64_t F = M->sh_up.rows;
        if (M->sh_gate.data) {
            const mr_weight *ws[2] = {&M->sh_gate, &M->sh_up};
            float *ys[2] = {g, g};
            rc = run_mats(K, ws, ys, 2, M->sh_act, h, B, threads);
        } else {
            const mr_weight *ws[1] = {&M->sh_up};
            float *ys[1] = {u};
            rc = run_mats(K, ws, ys, 1, -1, h, B, threads);
            if (rc == MR_OK) mr_expert_act(K, u, g, B * F, M->sh_act);
        }
        if (rc == MR_OK) {
            const mr_weight *ws[1] = {&M->sh_down};
            float *ys[1] = {ye};
            rc = run_mats(K, ws, ys, 1, -1, g, B, threads);
        }
        if (rc == MR_OK && M->sh_inp.data) {
            const mr_weight *ws[1] = {&M->sh_inp};
            float *ys[1] = {sg};
            rc = run_mats(K, ws, ys, 1, -1, h, B, threads);
            for (int64_t b = 0; b < B && rc == MR_OK; b++) {
                const float s = 1.0f / (1.0f + expf(-sg[b]));
                for (int64_t c = 0; c < d; c++) ye[b * d + c] *= s;
            }
        }
        for (int64_t i = 0; i < B * d && rc == MR_OK; i++) out[i] += ye[i];
    }
    mr_defer_free(buf); /* xe, g, ...: inputs of jobs a late worker may still be in */
    free(ids);
    return rc;
}

int mr_layer_check(const mr_layer *L, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    const mr_weight *ws[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->gate, &L->up, &L->down};
    const int64_t d = L->n_embd;
    const int64_t rows[7] = {L->n_head * L->head_dim_k, L->n_head_kv * L->head_dim_k, L->n_head_kv * L->head_dim_v, d,
                             L->n_ff, L->n_ff, d};
    const int64_t cols[7] = {d, d, d, L->n_head * L->head_dim_v, d, d, L->n_ff};
    if (L->moe_beside != 0 && (L->moe_beside != 1 || !L->moe || !L->mlp_post_norm || !L->moe_pre_norm ||
                                !L->moe_post_norm || !L->router_scale || L->norm_kind != 0))
        return MR_E_SHAPE;
    const int gated = L->act != 2 && L->act != 3, ffn = L->n_ff != 0 && (!L->moe || L->moe_beside);
    if (ffn && gated != (L->gate.data != NULL)) return MR_E_SHAPE; /* xIELU, relu^2 without gate, the others with */
    if (L->moe) {
        const int rc = moe_check(K, L->moe, d, L->moe_beside ? moe_width(L->moe) : L->n_ff);
        if (rc != MR_OK) return rc;
        if ((!L->moe_beside && (L->gate.data || L->up.data || L->down.data)) || L->parallel || L->n_ff <= 0)
            return MR_E_SHAPE;
    }
    if (!ffn && (L->gate.data || L->up.data || L->down.data || L->parallel)) return MR_E_SHAPE;
    if (L->kv_layer < -1 || (L->v_norm != 0 && L->v_norm != 1) || !(L->out_scale == L->out_scale)) return MR_E_SHAPE;
    if (L->mixer < 0 || L->mixer > 4) return MR_E_SHAPE;
    const int conv = L->mixer == 1, ssm = L->mixer == 2 || L->mixer == 4, dn = L->mixer == 3;
    if ((L->out_gate != 0 && L->out_gate != 1) || (L->out_gate && L->mixer != 0)) return MR_E_SHAPE;
    if (dn) {
        const int64_t Hv = L->n_head, Hk = L->dn_k_heads, Dk = L->dn_head_dim, Dv = L->head_dim_k;
        if (Hv <= 0 || Hk <= 0 || Dk <= 0 || Dv <= 0 || Dv > MR_DR_MAX_DV || Hv % Hk || !L->conv_w ||
            L->conv_taps < 2 || L->conv_taps > 64 || L->conv_b || !L->ssm_dt_b || !L->ssm_a || !L->ssm_norm ||
            L->kv_layer != -1 || L->n_head_kv != 1 || L->rope_table != -1 || L->parallel ||
            (L->dn_grouped != 0 && L->dn_grouped != 1) || (L->dn_fused_ba != 0 && L->dn_fused_ba != 1))
            return MR_E_SHAPE;
        const mr_weight *dw[3] = {&L->wz, &L->wb, &L->wa};
        const int64_t drows[3] = {Hv * Dv, L->dn_fused_ba ? 2 * Hv : Hv, Hv};
        for (int i = 0; i < 3; i++) {
            if (i == 2 && L->dn_fused_ba) {
                if (dw[i]->data) return MR_E_SHAPE;
                continue;
            }
            if (dw[i]->bias || mat_ok(K, dw[i], drows[i], d) != MR_OK) return MR_E_QTYPE;
        }
    }
    const int64_t G = L->ssm_groups, N = L->ssm_state, Hs = L->ssm_heads, inner = Hs * L->ssm_head_dim;
    if (ssm && (Hs <= 0 || L->ssm_head_dim <= 0 || G <= 0 || N <= 0 || Hs % G || !L->conv_w || L->conv_taps < 2 ||
                L->conv_taps > 64 || !L->ssm_dt_b || !L->ssm_a || !L->ssm_d || L->kv_layer != -1 || L->parallel))
        return MR_E_SHAPE;
    if (L->mixer == 2 && (L->n_head != Hs || L->head_dim_k != L->ssm_head_dim || L->n_head_kv != 1 ||
                          L->rope_table != -1))
        return MR_E_SHAPE;
    if (L->mixer == 4) { /* the Mamba-2 half's own projections */
        const mr_weight *sw[2] = {&L->ssm_in, &L->ssm_out};
        const int64_t sr[2] = {2 * inner + 2 * G * N + Hs, d}, sc[2] = {d, inner};
        for (int i = 0; i < 2; i++)
            if (sw[i]->bias || mat_ok(K, sw[i], sr[i], sc[i]) != MR_OK) return MR_E_QTYPE;
    }
    if (conv && (!L->conv_w || L->conv_taps < 2 || L->conv_taps > 64 || L->kv_layer != -1 || L->n_head != L->n_head_kv ||
                 L->n_head_kv * L->head_dim_k != d || L->rope_table != -1))
        return MR_E_SHAPE;
    for (int i = 0; i < 7; i++) {
        if (ws[i] == &L->gate && !gated) continue;
        if ((ws[i] == &L->gate || ws[i] == &L->up || ws[i] == &L->down) && !ffn) continue; /* none, or experts */
        if ((ws[i] == &L->wk || ws[i] == &L->wv) && (L->kv_layer >= 0 || conv || L->mixer == 2 || dn)) continue;
        int64_t r = rows[i]; /* wq of the other mixers: their own input projections */
        if (ws[i] == &L->wq && dn) r = 2 * L->dn_k_heads * L->dn_head_dim + L->n_head * L->head_dim_k; /* q, k, v */
        if (ws[i] == &L->wq && L->out_gate) r = 2 * L->n_head * L->head_dim_k; /* each head's query + gate */
        if (ws[i] == &L->wq && L->mixer == 2) r = 2 * inner + 2 * G * N + Hs;    /* z, xBC, dt */
        if (ws[i] == &L->wq && conv) r = 3 * d;                                /* B, C, x */
        if (mat_ok(K, ws[i], r, cols[i]) != MR_OK) return MR_E_QTYPE;
    }
    if (L->gate.bias || L->up.bias) return MR_E_SHAPE;
    if (L->n_head <= 0 || L->n_head_kv <= 0 || L->head_dim_k <= 0 || L->n_embd <= 0 || L->n_ff < 0) return MR_E_SHAPE;
    if (L->head_dim_k != L->head_dim_v || L->n_head % L->n_head_kv || L->rope_dim > L->head_dim_k || (L->rope_dim & 1))
        return MR_E_SHAPE;
    if (L->act < 0 || L->act > 3 || L->norm_kind < 0 || L->norm_kind > 1 || L->rope_table < -1) return MR_E_SHAPE;
    if ((L->parallel != 0 && L->parallel != 1) || (L->parallel && L->ffn_norm) || (L->qk_norm_full != 0 && L->qk_norm_full != 1) ||
        (L->qk_norm_after_rope != 0 && L->qk_norm_after_rope != 1))
        return MR_E_SHAPE;
    if ((L->attn_norm_b && !L->attn_norm) || (L->ffn_norm_b && !L->ffn_norm)) return MR_E_SHAPE;
    if (L->n_pl < 0 || (L->n_pl > 0 && (L->pl_act < 0 || L->pl_act > 1))) return MR_E_SHAPE;
    if (L->n_pl > 0) {
        if (mat_ok(K, &L->pl_gate, L->n_pl, d) != MR_OK || mat_ok(K, &L->pl_proj, d, L->n_pl) != MR_OK) return MR_E_QTYPE;
        if (L->pl_gate.bias || L->pl_proj.bias) return MR_E_SHAPE;
    }
    return MR_OK;
}

/* out = norm(x) over rows of n: RMSNorm, or LayerNorm as RMSNorm of the centred row plus bias;
 * no gain (w NULL and kind RMS with no norm asked): a copy. */
MR_INLINE void norm_rows(const mr_kernels *K, const mr_layer *L, const float *x, const float *w, const float *bias,
                         float *out, int64_t B, int64_t n) {
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * n;
        float *ob = out + b * n;
        if (L->norm_kind == 1) {
            double mean = 0.0;
            for (int64_t i = 0; i < n; i++) mean += xb[i];
            const float m = (float)(mean / (double)n);
            for (int64_t i = 0; i < n; i++) ob[i] = xb[i] - m;
            K->rmsnorm(ob, w, L->eps, n, ob);
            if (bias)
                for (int64_t i = 0; i < n; i++) ob[i] += bias[i];
        } else {
            K->rmsnorm(xb, w, L->eps, n, ob);
        }
    }
}

/* q (H x D), k (Hkv x D) of one token through their RMSNorms: per head, or over the whole projection */
MR_INLINE void qk_norms(const mr_kernels *K, const mr_layer *L, float *qb, float *kb, int64_t H, int64_t Hkv, int64_t D) {
    if (L->q_norm && L->qk_norm_full) K->rmsnorm(qb, L->q_norm, L->eps, H * D, qb);
    else if (L->q_norm)
        for (int64_t i = 0; i < H; i++) K->rmsnorm(qb + i * D, L->q_norm, L->eps, D, qb + i * D);
    if (L->k_norm && L->qk_norm_full && Hkv > 0) K->rmsnorm(kb, L->k_norm, L->eps, Hkv * D, kb);
    else if (L->k_norm)
        for (int64_t i = 0; i < Hkv; i++) K->rmsnorm(kb + i * D, L->k_norm, L->eps, D, kb + i * D);
}

/* xIELU in place over n values (Apertus' MLP activation; as ggml's op_xielu) */
MR_INLINE void xielu_rows(float *a, int64_t n, const float *p) {
    const float alpha_n = p[0], alpha_p = p[1], beta = p[2], eps = p[3];
    for (int64_t i = 0; i < n; i++) {
        const float x = a[i];
        a[i] = x > 0.0f ? alpha_p * x * x + beta * x : (expm1f(fminf(x, eps)) - x) * alpha_n + beta * x;
    }
}

/* h = the block's input norm of x, or x itself when the block has none */
MR_INLINE void pre_norm(const mr_kernels *K, const mr_layer *L, const float *x, const float *w, const float *bias,
                        float *h, int64_t B, int64_t d) {
    if (w) norm_rows(K, L, x, w, bias, h, B, d);
    else memcpy(h, x, (size_t)(B * d) * 4);
}

/* residual stream of B rows of d: x += s * norm(o) (post-block norm, in place in o) or x += s * o */
MR_INLINE void residual(const mr_kernels *K, const mr_layer *L, float *x, float *o, const float *norm, int64_t B,
                        int64_t d) {
    if (norm) norm_rows(K, L, o, norm, NULL, o, B, d);
    const float s = L->residual_scale;
    for (int64_t i = 0; i < B * d; i++) x[i] += s == 1.0f ? o[i] : s * o[i];
}

/* LFM2's gated short convolution for one decode step of B sequences: bcx = in_proj h (B x 3 n_embd);
 * the new B * x goes to position pos of layer l's cache (n_head_kv rows of head_dim_k, type_k) and the
 * convolution reads the conv_taps - 1 stored rows before it (zeros before position 0), the new row
 * exact; y = C * conv (B x n_embd). bx, row: scratch of B x n_embd floats each. Caller holds the lock. */
static int short_conv(const mr_kernels *K, const mr_layer *L, long long l, const float *h, float *bcx, float *y,
                      float *bx, float *row, int64_t B, const mr_kvseq *seqs, int type_k, int threads) {
    const int64_t d = L->n_embd, Hc = L->n_head_kv, Dh = L->head_dim_k, T = L->conv_taps;
    {
        const mr_weight *w[1] = {&L->wq};
        float *yy[1] = {bcx};
        const int rc = run_mats(K, w, yy, 1, -1, h, B, threads);
        if (rc != MR_OK) return rc;
    }
    const int64_t rb = mr_kv_row_bytes(type_k, Dh);
    for (int64_t b = 0; b < B; b++) {
        const mr_kvseq *s = &seqs[b];
        const float *Bv = bcx + b * 3 * d, *Cv = Bv + d, *Xv = Bv + 2 * d;
        float *yb = y + b * d, *xb = bx + b * d, *rw = row + b * d;
        uint8_t *base = (uint8_t *)s->k + l * s->layer_stride_k;
        for (int64_t i = 0; i < d; i++) xb[i] = Bv[i] * Xv[i];
        for (int64_t i = 0; i < Hc; i++) mr_kv_store(type_k, xb + i * Dh, Dh, base + (i * s->n_ctx + s->pos) * rb);
        /* taps oldest first, as the per-op path sums them; tap j reads position pos - (T - 1 - j) */
        for (int64_t i = 0; i < d; i++) yb[i] = 0.0f;
        for (int64_t j = 0; j < T; j++) {
            const int64_t p = s->pos - (T - 1 - j);
            if (p < 0) continue;
            const float *r = xb;
            if (j < T - 1) {
                for (int64_t i = 0; i < Hc; i++) {
                    const int rc = mr_kv_dequantize(type_k, base + (i * s->n_ctx + p) * rb, Dh, rw + i * Dh);
                    if (rc != MR_OK) return rc;
                }
                r = rw;
            }
            for (int64_t i = 0; i < d; i++) yb[i] += L->conv_w[i * T + j] * r[i];
        }
        for (int64_t i = 0; i < d; i++) yb[i] *= Cv[i];
    }
    return MR_OK;
}

/* One decode step of a recurrent mixer's causal depthwise convolution over cd channels: out = silu(bias +
 * the state's conv_taps - 1 rows and the new input `in`, weighted by conv_w (cd, conv_taps)), summed oldest
 * first as the per-op path does; then `in` is shifted into the state (conv_taps - 1, cd). */
static void conv_step(const mr_layer *L, float *cs, const float *in, float *o, int64_t cd) {
    const int64_t T = L->conv_taps;
    for (int64_t c = 0; c < cd; c++) {
        float acc = L->conv_b ? L->conv_b[c] : 0.0f;
        const float *w = L->conv_w + c * T;
        for (int64_t j = 0; j < T - 1; j++) acc += cs[j * cd + c] * w[j];
        acc += in[c] * w[T - 1];
        o[c] = acc / (1.0f + expf(-acc));
    }
    memmove(cs, cs + cd, (size_t)((T - 2) * cd) * 4);
    memcpy(cs + (T - 2) * cd, in, (size_t)cd * 4);
}

/* Mamba-2 for one decode step of B sequences (mixer 2): zx = in_proj h (B x R, R = 2 inner + 2 G N + H);
 * per sequence the convolution continues from its state's last conv_taps - 1 inputs (then shifted in) and
 * xs = silu(conv + bias) (B x conv_dim, conv_dim = inner + 2 G N); the scan (one item per sequence and
 * head, K->ssm_rows) writes y (B x inner) = S C + D x; then y = y * silu(z), RMS-normed per group with the
 * gains where the layer has them (the same operations, in the same order, as the per-op path). */
typedef struct {
    const mr_kernels *K;
    const mr_layer *L;
    const float *zx, *xs;
    float *y;
    const mr_kvseq *seqs;
    long long l;
    int64_t H, P, N, G, R, cd, inner;
} m2_ctx;

static void m2_task(const void *c_, int64_t item, int worker, float *buf) {
    (void)worker;
    (void)buf;
    const m2_ctx *c = (const m2_ctx *)c_;
    const int64_t b = item / c->H, h = item % c->H, g = h / (c->H / c->G), P = c->P, N = c->N;
    const mr_layer *L = c->L;
    const float *xs = c->xs + b * c->cd, *x = xs + h * P, *Bv = xs + c->inner + g * N,
                *Cv = xs + c->inner + c->G * N + g * N;
    const float dt = mr_softplus(c->zx[b * c->R + c->inner + c->cd + h] + L->ssm_dt_b[h]);
    float *S = c->seqs[b].state[2 * c->l + 1] + h * P * N, *y = c->y + b * c->inner + h * P;
    c->K->ssm_rows(S, x, Bv, Cv, expf(dt * L->ssm_a[h]), dt, P, N, y);
    for (int64_t p = 0; p < P; p++) y[p] += x[p] * L->ssm_d[h];
}

static int mamba2_step(const mr_kernels *K, const mr_layer *L, long long l, const mr_weight *in_proj, const float *h,
                       float *zx, float *y, float *xs, int64_t B, const mr_kvseq *seqs, int threads) {
    const int64_t H = L->ssm_heads, P = L->ssm_head_dim, N = L->ssm_state, G = L->ssm_groups, inner = H * P;
    const int64_t cd = inner + 2 * G * N, R = 2 * inner + 2 * G * N + H;
    {
        const mr_weight *w[1] = {in_proj};
        float *yy[1] = {zx};
        const int rc = run_mats(K, w, yy, 1, -1, h, B, threads);
        if (rc != MR_OK) return rc;
    }
    for (int64_t b = 0; b < B; b++) conv_step(L, seqs[b].state[2 * l], zx + b * R + inner, xs + b * cd, cd); /* xBC */
    const m2_ctx c = {K, L, zx, xs, y, seqs, l, H, P, N, G, R, cd, inner};
    int rc = mr_parallel_for(m2_task, NULL, &c, sizeof c, B * H, 0, threads);
    if (rc < 0) return rc;
    for (int64_t b = 0; b < B; b++) {
        float *yb = y + b * inner;
        K->act_mul(zx + b * R, yb, yb, inner, 0); /* silu(z) * y */
        if (L->ssm_norm) {
            const int64_t gs = inner / G;
            for (int64_t gi = 0; gi < G; gi++) K->rmsnorm(yb + gi * gs, L->ssm_norm + gi * gs, L->eps, gs, yb + gi * gs);
        }
    }
    return MR_OK;
}

/* Qwen3.5's gated delta-net for one decode step of B sequences (mixer 3): mixed = qkv_proj h (B x cd, cd =
 * 2 Hk Dk + Hv Dv), z = z_proj h (B x Hv Dv), beta / alpha inputs (B x Hv each, or fused per key head); per
 * sequence the convolution continues from its state (then shifted in), xs = silu(conv) and q, k of every key
 * head L2-normalised (q also scaled by 1 / sqrt(Dk)); the delta rule (one item per sequence and value head:
 * S = decay S; S += k (x) beta (v - S^T k); o = S^T q) writes y (B x Hv Dv), then y = rmsnorm(y per head) *
 * gains * silu(z): the operations of the per-op path. */
typedef struct {
    const mr_kernels *K;
    const mr_layer *L;
    const float *xs, *bi, *ai;
    float *y;
    const mr_kvseq *seqs;
    long long l;
    int64_t Hv, Hk, Dk, Dv, cd, ba;
} dn_ctx;

static void dn_task(const void *c_, int64_t item, int worker, float *buf) {
    (void)worker;
    (void)buf;
    const dn_ctx *c = (const dn_ctx *)c_;
    const mr_layer *L = c->L;
    const int64_t b = item / c->Hv, j = item % c->Hv, Hk = c->Hk, Dk = c->Dk, Dv = c->Dv, rep = c->Hv / Hk;
    const int64_t kh = L->dn_grouped ? j / rep : j % Hk;
    const float *xs = c->xs + b * c->cd, *q = xs + kh * Dk, *k = xs + Hk * Dk + kh * Dk, *v = xs + 2 * Hk * Dk + j * Dv;
    float bin, ain;
    if (L->dn_fused_ba) { /* per key head: its value heads' beta rows, then their alpha rows */
        const float *r = c->bi + b * c->ba + (j / rep) * 2 * rep;
        bin = r[j % rep];
        ain = r[rep + j % rep];
    } else {
        bin = c->bi[b * c->ba + j];
        ain = c->ai[b * c->Hv + j];
    }
    const float beta = 0.5f * tanhf(0.5f * bin) + 0.5f; /* sigmoid, as the per-op path writes it */
    const float decay = expf(L->ssm_a[j] * mr_softplus(ain + L->ssm_dt_b[j]));
    float kv[MR_DR_MAX_DV], delta[MR_DR_MAX_DV];
    c->K->delta_step(c->seqs[b].state[2 * c->l + 1] + j * Dk * Dv, q, k, v, decay, beta, c->y + (b * c->Hv + j) * Dv,
                     Dk, Dv, kv, delta);
}

static int delta_net_step(const mr_kernels *K, const mr_layer *L, long long l, const float *h, float *mixed, float *y,
                          float *xs, float *z, float *bi, float *ai, int64_t B, const mr_kvseq *seqs, int threads) {
    const int64_t Hv = L->n_head, Hk = L->dn_k_heads, Dk = L->dn_head_dim, Dv = L->head_dim_k;
    const int64_t cd = 2 * Hk * Dk + Hv * Dv, ba = L->dn_fused_ba ? 2 * Hv : Hv;
    {
        const mr_weight *w[4] = {&L->wq, &L->wz, &L->wb, &L->wa};
        float *yy[4] = {mixed, z, bi, ai};
        const int rc = run_mats(K, w, yy, L->dn_fused_ba ? 3 : 4, -1, h, B, threads);
        if (rc != MR_OK) return rc;
    }
    const float qs = 1.0f / sqrtf((float)Dk);
    for (int64_t b = 0; b < B; b++) {
        float *o = xs + b * cd;
        conv_step(L, seqs[b].state[2 * l], mixed + b * cd, o, cd); /* conv_b is NULL (checked) */
        for (int64_t hh = 0; hh < 2 * Hk; hh++) { /* q then k heads: x / max(|x|, eps); q also / sqrt(Dk) */
            float *r = o + hh * Dk;
            double ss = 0.0;
            for (int64_t i = 0; i < Dk; i++) ss += (double)r[i] * r[i];
            const float nrm = (float)sqrt(ss), sc = (hh < Hk ? qs : 1.0f) / (nrm > L->eps ? nrm : L->eps);
            for (int64_t i = 0; i < Dk; i++) r[i] *= sc;
        }
    }
    const dn_ctx c = {K, L, xs, bi, ai, y, seqs, l, Hv, Hk, Dk, Dv, cd, ba};
    int rc = mr_parallel_for(dn_task, NULL, &c, sizeof c, B * Hv, 0, threads);
    if (rc < 0) return rc;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < Hv; j++) {
            float *r = y + (b * Hv + j) * Dv;
            K->rmsnorm(r, L->ssm_norm, L->eps, Dv, r);
            K->act_mul(z + (b * Hv + j) * Dv, r, r, Dv, 0); /* silu(z) * y */
        }
    return MR_OK;
}

int mr_decode_layers(const mr_layer *layers, long long n_layer, float *x, long long n_seq, const mr_kvseq *seqs, int type_k,
                     int type_v, const float *const *cos_t, const float *const *sin_t, int n_tables, const float *pl_in,
                     int threads, int isa) {
    const mr_kernels *K = mr_get_kernels(isa);
    if (!K) return MR_E_ISA;
    if (n_layer <= 0 || n_seq <= 0 || n_seq > MR_PACKED_INT_MAX) return MR_E_SHAPE;
    for (long long l = 0; l < n_layer; l++) {
        const int rc = mr_layer_check(&layers[l], isa);
        if (rc != MR_OK) return rc;
        if (layers[l].rope_table >= n_tables || (layers[l].rope_table >= 0 && (!cos_t || !sin_t))) return MR_E_SHAPE;
        if (layers[l].mixer >= 2) /* a recurrent state (mixer 4: beside its KV rows) */
            for (long long b = 0; b < n_seq; b++)
                if (!seqs[b].state || !seqs[b].state[2 * l] || !seqs[b].state[2 * l + 1]) return MR_E_SHAPE;
        if ((layers[l].mixer < 2 || layers[l].mixer == 4) &&
            (mr_kv_row_bytes(type_k, layers[l].head_dim_k) < 0 || mr_kv_row_bytes(type_v, layers[l].head_dim_v) < 0))
            return MR_E_QTYPE;
        const long long src = layers[l].kv_layer;
        if (src >= 0 && (src >= l || layers[src].kv_layer != -1 || layers[src].mixer != 0 ||
                         layers[src].n_head_kv != layers[l].n_head_kv ||
                         layers[src].head_dim_k != layers[l].head_dim_k))
            return MR_E_SHAPE; /* a shared cache is an earlier layer's own, of the same shape */
        if (layers[l].n_pl != layers[0].n_pl || (layers[l].n_pl > 0 && !pl_in)) return MR_E_SHAPE;
    }
    if (threads <= 0) threads = mr_pool_threads_default();
    const mr_layer *L0 = &layers[0];
    const int64_t d = L0->n_embd, B = n_seq;
    int64_t qd = 0, kd = 0, ff = 0, gd = 0;
    for (long long l = 0; l < n_layer; l++) {
        const mr_layer *L = &layers[l];
        if (L->n_embd != d) return MR_E_SHAPE;
        if (L->n_head * L->head_dim_k > qd) qd = L->n_head * L->head_dim_k;
        if (L->n_head_kv * L->head_dim_k > kd) kd = L->n_head_kv * L->head_dim_k;
        if (L->n_ff > ff) ff = L->n_ff;
        if (L->n_pl > ff) ff = L->n_pl; /* the per-layer gate's output goes to a */
        if (L->mixer == 1) { /* short convolution: in_proj's B, C, x go to q; B * x and a stored row to v, k */
            if (3 * d > qd) qd = 3 * d;
            if (d > kd) kd = d;
        }
        if (L->mixer == 2 || L->mixer == 4) { /* Mamba-2: in_proj's z, xBC, dt go to q, the convolution's output
                                                  to k (mixer 4: after the attention half is done with them) */
            const int64_t inner = L->ssm_heads * L->ssm_head_dim, gn = 2 * L->ssm_groups * L->ssm_state;
            if (2 * inner + gn + L->ssm_heads > qd) qd = 2 * inner + gn + L->ssm_heads;
            if (inner + gn > kd) kd = inner + gn;
        }
        if (L->mixer == 3 || L->out_gate) { /* delta-net: qkv to q, conv output to k, z / beta / alpha to g;
                                               gated attention: query + gate to q, the gates to g */
            const int64_t cd = 2 * L->dn_k_heads * L->dn_head_dim + L->n_head * L->head_dim_k;
            const int64_t gq = 2 * L->n_head * L->head_dim_k;
            if (L->mixer == 3 && cd > qd) qd = cd;
            if (L->mixer == 3 && cd > kd) kd = cd;
            if (L->out_gate && gq > qd) qd = gq;
            if (L->n_head * L->head_dim_k + 4 * L->n_head > gd) gd = L->n_head * L->head_dim_k + 4 * L->n_head;
        }
    }
    mr_call_lock();
    int rc = MR_OK;
    const unsigned long long s0 = mr_pool_steals();
    /* scratch: h, o, o2, r (B x d), q, att (B x qd), k, v (B x kd), a (B x ff), g (B x gd); the old one freed
     * deferred (late workers may read it) */
    const size_t need = (size_t)(B * (4 * d + 2 * qd + 2 * kd + ff + gd) + 64);
    if (need > lbuf_cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, need * 2 * 4) != 0) rc = MR_E_NOMEM;
        else {
            mr_defer_free(lbuf);
            lbuf = (float *)p;
            lbuf_cap = need * 2;
        }
    }
    float *h = lbuf, *o = h + B * d, *o2 = o + B * d, *q = o2 + B * d, *att = q + B * qd, *k = att + B * qd,
          *v = k + B * kd, *a = v + B * kd, *g = a + B * ff, *r = g + B * gd;
    for (long long l = 0; l < n_layer && rc == MR_OK; l++) {
        const mr_layer *L = &layers[l];
        const int64_t H = L->n_head, Hkv = L->n_head_kv, D = L->head_dim_k, half = L->rope_dim / 2;
        const float *cs = L->rope_table >= 0 ? cos_t[L->rope_table] : NULL;
        const float *sn = L->rope_table >= 0 ? sin_t[L->rope_table] : NULL;
        /* attention block */
        double prof_t = prof_on ? prof_now() : 0.0;
        pre_norm(K, L, x, L->attn_norm, L->attn_norm_b, h, B, d);
        const int own_kv = L->kv_layer < 0;
        const long long kvl = own_kv ? l : L->kv_layer; /* the layer whose cache attention reads */
        if (L->mixer == 1) {
            rc = short_conv(K, L, l, h, q, att, v, k, B, seqs, type_k, threads);
            if (rc != MR_OK) break;
            PROF(2);
        } else if (L->mixer == 2) {
            rc = mamba2_step(K, L, l, &L->wq, h, q, att, k, B, seqs, threads);
            if (rc != MR_OK) break;
            PROF(2);
        } else if (L->mixer == 3) {
            const int64_t HD = L->n_head * L->head_dim_k;
            rc = delta_net_step(K, L, l, h, q, att, k, g, g + B * HD, g + B * HD + B * 2 * L->n_head, B, seqs,
                                threads);
            if (rc != MR_OK) break;
            PROF(2);
        } else { /* attention */
            const int64_t rot_k = mr_kv_rotation(type_k, D, 1), rot_v = mr_kv_rotation(type_v, D, 0);
            {
                const mr_weight *w[3] = {&L->wq, &L->wk, &L->wv};
                float *y[3] = {q, k, v};
                rc = run_mats(K, w, y, own_kv ? 3 : 1, -1, h, B, threads);
            }
            if (rc != MR_OK) break;
            if (L->out_gate) /* per head its query then its gate: the gates to g, the queries packed in place
                                (rows of 2 H D to rows of H D: every destination precedes the sources not yet read) */
                for (int64_t b = 0; b < B; b++)
                    for (int64_t i = 0; i < H; i++) {
                        const float *src = q + b * 2 * H * D + 2 * i * D;
                        memcpy(g + (b * H + i) * D, src + D, (size_t)D * 4);
                        memmove(q + (b * H + i) * D, src, (size_t)D * 4);
                    }
            PROF(0);
            for (int64_t b = 0; b < B; b++) {
                const mr_kvseq *s = &seqs[b];
                float *qb = q + b * H * D, *kb = k + b * Hkv * D, *vb = v + b * Hkv * D;
                const int64_t nk = own_kv ? Hkv : 0; /* k heads to normalize and rotate */
                if (!L->qk_norm_after_rope) qk_norms(K, L, qb, kb, H, nk, D);
                if (cs && half > 0) {
                    for (int64_t i = 0; i < H; i++) mr_rope_row(qb + i * D, L->rope_dim, cs + b * half, sn + b * half, L->rope_neox);
                    for (int64_t i = 0; i < nk; i++) mr_rope_row(kb + i * D, L->rope_dim, cs + b * half, sn + b * half, L->rope_neox);
                }
                if (L->qk_norm_after_rope) qk_norms(K, L, qb, kb, H, nk, D);
                /* a block-quantized cache holds scaled, rotated keys: queries are scaled inversely and turn
                 * with them (dots unchanged; the scales are powers of two, so exactly) */
                const int kq = mr_types[type_k].block > 1;
                if (kq && L->q_scale)
                    for (int64_t j = 0; j < H * D; j++) qb[j] *= L->q_scale[j];
                mr_kv_rotate(qb, H * D, rot_k);
                if (!own_kv) continue;
                if (kq && L->k_offset)
                    for (int64_t j = 0; j < Hkv * D; j++) kb[j] -= L->k_offset[j];
                if (kq && L->k_scale)
                    for (int64_t j = 0; j < Hkv * D; j++) kb[j] *= L->k_scale[j];
                mr_kv_rotate(kb, Hkv * D, rot_k);
                if (L->v_norm)
                    for (int64_t i = 0; i < Hkv; i++) K->rmsnorm(vb + i * D, NULL, L->eps, D, vb + i * D);
                mr_kv_rotate(vb, Hkv * D, rot_v);
                const int64_t rbk = mr_kv_row_bytes(type_k, D), rbv = mr_kv_row_bytes(type_v, D);
                for (int64_t i = 0; i < Hkv; i++) { /* the new key / value at position pos, quantized in place */
                    const int64_t row = i * s->n_ctx + s->pos;
                    mr_kv_store(type_k, kb + i * D, D, (uint8_t *)s->k + l * s->layer_stride_k + row * rbk);
                    mr_kv_store(type_v, vb + i * D, D, (uint8_t *)s->v + l * s->layer_stride_v + row * rbv);
                }
            }
            PROF(1);
            {
                const void *kp[MR_PACKED_INT_MAX], *vp[MR_PACKED_INT_MAX];
                int64_t nc[MR_PACKED_INT_MAX], st[MR_PACKED_INT_MAX], en[MR_PACKED_INT_MAX];
                for (int64_t b = 0; b < B; b++) {
                    kp[b] = (const uint8_t *)seqs[b].k + kvl * seqs[b].layer_stride_k;
                    vp[b] = (const uint8_t *)seqs[b].v + kvl * seqs[b].layer_stride_v;
                    nc[b] = seqs[b].n_ctx;
                    en[b] = seqs[b].pos + 1;
                    st[b] = L->window > 0 && en[b] > L->window ? en[b] - L->window : 0;
                }
                rc = mr_attention_decode_batch(K, q, att, B, kp, vp, nc, st, en, H, Hkv, D, type_k, type_v, L->attn_scale,
                                               L->softcap, L->sinks, threads);
            }
            if (rc != MR_OK) break;
            mr_kv_rotate(att, B * H * D, rot_v); /* rotated values: the output back to the plain basis */
            if (L->out_gate)
                for (int64_t i = 0; i < B * H * D; i++) att[i] *= 0.5f * tanhf(0.5f * g[i]) + 0.5f; /* sigmoid */
            PROF(2);
        }
        {
            const mr_weight *w[1] = {&L->wo};
            float *y[1] = {o};
            rc = run_mats(K, w, y, 1, -1, att, B, threads);
        }
        if (rc != MR_OK) break;
        if (L->mixer == 4) { /* Falcon-H1: the Mamba-2 half on the same h, its output added to the attention's */
            rc = mamba2_step(K, L, l, &L->ssm_in, h, q, att, k, B, seqs, threads);
            if (rc == MR_OK) {
                const mr_weight *w[1] = {&L->ssm_out};
                float *y[1] = {o2};
                rc = run_mats(K, w, y, 1, -1, att, B, threads);
            }
            if (rc != MR_OK) break;
            for (int64_t i = 0; i < B * d; i++) o[i] += o2[i];
        }
        if (L->parallel) { /* the MLP reads the same h; both outputs join the stream together below */
            if (L->post_attn_norm) norm_rows(K, L, o, L->post_attn_norm, NULL, o, B, d);
        } else {
            residual(K, L, x, o, L->post_attn_norm, B, d);
            /* feed-forward block */
            if (L->n_ff > 0) pre_norm(K, L, x, L->ffn_norm, L->ffn_norm_b, h, B, d);
        }
        PROF(3);
        if (L->moe && !L->moe_beside) {
            rc = moe_ffn(K, L->moe, h, h, o2, B, d, L->n_ff, threads);
            if (rc != MR_OK) break;
            residual(K, L, x, o2, L->post_ffn_norm, B, d);
        } else if (L->n_ff == 0) {
            /* no feed-forward half */
        } else if (L->act == 2 || L->act == 3) { /* no gate: a = xielu(Wu h) or relu(Wu h)^2 */
            const mr_weight *w[1] = {&L->up};
            float *y[1] = {a};
            rc = run_mats(K, w, y, 1, -1, h, B, threads);
            if (rc == MR_OK && L->act == 2) xielu_rows(a, B * L->n_ff, L->act_params);
            if (rc == MR_OK && L->act == 3) mr_expert_act(K, a, a, B * L->n_ff, 4);
        } else {
            const mr_weight *w[2] = {&L->gate, &L->up};
            float *y[2] = {a, a};
            rc = run_mats(K, w, y, 2, L->act, h, B, threads);
        }
        if (rc != MR_OK) break;
        PROF(4);
        if (L->n_ff > 0 && (!L->moe || L->moe_beside)) {
            const mr_weight *w[1] = {&L->down};
            float *y[1] = {o2};
            rc = run_mats(K, w, y, 1, -1, a, B, threads);
            if (rc != MR_OK) break;
            if (L->moe_beside) { /* o2 = mlp_post(o2) + moe_post(MoE(moe_pre(x))), the router reading r */
                norm_rows(K, L, o2, L->mlp_post_norm, NULL, o2, B, d);
                norm_rows(K, L, x, L->moe_pre_norm, NULL, h, B, d);
                for (int64_t b = 0; b < B; b++) K->rmsnorm(x + b * d, L->router_scale, L->eps, d, r + b * d);
                rc = moe_ffn(K, L->moe, h, r, o, B, d, moe_width(L->moe), threads);
                if (rc != MR_OK) break;
                norm_rows(K, L, o, L->moe_post_norm, NULL, o, B, d);
                for (int64_t i = 0; i < B * d; i++) o2[i] += o[i];
            }
            if (L->parallel) {
                if (L->post_ffn_norm) norm_rows(K, L, o2, L->post_ffn_norm, NULL, o2, B, d);
                for (int64_t i = 0; i < B * d; i++) o2[i] += o[i];
                residual(K, L, x, o2, NULL, B, d);
            } else {
                residual(K, L, x, o2, L->post_ffn_norm, B, d);
            }
        }
        if (L->n_pl > 0) { /* x += post_norm(proj(act(gate x) * in_l)) */
            const int64_t E = L->n_pl;
            {
                const mr_weight *w[1] = {&L->pl_gate};
                float *y[1] = {a};
                rc = run_mats(K, w, y, 1, -1, x, B, threads);
            }
            if (rc != MR_OK) break;
            for (int64_t b = 0; b < B; b++) K->act_mul(a + b * E, pl_in + (b * n_layer + l) * E, a + b * E, E, L->pl_act);
            {
                const mr_weight *w[1] = {&L->pl_proj};
                float *y[1] = {o2};
                rc = run_mats(K, w, y, 1, -1, a, B, threads);
            }
            if (rc != MR_OK) break;
            if (L->pl_post_norm) norm_rows(K, L, o2, L->pl_post_norm, NULL, o2, B, d);
            for (int64_t i = 0; i < B * d; i++) x[i] += o2[i];
        }
        if (L->out_scale != 1.0f)
            for (int64_t i = 0; i < B * d; i++) x[i] *= L->out_scale;
        PROF(5);
        if (prof_on) prof_ns[6] += 1.0;
    }
    if (rc == MR_OK) rc = mr_steals_since(s0);
    mr_call_unlock();
    return rc;
}
