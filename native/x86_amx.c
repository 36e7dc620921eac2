/* AMX (Advanced Matrix Extensions) matmul for many tokens: the "avx512_amx" ISA is the AVX-512 table plus this
 * path, which prefills of every weight type take from MR_AMX_MIN_TOKENS tokens on (dispatch.c, run_float).
 *
 * Weights are dequantized to float32 as the float paths do (dq_rows: 32 rows at a time), activations are
 * float32; AMX multiplies bf16 tiles (8 significant bits) with float32 accumulation, so each factor is
 * split into two bf16, v = hi + lo (both rounded to nearest: |v - hi - lo| <= 2^-16 |v|), and a product is
 * hi*hi + hi*lo + lo*hi (lo*lo, at most 2^-16 of it, left out): about the precision of the integer path's
 * int16 activations (2^-16 of a block's largest value), three tile products per pair of tiles.
 *
 * Shapes at the boundary:
 *   x: mr_amx_prep_x writes xh, xl (ntp, cols) bf16, ntp = nt rounded up to 16 (rows beyond nt zero);
 *   w: mr_amx_prep_w turns nr <= 32 float rows (row stride cols) into wt: per 32-column block b and 16-row
 *      half h, the hi then the lo tile (16 column pairs x 16 rows x 2 bf16, 1 KB each): wt + ((2b + h) * 2 +
 *      part) * 512 (uint16 units); rows >= nr zero;
 *   y[t * ys + r] for t < nt, r < nr (mr_amx_rows).
 *
 * Tiles (CFG_BF16, every tile 16 rows x 64 bytes; a thread loads a configuration when its next call needs another
 * than the last one, see load_cfg): 0, 1 C (16 tokens x 16 rows float32, row halves 0 / 1); 2, 3 A hi / lo (16
 * tokens x 32 columns); 4, 5 B hi / lo of row half 0, 6, 7 of row half 1.
 *
 * The second half of this file runs the integer GEMM on int8 tiles (below). */
#include "common.h"

#ifdef MR_X86
#include <cpuid.h>
#include <immintrin.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

mr_kernels mr_kernels_amx;

/* From this many tokens on, packed matrices take the int8-tile GEMM (below) instead of the decode kernels
 * (bench/kernels.py --tokens 8 / 12 / 16: 1.0x / 1.1-1.3x / 1.1-1.5x the decode kernels' time on Q4_0, Q5_0, Q8_0,
 * Q4_K). Q6_K's per-16 scales take two tile steps a block: from 13 tokens (GB/s against the decode kernels at
 * 10 / 12 / 14 / 16 tokens, 4864x1024 and 1024x4864: 0.88x / 1.0x / 1.14x / 1.2x). */
#define MR_AMX8_MIN_TOKENS 10
#define MR_AMX8_MIN_TOKENS_Q6_K 13

#if defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define MR_HAVE_AMX 1

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,amx-tile,amx-bf16,amx-int8"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,amx-tile,amx-bf16,amx-int8")
#endif

#include "x86_avx512_inl.h"

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static __thread int cfg_loaded; /* the configuration this thread's tiles have: 0 none, else a CFG_ */
enum { CFG_BF16 = 1, CFG_INT8, CFG_INT8_16 };

static void load_cfg(int id) {
    if (cfg_loaded == id) return;
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    if (id != CFG_BF16) { /* the int8 GEMM below: weights 16 rows x K, activations K / 4 rows, sums 16 x 16 */
        const int k = id == CFG_INT8 ? 32 : 16;
        c.colsb[0] = c.colsb[1] = (uint16_t)k;
        c.rows[2] = c.rows[3] = (uint8_t)(k / 4);
    }
    /* not _tile_loadconfig: GCC 11-12 declare its operand as the first 8 bytes only, and dropped the stores of
     * the rest as dead (SIGILL: a zero configuration) */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
    cfg_loaded = id;
}

