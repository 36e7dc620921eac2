"""GGUF reader over ``mmap`` (GGUF v2 and v3, little-endian).

``minirt.gguf.open(path)`` parses the header, the metadata and the tensor table, and validates
every count, length, type id, dimension and offset against the file size before it is used, so a
malformed file raises :class:`minirt.GGUFError` naming the field and its byte offset instead of
crashing, hanging or allocating more than the file holds. Tensor data is never read at open time:
``tensor.data`` is a zero-copy ``numpy`` view of the mapped bytes.

Layout (all little-endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv      × (string key, u32 value_type, value)
    n_tensors × (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32)
    tensor data (each tensor at data_start + offset, offsets aligned)

where ``string`` is ``u64 length`` + UTF-8 bytes and ``ne[0]`` is the fastest-moving dimension
(numpy order is the reverse: ``shape = ne[::-1]``).

Cost bound: every count is checked against the bytes left before its loop runs, and against the
limits below, so parsing time and memory are linear in the file size and capped in absolute terms
whatever the file holds. Arrays of numbers are one numpy array each (a single copy out of the
mapping: as many bytes as the file holds); the Python objects are one per key, per tensor, per string
and per nested array, and those are what the limits cap (each costs ~50-200 bytes of Python memory
against 8-32 bytes of file). Real models stay far below them (about 50 keys, 300-3000 tensors,
150k-300k vocabulary strings plus as many merges, no nested arrays); a file over a limit raises
:class:`GGUFError` naming it before the work.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import GGUFError
from .quants.types import GGML_TYPES, GGMLType

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4  # arrays of arrays are legal; a bound keeps recursion finite
MAX_KV = 1 << 16  # metadata keys per file
MAX_TENSORS = 1 << 16  # tensors per file (a large MoE model has a few thousand)
MAX_KEY_BYTES = 1 << 16  # one metadata key
MAX_TENSOR_NAME_BYTES = 1 << 10  # one tensor name (ggml itself allows 63)
MAX_STRING_BYTES = 64 << 20  # one string value (chat templates are 1-100 KB)
MAX_STRINGS = 1 << 22  # strings in all string arrays together (vocabulary + merges)
MAX_NESTED_ARRAYS = 1 << 16  # arrays inside arrays, all of them together

# GGUF value types: id -> (name, numpy dtype or None for string/array)
_VT_UINT8, _VT_INT8, _VT_UINT16, _VT_INT16, _VT_UINT32, _VT_INT32 = 0, 1, 2, 3, 4, 5
_VT_FLOAT32, _VT_BOOL, _VT_STRING, _VT_ARRAY, _VT_UINT64, _VT_INT64, _VT_FLOAT64 = 6, 7, 8, 9, 10, 11, 12
_SCALAR_DTYPES: dict[int, np.dtype] = {
    _VT_UINT8: np.dtype("<u1"),
    _VT_INT8: np.dtype("<i1"),
    _VT_UINT16: np.dtype("<u2"),
    _VT_INT16: np.dtype("<i2"),
    _VT_UINT32: np.dtype("<u4"),
    _VT_INT32: np.dtype("<i4"),
    _VT_FLOAT32: np.dtype("<f4"),
    _VT_BOOL: np.dtype("<u1"),
    _VT_UINT64: np.dtype("<u8"),
    _VT_INT64: np.dtype("<i8"),
    _VT_FLOAT64: np.dtype("<f8"),
}
# Explicit struct codes: numpy's dtype.char for 64-bit ints is the platform "l"/"L", which
# struct's standard ("<") sizes read as 4 bytes.
_STRUCT = {vt: struct.Struct("<" + c) for vt, c in {
    _VT_UINT8: "B", _VT_INT8: "b", _VT_UINT16: "H", _VT_INT16: "h", _VT_UINT32: "I", _VT_INT32: "i",
    _VT_FLOAT32: "f", _VT_BOOL: "B", _VT_UINT64: "Q", _VT_INT64: "q", _VT_FLOAT64: "d"}.items()}
assert all(_STRUCT[vt].size == dt.itemsize for vt, dt in _SCALAR_DTYPES.items())
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
VALUE_TYPE_NAMES = {
    0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32",
    7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64",
}


def _q(s: str, limit: int = 64) -> str:
    """``repr`` of a key or tensor name for messages, cut short: a hostile name can be file-sized."""
    return repr(s) if len(s) <= limit else f"{s[:limit]!r}...({len(s)} chars)"


@dataclass(eq=False, slots=True)  # slots: one tensor costs ~4x its table entry, not ~8x
class GGUFTensor:
    """One tensor of a GGUF file: its type, its shape in numpy order and its raw mapped bytes."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]  # numpy order: (..., rows, cols); cols = ne[0]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    _file: GGUFFile = field(repr=False)

    @property
    def qtype(self) -> str:
        """ggml type name, e.g. ``"Q4_K"``."""
        return self.type.name

    @property
    def n_elements(self) -> int:
        """Number of scalar elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last numpy dimension)."""
        return self.type.row_bytes(self.shape[-1])

    @property
    def data(self) -> np.ndarray:
        """Raw bytes, zero-copy and read-only: uint8 array of shape ``(*shape[:-1], row_bytes)``."""
        mm = self._file._require_open()
        arr = np.frombuffer(mm, dtype=np.uint8, count=self.nbytes, offset=self.offset)
        return arr.reshape(self.shape[:-1] + (self.row_bytes,))

    def dequantize(self) -> np.ndarray:
        """Float32 array of ``shape`` (same values as ``gguf.quants.dequantize``)."""
        from .quants import dequantize

        return dequantize(self.data, self.qtype, self.shape)


