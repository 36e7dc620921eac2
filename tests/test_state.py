"""Saving and restoring a conversation's KV cache across model instances."""

from __future__ import annotations

import json

import numpy as np
import pytest

import minirt
from minirt import StateError
from tests.tiny_models import TinySpec, write_tiny

PROMPT = "the capital of France is"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("state")
    a, b = d / "a.gguf", d / "b.gguf"
    write_tiny(a, TinySpec(seed=21))
    write_tiny(b, TinySpec(seed=22))
    return str(a), str(b)


def test_save_then_resume_in_a_new_instance(paths, tmp_path):
    a, _ = paths
    st = tmp_path / "conv.state"
    with minirt.load(a, n_ctx=128) as m:
        with pytest.raises(StateError):
            m.save_state(st)  # nothing yet
        first = m.generate(PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
        saved = m.save_state(st)
        assert saved == first.prompt_ids + first.token_ids[:-1]
        follow = saved + first.token_ids[-1:] + m.tokenize(" w1 w2", add_special=False)
        want = m.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids
    with minirt.load(a, n_ctx=128) as m2:
        assert m2.load_state(st) == saved
        c = m2.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True)
        assert c.usage["cached_tokens"] == len(saved)
        assert c.token_ids == want


def test_state_from_another_model_is_refused(paths, tmp_path):
    a, b = paths
    st = tmp_path / "a.state"
    with minirt.load(a, n_ctx=64) as m:
        m.generate(PROMPT, max_tokens=3, temperature=0.0)
        m.save_state(st)
    with minirt.load(b, n_ctx=64) as m:
        with pytest.raises(StateError, match="another model"):
            m.load_state(st)


def test_corrupt_or_foreign_files_are_refused(paths, tmp_path):
    a, _ = paths
    bad = tmp_path / "bad.state"
    bad.write_bytes(b"not a state file")
    with minirt.load(a, n_ctx=64) as m:
        with pytest.raises(StateError):
            m.load_state(bad)
        with pytest.raises(StateError):
            m.load_state(tmp_path / "missing.state")
        m.generate(PROMPT, max_tokens=3, temperature=0.0)
        good = tmp_path / "good.state"
        m.save_state(good)
        with np.load(good) as z:
            parts = {k: z[k] for k in z.files}
        h = json.loads(str(parts["header"]))
        for field, value in (("minirt", "0.0.0"), ("format", "other")):
            forged = tmp_path / f"{field}.state"
            with open(forged, "wb") as fh:  # np.savez(path) would write path + ".npz"
                np.savez(fh, **{**parts, "header": np.array(json.dumps({**h, field: value}))})
            with pytest.raises(StateError, match="format" if field == "format" else "saved by minirt"):
                m.load_state(forged)
        forged = tmp_path / "shape.state"
        with open(forged, "wb") as fh:
            np.savez(fh, **{**parts, "k": parts["k"][:, :1]})
        with pytest.raises(StateError, match="shape"):
            m.load_state(forged)


# -- hostile state files ------------------------------------------------------------------------------
# A state file goes into the prefix cache, where a wrong value would change every later request
# sharing its tokens: everything is checked before use, at a cost bounded by a valid state's size.
import io  # noqa: E402
import os  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402
import tracemalloc  # noqa: E402
import zipfile  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("MINIRT_FUZZ_EXAMPLES", "150"))
FOLLOW = " w1 w2"