/* 16 floats -> their bf16 hi and lo parts (each rounded to nearest even), as the low 16 bits of 32-bit lanes */
MR_INLINE void split16(__m512 v, __m512i *hi, __m512i *lo) {
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff), top = _mm512_set1_epi32((int)0xffff0000u);
    __m512i b = _mm512_castps_si512(v);
    __m512i r = _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(b, 16), one))), top);
    *hi = _mm512_srli_epi32(r, 16);
    b = _mm512_castps_si512(_mm512_sub_ps(v, _mm512_castsi512_ps(r)));
    r = _mm512_add_epi32(b, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(b, 16), one)));
    *lo = _mm512_srli_epi32(r, 16);
}

/* 32 floats -> 32 bf16 hi (one vector, in order) and 32 lo */
MR_INLINE void split32(const float *src, __m512i *hi, __m512i *lo) {
    __m512i h0, l0, h1, l1;
    split16(_mm512_loadu_ps(src), &h0, &l0);
    split16(_mm512_loadu_ps(src + 16), &h1, &l1);
    *hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(h0)), _mm512_cvtepi32_epi16(h1), 1);
    *lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(l0)), _mm512_cvtepi32_epi16(l1), 1);
}

void mr_amx_prep_x(const float *x, int64_t nt, int64_t xs, int64_t cols, uint16_t *xh, uint16_t *xl) {
    const int64_t ntp = (nt + 15) & ~(int64_t)15;
    for (int64_t t = 0; t < ntp; t++)
        for (int64_t c = 0; c < cols; c += 32) {
            __m512i h = _mm512_setzero_si512(), l = h;
            if (t < nt) split32(x + t * xs + c, &h, &l);
            _mm512_storeu_si512((void *)(xh + t * cols + c), h);
            _mm512_storeu_si512((void *)(xl + t * cols + c), l);
        }
}

void mr_amx_prep_w(const float *w, int nr, int64_t cols, uint16_t *wt) {
    const int64_t nb = cols / 32;
    for (int64_t b = 0; b < nb; b++)
        for (int h = 0; h < 2; h++) {
            __m512 vh[16], vl[16];
            for (int r = 0; r < 16; r++) {
                __m512i hi = _mm512_setzero_si512(), lo = hi;
                if (16 * h + r < nr) split32(w + (16 * h + r) * cols + 32 * b, &hi, &lo);
                vh[r] = _mm512_castsi512_ps(hi); /* lane k: the pair of columns 2k, 2k + 1 of row r */
                vl[r] = _mm512_castsi512_ps(lo);
            }
            transpose16(vh); /* vector k, lane r: pair k of row r (B's row k) */
            transpose16(vl);
            uint16_t *o = wt + ((2 * b + h) * 2) * 512;
            for (int k = 0; k < 16; k++) {
                _mm512_storeu_ps((float *)(void *)(o + 32 * k), vh[k]);
                _mm512_storeu_ps((float *)(void *)(o + 512 + 32 * k), vl[k]);
            }
        }
}

/* C tile c (16 tokens from t0 x 16 rows from r0) -> y, only the tokens < nt and rows < nr */
MR_INLINE void store_c(int c, float *y, int64_t ys, int64_t t0, int64_t nt, int r0, int nr) {
    const int nrow = nr - r0 < 16 ? nr - r0 : 16, ntok = nt - t0 < 16 ? (int)(nt - t0) : 16;
    if (nrow == 16 && ntok == 16) { /* straight into y: row stride ys floats */
        if (c == 0) _tile_stored(0, y + t0 * ys + r0, ys * 4);
        else _tile_stored(1, y + t0 * ys + r0, ys * 4);
        return;
    }
    float tmp[256] __attribute__((aligned(64)));
    if (c == 0) _tile_stored(0, tmp, 64);
    else _tile_stored(1, tmp, 64);
    for (int t = 0; t < ntok; t++) memcpy(y + (t0 + t) * ys + r0, tmp + 16 * t, (size_t)nrow * 4);
}

