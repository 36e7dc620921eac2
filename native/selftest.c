/* Standalone self-test of the native kernels, no Python needed (used to check other architectures,
 * e.g. an AArch64 build under qemu):
 *     cc -O2 -pthread -Inative (every .c file of native/) -lm -o selftest && ./selftest
 * For every ISA the CPU runs and every supported type, mr_matmul on random blocks (finite f16 scales)
 * is compared with mr_dequantize followed by a float64 dot, and so is mr_matmul_packed on the packed
 * layout (whose unpacking must give back every byte); then RMSNorm, softmax and attention.
 * Prints one line per failure and "N passed, M failed"; exit status 1 on any failure. */
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

static uint64_t rs = 88172645463325252ull;
static uint64_t rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return rs; }
static double urand(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }
static float frand(void) { return (float)(urand() * 2.0 - 1.0); }

typedef struct { int id; const char *name; int f16_off[2]; int n_off; } tinfo;
static const tinfo TYPES[] = {
    {GT_F32, "F32", {0}, 0},       {GT_F16, "F16", {0}, 0},       {GT_BF16, "BF16", {0}, 0},
    {GT_Q4_0, "Q4_0", {0}, 1},     {GT_Q4_1, "Q4_1", {0, 2}, 2},  {GT_Q5_0, "Q5_0", {0}, 1},
    {GT_Q5_1, "Q5_1", {0, 2}, 2},  {GT_Q8_0, "Q8_0", {0}, 1},     {GT_Q2_K, "Q2_K", {80, 82}, 2},
    {GT_Q3_K, "Q3_K", {108}, 1},   {GT_Q4_K, "Q4_K", {0, 2}, 2},  {GT_Q5_K, "Q5_K", {0, 2}, 2},
    {GT_Q6_K, "Q6_K", {208}, 1},   {GT_IQ4_NL, "IQ4_NL", {0}, 1}, {GT_IQ4_XS, "IQ4_XS", {0}, 1},
    {GT_IQ2_XXS, "IQ2_XXS", {0}, 1}, {GT_IQ2_XS, "IQ2_XS", {0}, 1}, {GT_IQ2_S, "IQ2_S", {0}, 1},
    {GT_IQ3_XXS, "IQ3_XXS", {0}, 1}, {GT_IQ3_S, "IQ3_S", {0}, 1},   {GT_IQ1_S, "IQ1_S", {0}, 1},
    {GT_IQ1_M, "IQ1_M", {0}, 0},     {GT_TQ1_0, "TQ1_0", {52}, 1},  {GT_TQ2_0, "TQ2_0", {64}, 1},
    {GT_MXFP4, "MXFP4", {0}, 0},
};

static int passed, failed;

static void check(int ok, const char *what) {
    if (ok) {
        passed++;
    } else {
        failed++;
        printf("FAIL %s\n", what);
    }
}

static void fill_weights(const tinfo *t, uint8_t *w, int64_t rows, int64_t cols) {
    const mr_type_info ti = mr_types[t->id];
    const int64_t nblk = rows * cols / ti.block;
    for (int64_t b = 0; b < nblk; b++) {
        uint8_t *blk = w + b * ti.bytes;
        if (t->id == GT_F32) {
            const float f = frand();
            memcpy(blk, &f, 4);
        } else if (t->id == GT_F16) {
            const uint16_t h = mr_f32_to_f16(frand());
            memcpy(blk, &h, 2);
        } else if (t->id == GT_BF16) {
            const float f = frand();
            uint32_t u;
            memcpy(&u, &f, 4);
            const uint16_t h = (uint16_t)(u >> 16);
            memcpy(blk, &h, 2);
        } else {
            for (int i = 0; i < ti.bytes; i++) blk[i] = (uint8_t)rnd();
            for (int k = 0; k < t->n_off; k++) {
                const float s = (float)(0.002 + 0.048 * urand()) * (rnd() & 1 ? 1.0f : -1.0f);
                const uint16_t h = mr_f32_to_f16(s);
                memcpy(blk + t->f16_off[k], &h, 2);
            }
            if (t->id == GT_IQ1_M) { /* the f16 scale sits in the top nibbles of the u16 at 48, 50, 52, 54 */
                const uint16_t h = mr_f32_to_f16((float)(0.002 + 0.048 * urand()));
                for (int k = 0; k < 4; k++) {
                    uint16_t v = (uint16_t)((mr_rd16(blk + 48 + 2 * k) & 0x0fff) | (((h >> (4 * k)) & 15) << 12));
                    memcpy(blk + 48 + 2 * k, &v, 2);
                }
            }
            if (t->id == GT_MXFP4) blk[0] = (uint8_t)(118 + rnd() % 8); /* scales 2^-10 .. 2^-3 */
        }
    }
}

