"""Fuzzing the GGUF reader over a small synthetic file.

Every case must either open (and then hold only tensors that lie inside the file) or raise
``minirt.GGUFError`` naming a byte offset. Any other exception fails, a case that runs past
``CASE_TIMEOUT_S`` fails as a hang, and a traced-memory peak above the file size plus
``MEM_SLACK`` fails as a blow-up (a count or length trusted before it was checked would
allocate far more than the file holds).

Cases: every truncation of the first 4 KiB (exhaustive), every integer field of the header
overwritten with each of a fixed set of hostile values (exhaustive), then hypothesis-driven byte
flips and combined hostile fields. ``MINIRT_FUZZ_EXAMPLES`` sets the hypothesis examples per
property (default 150; raise it for a longer run).
"""

from __future__ import annotations

import itertools
import os
import signal
import struct
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import minirt
from minirt import gguf as mgguf

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz suite needs hypothesis (test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gguf import VT, Craft, T, Val  # noqa: E402  (the crafting helper lives with the unit tests)

EXAMPLES = int(os.environ.get("MINIRT_FUZZ_EXAMPLES", "150"))
CASE_TIMEOUT_S = 5.0
MEM_SLACK = 64 * 1024  # parser bookkeeping: dicts, small arrays, the exception and its traceback
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz_model() -> Craft:
    """~4.6 KiB: a few keys (string array, number array, nested array, alignment), four tensors."""
    kvs = [
        ("general.architecture", Val(VT.STRING, "llama")),
        ("general.alignment", Val(VT.UINT32, 32)),
        ("llama.block_count", Val(VT.UINT32, 1)),
        ("llama.rope.freq_base", Val(VT.FLOAT32, 10000.0)),
        ("llama.flag", Val(VT.BOOL, True)),
        ("llama.big", Val(VT.UINT64, 2**40 + 3)),
        ("tokenizer.ggml.tokens", Val(VT.ARRAY, ["<s>", "</s>", "a", "", "▁the", "é", "🦙", "x" * 40], VT.STRING)),
        ("tokenizer.ggml.scores", Val(VT.ARRAY, [0.0, -1.0, -2.5, 3.0, 1e-3, 7.0, -7.0, 0.5], VT.FLOAT32)),
        ("llama.nested", Val(VT.ARRAY, [Val(VT.ARRAY, [1, 2], VT.INT16), Val(VT.ARRAY, ["z"], VT.STRING)], VT.ARRAY)),
    ]
    tensors = [T("token_embd.weight", [32, 16], 8), T("blk.0.attn_norm.weight", [32], 0),
               T("blk.0.ffn_down.weight", [256, 8], 12), T("output.weight", [32, 32], 1)]
    return Craft(kvs, tensors)


MODEL = fuzz_model()
DATA = MODEL.bytes
HEADER_END = MODEL.at["data"]


class _Hang(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise _Hang in this thread after ``seconds`` (SIGALRM; a no-op where it does not exist)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _Hang()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Runner:
    """Writes each case to a fresh file and opens it under a time limit and traced memory."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.n = 0
        self.max_peak = 0

    def __call__(self, data: bytes) -> mgguf.GGUFFile | minirt.GGUFError:
        self.n += 1
        path = self.folder / f"case{self.n}.gguf"
        path.write_bytes(data)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            with time_limit(CASE_TIMEOUT_S):
                try:
                    f = mgguf.open(path)
                except minirt.GGUFError as e:
                    assert "at byte" in str(e), f"error without an offset: {e}"
                    return e
                try:
                    check_opened(f, len(data))
                finally:
                    f.close()
                return f
        except _Hang:
            pytest.fail(f"hang: a {len(data)}-byte case took more than {CASE_TIMEOUT_S} s")
        finally:
            peak = tracemalloc.get_traced_memory()[1] - base
            self.max_peak = max(self.max_peak, peak)
            assert peak <= len(data) + MEM_SLACK, f"memory peak {peak} for a {len(data)}-byte file"
            path.unlink()


def check_opened(f: mgguf.GGUFFile, size: int) -> None:
    """A file that opened must be internally consistent and every tensor must lie inside it."""
    assert f.alignment > 0 and f.alignment & (f.alignment - 1) == 0
    assert f.data_offset % f.alignment == 0
    for key, v in f.metadata.items():
        t = f.metadata_types[key]
        if t == "ARRAY[STRING]":
            assert isinstance(v, list) and all(isinstance(s, str) for s in v)
        elif t.startswith("ARRAY[ARRAY"):
            assert isinstance(v, list)
        elif t.startswith("ARRAY"):
            assert isinstance(v, np.ndarray) and v.nbytes <= size
    for t in f:
        assert t.offset >= f.data_offset and (t.offset - f.data_offset) % f.alignment == 0
        assert t.offset + t.nbytes <= size
        assert t.shape[-1] % t.type.block_size == 0
        assert t.nbytes == t.n_elements // t.type.block_size * t.type.type_size
        d = t.data
        assert d.shape == (*t.shape[:-1], t.row_bytes) and d.nbytes == t.nbytes
        if d.size:
            _ = int(d.reshape(-1)[0]) + int(d.reshape(-1)[-1])  # the mapping really holds these bytes
        del d


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[Runner]:
    tracemalloc.start()
    runner = Runner(tmp_path_factory.mktemp("fuzz"))
    try:
        opened = runner(DATA)  # warm-up: lazy imports and caches are not counted against cases
        assert isinstance(opened, mgguf.GGUFFile)
        yield runner
    finally:
        tracemalloc.stop()


def test_model_is_what_the_fuzzer_expects(run):
    assert len(DATA) > 4096 and MODEL.tensor_end > 4096
    f = run(DATA)
    assert isinstance(f, mgguf.GGUFFile)
    with mgguf.open(_write(run.folder / "whole.gguf", DATA)) as f:
        assert len(f.tensors) == 4 and f.metadata["tokenizer.ggml.tokens"][6] == "🦙"
        assert f.metadata["llama.big"] == 2**40 + 3


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def test_every_truncation_of_the_first_4k(run):
    """Exhaustive: every prefix shorter than the end of the tensor data must be refused."""
    for cut in range(4096):
        out = run(DATA[:cut])
        assert isinstance(out, minirt.GGUFError), f"a file cut at {cut} of {len(DATA)} bytes opened"
    for cut in range(MODEL.tensor_end, len(DATA) + 1):  # only the final padding missing: still valid
        assert isinstance(run(DATA[:cut]), mgguf.GGUFFile), cut


def _hostile_values(width: int) -> list[int]:
    n = len(DATA)
    vals = {0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 4096, 2**16 - 1, 2**31 - 1, 2**31,
            2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
            n, n - 1, n + 1, n // 8, n // 12, n // 13, n // 32, n * 8}
    return sorted(v & ((1 << (8 * width)) - 1) for v in vals)


def _poke(data: bytes, offset: int, width: int, value: int) -> bytes:
    b = bytearray(data)
    b[offset:offset + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    return bytes(b)


def test_hostile_values_in_every_integer_field(run):
    """Exhaustive: each count, length, type id, n_dims, dim, offset and version field × hostile values."""
    fields = [f for f in MODEL.ints if f[1] < HEADER_END]
    assert len(fields) > 40
    opened = 0
    for (_name, off, width), value in itertools.chain.from_iterable(
            ((f, v) for v in _hostile_values(f[2])) for f in fields):
        out = run(_poke(DATA, off, width, value))
        opened += isinstance(out, mgguf.GGUFFile)
    assert opened > 0  # some values are harmless (e.g. a count rewritten to itself is not in the set)


@FUZZ_SETTINGS
@given(flips=st.lists(st.tuples(st.one_of(st.integers(0, HEADER_END - 1), st.integers(0, len(DATA) - 1)),
                                st.integers(1, 255)), min_size=1, max_size=8))
def test_random_byte_flips(run, flips):
    b = bytearray(DATA)
    for off, x in flips:
        b[off] ^= x
    run(bytes(b))


_INT_FIELDS = [f for f in MODEL.ints if f[1] < HEADER_END]


@FUZZ_SETTINGS
@given(pokes=st.lists(st.tuples(st.sampled_from(_INT_FIELDS),
                                st.one_of(st.sampled_from(_hostile_values(8)), st.integers(0, 2**64 - 1))),
                      min_size=1, max_size=3),
       cut=st.one_of(st.none(), st.integers(0, len(DATA))))
def test_hostile_fields_combined(run, pokes, cut):
    data = DATA
    for (_name, off, width), value in pokes:
        data = _poke(data, off, width, value)
    run(data if cut is None else data[:cut])


def test_memory_bound_is_meaningful(run):
    """The traced peak of a normal open is well inside the slack (so the bound can catch blow-ups)."""
    assert 0 < run.max_peak < MEM_SLACK, run.max_peak


# --------------------------------------------------------------------------------------------
# generated structures: many keys, strings (valid or not UTF-8), nested arrays, empty tensors,
# with the counts in the header optionally lying; the cost bound is per file byte
# --------------------------------------------------------------------------------------------
K_PER_BYTE = 11  # Python objects per file byte at most (see tests/test_hostile_files.py)


def _gs(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


_blobs = st.one_of(st.text(max_size=12).map(lambda s: s.encode("utf-8", "surrogatepass")), st.binary(max_size=12))
_values = st.one_of(
    st.integers(0, 255).map(lambda v: struct.pack("<IB", 0, v)),
    _blobs.map(lambda b: struct.pack("<I", 8) + _gs(b)),
    st.lists(_blobs, max_size=40).map(lambda xs: struct.pack("<IIQ", 9, 8, len(xs)) + b"".join(map(_gs, xs))),
    st.lists(st.integers(0, 2**31 - 1), max_size=40).map(
        lambda xs: struct.pack("<IIQ", 9, 5, len(xs)) + struct.pack(f"<{len(xs)}i", *xs)),
    st.lists(st.lists(st.integers(0, 65535), max_size=3), max_size=60).map(
        lambda xss: struct.pack("<IIQ", 9, 9, len(xss)) + b"".join(
            struct.pack("<IQ", 2, len(xs)) + struct.pack(f"<{len(xs)}H", *xs) for xs in xss)),
)


@FUZZ_SETTINGS
@given(keys=st.lists(st.tuples(_blobs, _values), max_size=120), n_tensors=st.integers(0, 200),
       kv_delta=st.sampled_from([0, 0, 0, 1, -1, 2**40]), t_delta=st.sampled_from([0, 0, 0, 1, -1]))
def test_generated_structures_cost_at_most_k_per_byte(tmp_path_factory, keys, n_tensors, kv_delta, t_delta):
    body = b"".join(_gs(k) + v for k, v in keys)
    body += b"".join(_gs(b"t%d" % i) + struct.pack("<IQIQ", 1, 0, 0, 0) for i in range(n_tensors))
    n_kv = max(0, len(keys) + kv_delta) & (2**64 - 1)
    data = b"GGUF" + struct.pack("<IQQ", 3, max(0, n_tensors + t_delta), n_kv) + body
    data += b"\0" * (-len(data) % 32)
    path = tmp_path_factory.getbasetemp() / "generated.gguf"
    path.write_bytes(data)
    invalid = any(_not_utf8(k) for k, _ in keys)
    try:  # warm-up, untraced: lazy imports and first-use caches are not the file's cost
        mgguf.open(path).close()
    except minirt.GGUFError:
        pass
    was_tracing = tracemalloc.is_tracing()  # the module's Runner may be tracing already
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        with time_limit(CASE_TIMEOUT_S):
            try:
                mgguf.open(path).close()
                opened = True
            except minirt.GGUFError as e:
                assert "at byte" in str(e), e
                opened = False
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    assert peak <= K_PER_BYTE * len(data) + MEM_SLACK, f"peak {peak} for a {len(data)}-byte file"
    if invalid and kv_delta == 0:
        assert not opened, "a key that is not UTF-8 was accepted"


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True
