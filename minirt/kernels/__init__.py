"""Compute backends for the quantized matmul at the heart of the forward pass.

``get_backend(name)`` returns an object with ``name`` and ``matmul(x, lin) -> y`` where ``x`` is
float32 ``(T, in_features)`` and ``lin`` a :class:`minirt.archs.base.Linear` whose weight stays
quantized. Backends, fastest first:

- ``native``: C kernels (SIMD chosen at run time) through cffi — needs the built extension or a
  C compiler on first use;
- ``numba``: portable JIT kernels, always available;
- ``reference``: dequantize once to float32 and use BLAS (memory-hungry; for checking only).

``MINIRT_BACKEND=native|numba|reference`` forces one; ``auto`` takes native when it loads and
falls back to numba with one logged warning.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from ..errors import BackendError, InvalidRequestError

log = logging.getLogger(__name__)

BACKENDS = ("native", "numba", "reference")
_warned = False
_lock = threading.Lock()


class ReferenceBackend:
    """Dequantize each weight once (cached on the Linear) and multiply with numpy's BLAS."""

    name = "reference"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads

    def matmul(self, x: np.ndarray, lin: Any) -> np.ndarray:
        w = lin.backend_data
        if w is None:
            from ..quants import dequantize

            w = lin.backend_data = dequantize(lin.w, lin.qtype, (lin.out_features, lin.in_features))
        return x @ w.T

    def info(self) -> dict[str, Any]:
        return {"backend": self.name}


class NumbaBackend:
    """numba kernels over the raw blocks (``minirt.kernels.numba_backend``)."""

    name = "numba"

    def __init__(self, threads: int | None = None) -> None:
        from . import numba_backend

        self._mod = numba_backend
        self.threads = threads
        if threads:
            import numba

            numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))

    def matmul(self, x: np.ndarray, lin: Any) -> np.ndarray:
        return self._mod.matmul(x, lin.w, lin.qtype)

    def info(self) -> dict[str, Any]:
        import numba

        return {"backend": self.name, "threads": numba.get_num_threads()}


class NativeBackend:
    """C kernels through cffi (``minirt.kernels.native``)."""

    name = "native"

    def __init__(self, threads: int | None = None) -> None:
        from . import native

        native._load()  # raises BackendError with the reason when the kernels cannot be built or loaded
        self._mod = native
        self.threads = threads

    def matmul(self, x: np.ndarray, lin: Any) -> np.ndarray:
        return self._mod.matmul(x, lin.w, lin.qtype, threads=self.threads)

    # the small per-layer ops: native versions avoid numpy temporaries on the decode hot path
    def rms_norm(self, x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        """RMSNorm over the last axis of x (..., n)."""
        x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        return self._mod.rmsnorm(x2, w, eps).reshape(x.shape)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool, rope_dim: int) -> None:
        """Rotate x (T, heads, head_dim) in place with cos/sin tables (T, rope_dim/2)."""
        if not x.flags.c_contiguous:
            from ..archs.base import apply_rope

            apply_rope(x, cos, sin, neox, rope_dim)
            return
        self._mod.rope(x, neox=neox, n_rot=rope_dim, cos=cos, sin=sin)

    def attention_decode(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, n_past: int, scale: float,
                         window: int, softcap: float) -> np.ndarray | None:
        """One query (H, D) over the first n_past cached positions; None when this shape is not handled."""
        if kc.shape != vc.shape or q.shape[-1] != kc.shape[-1]:
            return None
        return self._mod.attention_decode(q, kc, vc, n_past, scale, window=window, softcap=softcap,
                                          threads=self.threads)

    def info(self) -> dict[str, Any]:
        d = dict(self._mod.info())
        d["backend"] = self.name
        return d


def get_backend(name: str | None = None, threads: int | None = None) -> Any:
    """Backend by name (``auto``/None: ``$MINIRT_BACKEND`` or native → numba)."""
    global _warned
    name = (name or os.environ.get("MINIRT_BACKEND") or "auto").lower()
    if name == "reference":
        return ReferenceBackend(threads)
    if name == "numba":
        return NumbaBackend(threads)
    if name == "native":
        return NativeBackend(threads)
    if name != "auto":
        raise InvalidRequestError(f"unknown backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    try:
        return NativeBackend(threads)
    except (BackendError, ImportError) as e:
        with _lock:
            if not _warned:
                log.warning("native kernels unavailable (%s); using the numba backend", e)
                _warned = True
        return NumbaBackend(threads)
