"""Element types of the KV cache, named as llama.cpp names them (``--cache-type-k`` / ``-ctk``).

One place per fact: each type's ggml id, block size and bytes per block, how a cache row of
``head_dim`` values is stored (numpy dtype and width), and the numpy reference for writing and
reading rows. The block layouts are ggml's (the same as weights of that type); quantizing follows
ggml's reference quantizers, for which gguf-py's ``gguf.quants`` is the numpy spec used here.
The native kernels (native/kvcache.c) quantize the same way and read the stored type directly.

Storage of one cache layer ``(n_head_kv, n_ctx, width)``: ``f32`` float32 and ``f16`` float16 with
width = head_dim; ``bf16`` uint16 bits; block types uint8 with width = head_dim / 32 · bytes per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequestError


@dataclass(frozen=True)
class KVType:
    """One cache element type."""

    name: str  # llama.cpp's name: "f16", "q8_0", ...
    ggml_id: int  # ggml type id (what the native kernels are told)
    block: int  # elements per block (1 for the float types)
    type_size: int  # bytes per block
    dtype: np.dtype  # numpy dtype of the stored array

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def width(self, head_dim: int) -> int:
        """Last-axis length of the stored array for rows of ``head_dim`` values."""
        self.check_dim(head_dim)
        return head_dim // self.block * self.type_size // self.dtype.itemsize

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one row of ``head_dim`` values takes."""
        self.check_dim(head_dim)
        return head_dim // self.block * self.type_size

    def check_dim(self, head_dim: int) -> None:
        if head_dim <= 0 or head_dim % self.block:
            raise InvalidRequestError(f"KV cache type {self.name} needs a head size that is a multiple of "
                                      f"{self.block}, this model's is {head_dim}")

    def rotation(self, head_dim: int, keys: bool) -> int:
        """Size of the Walsh-Hadamard rotation rows of this type are stored under, 0 for none.

        llama.cpp (``attn_rot_k`` / ``attn_rot_v`` in llama-kv-cache.cpp) rotates queries and keys
        (and values, rotating the attention output back) by an orthonormal Hadamard matrix before a
        block-quantized cache stores them: dot products are unchanged, and a channel of very large
        magnitude (Qwen2.5's K bias) is spread over its block instead of flattening the other 31
        values. Its rule: quantized types and head sizes that are multiples of 64; keys use the
        largest power of two (≥ 64) dividing the head size, values 64. native/kvcache.c
        (``mr_kv_rotation``) applies the same rule."""
        if not self.quantized or head_dim % 64:
            return 0
        if not keys:
            return 64
        n = 64
        while head_dim % (2 * n) == 0:
            n *= 2
        return n

    def head_dim(self, width: int) -> int:
        """Inverse of :meth:`width`."""
        return width * self.dtype.itemsize // self.type_size * self.block

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """float32 rows x (..., head_dim) → stored rows (..., width) (numpy reference)."""
        x = np.asarray(x, dtype=np.float32)
        if self.name == "f32":
            return x.copy()
        if self.name == "f16":
            return x.astype(np.float16)
        from gguf import GGMLQuantizationType, quants

        q = quants.quantize(np.ascontiguousarray(x), GGMLQuantizationType(self.ggml_id))
        return q.view(self.dtype)

    def dequantize(self, s: np.ndarray) -> np.ndarray:
        """Stored rows (..., width) → float32 (..., head_dim) (numpy reference)."""
        if self.name in ("f32", "f16"):
            return np.asarray(s, dtype=np.float32)
        from .quants import get_spec

        raw = np.ascontiguousarray(s).view(np.uint8)
        spec = get_spec(self.name.upper())
        blocks = raw.reshape(-1, self.type_size)
        out = spec.dequantize_blocks(blocks).astype(np.float32, copy=False)
        return out.reshape(*raw.shape[:-1], raw.shape[-1] // self.type_size * self.block)


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix of size n (a power of two) in natural (Sylvester)
    order, as llama.cpp builds it: H[i, j] = (-1)^popcount(i & j) / sqrt(n); symmetric, H @ H = I."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    return _hadamard(n)


_HADAMARD: dict[int, np.ndarray] = {}


def _hadamard(n: int) -> np.ndarray:
    h = _HADAMARD.get(n)
    if h is None:
        i = np.arange(n)
        bits = np.bitwise_and.outer(i, i)
        parity = np.zeros_like(bits)
        while bits.any():
            parity ^= bits & 1
            bits >>= 1
        h = _HADAMARD[n] = ((1 - 2 * parity) / np.sqrt(n)).astype(np.float32)
        h.setflags(write=False)
    return h


def rotate(x: np.ndarray, n: int, inplace: bool = False) -> np.ndarray:
    """x (..., D) with each run of n values along the last axis multiplied by :func:`hadamard` (n);
    its own inverse. n = 0: x unchanged. Returns a new float32 array (x when n = 0); ``inplace``:
    rotates x itself where it is a C-contiguous float32 array the caller owns (a temporary), saving
    the copy.

    Computed by the fast Walsh-Hadamard butterflies in the order native/kvcache.c's mr_kv_rotate
    runs them (then one scale), so rows rotated here and in the fused decode step are the same floats;
    by those kernels when they are loaded (a few times faster), else in numpy."""
    if not n:
        return x
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % n or n & (n - 1):
        raise ValueError(f"rows of {x.shape[-1]} values cannot be rotated in runs of {n}")
    from .kernels import native

    if native.loaded():
        return native.kv_rotate(x, n, inplace=inplace)
    return _rotate_numpy(x, n)


def _rotate_numpy(x: np.ndarray, n: int) -> np.ndarray:
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        z = y.reshape(y.shape[0], n // (2 * h), 2, h)
        a, b = z[:, :, 0], z[:, :, 1]
        y = np.stack((a + b, a - b), axis=2).reshape(-1, n)
        h *= 2
    y *= np.float32(1.0) / np.sqrt(np.float32(n))
    return y.reshape(x.shape)


_TYPES = {t.name: t for t in (
    KVType("f32", 0, 1, 4, np.dtype(np.float32)),
    KVType("f16", 1, 1, 2, np.dtype(np.float16)),
    KVType("bf16", 30, 1, 2, np.dtype(np.uint16)),
    KVType("q8_0", 8, 32, 34, np.dtype(np.uint8)),
    KVType("q4_0", 2, 32, 18, np.dtype(np.uint8)),
    KVType("q4_1", 3, 32, 20, np.dtype(np.uint8)),
    KVType("q5_0", 6, 32, 22, np.dtype(np.uint8)),
    KVType("q5_1", 7, 32, 24, np.dtype(np.uint8)),
)}

CACHE_TYPES: tuple[str, ...] = tuple(_TYPES)
"""Names accepted for ``cache_type_k`` / ``cache_type_v`` (``--cache-type-k/-v``)."""

DEFAULT_CACHE_TYPE = "f16"  # llama.cpp's default too


def get(name: str | KVType) -> KVType:
    """The :class:`KVType` called ``name`` (case-insensitive); InvalidRequestError naming the choices."""
    if isinstance(name, KVType):
        return name
    t = _TYPES.get(str(name).lower()) if isinstance(name, str) else None
    if t is None:
        raise InvalidRequestError(f"unknown KV cache type {name!r}; choose one of {', '.join(CACHE_TYPES)}")
    return t


def of_array(a: np.ndarray) -> KVType:
    """The type of a plain float cache array (float32 / float16); others must be named."""
    if a.dtype == np.float32:
        return _TYPES["f32"]
    if a.dtype == np.float16:
        return _TYPES["f16"]
    raise InvalidRequestError(f"a cache array of dtype {a.dtype} needs its KV type named")
