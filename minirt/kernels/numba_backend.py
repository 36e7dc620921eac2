"""Portable quantized matmul in numba: ``y = x @ W.T`` straight from the ggml blocks.

This is the fallback when no C compiler is available. Weights are never dequantized as a whole:

* decode (``n_tokens == 1``): every weight row is dotted with ``x`` by the type's fused kernel
  (``QuantSpec.dot_kernel``): each block is unpacked by an inner loop over 16/32 elements that
  LLVM vectorizes (bytes → int32 → float32, FMA with ``x``, one horizontal sum per block), the
  block scale is applied to that sum, and offsets/mins go through per-16 sums of ``x`` computed
  once per call. Rows are split across threads with ``numba.prange``, one contiguous range each.
* prefill (``n_tokens > 1``): each thread dequantizes 16 rows at a time into a scratch
  (``QuantSpec.row_kernel``, exact) and multiplies them with every token through a 4-row x
  4-token register tile, so the unpacking is paid once per row, not once per token.

Accuracy: everything is float32 (activations are not quantized); against a float64
dequantize-then-matmul the relative error (2-norm over the output) is ~1e-7 .. 1e-6, tested to be
at most 1e-5 on random and real tensors.

Thread count is the caller's business (``numba.set_num_threads``). If the ``tbb`` wheel is
installed, numba's TBB threading layer is used (see :func:`_preload_tbb`): it keeps calls fast
when other processes compete for the cores, where OpenMP's static split stalls.

Each quant type gets its own compiled copy of the drivers (``LazyJit.specialize``), compiled on
first use and cached on disk (about 5-10 s per type the first time, milliseconds afterwards);
:func:`warmup` does it upfront.
"""

from __future__ import annotations

import ctypes
import logging
import os
import site
import sys
import threading

import numba
import numpy as np

from ..errors import InvalidRequestError
from ..quants import QuantSpec, get_spec
from ..quants._jit import jit

log = logging.getLogger(__name__)

# Placeholders: each specialized driver binds these to one quant type's kernels.
_DOT = None  # dot_kernel(w_row, x, xs16, scratch) -> float32
_DEQ = None  # row_kernel(w_row, dst) -> None



