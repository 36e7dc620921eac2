"""GGUF reader: round trips against gguf-py's writer and reader, crafted malformed files, real models.

``Craft`` writes GGUF bytes field by field and records where every field starts, so a test can
break one field on purpose and check that the error names that field and its byte offset. Its
output is checked byte for byte against ``gguf.GGUFWriter`` so the crafted layout is the real one.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import minirt
from minirt import gguf as mgguf
from minirt.quants.types import GGML_TYPES, GGML_TYPES_BY_NAME

gguf = pytest.importorskip("gguf", reason="gguf-py (GGUFWriter / GGUFReader) is the reference for these tests")
VT = gguf.GGUFValueType

# struct format of each scalar GGUF value type
_FMT = {VT.UINT8: "B", VT.INT8: "b", VT.UINT16: "H", VT.INT16: "h", VT.UINT32: "I", VT.INT32: "i",
        VT.FLOAT32: "f", VT.BOOL: "?", VT.UINT64: "Q", VT.INT64: "q", VT.FLOAT64: "d"}
_NP = {VT.UINT8: np.uint8, VT.INT8: np.int8, VT.UINT16: np.uint16, VT.INT16: np.int16, VT.UINT32: np.uint32,
       VT.INT32: np.int32, VT.FLOAT32: np.float32, VT.BOOL: np.bool_, VT.UINT64: np.uint64,
       VT.INT64: np.int64, VT.FLOAT64: np.float64}


# --------------------------------------------------------------------------------------------
# crafting
# --------------------------------------------------------------------------------------------
@dataclass
class Val:
    """A metadata value with its explicit GGUF type; ``sub`` is the element type of an ARRAY.

    Elements of a nested array are themselves ``Val(VT.ARRAY, [...], sub)``.
    """

    vt: int
    v: Any
    sub: int | None = None


@dataclass
class T:
    """A tensor to craft: ``ne`` in ggml order (fastest first), raw bytes, optional forced offset."""

    name: str
    ne: list[int]
    type_id: int
    data: bytes | None = None
    offset: int | None = None

    def nbytes(self) -> int:
        gt = GGML_TYPES.get(self.type_id)
        if gt is None:  # a type id crafted to be unknown: no data
            return 0
        n = 1
        for d in self.ne:
            n *= d
        return n // gt.block_size * gt.type_size


class Craft:
    """Serialise a GGUF exactly like GGUFWriter does, recording each field's byte offset.

    ``at[name]`` is where field ``name`` starts; ``ints`` lists every integer field written as
    (name, offset, width) so fuzzers can overwrite counts, lengths, type ids, dims and offsets.
    Field names: ``magic version tensor_count kv_count``; ``kv:K`` (key length), ``kv:K.type``,
    ``kv:K.value``, ``kv:K.etype``, ``kv:K.count``, ``kv:K[i]``; ``ti:N`` (name length),
    ``ti:N.n_dims``, ``ti:N.dims``, ``ti:N.type``, ``ti:N.offset``; ``data``, ``data:N``.
    """

    def __init__(self, kvs: list[tuple[str, Val]], tensors: list[T], version: int = 3, alignment: int = 32,
                 n_kv: int | None = None, n_tensors: int | None = None) -> None:
        self.b = bytearray()
        self.at: dict[str, int] = {}
        self.ints: list[tuple[str, int, int]] = []
        self.tensor_end = 0  # end of the last tensor's bytes (before final padding)
        self._mark("magic")
        self.b += b"GGUF"
        self._int("version", "I", version)
        self._int("tensor_count", "Q", len(tensors) if n_tensors is None else n_tensors)
        self._int("kv_count", "Q", len(kvs) if n_kv is None else n_kv)
        for key, val in kvs:
            self._string(f"kv:{key}", key)
            self._int(f"kv:{key}.type", "I", val.vt)
            self._value(f"kv:{key}", val)
        offset = 0
        offsets = []
        for t in tensors:
            self._string(f"ti:{t.name}", t.name)
            self._int(f"ti:{t.name}.n_dims", "I", len(t.ne))
            self._mark(f"ti:{t.name}.dims")
            for j, d in enumerate(t.ne):
                self._int(f"ti:{t.name}.dims[{j}]", "Q", d)
            self._int(f"ti:{t.name}.type", "I", t.type_id)
            off = offset if t.offset is None else t.offset
            self._int(f"ti:{t.name}.offset", "Q", off)
            offsets.append(off)
            offset += -(-t.nbytes() // alignment) * alignment
        self._pad(alignment)
        self._mark("data")
        data_start = len(self.b)
        for t, off in zip(tensors, offsets):
            data = t.data if t.data is not None else _bytes_for(t.name, t.nbytes())
            end = data_start + off + len(data)
            if len(self.b) < end:
                self.b += bytes(end - len(self.b))
            self.b[data_start + off:end] = data
            self.at[f"data:{t.name}"] = data_start + off
            self.tensor_end = max(self.tensor_end, end)
            self._pad(alignment)

    @property
    def bytes(self) -> bytes:
        return bytes(self.b)

    def _mark(self, name: str) -> None:
        self.at.setdefault(name, len(self.b))

    def _int(self, name: str, fmt: str, v: int) -> None:
        self._mark(name)
        self.ints.append((name, len(self.b), struct.calcsize(fmt)))
        self.b += struct.pack("<" + fmt, v)

    def _string(self, name: str, s: str | bytes) -> None:
        raw = s.encode("utf-8") if isinstance(s, str) else s
        self._int(name, "Q", len(raw))
        self.b += raw

    def _pad(self, alignment: int) -> None:
        self.b += bytes(-len(self.b) % alignment)

    def _value(self, name: str, val: Val) -> None:
        self._mark(name + ".value")
        if val.vt in _FMT:
            self.b += struct.pack("<" + _FMT[val.vt], val.v)
        elif val.vt == VT.STRING:
            self._string(name + ".str", val.v)
        elif val.vt == VT.ARRAY:
            self._int(name + ".etype", "I", val.sub)
            self._int(name + ".count", "Q", len(val.v))
            for i, item in enumerate(val.v):
                self._mark(f"{name}[{i}]")
                if val.sub == VT.ARRAY:
                    self._value(f"{name}[{i}]", item)  # item is a Val(ARRAY, ...) without its type tag
                elif val.sub == VT.STRING:
                    self._string(f"{name}[{i}]", item)
                else:
                    self.b += struct.pack("<" + _FMT[val.sub], item)
        else:  # an unknown type id: write 4 junk bytes as its "value"
            self.b += b"\0\0\0\0"


def _bytes_for(name: str, n: int) -> bytes:
    """Deterministic pseudo-random bytes for a tensor (seeded by its name)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def small_model(**kw: Any) -> Craft:
    """A small valid GGUF: a few keys (string array, number array) and three tensors."""
    kvs = [
        ("general.architecture", Val(VT.STRING, "llama")),
        ("llama.block_count", Val(VT.UINT32, 2)),
        ("llama.rope.freq_base", Val(VT.FLOAT32, 10000.0)),
        ("tokenizer.ggml.tokens", Val(VT.ARRAY, ["<s>", "</s>", "a", "", "▁the", "é", "🦙"], VT.STRING)),
        ("tokenizer.ggml.scores", Val(VT.ARRAY, [0.0, -1.0, -2.5, 3.0, 1e-3, 7.0, -7.0], VT.FLOAT32)),
    ]
    tensors = [T("token_embd.weight", [32, 7], 8), T("blk.0.attn_norm.weight", [32], 0),
               T("blk.0.ffn_down.weight", [256, 2], 12)]
    return Craft(kw.pop("kvs", kvs), kw.pop("tensors", tensors), **kw)


