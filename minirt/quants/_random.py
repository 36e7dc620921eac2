"""Random blocks of any supported type, for tests and benchmarks.

Random bytes are valid quants for every type except in their float scale fields, where they can
spell NaN or inf; those fields are overwritten with finite values. The offsets below restate the
layouts documented in the family modules.
"""

from __future__ import annotations

import numpy as np

from . import get_spec

# byte offsets of the float16 scale fields inside one block
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
    "TQ1_0": (52,), "TQ2_0": (64,),
}
# byte offsets of float32 scale fields
F32_FIELDS: dict[str, tuple[int, ...]] = {"Q8_K": (0,)}


def random_blocks(qtype: str, n_blocks: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """uint8 ``(n_blocks, type_size)`` of random quants with finite scales of magnitude ~``scale``.

    For F32/F16/BF16 the "blocks" are single standard-normal values.
    """
    spec = get_spec(qtype)
    name = spec.name
    if name == "F32":
        return rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    if name == "F16":
        return rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if name == "BF16":
        bits = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> np.uint32(16)
        return bits.astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    blocks = rng.integers(0, 256, size=(n_blocks, spec.type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(name, ()):
        v = (rng.standard_normal(n_blocks) * scale).astype("<f2")
        blocks[:, off:off + 2] = v.view(np.uint8).reshape(n_blocks, 2)
    if name == "IQ1_M":  # the f16 scale lives in the top nibbles of the four u16 at byte 48
        v = (rng.standard_normal(n_blocks) * scale).astype("<f2").view("<u2").astype(np.uint16)
        sc = np.ascontiguousarray(blocks[:, 48:56]).view("<u2") & np.uint16(0x0FFF)
        for k in range(4):
            sc[:, k] |= ((v >> np.uint16(4 * k)) & np.uint16(15)) << np.uint16(12)
        blocks[:, 48:56] = sc.view(np.uint8)
    if name == "MXFP4":  # E8M0 exponents near 2**(e-128) ~ scale / 4 (|codebook| <= 12)
        e = np.round(np.log2(scale / 4)) + 128 + rng.integers(-2, 3, size=n_blocks)
        blocks[:, 0] = np.clip(e, 1, 254).astype(np.uint8)
    for off in F32_FIELDS.get(name, ()):
        v = (rng.standard_normal(n_blocks) * scale).astype("<f4")
        blocks[:, off:off + 4] = v.view(np.uint8).reshape(n_blocks, 4)
    return blocks


def random_matrix(qtype: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """uint8 ``(rows, row_bytes)``: a random ``rows x cols`` weight matrix of ``qtype``."""
    spec = get_spec(qtype)
    n = rows * (cols // spec.block_size)
    return random_blocks(qtype, n, rng, scale).reshape(rows, spec.row_bytes(cols))
