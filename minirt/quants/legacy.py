"""The original ggml block quants: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 elements per block).

Block layouts (byte offsets inside one block; f16 = IEEE binary16, little-endian)::

    Q4_0  18 B: d f16 @0 | qs[16] @2            x[l] = d * ((qs[l] & 15) - 8),  x[16+l] = d * ((qs[l] >> 4) - 8)
    Q4_1  20 B: d f16 @0 | m f16 @2 | qs[16] @4  x[l] = d * (qs[l] & 15) + m,    x[16+l] = d * (qs[l] >> 4) + m
    Q5_0  22 B: d f16 @0 | qh u32 @2 | qs[16] @6 q[j] = nibble(j) | bit j of qh << 4;  x[j] = d * (q[j] - 16)
    Q5_1  24 B: d f16 @0 | m f16 @2 | qh u32 @4 | qs[16] @8               x[j] = d * q[j] + m
    Q8_0  34 B: d f16 @0 | qs int8[32] @2        x[j] = d * qs[j]

where for l in 0..15, ``nibble(l) = qs[l] & 15`` and ``nibble(16+l) = qs[l] >> 4``.

Per type: ``dequantize_blocks_*`` (numpy spec, uint8 ``(n, type_size)`` → float32 ``(n, 32)``,
same float32 operations in the same order as ggml, hence bit-identical), ``deq_row_*`` (numba,
one row ``src uint8 (row_bytes,)`` → ``dst float32 (cols,)``, bit-identical to the spec) and
``dot_*`` (numba, fused decode dot product, float32 accumulation).

Every ``dot_*`` kernel in minirt.quants has the signature ``dot(w, x, xs, scratch) -> float32``:
``w`` uint8 ``(row_bytes,)`` one weight row, ``x`` float32 ``(cols,)`` the activation row,
``xs`` float32 ``(cols // 16,)`` sums of ``x`` over each 16 consecutive elements (used by types
with a per-block offset: ``sum(d*q*x + m*x) = d*sum(q*x) + m*sum(x)``) and ``scratch`` float32
``(cols,)`` per-thread scratch. It returns ``sum_k W[k] * x[k]``.

How the dot kernels get vectorized: each block is processed by an inner loop over 16 or 32
elements that accumulates a float32 partial sum, scaled once per block. With a literal trip count
LLVM fully unrolls that loop and then vectorizes the *block* loop instead, gathering bytes 18-34
apart (slow). The trip counts are therefore written ``n32 = 32 | (cols >> 62)``: always 32, but
not a constant to LLVM, so it keeps the inner loop, vectorizes it (8-wide byte→int32→float
conversions and FMAs, one horizontal sum per block) and never runs the remainder.
"""

from __future__ import annotations

import numpy as np

from ._common import f16_field, nb_f16, nb_u32, nibbles, u32_field
from ._jit import jit

QK = 32
_BIT = np.array([1 << j for j in range(32)], dtype=np.uint32)  # bit masks for the Q5 high bits

# ---------------------------------------------------------------------------------------------
# numpy specs


def _q4(blocks: np.ndarray, off: int) -> np.ndarray:
    """4-bit quants ``(n, 32)`` uint8 from the 16 bytes at ``off``."""
    return nibbles(blocks[:, None, off:off + 16]).reshape(-1, QK)


