"""KV-cache state files (:meth:`minirt.Model.save_state` / :meth:`~minirt.Model.load_state`).

A state file is a ``.npz`` archive (``np.savez``) of four members: ``header`` (a JSON string:
format, minirt version, model fingerprint, ``n_tokens``, ``cache_type_k`` / ``cache_type_v``,
``kv_basis``), ``tokens`` (``(n,)`` int32 ids), ``k`` and ``v`` (``(n_layer, n_head_kv, n, width)``,
stored rows of those KV element types; ``kv_basis`` 1: in the form block-quantized caches store them
(keys less their layer's constant offset, keys and values Hadamard-rotated: :class:`minirt.kv_cache.KVCache`),
0 or absent (files written before that field): plain rows; a model with other cache types, or a file
of the other basis, converts them through float32). A fifth member ``kscale`` (``(n_layer, n_head_kv,
head_dim_k)`` int8, the base-2 exponents of the key scales of :mod:`minirt.kv_balance`,
``kv_balance.to_exponents``) is
there exactly when the header's ``kv_key_scales`` is true; a model whose caches scale keys otherwise
converts the rows through float32 too. A member ``rstate`` (``(state_size,)`` float32, every recurrent
layer's state after the saved positions in :meth:`minirt.kv_cache.KVCache.export_state`'s layout) is
there exactly when the header's ``recurrent`` is true, which it must be for a model with recurrent
(Qwen3.5 delta-net) layers and only for one.

Reading one is hostile-input work: it ends up in the prefix cache, where a wrong value would
silently change every later request sharing its tokens. So :func:`read_state` checks everything
against the model before using it, at a cost bounded by what a valid state of this model can be:

* the path must be a regular file, opened non-blocking (a FIFO or device path cannot hang it);
  its size must not exceed the largest valid state (full context) plus a small slack;
* the archive must hold exactly the four members, each stored or deflated, its *declared*
  uncompressed size matching the array its npy header declares, that array's dtype and shape
  matching this model's cache — all before a byte of array data is decompressed; data is then
  read with bounded decompression (never more than the expected bytes plus one), and the zip
  CRC is verified;
* token ids must be in the vocabulary, keys and values finite.

Every failure is a :class:`minirt.StateError` naming the file and the problem.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import kv_types
from .errors import InvalidRequestError, StateError
from .kv_cache import dequantize_rows

log = logging.getLogger(__name__)

MAX_HEADER_CHARS = 1 << 16  # the JSON header is a few hundred characters
NPY_HEADER_MAX = 10_000  # numpy's own limit for the npy header (np.lib.format)
ZIP_SLACK = 1 << 16  # local headers, zip64 extras, central directory
MEMBERS = ("header", "tokens", "k", "v")
SCALE_MEMBER = "kscale"  # present when the header's kv_key_scales is true
STATE_MEMBER = "rstate"  # present when the header's recurrent is true
_EOCD = b"PK\x05\x06"


def read_state(path: str | os.PathLike[str], cache: Any, n_vocab: int,
               check_header: Callable[[dict[str, Any]], None]) -> list[int]:
    """Validate the state file at ``path`` against ``cache`` (an empty :class:`minirt.kv_cache.KVCache`
    of the model) and fill the cache with it; returns the token ids. ``check_header(header)``
    raises :class:`StateError` when the header belongs to another model or version."""
    name = os.fspath(path)
    n_layer, n_head_kv = cache.k.shape[:2]
    dk, dv = cache.head_dim_k, cache.head_dim_v
    tok_dtype = cache.tokens.dtype
    # the largest state of this model: a full context in float32, whatever types the file holds
    per_token = n_layer * n_head_kv * (dk + dv) * 4 + tok_dtype.itemsize
    n_state = cache.state_size()
    max_size = cache.n_ctx * per_token + 4 * n_state + 5 * (NPY_HEADER_MAX + ZIP_SLACK) + 4 * MAX_HEADER_CHARS
    with _open_regular(name) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_size:
            raise StateError(f"{name}: {size} bytes is more than a state of this model can be "
                             f"({max_size} bytes for a full context of {cache.n_ctx} tokens)")
        _check_directory(name, fh, size)
        try:
            zf = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, struct.error) as e:
            raise StateError(f"{name}: not a minirt state file ({e})") from None
        with zf:
            infos = zf.infolist()
            names = sorted(i.filename for i in infos)
            rec = (STATE_MEMBER,) if n_state else ()
            if names not in (sorted(f"{m}.npy" for m in (*MEMBERS, *rec)),
                             sorted(f"{m}.npy" for m in (*MEMBERS, *rec, SCALE_MEMBER))):
                raise StateError(f"{name}: not a minirt state file for this model (members {names[:8]}, expected "
                                 f"{', '.join(MEMBERS + rec)} and optionally {SCALE_MEMBER})")
            member = {i.filename[:-4]: i for i in infos}

            hdr = _read_array(name, zf, member["header"], _header_ok, 4 * MAX_HEADER_CHARS)
            try:
                header = json.loads(str(hdr[()]))
            except (ValueError, RecursionError) as e:
                raise StateError(f"{name}: the header is not JSON ({e})") from None
            if not isinstance(header, dict):
                raise StateError(f"{name}: the header is not a JSON object")
            check_header(header)
            n = header.get("n_tokens")
            if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= cache.n_ctx:
                raise StateError(f"{name}: n_tokens {n!r} is not a token count in [1, {cache.n_ctx}] "
                                 f"(this model's context)")
            tk, tv = _file_types(name, header)
            try:
                want_k = (n_layer, n_head_kv, n, tk.width(dk))
                want_v = (n_layer, n_head_kv, n, tv.width(dv))
            except InvalidRequestError as e:
                raise StateError(f"{name}: {e}") from None

            tokens = _read_array(name, zf, member["tokens"], _exactly(tok_dtype, (n,)), n * tok_dtype.itemsize)
            if tokens.min() < 0 or tokens.max() >= n_vocab:
                raise StateError(f"{name}: token ids out of range [0, {n_vocab}) "
                                 f"(min {tokens.min()}, max {tokens.max()})")
            k = _read_array(name, zf, member["k"], _exactly(tk.dtype, want_k),
                            int(np.prod(want_k)) * tk.dtype.itemsize)
            v = _read_array(name, zf, member["v"], _exactly(tv.dtype, want_v),
                            int(np.prod(want_v)) * tv.dtype.itemsize)
            has_scales = header.get("kv_key_scales", False)
            if not isinstance(has_scales, bool) or has_scales != (SCALE_MEMBER in member):
                raise StateError(f"{name}: kv_key_scales {str(has_scales)[:40]!r} does not match the members "
                                 f"({'with' if SCALE_MEMBER in member else 'without'} {SCALE_MEMBER})")
            file_scales = None
            if has_scales:
                want_s = (n_layer, n_head_kv, dk)
                e = _read_array(name, zf, member[SCALE_MEMBER], _exactly(np.dtype(np.int8), want_s),
                                int(np.prod(want_s)))
                file_scales = _scales_of(name, cache, e)
            rstate = None
            if header.get("recurrent", False) is not bool(n_state):
                raise StateError(f"{name}: recurrent {str(header.get('recurrent'))[:40]!r} does not match this "
                                 f"model ({'with' if n_state else 'without'} recurrent layers)")
            if n_state:
                rstate = _read_array(name, zf, member[STATE_MEMBER], _exactly(np.dtype(np.float32), (n_state,)),
                                     4 * n_state)
                _finite(name, STATE_MEMBER, rstate)
    basis = header.get("kv_basis", 0)
    if basis not in (0, 1) or isinstance(basis, bool):
        raise StateError(f"{name}: unknown kv_basis {str(basis)[:40]!r} (expected 0 or 1)")
    if (tk.name, tv.name) == cache.types and bool(basis) == cache.transformed \
            and _same_scales(file_scales, cache.key_scales):
        _finite(name, "k", k if not tk.quantized else dequantize_rows(k, tk))
        _finite(name, "v", v if not tv.quantized else dequantize_rows(v, tv))
        cache.import_rows(k, v, n)
    else:  # saved with other cache types (or rotation): converted (through float32) to this model's
        log.info("%s: converting a %s/%s KV state (basis %d) to %s/%s", name, tk.name, tv.name, basis, *cache.types)
        kf, vf = dequantize_rows(k, tk), dequantize_rows(v, tv)
        _finite(name, "k", kf)
        _finite(name, "v", vf)
        cache.import_rows(kf, vf, n, float_rows=True, stored_as=(tk, tv) if basis else None,
                          stored_scales=file_scales if basis else None)
    cache.tokens[:n] = tokens
    cache.n_past = n
    if rstate is not None:
        cache.import_state(rstate, n)
    return tokens.tolist()


def scale_exponents(cache: Any) -> np.ndarray | None:
    """The ``kscale`` member of a state of ``cache``: (n_layer, n_head_kv, head_dim_k) int8 base-2
    exponents of its key scales (:func:`minirt.kv_balance.to_exponents`), or None when it has none."""
    from .kv_balance import to_exponents

    sc = cache.key_scales
    return None if sc is None else to_exponents(sc, cache.k.shape[1], cache.head_dim_k)


def _scales_of(name: str, cache: Any, e: np.ndarray) -> tuple[np.ndarray | None, ...]:
    """Per layer the key scales a state file's exponents ``e`` give, in the layer's own shape."""
    from .kv_balance import MAX_LOG2, from_exponents

    layers = cache.layers if cache.layers is not None else [(e.shape[1], cache.head_dim_k, 0)] * cache.n_layer
    out = from_exponents(e, [None if s is None else (s[0], s[1]) for s in layers])
    if out is None:
        raise StateError(f"{name}: key scale exponents outside [-{MAX_LOG2}, {MAX_LOG2}]")
    return out


def _same_scales(a: Sequence[np.ndarray | None] | None, b: Sequence[np.ndarray | None] | None) -> bool:
    """Whether two per-layer key scale lists store keys alike (a layer without scales = scales of 1)."""
    if a is None and b is None:
        return True
    n = len(a if a is not None else b)
    for i in range(n):
        x = None if a is None else a[i]
        y = None if b is None else b[i]
        if x is None and y is None:
            continue
        x = np.ones_like(y) if x is None else x
        y = np.ones_like(x) if y is None else y
        if x.shape != y.shape or not np.array_equal(x, y):
            return False
    return True


def _file_types(name: str, header: dict[str, Any]) -> tuple[Any, Any]:
    """The KV element types the file holds (its header's ``cache_type_k`` / ``cache_type_v``;
    files written before those fields hold float32, or float16 where ``kv_dtype`` says so)."""
    legacy = "f16" if header.get("kv_dtype") == "float16" else "f32"
    try:
        return (kv_types.get(str(header.get("cache_type_k", legacy))[:16]),
                kv_types.get(str(header.get("cache_type_v", legacy))[:16]))
    except InvalidRequestError as e:
        raise StateError(f"{name}: {e}") from None


def _open_regular(name: str) -> Any:
    """Open ``name`` for reading without blocking (a FIFO with no writer would block ``open``
    forever) and refuse anything but a regular file."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags)
    except OSError as e:
        raise StateError(f"{name}: cannot open the state file ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket"
                    if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise StateError(f"{name}: is {kind}, not a state file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_directory(name: str, fh: Any, size: int) -> None:
    """The archive's end record must announce a handful of members and a small central directory
    (``zipfile`` would otherwise parse millions of entries before any other check)."""
    tail = min(size, 22 + (1 << 16))
    fh.seek(size - tail)
    data = fh.read(tail)
    at = data.rfind(_EOCD)
    if at < 0 or len(data) - at < 22:
        raise StateError(f"{name}: not a minirt state file (no zip end record)")
    entries, cd_size = struct.unpack("<xxxxxxxxxxHI", data[at:at + 16])
    if entries > 2 * len(MEMBERS) or cd_size > ZIP_SLACK:
        raise StateError(f"{name}: not a minirt state file ({entries} members, central directory of {cd_size} bytes)")
    fh.seek(0)


def _header_ok(dtype: np.dtype, shape: tuple[int, ...]) -> str | None:
    if dtype.kind != "U" or shape != () or dtype.itemsize > 4 * MAX_HEADER_CHARS:
        return f"the header must be one JSON string of at most {MAX_HEADER_CHARS} characters, got {dtype} {shape}"
    return None


def _exactly(dtype: np.dtype, shape: tuple[int, ...]) -> Callable[[np.dtype, tuple[int, ...]], str | None]:
    def check(got_dtype: np.dtype, got_shape: tuple[int, ...]) -> str | None:
        if got_dtype != dtype:
            return f"dtype {got_dtype.str} where this model's cache holds {dtype.str}"
        if tuple(got_shape) != shape:
            return f"shape {tuple(got_shape)} where this model needs {shape}"
        return None
    return check


def _read_array(name: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo,
                check: Callable[[np.dtype, tuple[int, ...]], str | None], max_data: int) -> np.ndarray:
    """One npy member: sizes checked before decompressing, data read with bounded decompression."""
    what = info.filename[:-4]
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise StateError(f"{name}: member {what!r} uses compression method {info.compress_type} "
                         "(only stored or deflated)")
    if info.flag_bits & 0x1:
        raise StateError(f"{name}: member {what!r} is encrypted")
    if info.file_size > max_data + NPY_HEADER_MAX + 128:
        raise StateError(f"{name}: member {what!r} declares {info.file_size} bytes, more than this model's "
                         f"state can hold ({max_data} bytes of data)")
    try:
        with zf.open(info) as m:
            version = np.lib.format.read_magic(m)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(m, max_header_size=NPY_HEADER_MAX)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(m, max_header_size=NPY_HEADER_MAX)
            else:
                raise StateError(f"{name}: member {what!r} has npy format version {version}")
            problem = check(dtype, shape)
            if problem is not None:
                raise StateError(f"{name}: member {what!r} has {problem}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if nbytes > max_data:
                raise StateError(f"{name}: member {what!r} holds {nbytes} bytes, more than {max_data}")
            header_len = m.tell()
            if info.file_size != header_len + nbytes:
                raise StateError(f"{name}: member {what!r} declares {info.file_size} bytes but its array "
                                 f"needs {header_len + nbytes}")
            buf = m.read(nbytes)  # ZipExtFile decompresses at most what is asked for
            if len(buf) != nbytes:
                raise StateError(f"{name}: member {what!r} is truncated ({len(buf)} of {nbytes} bytes)")
            if m.read(1):  # at the end: this read also verifies the CRC
                raise StateError(f"{name}: member {what!r} holds more data than its array")
    except StateError:
        raise
    except (zipfile.BadZipFile, zlib.error, OSError, ValueError, EOFError, NotImplementedError, RuntimeError,
            SyntaxError, TypeError, KeyError, struct.error, OverflowError, MemoryError) as e:
        raise StateError(f"{name}: member {what!r} is corrupt ({type(e).__name__}: {e})") from None
    order = "F" if fortran and len(shape) > 1 else "C"
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)


def _finite(name: str, what: str, a: np.ndarray) -> None:
    if a.dtype.kind in "fc" and not np.isfinite(a).all():
        raise StateError(f"{name}: member {what!r} holds NaN or infinite values")


__all__ = ["read_state"]
