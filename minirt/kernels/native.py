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
- from 11 tokens on packed Q4_0 / Q5_0 / Q8_0 / Q4_K / Q6_K matrices (AVX-512 VNNI), ``int16-gemm``: the
  same int16 activations as the ``int16`` path (so the same error bound, and each token of a batch
  gets what it gets alone up to float32 summation order), with 16 tokens in the lanes of each
  ``vpdpwssd`` and every weight pair broadcast: 1.1-1.5x the float panel's speed, and at 16 tokens (a
  16-sequence decode step) 1.2-1.5x the packed decode kernels, which keep 5..10 tokens
  (``native/x86_avx512_gemm.c`` says why not int8).
- from 64 tokens with the ``avx512_amx`` ISA (CPUs with AMX-BF16, e.g. Xeon Sapphire Rapids and later;
  chosen by default where present, ``MINIRT_ISA=avx512`` or ``MINIRT_AMX=0`` turns it off), ``amx-bf16``: every
  type but F32, weights dequantized as the float paths do and activations in float32, each factor split
  into two bf16 (hi + lo, each within 2**-16 of it) and multiplied in AMX tiles, hi*hi + hi*lo + lo*hi summed
  in float32: at most 3 * 2**-16 of sum |w x| per output (``native/x86_amx.c``).
- with ``avx512_amx`` on CPUs with AMX-INT8 (``MINIRT_AMX_INT8=0`` leaves it out), ``amx-int8``: the ``int16-gemm``
  for packed Q4_0 / Q5_0 / Q8_0 / Q4_K from 10 tokens (Q6_K from 13) up to 255 (packed matrices keep it
  before ``amx-bf16``), each int16 activation split exactly into a signed high and an unsigned low byte and
  multiplied with the int8 weights in AMX tiles: the same int32 block sums, so the same results bit for bit,
  1.1-1.9x faster at 12-64 tokens (a 16-sequence decode step, the prompts of a batch).
- the scalar path (and types without an integer kernel) dequantize a row and dot in float32.

Threads: a persistent pthread pool (``set_threads``; default the physical core count) splits rows
by dynamic chunking; workers spin briefly between calls, then sleep. If another process
deschedules a worker mid-chunk, the caller recomputes that chunk itself instead of waiting (the
late result is dropped), so a busy core slows a call down instead of stalling it. All calls
release the GIL (cffi API mode).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import mmap
import os
import platform
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..blocks import GatedDeltaNet, Mamba2, MoE, ParallelMixer, ParallelMoE, ShortConv
from ..errors import BackendError, InvalidRequestError, UnsupportedQuantError

log = logging.getLogger(__name__)

ISA_NAMES = ("scalar", "avx2", "avx512", "neon", "neon_dot", "avx512_amx")
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
    "IQ2_XXS": (16, 256, 66),
    "IQ2_XS": (17, 256, 74),
    "IQ3_XXS": (18, 256, 98),
    "IQ1_S": (19, 256, 50),
    "IQ3_S": (21, 256, 110),
    "IQ2_S": (22, 256, 82),
    "IQ1_M": (29, 256, 56),
    "TQ1_0": (34, 256, 54),
    "TQ2_0": (35, 256, 66),
    "MXFP4": (39, 32, 17),
}

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)

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

    def __enter__(self) -> _FileLock:
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


def _stale_installed(mod: Any) -> str | None:
    """Why the installed extension must not be used, or None. Only a source checkout (an editable
    install) can go stale: the extension carries the hash of the sources it was built from
    (``mr_source_hash``), compared here with the C sources next to the package."""
    src = Path(__file__).resolve().parents[2] / "native"
    if not (src / "build.py").is_file():
        return None  # an installed wheel: the extension is what was built from its own sources
    ext_file = getattr(mod, "__file__", "the installed extension")
    try:
        built = mod.ffi.string(mod.lib.mr_source_hash()).decode()
    except AttributeError:
        return f"{ext_file} predates source hashes"
    spec = importlib.util.spec_from_file_location("_minirt_native_hash", src / "build.py")
    if spec is None or spec.loader is None:
        return None
    build = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(build)
        now = build.source_hash()
    except Exception as e:  # noqa: BLE001 - unreadable sources: keep the installed build
        log.debug("native kernels: cannot hash the sources (%s)", e)
        return None
    return None if now == built else f"{ext_file} was built from other sources"


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

                stale = _stale_installed(mod)
                if stale:
                    log.info("native kernels: %s; building them from the sources", stale)
                    raise ImportError(stale)
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


def loaded() -> bool:
    """True when the extension is already loaded in this process (never builds or imports it)."""
    return _mod is not None


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


def _after_call(lib: Any, rc: int, what: str, a: Any, b: Any) -> None:
    """After a pool call: rc > 0 means the caller took over work from a descheduled worker, which
    may still read ``a`` and ``b``: keep them alive until it has left that job. rc < 0 raises."""
    if rc > 0:
        with _keepalive_lock:
            _keepalive.append((lib.mr_pool_generation(), a, b))
    elif rc < 0:
        _check_rc(rc, what)
    if _keepalive:
        _prune_keepalive(lib)


def drain_keepalive(timeout: float = 10.0) -> int:
    """Wait (up to ``timeout`` s) until no pool worker is inside a job published before this call, then
    drop the arrays kept alive for late workers of those jobs; returns how many of them are still held
    (0 unless it timed out).

    Called when a model closes, before its weights and file mapping go: a worker overtaken in one of
    the model's jobs (descheduled after claiming rows the caller then computed itself) may still be
    reading them, whether or not that call was recorded in ``_keepalive``. Workers always finish an
    item, so this only waits for the scheduler to run them again (about a time slice)."""
    if _mod is None:
        return 0
    lib = _mod.lib
    # the jobs published so far: later ones (other models still running) do not hold this up
    gen = lib.mr_pool_generation()
    start = time.monotonic()
    warned = False
    while not lib.mr_pool_quiescent(gen):
        waited = time.monotonic() - start
        if waited >= timeout:
            break
        if not warned and waited >= 1.0:
            log.warning("a native pool worker is still inside a job after 1 s; waiting for it")
            warned = True
        time.sleep(0.0005)
    _prune_keepalive(lib)
    with _keepalive_lock:
        left = sum(1 for e in _keepalive if e[0] <= gen)
    if left:
        log.warning("%d native call(s) still have a worker inside after %.1f s", left, timeout)
    return left


