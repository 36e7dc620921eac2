"""Native CPU kernels (C through cffi): quantized matmul straight from ggml blocks, plus the small
decoder-step helpers (RMSNorm, RoPE, softmax, single-query attention).

Loading, in order: the extension built at install time (``minirt._native``), else a copy compiled on
first use into ``$MINIRT_HOME/native/<hash of sources + compiler + python>/`` (a file lock keeps
concurrent processes from building twice), else :class:`minirt.BackendError` with the reason.

The instruction set is chosen at run time from the CPU (AVX-512 VNNI, AVX2+FMA, scalar; NEON on
AArch64); ``MINIRT_ISA=scalar|avx2|avx512|neon`` forces a lower one, and every call takes ``isa=``.

Paths (``matmul_path`` tells which one a call takes):

- up to 4 tokens, ``int16``: activations quantized to int16 per 32 elements (scale = max|x| / 32767)
  and dotted in integers against the unpacked weights (AVX-512 VNNI ``vpdpwssd``, AVX2
  ``vpmaddwd``), each 32-block's sum scaled in float32. Error bound, per output:
  ``|y - y64| <= sum_i |W_i| * max|x_block(i)| / 65534`` plus float32 rounding: every activation
  is off by at most 2**-16 of its block's maximum, 128x finer than llama.cpp's int8 (Q8_0 / Q8_K)
  activations. Measured on real tensors of both models (random activations): max |y - y64| /
  max |y64| = 2e-5 .. 6e-5 (up to 1.6e-4 with 30x outlier channels) against 3e-3 .. 2e-2 for int8
  activations; mean error 0.4 % .. 1.3 % of the int8 one (``tests/test_native.py`` asserts the
  bound, < 5e-4, and < 10 %).
- more tokens, ``float-tile`` / ``float-panel``: weights dequantized to float32 once per block of
  tokens (exactly, as gguf-py does) and multiplied in float32 with FMA register tiles; the panel
  (AVX-512, from 12 tokens) transposes 32 rows into a panel and forms outer products.
- the scalar path (and types without an integer kernel) dequantize a row and dot in float32.

Threads: a persistent pthread pool (``set_threads``; default the physical core count) splits rows
by dynamic chunking; workers spin briefly between calls, then sleep. If another process
deschedules a worker mid-chunk, the caller recomputes that chunk itself instead of waiting (the
late result is dropped), so a busy core slows a call down instead of stalling it. All calls
release the GIL (cffi API mode).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendError, InvalidRequestError, UnsupportedQuantError

log = logging.getLogger(__name__)

ISA_NAMES = ("scalar", "avx2", "avx512", "neon", "neon_dot")
_ISA_IDS = {n: i for i, n in enumerate(ISA_NAMES)}

# name -> (ggml id, elements per block, bytes per block) for every type the kernels compute with
QTYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "IQ4_NL": (20, 32, 18),
    "IQ4_XS": (23, 256, 136),
}

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_U8 = np.dtype(np.uint8)
_I32 = np.dtype(np.int32)

_load_lock = threading.Lock()
_mod: Any = None
_load_error: str | None = None
_build_path: str | None = None
_source: str | None = None


# ----------------------------------------------------------------------------------- loading

def _native_src_dir() -> Path | None:
    env = os.environ.get("MINIRT_NATIVE_SRC")
    cands = [Path(env)] if env else []
    cands.append(Path(__file__).resolve().parents[2] / "native")  # source checkout
    try:  # installed copy: the sources ship as package data
        spec = importlib.util.find_spec("minirt._native_src")
        if spec is not None and spec.submodule_search_locations:
            cands.extend(Path(p) for p in spec.submodule_search_locations)
    except (ImportError, ValueError):
        pass
    for c in cands:
        if (c / "build.py").is_file() and (c / "api.h").is_file():
            return c
    return None


def _compiler_id() -> str:
    """First line of ``$CC --version`` (the compiler the build will use); raises BackendError if none."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    exe = cc.split()[0]
    try:
        res = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise BackendError(f"native kernels: no C compiler ({exe!r}: {e})") from e
    if res.returncode != 0:
        raise BackendError(f"native kernels: C compiler {exe!r} failed: {res.stderr.strip()[:200]}")
    return (res.stdout.splitlines() or [""])[0]


