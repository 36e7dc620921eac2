"""The ternary types TQ1_0 and TQ2_0 (256-element super-blocks, weights in {-1, 0, 1} times d).

Block layouts (byte offsets; f16 = IEEE binary16, little-endian)::

    TQ1_0  54 B: qs[48] @0 | qh[4] @48 | d f16 @52
           base-3 digits packed 5 per byte (4 per qh byte) as ceil(v * 256 / 243): digit n of byte q is
           t = ((q * 3**n) mod 256) * 3 >> 8  (0..2), x = d * (t - 1)
           e < 160:       byte qs[e % 32],        n = e // 32
           160 <= e < 240: byte qs[32 + (e - 160) % 16], n = (e - 160) // 16
           e >= 240:      byte qh[(e - 240) % 4],  n = (e - 240) // 4
    TQ2_0  66 B: qs[64] @0 | d f16 @64
           e = 128 j + 32 s + l:  t = (qs[32 j + l] >> 2 s) & 3,  x = d * (t - 1)

See ``legacy.py`` for what ``dequantize_blocks_*``, ``deq_row_*`` and ``dot_*`` are.
"""

from __future__ import annotations

import numpy as np

from ._common import f16_field, nb_f16
from ._jit import jit

DOT_SCRATCH = ("TQ1_0",)  # its dot kernel dequantizes the row into the scratch first
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8)


def _trits(q: np.ndarray, pows: np.ndarray) -> np.ndarray:
    """Bytes ``(n, k)`` -> digits ``(n, len(pows), k)`` as int8 ``t - 1`` (uint8 products wrap as in C)."""
    v = (q[:, None, :] * pows[None, :, None]).astype(np.uint16)
    return ((v * np.uint16(3)) >> np.uint16(8)).astype(np.int8) - np.int8(1)


def dequantize_blocks_tq1_0(blocks: np.ndarray) -> np.ndarray:
    """TQ1_0 spec: ``(n, 54)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 52)
    q = np.concatenate([_trits(blocks[:, 0:32], _POW3).reshape(n, 160),
                        _trits(blocks[:, 32:48], _POW3).reshape(n, 80),
                        _trits(blocks[:, 48:52], _POW3[:4]).reshape(n, 16)], axis=1)
    return d * q.astype(np.float32)


def dequantize_blocks_tq2_0(blocks: np.ndarray) -> np.ndarray:
    """TQ2_0 spec: ``(n, 66)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 64)
    t = (blocks[:, 0:64].reshape(n, 2, 1, 32) >> _SHIFT2.reshape(1, 1, 4, 1)) & np.uint8(3)
    return d * (t.reshape(n, 256).astype(np.int8) - np.int8(1)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# numba row kernels (exact)


@jit(inline=True)
def _trit(q, p):  # pragma: no cover - compiled
    v = np.uint8(q * np.uint8(p))  # wraps mod 256 as in C
    return np.float32(((np.int32(v) * 3) >> 8) - 1)


@jit()
def deq_row_tq1_0(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 54
        d = nb_f16(src[o + 52], src[o + 53])
        e0 = b * 256
        p = 1
        for n in range(5):
            for m in range(32):
                dst[e0 + 32 * n + m] = d * _trit(src[o + m], p)
            for m in range(16):
                dst[e0 + 160 + 16 * n + m] = d * _trit(src[o + 32 + m], p)
            if n < 4:
                for m in range(4):
                    dst[e0 + 240 + 4 * n + m] = d * _trit(src[o + 48 + m], p)
            p *= 3


@jit()
def deq_row_tq2_0(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 66
        d = nb_f16(src[o + 64], src[o + 65])
        for j in range(2):
            for s in range(4):
                e0 = b * 256 + 128 * j + 32 * s
                for l in range(32):
                    t = (np.int32(src[o + 32 * j + l]) >> (2 * s)) & 3
                    dst[e0 + l] = d * np.float32(t - 1)


# ---------------------------------------------------------------------------------------------
# numba fused dot kernels (decode): sum of t * x per block, minus sum x, scaled by d


@jit(fastmath=True)
def dot_tq1_0(w, x, xs, scratch):  # pragma: no cover - compiled
    deq_row_tq1_0(w, scratch)
    s = np.float32(0)
    for i in range(x.shape[0]):
        s += scratch[i] * x[i]
    return s


@jit(fastmath=True)
def dot_tq2_0(w, x, xs, scratch):  # pragma: no cover - compiled
    n32 = 32 | (x.shape[0] >> 62)  # = 32; opaque to LLVM (see legacy.py)
    acc = np.float32(0)
    for b in range(x.shape[0] // 256):
        o = b * 66
        s = np.float32(0)
        for j in range(2):
            for k in range(4):
                e0 = b * 256 + 128 * j + 32 * k
                sh = np.uint8(2 * k)
                for l in range(n32):
                    s += np.float32(np.int8(((w[o + 32 * j + l] >> sh) & np.uint8(3)) - np.uint8(1))) * x[e0 + l]
        acc += nb_f16(w[o + 64], w[o + 65]) * s
    return acc
