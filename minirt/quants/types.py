"""The table of every ggml tensor type id: name, elements per block, bytes per block.

This is the file-format fact the GGUF reader needs to size a tensor, for every type a GGUF may
hold, including types minirt cannot compute with (those open fine; using their data raises
:class:`minirt.UnsupportedQuantError`). How each supported type is laid out inside its block lives
with its kernels in ``minirt/quants/<family>.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256  # elements per super-block of the k-quants and the 256-element i-quants


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: ``block_size`` elements are stored in ``type_size`` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one row of ``n_cols`` elements (``n_cols`` must be a multiple of block_size)."""
        return n_cols // self.block_size * self.type_size


# id: (name, block elements, block bytes) — ggml's own table (ggml.c type_traits).
_TABLE: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    6: ("Q5_0", 32, 2 + 4 + 16),
    7: ("Q5_1", 32, 2 + 2 + 4 + 16),
    8: ("Q8_0", 32, 2 + 32),
    9: ("Q8_1", 32, 4 + 4 + 32),
    10: ("Q2_K", QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    11: ("Q3_K", QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    12: ("Q4_K", QK_K, 2 + 2 + QK_K // 2 + 12),
    13: ("Q5_K", QK_K, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    14: ("Q6_K", QK_K, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    15: ("Q8_K", QK_K, 4 + QK_K + QK_K // 8),
    16: ("IQ2_XXS", QK_K, 2 + QK_K // 4),
    17: ("IQ2_XS", QK_K, 2 + QK_K // 4 + QK_K // 32),
    18: ("IQ3_XXS", QK_K, 2 + QK_K // 4 + QK_K // 8),
    19: ("IQ1_S", QK_K, 2 + QK_K // 8 + QK_K // 16),
    20: ("IQ4_NL", 32, 2 + 16),
    21: ("IQ3_S", QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    22: ("IQ2_S", QK_K, 2 + QK_K // 4 + QK_K // 16),
    23: ("IQ4_XS", QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", QK_K, 2 + 4 * 13),
    35: ("TQ2_0", QK_K, 2 + 64),
    39: ("MXFP4", 32, 1 + 16),
    40: ("NVFP4", 64, 4 + 32),
    41: ("Q1_0", 128, 2 + 16),
}

GGML_TYPES: dict[int, GGMLType] = {i: GGMLType(i, n, b, s) for i, (n, b, s) in _TABLE.items()}
GGML_TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}


def ggml_type(key: int | str) -> GGMLType:
    """Look up a ggml type by id or name; KeyError when ggml has no such type."""
    if isinstance(key, str):
        return GGML_TYPES_BY_NAME[key.upper()]
    return GGML_TYPES[int(key)]
