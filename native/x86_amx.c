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
 * Tiles (one configuration per thread, loaded at its first call; every tile 16 rows x 64 bytes): 0, 1 C (16
 * tokens x 16 rows float32, row halves 0 / 1); 2, 3 A hi / lo (16 tokens x 32 columns); 4, 5 B hi / lo of row
 * half 0, 6, 7 of row half 1. */
#include "common.h"

#ifdef MR_X86
#include <cpuid.h>
#include <immintrin.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

mr_kernels mr_kernels_amx;

#if defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define MR_HAVE_AMX 1

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,amx-tile,amx-bf16")
#endif

#include "x86_avx512_inl.h"

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static __thread int cfg_loaded;

static void load_cfg(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    /* not _tile_loadconfig: GCC 11-12 declare its operand as the first 8 bytes only, and dropped the stores of
     * the rest as dead (SIGILL: a zero configuration) */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
    cfg_loaded = 1;
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
    if (!cfg_loaded) load_cfg();
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
    return 1;
#else
    (void)k;
    (void)avx512;
    return 0;
#endif
}
#endif /* MR_X86 */
