"""Device functions that dequantize weights straight from raw ggml blocks.

Every function has the signature ``deq(w8, w16, w32, r, c0, out)``: it writes the 8 weights
``W[r, c0 .. c0+7]`` (``c0`` a multiple of 8) as float32 into the local array ``out``. The
weight is one uploaded tensor seen three ways over the same VRAM:

- ``w8``  uint8   ``(rows, row_bytes)``   — the raw blocks, byte for byte as in the GGUF file;
- ``w16`` float16 ``(rows, row_bytes/2)`` — the same bytes read as halves (every ggml block has
  an even size and its f16 scales at even offsets, so ``d`` of the block at byte ``base + o`` is
  ``w16[r, (base + o) // 2]``);
- ``w32`` float32 ``(rows, cols)``        — only for F32 weights (a 1x1 dummy otherwise).

Groups of 8 never straddle a block or a sub-block scale (sub-blocks are 16 or 32 wide), so each
function decodes its scales once per group. Layouts follow ggml (``ggml-quants.c``) and are
checked value for value against ``gguf.quants.dequantize`` in the tests.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32

from ...quants import iqgrids
from ...quants.mxfp4 import KVALUES as _KV_MXFP4
from ...quants.mxfp4 import e8m0_half

GROUP = 8  # weights decoded per call

# bytes per block / weights per block of every type with a device dequantizer
TYPE_SIZES = {
    "F32": (4, 1), "F16": (2, 1),
    "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
    "Q2_K": (84, 256), "Q3_K": (110, 256), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256),
    "IQ2_XXS": (66, 256), "IQ2_XS": (74, 256), "IQ2_S": (82, 256), "IQ3_XXS": (98, 256), "IQ3_S": (110, 256),
    "IQ1_S": (50, 256), "IQ1_M": (56, 256), "TQ1_0": (54, 256), "TQ2_0": (66, 256), "MXFP4": (17, 32),
}

# Codebooks as device constants (see minirt/quants/iqgrids.py). A group of 8 weights is one grid entry
# of the IQ1/IQ2 types, two of the IQ3 ones, so each group reads one sign byte and one scale.
_G_IQ2XXS = iqgrids.grid("iq2xxs").astype(np.int32)
_G_IQ2XS = iqgrids.grid("iq2xs").astype(np.int32)
_G_IQ2S = iqgrids.grid("iq2s").astype(np.int32)
_G_IQ3XXS = iqgrids.grid("iq3xxs").astype(np.int32)
_G_IQ3S = iqgrids.grid("iq3s").astype(np.int32)
_G_IQ1S = iqgrids.grid("iq1s").view(np.int8).astype(np.int32)
_KSIGNS = iqgrids.KSIGNS.astype(np.int32)
_E8M0 = e8m0_half(np.arange(256, dtype=np.uint8))
_KV4 = _KV_MXFP4.astype(np.float32)
# 2**(e-25) per half-precision exponent field (see minirt/quants/_common.py), for IQ1_M's scattered d
_F16_SCALE = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 31)] + [0.0], dtype=np.float32)


@cuda.jit(device=True, inline=True)
def _i8(b):
    """uint8 byte → signed value."""
    v = int32(b)
    return v - 256 if v >= 128 else v


@cuda.jit(device=True)
def deq_f32(w8, w16, w32, r, c0, out):
    for i in range(8):
        out[i] = w32[r, c0 + i]


@cuda.jit(device=True)
def deq_f16(w8, w16, w32, r, c0, out):
    for i in range(8):
        out[i] = float32(w16[r, c0 + i])


@cuda.jit(device=True)
def deq_q8_0(w8, w16, w32, r, c0, out):
    # block: d f16 | qs int8[32]
    b = c0 // 32
    base = b * 34
    d = float32(w16[r, b * 17])
    q = base + 2 + (c0 - b * 32)
    for i in range(8):
        out[i] = d * float32(_i8(w8[r, q + i]))


@cuda.jit(device=True)
def deq_q4_0(w8, w16, w32, r, c0, out):
    # block: d f16 | qs[16]; weight j < 16 is the low nibble of qs[j], j >= 16 the high one of qs[j-16]
    b = c0 // 32
    j0 = c0 - b * 32
    base = b * 18
    d = float32(w16[r, b * 9])
    if j0 < 16:
        for i in range(8):
            out[i] = d * float32(int32(w8[r, base + 2 + j0 + i] & 15) - 8)
    else:
        for i in range(8):
            out[i] = d * float32(int32(w8[r, base + 2 + j0 - 16 + i] >> 4) - 8)


@cuda.jit(device=True)
def deq_q4_1(w8, w16, w32, r, c0, out):
    # block: d f16 | m f16 | qs[16]; w = d * q + m
    b = c0 // 32
    j0 = c0 - b * 32
    base = b * 20
    d = float32(w16[r, b * 10])
    m = float32(w16[r, b * 10 + 1])
    if j0 < 16:
        for i in range(8):
            out[i] = d * float32(w8[r, base + 4 + j0 + i] & 15) + m
    else:
        for i in range(8):
            out[i] = d * float32(w8[r, base + 4 + j0 - 16 + i] >> 4) + m


@cuda.jit(device=True)
def _qh32(w8, r, o):
    """Little-endian uint32 at byte offset o of row r."""
    return (int32(w8[r, o]) | (int32(w8[r, o + 1]) << 8) | (int32(w8[r, o + 2]) << 16)
            | (int32(w8[r, o + 3]) << 24))


@cuda.jit(device=True)
def deq_q5_0(w8, w16, w32, r, c0, out):
    # block: d f16 | qh u32 (bit j = 5th bit of weight j) | qs[16]; w = d * (q - 16)
    b = c0 // 32
    j0 = c0 - b * 32
    base = b * 22
    d = float32(w16[r, b * 11])
    qh = _qh32(w8, r, base + 2)
    for i in range(8):
        j = j0 + i
        if j < 16:
            lo = int32(w8[r, base + 6 + j] & 15)
        else:
            lo = int32(w8[r, base + 6 + j - 16] >> 4)
        hb = (qh >> j) & 1
        out[i] = d * float32((lo | (hb << 4)) - 16)


@cuda.jit(device=True)
def deq_q5_1(w8, w16, w32, r, c0, out):
    # block: d f16 | m f16 | qh u32 | qs[16]; w = d * q + m
    b = c0 // 32
    j0 = c0 - b * 32
    base = b * 24
    d = float32(w16[r, b * 12])
    m = float32(w16[r, b * 12 + 1])
    qh = _qh32(w8, r, base + 4)
    for i in range(8):
        j = j0 + i
        if j < 16:
            lo = int32(w8[r, base + 8 + j] & 15)
        else:
            lo = int32(w8[r, base + 8 + j - 16] >> 4)
        hb = (qh >> j) & 1
        out[i] = d * float32(lo | (hb << 4)) + m


@cuda.jit(device=True)
def deq_q2_k(w8, w16, w32, r, c0, out):
    # block (256): scales[16] (lo4 scale, hi4 min) | qs[64] | d f16 | dmin f16
    b = c0 // 256
    i0 = c0 - b * 256
    base = b * 84
    d = float32(w16[r, (base + 80) // 2])
    dmin = float32(w16[r, (base + 82) // 2])
    n = i0 // 128
    j = (i0 % 128) // 32
    l0 = i0 % 32
    sc = int32(w8[r, base + n * 8 + j * 2 + l0 // 16])
    dl = d * float32(sc & 15)
    ml = dmin * float32(sc >> 4)
    q = base + 16 + n * 32 + l0
    sh = 2 * j
    for i in range(8):
        out[i] = dl * float32((int32(w8[r, q + i]) >> sh) & 3) - ml


@cuda.jit(device=True)
def deq_q3_k(w8, w16, w32, r, c0, out):
    # block (256): hmask[32] | qs[64] | scales[12] (16 packed 6-bit scales, offset 32) | d f16
    b = c0 // 256
    i0 = c0 - b * 256
    base = b * 110
    d = float32(w16[r, (base + 108) // 2])
    n = i0 // 128
    j = (i0 % 128) // 32
    l0 = i0 % 32
    s = n * 8 + j * 2 + l0 // 16
    lo = (int32(w8[r, base + 96 + s % 8]) >> (4 * (s // 8))) & 15
    hi = (int32(w8[r, base + 96 + 8 + s % 4]) >> (2 * (s // 4))) & 3
    dl = d * float32((lo | (hi << 4)) - 32)
    m = 1 << (n * 4 + j)
    sh = 2 * j
    for i in range(8):
        l = l0 + i
        q = (int32(w8[r, base + 32 + n * 32 + l]) >> sh) & 3
        if (int32(w8[r, base + l]) & m) == 0:
            q -= 4
        out[i] = dl * float32(q)


@cuda.jit(device=True)
def _scale_min_k4(w8, r, o, j):
    """6-bit (scale, min) of sub-block j from the 12 packed bytes at offset o (ggml get_scale_min_k4)."""
    if j < 4:
        sc = int32(w8[r, o + j]) & 63
        mn = int32(w8[r, o + j + 4]) & 63
    else:
        sc = (int32(w8[r, o + j + 4]) & 15) | ((int32(w8[r, o + j - 4]) >> 6) << 4)
        mn = (int32(w8[r, o + j + 4]) >> 4) | ((int32(w8[r, o + j]) >> 6) << 4)
    return sc, mn


@cuda.jit(device=True)
def deq_q4_k(w8, w16, w32, r, c0, out):
    # block (256): d f16 | dmin f16 | scales[12] | qs[128]; 8 sub-blocks of 32
    b = c0 // 256
    i0 = c0 - b * 256
    base = b * 144
    d = float32(w16[r, base // 2])
    dmin = float32(w16[r, base // 2 + 1])
    c = i0 // 64
    h = (i0 % 64) // 32
    l0 = i0 % 32
    sc, mn = _scale_min_k4(w8, r, base + 4, 2 * c + h)
    dl = d * float32(sc)
    ml = dmin * float32(mn)
    q = base + 16 + c * 32 + l0
    sh = 4 * h
    for i in range(8):
        out[i] = dl * float32((int32(w8[r, q + i]) >> sh) & 15) - ml


@cuda.jit(device=True)
def deq_q5_k(w8, w16, w32, r, c0, out):
    # block (256): d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    b = c0 // 256
    i0 = c0 - b * 256
    base = b * 176
    d = float32(w16[r, base // 2])
    dmin = float32(w16[r, base // 2 + 1])
    c = i0 // 64
    h = (i0 % 64) // 32
    l0 = i0 % 32
    sc, mn = _scale_min_k4(w8, r, base + 4, 2 * c + h)
    dl = d * float32(sc)
    ml = dmin * float32(mn)
    u = 1 << (2 * c + h)
    sh = 4 * h
    for i in range(8):
        l = l0 + i
        q = (int32(w8[r, base + 48 + c * 32 + l]) >> sh) & 15
        if int32(w8[r, base + 16 + l]) & u:
            q += 16
        out[i] = dl * float32(q) - ml


@cuda.jit(device=True)
def deq_q6_k(w8, w16, w32, r, c0, out):
    # block (256): ql[128] | qh[64] | scales int8[16] | d f16
    b = c0 // 256
    i0 = c0 - b * 256
    base = b * 210
    d = float32(w16[r, (base + 208) // 2])
    n = i0 // 128
    k = (i0 % 128) // 32
    l0 = i0 % 32
    dl = d * float32(_i8(w8[r, base + 192 + n * 8 + l0 // 16 + 2 * k]))
    ql = base + n * 64 + 32 * (k & 1)
    shl = 4 * (k >> 1)
    qh = base + 128 + n * 32
    shh = 2 * k
    for i in range(8):
        l = l0 + i
        q = ((int32(w8[r, ql + l]) >> shl) & 15) | (((int32(w8[r, qh + l]) >> shh) & 3) << 4)
        out[i] = dl * float32(q - 32)


@cuda.jit(device=True, inline=True)
def _u16(w8, r, o):
    return int32(w8[r, o]) | (int32(w8[r, o + 1]) << 8)


@cuda.jit(device=True)
def _signed8(out, db, grid, gi, sb):
    """out[j] = db * grid[gi, j], negated where bit j of the sign byte is set."""
    for j in range(8):
        v = db * float32(grid[gi, j])
        out[j] = -v if (sb >> j) & 1 else v


@cuda.jit(device=True)
def deq_iq2_xxs(w8, w16, w32, r, c0, out):
    # block (256): d f16 | 8 x (grid idx u8[4], aux u32 = 4 x 7-bit signs | 4-bit scale << 28)
    b = c0 // 256
    g = (c0 % 256) // 32
    l = (c0 % 32) // 8
    q = b * 66 + 2 + 8 * g
    aux = _u16(w8, r, q + 4) | (_u16(w8, r, q + 6) << 16)
    db = float32(w16[r, b * 33]) * (float32(0.5) + float32((aux >> 28) & 15)) * float32(0.25)
    _signed8(out, db, _G_IQ2XXS, int32(w8[r, q + l]), _KSIGNS[(aux >> (7 * l)) & 127])


@cuda.jit(device=True)
def deq_iq2_xs(w8, w16, w32, r, c0, out):
    # block (256): d f16 | qs u16[32] (9-bit grid idx, 7-bit signs) | scales[8] (4 bits per 16)
    b = c0 // 256
    i = (c0 % 256) // 8
    base = b * 74
    s = (int32(w8[r, base + 66 + i // 4]) >> (4 * ((i // 2) % 2))) & 15
    db = float32(w16[r, b * 37]) * (float32(0.5) + float32(s)) * float32(0.25)
    q = _u16(w8, r, base + 2 + 2 * i)
    _signed8(out, db, _G_IQ2XS, q & 511, _KSIGNS[q >> 9])


@cuda.jit(device=True)
def deq_iq2_s(w8, w16, w32, r, c0, out):
    # block (256): d f16 | qs[32] | signs[32] | qh[8] (2 high idx bits each) | scales[8]
    b = c0 // 256
    i = (c0 % 256) // 8
    base = b * 82
    s = (int32(w8[r, base + 74 + i // 4]) >> (4 * ((i // 2) % 2))) & 15
    db = float32(w16[r, b * 41]) * (float32(0.5) + float32(s)) * float32(0.25)
    gi = int32(w8[r, base + 2 + i]) | (((int32(w8[r, base + 66 + i // 4]) >> (2 * (i % 4))) & 3) << 8)
    _signed8(out, db, _G_IQ2S, gi, int32(w8[r, base + 34 + i]))


@cuda.jit(device=True)
def deq_iq3_xxs(w8, w16, w32, r, c0, out):
    # block (256): d f16 | qs[64] (grid idx of 4) | aux u32[8] (4 x 7-bit signs | scale << 28)
    b = c0 // 256
    g = (c0 % 256) // 32
    l = (c0 % 32) // 8
    base = b * 98
    o = base + 66 + 4 * g
    aux = _u16(w8, r, o) | (_u16(w8, r, o + 2) << 16)
    db = float32(w16[r, b * 49]) * (float32(0.5) + float32((aux >> 28) & 15)) * float32(0.5)
    sb = _KSIGNS[(aux >> (7 * l)) & 127]
    for h in range(2):
        gi = int32(w8[r, base + 2 + 8 * g + 2 * l + h])
        for j in range(4):
            v = db * float32(_G_IQ3XXS[gi, j])
            out[4 * h + j] = -v if (sb >> (4 * h + j)) & 1 else v


@cuda.jit(device=True)
def deq_iq3_s(w8, w16, w32, r, c0, out):
    # block (256): d f16 | qs[64] | qh[8] | signs[32] | scales[4] (4 bits per 32)
    b = c0 // 256
    i = (c0 % 256) // 8
    base = b * 110
    g = i // 4
    s = (int32(w8[r, base + 106 + g // 2]) >> (4 * (g % 2))) & 15
    db = float32(w16[r, b * 55]) * float32(1 + 2 * s)
    sb = int32(w8[r, base + 74 + i])
    for h in range(2):
        e = 2 * i + h
        gi = int32(w8[r, base + 2 + e]) | (((int32(w8[r, base + 66 + e // 8]) >> (e % 8)) & 1) << 8)
        for j in range(4):
            v = db * float32(_G_IQ3S[gi, j])
            out[4 * h + j] = -v if (sb >> (4 * h + j)) & 1 else v


@cuda.jit(device=True)
def deq_iq1_s(w8, w16, w32, r, c0, out):
    # block (256): d f16 | qs[32] | qh u16[8] (3 high idx bits x 4, 3-bit scale << 12, delta sign << 15)
    b = c0 // 256
    g = (c0 % 256) // 32
    l = (c0 % 32) // 8
    base = b * 50
    h = _u16(w8, r, base + 34 + 2 * g)
    dl = float32(w16[r, b * 25]) * float32(2 * ((h >> 12) & 7) + 1)
    delta = float32(-0.125) if h & 0x8000 else float32(0.125)
    gi = int32(w8[r, base + 2 + 4 * g + l]) | (((h >> (3 * l)) & 7) << 8)
    for j in range(8):
        out[j] = dl * (float32(_G_IQ1S[gi, j]) + delta)


@cuda.jit(device=True)
def _f16_bits(h):
    """float16 given as its 16 bits -> float32, exact (as minirt.quants._common.nb_f16)."""
    e = (h >> 10) & 31
    m = h & 1023
    if e == 31:
        v = float32(np.inf) if m == 0 else float32(np.nan)
    else:
        if e != 0:
            m = m | 1024
        v = float32(m) * _F16_SCALE[e]
    return -v if h & 0x8000 else v


@cuda.jit(device=True)
def deq_iq1_m(w8, w16, w32, r, c0, out):
    # block (256): qs[32] | qh[16] (nibble per 8: 3 high idx bits, delta sign) | scales u16[4]
    b = c0 // 256
    i = (c0 % 256) // 8
    base = b * 56
    s0 = _u16(w8, r, base + 48)
    s1 = _u16(w8, r, base + 50)
    s2 = _u16(w8, r, base + 52)
    s3 = _u16(w8, r, base + 54)
    d = _f16_bits((s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000))
    k = i // 2
    sw = _u16(w8, r, base + 48 + 2 * (k // 4))
    dl = d * float32(2 * ((sw >> (3 * (k % 4))) & 7) + 1)
    nib = (int32(w8[r, base + 32 + i // 2]) >> (4 * (i % 2))) & 15
    gi = int32(w8[r, base + i]) | ((nib & 7) << 8)
    delta = float32(-0.125) if nib & 8 else float32(0.125)
    for j in range(8):
        out[j] = dl * (float32(_G_IQ1S[gi, j]) + delta)


@cuda.jit(device=True)
def deq_tq1_0(w8, w16, w32, r, c0, out):
    # block (256): qs[48] | qh[4] | d f16; 5 (4 in qh) base-3 digits per byte, see minirt/quants/ternary.py
    b = c0 // 256
    e0 = c0 % 256
    base = b * 54
    d = float32(w16[r, b * 27 + 26])
    for i in range(8):
        e = e0 + i
        if e < 160:
            q = int32(w8[r, base + e % 32])
            n = e // 32
        elif e < 240:
            q = int32(w8[r, base + 32 + (e - 160) % 16])
            n = (e - 160) // 16
        else:
            q = int32(w8[r, base + 48 + (e - 240) % 4])
            n = (e - 240) // 4
        p = 1
        for _ in range(n):
            p *= 3
        v = (q * p) & 255
        out[i] = d * float32(((v * 3) >> 8) - 1)


@cuda.jit(device=True)
def deq_tq2_0(w8, w16, w32, r, c0, out):
    # block (256): qs[64] | d f16; element 128j + 32s + l = (qs[32j + l] >> 2s) & 3, minus 1
    b = c0 // 256
    e0 = c0 % 256
    base = b * 66
    d = float32(w16[r, b * 33 + 32])
    j = e0 // 128
    s = (e0 % 128) // 32
    l0 = e0 % 32
    for i in range(8):
        out[i] = d * float32(((int32(w8[r, base + 32 * j + l0 + i]) >> (2 * s)) & 3) - 1)


@cuda.jit(device=True)
def deq_mxfp4(w8, w16, w32, r, c0, out):
    # block (32): e u8 (d = 2**(e-128)) | qs[16] (E2M1 codes, low nibbles first)
    b = c0 // 32
    j0 = c0 - b * 32
    base = b * 17
    d = _E8M0[w8[r, base]]
    if j0 < 16:
        for i in range(8):
            out[i] = d * _KV4[int32(w8[r, base + 1 + j0 + i]) & 15]
    else:
        for i in range(8):
            out[i] = d * _KV4[int32(w8[r, base + 1 + j0 - 16 + i]) >> 4]


DEQUANTIZERS = {
    "F32": deq_f32, "F16": deq_f16,
    "Q4_0": deq_q4_0, "Q4_1": deq_q4_1, "Q5_0": deq_q5_0, "Q5_1": deq_q5_1, "Q8_0": deq_q8_0,
    "Q2_K": deq_q2_k, "Q3_K": deq_q3_k, "Q4_K": deq_q4_k, "Q5_K": deq_q5_k, "Q6_K": deq_q6_k,
    "IQ2_XXS": deq_iq2_xxs, "IQ2_XS": deq_iq2_xs, "IQ2_S": deq_iq2_s, "IQ3_XXS": deq_iq3_xxs, "IQ3_S": deq_iq3_s,
    "IQ1_S": deq_iq1_s, "IQ1_M": deq_iq1_m, "TQ1_0": deq_tq1_0, "TQ2_0": deq_tq2_0, "MXFP4": deq_mxfp4,
}

SUPPORTED_TYPES = tuple(DEQUANTIZERS)
