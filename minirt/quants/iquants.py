"""The i-quants: IQ4_NL (32-element blocks), IQ4_XS and the lattice types IQ1_S, IQ1_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (256-element super-blocks).

IQ4_NL / IQ4_XS map a 4-bit index through the fixed codebook ``KVALUES`` (ggml's ``kvalues_iq4nl``).
The lattice types map an index to 8 (IQ1/IQ2) or 4 (IQ3) magnitudes at once through a grid
(``iqgrids.grid``: ggml's ``iq2xxs_grid`` ...); signs come as 8 raw bits per 8 elements, or as 7 bits
expanded by ``KSIGNS`` (the 8th sign makes the number of minus signs even).

Block layouts (byte offsets; f16 = IEEE binary16, little-endian)::

    IQ4_NL  18 B: d f16 @0 | qs[16] @2
            x[l] = d * KVALUES[qs[l] & 15],  x[16 + l] = d * KVALUES[qs[l] >> 4]   (l < 16)
    IQ4_XS 136 B: d f16 @0 | scales_h u16 @2 | scales_l[4] @4 | qs[128] @8
            sub-block j (0..7) of 32: ls = ((scales_l[j // 2] >> 4 * (j % 2)) & 15)
                                            | (((scales_h >> 2 * j) & 3) << 4)
            x[32j + l] = (d * (ls - 32)) * KVALUES[qs[16j + l] & 15],
            x[32j + 16 + l] = (d * (ls - 32)) * KVALUES[qs[16j + l] >> 4]

The lattice types (``G`` = the type's grid, ``sgn(b)`` = -1 where bit b of the sign byte is set)::

    IQ2_XXS  66 B: d f16 @0 | 8 x (grid idx u8[4], aux u32) @2
             group g (32 elements): aux = u32 at 2 + 8g + 4; db = d * (0.5 + (aux >> 28)) * 0.25
             x[32g + 8l + j] = db * G[idx[l]][j] * sgn_j(KSIGNS[(aux >> 7l) & 127])
    IQ2_XS   74 B: d f16 @0 | qs u16[32] @2 | scales[8] @66
             q = qs[4g' + k] per 8 elements (g' = element // 32), idx = q & 511, signs KSIGNS[q >> 9]
             scale per 16: s = (scales[e // 32] >> 4 * ((e // 16) % 2)) & 15;  db = d * (0.5 + s) * 0.25
    IQ2_S    82 B: d f16 @0 | qs[32] @2 | signs[32] @34 | qh[8] @66 | scales[8] @74
             i = e // 8: idx = qs[i] | ((qh[i // 4] >> 2 * (i % 4)) & 3) << 8, sign bits signs[i];
             scale per 16 as IQ2_XS
    IQ3_XXS  98 B: d f16 @0 | qs[64] @2 | aux u32[8] @66
             grid entries of 4: i = e // 4, idx = qs[i]; group g of 32: db = d * (0.5 + (aux[g] >> 28)) * 0.5,
             signs of its 8-element part l: KSIGNS[(aux[g] >> 7l) & 127]
    IQ3_S   110 B: d f16 @0 | qs[64] @2 | qh[8] @66 | signs[32] @74 | scales[4] @106
             i = e // 4: idx = qs[i] | ((qh[i // 8] >> (i % 8)) & 1) << 8; sign bits signs[e // 8];
             group g of 32: db = d * (1 + 2 * ((scales[g // 2] >> 4 * (g % 2)) & 15))
    IQ1_S    50 B: d f16 @0 | qs[32] @2 | qh u16[8] @34
             group g of 32: h = qh[g]; dl = d * (2 * ((h >> 12) & 7) + 1); delta = -1/8 if h & 0x8000 else 1/8
             i = e // 8: idx = qs[i] | ((h >> 3 * (i % 4)) & 7) << 8;  x = dl * (G[idx][j] + delta)   (G int8)
    IQ1_M    56 B: qs[32] @0 | qh[16] @32 | sc u16[4] @48
             d = f16 of bits (sc[0] >> 12) | (sc[1] >> 8 & 0xf0) | (sc[2] >> 4 & 0xf00) | (sc[3] & 0xf000)
             per 16 (k = e // 16): dl = d * (2 * ((sc[k // 4] >> 3 * (k % 4)) & 7) + 1)
             i = e // 8: nib = qh[i // 2] >> 4 * (i % 2); idx = qs[i] | (nib & 7) << 8;
             delta = -1/8 if nib & 8 else 1/8;  x = dl * (G[idx][j] + delta)

See ``legacy.py`` for what ``dequantize_blocks_*``, ``deq_row_*`` and ``dot_*`` are.
"""