@pytest.fixture(scope="module")
def hostile(paths, tmp_path_factory):
    """A model, a valid state file of it, its members, and the reference continuation."""
    a, _ = paths
    d = tmp_path_factory.mktemp("hostile-state")
    m = minirt.load(a, n_ctx=64)
    first = m.generate(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    good = d / "good.state"
    saved = m.save_state(good)
    follow = saved + first.token_ids[-1:] + m.tokenize(FOLLOW, add_special=False)
    m.cache_pool.clear()
    want = m.generate(follow, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids
    other = m.tokenize("a completely different prompt", add_special=False)
    want_other = m.generate(other, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids
    m.cache_pool.clear()
    with np.load(good) as z:
        parts = {k: z[k] for k in z.files}
    yield _Fixture({"m": m, "dir": d, "good": good, "bytes": good.read_bytes(), "parts": parts, "saved": saved,
           "follow": follow, "want": want, "other": other, "want_other": want_other})
    m.close()


class _Fixture(dict):
    def __repr__(self) -> str:  # hypothesis prints its arguments
        return "<hostile state fixture>"


def _pool(m):
    return [c.token_ids().tolist() for c in m.cache_pool._idle]


def _still_serves(h):
    """No bad state reached the prefix cache: fresh prompts and the saved prefix give the reference."""
    m = h["m"]
    assert m.generate(h["other"], max_tokens=4, temperature=0.0, ignore_eos=True).token_ids == h["want_other"]
    assert m.generate(h["follow"], max_tokens=4, temperature=0.0, ignore_eos=True).token_ids == h["want"]
    m.cache_pool.clear()


def _refused(h, path, *words):
    m = h["m"]
    before = _pool(m)
    with pytest.raises(StateError) as ei:
        m.load_state(path)
    msg = str(ei.value)
    # "a|b": either word (a member too big for this model's cache is refused by its declared size
    # before its dtype is looked at)
    assert str(path) in msg and all(any(alt in msg for alt in w.split("|")) for w in words), msg
    assert _pool(m) == before  # nothing half-loaded
    _still_serves(h)
    return msg


def _write(path, parts, compressed=False):
    with open(path, "wb") as fh:  # np.savez(path) would append ".npz" to the name
        (np.savez_compressed if compressed else np.savez)(fh, **parts)
    return path


def _header(h, **changes):
    hd = json.loads(str(h["parts"]["header"]))
    hd.update(changes)
    return {**h["parts"], "header": np.array(json.dumps(hd))}


@pytest.mark.parametrize("value", ["abc", "12", 1.5, True, None, -1, 0, 10**30, [3], 65])
def test_bad_n_tokens_is_a_state_error(hostile, value):
    """``int(n_tokens)`` used to run outside the error handling (ValueError / TypeError escaped)."""
    _refused(hostile, _write(hostile["dir"] / "n.state", _header(hostile, n_tokens=value)), "n_tokens")


def _nan(a):
    a = a.copy()
    a.flat[a.size // 2] = np.nan
    return a


def _inf(a):
    a = a.copy()
    a.flat[0] = -np.inf
    return a


BAD_MEMBERS = {
    "k-nan": ("k", _nan, "NaN"),
    "v-inf": ("v", _inf, "NaN or infinite"),
    "k-complex": ("k", lambda a: np.ascontiguousarray(a).view(np.complex64), "dtype"),  # same bytes, complex
    "k-float64": ("k", lambda a: a.astype(np.float64), "dtype|can hold"),
    "v-other-float": ("v", lambda a: a.astype(np.float32 if a.dtype == np.float16 else np.float16), "dtype|can hold"),
    "k-big-endian": ("k", lambda a: a.astype(">f4"), "dtype|can hold"),
    "k-int": ("k", lambda a: a.astype(np.int32), "dtype|can hold"),
    "k-object": ("k", lambda a: np.array([a, None], dtype=object), "dtype"),
    "k-short": ("k", lambda a: a[:, :, :-1], "shape"),
    "k-long": ("k", lambda a: np.concatenate([a, a[:, :, :1]], axis=2), "shape"),
    "k-heads": ("k", lambda a: a[:, :1], "shape"),
    "v-head-dim": ("v", lambda a: a[..., :-1], "shape"),
    "v-layers": ("v", lambda a: np.concatenate([a, a]), "shape"),
    "k-flat": ("k", lambda a: a.ravel(), "shape"),
    "tokens-high": ("tokens", lambda t: np.where(np.arange(t.size) == 1, 10**6, t).astype(t.dtype), "out of range"),
    "tokens-negative": ("tokens", lambda t: np.where(np.arange(t.size) == 0, -5, t).astype(t.dtype), "out of range"),
    "tokens-float": ("tokens", lambda t: t.astype(np.float32), "dtype"),
    "tokens-2d": ("tokens", lambda t: t[None], "shape"),
    "header-not-string": ("header", lambda hd: np.arange(3), "header"),
    "header-not-json": ("header", lambda hd: np.array("{not json"), "JSON"),
    "header-list": ("header", lambda hd: np.array("[1, 2]"), "object"),
}


@pytest.mark.parametrize("case", sorted(BAD_MEMBERS))
def test_bad_member_is_refused_and_never_reaches_the_prefix_cache(hostile, case):
    """NaN, complex, wrong dtype, wrong shape, out-of-range ids: refused by name; the model keeps
    serving the reference continuation (before, NaN and complex states were accepted and poisoned
    every request sharing the saved tokens)."""
    member, fn, word = BAD_MEMBERS[case]
    parts = dict(hostile["parts"])
    parts[member] = fn(parts[member])
    _refused(hostile, _write(hostile["dir"] / f"{case}.state", parts), word)


def test_missing_and_extra_members_are_refused(hostile):
    parts = dict(hostile["parts"])
    _refused(hostile, _write(hostile["dir"] / "missing.state", {k: v for k, v in parts.items() if k != "v"}),
             "members")
    _refused(hostile, _write(hostile["dir"] / "extra.state", {**parts, "extra": np.zeros(3)}), "members")


def _peak_during(fn):
    tracemalloc.start()
    try:
        fn()
    except StateError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def _bomb(h, path, declared_shape=None, lie=False):
    """A deflated ``k.npy`` whose npy header is right but whose data goes on for 100 MB of zeros
    (a ~0.1 MB file). ``lie``: the central directory also declares the expected size."""
    k = h["parts"]["k"]
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": np.lib.format.dtype_to_descr(k.dtype),
                                               "fortran_order": False, "shape": declared_shape or k.shape})
    bomb = hdr.getvalue() + b"\0" * (100 << 20)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in h["parts"].items():
            if name == "k":
                zf.writestr("k.npy", bomb)
            else:
                buf = io.BytesIO()
                np.lib.format.write_array(buf, arr, allow_pickle=False)
                zf.writestr(f"{name}.npy", buf.getvalue())
    del bomb
    if lie:  # patch k.npy's uncompressed size in the central directory to the honest value
        data = bytearray(path.read_bytes())
        at = data.find(b"PK\x01\x02")
        while at >= 0:
            n_name = struct.unpack_from("<H", data, at + 28)[0]
            if bytes(data[at + 46:at + 46 + n_name]) == b"k.npy":
                struct.pack_into("<I", data, at + 24, len(hdr.getvalue()) + k.nbytes)
            at = data.find(b"PK\x01\x02", at + 4)
        path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("kind", ["honest", "lying", "huge-shape"])
def test_compressed_bomb_costs_a_bounded_multiple_of_the_state_size(hostile, kind):
    """0.1 MB of deflated zeros that expand to 100 MB: refused with at most a small multiple of a
    valid state's size allocated (np.load decompressed the whole member before any check)."""
    k = hostile["parts"]["k"]
    shape = (k.shape[0], k.shape[1], 50_000, k.shape[3]) if kind == "huge-shape" else None
    path = _bomb(hostile, hostile["dir"] / f"bomb-{kind}.state", declared_shape=shape, lie=kind == "lying")
    assert path.stat().st_size < (1 << 20)
    valid = len(hostile["bytes"])
    peak = _peak_during(lambda: hostile["m"].load_state(path))
    assert peak < 8 * valid + (1 << 20), f"peak {peak} bytes for a {path.stat().st_size}-byte file"
    _refused(hostile, path)


def test_fifo_and_devices_are_refused_without_blocking(hostile):
    """open() of a FIFO with no writer blocks forever; the state reader opens non-blocking and
    refuses anything but a regular file."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    fifo = hostile["dir"] / "fifo.state"
    os.mkfifo(fifo)
    out: list[BaseException | None] = []

    def load():
        try:
            hostile["m"].load_state(fifo)
            out.append(None)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock the stuck reader before failing
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("load_state blocked on a FIFO")
    assert isinstance(out[0], StateError) and "FIFO" in str(out[0])
    for dev, word in (("/dev/zero", "device"), (hostile["dir"], "directory")):
        if os.path.exists(dev):
            _refused(hostile, dev, word)


def test_valid_states_still_load_compressed_and_fortran_ordered(hostile):
    """The checks refuse only what is wrong: savez_compressed and a Fortran-ordered k load fine."""
    m, parts = hostile["m"], hostile["parts"]
    for name, p in (("compressed", parts), ("fortran", {**parts, "k": np.asfortranarray(parts["k"])})):
        path = _write(hostile["dir"] / f"{name}.state", p, compressed=name == "compressed")
        assert m.load_state(path) == hostile["saved"]
        c = m.generate(hostile["follow"], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert c.usage["cached_tokens"] == len(hostile["saved"]) and c.token_ids == hostile["want"]
        m.cache_pool.clear()


def _check_outcome(h, path):
    """Only StateError may escape; a file that loads must have loaded exactly the saved state."""
    m = h["m"]
    before = _pool(m)
    try:
        got = m.load_state(path)
    except StateError:
        assert _pool(m) == before
    else:
        assert got == h["saved"]
        cache = m.cache_pool.most_recent()
        np.testing.assert_array_equal(cache.k[:, :, :len(got)], h["parts"]["k"])
        np.testing.assert_array_equal(cache.v[:, :, :len(got)], h["parts"]["v"])
    _still_serves(h)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_fuzz_state_file_bytes(hostile, data):
    """Overwritten, inserted, deleted bytes and truncation anywhere in a valid file."""
    raw = bytearray(hostile["bytes"])
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        kind = data.draw(st.sampled_from(["set", "insert", "delete", "truncate"]), label="kind")
        at = data.draw(st.integers(0, max(0, len(raw) - 1)), label="at")
        if kind == "set" and raw:
            raw[at] = data.draw(st.integers(0, 255).filter(lambda b, o=raw[at]: b != o), label="byte")
        elif kind == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
        elif kind == "delete":
            del raw[at:at + data.draw(st.integers(1, 16), label="n")]
        else:
            del raw[at:]
    path = hostile["dir"] / "fuzz-bytes.state"
    path.write_bytes(bytes(raw))
    _check_outcome(hostile, path)


DTYPES = [np.float32, np.float64, np.float16, np.complex64, np.int32, np.int64, np.uint8, np.bool_, ">f4", "<U3"]


@FUZZ
@given(data=st.data())
def test_fuzz_state_members(hostile, data):
    """Members replaced by arrays of other dtypes and shapes, NaN/inf sprinkled in, members dropped
    or duplicated under other names, header fields changed: only StateError escapes, and whatever
    loads is exactly the saved state."""
    parts = dict(hostile["parts"])
    name = data.draw(st.sampled_from(["header", "tokens", "k", "v", "drop", "add"]), label="member")
    if name == "drop":
        del parts[data.draw(st.sampled_from(sorted(parts)), label="dropped")]
    elif name == "add":
        parts[data.draw(st.text("abcdefgh", min_size=1, max_size=4), label="new")] = np.zeros(2)
    elif name == "header":
        hd = json.loads(str(parts["header"]))
        key = data.draw(st.sampled_from(sorted(hd)), label="key")
        hd[key] = data.draw(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                                      st.text(max_size=20), st.lists(st.integers(), max_size=3)), label="value")
        parts["header"] = np.array(json.dumps(hd))
    else:
        a = parts[name]
        dtype = data.draw(st.sampled_from([a.dtype, *DTYPES]), label="dtype")
        shape = list(a.shape)
        if data.draw(st.booleans(), label="reshape"):
            axis = data.draw(st.integers(0, len(shape) - 1), label="axis")
            shape[axis] = data.draw(st.integers(0, shape[axis] + 3), label="size")
        with np.errstate(all="ignore"):
            b = np.resize(a, shape).astype(dtype)
        if b.dtype.kind in "fc" and b.size and data.draw(st.booleans(), label="nonfinite"):
            b.flat[data.draw(st.integers(0, b.size - 1), label="at")] = data.draw(
                st.sampled_from([np.nan, np.inf, -np.inf]), label="value")
        if name == "tokens" and b.dtype.kind in "iu" and b.size and data.draw(st.booleans(), label="id"):
            bad = data.draw(st.sampled_from([-1, hostile["m"].n_vocab, 2**31 - 1]), label="bad id")
            b.flat[0] = np.array(bad, dtype=np.int64).astype(b.dtype)  # wraps for narrow types
        parts[name] = b
    path = _write(hostile["dir"] / "fuzz-members.state", parts, compressed=data.draw(st.booleans(), label="zip"))
    _check_outcome(hostile, path)
