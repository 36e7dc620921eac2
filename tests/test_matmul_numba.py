"""The fused quantized matmul of the numba backend against dequantize-then-matmul in float64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minirt
from minirt.quants import SUPPORTED_TYPES, dequantize, get_spec
from minirt.quants._random import random_matrix

numba = pytest.importorskip("numba")
from minirt.kernels import numba_backend as nb  # noqa: E402

REL_TOL = 1e-5  # float32 accumulation against a float64 reference


def reference(x: np.ndarray, w: np.ndarray, qtype: str) -> np.ndarray:
    """float64 x @ W.T with W from the numpy spec."""
    rows = w.shape[0]
    cols = x.shape[1]
    wf = dequantize(w, qtype, (rows, cols)).astype(np.float64)
    return x.astype(np.float64) @ wf.T


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture
def threads():
    """Run with a given numba thread count, restoring the previous one."""
    old = numba.get_num_threads()
    yield lambda n: numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    numba.set_num_threads(old)


def cols_for(qtype: str, n_blocks: int) -> int:
    spec = get_spec(qtype)
    return n_blocks * (spec.block_size if spec.block_size > 1 else 32)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
@pytest.mark.parametrize("n_tokens", [1, 3, 9])
def test_matches_float64_reference_random(qtype, n_tokens, threads):
    rng = np.random.default_rng(sum(map(ord, qtype)) * 100 + n_tokens)
    rows, cols = 37, cols_for(qtype, 5)  # odd row count, several blocks per row
    w = random_matrix(qtype, rows, cols, rng)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    ref = reference(x, w, qtype)
    for n_threads in (1, 2):
        threads(n_threads)
        y = nb.matmul(x, w, qtype)
        assert y.shape == (n_tokens, rows) and y.dtype == np.float32
        assert rel_err(y, ref) <= REL_TOL, (qtype, n_tokens, n_threads)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(SUPPORTED_TYPES), rows=st.integers(1, 40), n_blocks=st.integers(1, 6),
       n_tokens=st.integers(1, 11), seed=st.integers(0, 2**32 - 1))
def test_shapes_property(qtype, rows, n_blocks, n_tokens, seed):
    """Any shape, down to a single output. A single output can be a near-total cancellation,
    where no float32 evaluation has a small relative error, so the bound is the one rounding
    error obeys: |y - y_ref| <= tol * (|x| @ |W|.T), elementwise (measured: below 2e-7)."""
    rng = np.random.default_rng(seed)
    cols = cols_for(qtype, n_blocks)
    w = random_matrix(qtype, rows, cols, rng)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    y = nb.matmul(x, w, qtype)
    wf = dequantize(w, qtype, (rows, cols)).astype(np.float64)
    ref = x.astype(np.float64) @ wf.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(wf).T
    assert np.all(np.abs(y - ref) <= REL_TOL * scale + 1e-30)


def test_decode_and_prefill_paths_agree():
    rng = np.random.default_rng(11)
    w = random_matrix("Q4_K", 50, 1024, rng)
    x = rng.standard_normal((6, 1024)).astype(np.float32)
    batch = nb.matmul(x, w, "Q4_K")
    for t in range(6):
        one = nb.matmul(x[t:t + 1], w, "Q4_K")
        np.testing.assert_allclose(one[0], batch[t], rtol=1e-5, atol=1e-5 * np.abs(batch[t]).max())


def test_out_parameter_is_filled_in_place():
    rng = np.random.default_rng(12)
    w = random_matrix("Q8_0", 9, 64, rng)
    for n in (1, 4):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        out = np.full((n, 9), np.nan, np.float32)
        y = nb.matmul(x, w, "Q8_0", out=out)
        assert y is out
        assert rel_err(out, reference(x, w, "Q8_0")) <= REL_TOL


def test_one_dimensional_x_is_one_token():
    rng = np.random.default_rng(16)
    w = random_matrix("Q6_K", 5, 512, rng)
    x = rng.standard_normal(512).astype(np.float32)
    y = nb.matmul(x, w, "Q6_K")
    assert y.shape == (5,)
    assert rel_err(y, reference(x[None], w, "Q6_K")[0]) <= REL_TOL


def test_read_only_inputs_and_empty_shapes():
    rng = np.random.default_rng(13)
    w = random_matrix("Q5_0", 8, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    w.flags.writeable = False
    x.flags.writeable = False
    assert rel_err(nb.matmul(x, w, "Q5_0"), reference(x, w, "Q5_0")) <= REL_TOL
    assert nb.matmul(np.zeros((0, 64), np.float32), w, "Q5_0").shape == (0, 8)
    assert nb.matmul(x, w[:0], "Q5_0").shape == (2, 0)


def test_validation_errors():
    rng = np.random.default_rng(14)
    w = random_matrix("Q4_0", 4, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    bad = minirt.InvalidRequestError
    with pytest.raises(bad, match="float32"):
        nb.matmul(x.astype(np.float64), w, "Q4_0")
    with pytest.raises(bad, match="shape"):
        nb.matmul(x.reshape(1, 2, 64), w, "Q4_0")
    with pytest.raises(bad, match="overlap"):
        buf = np.zeros((2, 64), np.float32)
        nb.matmul(buf, random_matrix("Q4_0", 64, 64, rng), "Q4_0", out=buf)
    with pytest.raises(bad, match="C-contiguous"):
        nb.matmul(np.asfortranarray(np.ones((2, 64), np.float32)), w, "Q4_0")
    with pytest.raises(bad, match="bytes per row"):
        nb.matmul(np.ones((2, 96), np.float32), w, "Q4_0")
    with pytest.raises(bad, match="multiple of 32"):
        nb.matmul(np.ones((2, 48), np.float32), w, "Q4_0")
    with pytest.raises(bad, match="uint8"):
        nb.matmul(x, w.view(np.int8), "Q4_0")
    with pytest.raises(bad, match="C-contiguous"):
        nb.matmul(x, np.asfortranarray(w), "Q4_0")
    with pytest.raises(bad, match="out must be float32"):
        nb.matmul(x, w, "Q4_0", out=np.empty((2, 5), np.float32))
    with pytest.raises(bad, match="out must be float32"):
        nb.matmul(x, w, "Q4_0", out=np.empty((2, 4), np.float64))
    with pytest.raises(bad, match="writeable"):
        out = np.empty((2, 4), np.float32)
        out.flags.writeable = False
        nb.matmul(x, w, "Q4_0", out=out)
    with pytest.raises(minirt.UnsupportedQuantError, match="NVFP4"):
        nb.matmul(x, w, "NVFP4")
    with pytest.raises(minirt.UnsupportedQuantError, match="unknown"):
        nb.matmul(x, w, "Q4_9")


def test_real_tensors(real_model, threads):
    """For each quant type a real model uses: its first 2-D tensor, plus the token embedding."""
    key, path = real_model
    threads(2)
    rng = np.random.default_rng(15)
    f = minirt.gguf.open(path)
    try:
        picked = {}
        for name, t in f.tensors.items():
            if len(t.shape) == 2 and t.qtype != "F32":
                picked.setdefault(t.qtype, name)
        names = sorted(set(picked.values()) | {"token_embd.weight"})
        assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= set(picked), picked
        for name in names:
            t = f.tensors[name]
            w = t.data[:2048]  # the embedding matrices are large; 2048 rows are plenty
            cols = t.shape[1]
            for n_tokens in (1, 7):
                # activations with an outlier channel, as real hidden states have
                x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
                x[:, 3] *= 30
                y = nb.matmul(x, w, t.qtype)
                err = rel_err(y, reference(x, w, t.qtype))
                assert err <= REL_TOL, (key, name, t.qtype, n_tokens, err)
    finally:
        f.close()


def test_warmup_compiles_every_requested_type():
    nb.warmup(["Q8_0", "Q4_K"], prefill=True)
    assert nb._DRIVERS["Q8_0"].decode._dispatcher is not None
    assert nb._DRIVERS["Q4_K"].prefill._dispatcher is not None


def test_tbb_preload_is_a_no_op_without_the_library_or_after_start():
    assert nb._preload_tbb(("/nonexistent-prefix",)) is None
    nb.matmul(np.ones((1, 32), np.float32), np.zeros((1, 34), np.uint8), "Q8_0")  # threads started
    assert nb._preload_tbb() is None


def test_gelu_erf_against_math_erf():
    """The numba backend's erf GELU (A&S 7.1.26 in float32, as the native kernel): within 2.5e-7·|x| plus
    float32 rounding of math.erf's GELU in float64, the tails exact."""
    import math

    rng = np.random.default_rng(24)
    x = (rng.standard_normal((5, 333)) * 6).astype(np.float32)
    x[0, :3] = [-100.0, 100.0, 0.0]
    x64 = x.astype(np.float64)
    want = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    got = nb.gelu_erf(x)
    assert got.shape == x.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= 2.5e-7 * np.abs(x64) + 2e-7 * np.abs(want))
    assert got[0, 0] == 0.0 and got[0, 1] == 100.0
    backend = minirt.kernels.get_backend("numba")
    np.testing.assert_array_equal(backend.activation(x, "gelu"), got)