from __future__ import annotations

import numpy as np

from . import iqgrids
from ._common import f16_field, nb_f16, nb_u32, nibbles, u16_field
from ._jit import jit

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_KV_F32 = KVALUES.astype(np.float32)

# grids as uint8 (entries, width) for the numba kernels and float32 for the numpy specs
G_IQ2XXS, G_IQ2XS, G_IQ2S = iqgrids.grid("iq2xxs"), iqgrids.grid("iq2xs"), iqgrids.grid("iq2s")
G_IQ3XXS, G_IQ3S, G_IQ1S = iqgrids.grid("iq3xxs"), iqgrids.grid("iq3s"), iqgrids.grid("iq1s").view(np.int8)
_GF = {k: v.astype(np.float32) for k, v in
       (("iq2xxs", G_IQ2XXS), ("iq2xs", G_IQ2XS), ("iq2s", G_IQ2S), ("iq3xxs", G_IQ3XXS), ("iq3s", G_IQ3S),
        ("iq1s", G_IQ1S))}
KSIGNS = iqgrids.KSIGNS
# dot kernels that dequantize the row into the per-thread scratch first
DOT_SCRATCH = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
_BITS8 = np.arange(8, dtype=np.uint8)
IQ1_DELTA = np.float32(0.125)


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


def _signs(bytes_: np.ndarray) -> np.ndarray:
    """Sign bytes ``(...)`` -> float32 ``(..., 8)``: -1 where bit j is set, else 1."""
    return np.where((bytes_[..., None] >> _BITS8) & np.uint8(1), np.float32(-1), np.float32(1))


def _u32(blocks: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, lo:hi]).view("<u4").astype(np.uint32)


def _u16(blocks: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, lo:hi]).view("<u2").astype(np.uint16)


def _scales16(sc: np.ndarray) -> np.ndarray:
    """IQ2_XS / IQ2_S: ``(n, 8)`` bytes -> ``(n, 16)`` 4-bit scales, low nibble first."""
    return nibbles(sc[:, :, None]).reshape(sc.shape[0], 16)


