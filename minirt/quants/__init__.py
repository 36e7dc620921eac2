"""Quantization types: block layouts, numpy reference dequantizers and numba kernels.

Each supported ggml type is described once, in its family module:

* ``floats.py``  — F32, F16, BF16
* ``legacy.py``  — Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
* ``kquants.py`` — Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K
* ``iquants.py`` — IQ4_NL, IQ4_XS, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
  (grids in ``iqgrids.py``)
* ``ternary.py`` — TQ1_0, TQ2_0
* ``mxfp4.py``   — MXFP4

with its byte layout, a vectorized numpy dequantizer (the executable spec, bit-identical to
``gguf.quants``), a numba kernel dequantizing one row (bit-identical to the spec) and a numba
fused dot product used by ``minirt.kernels.numba_backend.matmul``.

:func:`get_spec` returns a type's :class:`QuantSpec`; :func:`dequantize` turns raw tensor bytes
into float32. Importing this package does not import numba: kernels compile on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidRequestError, UnsupportedQuantError
from . import floats, iquants, kquants, legacy, mxfp4, ternary
from ._jit import LazyJit
from .types import GGML_TYPES, GGML_TYPES_BY_NAME, QK_K, GGMLType, ggml_type


@dataclass(frozen=True)
class QuantSpec:
    """Everything minirt knows about computing with one ggml type.

    ``dequantize_blocks``: numpy spec, uint8 ``(n_blocks, type_size)`` → float32 ``(n_blocks, block_size)``.
    ``row_kernel``: numba ``(src uint8 (row_bytes,), dst float32 (cols,)) -> None``, dequantizes one row.
    ``dot_kernel``: numba ``(w uint8 (row_bytes,), x float32 (cols,), xs float32 (cols // 16,),
    scratch float32 (cols,)) -> float32``: ``sum(W_row * x)`` straight from the blocks, where ``xs``
    holds the sums of ``x`` over each 16 consecutive elements (see ``legacy.py``).
    """

    ggml: GGMLType
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]
    row_kernel: LazyJit
    dot_kernel: LazyJit
    dot_scratch: bool = False
    """True when ``dot_kernel`` writes the row into ``scratch`` (else a 0-length scratch may be passed)."""

    @property
    def name(self) -> str:
        """ggml type name, e.g. ``"Q4_K"``."""
        return self.ggml.name

    @property
    def block_size(self) -> int:
        """Elements per block."""
        return self.ggml.block_size

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return self.ggml.type_size

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of ``cols`` elements; raises if cols is not a multiple of the block size."""
        if cols <= 0 or cols % self.block_size:
            raise InvalidRequestError(
                f"{self.name} rows must hold a positive multiple of {self.block_size} elements, got {cols}")
        return cols // self.block_size * self.type_size


def _spec(name: str, module: object) -> QuantSpec:
    key = name.lower()
    return QuantSpec(
        ggml=GGML_TYPES_BY_NAME[name],
        dequantize_blocks=getattr(module, f"dequantize_blocks_{key}"),
        row_kernel=getattr(module, f"deq_row_{key}"),
        dot_kernel=getattr(module, f"dot_{key}"),
        dot_scratch=name in getattr(module, "DOT_SCRATCH", ()),
    )


_SPECS: dict[str, QuantSpec] = {
    name: _spec(name, mod)
    for mod, names in (
        (floats, ("F32", "F16", "BF16")),
        (legacy, ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")),
        (kquants, ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K")),
        (iquants, ("IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")),
        (ternary, ("TQ1_0", "TQ2_0")),
        (mxfp4, ("MXFP4",)),
    )
    for name in names
}

SUPPORTED_TYPES: tuple[str, ...] = tuple(_SPECS)
"""Names of the ggml types minirt can dequantize and multiply with."""


def get_spec(qtype: str | int | GGMLType) -> QuantSpec:
    """The :class:`QuantSpec` of a ggml type given by name (``"Q4_K"``), id or :class:`GGMLType`.

    Raises :class:`minirt.UnsupportedQuantError` naming the type when ggml knows it but minirt
    cannot compute with it (NVFP4, Q8_1 ...) or when no ggml type has that name or id.
    """
    if isinstance(qtype, GGMLType):
        t: GGMLType | None = qtype
    else:
        try:
            t = ggml_type(qtype)
        except (KeyError, ValueError, TypeError, AttributeError):
            t = None
    if t is None:
        raise UnsupportedQuantError(
            f"unknown ggml type {qtype!r}; supported types: {', '.join(SUPPORTED_TYPES)}")
    spec = _SPECS.get(t.name)
    if spec is None:
        raise UnsupportedQuantError(
            f"ggml type {t.name} (id {t.id}) is not supported by minirt; supported types: "
            f"{', '.join(SUPPORTED_TYPES)}")
    return spec


# Blocks dequantized per numpy call: bounds the temporaries (a few times 64 KiB blocks).
_CHUNK_BLOCKS = 1 << 15


def dequantize(data: np.ndarray, qtype: str | int | GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize raw tensor bytes with the numpy spec.

    ``data``: uint8 array of any leading shape holding ``prod(shape)`` elements of ``qtype``
    (e.g. ``GGUFTensor.data``, ``(*shape[:-1], row_bytes)``). Returns float32 of ``shape``.
    Raises :class:`minirt.UnsupportedQuantError` for a type minirt cannot handle and
    :class:`minirt.InvalidRequestError` when data and shape disagree.
    """
    spec = get_spec(qtype)
    shape = tuple(int(s) for s in shape)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise InvalidRequestError(
            f"{spec.name} data must be a uint8 numpy array, got {getattr(data, 'dtype', type(data).__name__)}")
    if not shape or any(s < 0 for s in shape):
        raise InvalidRequestError(f"invalid shape {shape} for {spec.name} data")
    n = int(np.prod(shape, dtype=np.int64))
    if shape[-1] % spec.block_size:
        raise InvalidRequestError(
            f"{spec.name} rows must hold a multiple of {spec.block_size} elements, got shape {shape}")
    n_blocks = n // spec.block_size
    if data.size != n_blocks * spec.type_size:
        raise InvalidRequestError(
            f"{spec.name} data of {data.size} bytes does not match shape {shape} "
            f"({n_blocks} blocks x {spec.type_size} bytes)")
    blocks = data.reshape(n_blocks, spec.type_size)
    out = np.empty((n_blocks, spec.block_size), dtype=np.float32)
    # inf/NaN scales in a file give inf/NaN weights, as in ggml; no RuntimeWarning for them
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, n_blocks, _CHUNK_BLOCKS):
            stop = min(n_blocks, start + _CHUNK_BLOCKS)
            out[start:stop] = spec.dequantize_blocks(blocks[start:stop])
    return out.reshape(shape)


__all__ = [
    "QuantSpec",
    "SUPPORTED_TYPES",
    "get_spec",
    "dequantize",
    "GGML_TYPES",
    "GGML_TYPES_BY_NAME",
    "GGMLType",
    "QK_K",
    "ggml_type",
]
