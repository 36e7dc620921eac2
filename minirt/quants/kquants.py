"""The k-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K (256-element super-blocks).

Block layouts (byte offsets inside one super-block; f16 = IEEE binary16, little-endian). Element
``e`` of the 256 is written with the indices that the layout groups it by::

    Q2_K   84 B: scales[16] @0 | qs[64] @16 | d f16 @80 | dmin f16 @82
           e = 128*h + 32*s + l  (h<2, s<4, l<32);  q = (qs[32*h + l] >> 2*s) & 3
           group g = e // 16; sc = scales[g] & 15, mn = scales[g] >> 4
           x = (d * sc) * q - (dmin * mn)
    Q3_K  110 B: hmask[32] @0 | qs[64] @32 | scales[12] @96 | d f16 @108
           e = 128*h + 32*s + l;  q = ((qs[32*h + l] >> 2*s) & 3) - (0 if hmask[l] bit (4*h + s) else 4)
           group g = e // 16; 6-bit scale: low 4 bits = scales[g % 8] >> (4 * (g // 8)),
           high 2 bits = scales[8 + g % 4] >> (2 * (g // 4));  x = (d * (scale - 32)) * q
    Q4_K  144 B: d f16 @0 | dmin f16 @2 | scales[12] @4 | qs[128] @16
           e = 64*j + 32*n + l  (j<4, n<2);  q = (qs[32*j + l] >> 4*n) & 15
           sub-block b = 2*j + n; sc, mn = 6-bit scale/min b (see _common.k4_scales_mins)
           x = (d * sc) * q - (dmin * mn)
    Q5_K  176 B: d f16 @0 | dmin f16 @2 | scales[12] @4 | qh[32] @16 | qs[128] @48
           as Q4_K, plus q |= ((qh[l] >> b) & 1) << 4
    Q6_K  210 B: ql[128] @0 | qh[64] @128 | scales int8[16] @192 | d f16 @208
           e = 128*h + 32*s + l  (h<2, s<4);  low 4 bits = (ql[64*h + 32*(s % 2) + l] >> 4*(s // 2)) & 15,
           high 2 bits = (qh[32*h + l] >> 2*s) & 3;  x = (d * scales[e // 16]) * (q - 32)
    Q8_K  292 B: d f32 @0 | qs int8[256] @4 | bsums int16[16] @260 (sums of qs per 16, unused here)
           x = d * qs[e]

See ``legacy.py`` for what ``dequantize_blocks_*``, ``deq_row_*`` and ``dot_*`` are.
"""

from __future__ import annotations

import numpy as np

from ._common import f16_field, f32_field, k4_scales_mins, nb_f16, nb_k4_scale_min, nibbles
from ._jit import jit

QK_K = 256

# ---------------------------------------------------------------------------------------------
# numpy specs