class GGUFFile:
    """A parsed, memory-mapped GGUF file. Use :func:`open`; close it (or use ``with``) when done."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, str] = {}  # key -> GGUF value type name ("STRING", "ARRAY[UINT32]" ...)
        self.tensors: dict[str, GGUFTensor] = {}
        self.version = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        self._mm: mmap.mmap | None = None
        self._fd = -1
        # (fd, bytes needed, what, error type) of each mapped file whose truncation check_intact() detects
        self._watched: list[tuple[int, int, str, type[Exception]]] = []
        try:
            # A FIFO or device would block or never end: only regular files are mapped.
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                raise GGUFError(f"{self.path}: not a regular file")
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as e:
            raise GGUFError(f"cannot open GGUF file {self.path!r}: {e.strerror}") from e
        try:
            self.file_size = os.fstat(fd).st_size
            if self.file_size == 0:
                raise GGUFError(f"{self.path}: header at byte 0: file is empty")
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as e:
            os.close(fd)
            raise GGUFError(f"cannot map GGUF file {self.path!r}: {e}") from e
        self._fd = fd  # kept open for check_intact(): one fstat per step
        try:
            _Parser(self, self._mm).parse()
        except BaseException:
            self.close()
            raise
        self._watched.append((fd, self.file_size, f"GGUF file {self.path}", GGUFError))

    def check_intact(self) -> None:
        """Raise (:class:`GGUFError` for this file) when a mapped file was truncated since it was
        opened: reading its pages past the new end would kill the process with SIGBUS.

        One ``fstat`` per file, called before each forward pass. It narrows the window, it cannot
        close it: a truncation during a pass still ends the process (a guard inside the kernels would
        need a SIGBUS handler in C). Keep model files read-only while they are loaded."""
        for fd, need, what, error in self._watched:
            try:
                size = os.fstat(fd).st_size
            except OSError as e:
                raise error(f"{what}: cannot check it ({e.strerror}); reload the model") from None
            if size < need:
                raise error(f"{what} was truncated while in use ({size} bytes, {need} mapped); reload the model")

    # -- lifecycle ---------------------------------------------------------------------------
    def _require_open(self) -> mmap.mmap:
        if self._mm is None or self._mm.closed:
            raise GGUFError(f"{self.path}: file is closed")
        return self._mm

    @property
    def closed(self) -> bool:
        """True once :meth:`close` released the mapping."""
        return self._mm is None

    def close(self) -> None:
        """Release the mapping. Arrays still viewing it keep it alive until they are dropped."""
        mm, self._mm = self._mm, None
        watched, self._watched = self._watched, []
        fds = {w[0] for w in watched} | ({self._fd} if self._fd >= 0 else set())
        self._fd = -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # numpy views of tensor data are still alive; the mapping is freed with them.
                log.debug("%s: mapping still referenced by tensor views; freed when they are", self.path)

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0 or getattr(self, "_watched", None):
            self.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- convenience -------------------------------------------------------------------------
    @property
    def architecture(self) -> str | None:
        """``general.architecture`` or None."""
        v = self.metadata.get("general.architecture")
        return v if isinstance(v, str) else None

    def get(self, key: str, default: Any = None) -> Any:
        """``metadata.get(key, default)``."""
        return self.metadata.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """Metadata value ``<architecture>.<suffix>``, e.g. ``arch_get("block_count")``."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def __iter__(self) -> Iterator[GGUFTensor]:
        return iter(self.tensors.values())

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


