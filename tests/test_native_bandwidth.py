"""The native streaming-read probe (``native.read_bandwidth``): every byte read on every ISA and
thread count, against numpy's wrapping uint64 sum; input validation."""

from __future__ import annotations

import numpy as np
import pytest

from minirt.errors import InvalidRequestError
from minirt.kernels import native


@pytest.fixture(scope="module")
def isas() -> list[str]:
    try:
        native._load()
    except Exception as e:  # noqa: BLE001 - only a machine without a C compiler lands here
        pytest.skip(f"native kernels unavailable: {e}")
    return native.supported_isas()


# sizes: below one 2 MiB slice, exactly one, several plus a tail that no vector loop covers
@pytest.mark.parametrize("n_words", [1, 7, 33, (1 << 18), (1 << 18) * 3 + 5])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sum_matches_numpy_on_every_isa(isas, n_words, threads):
    buf = np.random.default_rng(n_words).integers(0, np.iinfo(np.uint64).max, size=n_words, dtype=np.uint64,
                                                  endpoint=True)
    want = int(buf.sum(dtype=np.uint64))  # wraps modulo 2**64, like the kernel
    for isa in isas:
        seconds, got = native.read_bandwidth(buf, threads=threads, reps=2, isa=isa)
        assert got == want, isa
        assert seconds > 0


def test_any_dtype_is_read_as_bytes(isas):
    buf = np.arange(1024, dtype=np.float32)
    _, got = native.read_bandwidth(buf)
    assert got == int(buf.view(np.uint64).sum(dtype=np.uint64))


def test_unaligned_start(isas):
    raw = np.random.default_rng(1).integers(0, 255, size=8 * 1001 + 3, dtype=np.uint8)
    view = raw[3:].view(np.uint64)  # not 64-byte (nor 8-byte) aligned
    _, got = native.read_bandwidth(view, isa=isas[-1])
    assert got == int(view.sum(dtype=np.uint64))


def test_bad_input_is_refused(isas):
    with pytest.raises(InvalidRequestError, match="multiple of 8"):
        native.read_bandwidth(np.zeros(3, dtype=np.uint8))
    with pytest.raises(InvalidRequestError, match="multiple of 8"):
        native.read_bandwidth(np.zeros(0, dtype=np.uint64))
    with pytest.raises(InvalidRequestError, match="C-contiguous"):
        native.read_bandwidth(np.zeros((4, 4), dtype=np.uint64)[:, 1])
    with pytest.raises(InvalidRequestError, match="reps"):
        native.read_bandwidth(np.zeros(8, dtype=np.uint64), reps=0)
    with pytest.raises(InvalidRequestError, match="threads"):
        native.read_bandwidth(np.zeros(8, dtype=np.uint64), threads=0)
