"""Non-linear 4-bit i-quants: IQ4_NL (32-element blocks) and IQ4_XS (256-element super-blocks).

Both map a 4-bit index through the fixed codebook ``KVALUES`` (ggml's ``kvalues_iq4nl``).

Block layouts (byte offsets; f16 = IEEE binary16, little-endian)::

    IQ4_NL  18 B: d f16 @0 | qs[16] @2
            x[l] = d * KVALUES[qs[l] & 15],  x[16 + l] = d * KVALUES[qs[l] >> 4]   (l < 16)
    IQ4_XS 136 B: d f16 @0 | scales_h u16 @2 | scales_l[4] @4 | qs[128] @8
            sub-block j (0..7) of 32: ls = ((scales_l[j // 2] >> 4 * (j % 2)) & 15)
                                            | (((scales_h >> 2 * j) & 3) << 4)
            x[32j + l] = (d * (ls - 32)) * KVALUES[qs[16j + l] & 15],
            x[32j + 16 + l] = (d * (ls - 32)) * KVALUES[qs[16j + l] >> 4]

See ``legacy.py`` for what ``dequantize_blocks_*``, ``deq_row_*`` and ``dot_*`` are.
"""

from __future__ import annotations

import numpy as np

from ._common import f16_field, nb_f16, nibbles, u16_field
from ._jit import jit

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_KV_F32 = KVALUES.astype(np.float32)


def dequantize_blocks_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL spec: ``(n, 18)`` → ``(n, 32)`` float32."""
    d = f16_field(blocks, 0)
    idx = nibbles(blocks[:, None, 2:18]).reshape(-1, 32)
    return d * _KV_F32[idx]


def dequantize_blocks_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS spec: ``(n, 136)`` → ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    sh = u16_field(blocks, 2)  # (n, 1)
    sl = nibbles(blocks[:, None, 4:8]).reshape(n, 2, 4).transpose(0, 2, 1).reshape(n, 8)  # j -> byte j//2, nibble j%2
    hi = ((sh >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)).astype(np.uint8)
    ls = ((sl | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    dl = (d * ls).reshape(n, 8, 1)
    idx = nibbles(blocks[:, 8:136].reshape(n, 8, 16)).reshape(n, 8, 32)
    return (dl * _KV_F32[idx]).reshape(n, 256)


# ---------------------------------------------------------------------------------------------
# numba row kernels (exact)


@jit()
def deq_row_iq4_nl(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 32):
        o = b * 18
        d = nb_f16(src[o], src[o + 1])
        for l in range(16):
            v = src[o + 2 + l]
            dst[b * 32 + l] = d * _KV_F32[v & np.uint8(15)]
            dst[b * 32 + 16 + l] = d * _KV_F32[v >> np.uint8(4)]


@jit(inline=True)
def _iq4xs_scale(src, o, j):  # pragma: no cover - compiled
    """Signed 6-bit scale of sub-block j of the IQ4_XS super-block at src[o:]."""
    sh = np.int32(src[o + 2]) | (np.int32(src[o + 3]) << 8)
    lo = (np.int32(src[o + 4 + (j >> 1)]) >> (4 * (j & 1))) & 15
    return (lo | (((sh >> (2 * j)) & 3) << 4)) - 32


@jit()
def deq_row_iq4_xs(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 136
        d = nb_f16(src[o], src[o + 1])
        for j in range(8):
            dl = d * np.float32(_iq4xs_scale(src, o, j))
            e0 = b * 256 + j * 32
            for l in range(16):
                v = src[o + 8 + j * 16 + l]
                dst[e0 + l] = dl * _KV_F32[v & np.uint8(15)]
                dst[e0 + 16 + l] = dl * _KV_F32[v >> np.uint8(4)]


# ---------------------------------------------------------------------------------------------
# numba fused dot kernels (decode)


@jit(fastmath=True)
def dot_iq4_nl(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see module docstring)
    acc = np.float32(0)
    for b in range(x.shape[0] // 32):
        o = b * 18
        s = np.float32(0)
        for l in range(n16):
            v = w[o + 2 + l]
            s += _KV_F32[v & np.uint8(15)] * x[b * 32 + l] + _KV_F32[v >> np.uint8(4)] * x[b * 32 + 16 + l]
        acc += nb_f16(w[o], w[o + 1]) * s
    return acc


@jit(fastmath=True)
def dot_iq4_xs(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see module docstring)
    acc = np.float32(0)
    for b in range(x.shape[0] // 256):
        o = b * 136
        sq = np.float32(0)
        for j in range(8):
            e0 = b * 256 + j * 32
            s = np.float32(0)
            for l in range(n16):
                v = w[o + 8 + j * 16 + l]
                s += _KV_F32[v & np.uint8(15)] * x[e0 + l] + _KV_F32[v >> np.uint8(4)] * x[e0 + 16 + l]
            sq += np.float32(_iq4xs_scale(w, o, j)) * s
        acc += nb_f16(w[o], w[o + 1]) * sq
    return acc
