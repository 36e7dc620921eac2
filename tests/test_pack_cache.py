"""The packed-weight cache ($MINIRT_HOME/packed): written on the first load, read by later ones,
never trusted when it does not match the model."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import minirt
from tests.tiny_models import TinySpec, write_tiny

IDS = [1, 5, 9, 3, 7, 2]


@pytest.fixture
def packable(tmp_path, monkeypatch):
    """A tiny Q8_0 model wide enough for the packed layout, and a private $MINIRT_HOME."""
    from minirt.kernels import native

    try:
        isa = native.info()["isa"]
    except minirt.BackendError as e:
        pytest.skip(f"native kernels unavailable: {e}")
    if not native.pack_preferred("Q8_0"):
        pytest.skip(f"the {isa} kernels read Q8_0 weights unpacked: nothing is cached on this CPU")
    home = tmp_path / "home"
    monkeypatch.setenv("MINIRT_HOME", str(home))
    monkeypatch.delenv("MINIRT_PACK_CACHE", raising=False)
    monkeypatch.delenv("MINIRT_PACK", raising=False)
    path = tmp_path / "tiny-q8.gguf"
    write_tiny(path, TinySpec(qtype=QT.Q8_0, n_embd=256, n_ff=256, n_head=4, n_head_kv=2, seed=5))
    return path, home / "packed"


def _logits(path, packed: bool = True) -> np.ndarray:
    with minirt.load(str(path), backend="native", n_ctx=64) as llm:
        n = sum(lin.backend_data is not None for lin in llm.model.linears())
        assert (n > 0) == packed, f"{n} packed weights"
        return llm.logits(IDS)


def _no_repacking(monkeypatch):
    from minirt.kernels import native

    def refuse(*a, **k):
        raise AssertionError("repacked although a valid cache exists")

    monkeypatch.setattr(native, "pack", refuse)


def test_first_load_writes_the_cache_and_later_loads_read_it(packable, monkeypatch):
    path, cache_dir = packable
    first = _logits(path)
    files = list(cache_dir.glob("*.pack"))
    assert len(files) == 1, files
    with monkeypatch.context() as m:
        _no_repacking(m)
        again = _logits(path)
    np.testing.assert_array_equal(first, again)
    # the ggml rows as stored, through the unpacked kernels: the same weights, so the same logits up
    # to the kernels' 8-bit activation rounding (its bound is tested in test_native)
    monkeypatch.setenv("MINIRT_PACK", "0")
    plain = _logits(path, packed=False)
    np.testing.assert_allclose(first, plain, rtol=0, atol=0.02)
    assert (first.argmax(-1) == plain.argmax(-1)).all()


def test_a_corrupt_cache_is_detected_and_replaced(packable, monkeypatch, caplog):
    path, cache_dir = packable
    good = _logits(path)
    (f,) = cache_dir.glob("*.pack")
    with open(f, "r+b") as fh:  # the first tile of the first matrix
        fh.seek(4096)
        b = bytearray(fh.read(64))
        fh.seek(4096)
        fh.write(bytes(x ^ 0x5A for x in b))
    with caplog.at_level(logging.WARNING, logger="minirt"):
        assert np.array_equal(_logits(path), good)
    assert "does not match the model's weights" in caplog.text
    with monkeypatch.context() as m:  # rewritten: the next load reads it again
        _no_repacking(m)
        np.testing.assert_array_equal(_logits(path), good)


@pytest.mark.parametrize("damage", ["truncate", "header", "empty"])
def test_a_truncated_or_foreign_cache_is_repacked(packable, damage):
    path, cache_dir = packable
    good = _logits(path)
    (f,) = cache_dir.glob("*.pack")
    if damage == "truncate":
        os.truncate(f, f.stat().st_size // 2)
    elif damage == "header":
        with open(f, "r+b") as fh:
            fh.seek(8)
            fh.write(b"0" * 32)  # another model's key
    else:
        f.write_bytes(b"")
    np.testing.assert_array_equal(_logits(path), good)
    (f2,) = cache_dir.glob("*.pack")
    assert f2.stat().st_size > 4096 + 1024


def test_a_changed_model_file_gets_its_own_entry(packable):
    path, cache_dir = packable
    _logits(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _logits(path)
    assert len(list(cache_dir.glob("*.pack"))) == 2


def test_the_cache_can_be_turned_off(packable, monkeypatch):
    path, cache_dir = packable
    monkeypatch.setenv("MINIRT_PACK_CACHE", "0")
    _logits(path)
    assert not cache_dir.exists() or not list(cache_dir.glob("*.pack"))


def test_an_unwritable_cache_folder_only_costs_the_repacking(packable, caplog):
    path, cache_dir = packable
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.write_text("not a folder")  # mkdir/mkstemp inside it fail
    with caplog.at_level(logging.WARNING, logger="minirt"):
        a = _logits(path)
        b = _logits(path)
    np.testing.assert_array_equal(a, b)
    assert "cannot write pack cache" in caplog.text