void mr_amx_rows(const uint16_t *wt, int nr, int64_t cols, const uint16_t *xh, const uint16_t *xl, int64_t nt, float *y,
                 int64_t ys) {
    load_cfg(CFG_BF16);
    __asm__ volatile("" ::: "memory"); /* GCC's tileloadd names no memory operand: the operands' stores first */
    const int64_t nb = cols / 32, xstride = cols * 2;
    const int two = nr > 16;
    for (int64_t t0 = 0; t0 < nt; t0 += 16) {
        _tile_zero(0);
        _tile_zero(1);
        const uint16_t *ah = xh + t0 * cols, *al = xl + t0 * cols;
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *bt = wt + (4 * b) * 512;
            _tile_loadd(2, ah + 32 * b, xstride);
            _tile_loadd(3, al + 32 * b, xstride);
            _tile_loadd(4, bt, 64);
            _tile_loadd(5, bt + 512, 64);
            _tile_dpbf16ps(0, 2, 4);
            _tile_dpbf16ps(0, 2, 5);
            _tile_dpbf16ps(0, 3, 4);
            if (two) {
                _tile_loadd(6, bt + 1024, 64);
                _tile_loadd(7, bt + 1536, 64);
                _tile_dpbf16ps(1, 2, 6);
                _tile_dpbf16ps(1, 2, 7);
                _tile_dpbf16ps(1, 3, 6);
            }
        }
        store_c(0, y, ys, t0, nt, 0, nr);
        if (two) store_c(1, y, ys, t0, nt, 16, nr);
    }
}

/* ---------------------------------------------------------------- int8 tiles on the integer GEMM's values
 *
 * The integer GEMM (x86_avx512_gemm.c) for few tokens (a batched decode step, the prompts of a batch): the same
 * weights (unpacked by gw8 straight to int8: every packed type's integers fit) and the same int16 activations per
 * 32-block, each split exactly into a signed high byte and an unsigned low byte, x = 256 hi + lo. Per 32-block
 * (16 for Q6_K's scales) and 16 rows, two tile products give the integer sums of w hi and w lo for 16 tokens
 * (tdpbssd, tdpbsud); 256 * the first + the second is the int32 sum the int16 kernel's vpdpwssd forms, so its
 * float conversion and scaling (same order) give the int16 GEMM's results bit for bit. What the tiles save: the
 * int16 kernel spends a broadcast and a vpdpwssd per weight pair, row and 16 tokens; here the vector units only
 * scale the 16 x 16 block sums.
 *
 * Measured on the Xeon this was written on (2 vCPUs): a step (tile loads, 2 products, 2 tile stores) takes
 * ~21 ns and the scaling of its sums ~17 ns, and the two add up: AMX and AVX-512 work do not overlap there.
 * Hence the 16-row tiles, one tile set per step, and no further pipelining. bf16 tiles on the same integers
 * (exact: hi * 256 and lo as bf16, both products accumulated into one float tile, one store and two vector
 * instructions a row) measured 13 ns + 13 ns per step in isolation but slower in the GEMM (twice the bytes of
 * unpacked weights and activations), and were not kept.
 *
 * Shapes at the boundary:
 *   activations (amx8_xpanel): the mr_xp panel with q holding, per 16-token group g and block b, at byte
 *     (g nb + b) * 1024: hi (8 rows x 16 tokens x 4 bytes: row k, token j = hi bytes of columns 4k..4k+3) then
 *     lo (the same, low bytes); d and ds as the int16 panel;
 *   weights: nr <= 16 rows of int8 (row stride cols bytes), scales wd[16 k + r] per K step k, mins wm[16 b + r]
 *     (gw8's form); pf, pfn: packed tiles to prefetch on the way (the group unpacked next);
 *   y[t * ys + r] for r < nr, t < nt.
 * Bounds: |hi| <= 128, lo <= 255, |w| <= 128: per block |256 sum w hi| <= 2^27, sum w lo < 2^20, within int32.
 *
 * Tiles (CFG_INT8, CFG_INT8_16 for per-16 scales): 0, 1 weights (16 rows x 32 / 16 columns, alternating steps),
 * 2, 3 activations hi / lo (8 / 4 rows of 4 columns x 16 tokens), 4, 5 and 6, 7 sums hi / lo (16 rows x 16
 * tokens int32, alternating steps). */

static void amx8_xpanel(const float *x, int64_t nt, int64_t xs, int64_t cols, float *tmp, mr_xp *xp) {
    xp_panel(x, nt, xs, cols, tmp, xp, 1);
}

/* the int32 sums of one K step (hi at c, lo at c + 256: 16 rows x 16 tokens), row r -> f += float(256 hi + lo) *
 * (dx * wd_r), then - ds * wm_r */
