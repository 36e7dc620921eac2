"""MXFP4 (OCP microscaling FP4, 32-element blocks): E2M1 values with a shared power-of-two scale.

Block layout::

    MXFP4  17 B: e u8 @0 | qs[16] @1
           d = 2**(e - 128) (ggml_e8m0_to_fp32_half: half the E8M0 scale, so the codebook is integral;
           e < 2 gives the subnormals 2**-128, 2**-127; e = 255 gives 2**127, not NaN)
           x[l] = d * KVALUES[qs[l] & 15],  x[16 + l] = d * KVALUES[qs[l] >> 4]   (l < 16)

``KVALUES`` is ggml's ``kvalues_mxfp4``: the E2M1 values doubled. See ``legacy.py`` for what
``dequantize_blocks_*``, ``deq_row_*`` and ``dot_*`` are.
"""

from __future__ import annotations

import numpy as np

from ._common import nibbles
from ._jit import jit

KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_KV_F32 = KVALUES.astype(np.float32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """uint8 exponents -> float32 ``2**(e - 128)`` built from bits (exact, subnormal for e < 2)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def dequantize_blocks_mxfp4(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 spec: ``(n, 17)`` -> ``(n, 32)`` float32."""
    d = e8m0_half(blocks[:, 0:1])
    return d * _KV_F32[nibbles(blocks[:, None, 1:17]).reshape(-1, 32)]


_E8M0 = e8m0_half(np.arange(256, dtype=np.uint8))  # the 256 scales, for the numba kernels


@jit()
def deq_row_mxfp4(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 32):
        o = b * 17
        d = _E8M0[src[o]]
        for l in range(16):
            v = src[o + 1 + l]
            dst[b * 32 + l] = d * _KV_F32[v & np.uint8(15)]
            dst[b * 32 + 16 + l] = d * _KV_F32[v >> np.uint8(4)]


@jit(fastmath=True)
def dot_mxfp4(w, x, xs, scratch):  # pragma: no cover - compiled
    n16 = 16 | (x.shape[0] >> 62)  # = 16; opaque to LLVM (see legacy.py)
    acc = np.float32(0)
    for b in range(x.shape[0] // 32):
        o = b * 17
        s = np.float32(0)
        for l in range(n16):
            v = w[o + 1 + l]
            s += _KV_F32[v & np.uint8(15)] * x[b * 32 + l] + _KV_F32[v >> np.uint8(4)] * x[b * 32 + 16 + l]
        acc += _E8M0[w[o]] * s
    return acc
