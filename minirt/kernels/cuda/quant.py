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

from numba import cuda, float32, int32

GROUP = 8  # weights decoded per call

# bytes per block / weights per block of every type with a device dequantizer
TYPE_SIZES = {
    "F32": (4, 1), "F16": (2, 1),
    "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
    "Q2_K": (84, 256), "Q3_K": (110, 256), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256),
}


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


DEQUANTIZERS = {
    "F32": deq_f32, "F16": deq_f16,
    "Q4_0": deq_q4_0, "Q4_1": deq_q4_1, "Q5_0": deq_q5_0, "Q5_1": deq_q5_1, "Q8_0": deq_q8_0,
    "Q2_K": deq_q2_k, "Q3_K": deq_q3_k, "Q4_K": deq_q4_k, "Q5_K": deq_q5_k, "Q6_K": deq_q6_k,
}

SUPPORTED_TYPES = tuple(DEQUANTIZERS)
