"""Quant formats: the numpy specs against gguf-py, the numba row kernels against the specs,
the registry, and every tensor of both real models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minirt
from minirt.quants import SUPPORTED_TYPES, QuantSpec, dequantize, get_spec
from minirt.quants._random import F16_FIELDS, random_blocks
from minirt.quants.types import GGML_TYPES

try:  # gguf-py (llama.cpp's Python package) is the reference implementation
    import gguf.quants as gq
    from gguf import GGMLQuantizationType
except ImportError:  # pragma: no cover
    gq = None
needs_gguf = pytest.mark.skipif(gq is None, reason="gguf-py (pip install gguf) is needed as the reference")

# checked against committed fixtures of gguf-py's and ggml's C output (tools/quant_fixtures), so these
# tests run without gguf-py
FIXTURE_TYPES = ("MXFP4", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")
EXPECTED = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K", "Q8_K", "IQ4_NL", "IQ4_XS") + FIXTURE_TYPES
# gguf-py has no Q8_K dequantizer (it is an activation-only type in ggml)
GGUF_TYPES = tuple(t for t in EXPECTED if t != "Q8_K" and t not in FIXTURE_TYPES)
FIXTURES = Path(__file__).resolve().parent / "data" / "quants"


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def gguf_dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    return gq.dequantize(blocks, GGMLQuantizationType[qtype]).reshape(blocks.shape[0], -1).astype(np.float32)


def numba_rows(blocks_2d: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    from minirt.kernels import numba_backend

    return numba_backend.dequantize(np.ascontiguousarray(blocks_2d), qtype, cols)


# ---------------------------------------------------------------------------------------------
# registry


def test_supported_types_are_the_documented_ones():
    assert set(SUPPORTED_TYPES) == set(EXPECTED)
    for name in SUPPORTED_TYPES:
        spec = get_spec(name)
        assert isinstance(spec, QuantSpec)
        assert spec.name == name
        table = GGML_TYPES[spec.ggml.id]
        assert (spec.block_size, spec.type_size) == (table.block_size, table.type_size)


def test_get_spec_accepts_name_lowercase_id_and_type():
    spec = get_spec("Q4_K")
    assert get_spec("q4_k") is spec
    assert get_spec(12) is spec
    assert get_spec(spec.ggml) is spec


@pytest.mark.parametrize("name", ["NVFP4", "Q1_0", "Q8_1", "I8"])
def test_known_but_unsupported_types_raise_naming_the_type(name):
    with pytest.raises(minirt.UnsupportedQuantError, match=name):
        get_spec(name)


@pytest.mark.parametrize("key", ["Q9_9", "", 999, -1])
def test_unknown_types_raise(key):
    with pytest.raises(minirt.UnsupportedQuantError, match="unknown ggml type"):
        get_spec(key)


def test_import_does_not_load_numba():
    code = "import sys, minirt, minirt.quants; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_row_bytes_rejects_partial_blocks():
    with pytest.raises(minirt.InvalidRequestError, match="multiple of 256"):
        get_spec("Q4_K").row_bytes(896)
    assert get_spec("Q4_K").row_bytes(512) == 288


# ---------------------------------------------------------------------------------------------
# numpy spec vs gguf-py, numba row kernel vs spec: random blocks


@needs_gguf
@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_spec_matches_gguf_on_random_blocks(qtype):
    rng = np.random.default_rng(sum(map(ord, qtype)))
    spec = get_spec(qtype)
    n = 4096 if spec.block_size == 1 else 97
    blocks = random_blocks(qtype, n, rng)
    mine = spec.dequantize_blocks(blocks)
    assert mine.dtype == np.float32 and mine.shape == (n, spec.block_size)
    assert bits_equal(mine, gguf_dequantize(blocks, qtype))


def _nan_aware_equal(got: np.ndarray, want: np.ndarray) -> bool:
    """Same bits where want is not NaN, NaN where it is (NaN sign and payload are not part of a format)."""
    nan = np.isnan(want)
    return (got.shape == want.shape and np.array_equal(np.isnan(got), nan)
            and bits_equal(got[~nan], want[~nan]))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("qtype", FIXTURE_TYPES)
def test_spec_and_numba_match_committed_reference_fixtures(qtype):
    """Random blocks (last two: raw bytes, scale fields included) against gguf-py's / ggml's output."""
    fx = np.load(FIXTURES / f"{qtype}.npz")
    blocks, want = fx["blocks"], fx["values"]
    spec = get_spec(qtype)
    assert blocks.shape[1] == spec.type_size and want.shape == (blocks.shape[0], spec.block_size)
    assert np.isfinite(want[:-2]).all()
    with np.errstate(invalid="ignore", over="ignore"):
        assert _nan_aware_equal(spec.dequantize_blocks(blocks), want)
        assert _nan_aware_equal(dequantize(blocks, qtype, want.shape), want)
    got = numba_rows(blocks.reshape(1, -1), qtype, want.size).reshape(want.shape)
    assert _nan_aware_equal(got, want)


def test_iq_grids_have_the_documented_shape_and_values():
    from minirt.quants import iqgrids

    g = iqgrids.grid("iq2xxs")
    assert g.shape == (256, 8) and set(np.unique(g)) <= {0x08, 0x19, 0x2B}
    assert iqgrids.grid("iq3s").shape == (512, 4) and set(np.unique(iqgrids.grid("iq3s"))) <= set(range(1, 16, 2))
    assert set(np.unique(iqgrids.grid("iq1s").view(np.int8))) == {-1, 0, 1}
    # ggml's ksigns_iq2xs starts 0, 129, 130, 3, 132: bit 7 = parity of the low 7 bits
    assert list(iqgrids.KSIGNS[:5]) == [0, 129, 130, 3, 132] and iqgrids.KSIGNS[127] == 255


def test_q8_k_spec_is_d_times_q():
    # ggml block_q8_K: float32 d, int8 qs[256], int16 bsums[16]; x = d * q
    rng = np.random.default_rng(8)
    blocks = random_blocks("Q8_K", 9, rng)
    d = np.frombuffer(blocks[:, :4].tobytes(), dtype="<f4").reshape(9, 1)
    q = blocks[:, 4:260].view(np.int8).astype(np.float32)
    assert bits_equal(get_spec("Q8_K").dequantize_blocks(blocks), d * q)
    assert bits_equal(get_spec("Q8_K").dequantize_blocks(blocks[:1])[0, :3], d[0] * q[0, :3])


@pytest.mark.parametrize("qtype", EXPECTED)
@pytest.mark.parametrize("rows,blocks_per_row", [(3, 5), (1, 40), (7, 1)])
def test_numba_row_kernel_matches_spec(qtype, rows, blocks_per_row):
    spec = get_spec(qtype)
    rng = np.random.default_rng(rows * 1000 + blocks_per_row)
    bpr = blocks_per_row * (64 if spec.block_size == 1 else 1)
    blocks = random_blocks(qtype, rows * bpr, rng)
    cols = bpr * spec.block_size
    want = spec.dequantize_blocks(blocks).reshape(rows, cols)
    got = numba_rows(blocks.reshape(rows, -1), qtype, cols)
    assert bits_equal(got, want)
    # the row kernel called directly on one row
    one = np.empty(cols, np.float32)
    spec.row_kernel(np.ascontiguousarray(blocks.reshape(rows, -1)[rows - 1]), one)
    assert bits_equal(one, want[rows - 1])


# Arbitrary bytes, scale fields included: subnormal, negative zero, inf and NaN scales.
@needs_gguf
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("qtype", GGUF_TYPES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_arbitrary_bytes_spec_vs_gguf_vs_numba(qtype, data):
    spec = get_spec(qtype)
    n = data.draw(st.integers(1, 6), label="blocks")
    raw = data.draw(st.binary(min_size=n * spec.type_size, max_size=n * spec.type_size), label="bytes")
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(n, spec.type_size)
    mine = spec.dequantize_blocks(blocks)
    assert bits_equal(mine, gguf_dequantize(blocks, qtype))  # same operations, same NaN payloads
    got = numba_rows(blocks.reshape(1, -1), qtype, n * spec.block_size)[0]
    want = mine.reshape(-1)
    np.testing.assert_array_equal(got, want)  # NaN where the spec has NaN
    finite = np.isfinite(want)
    assert bits_equal(got[finite], want[finite])  # and exact bits (sign of zero too) elsewhere


@needs_gguf
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("qtype", [q for q in F16_FIELDS if q in GGUF_TYPES])
def test_special_scale_values(qtype):
    """Subnormal, zero, negative, max and inf float16 scales convert exactly in both paths."""
    spec = get_spec(qtype)
    specials = np.array([0.0, -0.0, 6e-8, -3e-5, 6.1e-5, 65504.0, -65504.0, np.inf], dtype=np.float16)
    rng = np.random.default_rng(3)
    blocks = random_blocks(qtype, len(specials), rng)
    for off in F16_FIELDS[qtype]:
        blocks[:, off:off + 2] = specials.view(np.uint8).reshape(-1, 2)
    mine = spec.dequantize_blocks(blocks)
    np.testing.assert_array_equal(mine, gguf_dequantize(blocks, qtype))
    got = numba_rows(blocks.reshape(1, -1), qtype, blocks.shape[0] * spec.block_size)[0]
    np.testing.assert_array_equal(got, mine.reshape(-1))


@needs_gguf
@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_every_16_bit_pattern(qtype):
    """All 65536 float16/bfloat16 values, NaN payloads included, convert to the same bits."""
    halves = np.arange(65536, dtype=np.uint32).astype("<u2")
    blocks = halves.view(np.uint8).reshape(-1, 2)
    want = gguf_dequantize(blocks, qtype).reshape(-1)
    assert bits_equal(get_spec(qtype).dequantize_blocks(blocks).reshape(-1), want)
    assert bits_equal(numba_rows(blocks.reshape(1, -1), qtype, 65536)[0], want)


# ---------------------------------------------------------------------------------------------
# dequantize(): shapes and errors


@needs_gguf
def test_dequantize_any_leading_shape():
    rng = np.random.default_rng(5)
    blocks = random_blocks("Q6_K", 2 * 3 * 2, rng)
    data = blocks.reshape(2, 3, 2 * 210)
    out = dequantize(data, "Q6_K", (2, 3, 512))
    assert out.shape == (2, 3, 512) and out.dtype == np.float32
    assert bits_equal(out.reshape(-1, 256), gguf_dequantize(blocks, "Q6_K"))


def test_dequantize_large_input_is_chunked_consistently(monkeypatch):
    import minirt.quants as mq

    rng = np.random.default_rng(6)
    blocks = random_blocks("Q4_K", 50, rng)
    whole = dequantize(blocks, "Q4_K", (10, 5 * 256))
    monkeypatch.setattr(mq, "_CHUNK_BLOCKS", 7)
    assert bits_equal(dequantize(blocks, "Q4_K", (10, 5 * 256)), whole)


def test_dequantize_errors():
    blocks = np.zeros((4, 18), np.uint8)
    with pytest.raises(minirt.InvalidRequestError, match="does not match shape"):
        dequantize(blocks, "Q4_0", (4, 64))
    with pytest.raises(minirt.InvalidRequestError, match="multiple of 32"):
        dequantize(blocks, "Q4_0", (2, 36))
    with pytest.raises(minirt.InvalidRequestError, match="uint8"):
        dequantize(blocks.astype(np.int8), "Q4_0", (4, 32))
    with pytest.raises(minirt.UnsupportedQuantError, match="NVFP4"):
        dequantize(blocks, "NVFP4", (4, 64))


# ---------------------------------------------------------------------------------------------
# every tensor of both real models

_CHUNK_ROWS = 16384


@needs_gguf
@pytest.mark.slow
def test_every_tensor_of_real_model(real_model):
    """numpy spec == gguf-py and numba row kernels == spec, bit for bit, on every tensor."""
    from minirt.kernels import numba_backend

    key, path = real_model
    f = minirt.gguf.open(path)
    seen = set()
    try:
        for name, t in f.tensors.items():
            assert t.qtype in SUPPORTED_TYPES, f"{name}: {t.qtype}"
            seen.add(t.qtype)
            cols = t.shape[-1]
            rows = t.data.reshape(-1, t.row_bytes)
            for start in range(0, rows.shape[0], _CHUNK_ROWS):
                chunk = rows[start:start + _CHUNK_ROWS]
                ref = gq.dequantize(chunk, GGMLQuantizationType[t.qtype]).astype(np.float32)
                mine = dequantize(chunk, t.qtype, (chunk.shape[0], cols))
                assert bits_equal(mine, ref), f"{key} {name} rows {start}+: numpy spec != gguf"
                got = numba_backend.dequantize(chunk, t.qtype, cols)
                assert bits_equal(got, mine), f"{key} {name} rows {start}+: numba row kernel != spec"
    finally:
        f.close()
    assert {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= seen


@needs_gguf
def test_gguf_tensor_dequantize_uses_the_spec(qwen_path):
    f = minirt.gguf.open(qwen_path)
    try:
        for name in ("blk.0.ffn_down.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"):
            t = f.tensors[name]
            ref = gq.dequantize(t.data, GGMLQuantizationType[t.qtype])
            got = t.dequantize()
            assert got.shape == t.shape and got.dtype == np.float32
            assert bits_equal(got, ref), name
    finally:
        f.close()