/* worst |y - W x| / sum |W x| over the nt x rows outputs against a float64 reference (1e9 for a NaN) */
static double worst_rel_err(const float *W, const float *x, const float *y, int64_t rows, int64_t cols, int64_t nt) {
    double worst = 0.0;
    for (int64_t tt = 0; tt < nt; tt++)
        for (int64_t r = 0; r < rows; r++) {
            double ref = 0.0, absd = 0.0;
            for (int64_t c = 0; c < cols; c++) {
                ref += (double)W[r * cols + c] * x[tt * cols + c];
                absd += fabs((double)W[r * cols + c] * x[tt * cols + c]);
            }
            const double e = fabs(y[tt * rows + r] - ref) / (absd + 1e-30);
            if (e > worst || e != e) worst = e != e ? 1e9 : e;
        }
    return worst;
}

static void test_matmul(int isa, const tinfo *t, int64_t rows, int64_t cols, int64_t nt, int threads) {
    const mr_type_info ti = mr_types[t->id];
    const int64_t rb = cols / ti.block * ti.bytes;
    uint8_t *w = malloc((size_t)(rows * rb));
    float *W = malloc((size_t)(rows * cols) * 4), *x = malloc((size_t)(nt * cols) * 4);
    float *y = malloc((size_t)(nt * rows) * 4);
    fill_weights(t, w, rows, cols);
    for (int64_t i = 0; i < nt * cols; i++) x[i] = frand() * 3.0f;
    int ok = mr_dequantize(t->id, w, rows * cols, W) == 0;
    ok = ok && mr_matmul(t->id, w, rows, cols, rb, x, nt, cols, y, rows, threads, isa) >= 0;
    const double worst = ok ? worst_rel_err(W, x, y, rows, cols, nt) : 0.0;
    char what[160];
    snprintf(what, sizeof what, "matmul isa=%d %s rows=%lld cols=%lld nt=%lld threads=%d: rel err %.3g", isa,
             t->name, (long long)rows, (long long)cols, (long long)nt, threads, worst);
    /* int16 activations round to 1/65534 of a 32-block's max; int8 ones (path 6, q8_K-like) to 1/254
     * of a 256-block's max: about 1e-3 of sum |W x| on these inputs */
    check(ok && worst < (mr_matmul_path(t->id, nt, isa) == 6 ? 1e-2 : 1e-4), what);
    free(w); free(W); free(x); free(y);
}

/* packed layout: byte-exact round trip, and mr_matmul_packed against the float64 reference */
static void test_packed(int isa, const tinfo *t, int64_t rows, int64_t cols, int64_t nt, int threads) {
    const mr_type_info ti = mr_types[t->id];
    const long long psize = mr_pack_size(t->id, rows, cols);
    if (psize <= 0) return;
    const int64_t rb = cols / ti.block * ti.bytes;
    uint8_t *w = malloc((size_t)(rows * rb)), *w2 = malloc((size_t)(rows * rb)), *p = malloc((size_t)psize);
    float *W = malloc((size_t)(rows * cols) * 4), *x = malloc((size_t)(nt * cols) * 4);
    float *y = malloc((size_t)(nt * rows) * 4);
    fill_weights(t, w, rows, cols);
    for (int64_t i = 0; i < nt * cols; i++) x[i] = frand() * 3.0f;
    int ok = mr_dequantize(t->id, w, rows * cols, W) == 0 && mr_pack(t->id, w, rows, cols, rb, p, threads) == 0;
    ok = ok && mr_unpack(t->id, p, rows, cols, w2, rb) == 0 && memcmp(w, w2, (size_t)(rows * rb)) == 0;
    ok = ok && mr_matmul_packed(t->id, p, rows, cols, x, nt, cols, y, rows, threads, isa) >= 0;
    const double worst = ok ? worst_rel_err(W, x, y, rows, cols, nt) : 0.0;
    char what[160];
    snprintf(what, sizeof what, "packed isa=%d %s rows=%lld cols=%lld nt=%lld threads=%d: rel err %.3g", isa, t->name,
             (long long)rows, (long long)cols, (long long)nt, threads, worst);
    check(ok && worst < 1e-4, what);
    free(w); free(w2); free(p); free(W); free(x); free(y);
}