def write(tmp_path: Path, data: bytes, name: str = "f.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def expect_error(tmp_path: Path, data: bytes, field: str, at: int, also: str = "") -> str:
    """Open ``data``; require a GGUFError whose message names ``field`` and ``at byte {at}``."""
    p = write(tmp_path, data, "bad.gguf")
    with pytest.raises(minirt.GGUFError) as ei:
        mgguf.open(p)
    err, msg = ei.value, str(ei.value)
    assert isinstance(err, ValueError) and isinstance(err, minirt.MinirtError)
    assert field in msg, f"field {field!r} not named in: {msg}"
    assert f"at byte {at}:" in msg, f"offset {at} not named in: {msg}"
    assert also.lower() in msg.lower(), f"{also!r} not in: {msg}"
    return msg


def patch(data: bytes, at: int, fmt: str, v: int) -> bytes:
    b = bytearray(data)
    struct.pack_into("<" + fmt, b, at, v)
    return bytes(b)


# --------------------------------------------------------------------------------------------
# writer -> minirt / GGUFReader round trips
# --------------------------------------------------------------------------------------------
SCALARS: list[tuple[str, int, Any]] = [
    ("t.u8", VT.UINT8, 255), ("t.i8", VT.INT8, -128), ("t.u16", VT.UINT16, 65535), ("t.i16", VT.INT16, -32768),
    ("t.u32", VT.UINT32, 2**32 - 1), ("t.i32", VT.INT32, -(2**31)), ("t.f32", VT.FLOAT32, 0.1),
    ("t.bool_true", VT.BOOL, True), ("t.bool_false", VT.BOOL, False),
    ("t.u64", VT.UINT64, 2**64 - 1), ("t.i64", VT.INT64, -(2**63)), ("t.f64", VT.FLOAT64, 1 / 3),
    ("t.str", VT.STRING, "héllo wörld ✓ 🦙 \n\t\"q\""), ("t.str_empty", VT.STRING, ""),
]
ARRAYS: list[tuple[str, int, list]] = [
    ("a.u8", VT.UINT8, [0, 1, 255]), ("a.i8", VT.INT8, [-128, 0, 127]), ("a.u16", VT.UINT16, [0, 65535]),
    ("a.i16", VT.INT16, [-32768, 5]), ("a.u32", VT.UINT32, [2**32 - 1, 0, 7]), ("a.i32", VT.INT32, [-(2**31),
                                                                                                    2**31 - 1]),
    ("a.f32", VT.FLOAT32, [0.5, -1.25, 1e30, 3.14159]), ("a.bool", VT.BOOL, [True, False, True]),
    ("a.u64", VT.UINT64, [2**64 - 1, 0]), ("a.i64", VT.INT64, [-(2**63), 2**63 - 1]),
    ("a.f64", VT.FLOAT64, [1 / 3, -2.0**-1000]), ("a.str", VT.STRING, ["a", "", "ünïcödé", "🦙 llama", "x" * 300]),
]
NESTED: list[tuple[str, list, str]] = [
    ("n.int", [[1, 2, 3], [4], [5, 6]], "ARRAY[ARRAY[INT32]]"),
    ("n.str", [["a", "b"], ["ç"]], "ARRAY[ARRAY[STRING]]"),
    ("n.float", [[0.5], [1.5, 2.5]], "ARRAY[ARRAY[FLOAT32]]"),
]


def _expected_scalar(vt: int, v: Any) -> Any:
    return float(np.float32(v)) if vt == VT.FLOAT32 else v


def _write_all_types(path: Path, alignment: int | None = None, tensors: list | None = None) -> None:
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vt, v in SCALARS:
        w.add_key_value(key, v, vt)
    for key, vt, v in ARRAYS:
        w.add_key_value(key, v, VT.ARRAY, sub_type=vt)
    for key, v, _ in NESTED:
        w.add_array(key, v)
    for name, arr, raw in tensors or []:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reader_type_name(types: list) -> str:
    s = types[-1].name
    for t in reversed(types[:-1]):
        s = f"{t.name}[{s}]"
    return s


def _flatten(v: Any) -> Any:
    """The way GGUFReader.contents() presents arrays: nested arrays flattened to one list."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list) and v and isinstance(v[0], (list, np.ndarray)):
        return [x for e in v for x in _flatten(e)]
    return v


def compare_with_reader(path: Path, f: mgguf.GGUFFile) -> None:
    """Metadata values and types, tensor names, types, shapes, offsets and bytes equal GGUFReader's."""
    r = gguf.GGUFReader(str(path))
    fields = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(f.metadata)
    for key, field in fields.items():
        ours = f.metadata[key]
        assert _flatten(ours) == field.contents(), key
        assert f.metadata_types[key] == _reader_type_name(field.types), key
    assert [t.name for t in r.tensors] == list(f.tensors)
    assert f.data_offset == r.data_offset
    assert f.alignment == r.alignment
    for rt in r.tensors:
        t = f.tensors[rt.name]
        assert t.type.id == int(rt.tensor_type) and t.qtype == rt.tensor_type.name
        assert t.shape == tuple(reversed(rt.shape.tolist()))
        assert t.offset == rt.data_offset
        assert t.nbytes == rt.n_bytes
        assert t.n_elements == rt.n_elements
        ours_b, theirs_b = t.data.reshape(-1), rt.data.reshape(-1).view(np.uint8)
        if t.nbytes > (1 << 20):  # large real tensors: compare digests, no temporaries
            assert hashlib.sha256(ours_b).digest() == hashlib.sha256(theirs_b).digest(), rt.name
        else:
            assert np.array_equal(ours_b, theirs_b), rt.name


def test_every_value_type_matches_writer_and_reader(tmp_path):
    p = tmp_path / "types.gguf"
    _write_all_types(p)
    with mgguf.open(p) as f:
        assert f.version == 3 and f.tensors == {}
        md, ty = f.metadata, f.metadata_types
        assert md["general.architecture"] == "llama"
        for key, vt, v in SCALARS:
            exp = _expected_scalar(vt, v)
            assert md[key] == exp and type(md[key]) is type(exp), key
            assert ty[key] == VT(vt).name
        for key, vt, v in ARRAYS:
            if vt == VT.STRING:
                assert md[key] == v and isinstance(md[key], list)
            else:
                exp = np.array(v, dtype=_NP[vt])
                assert isinstance(md[key], np.ndarray) and md[key].dtype == exp.dtype, key
                np.testing.assert_array_equal(md[key], exp)
            assert ty[key] == f"ARRAY[{VT(vt).name}]"
        for key, v, tname in NESTED:
            got = md[key]
            assert len(got) == len(v) and ty[key] == tname
            for g, e in zip(got, v):
                if isinstance(e[0], str):
                    assert g == e
                else:
                    np.testing.assert_array_equal(g, np.array(e, dtype=np.float32 if isinstance(e[0],
                                                                                                float) else np.int32))
        compare_with_reader(p, f)


def test_craft_layout_is_gguf_writer_layout(tmp_path):
    """The crafting helper used by the malformed-file tests writes exactly what GGUFWriter writes."""
    p = tmp_path / "w.gguf"
    tensors = [("a", np.arange(12, dtype=np.float32).reshape(3, 4), None),
               ("b", np.frombuffer(_bytes_for("b", 2 * 34), np.uint8).reshape(2, 34), gguf.GGMLQuantizationType.Q8_0)]
    _write_all_types(p, alignment=64, tensors=tensors)
    kvs = [("general.architecture", Val(VT.STRING, "llama")), ("general.alignment", Val(VT.UINT32, 64))]
    kvs += [(k, Val(vt, v)) for k, vt, v in SCALARS]
    kvs += [(k, Val(VT.ARRAY, v, vt)) for k, vt, v in ARRAYS]
    for k, v, _ in NESTED:
        sub = VT.STRING if isinstance(v[0][0], str) else VT.FLOAT32 if isinstance(v[0][0], float) else VT.INT32
        kvs.append((k, Val(VT.ARRAY, [Val(VT.ARRAY, e, sub) for e in v], VT.ARRAY)))
    c = Craft(kvs, [T("a", [4, 3], 0, np.arange(12, dtype=np.float32).tobytes()),
                    T("b", [32, 2], 8, _bytes_for("b", 68))],
              alignment=64)
    assert c.bytes == p.read_bytes()


@pytest.mark.parametrize("alignment", [1, 8, 32, 64, 256, 4096])
def test_custom_alignment(tmp_path, alignment):
    p = tmp_path / "align.gguf"
    tensors = [("odd", np.arange(5, dtype=np.float32), None), ("odd2", np.arange(3, dtype=np.float16), None),
               ("q", np.frombuffer(_bytes_for("q", 34), np.uint8).reshape(1, 34), gguf.GGMLQuantizationType.Q8_0)]
    _write_all_types(p, alignment=alignment, tensors=tensors)
    with mgguf.open(p) as f:
        assert f.alignment == alignment and f.metadata["general.alignment"] == alignment
        assert f.data_offset % alignment == 0
        for t in f:
            assert (t.offset - f.data_offset) % alignment == 0
        compare_with_reader(p, f)


def test_version_2_and_3(tmp_path):
    c = small_model()
    p3 = write(tmp_path, c.bytes, "v3.gguf")
    p2 = write(tmp_path, patch(c.bytes, c.at["version"], "I", 2), "v2.gguf")
    with mgguf.open(p3) as f3, mgguf.open(p2) as f2:
        assert (f3.version, f2.version) == (3, 2)
        assert f2.metadata.keys() == f3.metadata.keys() and f2.metadata_types == f3.metadata_types
        assert f2.metadata["tokenizer.ggml.tokens"] == f3.metadata["tokenizer.ggml.tokens"]
        for t2, t3 in zip(f2, f3):
            assert (t2.name, t2.qtype, t2.shape, t2.offset) == (t3.name, t3.qtype, t3.shape, t3.offset)
            assert t2.data.tobytes() == t3.data.tobytes()
        compare_with_reader(p2, f2)  # GGUFReader also reads v2


# every type gguf-py knows, with odd shapes; quantized types get whole blocks per row
ALL_TYPES = [t for t in gguf.GGMLQuantizationType]


def _odd_shapes(bs: int) -> list[tuple[int, ...]]:
    if bs == 1:
        return [(7,), (3, 5), (2, 3, 7), (1, 1, 1, 3), (1,)]
    return [(bs,), (3, 2 * bs), (2, 1, bs), (1, 2, 3, bs)]


def test_ggml_type_table_matches_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES

    for t in ALL_TYPES:
        mt = GGML_TYPES[int(t)]
        assert (mt.name, mt.block_size, mt.type_size) == (t.name, *GGML_QUANT_SIZES[t])
    assert set(GGML_TYPES) == {int(t) for t in ALL_TYPES}


def test_many_types_odd_shapes_match_reader(tmp_path):
    from gguf.constants import GGML_QUANT_SIZES

    tensors, expect = [], {}
    for t in ALL_TYPES:
        bs, ts = GGML_QUANT_SIZES[t]
        for i, shape in enumerate(_odd_shapes(bs)):
            name = f"{t.name}.{i}"
            byte_shape = (*shape[:-1], shape[-1] // bs * ts)
            raw = np.frombuffer(_bytes_for(name, int(np.prod(byte_shape))), np.uint8).reshape(byte_shape)
            tensors.append((name, raw, t))
            expect[name] = (t.name, shape, raw)
    p = tmp_path / "types.gguf"
    _write_all_types(p, tensors=tensors)
    with mgguf.open(p) as f:
        assert len(f.tensors) == len(expect)
        for name, (qtype, shape, raw) in expect.items():
            t = f.tensors[name]
            assert t.qtype == qtype and t.shape == shape, name
            assert t.data.shape == raw.shape and t.row_bytes == raw.shape[-1]
            assert np.array_equal(t.data, raw), name
        compare_with_reader(p, f)


def test_low_bit_types_open(tmp_path):
    tensors = [T("iq", [256, 2], GGML_TYPES_BY_NAME["IQ2_XXS"].id), T("tq", [256], GGML_TYPES_BY_NAME["TQ1_0"].id),
               T("mx", [64], GGML_TYPES_BY_NAME["MXFP4"].id)]
    c = small_model(tensors=tensors)
    with mgguf.open(write(tmp_path, c.bytes)) as f:
        assert [t.qtype for t in f] == ["IQ2_XXS", "TQ1_0", "MXFP4"]
        assert f.tensors["iq"].data.tobytes() == c.b[c.at["data:iq"]:c.at["data:iq"] + 2 * 66]


def test_data_is_zero_copy_readonly_view(tmp_path):
    c = small_model()
    p = write(tmp_path, c.bytes)
    f = mgguf.open(p)
    base = np.frombuffer(f._mm, np.uint8)  # the mapping itself
    for t in f:
        d = t.data
        assert not d.flags.owndata and not d.flags.writeable
        assert np.shares_memory(d, base)
        assert d.ctypes.data == base.ctypes.data + t.offset
        assert d.tobytes() == c.bytes[c.at[f"data:{t.name}"]:c.at[f"data:{t.name}"] + t.nbytes]
        with pytest.raises(ValueError):
            d[..., 0] = 1
    held = f.tensors["token_embd.weight"].data
    del base
    tokens, scores = f.metadata["tokenizer.ggml.tokens"], f.metadata["tokenizer.ggml.scores"]
    f.close()  # a live view keeps the mapping valid; metadata arrays are copies
    assert f.closed
    assert held.tobytes() == c.bytes[c.at["data:token_embd.weight"]:][:held.nbytes]
    assert tokens[-1] == "🦙" and scores[2] == np.float32(-2.5)
    with pytest.raises(minirt.GGUFError, match="closed"):
        _ = f.tensors["token_embd.weight"].data


def _resident_fraction(path: Path, start: int, length: int) -> float:
    """Fraction of the pages of ``path[start:start+length]`` that sit in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            arr = np.frombuffer(mm, np.uint8)
            a0 = start // page * page
            npages = -(-(start + length - a0) // page)
            vec = (ctypes.c_ubyte * npages)()
            rc = libc.mincore(arr.ctypes.data + a0, npages * page, vec)
            assert rc == 0, os.strerror(ctypes.get_errno())
            del arr
            return sum(v & 1 for v in vec) / npages
        finally:
            mm.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page-cache residency (mincore) is checked on Linux")
def test_open_does_not_read_tensor_data(tmp_path):
    """A 64 MiB tensor stored as a sparse hole stays out of the page cache until .data is read."""
    p = tmp_path / "sparse.gguf"
    w = gguf.GGUFWriter(str(p), arch="llama")
    w.add_tensor_info("big", (4096, 4096), np.dtype(np.float32), 4096 * 4096 * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.write_padding(w.fout[0], w.fout[0].tell())
    w.close()
    data_start = p.stat().st_size
    os.truncate(p, data_start + 4096 * 4096 * 4)  # the data region is a hole: no page is cached yet
    n = 4096 * 4096 * 4
    with mgguf.open(p) as f:
        t = f.tensors["big"]
        assert (t.offset, t.nbytes, t.shape) == (data_start, n, (4096, 4096))
        before = _resident_fraction(p, data_start, n)
        d = t.data
        assert int(d[:, ::4096].sum()) == 0  # touch one byte per page: now it is read
        after = _resident_fraction(p, data_start, n)
        del d
    if after < 0.9:
        pytest.skip(f"this filesystem does not show reads of file holes in mincore ({after:.2f} resident after a read)")
    assert before < 0.05, f"{before:.1%} of the tensor data was read by open()"  # read-around near the header at most


# --------------------------------------------------------------------------------------------
# string decoding: fast path, checked path, invalid UTF-8
# --------------------------------------------------------------------------------------------
def test_invalid_utf8_strings_are_refused(tmp_path):
    """GGUF strings are UTF-8 (gguf-py reads them strictly too): invalid bytes in a value, an array
    element, a key or a tensor name raise GGUFError naming the field, not later in the tokenizer."""
    good = [b"ok", b"\xc3\xa9", b""]
    with mgguf.open(write(tmp_path, Craft([("v", Val(VT.ARRAY, good, VT.STRING))], []).bytes)) as f:
        assert f.metadata["v"] == ["ok", "é", ""]
    for bad in (b"\xff\xfe", b"caf\xc3", b"\x80tail", b"\xed\xa0\x80"):  # the last: an encoded surrogate
        with pytest.raises(minirt.GGUFError, match=r"metadata\['v'\]\[1\] at byte \d+: string is not valid UTF-8"):
            mgguf.open(write(tmp_path, Craft([("v", Val(VT.ARRAY, [b"ok", bad], VT.STRING))], []).bytes))
    with pytest.raises(minirt.GGUFError, match=r"metadata\['general.architecture'\] at byte \d+: string is not valid"):
        mgguf.open(write(tmp_path, Craft([("general.architecture", Val(VT.STRING, b"ll\xffama"))], []).bytes))


def test_string_array_fast_and_checked_paths_agree():
    hyp = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    texts = st.one_of(st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")), st.binary(max_size=300))

    @hyp.settings(max_examples=150, deadline=None)
    @hyp.given(st.lists(texts, max_size=60))
    def check(items: list[bytes]) -> None:
        blob = b"".join(struct.pack("<Q", len(x)) + x for x in items) + b"tail"
        buf = mmap.mmap(-1, len(blob))
        buf.write(blob)
        fake = mgguf.GGUFFile.__new__(mgguf.GGUFFile)
        fake.path = "<mem>"
        fast = mgguf._Parser(fake, buf)
        try:
            expect = [x.decode("utf-8") for x in items]
        except UnicodeDecodeError:
            expect = None
        slow = mgguf._Parser(fake, buf)
        if expect is None:  # both paths refuse invalid UTF-8, naming the element
            with pytest.raises(minirt.GGUFError, match="not valid UTF-8"):
                fast.string_array(len(items), "v")
            with pytest.raises(minirt.GGUFError, match="not valid UTF-8"):
                slow._string_array_checked(len(items), "v")
            return
        got = fast.string_array(len(items), "v")
        ref = slow._string_array_checked(len(items), "v")
        assert got == ref == expect
        assert fast.pos == slow.pos == len(blob) - 4

    check()


# --------------------------------------------------------------------------------------------
# malformed files: each names the field and its byte offset
# --------------------------------------------------------------------------------------------
def test_bad_magic(tmp_path):
    data = small_model().bytes
    expect_error(tmp_path, b"GGUX" + data[4:], "magic", 0, "expected b'GGUF'")
    expect_error(tmp_path, b"FUGG" + data[4:], "magic", 0, "big-endian")


@pytest.mark.parametrize("version", [0, 1, 4, 0x03000000])
def test_unsupported_version(tmp_path, version):
    c = small_model()
    msg = expect_error(tmp_path, patch(c.bytes, c.at["version"], "I", version), "version", 4, f"version {version}")
    assert ("big-endian" in msg) == (version == 0x03000000)


def test_empty_missing_and_non_regular(tmp_path):
    expect_error(tmp_path, b"", "header", 0, "empty")
    with pytest.raises(minirt.GGUFError, match="cannot open"):
        mgguf.open(tmp_path / "nope.gguf")
    with pytest.raises(minirt.GGUFError, match="not a regular file"):
        mgguf.open(tmp_path)
    if hasattr(os, "mkfifo"):  # opening a FIFO would block forever
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(minirt.GGUFError, match="not a regular file"):
            mgguf.open(tmp_path / "fifo")


def test_truncated_header(tmp_path):
    data = small_model().bytes
    expect_error(tmp_path, data[:2], "magic", 0, "truncated")
    expect_error(tmp_path, data[:6], "version", 4, "truncated")
    expect_error(tmp_path, data[:12], "tensor_count", 8, "truncated")
    expect_error(tmp_path, data[:20], "metadata_kv_count", 16, "truncated")
    expect_error(tmp_path, data[:24], "tensor_count", 8, "only 0 follow the header")


def test_truncated_metadata(tmp_path):
    c = small_model()
    d, at = c.bytes, c.at
    # (the header's counts promise 3 tensor infos, >= 96 bytes: an earlier cut fails on the count)
    expect_error(tmp_path, d[:72], "tensor_count", 8, "corrupt count or truncated file")
    tok = "tokenizer.ggml.tokens"  # metadata[3]
    expect_error(tmp_path, d[:at[f"kv:{tok}"] + 3], "metadata[3].key length", at[f"kv:{tok}"], "truncated")
    expect_error(tmp_path, d[:at[f"kv:{tok}"] + 10], "metadata[3].key", at[f"kv:{tok}"], "exceeds")
    expect_error(tmp_path, d[:at[f"kv:{tok}.type"] + 2], f"metadata['{tok}'].type", at[f"kv:{tok}.type"])
    key = "llama.rope.freq_base"
    expect_error(tmp_path, d[:at[f"kv:{key}.value"] + 3], f"metadata['{key}']", at[f"kv:{key}.value"], "truncated")
    tok = "tokenizer.ggml.tokens"
    expect_error(tmp_path, d[:at[f"kv:{tok}.count"] + 4], f"metadata['{tok}'] count", at[f"kv:{tok}.count"])
    # (a cut early in the array fails the count check instead: 7 strings need >= 56 bytes)
    expect_error(tmp_path, d[:at[f"kv:{tok}[6]"] + 5], f"metadata['{tok}'][6] length", at[f"kv:{tok}[6]"])
    expect_error(tmp_path, d[:at[f"kv:{tok}[6]"] + 9], f"metadata['{tok}'][6]", at[f"kv:{tok}[6]"], "exceeds")
    expect_error(tmp_path, d[:at[f"kv:{tok}[1]"]], f"metadata['{tok}'] count", at[f"kv:{tok}.count"], "7 strings")
    sc = "tokenizer.ggml.scores"
    # 7 float32 scores need 28 bytes: a cut inside them is caught at the count
    expect_error(tmp_path, d[:at[f"kv:{sc}.value"] + 12 + 20], f"metadata['{sc}'] count", at[f"kv:{sc}.count"],
                 "exceed")


def test_truncated_tensor_infos(tmp_path):
    c = small_model()
    d, at = c.bytes, c.at
    n = "blk.0.attn_norm.weight"
    expect_error(tmp_path, d[:at[f"ti:{n}"] + 12], "tensor[1].name", at[f"ti:{n}"], "exceeds")
    expect_error(tmp_path, d[:at[f"ti:{n}.n_dims"] + 1], f"tensor '{n}' n_dims", at[f"ti:{n}.n_dims"], "truncated")
    expect_error(tmp_path, d[:at[f"ti:{n}.dims"] + 4], f"tensor '{n}' dims", at[f"ti:{n}.dims"], "truncated")
    expect_error(tmp_path, d[:at[f"ti:{n}.type"] + 3], f"tensor '{n}' type", at[f"ti:{n}.type"], "truncated")
    expect_error(tmp_path, d[:at[f"ti:{n}.offset"] + 7], f"tensor '{n}' offset", at[f"ti:{n}.offset"], "truncated")


def test_truncated_data(tmp_path):
    c = small_model()
    last = "blk.0.ffn_down.weight"
    cut = c.at[f"data:{last}"] + 100
    msg = expect_error(tmp_path, c.bytes[:cut], f"tensor '{last}' data", c.at[f"ti:{last}.offset"], "past the end")
    assert f"file offset {c.at[f'data:{last}']}" in msg and f"{cut}-byte file" in msg
    # a file that ends right after the tensor infos lacks the aligned start of the data
    infos_end = c.at[f"ti:{last}.offset"] + 8
    assert infos_end % 32, "the crafted header should need padding"
    expect_error(tmp_path, c.bytes[:infos_end], "tensor data", infos_end, "aligned start")


@pytest.mark.parametrize("value", [2**31, 2**63, 2**64 - 1])
def test_absurd_counts(tmp_path, value):
    c = small_model()
    d, at = c.bytes, c.at
    expect_error(tmp_path, patch(d, at["tensor_count"], "Q", value), "tensor_count", 8, "corrupt count")
    expect_error(tmp_path, patch(d, at["kv_count"], "Q", value), "metadata_kv_count", 16, "corrupt count")
    tok, sc = "tokenizer.ggml.tokens", "tokenizer.ggml.scores"
    expect_error(tmp_path, patch(d, at[f"kv:{tok}.count"], "Q", value), f"metadata['{tok}'] count",
                 at[f"kv:{tok}.count"])
    expect_error(tmp_path, patch(d, at[f"kv:{sc}.count"], "Q", value), f"metadata['{sc}'] count", at[f"kv:{sc}.count"])


@pytest.mark.parametrize("value", [10**6, 2**63, 2**64 - 1])
def test_absurd_string_lengths(tmp_path, value):
    c = small_model()
    d, at = c.bytes, c.at
    key = "llama.block_count"
    expect_error(tmp_path, patch(d, at[f"kv:{key}"], "Q", value), "metadata[1].key", at[f"kv:{key}"], "exceeds")
    arch = "general.architecture"
    expect_error(tmp_path, patch(d, at[f"kv:{arch}.str"], "Q", value), f"metadata['{arch}']", at[f"kv:{arch}.str"])
    tok = "tokenizer.ggml.tokens"
    expect_error(tmp_path, patch(d, at[f"kv:{tok}[2]"], "Q", value), f"metadata['{tok}'][2]", at[f"kv:{tok}[2]"],
                 "exceeds")
    n = "token_embd.weight"
    expect_error(tmp_path, patch(d, at[f"ti:{n}"], "Q", value), "tensor[0].name", at[f"ti:{n}"], "exceeds")


def test_unknown_value_types(tmp_path):
    c = small_model()
    d, at = c.bytes, c.at
    key = "llama.block_count"
    for vt in (13, 255, 2**32 - 1):
        expect_error(tmp_path, patch(d, at[f"kv:{key}.type"], "I", vt), f"metadata['{key}'] type",
                     at[f"kv:{key}.type"], f"unknown value type {vt}")
    tok = "tokenizer.ggml.tokens"
    expect_error(tmp_path, patch(d, at[f"kv:{tok}.etype"], "I", 13), f"metadata['{tok}'] element type",
                 at[f"kv:{tok}.etype"], "unknown value type 13")


@pytest.mark.parametrize("type_id", [4, 5, 31, 36, 42, 1000, 2**32 - 1])
def test_unknown_ggml_type(tmp_path, type_id):
    c = small_model()
    n = "blk.0.attn_norm.weight"
    expect_error(tmp_path, patch(c.bytes, c.at[f"ti:{n}.type"], "I", type_id), f"tensor '{n}' type",
                 c.at[f"ti:{n}.type"], f"unknown ggml type id {type_id}")


def test_bad_dims(tmp_path):
    n = "w"

    def one(ne: list[int], type_id: int = 0) -> Craft:
        return small_model(tensors=[T(n, ne, type_id, data=b"")])

    for ne in ([2**32, 2**32, 2**32], [2**62], [2**63 + 5], [2**64 - 1, 2]):
        c = one(ne)
        expect_error(tmp_path, c.bytes, f"tensor '{n}' dims", c.at[f"ti:{n}.dims"], "overflow")
    c = one([100, 2], GGML_TYPES_BY_NAME["Q4_K"].id)
    expect_error(tmp_path, c.bytes, f"tensor '{n}' dims", c.at[f"ti:{n}.dims"],
                 "not a multiple of the Q4_K block size 256")
    for nd in (0, 5, 2**32 - 1):
        c = small_model()
        m = "blk.0.attn_norm.weight"
        expect_error(tmp_path, patch(c.bytes, c.at[f"ti:{m}.n_dims"], "I", nd), f"tensor '{m}' n_dims",
                     c.at[f"ti:{m}.n_dims"], "dimensions")


def test_dims_disagree_with_byte_size(tmp_path):
    # "a" claims 64 F32 (256 bytes) but "b" starts 128 bytes later: the shapes overlap
    c = small_model(tensors=[T("a", [64], 0, data=bytes(128), offset=0), T("b", [32], 0, offset=128)])
    expect_error(tmp_path, c.bytes, "tensor 'a' data", c.at["data:a"], "overlap tensor 'b'")
    # enlarging the last tensor's dims runs it past the end of the file
    c = small_model()
    last = "blk.0.ffn_down.weight"
    bad = patch(c.bytes, c.at[f"ti:{last}.dims[1]"], "Q", 3)
    expect_error(tmp_path, bad, f"tensor '{last}' data", c.at[f"ti:{last}.offset"], "past the end")


def test_layout_gap_opens_with_a_warning(tmp_path, caplog):
    """Gaps between tensors are legal GGUF (GGUFReader reads them) but ggml refuses them: warn."""
    with caplog.at_level("WARNING", logger="minirt.gguf"):
        with mgguf.open(write(tmp_path, small_model().bytes, "ok.gguf")):
            pass
        assert not caplog.records
        c = small_model(tensors=[T("a", [8], 0), T("b", [8], 0, offset=64)])
        with mgguf.open(write(tmp_path, c.bytes, "gap.gguf")) as f:
            assert f.tensors["b"].offset == c.at["data:b"] == f.data_offset + 64
            assert f.tensors["b"].data.tobytes() == c.bytes[c.at["data:b"]:c.at["data:b"] + 32]
    assert len(caplog.records) == 1 and "tensor 'b' starts at data offset 64, ggml expects 32" in caplog.text


def test_tensor_data_past_end_of_file(tmp_path):
    c = small_model()
    n = "token_embd.weight"
    for off in (len(c.bytes), 2**40, 2**64 - 32):
        expect_error(tmp_path, patch(c.bytes, c.at[f"ti:{n}.offset"], "Q", off), f"tensor '{n}' data",
                     c.at[f"ti:{n}.offset"], "past the end")


def test_misaligned_offsets(tmp_path):
    c = small_model()
    n = "blk.0.attn_norm.weight"
    expect_error(tmp_path, patch(c.bytes, c.at[f"ti:{n}.offset"], "Q", 4), f"tensor '{n}' offset",
                 c.at[f"ti:{n}.offset"], "not aligned to 32")
    kvs = [("general.architecture", Val(VT.STRING, "llama")), ("general.alignment", Val(VT.UINT32, 64))]
    c = Craft(kvs, [T("a", [8], 0), T("b", [8], 0, offset=32)], alignment=64)
    expect_error(tmp_path, c.bytes, "tensor 'b' offset", c.at["ti:b.offset"], "not aligned to 64")


@pytest.mark.parametrize("val", [Val(VT.UINT32, 0), Val(VT.UINT32, 48), Val(VT.UINT64, 32), Val(VT.INT32, 32)])
def test_invalid_alignment(tmp_path, val):
    c = Craft([("general.architecture", Val(VT.STRING, "llama")), ("general.alignment", val)], [T("a", [8], 0)])
    expect_error(tmp_path, c.bytes, "metadata['general.alignment']", c.at["kv:general.alignment.value"],
                 "invalid alignment")


def test_duplicate_key_and_tensor_name(tmp_path):
    kvs = [("general.architecture", Val(VT.STRING, "llama")), ("k", Val(VT.UINT8, 1)), ("k", Val(VT.UINT8, 2))]
    c = Craft(kvs, [])
    second = len(b"GGUF") + 4 + 16 + (8 + 20 + 4 + 8 + 5) + (8 + 1 + 4 + 1)
    expect_error(tmp_path, c.bytes, "metadata key 'k'", second, "duplicate key")
    c = small_model(tensors=[T("w", [8], 0), T("v", [8], 0), T("w", [8], 0)])
    second_w = c.at["ti:v"] + 8 + 1 + 4 + 8 + 4 + 8
    expect_error(tmp_path, c.bytes, "tensor name 'w'", second_w, "duplicate tensor name")


def test_messages_cut_long_names_short(tmp_path):
    """A hostile key or tensor name can be as large as the file; messages quote only its start."""
    long_key = "k" * 5000
    c = Craft([(long_key, Val(VT.UINT8, 1)), (long_key, Val(VT.UINT8, 2))], [])
    msg = expect_error(tmp_path, c.bytes, "metadata key 'kkkk", 24 + 8 + 5000 + 4 + 1, "duplicate key")
    assert len(msg) < 400 and "(5000 chars)" in msg
    n = mgguf.MAX_TENSOR_NAME_BYTES
    c = small_model(tensors=[T("t" * n, [8], 99)])
    msg = expect_error(tmp_path, c.bytes, "tensor 'tttt", c.at["ti:" + "t" * n + ".type"], "unknown ggml type id 99")
    assert len(msg) < 400


def test_nested_arrays_depth_bound(tmp_path):
    v: Val = Val(VT.ARRAY, [1], VT.INT32)
    for _ in range(mgguf.MAX_ARRAY_DEPTH):
        v = Val(VT.ARRAY, [v], VT.ARRAY)
    c = Craft([("deep", v)], [])
    deepest = "[0]" * mgguf.MAX_ARRAY_DEPTH
    expect_error(tmp_path, c.bytes, "metadata['deep']" + deepest, c.at["kv:deep" + deepest],
                 "nested deeper")
    ok = Val(VT.ARRAY, [Val(VT.ARRAY, [Val(VT.ARRAY, [7, 8], VT.UINT16)], VT.ARRAY)], VT.ARRAY)
    with mgguf.open(write(tmp_path, Craft([("ok", ok)], []).bytes)) as f:
        assert f.metadata_types["ok"] == "ARRAY[ARRAY[ARRAY[UINT16]]]"
        np.testing.assert_array_equal(f.metadata["ok"][0][0], np.array([7, 8], np.uint16))


def test_error_messages_name_the_file(tmp_path):
    p = write(tmp_path, b"GGUX" + bytes(40), "named.gguf")
    with pytest.raises(minirt.GGUFError) as ei:
        mgguf.open(p)
    assert str(p) in str(ei.value)
    assert re.search(r"magic at byte 0: expected b'GGUF', found b'GGUX'", str(ei.value))


# --------------------------------------------------------------------------------------------
# real models
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_model_matches_gguf_reader(real_model):
    key, path = real_model
    with mgguf.open(path) as f:
        compare_with_reader(path, f)
        assert f.architecture == {"qwen": "qwen2", "gemma": "gemma3"}[key]
        assert {t.qtype for t in f} <= {"F32", "F16", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
        toks = f.metadata["tokenizer.ggml.tokens"]
        assert isinstance(toks, list) and len(toks) >= 150_000 and all(isinstance(s, str) for s in toks[:100])
        assert len(f.metadata["tokenizer.ggml.token_type"]) == len(toks)


def test_real_model_open_time(real_model):
    """Open + every metadata value (vocabularies included) within 0.5 s (best of 3; machine noise)."""
    _key, path = real_model
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        with mgguf.open(path) as f:
            n = sum(len(v) if isinstance(v, (list, np.ndarray)) else 1 for v in f.metadata.values())
        best = min(best, time.perf_counter() - t0)
    assert n > 150_000
    assert best <= 0.5, f"open took {best:.3f} s"