def _q5(blocks: np.ndarray, qh_off: int, qs_off: int) -> np.ndarray:
    """5-bit quants ``(n, 32)`` uint8: nibbles plus bit j of the u32 at ``qh_off`` as bit 4."""
    qh = u32_field(blocks, qh_off)  # (n, 1)
    hb = ((qh >> np.arange(QK, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    return _q4(blocks, qs_off) | (hb << np.uint8(4))


def dequantize_blocks_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 spec: ``(n, 18)`` → ``(n, 32)`` float32."""
    d = f16_field(blocks, 0)
    return d * (_q4(blocks, 2).astype(np.int8) - np.int8(8)).astype(np.float32)


def dequantize_blocks_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1 spec: ``(n, 20)`` → ``(n, 32)`` float32."""
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    return d * _q4(blocks, 4).astype(np.float32) + m


def dequantize_blocks_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 spec: ``(n, 22)`` → ``(n, 32)`` float32."""
    d = f16_field(blocks, 0)
    return d * (_q5(blocks, 2, 6).astype(np.int8) - np.int8(16)).astype(np.float32)


def dequantize_blocks_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1 spec: ``(n, 24)`` → ``(n, 32)`` float32."""
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)
    return d * _q5(blocks, 4, 8).astype(np.float32) + m


def dequantize_blocks_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 spec: ``(n, 34)`` → ``(n, 32)`` float32."""
    d = f16_field(blocks, 0)
    return d * blocks[:, 2:34].view(np.int8).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# numba row kernels (exact: no fastmath, same operation order as the specs)


@jit()
def deq_row_q4_0(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 32):
        o = b * 18
        d = nb_f16(src[o], src[o + 1])
        for l in range(16):
            v = src[o + 2 + l]
            dst[b * 32 + l] = d * np.float32(np.int32(v & np.uint8(15)) - 8)
            dst[b * 32 + 16 + l] = d * np.float32(np.int32(v >> np.uint8(4)) - 8)


@jit()
def deq_row_q4_1(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 32):
        o = b * 20
        d = nb_f16(src[o], src[o + 1])
        m = nb_f16(src[o + 2], src[o + 3])
        for l in range(16):
            v = src[o + 4 + l]
            dst[b * 32 + l] = d * np.float32(v & np.uint8(15)) + m
            dst[b * 32 + 16 + l] = d * np.float32(v >> np.uint8(4)) + m


@jit()
def deq_row_q5_0(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 32):
        o = b * 22
        d = nb_f16(src[o], src[o + 1])
        qh = nb_u32(src, o + 2)
        for l in range(16):
            v = np.int32(src[o + 6 + l])
            h0 = np.int32((qh >> np.uint32(l)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(l + 16)) & np.uint32(1)) << 4
            dst[b * 32 + l] = d * np.float32(((v & 15) | h0) - 16)
            dst[b * 32 + 16 + l] = d * np.float32(((v >> 4) | h1) - 16)


@jit()
def deq_row_q5_1(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 32):
        o = b * 24
        d = nb_f16(src[o], src[o + 1])
        m = nb_f16(src[o + 2], src[o + 3])
        qh = nb_u32(src, o + 4)
        for l in range(16):
            v = np.int32(src[o + 8 + l])
            h0 = np.int32((qh >> np.uint32(l)) & np.uint32(1)) << 4
            h1 = np.int32((qh >> np.uint32(l + 16)) & np.uint32(1)) << 4
            dst[b * 32 + l] = d * np.float32((v & 15) | h0) + m
            dst[b * 32 + 16 + l] = d * np.float32((v >> 4) | h1) + m


@jit()
def deq_row_q8_0(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 32):
        o = b * 34
        d = nb_f16(src[o], src[o + 1])
        for l in range(32):
            dst[b * 32 + l] = d * np.float32(np.int8(src[o + 2 + l]))


# ---------------------------------------------------------------------------------------------
# numba fused dot kernels (decode): float32, per-block horizontal sums scaled by d


@jit(fastmath=True)
def dot_q4_0(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see module docstring)
    acc = np.float32(0)
    for b in range(x.shape[0] // 32):
        o = b * 18
        xo = b * 32
        s = np.float32(0)
        for l in range(n16):
            v = w[o + 2 + l]
            # q - 8 in int8 lanes: signed quants keep the float sums free of cancellation
            s += (np.float32(np.int8(np.uint8(v & np.uint8(15)) - np.uint8(8))) * x[xo + l]
                  + np.float32(np.int8(np.uint8(v >> np.uint8(4)) - np.uint8(8))) * x[xo + 16 + l])
        acc += nb_f16(w[o], w[o + 1]) * s
    return acc


@jit(fastmath=True)
def dot_q4_1(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see module docstring)
    acc = np.float32(0)
    for b in range(x.shape[0] // 32):
        o = b * 20
        xo = b * 32
        s = np.float32(0)
        for l in range(n16):
            v = w[o + 4 + l]
            s += (np.float32(np.uint8(v & np.uint8(15))) * x[xo + l]
                  + np.float32(np.uint8(v >> np.uint8(4))) * x[xo + 16 + l])
        acc += nb_f16(w[o], w[o + 1]) * s + nb_f16(w[o + 2], w[o + 3]) * (xs[2 * b] + xs[2 * b + 1])
    return acc


@jit(fastmath=True)
def dot_q5_0(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see module docstring)
    acc = np.float32(0)
    for b in range(x.shape[0] // 32):
        o = b * 22
        xo = b * 32
        qh = nb_u32(w, o + 2)
        s = np.float32(0)
        for l in range(n16):
            v = w[o + 6 + l]
            # q - 16 = nibble + (0 if the high bit is set else -16): a select on a mask
            # vectorizes as a masked add in 32-bit lanes (a variable shift of qh would be
            # widened to 64-bit lanes)
            f0 = np.float32(np.uint8(v & np.uint8(15))) + (np.float32(0) if qh & _BIT[l] else np.float32(-16))
            f1 = np.float32(np.uint8(v >> np.uint8(4))) + (np.float32(0) if qh & _BIT[l + 16] else np.float32(-16))
            s += f0 * x[xo + l] + f1 * x[xo + 16 + l]
        acc += nb_f16(w[o], w[o + 1]) * s
    return acc


@jit(fastmath=True)
def dot_q5_1(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16
    acc = np.float32(0)
    for b in range(x.shape[0] // 32):
        o = b * 24
        xo = b * 32
        qh = nb_u32(w, o + 4)
        s = np.float32(0)
        for l in range(n16):
            v = w[o + 8 + l]
            f0 = np.float32(np.uint8(v & np.uint8(15))) + (np.float32(16) if qh & _BIT[l] else np.float32(0))
            f1 = np.float32(np.uint8(v >> np.uint8(4))) + (np.float32(16) if qh & _BIT[l + 16] else np.float32(0))
            s += f0 * x[xo + l] + f1 * x[xo + 16 + l]
        acc += nb_f16(w[o], w[o + 1]) * s + nb_f16(w[o + 2], w[o + 3]) * (xs[2 * b] + xs[2 * b + 1])
    return acc


@jit(fastmath=True)
def dot_q8_0(w, x, xs, scratch):  # pragma: no cover - compiled
    n32 = 32 | (x.shape[0] >> 62)  # = 32
    acc = np.float32(0)
    for b in range(x.shape[0] // 32):
        o = b * 34
        xo = b * 32
        s = np.float32(0)
        for l in range(n32):
            s += np.float32(np.int8(w[o + 2 + l])) * x[xo + l]
        acc += nb_f16(w[o], w[o + 1]) * s
    return acc