_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit fields of ``(n, 64)`` bytes → ``(n, 2, 4, 32)``: [h, s, l] = (qs[32h + l] >> 2s) & 3."""
    return (qs.reshape(-1, 2, 1, 32) >> _SHIFT2) & np.uint8(3)


def dequantize_blocks_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K spec: ``(n, 84)`` → ``(n, 256)`` float32."""
    n = blocks.shape[0]
    sc = blocks[:, 0:16]
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)
    dl = (d * (sc & np.uint8(15)).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> np.uint8(4)).astype(np.float32)).reshape(n, 16, 1)
    q = _crumbs(blocks[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_scales(sc: np.ndarray) -> np.ndarray:
    """Q3_K: ``(n, 12)`` packed → ``(n, 16)`` signed 6-bit scales (already minus 32) as float32."""
    lo = np.concatenate([sc[:, 0:8] & np.uint8(15), sc[:, 0:8] >> np.uint8(4)], axis=1)
    hi = ((sc[:, None, 8:12] >> _SHIFT2.reshape(1, 4, 1)) & np.uint8(3)).reshape(-1, 16)
    return ((lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)


def dequantize_blocks_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K spec: ``(n, 110)`` → ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 108)
    dl = (d * _q3_scales(blocks[:, 96:108])).reshape(n, 16, 1)
    ql = _crumbs(blocks[:, 32:96]).reshape(n, 8, 32)
    # bit (4h + s) of hmask[l] belongs to element 128h + 32s + l
    hb = ((blocks[:, None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1))
    q = ql.astype(np.int8) - ((hb ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def dequantize_blocks_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K spec: ``(n, 144)`` → ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = k4_scales_mins(blocks[:, 4:16])
    dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    q = nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequantize_blocks_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K spec: ``(n, 176)`` → ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d, dmin = f16_field(blocks, 0), f16_field(blocks, 2)
    sc, mn = k4_scales_mins(blocks[:, 4:16])
    dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    ql = nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    hb = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = (ql | (hb << np.uint8(4))).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequantize_blocks_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K spec: ``(n, 210)`` → ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 208)
    dl = (d * blocks[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    # ql (n, 2, 2, 64) -> nibbles (n, 2, 2[nib], 2[half of 64], 32) ordered as s = 2*nib + half
    ql = nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 2, 4, 32)
    qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT2) & np.uint8(3)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def dequantize_blocks_q8_k(blocks: np.ndarray) -> np.ndarray:
    """Q8_K spec: ``(n, 292)`` → ``(n, 256)`` float32."""
    d = f32_field(blocks, 0)
    return d * blocks[:, 4:260].view(np.int8).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# numba row kernels (exact)


@jit()
def deq_row_q2_k(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 84
        d = nb_f16(src[o + 80], src[o + 81])
        dmin = nb_f16(src[o + 82], src[o + 83])
        for h in range(2):
            for s in range(4):
                for half in range(2):
                    g = h * 8 + s * 2 + half
                    sc = src[o + g]
                    dl = d * np.float32(sc & np.uint8(15))
                    ml = dmin * np.float32(sc >> np.uint8(4))
                    q0 = o + 16 + h * 32 + half * 16
                    e0 = b * 256 + h * 128 + s * 32 + half * 16
                    for l in range(16):
                        q = (src[q0 + l] >> np.uint8(2 * s)) & np.uint8(3)
                        dst[e0 + l] = dl * np.float32(q) - ml


@jit(inline=True)
def _q3_scale(src, o, g):  # pragma: no cover - compiled
    """Signed 6-bit scale g (0..15) of the Q3_K scale field at src[o:o+12]."""
    lo = (np.int32(src[o + (g & 7)]) >> (4 * (g >> 3))) & 15
    hi = (np.int32(src[o + 8 + (g & 3)]) >> (2 * (g >> 2))) & 3
    return (lo | (hi << 4)) - 32


@jit()
def deq_row_q3_k(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 110
        d = nb_f16(src[o + 108], src[o + 109])
        for h in range(2):
            for s in range(4):
                bit = h * 4 + s
                for half in range(2):
                    g = h * 8 + s * 2 + half
                    dl = d * np.float32(_q3_scale(src, o + 96, g))
                    e0 = b * 256 + h * 128 + s * 32 + half * 16
                    for l0 in range(16):
                        l = half * 16 + l0
                        ql = np.int32(src[o + 32 + h * 32 + l] >> np.uint8(2 * s)) & 3
                        hb = np.int32(src[o + l] >> np.uint8(bit)) & 1
                        dst[e0 + l0] = dl * np.float32(ql - 4 + 4 * hb)


@jit()
def deq_row_q4_k(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 144
        d = nb_f16(src[o], src[o + 1])
        dmin = nb_f16(src[o + 2], src[o + 3])
        for j in range(4):
            sc0, m0 = nb_k4_scale_min(src, o + 4, 2 * j)
            sc1, m1 = nb_k4_scale_min(src, o + 4, 2 * j + 1)
            d0 = d * np.float32(sc0)
            d1 = d * np.float32(sc1)
            mm0 = dmin * np.float32(m0)
            mm1 = dmin * np.float32(m1)
            e0 = b * 256 + j * 64
            for l in range(32):
                v = src[o + 16 + j * 32 + l]
                dst[e0 + l] = d0 * np.float32(v & np.uint8(15)) - mm0
                dst[e0 + 32 + l] = d1 * np.float32(v >> np.uint8(4)) - mm1


@jit()
def deq_row_q5_k(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 176
        d = nb_f16(src[o], src[o + 1])
        dmin = nb_f16(src[o + 2], src[o + 3])
        for j in range(4):
            sc0, m0 = nb_k4_scale_min(src, o + 4, 2 * j)
            sc1, m1 = nb_k4_scale_min(src, o + 4, 2 * j + 1)
            d0 = d * np.float32(sc0)
            d1 = d * np.float32(sc1)
            mm0 = dmin * np.float32(m0)
            mm1 = dmin * np.float32(m1)
            e0 = b * 256 + j * 64
            for l in range(32):
                v = np.int32(src[o + 48 + j * 32 + l])
                hv = np.int32(src[o + 16 + l])
                q0 = (v & 15) | (((hv >> (2 * j)) & 1) << 4)
                q1 = (v >> 4) | (((hv >> (2 * j + 1)) & 1) << 4)
                dst[e0 + l] = d0 * np.float32(q0) - mm0
                dst[e0 + 32 + l] = d1 * np.float32(q1) - mm1


@jit()
def deq_row_q6_k(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 210
        d = nb_f16(src[o + 208], src[o + 209])
        for h in range(2):
            for s in range(4):
                for half in range(2):
                    g = h * 8 + s * 2 + half
                    dl = d * np.float32(np.int8(src[o + 192 + g]))
                    e0 = b * 256 + h * 128 + s * 32 + half * 16
                    for l0 in range(16):
                        l = half * 16 + l0
                        lo = (np.int32(src[o + h * 64 + (s & 1) * 32 + l]) >> (4 * (s >> 1))) & 15
                        hi = (np.int32(src[o + 128 + h * 32 + l]) >> (2 * s)) & 3
                        dst[e0 + l0] = dl * np.float32((lo | (hi << 4)) - 32)


@jit()
def deq_row_q8_k(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 292
        d = src[o:o + 4].view(np.float32)[0]
        for l in range(256):
            dst[b * 256 + l] = d * np.float32(np.int8(src[o + 4 + l]))


# ---------------------------------------------------------------------------------------------
# numba fused dot kernels (decode). Signed quants are dotted with x in float32; the mins of
# Q2_K/Q4_K/Q5_K are applied through the per-16 sums ``xs`` of x (sum(d*q*x - m*x) =
# d*sum(q*x) - m*sum(x)), as ggml does.


@jit(fastmath=True)
def dot_q2_k(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see module docstring)
    acc = np.float32(0)
    for b in range(x.shape[0] // 256):
        o = b * 84
        sq = np.float32(0)
        sm = np.float32(0)
        for h in range(2):
            for s in range(4):
                g = h * 8 + s * 2
                e0 = b * 256 + h * 128 + s * 32
                shift = np.uint8(2 * s)
                t0 = np.float32(0)
                t1 = np.float32(0)
                for l in range(n16):
                    v0 = w[o + 16 + h * 32 + l]
                    v1 = w[o + 16 + h * 32 + 16 + l]
                    t0 += np.float32(np.uint8((v0 >> shift) & np.uint8(3))) * x[e0 + l]
                    t1 += np.float32(np.uint8((v1 >> shift) & np.uint8(3))) * x[e0 + 16 + l]
                c0 = w[o + g]
                c1 = w[o + g + 1]
                sq += np.float32(c0 & np.uint8(15)) * t0 + np.float32(c1 & np.uint8(15)) * t1
                sm += np.float32(c0 >> np.uint8(4)) * xs[e0 // 16] + np.float32(c1 >> np.uint8(4)) * xs[e0 // 16 + 1]
        acc += nb_f16(w[o + 80], w[o + 81]) * sq - nb_f16(w[o + 82], w[o + 83]) * sm
    return acc


@jit(fastmath=True)
def dot_q3_k(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see module docstring)
    acc = np.float32(0)
    for b in range(x.shape[0] // 256):
        o = b * 110
        sq = np.float32(0)
        for h in range(2):
            for s in range(4):
                g = h * 8 + s * 2
                e0 = b * 256 + h * 128 + s * 32
                shift = np.uint8(2 * s)
                bit = np.uint8(h * 4 + s)
                t0 = np.float32(0)
                t1 = np.float32(0)
                for l in range(n16):
                    # q + 4 = low 2 bits + 4 * hmask bit, in 0..7; q itself in int8 lanes
                    v0 = (((w[o + 32 + h * 32 + l] >> shift) & np.uint8(3))
                          | (((w[o + l] >> bit) & np.uint8(1)) << np.uint8(2)))
                    v1 = (((w[o + 48 + h * 32 + l] >> shift) & np.uint8(3))
                          | (((w[o + 16 + l] >> bit) & np.uint8(1)) << np.uint8(2)))
                    t0 += np.float32(np.int8(np.uint8(v0) - np.uint8(4))) * x[e0 + l]
                    t1 += np.float32(np.int8(np.uint8(v1) - np.uint8(4))) * x[e0 + 16 + l]
                sq += np.float32(_q3_scale(w, o + 96, g)) * t0 + np.float32(_q3_scale(w, o + 96, g + 1)) * t1
        acc += nb_f16(w[o + 108], w[o + 109]) * sq
    return acc


@jit(fastmath=True)
def dot_q4_k(w, x, xs, scratch):  # pragma: no cover - compiled
    n32 = 32 | (x.shape[0] >> 62)  # = 32
    acc = np.float32(0)
    for b in range(x.shape[0] // 256):
        o = b * 144
        sq = np.float32(0)
        sm = np.float32(0)
        for j in range(4):
            sc0, m0 = nb_k4_scale_min(w, o + 4, 2 * j)
            sc1, m1 = nb_k4_scale_min(w, o + 4, 2 * j + 1)
            q = o + 16 + 32 * j
            e0 = b * 256 + 64 * j
            t0 = np.float32(0)
            t1 = np.float32(0)
            for l in range(n32):
                v = w[q + l]
                t0 += np.float32(np.uint8(v & np.uint8(15))) * x[e0 + l]
                t1 += np.float32(np.uint8(v >> np.uint8(4))) * x[e0 + 32 + l]
            k = e0 // 16
            sq += np.float32(sc0) * t0 + np.float32(sc1) * t1
            sm += np.float32(m0) * (xs[k] + xs[k + 1]) + np.float32(m1) * (xs[k + 2] + xs[k + 3])
        acc += nb_f16(w[o], w[o + 1]) * sq - nb_f16(w[o + 2], w[o + 3]) * sm
    return acc


@jit(fastmath=True)
def dot_q5_k(w, x, xs, scratch):  # pragma: no cover - compiled
    n32 = 32 | (x.shape[0] >> 62)  # = 32
    acc = np.float32(0)
    for b in range(x.shape[0] // 256):
        o = b * 176
        sq = np.float32(0)
        sm = np.float32(0)
        for j in range(4):
            sc0, m0 = nb_k4_scale_min(w, o + 4, 2 * j)
            sc1, m1 = nb_k4_scale_min(w, o + 4, 2 * j + 1)
            q = o + 48 + 32 * j
            e0 = b * 256 + 64 * j
            bit0 = np.uint8(1 << (2 * j))
            bit1 = np.uint8(2 << (2 * j))
            t0 = np.float32(0)
            t1 = np.float32(0)
            for l in range(n32):
                v = w[q + l]
                hv = w[o + 16 + l]
                # the 5th bit as a select (vectorizes as a masked add, like Q5_0)
                f0 = np.float32(np.uint8(v & np.uint8(15))) + (np.float32(16) if hv & bit0 else np.float32(0))
                f1 = np.float32(np.uint8(v >> np.uint8(4))) + (np.float32(16) if hv & bit1 else np.float32(0))
                t0 += f0 * x[e0 + l]
                t1 += f1 * x[e0 + 32 + l]
            k = e0 // 16
            sq += np.float32(sc0) * t0 + np.float32(sc1) * t1
            sm += np.float32(m0) * (xs[k] + xs[k + 1]) + np.float32(m1) * (xs[k + 2] + xs[k + 3])
        acc += nb_f16(w[o], w[o + 1]) * sq - nb_f16(w[o + 2], w[o + 3]) * sm
    return acc


@jit(fastmath=True)
def dot_q6_k(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see module docstring)
    acc = np.float32(0)
    for b in range(x.shape[0] // 256):
        o = b * 210
        sq = np.float32(0)
        for h in range(2):
            e0 = b * 256 + h * 128
            ql = o + h * 64
            qh = o + 128 + h * 32
            for half in range(2):
                t0 = np.float32(0)
                t1 = np.float32(0)
                t2 = np.float32(0)
                t3 = np.float32(0)
                for l0 in range(n16):
                    l = half * 16 + l0
                    a = w[ql + l]
                    c = w[ql + 32 + l]
                    hh = w[qh + l]
                    # q + 32 in 0..63, then q in int8 lanes (signed: no cancellation in t)
                    q0 = (a & np.uint8(15)) | ((hh & np.uint8(3)) << np.uint8(4))
                    q1 = (c & np.uint8(15)) | (((hh >> np.uint8(2)) & np.uint8(3)) << np.uint8(4))
                    q2 = (a >> np.uint8(4)) | (((hh >> np.uint8(4)) & np.uint8(3)) << np.uint8(4))
                    q3 = (c >> np.uint8(4)) | ((hh >> np.uint8(6)) << np.uint8(4))
                    t0 += np.float32(np.int8(np.uint8(q0) - np.uint8(32))) * x[e0 + l]
                    t1 += np.float32(np.int8(np.uint8(q1) - np.uint8(32))) * x[e0 + 32 + l]
                    t2 += np.float32(np.int8(np.uint8(q2) - np.uint8(32))) * x[e0 + 64 + l]
                    t3 += np.float32(np.int8(np.uint8(q3) - np.uint8(32))) * x[e0 + 96 + l]
                sc = o + 192 + h * 8 + half  # scale of (s = 0, this half); s adds 2 groups
                sq += (np.float32(np.int8(w[sc])) * t0 + np.float32(np.int8(w[sc + 2])) * t1
                       + np.float32(np.int8(w[sc + 4])) * t2 + np.float32(np.int8(w[sc + 6])) * t3)
        acc += nb_f16(w[o + 208], w[o + 209]) * sq
    return acc


@jit(fastmath=True)
def dot_q8_k(w, x, xs, scratch):  # pragma: no cover - compiled
    acc = np.float32(0)
    for b in range(x.shape[0] // 256):
        o = b * 292
        s = np.float32(0)
        for l in range(256):
            s += np.float32(np.int8(w[o + 4 + l])) * x[b * 256 + l]
        acc += w[o:o + 4].view(np.float32)[0] * s
    return acc