static double dmax(double a, double b) { return a > b ? a : b; }

__attribute__((optimize("no-tree-vectorize"))) static void test_ops(int isa) {
    char what[96];
    /* rmsnorm */
    float x[300], wt[300], o[300];
    for (int i = 0; i < 300; i++) { x[i] = frand() * 4; wt[i] = frand(); }
    double ss = 0;
    for (int i = 0; i < 300; i++) ss += (double)x[i] * x[i];
    const double r = 1.0 / sqrt(ss / 300 + 1e-5);
    mr_rmsnorm(x, wt, 1e-5f, 1, 300, o, isa);
    double e = 0;
    for (int i = 0; i < 300; i++) e = dmax(e, fabs(o[i] - x[i] * r * wt[i]));
    snprintf(what, sizeof what, "rmsnorm isa=%d err %.3g", isa, e);
    check(e < 1e-5, what);
    /* softmax */
    for (int i = 0; i < 300; i++) o[i] = x[i] * 5;
    mr_softmax(o, 1, 300, isa);
    double mx = -1e30, sum = 0;
    for (int i = 0; i < 300; i++) mx = dmax(mx, x[i] * 5.0);
    for (int i = 0; i < 300; i++) sum += exp(x[i] * 5.0 - mx);
    e = 0;
    for (int i = 0; i < 300; i++) e = dmax(e, fabs(o[i] - exp(x[i] * 5.0 - mx) / sum));
    snprintf(what, sizeof what, "softmax isa=%d err %.3g", isa, e);
    check(e < 1e-6, what);
    /* attention: 4 heads over 2 kv heads, 37 positions of 64 */
    enum { NH = 4, NKV = 2, HD = 32, NCTX = 64, NP = 37 };
    static float q[NH * HD], k[NKV * NCTX * HD], v[NKV * NCTX * HD], out[NH * HD];
    for (int i = 0; i < NH * HD; i++) q[i] = frand();
    for (int i = 0; i < NKV * NCTX * HD; i++) { k[i] = frand(); v[i] = frand(); }
    mr_attention_decode(q, k, v, 0, 0, NH, NKV, NCTX, HD, NP, 0.17f, 0, 0.0f, NULL, out, 2, isa); /* f32 keys and values */
    e = 0;
    for (int h = 0; h < NH; h++) {
        const int kv = h / (NH / NKV);
        double s[NP], m = -1e30, z = 0;
        for (int j = 0; j < NP; j++) {
            s[j] = 0;
            for (int d = 0; d < HD; d++) s[j] += (double)q[h * HD + d] * k[(kv * NCTX + j) * HD + d];
            s[j] *= 0.17;
            m = dmax(m, s[j]);
        }
        for (int j = 0; j < NP; j++) z += exp(s[j] - m);
        for (int d = 0; d < HD; d++) {
            double a = 0;
            for (int j = 0; j < NP; j++) a += exp(s[j] - m) / z * v[(kv * NCTX + j) * HD + d];
            e = dmax(e, fabs(a - out[h * HD + d]));
        }
    }
    snprintf(what, sizeof what, "attention isa=%d err %.3g", isa, e);
    check(e < 1e-5, what);
}

int main(void) {
    const int mask = mr_isa_mask();
    printf("isa mask %d, selected %d, physical cores %d\n", mask, mr_isa_selected(), mr_physical_cores());
    static const int64_t cases[][4] = {{1, 1, 1, 1}, {7, 1, 2, 2}, {37, 2, 3, 3}, {70, 5, 5, 2}, {33, 2, 17, 3},
                                       {45, 4, 40, 2}};
    for (int isa = 0; isa < MR_N_ISA; isa++) {
        if (!(mask & (1 << isa))) continue;
        for (size_t ti = 0; ti < sizeof TYPES / sizeof TYPES[0]; ti++) {
            const int unit = mr_types[TYPES[ti].id].block < 32 ? 32 : mr_types[TYPES[ti].id].block;
            for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
                test_matmul(isa, &TYPES[ti], cases[c][0], cases[c][1] * unit, cases[c][2], (int)cases[c][3]);
            const int punit = mr_pack_tile_cols(TYPES[ti].id);
            for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
                test_packed(isa, &TYPES[ti], cases[c][0], cases[c][1] * punit, cases[c][2], (int)cases[c][3]);
        }
        test_ops(isa);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