def _preload_tbb(prefixes: tuple[str, ...] | None = None) -> str | None:
    """Make numba's TBB threading layer usable when the ``tbb`` wheel is installed.

    numba prefers TBB (work stealing) over OpenMP (static split) but looks for ``libtbb.so.12``
    on the loader path only, which a virtualenv's ``lib/`` is not, so a pip-installed ``tbb`` is
    silently ignored. Loading the library from there first fixes that. Nothing happens when the
    wheel is absent, off Linux, or once numba has started its threads. Returns the path loaded.

    Why it matters: with OpenMP, a matmul waits for its slowest thread; on a machine where
    other processes compete for the cores a descheduled thread stalls every call by a scheduler
    time slice (~8 ms measured, 10-20x the call), while TBB lets the running thread take the
    unstarted share.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        from numba.np.ufunc import parallel as _parallel

        if getattr(_parallel, "_is_initialized", False):
            return None
    except ImportError:  # pragma: no cover - numba layout changed
        return None
    if prefixes is None:
        prefixes = tuple(dict.fromkeys([sys.prefix, sys.base_prefix, getattr(site, "USER_BASE", None) or ""]))
    for prefix in prefixes:
        path = os.path.join(prefix, "lib", "libtbb.so.12")
        if prefix and os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                log.debug("could not load %s: %s", path, e)
                return None
            log.debug("loaded %s for numba's TBB threading layer", path)
            return path
    return None


_preload_tbb()

_ROWS_PER_CHUNK = 16  # prefill: rows dequantized together (a multiple of 4); x tiles are reused across them


@jit(fastmath=True, inline=True)
def _sums16(x, xs):  # pragma: no cover - compiled
    """xs[k] = sum(x[16k:16k+16]); x float32 (cols,), xs float32 (cols // 16,)."""
    for k in range(xs.shape[0]):
        s = np.float32(0)
        for i in range(16):
            s += x[16 * k + i]
        xs[k] = s


@jit(parallel=True, fastmath=True)
def _decode(x, w, out, n_chunks, scratch_len):  # pragma: no cover - compiled
    """out[0, r] = dot(W[r], x[0]). x float32 (1, cols), w uint8 (rows, row_bytes), out float32 (1, rows).

    Rows are split into ``n_chunks`` contiguous ranges (numba hands them to its threads), each
    with its own float32 (scratch_len,) scratch (cols for the types whose ``QuantSpec.dot_scratch``; 0 otherwise).
    """
    x0 = x[0]
    y = out[0]
    cols = x0.shape[0]
    rows = w.shape[0]
    xs = np.empty(cols // 16, np.float32)
    _sums16(x0, xs)
    per = (rows + n_chunks - 1) // n_chunks
    for c in numba.prange(n_chunks):
        scratch = np.empty(scratch_len, np.float32)
        for r in range(c * per, min(rows, (c + 1) * per)):
            y[r] = _DOT(w[r], x0, xs, scratch)
    return out


@jit(fastmath=True)
def _tile(s, r0, nr, x, t0, nt, out):  # pragma: no cover - compiled
    """out[t0:t0+nt, r0:r0+nr] = x[t0:t0+nt] @ s[0:nr].T with a 4x4 register tile.

    s float32 (4, cols) dequantized rows (rows past nr are ignored), x float32 (T, cols).
    Missing rows/tokens of a partial tile reuse the last valid one and are not stored.
    Not inlined: it does not depend on the quant type, so it compiles once for all of them.
    """
    w0 = s[0]
    w1 = s[min(1, nr - 1)]
    w2 = s[min(2, nr - 1)]
    w3 = s[min(3, nr - 1)]
    x0 = x[t0]
    x1 = x[t0 + min(1, nt - 1)]
    x2 = x[t0 + min(2, nt - 1)]
    x3 = x[t0 + min(3, nt - 1)]
    a00 = a01 = a02 = a03 = np.float32(0)
    a10 = a11 = a12 = a13 = np.float32(0)
    a20 = a21 = a22 = a23 = np.float32(0)
    a30 = a31 = a32 = a33 = np.float32(0)
    for k in range(x.shape[1]):
        v0 = w0[k]
        v1 = w1[k]
        v2 = w2[k]
        v3 = w3[k]
        u = x0[k]
        a00 += v0 * u
        a01 += v1 * u
        a02 += v2 * u
        a03 += v3 * u
        u = x1[k]
        a10 += v0 * u
        a11 += v1 * u
        a12 += v2 * u
        a13 += v3 * u
        u = x2[k]
        a20 += v0 * u
        a21 += v1 * u
        a22 += v2 * u
        a23 += v3 * u
        u = x3[k]
        a30 += v0 * u
        a31 += v1 * u
        a32 += v2 * u
        a33 += v3 * u
    acc = ((a00, a01, a02, a03), (a10, a11, a12, a13), (a20, a21, a22, a23), (a30, a31, a32, a33))
    for j in range(nt):
        row = acc[j]
        for i in range(nr):
            out[t0 + j, r0 + i] = row[i]


@jit(parallel=True, fastmath=True)
def _prefill(x, w, out, n_chunks):  # pragma: no cover - compiled
    """out = x @ W.T. x float32 (T, cols), w uint8 (rows, row_bytes), out float32 (T, rows)."""
    n_tok, cols = x.shape
    rows = w.shape[0]
    n_groups = (rows + _ROWS_PER_CHUNK - 1) // _ROWS_PER_CHUNK
    per = (n_groups + n_chunks - 1) // n_chunks
    for c in numba.prange(n_chunks):
        s = np.zeros((_ROWS_PER_CHUNK, cols), np.float32)  # per-thread scratch of dequantized rows
        for g in range(c * per, min(n_groups, (c + 1) * per)):
            r_lo = g * _ROWS_PER_CHUNK
            r_hi = min(rows, r_lo + _ROWS_PER_CHUNK)
            for r in range(r_lo, r_hi):
                _DEQ(w[r], s[r - r_lo])
            for t0 in range(0, n_tok, 4):
                nt = min(4, n_tok - t0)
                for r0 in range(r_lo, r_hi, 4):
                    nr = min(4, r_hi - r0)
                    _tile(s[r0 - r_lo:r0 - r_lo + 4], r0, nr, x, t0, nt, out)
    return out


@jit(parallel=True)
def _dequantize_rows(w, out):  # pragma: no cover - compiled
    """out[r] = dequantize(W[r]) with the exact row kernel. w uint8 (rows, row_bytes), out float32 (rows, cols)."""
    for r in numba.prange(w.shape[0]):
        _DEQ(w[r], out[r])
    return out


class _Drivers:
    """The drivers compiled for one quant type."""

    def __init__(self, spec: QuantSpec) -> None:
        name = spec.name
        self.spec = spec
        self.scratch_per_col = 1 if spec.dot_scratch else 0
        self.decode = _decode.specialize(name, _DOT=spec.dot_kernel)
        self.prefill = _prefill.specialize(name, _DEQ=spec.row_kernel)
        self.dequantize_rows = _dequantize_rows.specialize(name, _DEQ=spec.row_kernel)


_DRIVERS: dict[object, _Drivers] = {}  # by the qtype key callers pass ("Q4_K", 12 ...) and by name
_DRIVERS_LOCK = threading.Lock()


def _drivers(qtype: object) -> _Drivers:
    try:
        d = _DRIVERS.get(qtype)
    except TypeError:  # unhashable: let get_spec name the problem
        d = None
    if d is None:
        spec = get_spec(qtype)  # raises UnsupportedQuantError
        with _DRIVERS_LOCK:
            d = _DRIVERS.get(spec.name)
            if d is None:
                d = _DRIVERS[spec.name] = _Drivers(spec)
            if isinstance(qtype, (str, int)):
                _DRIVERS[qtype] = d
    return d


# Rows are cut into this many ranges, whatever the active thread count (reading it costs ~2 us
# per call); numba's scheduler spreads the ranges over the threads that are active.
_N_CHUNKS = max(1, int(numba.config.NUMBA_NUM_THREADS))


def _readonly(a: np.ndarray) -> np.ndarray:
    # One compiled specialization per driver: mmap'd weights are read-only, so present weights
    # that way (a view; no copy; free when the array is already read-only).
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _writeable(a: np.ndarray) -> np.ndarray:
    # Activations are normally writeable; copy the rare read-only one rather than compile twice.
    return a if a.flags.writeable else a.copy()


def _check_weight(w: np.ndarray, spec: QuantSpec, cols: int) -> None:
    if not isinstance(w, np.ndarray) or w.dtype != np.uint8 or w.ndim != 2:
        raise InvalidRequestError(
            f"w must be a 2-D uint8 array of raw {spec.name} rows, got "
            f"{getattr(w, 'dtype', type(w).__name__)} with shape {getattr(w, 'shape', None)}")
    if not w.flags.c_contiguous:
        raise InvalidRequestError("w must be C-contiguous")
    if cols <= 0 or cols % spec.block_size or w.shape[1] != spec.row_bytes(cols):
        want = spec.row_bytes(cols)  # raises when cols is not a multiple of the block size
        raise InvalidRequestError(
            f"w has {w.shape[1]} bytes per row but {cols} {spec.name} columns need {want}")


_PARALLEL_LOCK = threading.Lock()
_serialize: bool | None = None  # True when numba's threading layer cannot run two regions at once


def _run_parallel(fn, *args):  # type: ignore[no-untyped-def]
    """Call a parallel driver; serialized only under numba's "workqueue" layer, which aborts the
    process when two Python threads enter parallel regions at the same time (omp and tbb do not)."""
    global _serialize
    if _serialize is False:
        return fn(*args)
    with _PARALLEL_LOCK:
        result = fn(*args)
        if _serialize is None:
            _serialize = numba.threading_layer() == "workqueue"
            if _serialize:
                log.info("numba threading layer is workqueue: parallel matmuls are serialized")
    return result


@numba.njit(parallel=True, cache=True, fastmath=True)
def _gelu_erf_rows(x, out):  # pragma: no cover - compiled
    # erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), the formula of minirt.blocks.erf in float32:
    # written as a loop of plain arithmetic and exp the compiler vectorizes (4x libm's scalar erff)
    for i in numba.prange(x.shape[0]):
        for j in range(x.shape[1]):
            v = x[i, j]
            z = v * np.float32(0.7071067811865476)
            a = abs(z)
            t = np.float32(1.0) / (np.float32(1.0) + np.float32(0.3275911) * a)
            poly = t * (np.float32(0.254829592) + t * (np.float32(-0.284496736) + t * (
                np.float32(1.421413741) + t * (np.float32(-1.453152027) + t * np.float32(1.061405429)))))
            y = np.float32(1.0) - poly * np.exp(-a * a)
            out[i, j] = np.float32(0.5) * v * (np.float32(1.0) + (y if z >= 0 else -y))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """``0.5·x·(1 + erf(x/√2))`` of float32 x (..., n), rows split over numba's threads (the numpy
    version, :func:`minirt.blocks.gelu`, evaluates the same formula in float64)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1] if x.ndim else 1)
    out = np.empty_like(x2)
    if x2.size:
        _run_parallel(_gelu_erf_rows, x2, out)
    return out.reshape(np.shape(x))


def matmul(x: np.ndarray, w: np.ndarray, qtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """``y = x @ W.T`` computed from the quantized rows of ``W``.

    x: float32 ``(n_tokens, cols)`` C-contiguous (a 1-D ``(cols,)`` is one token and gives a
    ``(rows,)`` result); w: uint8 ``(rows, row_bytes)`` C-contiguous, the raw ggml rows of
    ``qtype``; out: optional float32 ``(n_tokens, rows)`` C-contiguous, written in place.
    Returns float32 ``(n_tokens, rows)``. Raises :class:`minirt.InvalidRequestError` on a shape,
    dtype or layout mismatch and :class:`minirt.UnsupportedQuantError` for an unsupported type.
    """
    d = _drivers(qtype)
    spec = d.spec
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not 1 <= x.ndim <= 2:
        raise InvalidRequestError(
            f"x must be a float32 array of shape (n_tokens, cols) or (cols,), got "
            f"{getattr(x, 'dtype', type(x).__name__)} with shape {getattr(x, 'shape', None)}")
    if not x.flags.c_contiguous:
        raise InvalidRequestError("x must be C-contiguous")
    one_d = x.ndim == 1
    x2 = x.reshape(1, -1) if one_d else x
    n_tok, cols = x2.shape
    _check_weight(w, spec, cols)
    rows = w.shape[0]
    shape = (rows,) if one_d else (n_tok, rows)
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape:
            raise InvalidRequestError(
                f"out must be float32 of shape {shape}, got "
                f"{getattr(out, 'dtype', type(out).__name__)} with shape {getattr(out, 'shape', None)}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidRequestError("out must be C-contiguous and writeable")
        if np.may_share_memory(out, x2) or np.may_share_memory(out, w):
            raise InvalidRequestError("out must not overlap x or w")
    if n_tok == 0 or rows == 0:
        return out
    out2 = out.reshape(1, rows) if one_d else out
    x2 = _writeable(x2)
    w = _readonly(w)
    if n_tok == 1:
        # the parallel region costs ~1 us, less than a 128 x 896 matrix takes on one thread
        _run_parallel(d.decode, x2, w, out2, min(_N_CHUNKS, rows), cols * d.scratch_per_col)
    else:
        n_groups = (rows + _ROWS_PER_CHUNK - 1) // _ROWS_PER_CHUNK
        _run_parallel(d.prefill, x2, w, out2, min(_N_CHUNKS, n_groups))
    return out


def dequantize(w: np.ndarray, qtype: str, cols: int, out: np.ndarray | None = None) -> np.ndarray:
    """Dequantize raw rows ``w`` uint8 ``(rows, row_bytes)`` into float32 ``(rows, cols)`` with the
    numba row kernels (bit-identical to the numpy spec in :mod:`minirt.quants`), rows in parallel."""
    d = _drivers(qtype)
    _check_weight(w, d.spec, cols)
    rows = w.shape[0]
    if out is None:
        out = np.empty((rows, cols), dtype=np.float32)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (rows, cols)
          or not out.flags.c_contiguous or not out.flags.writeable):
        raise InvalidRequestError(f"out must be writeable C-contiguous float32 of shape {(rows, cols)}")
    if rows:
        _run_parallel(d.dequantize_rows, _readonly(w), out)
    return out


def warmup(qtypes: tuple[str, ...] | list[str], prefill: bool = True) -> None:
    """Compile (or load from the on-disk cache) the drivers of ``qtypes`` ahead of first use."""
    for q in qtypes:
        spec = get_spec(q)
        cols = spec.block_size * max(1, 256 // spec.block_size)
        w = np.zeros((2, spec.row_bytes(cols)), dtype=np.uint8)
        matmul(np.zeros((1, cols), np.float32), w, q)
        if prefill:
            matmul(np.zeros((2, cols), np.float32), w, q)


__all__ = ["matmul", "dequantize", "warmup"]