class _Parser:
    """Single forward pass over the header with bounds checked before every read."""

    def __init__(self, f: GGUFFile, buf: mmap.mmap) -> None:
        self.f = f
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.n_strings = 0  # strings of string arrays so far (MAX_STRINGS)
        self.n_nested = 0  # arrays inside arrays so far (MAX_NESTED_ARRAYS)

    # -- primitives --------------------------------------------------------------------------
    def fail(self, what: str, at: int, msg: str) -> GGUFError:
        return GGUFError(f"{self.f.path}: {what} at byte {at}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(what, self.pos, f"truncated: needs {n} bytes, file has {self.size - self.pos} left")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, limit_name: str = "MAX_STRING_BYTES") -> str:
        limit = globals()[limit_name]  # looked up per call: the limits are module settings
        start = self.pos
        n = self.u64(what + " length")
        if n > self.size - self.pos:
            raise self.fail(what, start, f"string length {n} exceeds the {self.size - self.pos} bytes left")
        if n > limit:
            raise self.fail(what, start, f"string length {n} exceeds the limit of {limit} bytes (gguf.{limit_name})")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return self.decode(b, what, start)

    def decode(self, b: bytes, what: str, at: int) -> str:
        """Strict UTF-8, as the format requires (and gguf-py reads): invalid bytes would surface
        much later as encode errors in the tokenizer or the server, so they are refused here."""
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(what, at, f"string is not valid UTF-8 ({e.reason} at byte {e.start} "
                            "of the string)") from None

    # -- structure ---------------------------------------------------------------------------
    def parse(self) -> None:
        f = self.f
        self.need(4, "magic")
        magic = self.buf[0:4]
        if magic != GGUF_MAGIC:
            hint = " (big-endian GGUF is not supported)" if magic == GGUF_MAGIC[::-1] else ""
            raise self.fail("magic", 0, f"expected b'GGUF', found {magic!r}{hint}")
        self.pos = 4
        version = self.u32("version")
        if version not in SUPPORTED_VERSIONS:
            hint = " (looks big-endian)" if (version & 0xFFFF) == 0 and version else ""
            raise self.fail("version", 4, f"unsupported GGUF version {version}{hint}; supported: 2, 3")
        f.version = version
        n_tensors = self.u64("tensor_count")
        n_kv = self.u64("metadata_kv_count")
        # Counts are checked against the bytes that follow before any loop runs, so a corrupt
        # count fails here naming the count (a tensor info takes >= 32 bytes: name length 8,
        # n_dims 4, one dim 8, type 4, offset 8; a key/value >= 13: key length 8, type 4, 1 byte).
        left = self.size - self.pos
        if n_tensors * 32 > left:
            raise self.fail("tensor_count", 8, f"{n_tensors} tensor infos need at least {n_tensors * 32} bytes, "
                            f"only {left} follow the header (corrupt count or truncated file)")
        if n_kv * 13 > left:
            raise self.fail("metadata_kv_count", 16, f"{n_kv} key/values need at least {n_kv * 13} bytes, "
                            f"only {left} follow the header (corrupt count or truncated file)")
        if n_tensors > MAX_TENSORS:
            raise self.fail("tensor_count", 8,
                            f"{n_tensors} tensors exceed the limit of {MAX_TENSORS} (gguf.MAX_TENSORS)")
        if n_kv > MAX_KV:
            raise self.fail("metadata_kv_count", 16, f"{n_kv} key/values exceed the limit of {MAX_KV} (gguf.MAX_KV)")

        md, mtypes = f.metadata, f.metadata_types
        value_at: dict[str, int] = {}  # key -> byte offset of its value, for later error messages (alignment)
        for i in range(n_kv):
            kat = self.pos
            key = self.string(f"metadata[{i}].key", "MAX_KEY_BYTES")
            if key in md:
                raise self.fail(f"metadata key {_q(key)}", kat, "duplicate key")
            label = f"metadata[{_q(key)}]"
            tat = self.pos
            vt = self.u32(label + ".type")
            if key == "general.alignment":
                value_at[key] = self.pos
            md[key], mtypes[key] = self.value(vt, label, tat, 0)

        align = md.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in md:
            # Same rule as ggml: a non-zero power of two stored as UINT32.
            if mtypes["general.alignment"] != "UINT32" or align <= 0 or align & (align - 1):
                raise self.fail("metadata['general.alignment']", value_at["general.alignment"],
                                f"invalid alignment {repr(align)[:64]} of type {mtypes['general.alignment']} "
                                "(a non-zero power of two UINT32 is required)")
        f.alignment = int(align)

        infos = []  # (tensor, byte offset of its offset field); offsets made absolute below
        tensors = f.tensors
        for i in range(n_tensors):
            nat = self.pos
            name = self.string(f"tensor[{i}].name", "MAX_TENSOR_NAME_BYTES")
            if name in tensors:
                raise self.fail(f"tensor name {_q(name)}", nat, "duplicate tensor name")
            tn = f"tensor {_q(name)}"
            dat = self.pos
            n_dims = self.u32(tn + " n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.fail(tn + " n_dims", dat, f"{n_dims} dimensions (1..{MAX_DIMS} allowed)")
            self.need(8 * n_dims, tn + " dims")
            ne = list(struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos))
            self.pos += 8 * n_dims
            n_el = 1
            for d in ne:
                n_el *= d
            if any(d >= 1 << 62 for d in ne) or n_el >= 1 << 62:
                raise self.fail(tn + " dims", dat + 4, f"dimensions {ne} overflow")
            tat = self.pos
            tid = self.u32(tn + " type")
            gt = GGML_TYPES.get(tid)
            if gt is None:
                raise self.fail(tn + " type", tat, f"unknown ggml type id {tid}")
            if ne[0] % gt.block_size:
                raise self.fail(tn + " dims", dat + 4,
                                f"row length {ne[0]} is not a multiple of the {gt.name} block size {gt.block_size}")
            oat = self.pos
            off = self.u64(tn + " offset")
            if off % f.alignment:
                raise self.fail(tn + " offset", oat, f"offset {off} not aligned to {f.alignment}")
            t = GGUFTensor(name, gt, tuple(reversed(ne)), off, n_el // gt.block_size * gt.type_size, f)
            tensors[name] = t
            infos.append((t, oat))

        data_start = -(-self.pos // f.alignment) * f.alignment
        if n_tensors and data_start > self.size:
            raise self.fail("tensor data", self.pos, "file ends before the aligned start of tensor data")
        f.data_offset = data_start
        avail = self.size - data_start
        for t, oat in infos:
            off, nbytes = t.offset, t.nbytes
            if off > avail or nbytes > avail - off:
                raise self.fail(f"tensor {_q(t.name)} data", oat,
                                f"{nbytes} bytes ({t.type.name} {list(t.shape)}) at file offset {data_start + off} "
                                f"run past the end of the {self.size}-byte file")
            t.offset = data_start + off
        del infos
        # The format allows any aligned, non-overlapping layout, so dims that claim more bytes
        # than a tensor's slot show up as it running into the next tensor.
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in f.tensors.values() if t.nbytes)
        for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
            if e0 > s1:
                raise self.fail(f"tensor {_q(n0)} data", s0,
                                f"{e0 - s0} bytes implied by its shape overlap tensor {_q(n1)} at byte {s1}")
        # ggml itself (llama.cpp) also requires the tensors back to back in table order, each
        # padded to the alignment; a file with gaps opens here but would not load there.
        expect = 0
        for t in f.tensors.values():
            if t.offset - data_start != expect:
                log.warning("%s: tensor %s starts at data offset %d, ggml expects %d (gaps or reordering "
                            "between tensors; llama.cpp would refuse this file)", f.path, _q(t.name),
                            t.offset - data_start, expect)
                break
            expect += -(-t.nbytes // f.alignment) * f.alignment

    def value(self, vt: int, what: str, at: int, depth: int) -> tuple[Any, str]:
        """Read one value of GGUF type ``vt``; returns (python value, type name)."""
        st = _STRUCT.get(vt)
        if st is not None:
            self.need(st.size, what)
            (v,) = st.unpack_from(self.buf, self.pos)
            self.pos += st.size
            if vt == _VT_BOOL:
                v = bool(v)
            return v, VALUE_TYPE_NAMES[vt]
        if vt == _VT_STRING:
            return self.string(what), "STRING"
        if vt == _VT_ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(what, at, f"arrays nested deeper than {MAX_ARRAY_DEPTH}")
            eat = self.pos
            et = self.u32(what + " element type")
            cat = self.pos
            n = self.u64(what + " count")
            left = self.size - self.pos
            dt = _SCALAR_DTYPES.get(et)
            if dt is not None:
                if n > left // dt.itemsize:
                    raise self.fail(what + " count", cat,
                                    f"{n} {VALUE_TYPE_NAMES[et]} elements exceed the {left} bytes left")
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).copy()
                self.pos += n * dt.itemsize
                if et == _VT_BOOL:
                    arr = arr.astype(bool)
                return arr, f"ARRAY[{VALUE_TYPE_NAMES[et]}]"
            if et == _VT_STRING:
                if n > left // 8:
                    raise self.fail(what + " count", cat, f"{n} strings exceed the {left} bytes left")
                self.n_strings += n
                if self.n_strings > MAX_STRINGS:
                    raise self.fail(what + " count", cat, f"{n} strings bring the file's string arrays to "
                                    f"{self.n_strings} strings, over the limit of {MAX_STRINGS} (gguf.MAX_STRINGS)")
                return self.string_array(n, what), "ARRAY[STRING]"
            if et == _VT_ARRAY:
                if n > left // 12:
                    raise self.fail(what + " count", cat, f"{n} arrays exceed the {left} bytes left")
                self.n_nested += n
                if self.n_nested > MAX_NESTED_ARRAYS:
                    raise self.fail(what + " count", cat, f"{n} arrays bring the file's nested arrays to "
                                    f"{self.n_nested}, over the limit of {MAX_NESTED_ARRAYS} (gguf.MAX_NESTED_ARRAYS)")
                items, sub = [], "ARRAY[?]"
                for i in range(n):
                    # each element is itself an array value: (u32 element type, u64 count, elements)
                    v, sub = self.value(_VT_ARRAY, f"{what}[{i}]", self.pos, depth + 1)
                    items.append(v)
                return items, f"ARRAY[{sub}]"
            raise self.fail(what + " element type", eat, f"unknown value type {et}")
        raise self.fail(what + " type", at, f"unknown value type {vt}")

    def string_array(self, n: int, what: str) -> list[str]:
        """``n`` length-prefixed strings: the hot loop of opening a vocabulary (150k-262k entries).

        The fast path trusts each length and checks the end position once after the loop:
        positions only grow, so an overrun anywhere either leaves the end past the file or makes
        a later length read fail; mmap slices past the end are merely short, and each overrun
        slice is bounded by the file. Any doubt (an overrun, invalid UTF-8, an over-long string) re-reads
        the array with :meth:`_string_array_checked`, which names the offending element and its offset.
        """
        buf, pos = self.buf, self.pos
        unpack = _U64.unpack_from
        out: list[str] = [""] * n  # n <= bytes left // 8: never more slots than the file holds
        try:
            for i in range(n):
                (ln,) = unpack(buf, pos)
                if ln > MAX_STRING_BYTES:
                    raise OverflowError
                pos += 8
                end = pos + ln
                out[i] = buf[pos:end].decode()  # strict UTF-8, the fastest decode call
                pos = end
        except (struct.error, OverflowError, UnicodeDecodeError):
            pos = -1
        if 0 <= pos <= self.size:
            self.pos = pos
            return out
        del out
        return self._string_array_checked(n, what)

    def _string_array_checked(self, n: int, what: str) -> list[str]:
        """Slow path of :meth:`string_array`: bound, limit and UTF-8 check per element."""
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out: list[str] = [""] * n
        for i in range(n):
            if pos + 8 > size:
                raise self.fail(f"{what}[{i}] length", pos, f"truncated: needs 8 bytes, file has {size - pos} left")
            (ln,) = unpack(buf, pos)
            pos += 8
            end = pos + ln
            if end > size:
                raise self.fail(f"{what}[{i}]", pos - 8,
                                f"string length {ln} exceeds the {size - pos} bytes left")
            if ln > MAX_STRING_BYTES:
                raise self.fail(f"{what}[{i}]", pos - 8, f"string length {ln} exceeds the limit of "
                                f"{MAX_STRING_BYTES} bytes (gguf.MAX_STRING_BYTES)")
            out[i] = self.decode(buf[pos:end], f"{what}[{i}]", pos - 8)
            pos = end
        self.pos = pos
        return out


def open(path: str | os.PathLike[str]) -> GGUFFile:  # noqa: A001 - public name from the design contract
    """Open and validate a GGUF file; raises :class:`minirt.GGUFError` if it is malformed."""
    return GGUFFile(path)


__all__ = ["open", "GGUFFile", "GGUFTensor", "GGUFError"]
