"""Unquantized float types: F32, F16, BF16 (one element per "block").

Layouts (little-endian, ``block_size`` 1):

* F32  — 4 bytes: IEEE-754 binary32.
* F16  — 2 bytes: IEEE-754 binary16; converted exactly to float32.
* BF16 — 2 bytes: the high 16 bits of a binary32 (value = bits << 16).

Each type has a numpy reference ``dequantize_blocks_*`` (uint8 ``(n, type_size)`` → float32
``(n, 1)``), a numba row kernel ``deq_row_*(src uint8 (row_bytes,), dst float32 (cols,))`` that
is bit-identical to it, and a numba ``dot_*`` used by the fused matmul (see ``legacy.py`` for
that signature).
"""

from __future__ import annotations

import numpy as np

from ._jit import jit

DOT_SCRATCH = ("F16", "BF16")  # their dot kernels convert the row into the scratch first


def dequantize_blocks_f32(blocks: np.ndarray) -> np.ndarray:
    """F32 spec: ``(n, 4)`` bytes → ``(n, 1)`` float32."""
    return np.ascontiguousarray(blocks).view("<f4").astype(np.float32, copy=False).reshape(-1, 1)


def dequantize_blocks_f16(blocks: np.ndarray) -> np.ndarray:
    """F16 spec: ``(n, 2)`` bytes → ``(n, 1)`` float32."""
    return np.ascontiguousarray(blocks).view("<f2").astype(np.float32).reshape(-1, 1)


def dequantize_blocks_bf16(blocks: np.ndarray) -> np.ndarray:
    """BF16 spec: ``(n, 2)`` bytes → ``(n, 1)`` float32 (bits shifted into the high half)."""
    u = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << np.uint32(16)
    return u.view(np.float32).reshape(-1, 1)


# --- numba row kernels: src uint8 (row_bytes,) → dst float32 (cols,) ------------------------


@jit()
def deq_row_f32(src, dst):  # pragma: no cover - compiled
    """F32 row: copy the bits (NaN payloads included)."""
    out = dst.view(np.uint32)
    for i in range(dst.shape[0]):
        o = 4 * i
        out[i] = (np.uint32(src[o]) | (np.uint32(src[o + 1]) << np.uint32(8))
                  | (np.uint32(src[o + 2]) << np.uint32(16)) | (np.uint32(src[o + 3]) << np.uint32(24)))


@jit()
def deq_row_f16(src, dst):  # pragma: no cover - compiled
    """F16 row: exact binary16 → binary32 (NaN payloads kept, as numpy does).

    Built as bits so the loop vectorizes: normal numbers, infinities and NaNs get their exponent
    rebiased (15 → 127, 31 → 255) and mantissa shifted; zeros keep only the sign; subnormals
    (rare) are fixed afterwards as mantissa * 2**-24.
    """
    out = dst.view(np.uint32)
    n = dst.shape[0]
    for i in range(n):
        h = np.uint32(src[2 * i]) | (np.uint32(src[2 * i + 1]) << np.uint32(8))
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        e = h & np.uint32(0x7C00)
        body = (h & np.uint32(0x7FFF)) << np.uint32(13)
        bits = sign | (body + np.uint32(112 << 23))  # exponent e → e + 112
        bits = (sign | body | np.uint32(0x7F800000)) if e == np.uint32(0x7C00) else bits
        out[i] = np.uint32(sign if e == np.uint32(0) else bits)
    for i in range(n):  # a select, not a branch, so this loop vectorizes too
        hi = src[2 * i + 1]
        v = np.float32(np.int32(src[2 * i]) | ((np.int32(hi) & 3) << 8)) * np.float32(2.0 ** -24)
        v = -v if hi & np.uint8(0x80) else v
        dst[i] = v if (hi & np.uint8(0x7C)) == 0 else dst[i]  # zero or subnormal


@jit()
def deq_row_bf16(src, dst):  # pragma: no cover - compiled
    """BF16 row: bits << 16."""
    out = dst.view(np.uint32)
    for i in range(dst.shape[0]):
        out[i] = (np.uint32(src[2 * i]) << np.uint32(16)) | (np.uint32(src[2 * i + 1]) << np.uint32(24))


# --- fused dot kernels: see legacy.py for the common signature -------------------------------


@jit(fastmath=True)
def dot_f32(w, x, xs, scratch):  # pragma: no cover - compiled
    """sum(W_row * x) for an F32 row read in place."""
    wf = w.view(np.float32)
    s = np.float32(0)
    for i in range(x.shape[0]):
        s += wf[i] * x[i]
    return s


@jit(fastmath=True)
def dot_f16(w, x, xs, scratch):  # pragma: no cover - compiled
    """sum(W_row * x) for an F16 row (converted into the per-thread scratch first)."""
    deq_row_f16(w, scratch)
    s = np.float32(0)
    for i in range(x.shape[0]):
        s += scratch[i] * x[i]
    return s


@jit(fastmath=True)
def dot_bf16(w, x, xs, scratch):  # pragma: no cover - compiled
    """sum(W_row * x) for a BF16 row (converted into the per-thread scratch first)."""
    deq_row_bf16(w, scratch)
    s = np.float32(0)
    for i in range(x.shape[0]):
        s += scratch[i] * x[i]
    return s