def dequantize_blocks_iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    """IQ2_XXS spec: ``(n, 66)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    raw = blocks[:, 2:66].reshape(n, 8, 8)
    aux = _u32(blocks, 2, 66).reshape(n, 8, 2)[:, :, 1]
    db = d * (np.float32(0.5) + (aux >> np.uint32(28)).astype(np.float32)) * np.float32(0.25)
    sidx = (aux[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & np.uint32(127)
    grid = _GF["iq2xxs"][raw[:, :, 0:4]]                                  # (n, 8, 4, 8)
    return (db[:, :, None, None] * grid * _signs(KSIGNS[sidx])).reshape(n, 256)


def dequantize_blocks_iq2_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ2_XS spec: ``(n, 74)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qs = _u16(blocks, 2, 66)                                                 # (n, 32)
    db = d * (np.float32(0.5) + _scales16(blocks[:, 66:74]).astype(np.float32)) * np.float32(0.25)
    grid = _GF["iq2xs"][qs & np.uint16(511)].reshape(n, 16, 2, 8)
    signs = _signs(KSIGNS[qs >> np.uint16(9)]).reshape(n, 16, 2, 8)
    return (db[:, :, None, None] * grid * signs).reshape(n, 256)


def dequantize_blocks_iq2_s(blocks: np.ndarray) -> np.ndarray:
    """IQ2_S spec: ``(n, 82)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    db = d * (np.float32(0.5) + _scales16(blocks[:, 74:82]).astype(np.float32)) * np.float32(0.25)
    qh = ((blocks[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & np.uint8(3)).reshape(n, 32)
    idx = blocks[:, 2:34].astype(np.uint16) | (qh.astype(np.uint16) << np.uint16(8))
    grid = _GF["iq2s"][idx].reshape(n, 16, 2, 8)
    signs = _signs(blocks[:, 34:66]).reshape(n, 16, 2, 8)
    return (db[:, :, None, None] * grid * signs).reshape(n, 256)


def dequantize_blocks_iq3_xxs(blocks: np.ndarray) -> np.ndarray:
    """IQ3_XXS spec: ``(n, 98)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    aux = _u32(blocks, 66, 98)                                               # (n, 8)
    db = d * (np.float32(0.5) + (aux >> np.uint32(28)).astype(np.float32)) * np.float32(0.5)
    sidx = (aux[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & np.uint32(127)
    grid = _GF["iq3xxs"][blocks[:, 2:66]].reshape(n, 8, 4, 8)
    return (db[:, :, None, None] * grid * _signs(KSIGNS[sidx])).reshape(n, 256)


def dequantize_blocks_iq3_s(blocks: np.ndarray) -> np.ndarray:
    """IQ3_S spec: ``(n, 110)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    sc = nibbles(blocks[:, 106:110, None]).reshape(n, 8)
    db = d * (np.uint8(1) + np.uint8(2) * sc)
    qh = ((blocks[:, 66:74, None] >> _BITS8) & np.uint8(1)).reshape(n, 64)
    idx = blocks[:, 2:66].astype(np.uint16) | (qh.astype(np.uint16) << np.uint16(8))
    grid = _GF["iq3s"][idx].reshape(n, 8, 4, 8)
    signs = _signs(blocks[:, 74:106]).reshape(n, 8, 4, 8)
    return (db[:, :, None, None] * grid * signs).reshape(n, 256)


def dequantize_blocks_iq1_s(blocks: np.ndarray) -> np.ndarray:
    """IQ1_S spec: ``(n, 50)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    d = f16_field(blocks, 0)
    qh = _u16(blocks, 34, 50)                                                # (n, 8)
    dl = d * (np.uint16(2) * ((qh >> np.uint16(12)) & np.uint16(7)) + np.uint16(1))
    delta = np.where(qh & np.uint16(0x8000), -IQ1_DELTA, IQ1_DELTA)
    hi = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & np.uint16(7)
    idx = blocks[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | (hi << np.uint16(8))
    grid = _GF["iq1s"][idx]                                                  # (n, 8, 4, 8)
    return (dl[:, :, None, None] * (grid + delta[:, :, None, None])).reshape(n, 256)


def _iq1m_d(sc: np.ndarray) -> np.ndarray:
    """IQ1_M: the f16 super-block scale spread over the top nibbles of ``(n, 4)`` uint16 -> ``(n, 1)``."""
    bits = ((sc[:, 0] >> np.uint16(12)) | ((sc[:, 1] >> np.uint16(8)) & np.uint16(0xF0))
            | ((sc[:, 2] >> np.uint16(4)) & np.uint16(0xF00)) | (sc[:, 3] & np.uint16(0xF000)))
    return bits.astype("<u2").view("<f2").astype(np.float32).reshape(-1, 1)


def dequantize_blocks_iq1_m(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M spec: ``(n, 56)`` -> ``(n, 256)`` float32."""
    n = blocks.shape[0]
    sc = _u16(blocks, 48, 56)                                                # (n, 4)
    d = _iq1m_d(sc)
    s3 = ((sc[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & np.uint16(7)).reshape(n, 16)
    dl = d * (np.uint16(2) * s3 + np.uint16(1))                              # (n, 16)
    nib = nibbles(blocks[:, 32:48, None]).reshape(n, 32)                     # nibble i: 8 elements
    idx = blocks[:, 0:32].astype(np.uint16) | ((nib & np.uint8(7)).astype(np.uint16) << np.uint16(8))
    delta = np.where(nib & np.uint8(8), -IQ1_DELTA, IQ1_DELTA).reshape(n, 16, 2, 1)
    grid = _GF["iq1s"][idx].reshape(n, 16, 2, 8)
    return (dl[:, :, None, None] * (grid + delta)).reshape(n, 256)


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


@jit(inline=True)
def _sgn(sbyte, j):  # pragma: no cover - compiled
    return np.float32(-1) if (sbyte >> np.uint8(j)) & np.uint8(1) else np.float32(1)


@jit()
def deq_row_iq2_xxs(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 66
        d = nb_f16(src[o], src[o + 1])
        for g in range(8):
            q = o + 2 + 8 * g
            aux = nb_u32(src, q + 4)
            db = d * (np.float32(0.5) + np.float32(aux >> np.uint32(28))) * np.float32(0.25)
            for l in range(4):
                sb = KSIGNS[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                gi = src[q + l]
                e0 = b * 256 + 32 * g + 8 * l
                for j in range(8):
                    dst[e0 + j] = db * np.float32(G_IQ2XXS[gi, j]) * _sgn(sb, j)


@jit()
def deq_row_iq2_xs(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 74
        d = nb_f16(src[o], src[o + 1])
        for k in range(16):
            s = (np.int32(src[o + 66 + k // 2]) >> (4 * (k % 2))) & 15
            db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
            for h in range(2):
                i = 2 * k + h
                q = np.int32(src[o + 2 + 2 * i]) | (np.int32(src[o + 3 + 2 * i]) << 8)
                sb = KSIGNS[q >> 9]
                gi = q & 511
                e0 = b * 256 + 8 * i
                for j in range(8):
                    dst[e0 + j] = db * np.float32(G_IQ2XS[gi, j]) * _sgn(sb, j)


@jit()
def deq_row_iq2_s(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 82
        d = nb_f16(src[o], src[o + 1])
        for k in range(16):
            s = (np.int32(src[o + 74 + k // 2]) >> (4 * (k % 2))) & 15
            db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
            for h in range(2):
                i = 2 * k + h
                gi = np.int32(src[o + 2 + i]) | (((np.int32(src[o + 66 + i // 4]) >> (2 * (i % 4))) & 3) << 8)
                sb = src[o + 34 + i]
                e0 = b * 256 + 8 * i
                for j in range(8):
                    dst[e0 + j] = db * np.float32(G_IQ2S[gi, j]) * _sgn(sb, j)


@jit()
def deq_row_iq3_xxs(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 98
        d = nb_f16(src[o], src[o + 1])
        for g in range(8):
            aux = nb_u32(src, o + 66 + 4 * g)
            db = d * (np.float32(0.5) + np.float32(aux >> np.uint32(28))) * np.float32(0.5)
            for l in range(4):
                sb = KSIGNS[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                e0 = b * 256 + 32 * g + 8 * l
                for h in range(2):
                    gi = src[o + 2 + 8 * g + 2 * l + h]
                    for j in range(4):
                        dst[e0 + 4 * h + j] = db * np.float32(G_IQ3XXS[gi, j]) * _sgn(sb, 4 * h + j)


@jit()
def deq_row_iq3_s(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 110
        d = nb_f16(src[o], src[o + 1])
        for g in range(8):
            s = (np.int32(src[o + 106 + g // 2]) >> (4 * (g % 2))) & 15
            db = d * np.float32(1 + 2 * s)
            for l in range(4):
                sb = src[o + 74 + 4 * g + l]
                e0 = b * 256 + 32 * g + 8 * l
                for h in range(2):
                    i = 8 * g + 2 * l + h
                    gi = np.int32(src[o + 2 + i]) | (((np.int32(src[o + 66 + i // 8]) >> (i % 8)) & 1) << 8)
                    for j in range(4):
                        dst[e0 + 4 * h + j] = db * np.float32(G_IQ3S[gi, j]) * _sgn(sb, 4 * h + j)


@jit()
def deq_row_iq1_s(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 50
        d = nb_f16(src[o], src[o + 1])
        for g in range(8):
            h = np.int32(src[o + 34 + 2 * g]) | (np.int32(src[o + 35 + 2 * g]) << 8)
            dl = d * np.float32(2 * ((h >> 12) & 7) + 1)
            delta = -IQ1_DELTA if h & 0x8000 else IQ1_DELTA
            for l in range(4):
                gi = np.int32(src[o + 2 + 4 * g + l]) | (((h >> (3 * l)) & 7) << 8)
                e0 = b * 256 + 32 * g + 8 * l
                for j in range(8):
                    dst[e0 + j] = dl * (np.float32(G_IQ1S[gi, j]) + delta)


@jit()
def deq_row_iq1_m(src, dst):  # pragma: no cover - compiled
    for b in range(dst.shape[0] // 256):
        o = b * 56
        s0 = np.int32(src[o + 48]) | (np.int32(src[o + 49]) << 8)
        s1 = np.int32(src[o + 50]) | (np.int32(src[o + 51]) << 8)
        s2 = np.int32(src[o + 52]) | (np.int32(src[o + 53]) << 8)
        s3 = np.int32(src[o + 54]) | (np.int32(src[o + 55]) << 8)
        bits = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000)
        d = nb_f16(np.uint8(bits & 255), np.uint8(bits >> 8))
        for k in range(16):
            w = np.int32(src[o + 48 + 2 * (k // 4)]) | (np.int32(src[o + 49 + 2 * (k // 4)]) << 8)
            dl = d * np.float32(2 * ((w >> (3 * (k % 4))) & 7) + 1)
            for h in range(2):
                i = 2 * k + h
                nib = (np.int32(src[o + 32 + i // 2]) >> (4 * (i % 2))) & 15
                gi = np.int32(src[o + i]) | ((nib & 7) << 8)
                delta = -IQ1_DELTA if nib & 8 else IQ1_DELTA
                e0 = b * 256 + 8 * i
                for j in range(8):
                    dst[e0 + j] = dl * (np.float32(G_IQ1S[gi, j]) + delta)


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


# The lattice types: the row is dequantized into the per-thread scratch (exact kernels above), then
# dotted; a fused loop would gather grid entries per element and vectorize no better.


@jit(fastmath=True)
def _dot_scratch(scratch, x):  # pragma: no cover - compiled
    s = np.float32(0)
    for i in range(x.shape[0]):
        s += scratch[i] * x[i]
    return s


@jit(fastmath=True)
def dot_iq2_xxs(w, x, xs, scratch):  # pragma: no cover - compiled
    deq_row_iq2_xxs(w, scratch)
    return _dot_scratch(scratch, x)


@jit(fastmath=True)
def dot_iq2_xs(w, x, xs, scratch):  # pragma: no cover - compiled
    deq_row_iq2_xs(w, scratch)
    return _dot_scratch(scratch, x)


@jit(fastmath=True)
def dot_iq2_s(w, x, xs, scratch):  # pragma: no cover - compiled
    deq_row_iq2_s(w, scratch)
    return _dot_scratch(scratch, x)


@jit(fastmath=True)
def dot_iq3_xxs(w, x, xs, scratch):  # pragma: no cover - compiled
    deq_row_iq3_xxs(w, scratch)
    return _dot_scratch(scratch, x)


@jit(fastmath=True)
def dot_iq3_s(w, x, xs, scratch):  # pragma: no cover - compiled
    deq_row_iq3_s(w, scratch)
    return _dot_scratch(scratch, x)


@jit(fastmath=True)
def dot_iq1_s(w, x, xs, scratch):  # pragma: no cover - compiled
    deq_row_iq1_s(w, scratch)
    return _dot_scratch(scratch, x)


@jit(fastmath=True)
def dot_iq1_m(w, x, xs, scratch):  # pragma: no cover - compiled
    deq_row_iq1_m(w, scratch)
    return _dot_scratch(scratch, x)
