"""Helpers shared by the quant families: float16 fields, little-endian integers, block views.

numpy helpers take ``blocks``: a uint8 array ``(n_blocks, type_size)``; field helpers return
columns ``(n_blocks, 1)`` so they broadcast against ``(n_blocks, k)`` quant arrays.
numba helpers (``nb_*``) are lazy kernels inlined into their callers.
"""

from __future__ import annotations

import numpy as np

from ._jit import jit

# ---------------------------------------------------------------------------------------------
# numpy side (executable spec)


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """float16 at byte ``offset`` of each block, as float32 ``(n_blocks, 1)`` (exact conversion)."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float32)


def f32_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """float32 at byte ``offset`` of each block, ``(n_blocks, 1)``."""
    return np.ascontiguousarray(blocks[:, offset:offset + 4]).view("<f4").astype(np.float32)


def u16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """little-endian uint16 at byte ``offset`` of each block, ``(n_blocks, 1)``."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<u2").astype(np.uint16)


def u32_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """little-endian uint32 at byte ``offset`` of each block, ``(n_blocks, 1)``."""
    return np.ascontiguousarray(blocks[:, offset:offset + 4]).view("<u4").astype(np.uint32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Split bytes ``(n, g, k)`` into ``(n, g, 2, k)``: low nibbles first, then high nibbles.

    This is the order ggml stores 4-bit values in: byte ``l`` of a group of ``k`` bytes holds
    element ``l`` in its low nibble and element ``k + l`` in its high nibble.
    """
    return np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-2)


def bits(qh: np.ndarray, n_bits: int) -> np.ndarray:
    """Bit planes of bytes ``(n, 1, k)`` → ``(n, n_bits, k)``: plane ``j`` holds bit ``j`` of each byte."""
    shifts = np.arange(n_bits, dtype=np.uint8).reshape(1, n_bits, 1)
    return (qh >> shifts) & np.uint8(1)


# K-quant 6-bit scales (Q4_K, Q5_K): 12 bytes hold 8 scales and 8 mins of 6 bits each.
#   bytes 0-3 : low 6 bits of scale[0..3]; top 2 bits = high bits of scale[4..7]
#   bytes 4-7 : low 6 bits of  min[0..3]; top 2 bits = high bits of  min[4..7]
#   bytes 8-11: low nibble = low 4 bits of scale[4..7], high nibble = low 4 bits of min[4..7]
def k4_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode ``(n, 12)`` packed K-quant scales into ``(n, 8)`` scales and ``(n, 8)`` mins (uint8)."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & np.uint8(63), (c & np.uint8(15)) | ((a >> np.uint8(6)) << np.uint8(4))], axis=1)
    mn = np.concatenate([b & np.uint8(63), (c >> np.uint8(4)) | ((b >> np.uint8(6)) << np.uint8(4))], axis=1)
    return sc, mn


# ---------------------------------------------------------------------------------------------
# numba side

# 2**(e-25) for a half-precision exponent field e in 1..30; entry 0 is 2**-24 (subnormals are
# mantissa * 2**-24). Multiplying an integer mantissa by a power of two is exact in float32.
_F16_SCALE = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 31)] + [0.0], dtype=np.float32)


@jit(inline=True)
def nb_f16(lo, hi):  # pragma: no cover - compiled
    """float16 stored as bytes (lo, hi) → float32, exact (inf/nan preserved).

    The branches are perfectly predicted on real scales (normal numbers) and measured faster
    than a branch-free select chain.
    """
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        if e != 0:
            m = m | 1024
        v = np.float32(m) * _F16_SCALE[e]
    if h & 0x8000:
        v = -v
    return v


@jit(inline=True)
def nb_k4_scale_min(q, o, j):  # pragma: no cover - compiled
    """Scale and min ``j`` (0..7) of the 12-byte K-quant scale field at ``q[o:o+12]``."""
    if j < 4:
        return np.int32(q[o + j]) & 63, np.int32(q[o + j + 4]) & 63
    a = np.int32(q[o + j + 4])
    return (a & 15) | ((np.int32(q[o + j - 4]) >> 6) << 4), (a >> 4) | ((np.int32(q[o + j]) >> 6) << 4)


@jit(inline=True)
def nb_u32(q, o):  # pragma: no cover - compiled
    """Little-endian uint32 at ``q[o:o+4]``."""
    return (np.uint32(q[o]) | (np.uint32(q[o + 1]) << np.uint32(8)) | (np.uint32(q[o + 2]) << np.uint32(16))
            | (np.uint32(q[o + 3]) << np.uint32(24)))