def _import_from(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BackendError(f"native kernels: cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _find_ext(d: Path, name: str) -> Path | None:
    for suffix in (".so", ".pyd", ".dylib"):
        hits = sorted(d.glob(f"{name}*{suffix}"))
        if hits:
            return hits[0]
    return None


class _FileLock:
    """Exclusive lock on a file (fcntl where available; no-op elsewhere)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> "_FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - non-POSIX
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.fd is not None
        try:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
        except ImportError:  # pragma: no cover
            pass
        os.close(self.fd)


def _jit_build() -> tuple[Any, str]:
    src = _native_src_dir()
    if src is None:
        raise BackendError("native kernels: no prebuilt extension and the C sources (native/) are not available")
    spec = importlib.util.spec_from_file_location("_minirt_native_build", src / "build.py")
    if spec is None or spec.loader is None:
        raise BackendError(f"native kernels: cannot load {src / 'build.py'}")
    build = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(build)
    except ImportError as e:
        raise BackendError(f"native kernels: build needs cffi ({e})") from e
    ident = "|".join([_compiler_id(), sys.version, platform.machine(), platform.system()])
    key = build.source_hash(ident)
    name = f"_minirt_native_{key}"
    home = Path(os.environ.get("MINIRT_HOME") or Path.home() / ".cache" / "minirt")
    root = home / "native"
    target = root / key
    found = _find_ext(target, name) if target.is_dir() else None
    if found is None:
        root.mkdir(parents=True, exist_ok=True)
        with _FileLock(root / f"{key}.lock"):
            found = _find_ext(target, name) if target.is_dir() else None
            if found is None:
                log.info("building native kernels into %s (first use)", target)
                tmp = Path(tempfile.mkdtemp(prefix=f"tmp-{key}-", dir=root))
                try:
                    out = build.make_ffi(name).compile(tmpdir=str(tmp), verbose=False)
                except Exception as e:  # compiler errors surface as distutils/setuptools exceptions
                    raise BackendError(f"native kernels: compilation failed: {e}") from e
                ext = Path(out)
                final = tmp / ext.name
                if ext != final:
                    os.replace(ext, final)
                for junk in tmp.iterdir():  # keep only the extension
                    if junk != final:
                        if junk.is_dir():
                            import shutil

                            shutil.rmtree(junk, ignore_errors=True)
                        else:
                            junk.unlink()
                os.replace(tmp, target)
                found = target / ext.name
    return _import_from(found, name), str(found)


def _load() -> Any:
    global _mod, _load_error, _build_path, _source
    if _mod is not None:
        return _mod
    with _load_lock:
        if _mod is not None:
            return _mod
        if _load_error is not None and not os.environ.get("MINIRT_NATIVE_RETRY"):
            raise BackendError(_load_error)
        try:
            try:
                if os.environ.get("MINIRT_NATIVE_JIT"):  # force the on-demand build (tests)
                    raise ImportError("MINIRT_NATIVE_JIT set")
                from .. import _native as mod  # type: ignore[attr-defined]

                _build_path = getattr(mod, "__file__", None)
                _source = "installed"
            except ImportError:
                mod, _build_path = _jit_build()
                _source = "jit"
        except BackendError as e:
            _load_error = str(e)
            raise
        except Exception as e:  # pragma: no cover - anything unexpected is still a backend failure
            _load_error = f"native kernels: {type(e).__name__}: {e}"
            raise BackendError(_load_error) from e
        _mod = mod
        return mod


def available() -> bool:
    """True when the native kernels load (building them on first use if needed)."""
    try:
        _load()
        return True
    except BackendError:
        return False


def _lib() -> tuple[Any, Any]:
    m = _mod if _mod is not None else _load()
    return m.ffi, m.lib


def supported_isas() -> list[str]:
    """ISAs this CPU can run, lowest first."""
    _, lib = _lib()
    mask = lib.mr_isa_mask()
    return [n for i, n in enumerate(ISA_NAMES) if mask & (1 << i)]


def info() -> dict[str, Any]:
    """Selected ISA, supported ISAs, default threads, physical cores, extension path and origin."""
    _, lib = _lib()
    return {
        "isa": ISA_NAMES[lib.mr_isa_selected()],
        "isas": supported_isas(),
        "threads": int(lib.mr_get_threads()),
        "physical_cores": int(lib.mr_physical_cores()),
        "build_path": _build_path,
        "source": _source,
    }


def set_threads(n: int | None) -> int:
    """Set the default number of threads (None: physical cores); returns the value in force."""
    _, lib = _lib()
    if n is not None and (not isinstance(n, (int, np.integer)) or n < 1):
        raise InvalidRequestError(f"threads must be a positive integer or None, got {n!r}")
    return int(lib.mr_set_threads(0 if n is None else int(n)))


def get_threads() -> int:
    """Default number of threads of native calls."""
    _, lib = _lib()
    return int(lib.mr_get_threads())


def set_isa(isa: str | None) -> str:
    """Select the ISA for later calls (None: the best this CPU supports); returns the one in force."""
    _, lib = _lib()
    rc = lib.mr_set_isa(-1 if isa is None else _isa_id(isa))
    if rc < 0:
        raise BackendError(f"ISA {isa!r} is not supported by this CPU (supported: {supported_isas()})")
    return ISA_NAMES[rc]


# ----------------------------------------------------------------------------------- validation

def _isa_id(isa: str | None) -> int:
    if isa is None:
        return -1
    i = _ISA_IDS.get(isa) if isinstance(isa, str) else None
    if i is None:
        raise InvalidRequestError(f"unknown ISA {isa!r}; expected one of {ISA_NAMES}")
    _, lib = _lib()
    if not lib.mr_isa_mask() & (1 << i):
        raise BackendError(f"ISA {isa!r} is not supported by this CPU (supported: {supported_isas()})")
    return i


def _qtype(qtype: str | int) -> tuple[str, int, int, int]:
    if isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        for name, (tid, bs, ts) in QTYPES.items():
            if tid == int(qtype):
                return name, tid, bs, ts
        raise UnsupportedQuantError(f"ggml type id {int(qtype)} is not supported by the native kernels")
    if not isinstance(qtype, str):
        raise InvalidRequestError(f"qtype must be a ggml type name such as 'Q4_K', got {qtype!r}")
    name = qtype.upper()
    t = QTYPES.get(name)
    if t is None:
        raise UnsupportedQuantError(f"quantization type {qtype!r} is not supported by the native kernels "
                                    f"(supported: {', '.join(QTYPES)})")
    return (name,) + t


def _f32_array(a: Any, what: str, ndim: tuple[int, ...]) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise InvalidRequestError(f"{what} must be a numpy array, got {type(a).__name__}")
    if a.dtype != _F32:
        raise InvalidRequestError(f"{what} must be float32, got {a.dtype}")
    if a.ndim not in ndim:
        raise InvalidRequestError(f"{what} must have {' or '.join(map(str, ndim))} dimensions, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise InvalidRequestError(f"{what} must be C-contiguous")
    return a


def _out_array(out: Any, shape: tuple[int, ...], what: str = "out") -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != _F32:
        raise InvalidRequestError(f"{what} must be a float32 numpy array")
    if out.shape != shape:
        raise InvalidRequestError(f"{what} has shape {out.shape}, expected {shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidRequestError(f"{what} must be C-contiguous and writeable")
    return out


def _overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.may_share_memory(a, b))


def _threads_arg(threads: int | None) -> int:
    if threads is None:
        return 0
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise InvalidRequestError(f"threads must be a positive integer or None, got {threads!r}")
    return int(threads)


def _check_rc(rc: int, what: str) -> None:
    if rc == 0:
        return
    msg = {-1: "unsupported quantization type", -2: "invalid shape", -3: "ISA not supported",
           -4: "out of memory", -5: "could not start threads"}.get(rc, f"error {rc}")
    raise BackendError(f"native {what}: {msg}")


# ----------------------------------------------------------------------------------- kernels

# (pool generation, arrays) of calls whose late workers may still read the arrays
_keepalive: list[tuple[int, Any, Any]] = []
_keepalive_lock = threading.Lock()


def _prune_keepalive(lib: Any) -> None:
    with _keepalive_lock:
        _keepalive[:] = [e for e in _keepalive if not lib.mr_pool_quiescent(e[0])]


def matmul(x: np.ndarray, w: np.ndarray, qtype: str, out: np.ndarray | None = None,
           threads: int | None = None, isa: str | None = None) -> np.ndarray:
    """``Y = X @ W.T`` straight from quantized blocks.

    x: float32 (n_tokens, cols) (or (cols,) for one token), C-contiguous.
    w: uint8 (rows, row_bytes) ggml blocks of ``qtype``, rows C-contiguous.
    out: float32 (n_tokens, rows) (or (rows,)), written in place when given.
    Returns out: float32 (n_tokens, rows).
    """
    m = _mod if _mod is not None else _load()
    ffi, lib = m.ffi, m.lib
    name, tid, bs, ts = _qtype(qtype)
    if not isinstance(x, np.ndarray) or x.dtype != _F32:
        raise InvalidRequestError(f"x must be a float32 numpy array, got "
                                  f"{x.dtype if isinstance(x, np.ndarray) else type(x).__name__}")
    if x.ndim == 2:
        nt, cols = x.shape
    elif x.ndim == 1:
        nt, cols = 1, x.shape[0]
    else:
        raise InvalidRequestError(f"x must be (n_tokens, cols) or (cols,), got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise InvalidRequestError("x must be C-contiguous")
    if not isinstance(w, np.ndarray) or w.dtype != _U8 or w.ndim != 2:
        raise InvalidRequestError(f"w must be a uint8 array of shape (rows, row_bytes), got "
                                  f"{getattr(w, 'dtype', type(w).__name__)} {getattr(w, 'shape', '')}")
    if not w.flags.c_contiguous:
        raise InvalidRequestError("w must be C-contiguous")
    rows, row_bytes = w.shape
    if cols == 0 or cols % bs:
        raise InvalidRequestError(f"{name}: cols={cols} is not a positive multiple of the block size {bs}")
    if row_bytes != cols // bs * ts:
        raise InvalidRequestError(f"{name}: w has {row_bytes} bytes per row, {cols} columns need {cols // bs * ts}")
    shape = (nt, rows) if x.ndim == 2 else (rows,)
    if out is None:
        out = np.empty(shape, dtype=_F32)
    else:
        _out_array(out, shape)
        if _overlaps(out, x):
            raise InvalidRequestError("out must not overlap x")
    if rows == 0 or nt == 0:
        return out
    rc = lib.mr_matmul(tid, ffi.from_buffer("unsigned char[]", w), rows, cols, row_bytes,
                       ffi.from_buffer("float[]", x), nt, cols, ffi.from_buffer("float[]", out, require_writable=True),
                       rows, _threads_arg(threads), _isa_id(isa))
    if rc > 0:
        # the caller took over rows from a descheduled worker, which may still read w and x:
        # keep them alive until it has left that job
        _keepalive.append((lib.mr_pool_generation(), w, x))
    elif rc < 0:
        _check_rc(rc, "matmul")
    if _keepalive:
        _prune_keepalive(lib)
    return out


def matmul_path(qtype: str, n_tokens: int, isa: str | None = None) -> str:
    """Which code path ``matmul`` takes: 'int16' (quantized activations), 'float-dot', 'float-tile' or
    'float-panel' (the float ones dequantize the weights and compute in float32)."""
    ffi, lib = _lib()
    _, tid, _, _ = _qtype(qtype)
    rc = lib.mr_matmul_path(tid, int(n_tokens), _isa_id(isa))
    return {1: "int16", 2: "float-dot", 3: "float-tile", 4: "float-panel"}.get(rc, "none")


def dequantize(w: np.ndarray, qtype: str, cols: int | None = None) -> np.ndarray:
    """Dequantize ``w`` (rows, row_bytes) uint8 blocks to float32 (rows, cols)."""
    ffi, lib = _lib()
    name, tid, bs, ts = _qtype(qtype)
    if not isinstance(w, np.ndarray) or w.dtype != _U8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise InvalidRequestError("w must be a C-contiguous uint8 array of shape (rows, row_bytes)")
    rows, rb = w.shape
    if rb % ts:
        raise InvalidRequestError(f"{name}: {rb} bytes per row is not a whole number of {ts}-byte blocks")
    n = rb // ts * bs
    if cols is not None and cols != n:
        raise InvalidRequestError(f"{name}: {rb} bytes per row hold {n} values, not {cols}")
    out = np.empty((rows, n), dtype=_F32)
    if out.size:
        _check_rc(lib.mr_dequantize(tid, ffi.from_buffer("unsigned char[]", w), rows * n,
                                    ffi.from_buffer("float[]", out, require_writable=True)), "dequantize")
    return out


def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float, out: np.ndarray | None = None,
            isa: str | None = None) -> np.ndarray:
    """``out = x / sqrt(mean(x**2, axis=-1) + eps) * weight`` over the rows of x (n,) or (rows, n)."""
    ffi, lib = _lib()
    x = _f32_array(x, "x", (1, 2))
    n = x.shape[-1]
    rows = 1 if x.ndim == 1 else x.shape[0]
    if n == 0:
        raise InvalidRequestError("x rows must not be empty")
    if weight is not None:
        weight = _f32_array(weight, "weight", (1,))
        if weight.shape[0] != n:
            raise InvalidRequestError(f"weight has {weight.shape[0]} elements, x rows have {n}")
    if not np.isfinite(eps) or eps < 0:
        raise InvalidRequestError(f"eps must be a finite non-negative float, got {eps!r}")
    if out is None:
        out = np.empty_like(x)
    else:
        _out_array(out, x.shape)
    if rows:
        wptr = ffi.NULL if weight is None else ffi.from_buffer("float[]", weight)
        _check_rc(lib.mr_rmsnorm(ffi.from_buffer("float[]", x), wptr, float(eps), rows, n,
                                 ffi.from_buffer("float[]", out, require_writable=True), _isa_id(isa)), "rmsnorm")
    return out


def rope_freqs(n_rot: int, freq_base: float = 10000.0, freq_scale: float = 1.0) -> np.ndarray:
    """Rotary frequencies ``freq_scale * freq_base ** (-2i / n_rot)`` for i < n_rot / 2, float32."""
    if n_rot <= 0 or n_rot % 2:
        raise InvalidRequestError(f"n_rot must be a positive even number, got {n_rot}")
    i = np.arange(n_rot // 2, dtype=np.float64)
    return (freq_scale * freq_base ** (-2.0 * i / n_rot)).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray | None = None, *, neox: bool, n_rot: int | None = None,
         freq_base: float = 10000.0, freq_scale: float = 1.0, freqs: np.ndarray | None = None,
         cos: np.ndarray | None = None, sin: np.ndarray | None = None, isa: str | None = None) -> np.ndarray:
    """Rotary position embedding of x (n_tokens, n_heads, head_dim) float32, in place; returns x.

    The first ``n_rot`` dims (default head_dim) rotate: NEOX style pairs (i, i + n_rot/2), normal style
    pairs (2i, 2i+1). Angles: ``positions[t] * freqs[i]`` with ``freqs`` given or from
    ``freq_base``/``freq_scale``; or precomputed ``cos``/``sin`` tables of shape (n_tokens, n_rot/2).
    """
    ffi, lib = _lib()
    x = _f32_array(x, "x", (3,))
    if not x.flags.writeable:
        raise InvalidRequestError("x must be writeable (rope works in place)")
    nt, nh, hd = x.shape
    n_rot = hd if n_rot is None else int(n_rot)
    if n_rot <= 0 or n_rot % 2 or n_rot > hd:
        raise InvalidRequestError(f"n_rot must be even and in 1..head_dim={hd}, got {n_rot}")
    half = n_rot // 2
    if cos is not None or sin is not None:
        if cos is None or sin is None:
            raise InvalidRequestError("cos and sin must be given together")
        cos = _f32_array(cos, "cos", (2,))
        sin = _f32_array(sin, "sin", (2,))
        if cos.shape != (nt, half) or sin.shape != (nt, half):
            raise InvalidRequestError(f"cos/sin must have shape {(nt, half)}, got {cos.shape} and {sin.shape}")
        _check_rc(lib.mr_rope_cs(ffi.from_buffer("float[]", x, require_writable=True), nt, nh, hd, n_rot,
                                 ffi.from_buffer("float[]", cos), ffi.from_buffer("float[]", sin), int(bool(neox)),
                                 _isa_id(isa)), "rope")
        return x
    if positions is None:
        raise InvalidRequestError("rope needs positions (or cos/sin tables)")
    pos = np.ascontiguousarray(positions)
    if pos.dtype.kind not in "iu" or pos.ndim != 1 or pos.shape[0] != nt:
        raise InvalidRequestError(f"positions must be an integer array of shape ({nt},), got {pos.dtype} {pos.shape}")
    if nt and (pos.min() < -(2**31) or pos.max() >= 2**31):
        raise InvalidRequestError("positions out of int32 range")
    pos = pos.astype(_I32, copy=False)
    if freqs is None:
        freqs = rope_freqs(n_rot, freq_base, freq_scale)
    else:
        freqs = _f32_array(freqs, "freqs", (1,))
        if freqs.shape[0] != half:
            raise InvalidRequestError(f"freqs must have n_rot/2 = {half} elements, got {freqs.shape[0]}")
    if nt:
        _check_rc(lib.mr_rope(ffi.from_buffer("float[]", x, require_writable=True), nt, nh, hd, n_rot,
                              ffi.from_buffer("int[]", pos), ffi.from_buffer("float[]", freqs), int(bool(neox)),
                              _isa_id(isa)), "rope")
    return x


def softmax(x: np.ndarray, out: np.ndarray | None = None, isa: str | None = None) -> np.ndarray:
    """Softmax over the last axis of x (n,) or (rows, n); in place when ``out is x``."""
    ffi, lib = _lib()
    x = _f32_array(x, "x", (1, 2))
    if x.shape[-1] == 0:
        raise InvalidRequestError("x rows must not be empty")
    if out is None:
        out = x.copy()
    elif out is not x:
        _out_array(out, x.shape)
        np.copyto(out, x)
    elif not x.flags.writeable:
        raise InvalidRequestError("x must be writeable for an in-place softmax")
    rows = 1 if out.ndim == 1 else out.shape[0]
    if rows:
        _check_rc(lib.mr_softmax(ffi.from_buffer("float[]", out, require_writable=True), rows, out.shape[-1],
                                 _isa_id(isa)), "softmax")
    return out


def attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int, scale: float,
                     out: np.ndarray | None = None, window: int = 0, softcap: float = 0.0,
                     threads: int | None = None, isa: str | None = None) -> np.ndarray:
    """One query position against a KV cache, grouped-query.

    q: (n_head, head_dim) float32; k_cache, v_cache: (n_kv, n_ctx, head_dim) float32 or float16, the
    first ``n_past`` positions valid; ``window`` > 0 keeps only the last ``window`` positions; softcap
    > 0 applies ``softcap * tanh(s / softcap)`` to the scaled scores. Returns out (n_head, head_dim).
    """
    ffi, lib = _lib()
    q = _f32_array(q, "q", (2,))
    n_head, hd = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, np.ndarray) or c.dtype not in (_F32, _F16) or c.ndim != 3:
            raise InvalidRequestError(f"{name} must be a float32 or float16 array (n_kv, n_ctx, head_dim)")
        if not c.flags.c_contiguous:
            raise InvalidRequestError(f"{name} must be C-contiguous")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise InvalidRequestError(f"k_cache {k_cache.dtype}{k_cache.shape} and v_cache "
                                  f"{v_cache.dtype}{v_cache.shape} must match")
    n_kv, n_ctx, hd2 = k_cache.shape
    if hd2 != hd:
        raise InvalidRequestError(f"cache head_dim {hd2} != q head_dim {hd}")
    if n_kv == 0 or n_head % n_kv:
        raise InvalidRequestError(f"n_head={n_head} must be a multiple of n_kv={n_kv}")
    if isinstance(n_past, bool) or not isinstance(n_past, (int, np.integer)) or not 1 <= n_past <= n_ctx:
        raise InvalidRequestError(f"n_past must be in 1..n_ctx={n_ctx}, got {n_past!r}")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise InvalidRequestError(f"window must be a non-negative integer, got {window!r}")
    if not np.isfinite(scale) or not np.isfinite(softcap) or softcap < 0:
        raise InvalidRequestError("scale must be finite and softcap finite and >= 0")
    if out is None:
        out = np.empty((n_head, hd), dtype=_F32)
    else:
        _out_array(out, (n_head, hd))
    f16 = k_cache.dtype == _F16
    ctype = "uint16_t[]" if f16 else "float[]"
    kb = k_cache.view(np.uint16) if f16 else k_cache
    vb = v_cache.view(np.uint16) if f16 else v_cache
    _check_rc(lib.mr_attention_decode(ffi.from_buffer("float[]", q), ffi.from_buffer(ctype, kb),
                                      ffi.from_buffer(ctype, vb), int(f16), n_head, n_kv, n_ctx, hd, int(n_past),
                                      float(scale), int(window), float(softcap),
                                      ffi.from_buffer("float[]", out, require_writable=True), _threads_arg(threads),
                                      _isa_id(isa)), "attention_decode")
    return out


__all__ = [
    "available", "info", "supported_isas", "set_threads", "get_threads", "set_isa", "matmul", "matmul_path",
    "dequantize", "rmsnorm", "rope", "rope_freqs", "softmax", "attention_decode", "QTYPES", "ISA_NAMES",
]
