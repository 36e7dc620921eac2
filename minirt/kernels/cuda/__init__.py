"""CUDA backend: weights stay quantized in VRAM and are dequantized on the fly by CUDA kernels.

Layout of the package:

- ``quant.py``   — per-type device functions that dequantize 8 consecutive weights of a row
  straight from the raw ggml blocks (the same bytes as in the GGUF file);
- ``kernels.py`` — the kernels (numba-cuda): fused dequant-matvec (decode), tiled quantized GEMM
  and dequantize-to-tile (prefill, the latter feeding cuBLAS through CuPy), RMSNorm, RoPE,
  KV-cache store, attention, activations, argmax;
- ``backend.py`` — :class:`CudaBackend`: upload, per-op ``matmul`` and the whole-forward path
  (activations and the f16 KV cache stay on the device; only logits come back), CUDA graphs for
  single-sequence decode through CuPy;
- ``selfcheck.py`` — every kernel against its numpy reference on random data (tests, bench).

Importing this package imports neither numba.cuda nor CuPy and does not touch the driver:
:func:`available` checks lazily. ``MINIRT_CUDA=0`` disables the backend.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["available", "unavailable_reason", "CudaBackend", "simulator_active"]

_lock = threading.Lock()
_checked: tuple[bool, str] | None = None
MIN_COMPUTE_CAPABILITY = (6, 0)  # fp16 loads/stores and the warp-level features the kernels use


def simulator_active() -> bool:
    """True when numba's CUDA simulator is (or will be) what ``numba.cuda`` provides."""
    mod = sys.modules.get("numba.cuda")
    if mod is not None:
        numba_config = getattr(sys.modules.get("numba"), "config", None)
        return hasattr(mod, "simulator_init") or bool(getattr(numba_config, "ENABLE_CUDASIM", False))
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _driver_present() -> str:
    """'' when an NVIDIA driver library can be loaded, else why not (cheap: no CUDA init)."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for n in names:
        try:
            ctypes.CDLL(n)
            return ""
        except OSError:
            continue
    return "no NVIDIA driver found (libcuda cannot be loaded)"


def _check() -> tuple[bool, str]:
    if os.environ.get("MINIRT_CUDA", "1") == "0":
        return False, "disabled by MINIRT_CUDA=0"
    if simulator_active():
        return False, "numba's CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1); it is for tests only"
    why = _driver_present()
    if why:
        return False, why
    try:
        from numba import cuda  # noqa: F401  (numba-cuda)
    except Exception as e:  # ImportError, or numba without a CUDA target
        return False, f"numba-cuda is not installed ({e}); install minirt[cuda]"
    try:
        if not cuda.is_available():
            return False, "numba-cuda found no usable GPU (driver/toolkit mismatch or no device)"
        dev = cuda.get_current_device()
        cc = tuple(dev.compute_capability)
        if cc < MIN_COMPUTE_CAPABILITY:
            return False, f"GPU {dev.name!r} has compute capability {cc}, need >= {MIN_COMPUTE_CAPABILITY}"
    except Exception as e:  # CudaSupportError, driver errors
        return False, f"CUDA initialisation failed: {e}"
    return True, ""


def available() -> bool:
    """Whether a usable NVIDIA GPU and numba-cuda are present (checked once, lazily)."""
    global _checked
    with _lock:
        if _checked is None:
            _checked = _check()
            if not _checked[0]:
                log.debug("CUDA backend unavailable: %s", _checked[1])
        return _checked[0]


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    available()
    assert _checked is not None
    return _checked[1]


def __getattr__(name: str) -> Any:
    # CudaBackend lives in backend.py, which imports numba.cuda: load it only when asked for
    if name == "CudaBackend":
        from .backend import CudaBackend

        return CudaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