class PackArena:
    """One anonymous memory region (2 MiB aligned, transparent huge pages requested) that packed
    matrices are carved from: the decode kernels stream it with few TLB misses."""

    _HUGE = 2 << 20

    def __init__(self, nbytes: int) -> None:
        self.size = int(nbytes)
        self._map = mmap.mmap(-1, self.size + self._HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # pragma: no cover - kernels without THP
                pass
        base = np.frombuffer(self._map, dtype=_U8)
        off = (-_address(base)) % self._HUGE
        self._buf = base[off:off + self.size]
        # fault every page in now, from one thread: faults taken inside the kernel's copy of a read()
        # or by several packing threads at once cost several times more (measured: a 390 MB read
        # into untouched huge pages 0.6-0.8 s, into touched ones 0.07 s + 0.05 s for the touching)
        self._buf[::4096] = 0
        self._used = 0

    @property
    def buffer(self) -> np.ndarray:
        """The whole region (``size`` bytes), e.g. to fill from or write to a file."""
        return self._buf

    def take(self, nbytes: int) -> np.ndarray:
        """A 64-byte aligned uint8 slice of ``nbytes`` bytes."""
        start = (self._used + 63) & ~63
        if start + nbytes > self.size:
            raise BackendError(f"pack arena of {self.size} bytes is full")
        self._used = start + nbytes
        return self._buf[start:start + nbytes]


class PackedMatrix:
    """A quantized weight matrix (rows, cols) repacked for the native decode kernels.

    Same bytes as the ggml rows, reordered into tiles of 4 rows x 128 columns (``native/pack.c``);
    ``matmul`` accepts it in place of the ggml array and gives the same results.
    """

    __slots__ = ("data", "qtype", "rows", "cols", "__weakref__")

    def __init__(self, data: np.ndarray, qtype: str, rows: int, cols: int) -> None:
        self.data = data
        self.qtype = qtype
        self.rows = rows
        self.cols = cols

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def __repr__(self) -> str:
        return f"PackedMatrix({self.qtype}, {self.rows}x{self.cols}, {self.nbytes} bytes)"


def _positive_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0


def _check_packed(pm: Any, what: str = "w", rows: int | None = None, cols: int | None = None) -> tuple[str, int]:
    """Validate a :class:`PackedMatrix` before C reads it: a known packable type, positive shape
    (``rows``/``cols`` when given), and a C-contiguous uint8 buffer of at least the packed size
    (C sees only a pointer, so a short buffer would be read past its end). Returns (type name, id)."""
    if not isinstance(pm, PackedMatrix):
        raise InvalidRequestError(f"{what} must be a PackedMatrix, got {type(pm).__name__}")
    name, tid, bs, _ = _qtype(pm.qtype)
    if not _positive_int(pm.rows) or not _positive_int(pm.cols) or pm.cols % bs:
        raise InvalidRequestError(f"{what}: packed {name} shape {pm.rows}x{pm.cols} is not positive with "
                                  f"whole {bs}-column blocks")
    if (rows is not None and pm.rows != rows) or (cols is not None and pm.cols != cols):
        raise InvalidRequestError(f"{what}: packed matrix is {pm.rows}x{pm.cols}, expected {rows}x{cols}")
    d = pm.data
    if not isinstance(d, np.ndarray) or d.dtype != _U8 or d.ndim != 1 or not d.flags.c_contiguous:
        raise InvalidRequestError(f"{what}: packed data must be a C-contiguous 1-D uint8 array")
    _, lib = _lib()
    need = int(lib.mr_pack_size(tid, int(pm.rows), int(pm.cols)))
    if need <= 0:
        raise InvalidRequestError(f"{what}: {name} {pm.rows}x{pm.cols} has no packed layout")
    if d.nbytes < need:
        raise InvalidRequestError(f"{what}: packed {name} {pm.rows}x{pm.cols} needs {need} bytes, its data has "
                                  f"{d.nbytes}")
    return name, tid


def pack_size(qtype: str, rows: int, cols: int) -> int:
    """Bytes of the packed form of a (rows, cols) matrix; 0 when it cannot be packed."""
    _, lib = _lib()
    try:
        _, tid, _, _ = _qtype(qtype)
    except (UnsupportedQuantError, InvalidRequestError):
        return 0
    return int(lib.mr_pack_size(tid, int(rows), int(cols)))


def _address(a: np.ndarray) -> int:
    """Address of a's first byte. Not ``a.ctypes.data``: each ``.ctypes`` access leaves small objects
    behind that pin pymalloc arenas across model loads."""
    return int(a.__array_interface__["data"][0])


def _file_pages(a: np.ndarray, whole_pages_inside: bool) -> tuple[Any, int, int] | None:
    """(mmap, offset, length) of the pages under ``a`` when ``a`` views a read-only shared file
    mapping (a GGUF opened by :mod:`minirt.gguf`), else None. ``whole_pages_inside``: only pages that
    lie entirely inside ``a`` (for dropping them), else every page ``a`` touches."""
    b: Any = a
    while b is not None and not isinstance(b, memoryview):
        b = getattr(b, "base", None)
    mm = b.obj if isinstance(b, memoryview) else None
    if not isinstance(mm, mmap.mmap) or not a.flags.c_contiguous:
        return None
    page = mmap.PAGESIZE
    base = _address(np.frombuffer(mm, dtype=_U8))  # ACCESS_READ maps are read-only: this is a view
    start = _address(a) - base
    if whole_pages_inside:
        lo, hi = -(-start // page) * page, (start + a.nbytes) // page * page
    else:
        lo, hi = start // page * page, min(len(mm), -(-(start + a.nbytes) // page) * page)
    if not (0 <= lo < hi <= len(mm)):
        return None
    return mm, lo, hi - lo


# Linux 5.14+; not in Python's mmap module before 3.13. The number means this only on Linux.
_MADV_POPULATE_READ = 22 if sys.platform.startswith("linux") else None


def prefault_file_pages(a: np.ndarray) -> bool:
    """Map the file pages under ``a`` in one call before a kernel streams them: many threads
    faulting page by page on one mapping contend on the kernel's mm lock (on a cold load this cost
    more than the packing itself). Falls back to MADV_WILLNEED; False when ``a`` is no file view."""
    r = _file_pages(a, whole_pages_inside=False)
    if r is None:
        return False
    return _advise_read(*r)


def _advise_read(mm: Any, off: int, n: int) -> bool:
    """Ask the kernel to map ``n`` bytes of ``mm`` at ``off`` now (MADV_POPULATE_READ), or at least
    to read them ahead (MADV_WILLNEED, for kernels before 5.14); False when neither is available."""
    for adv in (getattr(mmap, "MADV_POPULATE_READ", _MADV_POPULATE_READ), getattr(mmap, "MADV_WILLNEED", None)):
        if adv is None:
            continue
        try:
            mm.madvise(adv, off, n)
            return True
        except (OSError, ValueError):  # older kernels: EINVAL for POPULATE_READ
            continue
    return False


def release_file_pages(a: np.ndarray) -> int:
    """Drop this process's mapping of the file pages under ``a`` when ``a`` views a read-only
    shared file mapping (a GGUF opened by :mod:`minirt.gguf`): after packing, the ggml copy of a
    weight is not read any more, and the pages come back from the page cache if it is. Returns the
    bytes released (0 when ``a`` is not such a view, e.g. an anonymous array, whose data would be lost)."""
    r = _file_pages(a, whole_pages_inside=True)
    if r is None or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    mm, off, n = r
    try:
        mm.madvise(mmap.MADV_DONTNEED, off, n)
    except (OSError, ValueError):
        return 0
    return n


def pack_preferred(qtype: str, isa: str | None = None) -> bool:
    """True when the (selected) ISA has decode kernels for packed matrices of this type."""
    _, lib = _lib()
    try:
        _, tid, _, _ = _qtype(qtype)
    except (UnsupportedQuantError, InvalidRequestError):
        return False
    return bool(lib.mr_pack_preferred(tid, _isa_id(isa)))


def _ggml_rows(w: np.ndarray, qtype: str) -> tuple[str, int, int, int, int]:
    """Check ``w`` is a C-contiguous (rows, row_bytes) uint8 array of whole ``qtype`` blocks;
    returns (type name, type id, rows, row_bytes, columns)."""
    name, tid, bs, ts = _qtype(qtype)
    if not isinstance(w, np.ndarray) or w.dtype != _U8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise InvalidRequestError("w must be a C-contiguous uint8 array of shape (rows, row_bytes)")
    rows, rb = w.shape
    if rb % ts:
        raise InvalidRequestError(f"{name}: {rb} bytes per row is not a whole number of {ts}-byte blocks")
    return name, tid, rows, rb, rb // ts * bs


_PACK_CHUNK = 8 << 20  # bytes of packed output per native call when streaming file pages


def pack(w: np.ndarray, qtype: str, arena: PackArena | None = None, threads: int | None = None,
         stream_file_pages: bool = False) -> PackedMatrix | None:
    """Repack ``w`` (rows, row_bytes) ggml blocks for the decode kernels; None when this type/shape
    is not packable (or ``MINIRT_PACK=0``). ``arena``: where the bytes go (default: a new one).

    ``stream_file_pages``: when ``w`` views the GGUF mapping, pack it in chunks of 4-row groups,
    mapping each chunk's file pages in one call before and dropping them after (see
    :func:`prefault_file_pages`, :func:`release_file_pages`), so that the process never holds both
    copies of a large matrix (the peak resident memory of a load stays near one copy of the weights).
    """
    ffi, lib = _lib()
    if os.environ.get("MINIRT_PACK", "1") == "0":
        return None
    name, tid, rows, rb, cols = _ggml_rows(w, qtype)
    n = int(lib.mr_pack_size(tid, rows, cols))
    if n <= 0:
        return None
    dst = (arena or PackArena(n)).take(n)
    # the packed form is one contiguous run of tiles per group of 4 rows: a chunk of whole groups
    # of w packs into a contiguous slice of dst
    groups = (rows + 3) // 4
    per_group = n // groups
    step = max(1, _PACK_CHUNK // per_group) if stream_file_pages else groups
    for g0 in range(0, groups, step):
        r0, r1 = 4 * g0, min(rows, 4 * (g0 + step))
        sub = w[r0:r1]
        if stream_file_pages:
            prefault_file_pages(sub)
        out = dst[g0 * per_group:g0 * per_group + int(lib.mr_pack_size(tid, r1 - r0, cols))]
        _check_rc(lib.mr_pack(tid, ffi.from_buffer("unsigned char[]", sub), r1 - r0, cols, rb,
                              ffi.from_buffer("unsigned char[]", out, require_writable=True), _threads_arg(threads)),
                  "pack")
        if stream_file_pages:
            release_file_pages(sub)
    if stream_file_pages:
        release_file_pages(w)  # the partial pages at chunk edges
    return PackedMatrix(dst, name, rows, cols)


def unpack(pm: PackedMatrix) -> np.ndarray:
    """The ggml rows (rows, row_bytes) uint8 of a packed matrix (the inverse of :func:`pack`)."""
    ffi, lib = _lib()
    _check_packed(pm, "pm")
    name, tid, bs, ts = _qtype(pm.qtype)
    out = np.empty((pm.rows, pm.cols // bs * ts), dtype=_U8)
    _check_rc(lib.mr_unpack(tid, ffi.from_buffer("unsigned char[]", pm.data), pm.rows, pm.cols,
                            ffi.from_buffer("unsigned char[]", out, require_writable=True), out.shape[1]), "unpack")
    return out


def packed_rows(pm: PackedMatrix, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (n,) of a packed matrix dequantized to float32 (n, cols): the same values as
    :func:`dequantize` of those ggml rows. The embedding lookup of a model whose output head is its
    embedding reads these, so that the ggml copy (dropped after packing) stays out of memory."""
    ffi, lib = _lib()
    _, tid = _check_packed(pm, "pm")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.ndim != 1:
        raise InvalidRequestError(f"ids must be 1-D, got shape {ids.shape}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= pm.rows):
        raise InvalidRequestError(f"row ids must be in [0, {pm.rows})")
    out = np.empty((ids.size, pm.cols), dtype=np.float32)
    _check_rc(lib.mr_pack_rows(tid, ffi.from_buffer("unsigned char[]", pm.data), pm.rows, pm.cols,
                               ffi.cast("const long long *", ffi.from_buffer(ids)), ids.size,
                               ffi.from_buffer("float[]", out, require_writable=True)), "pack_rows")
    return out


class PackCache:
    """Packed weights of one model kept in ``$MINIRT_HOME/packed/`` so that later loads read them
    instead of repacking.

    The key covers the GGUF file's identity (real path, size, modification time, inode), each
    packed tensor's offset, type and shape, and the packing code, so a changed file or layout never
    matches. What is read is verified before use: the header holds a digest of the whole payload
    (:func:`_payload_digest`, written at creation) that is recomputed over the copy at load, so
    a byte changed anywhere in the file is caught; and a file is only opened when it is a regular
    file owned by this user and writable by nobody else, never through a symlink or a FIFO. The
    first and last 4-row group of every matrix are also unpacked and compared with the GGUF bytes.
    The cache holds at most ``KEEP`` models (least recently used go first); ``MINIRT_PACK_CACHE=0``
    disables it. Failures to read, verify or write it are logged and cost only the repacking.
    """

    MAGIC = b"MRPACK02"  # 02: payload digest in the header
    HEADER = 4096  # payload starts page-aligned
    KEEP = 4

    def __init__(self, path: Path, key: str, size: int) -> None:
        self.path, self.key, self.size = path, key, size

    @classmethod
    def for_model(cls, gguf_path: str, entries: list[tuple[np.ndarray, str, int]], size: int) -> PackCache | None:
        """The cache slot of these packed matrices (w, qtype, packed bytes) of ``gguf_path``, or None
        when caching is off or a matrix is not a view of the file."""
        import hashlib

        if os.environ.get("MINIRT_PACK_CACHE", "1") == "0":
            return None
        try:
            st = os.stat(gguf_path)
            real = os.path.realpath(gguf_path)
        except OSError:
            return None
        h = hashlib.sha256()
        h.update(f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{_pack_code_hash()}|{size}".encode())
        for w, qtype, n in entries:
            r = _file_pages(w, whole_pages_inside=False)
            if r is None:
                return None
            mm = r[0]
            off = _address(w) - _address(np.frombuffer(mm, dtype=_U8))
            h.update(f"|{off}:{qtype}:{w.shape[0]}x{w.shape[1]}:{n}".encode())
        key = h.hexdigest()[:32]
        home = Path(os.environ.get("MINIRT_HOME") or Path.home() / ".cache" / "minirt")
        return cls(home / "packed" / f"{key}.pack", key, size)

    def read_into(self, arena: PackArena) -> bool:
        """Fill ``arena`` (``size`` bytes) with the cached packed bytes; False (arena contents then
        undefined) when the file is absent, not this key, not trusted (see the class doc), truncated
        or not matching its digest.

        Read, not mapped: the decode kernels stream these bytes every token, and from the arena's
        anonymous huge pages they run about a quarter faster than from page-cache pages (measured:
        Gemma3-270M's 170 MiB output matrix 6.7-7.0 ms per token against 8.6-9.1 ms mapped; a whole
        decode step 12.1 ms against 15.2 ms). The read costs about 0.1 s per 300 MB on a warm page
        cache; and a file truncated or changed later cannot reach the kernels."""
        try:
            # O_NOFOLLOW: a symlink planted in the cache folder is refused (ELOOP), not followed;
            # O_NONBLOCK: a FIFO opens without waiting for a writer, and fstat then refuses it
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                         | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("cannot open pack cache %s (%s: a symlink?); repacking", self.path, e.strerror)
            return False
        try:
            return self._read_verified(fd, arena)
        finally:
            os.close(fd)

    def _read_verified(self, fd: int, arena: PackArena) -> bool:
        """read_into over an open ``fd``."""
        try:
            why = _untrusted_file(os.fstat(fd))
            if why:
                log.warning("pack cache %s is %s; repacking", self.path, why)
                return False
            head = os.pread(fd, self.HEADER, 0)
            if (len(head) != self.HEADER or head[:8] != self.MAGIC or head[8:40] != self.key.encode()
                    or int.from_bytes(head[40:48], "little") != self.size or arena.size < self.size):
                log.info("pack cache %s does not match this model; repacking", self.path)
                return False
            view = memoryview(arena.buffer)[:self.size]
            done = 0
            while done < self.size:  # a short read past the end: the file shrank (after the fstat, too)
                n = os.preadv(fd, [view[done:done + (256 << 20)]], self.HEADER + done)
                if n <= 0:
                    log.warning("pack cache %s is truncated; repacking", self.path)
                    return False
                done += n
        except (OSError, ValueError) as e:
            log.warning("cannot read pack cache %s (%s); repacking", self.path, e)
            return False
        if _payload_digest(arena.buffer[:self.size]) != head[48:80]:
            log.warning("pack cache %s does not match the model's weights (payload checksum); repacking", self.path)
            return False
        try:
            os.utime(fd if os.utime in os.supports_fd else self.path)  # least recently used goes first
        except OSError:
            pass
        return True

    def store(self, buf: np.ndarray) -> None:
        """Write ``buf[:size]`` as this key's cache file (atomically), then trim the cache."""
        d = self.path.parent
        tmp = None
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pack", dir=d)
            with os.fdopen(fd, "wb", buffering=0) as f:
                head = (self.MAGIC + self.key.encode() + self.size.to_bytes(8, "little")
                        + _payload_digest(buf[:self.size]))
                f.write(head.ljust(self.HEADER, b"\0"))
                view = memoryview(buf)[:self.size]
                done = 0
                while done < self.size:
                    done += f.write(view[done:])
            os.replace(tmp, self.path)
            tmp = None
            log.info("packed weights cached in %s (%d MB)", self.path, self.size >> 20)
        except OSError as e:
            log.warning("cannot write pack cache %s (%s); the next load repacks", self.path, e)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        try:
            files = sorted(d.glob("*.pack"), key=lambda q: q.stat().st_mtime, reverse=True)
            for old in files[self.KEEP:]:
                old.unlink()
        except OSError:
            pass


def _untrusted_file(st: os.stat_result) -> str | None:
    """Why a cache file must not be used (not a regular file, someone else's, writable by others), or None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this user"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_DIGEST_CHUNK = 16 << 20


def _payload_digest(buf: np.ndarray) -> bytes:
    """32-byte digest of ``buf``: sha256 of the sha256 of each 16 MiB chunk (and the length).

    Chunked so that the chunks hash in parallel (hashlib releases the GIL on large buffers); sha256
    because OpenSSL runs it at 1.5-2 GB/s per core with the SHA extensions (about 0.5 GB/s
    without), faster than hashlib's blake2b, and xxhash would be one more dependency. Cost at load:
    one read of the mapping, whose pages the decode needs anyway (measured: 0.4 s for 128 MiB on one
    core of a busy shared machine with the SHA extensions, blake2b 0.9 s; so a 400 MB cache costs
    about 0.1-0.3 s on 4 idle cores, against 1-3 s of repacking)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    n = int(buf.nbytes)
    mv = memoryview(buf).cast("B") if n else memoryview(b"")
    spans = [(i, min(n, i + _DIGEST_CHUNK)) for i in range(0, n, _DIGEST_CHUNK)]

    def one(span: tuple[int, int]) -> bytes:
        return hashlib.sha256(mv[span[0]:span[1]]).digest()

    workers = min(len(spans), os.cpu_count() or 1, 8)
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="minirt-digest") as ex:
            parts = list(ex.map(one, spans))
    else:
        parts = [one(sp) for sp in spans]
    return hashlib.sha256(n.to_bytes(8, "little") + b"".join(parts)).digest()


@functools.cache
def _pack_code_hash() -> str:
    """Hash of the packing code (its layout is what the cache stores)."""
    import hashlib

    src = _native_src_dir()
    h = hashlib.sha256()
    for name in ("pack.c", "common.h"):
        try:
            h.update((src / name).read_bytes() if src is not None else b"")
        except OSError:
            pass
    if src is None:  # no sources beside the extension: its identity stands in for them
        from .. import __version__

        h.update(f"{__version__}|{getattr(_mod, '__file__', '')}".encode())
    return h.hexdigest()[:16]


def spot_check_packed(pm: PackedMatrix, w: np.ndarray) -> bool:
    """True when the first and last 4-row groups of ``pm`` unpack to the rows of ``w``."""
    groups = (pm.rows + 3) // 4
    per_group = pm.nbytes // groups
    for g in {0, groups - 1}:
        r0, r1 = 4 * g, min(pm.rows, 4 * g + 4)
        part = PackedMatrix(pm.data[g * per_group:(g + 1) * per_group], pm.qtype, r1 - r0, pm.cols)
        if not np.array_equal(unpack(part), w[r0:r1]):
            return False
    return True


_ACTS = {"silu": 0, "gelu_tanh": 1}  # gated activations of mr_act_mul
_LAYER_ACTS = {**_ACTS, "xielu": 2, "relu2": 3}  # the layer stack also runs xIELU and squared ReLU without gate
_NORM_KINDS = {"rms": 0, "layer": 1}


def _ffn_width(m: Any) -> int:
    """The widest matrix input of a block's feed-forward (scratch for its activations); 0: none."""
    if m is None:
        return 0
    if isinstance(m, MoE):
        return max([int(lin.in_features) for lin in m.down] + ([int(m.shared.down.in_features)] if m.shared else []))
    if isinstance(m, ParallelMoE):  # mr_layer.n_ff: the dense MLP's (the experts size their own scratch)
        return int(m.mlp.down.in_features)
    return int(m.down.in_features)


def _ffn_out(m: Any) -> int:
    if isinstance(m, ParallelMoE):
        m = m.mlp
    return int(m.down[0].out_features if isinstance(m, MoE) else m.down.out_features)


def _mixer_view(**kw: Any) -> SimpleNamespace:
    """An attention-shaped view of a mixer that is not attention (``kw``: its heads, input and output
    projections and itself): no K/V projections, RoPE, norms, window, sinks or output gate; causal."""
    return SimpleNamespace(**{"wk": None, "wv": None, "scale": 1.0, "rope": None, "q_norm": None, "k_norm": None,
                              "v_norm": None, "qk_norm_per_head": True, "qk_norm_after_rope": False, "softcap": 0.0,
                              "window": 0, "sinks": None, "causal": True, "kv_source": None, "out_gate": False, **kw})


def _mixer(b: Any) -> Any:
    """The block's mixer as ``mr_layer`` sees it: its attention (Falcon-H1's with the Mamba-2 half beside it),
    or an attention-shaped view (:func:`_mixer_view`) of a short convolution (LFM2: in_proj as wq, out_proj
    as wo, its cache rows as n_head_kv heads of head_dim_k), a Mamba-2 mixer or a gated delta-net (their
    input / output projections as wq / wo, their value heads as n_head heads, one nominal KV head, no cache
    rows)."""
    a = b.attn
    if isinstance(a, ParallelMixer):
        return SimpleNamespace(**{**vars(a.attn), "causal": a.attn.causal, "ssm": a.ssm, "ssm_beside": True})
    if isinstance(a, GatedDeltaNet):
        return _mixer_view(n_head=a.n_v_heads, n_head_kv=1, head_dim_k=a.head_dim_v, head_dim_v=a.head_dim_v,
                           wq=a.qkv_proj, wo=a.out_proj, dn=a)
    if isinstance(a, Mamba2):
        return _mixer_view(n_head=a.n_head, n_head_kv=1, head_dim_k=a.head_dim, head_dim_v=a.head_dim,
                           wq=a.in_proj, wo=a.out_proj, ssm=a)
    if not isinstance(a, ShortConv):
        return a
    h, d = a.cache_heads, a.n_embd
    return _mixer_view(n_head=h, n_head_kv=h, head_dim_k=d // h, head_dim_v=d // h, wq=a.in_proj, wo=a.out_proj,
                       conv=a)


def _block_weights(b: Any) -> dict[str, Any]:
    """The block's matrices by their ``mr_layer`` field (None: absent: no gate, a layer reading
    another's K/V or a convolution, no per-layer input, no feed-forward half, the delta-net's and Falcon-H1's
    Mamba-2 matrices where the mixer is something else)."""
    a, m, g = _mixer(b), b.mlp, b.per_layer
    if isinstance(m, MoE):  # its matrices go in mr_layer.moe
        m = None
    elif isinstance(m, ParallelMoE):  # the dense MLP's; the experts' go in mr_layer.moe
        m = m.mlp
    dn, beside = getattr(a, "dn", None), getattr(a, "ssm_beside", False)
    return {"wq": a.wq, "wk": a.wk, "wv": a.wv, "wo": a.wo, "gate": m.gate if m is not None else None,
            "up": m.up if m is not None else None, "down": m.down if m is not None else None,
            "pl_gate": g.gate if g is not None else None, "pl_proj": g.proj if g is not None else None,
            "wz": dn.z_proj if dn is not None else None,
            "wb": (dn.ba_proj if dn.ba_proj is not None else dn.beta_proj) if dn is not None else None,
            "wa": dn.alpha_proj if dn is not None else None,
            "ssm_in": a.ssm.in_proj if beside else None, "ssm_out": a.ssm.out_proj if beside else None}


def layer_unsupported(b: Any) -> str | None:
    """Why the native decode step cannot run block ``b`` (a :class:`minirt.blocks.Block`); None if it can."""
    d = b.attn if isinstance(b.attn, GatedDeltaNet) else None
    if d is not None and (d.conv.dtype != np.float32 or not 2 <= d.taps <= 64 or d.head_dim_v > 1024
                          or d.n_v_heads % d.n_k_heads or d.norm.weight is None):
        return "a gated delta-net of other than 2..64 float32 taps, value heads of up to 1024 or a norm without gains"
    s = b.attn if isinstance(b.attn, Mamba2) else b.attn.ssm if isinstance(b.attn, ParallelMixer) else None
    if s is not None and (s.conv.dtype != np.float32 or not 2 <= s.taps <= 64 or s.n_head % s.n_group):
        return "a Mamba-2 convolution of other than 2..64 float32 taps per channel"
    if b.mlp is None and b.parallel:
        return "a parallel block without a feed-forward half"
    a, m = _mixer(b), b.mlp  # m None: a mixer without feed-forward half (Nemotron-H)
    c = getattr(a, "conv", None)
    if c is not None and (c.weight.dtype != np.float32 or c.weight.ndim != 2 or not 2 <= c.taps <= 64
                          or c.n_embd % c.cache_heads):
        return "a short convolution of other than 2..64 float32 taps per channel"
    beside_norms: list[Any] = []
    if isinstance(m, ParallelMoE):  # Gemma 4: the experts beside a dense MLP, each with its norms
        beside_norms = [m.pre_1, m.post_1, m.pre_2, m.post_2, m.router_norm]
        if any(n is None or n.kind != "rms" or n.bias is not None for n in beside_norms) \
                or m.router_norm.weight is not None:
            return "experts beside a dense MLP with other than RMSNorms (a router norm without gains)"
        why = _moe_why(m.moe)
        if why is not None:
            return f"a mixture-of-experts feed-forward with {why}"
        m = m.mlp  # the dense half: as any MLP below
    if isinstance(m, MoE):
        why = _moe_why(m)
        if why is not None:
            return f"a mixture-of-experts feed-forward with {why}"
    elif m is not None and (not hasattr(m, "down") or isinstance(m.down, list)):
        return f"a feed-forward of kind {type(m).__name__}"
    elif m is not None and (m.gate is None) != (m.act in ("xielu", "relu2")):
        return f"an MLP {'without' if m.gate is None else 'with'} gate and activation {m.act!r}"
    elif m is not None and m.act not in _LAYER_ACTS:
        return f"activation {m.act!r}"
    if a.v_norm is not None and (a.v_norm.kind != "rms" or a.v_norm.weight is not None):
        return "a value norm other than RMSNorm without gains"
    g = b.per_layer
    if g is not None and (g.act not in _ACTS or g.post_norm.bias is not None or g.post_norm.kind != "rms"):
        return "a per-layer input gate other than SiLU / GELU with an RMSNorm"
    if not a.causal:
        return "non-causal attention"
    if b.norm_residual:
        return "norms of the residual sum (post-norm layout)"
    if a.head_dim_k != a.head_dim_v:
        return "different key and value head sizes"
    block_norms = [n for n in (b.attn_norm, b.post_attn_norm, b.ffn_norm, b.post_ffn_norm) if n is not None]
    if len({n.kind for n in block_norms}) > 1:
        return "RMSNorm and LayerNorm in one block"
    if any(n.bias is not None for n in (b.post_attn_norm, b.post_ffn_norm) if n is not None):
        return "post-norms with a bias"
    qk = [n for n in (a.q_norm, a.k_norm, a.v_norm, g.post_norm if g is not None else None,
                      s.norm if s is not None else None, d.norm if d is not None else None) if n is not None]
    if any(n.kind != "rms" or n.bias is not None for n in qk):
        return "LayerNorm q/k norms"
    if len({float(n.eps) for n in block_norms + qk + beside_norms}) > 1:
        return "norms with different eps in one block"
    return None


def _moe_why(m: Any) -> str | None:
    """Why the fused decode step cannot run the mixture of experts ``m``; None if it can."""
    why = moe_unsupported(m)
    if why is None and m.latent_down is not None:  # the layer-by-layer path runs them
        why = "latent expert projections"
    if why is None and m.router.gating not in _GATINGS:
        why = f"router gating {m.router.gating!r}"
    sh = m.shared
    if why is None and sh is not None and (sh.act not in _SHARED_ACTS or (sh.act == "relu2") != (sh.gate is None)
                                           or any(lin.bias is not None for lin in sh.linears())):
        why = f"a shared expert with activation {sh.act!r} or biases"
    return why


class LayerStack:
    """A model's decoder blocks (:class:`minirt.blocks.Block`) prepared for the native decode step
    (``mr_decode_layers``).

    ``rope_index[i]``: which of the cos/sin table pairs handed to :meth:`run` block i reads (-1: a
    NoPE layer). A weight whose ``backend_data`` is a :class:`PackedMatrix` is read packed; the
    others in their ggml layout. ``key_offsets``: per layer the (n_head_kv, head_dim_k) constant a
    block-quantized cache stores keys less of (the caches' own, ``Config.kv_offsets``), or None.
    Raises :class:`BackendError` when a block cannot run natively here.
    """

    def __init__(self, blocks: list[Any], rope_index: list[int], isa: str | None = None,
                 key_offsets: Sequence[np.ndarray | None] | None = None) -> None:
        ffi, lib = _lib()
        self._keep: list[Any] = []
        self.n_layer = len(blocks)
        self._layers = ffi.new("mr_layer[]", self.n_layer)
        self._isa = _isa_id(isa)
        # what every cache and RoPE table handed to run() must match (checked there, not in C)
        self._half_rope = {}
        for i, b in enumerate(blocks):  # before anything reads a block's mixer or MLP
            why = layer_unsupported(b)
            if why is not None:
                raise BackendError(f"layer {i} cannot run in the native decode step: {why}")
        # a cache's (n_head_kv, head_dim_k, head_dim_v): the largest over the layers (layers of other
        # sizes have their rows at the front of their slot, see minirt.kv_cache); without any attention layer
        # the nominal (1, 1, 1) of ModelDesc.kv_shape
        shapes = [s for s in (b.attn.kv_shape for b in blocks) if s is not None]
        self._kv_max = tuple(max((int(s[j]) for s in shapes), default=1) for j in range(3))
        self._n_pl = max((b.per_layer.gate.out_features for b in blocks if b.per_layer is not None), default=0)
        # per layer the (convolution inputs, state) shapes of its recurrent state, None for a layer without one
        self._state_shapes = [getattr(b.attn, "state_shapes", None) for b in blocks]
        self._n_embd = int(_mixer(blocks[0]).wo.out_features) if blocks else 0
        if len(rope_index) != self.n_layer:
            raise InvalidRequestError(f"{len(rope_index)} RoPE table indices for {self.n_layer} layers")
        if key_offsets is not None and len(key_offsets) != self.n_layer:
            raise InvalidRequestError(f"{len(key_offsets)} key offsets for {self.n_layer} layers")
        for i, (b, ri) in enumerate(zip(blocks, rope_index)):
            why = layer_unsupported(b)
            if why is not None:
                raise BackendError(f"layer {i} cannot run in the native decode step: {why}")
            self._check_block(i, b)
            a, m = _mixer(b), b.mlp
            src = a.kv_source
            srcm = _mixer(blocks[src]) if src is not None and 0 <= src < i else None
            if src is not None and not (srcm is not None and not hasattr(srcm, "conv") and srcm.kv_source is None
                                        and (srcm.n_head_kv, srcm.head_dim_k) == (a.n_head_kv, a.head_dim_k)):
                raise InvalidRequestError(f"layer {i}: reads the KV cache of layer {src}, which is not an earlier "
                                          "layer with a cache of its own of the same shape")
            L = self._layers[i]
            L.n_embd, L.n_ff = self._n_embd, _ffn_width(m)
            L.n_head, L.n_head_kv, L.head_dim_k, L.head_dim_v = a.n_head, a.n_head_kv, a.head_dim_k, a.head_dim_v
            L.rope_dim = a.rope.dim if a.rope is not None else 0
            L.window = int(a.window)
            norms = [n for n in (b.attn_norm, b.post_attn_norm, b.ffn_norm, b.post_ffn_norm, a.q_norm, a.k_norm)
                     if n is not None]
            L.eps = float(norms[0].eps) if norms else 1e-6
            L.attn_scale, L.softcap, L.residual_scale = float(a.scale), float(a.softcap), float(b.residual_scale)
            L.rope_neox = int(bool(a.rope.neox)) if a.rope is not None else 0
            pm = m if isinstance(m, ParallelMoE) else None
            dm = pm.mlp if pm is not None else m  # the dense MLP, if any
            dense = dm is not None and not isinstance(dm, MoE)
            L.act = _LAYER_ACTS[dm.act] if dense else 0
            for j, v in enumerate(dm.act_params[:4] if dense else ()):
                L.act_params[j] = float(v)
            L.qk_norm_after_rope = int(bool(a.qk_norm_after_rope))
            L.sinks = self._f32(ffi, a.sinks) if a.sinks is not None else ffi.NULL
            L.kv_layer = -1 if a.kv_source is None else int(a.kv_source)
            L.v_norm = int(a.v_norm is not None)
            L.out_scale = float(b.out_scale)
            g = b.per_layer
            L.n_pl = 0 if g is None else int(g.gate.out_features)
            L.pl_act = 0 if g is None else _ACTS[g.act]
            if g is not None:  # a norm without gains still normalizes: pass ones
                pw = g.post_norm.weight
                L.pl_post_norm = self._f32(ffi, pw if pw is not None else np.ones(L.n_embd, _F32))
            else:
                L.pl_post_norm = ffi.NULL
            L.rope_table = int(ri) if a.rope is not None else -1
            c, s, dn = getattr(a, "conv", None), getattr(a, "ssm", None), getattr(a, "dn", None)
            rec = s if s is not None else dn  # a recurrent mixer: its own convolution
            beside = getattr(a, "ssm_beside", False)  # Falcon-H1's attention + Mamba-2
            L.mixer = 4 if beside else 3 if dn is not None else 2 if s is not None else 0 if c is None else 1
            L.conv_taps = rec.taps if rec is not None else 0 if c is None else c.taps
            taps_w = rec.conv if rec is not None else None if c is None else c.weight  # (channels, taps)
            L.conv_w = ffi.NULL if taps_w is None else self._f32(ffi, taps_w)
            L.ssm_state, L.ssm_groups = (s.d_state, s.n_group) if s is not None else (0, 0)
            L.ssm_heads, L.ssm_head_dim = (s.n_head, s.head_dim) if s is not None else (0, 0)
            L.dn_k_heads, L.dn_head_dim = (dn.n_k_heads, dn.head_dim_k) if dn is not None else (0, 0)
            L.dn_grouped = int(bool(dn.grouped)) if dn is not None else 0
            L.dn_fused_ba = int(dn.ba_proj is not None) if dn is not None else 0
            L.out_gate = int(bool(getattr(a, "out_gate", False)))
            vecs = {"conv_b": s.conv_bias, "ssm_dt_b": s.dt_bias, "ssm_a": s.a, "ssm_d": s.d_skip,
                    "ssm_norm": s.norm.weight if s.norm is not None else None} if s is not None else {}
            if dn is not None:
                vecs = {"ssm_dt_b": dn.dt_bias, "ssm_a": dn.a, "ssm_norm": dn.norm.weight}
            for k in ("conv_b", "ssm_dt_b", "ssm_a", "ssm_d", "ssm_norm"):
                v = vecs.get(k)
                setattr(L, k, ffi.NULL if v is None else self._f32(ffi, v))
            off = None if key_offsets is None else key_offsets[i]
            no_keys = c is not None or (rec is not None and not beside)  # a layer without attention keys
            if off is not None and (no_keys or np.shape(off) != (a.n_head_kv, a.head_dim_k)):
                raise InvalidRequestError(f"layer {i}: a key offset of shape {np.shape(off)} for keys of "
                                          f"{a.n_head_kv} x {a.head_dim_k}")
            L.k_offset = ffi.NULL if off is None else self._f32(ffi, off)
            L.k_scale = L.q_scale = ffi.NULL
            if a.rope is not None:
                self._half_rope[int(ri)] = max(self._half_rope.get(int(ri), 0), a.rope.dim // 2)
            kinds = {n.kind for n in (b.attn_norm, b.post_attn_norm, b.ffn_norm, b.post_ffn_norm) if n is not None}
            L.norm_kind = _NORM_KINDS[kinds.pop()] if kinds else 0
            L.qk_norm_full = int(not a.qk_norm_per_head)
            L.parallel = int(bool(b.parallel))
            for k, n in (("attn_norm", b.attn_norm), ("q_norm", a.q_norm), ("k_norm", a.k_norm),
                         ("post_attn_norm", b.post_attn_norm), ("ffn_norm", None if b.parallel else b.ffn_norm),
                         ("post_ffn_norm", b.post_ffn_norm)):
                # a norm without gains still normalizes: pass ones
                w = None if n is None else (n.weight if n.weight is not None else np.ones(self._width(k, a, L), _F32))
                setattr(L, k, ffi.NULL if w is None else self._f32(ffi, w))
            L.attn_norm_b = ffi.NULL if b.attn_norm is None or b.attn_norm.bias is None else self._f32(ffi,
                                                                                                       b.attn_norm.bias)
            fb = None if b.parallel or b.ffn_norm is None else b.ffn_norm.bias
            L.ffn_norm_b = ffi.NULL if fb is None else self._f32(ffi, fb)
            for k, lin in _block_weights(b).items():
                self._fill_weight(ffi, getattr(L, k), lin)
            L.moe = self._moe(ffi, m) if isinstance(m, MoE) else ffi.NULL
            L.moe_beside = int(pm is not None)
            L.mlp_post_norm = L.moe_pre_norm = L.moe_post_norm = L.router_scale = ffi.NULL
            if pm is not None:  # the dense MLP reads ffn_norm = pre_1; the experts their own norms
                ones = np.ones(self._n_embd, _F32)  # a norm without gains still normalizes
                L.ffn_norm, L.mlp_post_norm, L.moe_pre_norm, L.moe_post_norm = (
                    self._f32(ffi, n.weight if n.weight is not None else ones)
                    for n in (pm.pre_1, pm.post_1, pm.pre_2, pm.post_2))
                L.router_scale = self._f32(ffi, pm.router_scale)
                L.moe = self._moe(ffi, pm.moe, pm.expert_scale)
            rc = lib.mr_layer_check(ffi.addressof(self._layers, i), self._isa)
            if rc != 0:
                raise BackendError(f"layer {i} cannot run in the native decode step (code {rc})")
        self.n_tables = max(rope_index, default=-1) + 1

    def _fill_weight(self, ffi: Any, W: Any, lin: Any) -> None:
        """An ``mr_weight`` for ``lin`` (its packed copy where it has one); data NULL for None (absent)."""
        if lin is None:
            W.data = ffi.NULL
            return
        w = lin.backend_data if isinstance(lin.backend_data, PackedMatrix) else lin.w
        _, tid, bs, ts = _qtype(lin.qtype)
        W.qtype = tid
        if isinstance(w, PackedMatrix):
            W.packed, W.rows, W.cols, W.row_bytes = 1, w.rows, w.cols, 0
            W.data = self._ptr(ffi, "unsigned char[]", w.data)
            self._keep.append(w)
        else:
            W.packed, W.rows, W.row_bytes = 0, w.shape[0], w.shape[1]
            W.cols = w.shape[1] // ts * bs
            W.data = self._ptr(ffi, "unsigned char[]", np.ascontiguousarray(w))
        W.bias = ffi.NULL if lin.bias is None else self._f32(ffi, lin.bias)

    def _moe(self, ffi: Any, m: Any, expert_scale: np.ndarray | None = None) -> Any:
        """The ``mr_moe`` of a mixture of experts: router, routing rule, the experts as :class:`ExpertSet` holds
        them, the shared expert and its gate; ``expert_scale`` (n_expert,) multiplies each chosen expert's weight."""
        es = ExpertSet(m)
        self._keep.append(es)
        r = m.router
        mo = ffi.new("mr_moe *")
        self._keep.append(mo)
        mo.n_expert, mo.n_used = m.n_expert, r.n_used
        mo.gating, mo.norm_topk, mo.scale = _GATINGS[r.gating], int(bool(r.norm_topk)), float(r.scale)
        mo.sel_bias = ffi.NULL if r.selection_bias is None else self._f32(ffi, r.selection_bias)
        self._fill_weight(ffi, mo.router, r.gate)
        mo.gate, mo.up, mo.down = es.gate, es.up, es.down
        mo.act, mo.alpha, mo.limit = es.act, es.alpha, es.limit
        s = m.shared
        for k, lin in (("sh_gate", s.gate if s else None), ("sh_up", s.up if s else None),
                       ("sh_down", s.down if s else None), ("sh_inp", m.shared_gate)):
            self._fill_weight(ffi, getattr(mo, k), lin)
        mo.sh_act = _SHARED_ACTS[s.act] if s is not None else 0
        mo.expert_scale = ffi.NULL if expert_scale is None else self._f32(ffi, expert_scale)
        return mo

    def _check_block(self, i: int, b: Any) -> None:
        """Every size C will trust, checked against the block's dimensions before any pointer is
        taken: C sees bare pointers, so a short norm, bias or weight would be read past its end and
        a zero head count would divide by zero (raises InvalidRequestError naming the tensor)."""
        a, m = _mixer(b), b.mlp
        dims = {"n_head": a.n_head, "n_head_kv": a.n_head_kv, "head_dim_k": a.head_dim_k,
                "head_dim_v": a.head_dim_v, "n_embd": a.wo.out_features}
        if m is not None:
            dims.update(n_embd=_ffn_out(m), n_ff=_ffn_width(m))
        for k, v in dims.items():
            if not _positive_int(v):
                raise InvalidRequestError(f"layer {i}: {k} must be a positive integer, got {v!r}")
        if a.n_head % a.n_head_kv:
            raise InvalidRequestError(f"layer {i}: n_head {a.n_head} is not a multiple of n_head_kv {a.n_head_kv}")
        if int(dims["n_embd"]) != self._n_embd:
            raise InvalidRequestError(f"layer {i}: n_embd {dims['n_embd']} differs from layer 0 ({self._n_embd})")
        if a.rope is not None and (not _positive_int(a.rope.dim) or a.rope.dim % 2 or a.rope.dim > a.head_dim_k):
            raise InvalidRequestError(f"layer {i}: rope dim {a.rope.dim!r} must be even and in 1..{a.head_dim_k}")
        d, hk, hv = int(dims["n_embd"]), int(a.head_dim_k), int(a.head_dim_v)
        ff = _ffn_width(m) if m is not None and not isinstance(m, MoE) else 0
        E = b.per_layer.gate.out_features if b.per_layer is not None else 0
        s, dn = getattr(a, "ssm", None), getattr(a, "dn", None)
        q_rows = 3 * d if hasattr(a, "conv") else a.n_head * hk  # a short convolution's in_proj: B, C, x
        if getattr(a, "out_gate", False):  # each head's query, then its output gate
            q_rows = 2 * a.n_head * hk

        def vec(arr: Any, n: int, what: str) -> None:
            if arr is None:
                return
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.shape[0] != n:
                raise InvalidRequestError(f"layer {i}: {what} has shape {getattr(arr, 'shape', type(arr).__name__)}, "
                                          f"expected ({n},)")
            if not np.issubdtype(arr.dtype, np.floating):
                raise InvalidRequestError(f"layer {i}: {what} must be floating point, got {arr.dtype}")

        if dn is not None:  # the delta-net's convolution input: q, k of every key head, v of every value head
            q_rows = dn.conv_dim
            for what, arr, n in (("dt bias", dn.dt_bias, dn.n_v_heads), ("A", dn.a, dn.n_v_heads),
                                 ("norm", dn.norm.weight, dn.head_dim_v)):
                if arr is None:
                    raise InvalidRequestError(f"layer {i}: delta-net {what} missing")
                vec(arr, n, f"delta-net {what}")
            if dn.conv.shape != (dn.conv_dim, dn.taps) or \
                    dn.conv_dim != 2 * dn.n_k_heads * dn.head_dim_k + dn.n_v_heads * dn.head_dim_v:
                raise InvalidRequestError(f"layer {i}: delta-net convolution of shape {dn.conv.shape}")
        if s is not None and not getattr(a, "ssm_beside", False):  # Mamba-2's in_proj: z, xBC, dt
            q_rows = 2 * s.d_inner + 2 * s.n_group * s.d_state + s.n_head
        if s is not None:
            for what, arr, n in (("convolution bias", s.conv_bias, s.conv_dim), ("dt bias", s.dt_bias, s.n_head),
                                 ("A", s.a, s.n_head), ("D", s.d_skip, s.n_head),
                                 ("SSM norm", s.norm.weight if s.norm is not None else None, s.d_inner)):
                vec(arr, n, f"Mamba-2 {what}")
            if s.conv.shape != (s.conv_dim, s.taps) or s.conv_dim != s.d_inner + 2 * s.n_group * s.d_state:
                raise InvalidRequestError(f"layer {i}: Mamba-2 convolution of shape {s.conv.shape}")
        hv_n = dn.n_v_heads if dn is not None else 0
        shapes = {"wq": (q_rows, d), "wk": (a.n_head_kv * hk, d), "wv": (a.n_head_kv * hv, d),
                  "wo": (d, a.n_head * hv), "gate": (ff, d), "up": (ff, d), "down": (d, ff),
                  "pl_gate": (E, d), "pl_proj": (d, E), "wz": (hv_n * hv, d),
                  "wb": ((2 if dn is not None and dn.ba_proj is not None else 1) * hv_n, d), "wa": (hv_n, d),
                  "ssm_in": (2 * s.d_inner + 2 * s.n_group * s.d_state + s.n_head, d) if s is not None else (0, 0),
                  "ssm_out": (d, s.d_inner) if s is not None else (0, 0)}

        class _Dims:  # what _width reads
            n_embd = d
        for k, n in (("attn_norm", b.attn_norm), ("q_norm", a.q_norm), ("k_norm", a.k_norm),
                     ("post_attn_norm", b.post_attn_norm), ("ffn_norm", b.ffn_norm),
                     ("post_ffn_norm", b.post_ffn_norm)):
            if n is not None:
                width = self._width(k, a, _Dims)
                vec(n.weight, width, f"{k} weight")
                vec(n.bias, width, f"{k} bias")
        if b.per_layer is not None:
            vec(b.per_layer.post_norm.weight, d, "per-layer post norm weight")
        if isinstance(m, ParallelMoE):
            for what, n in (("pre_1", m.pre_1), ("post_1", m.post_1), ("pre_2", m.pre_2), ("post_2", m.post_2)):
                vec(n.weight, d, f"{what} norm weight")
            for what, arr, n in (("router scale", m.router_scale, d), ("expert scale", m.expert_scale,
                                                                      m.moe.n_expert)):
                if arr is None:
                    raise InvalidRequestError(f"layer {i}: {what} missing")
                vec(arr, n, what)
        c = getattr(a, "conv", None)
        if c is not None and (c.weight.shape != (d, c.taps) or c.cache_heads * hk != d):
            raise InvalidRequestError(f"layer {i}: convolution taps of shape {c.weight.shape} for n_embd {d} "
                                      f"in {c.cache_heads} cache rows")
        for k, lin in _block_weights(b).items():
            if lin is None:
                continue
            rows, cols = shapes[k]
            name, _, bs, ts = _qtype(lin.qtype)
            pw = lin.backend_data
            if isinstance(pw, PackedMatrix):
                _check_packed(pw, f"layer {i} {k}", rows, cols)
            else:
                w = lin.w
                if not isinstance(w, np.ndarray) or w.dtype != _U8 or w.ndim != 2:
                    raise InvalidRequestError(f"layer {i} {k}: weight must be a 2-D uint8 array of {name} blocks")
                if cols % bs or w.shape != (rows, cols // bs * ts):
                    raise InvalidRequestError(f"layer {i} {k}: {name} weight has shape {w.shape}, a {rows}x{cols} "
                                              f"matrix needs ({rows}, {cols // bs * ts if not cols % bs else '?'})")
            vec(lin.bias, rows, f"{k} bias")

    @staticmethod
    def _width(k: str, a: Any, L: Any) -> int:
        if k in ("q_norm", "k_norm"):
            heads = a.n_head if k == "q_norm" else a.n_head_kv
            return a.head_dim_k * (heads if not a.qk_norm_per_head else 1)
        return int(L.n_embd)

    def set_key_scales(self, scales: Sequence[np.ndarray | None] | None) -> None:
        """Per layer the powers of two (n_head_kv, head_dim_k) block-quantized caches scale keys by
        (the caches' own, ``Config.kv_scales``; None: none): layer i stores its keys scaled by its
        own, and its queries take 1 / those of the layer whose cache it reads. Call between steps."""
        ffi, _ = _lib()
        if scales is not None and len(scales) != self.n_layer:
            raise InvalidRequestError(f"{len(scales)} key scales for {self.n_layer} layers")
        for i in range(self.n_layer):
            L = self._layers[i]
            src = i if L.kv_layer < 0 else int(L.kv_layer)
            sc = None if scales is None else scales[src]
            if sc is not None and (L.mixer not in (0, 4) or np.shape(sc) != (L.n_head_kv, L.head_dim_k)
                                   or L.n_head % L.n_head_kv or not np.all(np.isfinite(sc) & (sc > 0))):
                raise InvalidRequestError(f"layer {i}: key scales of shape {np.shape(sc)} for keys of "
                                          f"{L.n_head_kv} x {L.head_dim_k} (positive, finite)")
            own = None if scales is None or L.kv_layer >= 0 else scales[i]
            L.k_scale = ffi.NULL if own is None else self._f32(ffi, own)
            L.q_scale = ffi.NULL if sc is None else self._f32(
                ffi, np.repeat(np.float32(1.0) / np.asarray(sc, _F32), L.n_head // L.n_head_kv, axis=0))

    def _states(self, ffi: Any, b: int, states: Sequence[Any] | None, keep: list[Any]) -> Any:
        """The ``float *[2 n_layer]`` of sequence b's recurrent states (NULL when no layer has one), every array
        checked against its layer's ``state_shapes`` (C writes them through bare pointers)."""
        rec = [i for i, sh in enumerate(self._state_shapes) if sh is not None]
        if not rec:
            return ffi.NULL
        if states is None or len(states) != self.n_layer:
            raise InvalidRequestError(f"sequence {b}: the layers need its recurrent states (one per layer)")
        p = ffi.new("float *[]", 2 * self.n_layer)
        keep.append(p)
        for i in rec:
            want, st = self._state_shapes[i], states[i]
            if st is None or len(st) != 2:
                raise InvalidRequestError(f"sequence {b}, layer {i}: no recurrent state")
            for j, (arr, shape) in enumerate(zip(st, want, strict=True)):
                if (not isinstance(arr, np.ndarray) or arr.dtype != _F32 or arr.shape != shape
                        or not arr.flags.c_contiguous or not arr.flags.writeable):
                    raise InvalidRequestError(f"sequence {b}, layer {i}: state {j} must be a writable C-contiguous "
                                              f"float32 array of {shape}, got {getattr(arr, 'shape', None)}")
                fp = ffi.from_buffer("float[]", arr, require_writable=True)
                keep.append(fp)
                p[2 * i + j] = fp
        return p

    def _ptr(self, ffi: Any, ctype: str, a: np.ndarray) -> Any:
        p = ffi.from_buffer(ctype, a)
        self._keep.append((a, p))
        return p

    def _f32(self, ffi: Any, a: np.ndarray) -> Any:
        a = np.ascontiguousarray(a, dtype=_F32)
        return self._ptr(ffi, "float[]", a)

    def run(self, x: np.ndarray, caches: list[tuple[np.ndarray, np.ndarray, int]],
            tables: list[tuple[np.ndarray, np.ndarray]], threads: int | None = None,
            per_layer: np.ndarray | None = None) -> None:
        """Every layer over x (n_seq, n_embd) float32, in place; token b is the next one of the
        sequence whose caches are ``caches[b] = (k, v, pos[, (type_k, type_v)])`` (k, v: (n_layer,
        n_head_kv, n_ctx, width) in their KV types, see :mod:`minirt.kv_types`; float32 / float16 arrays
        need no types; the new key/value go to position pos, quantized in place), followed, when some layer
        is a Mamba-2 mixer, by that sequence's states: per layer None or its (convolution inputs, SSM
        state) float32 arrays (:meth:`minirt.kv_cache.KVCache.state`), updated in place. tables: (cos, sin)
        pairs (n_seq, rope_dim / 2), one per RoPE variant the layers index. per_layer: the per-layer
        inputs (n_seq, n_layer, n_pl) float32 when the layers have them."""
        ffi, lib = _lib()
        n = len(caches)
        x = _f32_array(x, "x", (2,))
        if x.shape[0] != n or x.shape[1] != self._n_embd:
            raise InvalidRequestError(f"x has shape {x.shape}, expected ({n}, {self._n_embd})")
        seqs = ffi.new("mr_kvseq[]", n)
        keep = []
        kinds: tuple[Any, Any] | None = None
        for b, item in enumerate(caches):
            k, v, pos = item[:3]
            tk, tv = _kv_types(k, v, item[3] if len(item) > 3 else None)
            if kinds is None:
                kinds = (tk, tv)
            elif kinds != (tk, tv):
                raise InvalidRequestError("all caches of a decode step must have the same KV types")
            if not (k.flags.c_contiguous and v.flags.c_contiguous):
                raise InvalidRequestError("caches must be C-contiguous arrays")
            hkv, dk, dv = self._kv_max
            if (k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3] or k.shape[0] < self.n_layer
                    or k.shape[1] != hkv or tk.head_dim(k.shape[3]) != dk or k.shape[3] != tk.width(dk)
                    or tv.head_dim(v.shape[3]) != dv or v.shape[3] != tv.width(dv)):
                raise InvalidRequestError(f"cache of sequence {b}: k {k.shape} / v {v.shape} do not fit the layers")
            if not 0 <= int(pos) < k.shape[2]:
                raise InvalidRequestError(f"cache of sequence {b}: position {pos} outside its {k.shape[2]} slots")
            kp = ffi.from_buffer("char[]", k.reshape(-1).view(np.uint8), require_writable=True)
            vp = ffi.from_buffer("char[]", v.reshape(-1).view(np.uint8), require_writable=True)
            keep += [kp, vp]
            s = seqs[b]
            s.k, s.v = kp, vp
            s.n_ctx, s.pos = k.shape[2], int(pos)
            s.layer_stride_k, s.layer_stride_v = k[0].nbytes, v[0].nbytes
            s.state = self._states(ffi, b, item[4] if len(item) > 4 else None, keep)
        if len(tables) < self.n_tables:
            raise InvalidRequestError(f"{len(tables)} RoPE table pairs given, the layers read {self.n_tables}")
        nt = max(1, len(tables))
        cos_p, sin_p = ffi.new("float *[]", nt), ffi.new("float *[]", nt)
        for i, (c, sn) in enumerate(tables):
            c, sn = np.ascontiguousarray(c, dtype=_F32), np.ascontiguousarray(sn, dtype=_F32)
            for t in (c, sn):
                if t.ndim != 2 or t.shape[0] != n or t.shape[1] < self._half_rope.get(i, 0):
                    raise InvalidRequestError(
                        f"RoPE table of shape {t.shape}, expected ({n}, {self._half_rope.get(i, 0)})")
            cb, sb = ffi.from_buffer("float[]", c), ffi.from_buffer("float[]", sn)
            keep += [c, sn, cb, sb]
            cos_p[i], sin_p[i] = cb, sb
        pl = ffi.NULL
        if self._n_pl:
            if per_layer is None:
                raise InvalidRequestError("the layers have per-layer inputs and none were given")
            per_layer = _f32_array(per_layer, "per_layer", (3,))
            if per_layer.shape != (n, self.n_layer, self._n_pl):
                raise InvalidRequestError(f"per-layer inputs of shape {per_layer.shape}, expected "
                                          f"({n}, {self.n_layer}, {self._n_pl})")
            per_layer = np.ascontiguousarray(per_layer)
            pl = ffi.from_buffer("float[]", per_layer)
            keep += [per_layer, pl]
        rc = lib.mr_decode_layers(self._layers, self.n_layer, ffi.from_buffer("float[]", x, require_writable=True), n,
                                  seqs, kinds[0].ggml_id, kinds[1].ggml_id, cos_p, sin_p, len(tables), pl,
                                  _threads_arg(threads), self._isa)
        _after_call(lib, rc, "decode layers", self, (x, caches))


_MOE_ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 3, "relu2": 4}
_SHARED_ACTS = {"silu": 0, "gelu_tanh": 1, "relu2": 4}  # a shared expert in the layer stack (relu2 without gate)
_GATINGS = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}  # mr_moe.gating


def moe_unsupported(m: Any) -> str | None:
    """Why :func:`moe_experts` cannot run the routed experts of ``m`` (a :class:`minirt.blocks.MoE`); None if it can."""
    if m.act not in _MOE_ACTS:
        return f"expert activation {m.act!r}"
    if m.act == "swiglu_oai" and (m.gate is None or len(m.act_params) != 2):
        return "clamped SwiGLU without gate or without (alpha, limit)"
    if m.act == "relu2" and m.gate is not None:
        return "squared ReLU with a gate"
    for lin in (m.gate or []) + m.up + m.down:
        if lin.qtype not in QTYPES:
            return f"expert weights of type {lin.qtype}"
    return None


class ExpertSet:
    """The routed experts of one :class:`minirt.blocks.MoE` as ``mr_weight`` arrays for
    ``mr_moe_experts``; a weight whose ``backend_data`` is a :class:`PackedMatrix` is read packed.
    Raises :class:`BackendError` when :func:`moe_unsupported` names a reason."""

    def __init__(self, m: Any) -> None:
        ffi, lib = _lib()
        if not hasattr(lib, "mr_moe_experts"):  # an extension built before the MoE kernels existed
            raise BackendError(f"native MoE experts: {_build_path} predates them; reinstall minirt to rebuild")
        why = moe_unsupported(m)
        if why is not None:
            raise BackendError(f"native MoE experts: {why}")
        self._keep: list[Any] = []
        self.n_expert, self.n_embd = m.n_expert, m.down[0].out_features
        self.act = _MOE_ACTS[m.act]
        oai = m.act == "swiglu_oai"
        self.alpha, self.limit = (float(m.act_params[0]), float(m.act_params[1])) if oai else (0.0, 0.0)
        self.gate = self._weights(ffi, m.gate) if m.gate is not None else ffi.NULL
        self.up, self.down = self._weights(ffi, m.up), self._weights(ffi, m.down)
        for e in range(self.n_expert):  # the shapes mr_moe_experts relies on
            F = m.up[e].out_features
            if ((m.up[e].in_features, m.down[e].out_features, m.down[e].in_features) != (self.n_embd, self.n_embd, F)
                    or (m.gate is not None and (m.gate[e].out_features, m.gate[e].in_features) != (F, self.n_embd))):
                raise BackendError(f"native MoE experts: expert {e} has inconsistent shapes")

    def _weights(self, ffi: Any, lins: list[Any]) -> Any:
        arr = ffi.new("mr_weight[]", len(lins))
        self._keep.append(arr)
        for W, lin in zip(arr, lins):
            w = lin.backend_data if isinstance(lin.backend_data, PackedMatrix) else lin.w
            _, tid, bs, ts = _qtype(lin.qtype)
            W.qtype = tid
            if isinstance(w, PackedMatrix):
                W.packed, W.rows, W.cols, W.row_bytes = 1, w.rows, w.cols, 0
                data = w.data
            else:
                data = np.ascontiguousarray(w)
                W.packed, W.rows, W.row_bytes = 0, data.shape[0], data.shape[1]
                W.cols = data.shape[1] // ts * bs
            p = ffi.from_buffer("unsigned char[]", data)
            self._keep += [w, data, p]
            W.data = p
            if lin.bias is not None:
                b = np.ascontiguousarray(lin.bias, dtype=_F32)
                bp = ffi.from_buffer("float[]", b)
                self._keep += [b, bp]
                W.bias = bp
            else:
                W.bias = ffi.NULL
        return arr


def moe_experts(es: ExpertSet, x: np.ndarray, ids: np.ndarray, w: np.ndarray, threads: int | None = None,
                isa: str | None = None) -> np.ndarray:
    """The routed experts' sum for tokens x (T, n_embd) float32 that chose experts ``ids`` (T, k)
    int64 with weights ``w`` (T, k) float32: (T, n_embd), each chosen expert run once over its tokens."""
    ffi, lib = _lib()
    x = _f32_array(x, "x", (2,))
    T = x.shape[0]
    if x.shape[1] != es.n_embd:
        raise InvalidRequestError(f"x has {x.shape[1]} columns, the experts {es.n_embd}")
    if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or ids.ndim != 2 or ids.shape[0] != T:
        raise InvalidRequestError(f"ids must be an int64 array ({T}, k)")
    k = ids.shape[1]
    w = _f32_array(np.ascontiguousarray(w, dtype=_F32), "w", (2,))
    if w.shape != ids.shape or k < 1:
        raise InvalidRequestError(f"w {w.shape} must match ids {ids.shape}")
    ids = np.ascontiguousarray(ids)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= es.n_expert):
        raise InvalidRequestError(f"expert ids must be in [0, {es.n_expert})")
    out = np.empty((T, es.n_embd), dtype=_F32)
    rc = lib.mr_moe_experts(es.gate, es.up, es.down, es.n_expert, ffi.from_buffer("float[]", x), T, es.n_embd,
                            ffi.cast("long long *", _address(ids)), ffi.from_buffer("float[]", w), k, es.act,
                            es.alpha, es.limit, ffi.from_buffer("float[]", out, require_writable=True),
                            _threads_arg(threads), _isa_id(isa))
    _after_call(lib, rc, "moe experts", es, (x, ids))
    return out


def matmul(x: np.ndarray, w: np.ndarray | PackedMatrix, qtype: str | None = None, out: np.ndarray | None = None,
           threads: int | None = None, isa: str | None = None) -> np.ndarray:
    """``Y = X @ W.T`` straight from quantized blocks.

    x: float32 (n_tokens, cols) (or (cols,) for one token), C-contiguous.
    w: uint8 (rows, row_bytes) ggml blocks of ``qtype``, rows C-contiguous; or a
    :class:`PackedMatrix` (``qtype`` may then be omitted).
    out: float32 (n_tokens, rows) (or (rows,)), written in place when given.
    Returns out: float32 (n_tokens, rows).
    """
    m = _mod if _mod is not None else _load()
    ffi, lib = m.ffi, m.lib
    if isinstance(w, PackedMatrix):
        return _matmul_packed(ffi, lib, x, w, qtype, out, threads, isa)
    if qtype is None:
        raise InvalidRequestError("qtype is required for a ggml weight array")
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
    out = _matmul_out(out, shape, x)
    if rows == 0 or nt == 0:
        return out
    rc = lib.mr_matmul(tid, ffi.from_buffer("unsigned char[]", w), rows, cols, row_bytes,
                       ffi.from_buffer("float[]", x), nt, cols, ffi.from_buffer("float[]", out, require_writable=True),
                       rows, _threads_arg(threads), _isa_id(isa))
    _after_call(lib, rc, "matmul", w, x)
    return out


def _matmul_out(out: np.ndarray | None, shape: tuple[int, ...], x: np.ndarray) -> np.ndarray:
    """The matmul's float32 output: a new array, or ``out`` checked (shape, dtype, no overlap with x)."""
    if out is None:
        return np.empty(shape, dtype=_F32)
    _out_array(out, shape)
    if _overlaps(out, x):
        raise InvalidRequestError("out must not overlap x")
    return out


def _matmul_packed(ffi: Any, lib: Any, x: np.ndarray, w: PackedMatrix, qtype: str | None, out: np.ndarray | None,
                   threads: int | None, isa: str | None) -> np.ndarray:
    name, tid = _check_packed(w)
    if qtype is not None and _qtype(qtype)[0] != name:
        raise InvalidRequestError(f"qtype {qtype!r} does not match the packed matrix ({name})")
    x = _f32_array(x, "x", (1, 2))
    nt, cols = (1, x.shape[0]) if x.ndim == 1 else x.shape
    if cols != w.cols:
        raise InvalidRequestError(f"x has {cols} columns, the packed matrix {w.cols}")
    shape = (nt, w.rows) if x.ndim == 2 else (w.rows,)
    out = _matmul_out(out, shape, x)
    if nt == 0:
        return out
    wd = w.data
    rc = lib.mr_matmul_packed(tid, ffi.from_buffer("unsigned char[]", wd), w.rows, w.cols,
                              ffi.from_buffer("float[]", x),
                              nt, cols, ffi.from_buffer("float[]", out, require_writable=True), w.rows,
                              _threads_arg(threads), _isa_id(isa))
    _after_call(lib, rc, "matmul", wd, x)
    return out


def matmul_path(qtype: str, n_tokens: int, isa: str | None = None, packed: bool = False) -> str:
    """Which code path ``matmul`` takes: 'int16', 'int16-gemm' or 'int8' (quantized activations: int16 per
    32 elements, or int8 per 256 as llama.cpp's q8_K), 'float-dot', 'float-tile' or 'float-panel' (the
    float ones dequantize the weights and compute in float32), 'amx-bf16' (the ISA ``avx512_amx`` from 64 tokens
    on: dequantized weights and float activations each split into two bf16 for AMX tiles, float32 sums),
    'amx-int8' (that ISA's ``int16-gemm`` on AMX int8 tiles, the same results)."""
    ffi, lib = _lib()
    _, tid, _, _ = _qtype(qtype)
    if packed:
        rc = lib.mr_matmul_packed_path(tid, int(n_tokens), _isa_id(isa))
    else:
        rc = lib.mr_matmul_path(tid, int(n_tokens), _isa_id(isa))
    return {1: "int16", 2: "float-dot", 3: "float-tile", 4: "float-panel", 5: "int16-gemm", 6: "int8",
            7: "amx-bf16", 8: "amx-int8"}.get(rc, "none")


def dequantize(w: np.ndarray, qtype: str, cols: int | None = None) -> np.ndarray:
    """Dequantize ``w`` (rows, row_bytes) uint8 blocks to float32 (rows, cols)."""
    ffi, lib = _lib()
    name, tid, rows, rb, n = _ggml_rows(w, qtype)
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


def rope(x: np.ndarray, *, neox: bool, cos: np.ndarray, sin: np.ndarray, n_rot: int | None = None,
         isa: str | None = None) -> np.ndarray:
    """Rotary position embedding of x (n_tokens, n_heads, head_dim) float32, in place; returns x.

    The first ``n_rot`` dims (default head_dim) rotate: NEOX style pairs (i, i + n_rot/2), normal style
    pairs (2i, 2i+1), by the angles of the precomputed ``cos``/``sin`` tables (n_tokens, n_rot/2).
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
    cos = _f32_array(cos, "cos", (2,))
    sin = _f32_array(sin, "sin", (2,))
    if cos.shape != (nt, half) or sin.shape != (nt, half):
        raise InvalidRequestError(f"cos/sin must have shape {(nt, half)}, got {cos.shape} and {sin.shape}")
    _check_rc(lib.mr_rope_cs(ffi.from_buffer("float[]", x, require_writable=True), nt, nh, hd, n_rot,
                             ffi.from_buffer("float[]", cos), ffi.from_buffer("float[]", sin), int(bool(neox)),
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


TOPK_MAX = 64  # MR_TOPK_MAX: most elements logit_stats ranks


def logit_stats(x: np.ndarray, k: int, isa: str | None = None) -> tuple[float, float, np.ndarray, np.ndarray]:
    """Sampler statistics of one row of logits ``x`` (V,) float32: ``(max, logsumexp, top_ids, top_values)``.

    The top ``min(k, V)`` entries (0 <= k <= TOPK_MAX) come value descending, index ascending among
    equal values. When ``x`` holds a NaN, max and logsumexp are NaN and no entries are returned;
    when its maximum is infinite, both are that infinity and no entries are returned.
    """
    ffi, lib = _lib()
    x = _f32_array(x, "x", (1,))
    if x.size == 0:
        raise InvalidRequestError("x must not be empty")
    if not isinstance(k, (int, np.integer)) or not 0 <= k <= TOPK_MAX:
        raise InvalidRequestError(f"k must be an integer in [0, {TOPK_MAX}], got {k!r}")
    mx, lse = ffi.new("float *"), ffi.new("double *")
    idx, val = np.empty(max(int(k), 1), np.int64), np.empty(max(int(k), 1), np.float32)
    n = lib.mr_logit_stats(ffi.from_buffer("float[]", x), x.size, int(k), mx, lse,
                           ffi.cast("long long *", _address(idx)), ffi.cast("float *", _address(val)), _isa_id(isa))
    if n < 0:
        _check_rc(n, "logit_stats")
    return float(mx[0]), float(lse[0]), idx[:n], val[:n]


def attention_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n_past: int, scale: float,
                     out: np.ndarray | None = None, window: int = 0, softcap: float = 0.0,
                     threads: int | None = None, isa: str | None = None,
                     kv_types: tuple[str, str] | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
    """One query position against a KV cache, grouped-query.

    q: (n_head, head_dim) float32; k_cache, v_cache: (n_kv, n_ctx, width) rows stored in the KV types
    ``kv_types`` (names of :mod:`minirt.kv_types`; None: float32 / float16 arrays), the first ``n_past``
    positions valid; ``window`` > 0 keeps only the last ``window`` positions; softcap > 0 applies
    ``softcap * tanh(s / softcap)`` to the scaled scores; ``sinks`` (n_head,): per-head logits that join
    each softmax's denominator only (gpt-oss). Returns out (n_head, head_dim).
    """
    ffi, lib = _lib()
    q = _f32_array(q, "q", (2,))
    n_head, hd = q.shape
    tk, tv = _kv_types(k_cache, v_cache, kv_types)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 3 or not c.flags.c_contiguous:
            raise InvalidRequestError(f"{name} must be a C-contiguous array (n_kv, n_ctx, width)")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise InvalidRequestError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must match")
    n_kv, n_ctx, _ = k_cache.shape
    if tk.head_dim(k_cache.shape[2]) != hd or k_cache.shape[2] != tk.width(hd) or v_cache.shape[2] != tv.width(hd):
        raise InvalidRequestError(f"cache head_dim does not match q head_dim {hd} ({tk.name} k {k_cache.shape}, "
                                  f"{tv.name} v {v_cache.shape})")
    if n_kv == 0 or n_head % n_kv:
        raise InvalidRequestError(f"n_head={n_head} must be a multiple of n_kv={n_kv}")
    if isinstance(n_past, bool) or not isinstance(n_past, (int, np.integer)) or not 1 <= n_past <= n_ctx:
        raise InvalidRequestError(f"n_past must be in 1..n_ctx={n_ctx}, got {n_past!r}")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise InvalidRequestError(f"window must be a non-negative integer, got {window!r}")
    if not np.isfinite(scale) or not np.isfinite(softcap) or softcap < 0:
        raise InvalidRequestError("scale must be finite and softcap finite and >= 0")
    if sinks is not None:
        sinks = _f32_array(sinks, "sinks", (1,))
        if sinks.shape != (n_head,) or not np.isfinite(sinks).all():
            raise InvalidRequestError(f"sinks must be {n_head} finite values, got shape {sinks.shape}")
    if out is None:
        out = np.empty((n_head, hd), dtype=_F32)
    else:
        _out_array(out, (n_head, hd))
    _check_rc(lib.mr_attention_decode(ffi.from_buffer("float[]", q), _bytes_of(ffi, k_cache), _bytes_of(ffi, v_cache),
                                      tk.ggml_id, tv.ggml_id, n_head, n_kv, n_ctx, hd, int(n_past),
                                      float(scale), int(window), float(softcap),
                                      ffi.NULL if sinks is None else ffi.from_buffer("float[]", sinks),
                                      ffi.from_buffer("float[]", out, require_writable=True), _threads_arg(threads),
                                      _isa_id(isa)), "attention_decode")
    return out


def _kv_types(k: Any, v: Any, names: tuple[str, str] | None) -> tuple[Any, Any]:
    """The KV types of a cache pair: named, or read from float32 / float16 arrays; checks the dtypes."""
    from .. import kv_types

    for name, c in (("k_cache", k), ("v_cache", v)):
        if not isinstance(c, np.ndarray):
            raise InvalidRequestError(f"{name} must be a numpy array")
    if names is None:
        t = (kv_types.of_array(k), kv_types.of_array(v))
    else:
        t = (kv_types.get(names[0]), kv_types.get(names[1]))
    for name, c, kt in (("k_cache", k, t[0]), ("v_cache", v, t[1])):
        if c.dtype != kt.dtype:
            raise InvalidRequestError(f"{name}: a {kt.name} cache is stored as {kt.dtype}, got {c.dtype}")
    return t


def kv_types_fit(k: np.ndarray, v: np.ndarray, names: tuple[str, str], head_dim: int) -> bool:
    """True when the attention kernels take this cache pair: both halves stored in ``names`` types
    with rows of ``head_dim`` values (the kernels need head_dim_k == head_dim_v)."""
    from .. import kv_types

    tk, tv = kv_types.get(names[0]), kv_types.get(names[1])
    if k.dtype != tk.dtype or v.dtype != tv.dtype or head_dim % tk.block or head_dim % tv.block:
        return False
    return k.shape[-1] == tk.width(head_dim) and v.shape[-1] == tv.width(head_dim)


def _bytes_of(ffi: Any, a: np.ndarray) -> Any:
    return ffi.from_buffer("char[]", a.reshape(-1).view(np.uint8))


def kv_rotate(x: np.ndarray, n: int, inplace: bool = False) -> np.ndarray:
    """x (..., D) with each run of n values along the last axis Hadamard-rotated (a new float32
    array; the same floats as :func:`minirt.kv_types.rotate` and the fused decode step). ``inplace``:
    x itself is rotated when it is a writable C-contiguous float32 array (else a copy is)."""
    ffi, lib = _lib()
    if inplace and isinstance(x, np.ndarray) and x.dtype == _F32 and x.flags.c_contiguous and x.flags.writeable:
        y = x
    else:
        y = np.array(x, dtype=_F32, order="C", copy=True)
    if y.ndim < 1 or y.shape[-1] % n:
        raise InvalidRequestError(f"rows of {y.shape[-1] if y.ndim else 0} values cannot be rotated in runs of {n}")
    if y.size:
        _check_rc(lib.mr_kv_rotate_rows(ffi.from_buffer("float[]", y, require_writable=True), y.size, n), "kv_rotate")
    return y


def kv_quantize(x: np.ndarray, kv_type: str) -> np.ndarray:
    """float32 rows x (..., head_dim) → the stored rows (..., width) of KV type ``kv_type``, as the
    decode step writes them (ggml's reference quantizers)."""
    from .. import kv_types

    ffi, lib = _lib()
    t = kv_types.get(kv_type)
    x = np.ascontiguousarray(x, dtype=_F32)
    if x.ndim < 1:
        raise InvalidRequestError("x must have at least one dimension")
    out = np.empty((*x.shape[:-1], t.width(x.shape[-1])), dtype=t.dtype)
    if x.size:
        _check_rc(lib.mr_kv_quantize(t.ggml_id, ffi.from_buffer("float[]", x), x.size,
                                     ffi.from_buffer("char[]", out.reshape(-1).view(np.uint8), require_writable=True)),
                  "kv_quantize")
    return out


def kv_dequantize(s: np.ndarray, kv_type: str) -> np.ndarray:
    """Stored rows (..., width) of KV type ``kv_type`` → float32 (..., head_dim)."""
    from .. import kv_types

    ffi, lib = _lib()
    t = kv_types.get(kv_type)
    s = np.ascontiguousarray(s)
    if s.dtype != t.dtype or s.ndim < 1:
        raise InvalidRequestError(f"a {t.name} cache is stored as {t.dtype} rows, got {s.dtype}{s.shape}")
    out = np.empty((*s.shape[:-1], t.head_dim(s.shape[-1])), dtype=_F32)
    if out.size:
        _check_rc(lib.mr_kv_dequantize(t.ggml_id, _bytes_of(ffi, s), out.size,
                                       ffi.from_buffer("float[]", out, require_writable=True)), "kv_dequantize")
    return out


def act_mul(g: np.ndarray, u: np.ndarray, act: str, out: np.ndarray | None = None,
            isa: str | None = None) -> np.ndarray:
    """``act(g) * u`` elementwise (act: "silu" or "gelu_tanh"); ``out`` may be ``g`` (in place)."""
    ffi, lib = _lib()
    if act not in _ACTS:
        raise InvalidRequestError(f"act must be one of {sorted(_ACTS)}, got {act!r}")
    g = _f32_array(g, "g", (1, 2))
    u = _f32_array(u, "u", (1, 2))
    if g.shape != u.shape:
        raise InvalidRequestError(f"g {g.shape} and u {u.shape} must have the same shape")
    if out is None:
        out = np.empty_like(g)
    elif out is not g:
        _out_array(out, g.shape)
    if g.size:
        _check_rc(lib.mr_act_mul(ffi.from_buffer("float[]", g), ffi.from_buffer("float[]", u),
                                 ffi.from_buffer("float[]", out, require_writable=True), g.size, _ACTS[act],
                                 _isa_id(isa)),
                  "act_mul")
    return out


_UNGATED_ACTS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # mr_act_mul without u; 2: erf GELU (A&S 7.1.26)


def activation(x: np.ndarray, act: str, out: np.ndarray | None = None, isa: str | None = None) -> np.ndarray:
    """``act(x)`` elementwise of float32 x (T, n) or (n,) (act: "silu", "gelu_tanh" or "gelu", the erf
    GELU with |erf error| <= 1.5e-7); ``out`` may be ``x`` (in place)."""
    ffi, lib = _lib()
    if act not in _UNGATED_ACTS:
        raise InvalidRequestError(f"act must be one of {sorted(_UNGATED_ACTS)}, got {act!r}")
    x = _f32_array(x, "x", (1, 2))
    if out is None:
        out = np.empty_like(x)
    elif out is not x:
        _out_array(out, x.shape)
    if x.size:
        _check_rc(lib.mr_act_mul(ffi.from_buffer("float[]", x), ffi.NULL,
                                 ffi.from_buffer("float[]", out, require_writable=True), x.size, _UNGATED_ACTS[act],
                                 _isa_id(isa)),
                  "activation")
    return out


PROFILE_PHASES = ("qkv", "rope_kv", "attention", "attn_out", "gate_up", "down")


def profile(enable: bool | None = None, reset: bool = False) -> dict[str, float]:
    """Phase timing of the native decode layers: ``enable`` switches it on/off; returns seconds
    spent per phase so far (plus ``layers``: how many layers ran), zeroed afterwards if ``reset``."""
    ffi, lib = _lib()
    if enable is not None:
        lib.mr_profile_enable(int(bool(enable)))
    buf = ffi.new("double[8]")
    lib.mr_profile_read(buf, 8, int(bool(reset)))
    out = {name: buf[i] * 1e-9 for i, name in enumerate(PROFILE_PHASES)}
    out["layers"] = int(buf[6])
    return out


def attention_fast(isa: str | None = None) -> bool:
    """True when the ISA has the vectorized attention kernels (AVX-512): attention_prefill then
    beats a BLAS-based implementation; elsewhere it is correct but slower."""
    _, lib = _lib()
    return bool(lib.mr_attention_fast(_isa_id(isa)))


def delta_rule(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
               threads: int | None = None) -> np.ndarray:
    """The gated delta rule of :func:`minirt.blocks.delta_rule` in C, one value head per thread item:
    S (H, Dk, Dv) updated in place; q, k (n, H, Dk), v (n, H, Dv), decay, beta (n, H) float32. Returns
    o (n, H, Dv). Every shape is checked here (C reads them through bare pointers)."""
    ffi, lib = _lib()
    S = _f32_array(S, "S", (3,))
    if not S.flags.writeable:
        raise InvalidRequestError("S must be writeable")
    H, dk, dv = S.shape
    q, k, v = (_f32_array(a, name, (3,)) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    n = q.shape[0]
    if q.shape != (n, H, dk) or k.shape != (n, H, dk) or v.shape != (n, H, dv):
        raise InvalidRequestError(f"q {q.shape}, k {k.shape}, v {v.shape} do not match the state {S.shape}")
    decay, beta = _f32_array(decay, "decay", (2,)), _f32_array(beta, "beta", (2,))
    if decay.shape != (n, H) or beta.shape != (n, H):
        raise InvalidRequestError(f"decay {decay.shape} and beta {beta.shape} must be ({n}, {H})")
    if dv > lib.MR_DR_MAX_DV:
        raise InvalidRequestError(f"value head size {dv} is over {lib.MR_DR_MAX_DV}")
    if any(_overlaps(S, a) for a in (q, k, v, decay, beta)):
        raise InvalidRequestError("S must not overlap the inputs")
    o = np.empty((n, H, dv), dtype=np.float32)
    fb = ffi.from_buffer
    _check_rc(lib.mr_delta_rule(fb("float[]", S, require_writable=True), fb("float[]", q), fb("float[]", k),
                                fb("float[]", v), fb("float[]", decay), fb("float[]", beta),
                                fb("float[]", o, require_writable=True), n, H, dk, dv, _threads_arg(threads)),
              "delta_rule")
    return o


def causal_conv(rows: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None,
                threads: int | None = None) -> np.ndarray:
    """:func:`minirt.blocks.causal_conv` in C: rows (taps − 1 + n, c), w (c, taps), bias (c,) or None, float32.
    Returns (n, c). Every shape is checked here (C reads them through bare pointers)."""
    ffi, lib = _lib()
    rows, w = _f32_array(rows, "rows", (2,)), _f32_array(w, "w", (2,))
    c, taps = w.shape
    n = rows.shape[0] - (taps - 1)
    if rows.shape[1] != c or n < 0:
        raise InvalidRequestError(f"rows {rows.shape} do not fit a convolution of {c} channels and {taps} taps")
    if bias is not None and _f32_array(bias, "bias", (1,)).shape != (c,):
        raise InvalidRequestError(f"bias {bias.shape} must be ({c},)")
    w_t = np.ascontiguousarray(w.T)  # (taps, c): the kernel's inner loops run over contiguous channels
    out = np.empty((n, c), dtype=np.float32)
    fb = ffi.from_buffer
    b = ffi.NULL if bias is None else fb("float[]", bias)
    _check_rc(lib.mr_causal_conv(fb("float[]", rows), fb("float[]", w_t), b, fb("float[]", out, require_writable=True),
                                 n, c, taps, _threads_arg(threads)),
              "causal_conv")
    return out


def ssm_scan(S: np.ndarray, x: np.ndarray, dt: np.ndarray, a: np.ndarray, B: np.ndarray, C: np.ndarray,
             threads: int | None = None, isa: str | None = None) -> np.ndarray:
    """Mamba-2's selective scan of :func:`minirt.blocks.ssm_scan` in C, one head per thread item: S (H, P, N)
    updated in place; x (n, H, P), dt (n, H), a (H,), B and C (n, G, N) float32. Returns y (n, H, P).
    Every shape is checked here (C reads them through bare pointers)."""
    ffi, lib = _lib()
    S = _f32_array(S, "S", (3,))
    if not S.flags.writeable:
        raise InvalidRequestError("S must be writeable")
    H, P, N = S.shape
    x, B, C = (_f32_array(v, name, (3,)) for v, name in ((x, "x"), (B, "B"), (C, "C")))
    n, G = x.shape[0], B.shape[1]
    if x.shape != (n, H, P) or B.shape != (n, G, N) or C.shape != (n, G, N) or G == 0 or H % G:
        raise InvalidRequestError(f"x {x.shape}, B {B.shape}, C {C.shape} do not match the state {S.shape}")
    dt, a = _f32_array(dt, "dt", (2,)), _f32_array(a, "a", (1,))
    if dt.shape != (n, H) or a.shape != (H,):
        raise InvalidRequestError(f"dt {dt.shape} and a {a.shape} must be ({n}, {H}) and ({H},)")
    if any(_overlaps(S, v) for v in (x, dt, a, B, C)):
        raise InvalidRequestError("S must not overlap the inputs")
    y = np.empty((n, H, P), dtype=np.float32)
    fb = ffi.from_buffer
    _check_rc(lib.mr_ssm_scan(fb("float[]", S, require_writable=True), fb("float[]", x), fb("float[]", dt),
                              fb("float[]", a), fb("float[]", B), fb("float[]", C),
                              fb("float[]", y, require_writable=True), n, H, P, N, G, _threads_arg(threads),
                              _isa_id(isa)),
              "ssm_scan")
    return y


def attention_prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, p0: int, scale: float,
                      out: np.ndarray | None = None, window: int = 0, softcap: float = 0.0,
                      threads: int | None = None, isa: str | None = None,
                      kv_types: tuple[str, str] | None = None) -> np.ndarray:
    """Causal attention of n new queries at positions p0..p0+n-1, grouped-query.

    q: (n, n_head, head_dim) float32; k_cache, v_cache: (n_kv, n_ctx, width) rows in the KV types
    ``kv_types`` (None: float32 / float16 arrays) holding positions 0..p0+n-1 (the new keys
    included); query i sees the positions max(0, p0+i-window+1)..p0+i (window 0: all); softcap > 0
    caps the scaled scores with tanh. Keys are read in tiles (online softmax), so memory does not
    grow with the context. Returns out (n, n_head * head_dim).
    """
    ffi, lib = _lib()
    q = _f32_array(q, "q", (3,))
    n, n_head, hd = q.shape
    tk, tv = _kv_types(k_cache, v_cache, kv_types)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 3 or not c.flags.c_contiguous:
            raise InvalidRequestError(f"{name} must be a C-contiguous array (n_kv, n_ctx, width)")
    if (k_cache.shape[:2] != v_cache.shape[:2] or tk.head_dim(k_cache.shape[2]) != hd
            or k_cache.shape[2] != tk.width(hd) or v_cache.shape[2] != tv.width(hd)):
        raise InvalidRequestError(f"k_cache {tk.name}{k_cache.shape} and v_cache {tv.name}{v_cache.shape} "
                                  f"must match each other and q's head_dim {hd}")
    n_kv, n_ctx, _ = k_cache.shape
    if n_kv == 0 or n_head % n_kv:
        raise InvalidRequestError(f"n_head={n_head} must be a multiple of n_kv={n_kv}")
    if isinstance(p0, bool) or not isinstance(p0, (int, np.integer)) or p0 < 0 or p0 + n > n_ctx:
        raise InvalidRequestError(f"positions {p0}..{p0 + n - 1} do not fit the cache of {n_ctx}")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise InvalidRequestError(f"window must be a non-negative integer, got {window!r}")
    if not np.isfinite(scale) or not np.isfinite(softcap) or softcap < 0:
        raise InvalidRequestError("scale must be finite and softcap finite and >= 0")
    if out is None:
        out = np.empty((n, n_head * hd), dtype=_F32)
    else:
        _out_array(out, (n, n_head * hd))
    if n == 0:
        return out
    _check_rc(lib.mr_attention_prefill(ffi.from_buffer("float[]", q), n, n_head, hd, _bytes_of(ffi, k_cache),
                                       _bytes_of(ffi, v_cache), tk.ggml_id, tv.ggml_id, n_kv, n_ctx, int(p0),
                                       float(scale), int(window), float(softcap),
                                       ffi.from_buffer("float[]", out, require_writable=True),
                                       _threads_arg(threads), _isa_id(isa)), "attention_prefill")
    return out


def read_bandwidth(buf: np.ndarray, threads: int | None = None, reps: int = 5,
                   isa: str | None = None) -> tuple[float, int]:
    """Streaming-read probe of memory bandwidth: reads every byte of ``buf`` (C-contiguous, nbytes a
    multiple of 8) ``reps`` times on the thread pool with the ISA's widest integer adds.

    Returns (fastest pass in seconds, wrapping uint64 sum of the buffer's 64-bit words): the sum is
    what ``buf.view(np.uint64).sum(dtype=np.uint64)`` gives, proof that every byte was read."""
    ffi, lib = _lib()
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise InvalidRequestError("read_bandwidth: buf must be a C-contiguous numpy array")
    if buf.nbytes == 0 or buf.nbytes % 8:
        raise InvalidRequestError(f"read_bandwidth: buf.nbytes must be a positive multiple of 8, got {buf.nbytes}")
    if isinstance(reps, bool) or not isinstance(reps, (int, np.integer)) or reps < 1:
        raise InvalidRequestError(f"reps must be a positive integer, got {reps!r}")
    if not hasattr(lib, "mr_read_bandwidth"):  # an extension built before the probe existed
        raise BackendError(f"native read_bandwidth: {_build_path} predates it; reinstall minirt to rebuild")
    out = ffi.new("unsigned long long *")
    ns = lib.mr_read_bandwidth(ffi.from_buffer("char[]", buf.reshape(-1).view(np.uint8)), buf.nbytes,
                               _threads_arg(threads), int(reps), _isa_id(isa), out)
    if ns < 0:
        _check_rc(int(ns), "read_bandwidth")
    return ns * 1e-9, int(out[0])


__all__ = [
    "available", "info", "supported_isas", "set_threads", "get_threads", "set_isa", "matmul", "matmul_path",
    "PackArena", "PackedMatrix", "pack", "pack_size", "pack_preferred", "unpack", "packed_rows", "release_file_pages",
    "LayerStack", "ExpertSet", "moe_experts",
    "dequantize", "rmsnorm", "rope", "softmax", "attention_decode", "attention_prefill", "attention_fast", "act_mul",
    "delta_rule", "causal_conv", "ssm_scan",
    "profile",
    "read_bandwidth",
    "QTYPES",
    "ISA_NAMES",
]