MR_INLINE __m512 amx8_scale_row(__m512 f, const int32_t *c, int r, __m512 dx, __m512 ds, const float *wd,
                                const float *wm, const int MIN) {
    const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)(c + 16 * r)), 8),
                                       _mm512_load_si512((const void *)(c + 256 + 16 * r)));
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dx, _mm512_set1_ps(wd[r])), f);
    return MIN ? _mm512_fnmadd_ps(ds, _mm512_set1_ps(wm[r]), f) : f;
}
/* the 16 accumulators are named variables, not an array: GCC kept an array of them in memory, a load and a store
 * per row and step (a 16-sequence decode step of Qwen2.5-0.5B 60.0 -> 58.7 ms) */
#define AMX8_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

/* one K step (a 32-block, or half of one for per-16 scales: the configuration gives the width) of 16 rows in the
 * tile set P (0 or 1: weights P, sums 4 + 2P, 5 + 2P): weights at w (row stride cols), activations hi / lo at
 * xh, xl -> the int32 sums stored at c */
#define AMX8_STEP(A, CH, CL)                                                                                    \
    do {                                                                                                           \
        _tile_loadd(A, w, cols);                                                                                   \
        _tile_zero(CH);                                                                                            \
        _tile_zero(CL);                                                                                            \
        _tile_dpbssd(CH, A, 2);                                                                                    \
        _tile_dpbsud(CL, A, 3);                                                                                    \
        _tile_stored(CH, c, 64);                                                                                   \
        _tile_stored(CL, c + 256, 64);                                                                             \
    } while (0)

MR_INLINE void amx8_step(const int8_t *w, int64_t cols, const uint8_t *xh, const uint8_t *xl, int32_t *c, const int P) {
    _tile_loadd(2, xh, 64);
    _tile_loadd(3, xl, 64);
    if (P) AMX8_STEP(1, 6, 7); /* tile numbers are immediates */
    else AMX8_STEP(0, 4, 5);
}

/* K step s of 16 rows: block s, or (per-16 scales) half s % 2 of block s / 2 (activation rows 4h..4h+3) */
MR_INLINE void amx8_step_at(const int8_t *w8, int64_t cols, const uint8_t *xq, int64_t s, int32_t *c, const int S16) {
    const int64_t b = S16 ? s >> 1 : s, h = S16 ? s & 1 : 0;
    const int8_t *w = w8 + 32 * b + 16 * h;
    const uint8_t *xh = xq + b * 1024 + 256 * h;
    if (s & 1) amx8_step(w, cols, xh, xh + 512, c, 1);
    else amx8_step(w, cols, xh, xh + 512, c, 0);
}

/* 16 rows x one group of 16 tokens. Software-pipelined: step s + 1's tiles (the other tile set, the other half of
 * c) are issued before step s's sums are scaled, so that the vector loads of those sums do not wait for the tile
 * stores just issued (measured: the store-to-load wait was most of the time otherwise). */
MR_INLINE void amx8_group(const int8_t *w8, const float *wd, const float *wm, int nr, int64_t cols, const mr_xp *x,
                          int64_t g, int64_t nt, float *y, int64_t ys, const uint8_t *pf, int64_t pfn, const int MIN,
                          const int S16) {
    const int64_t nb = x->nb, ns = S16 ? 2 * nb : nb;
    const uint8_t *xq = (const uint8_t *)x->q + g * nb * 1024;
    int32_t c[2][512] __attribute__((aligned(64)));
#define AMX8_ZERO(r) __m512 f##r = _mm512_setzero_ps();
    AMX8_ROWS(AMX8_ZERO)
    amx8_step_at(w8, cols, xq, 0, c[0], S16);
    const int64_t per = (pfn / 64 + ns - 1) / ns; /* prefetched lines per step */
    for (int64_t s = 0; s < ns; s++) {
        for (int64_t i = 0, o = s * per * 64; i < per && o < pfn; i++, o += 64) __builtin_prefetch(pf + o, 0, 3);
        if (s + 1 < ns) amx8_step_at(w8, cols, xq, s + 1, c[(s + 1) & 1], S16);
        const int64_t b = S16 ? s >> 1 : s;
        const __m512 dx = _mm512_loadu_ps(x->d + (g * nb + b) * 16);
        const __m512 ds = MIN ? _mm512_loadu_ps(x->ds + (g * nb + b) * 16) : dx;
        const int32_t *cs = c[s & 1];
        const float *wds = wd + 16 * s, *wms = wm + 16 * s;
#define AMX8_SCALE(r) f##r = amx8_scale_row(f##r, cs, r, dx, ds, wds, wms, MIN);
        AMX8_ROWS(AMX8_SCALE)
    }
    const int64_t t0 = 16 * g;
    const int n = (int)(nt - t0 < 16 ? nt - t0 : 16);
#define AMX8_LIST(r) f##r,
    __m512 f[16] = {AMX8_ROWS(AMX8_LIST)};
#undef AMX8_ZERO
#undef AMX8_SCALE
#undef AMX8_LIST
    transpose16(f); /* f[j] lane r: token j, row r */
    const __mmask16 k = (__mmask16)((1u << nr) - 1);
    for (int j = 0; j < n; j++) _mm512_mask_storeu_ps(y + (t0 + j) * ys, k, f[j]);
}

/* the gemm_rows contract (common.h), nr <= 16, with wu, wd, wm in gw8's form; pf / pfn prefetched during the first
 * token group, a few lines a step */
static void amx8_rows(const int16_t *wu, const float *wd, const float *wm, int nr, int64_t cols, const mr_xp *x,
                      int64_t nt, float *y, int64_t ys, int s16, const uint8_t *pf, int64_t pfn) {
    load_cfg(s16 ? CFG_INT8_16 : CFG_INT8);
    __asm__ volatile("" ::: "memory"); /* GCC's tileloadd names no memory operand: the operands' stores first */
    const int8_t *w8 = (const int8_t *)(const void *)wu;
    for (int64_t g = 0; g < x->ng; g++) {
        const uint8_t *p = g ? NULL : pf; /* prefetched during the first token group */
        const int64_t n = g ? 0 : pfn;
        if (wm) amx8_group(w8, wd, wm, nr, cols, x, g, nt, y, ys, p, n, 1, 0);
        else if (s16) amx8_group(w8, wd, wd, nr, cols, x, g, nt, y, ys, p, n, 0, 1);
        else amx8_group(w8, wd, wd, nr, cols, x, g, nt, y, ys, p, n, 0, 0);
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

/* CPUID: AMX-TILE and AMX-BF16 (leaf 7 EDX bits 24, 22); the OS enables tile state in XCR0 (bits 17, 18); Linux
 * grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, which must precede any tile instruction) */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* AMX-INT8 (CPUID leaf 7 EDX bit 25), on top of amx_usable */
static int amx_int8_usable(void) {
    unsigned a, b, c, d;
    const char *e = getenv("MINIRT_AMX_INT8");
    return !(e && !strcmp(e, "0")) && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
}
#endif /* compiler with AMX */

/* 1 when this CPU, OS and compiler run the AMX path (then *k is the AVX-512 table with it); 0 otherwise.
 * MINIRT_AMX=0 leaves it out. */
int mr_init_amx(mr_kernels *k, const mr_kernels *avx512) {
#ifdef MR_HAVE_AMX
    const char *e = getenv("MINIRT_AMX");
    if ((e && !strcmp(e, "0")) || !amx_usable()) return 0;
    *k = *avx512;
    k->amx_prep_x = mr_amx_prep_x;
    k->amx_prep_w = mr_amx_prep_w;
    k->amx_rows = mr_amx_rows;
    if (amx_int8_usable()) {
        k->gemm_xpanel = amx8_xpanel;
        k->gemm_rows = amx8_rows;
        k->gemm_i8 = 1;
        k->gemm_min_t[GT_Q4_0] = k->gemm_min_t[GT_Q5_0] = k->gemm_min_t[GT_Q8_0] = k->gemm_min_t[GT_Q4_K] = MR_AMX8_MIN_TOKENS;
        k->gemm_min_t[GT_Q6_K] = MR_AMX8_MIN_TOKENS_Q6_K;
    }
    return 1;
#else
    (void)k;
    (void)avx512;
    return 0;
#endif
}
#endif /* MR_X86 */
