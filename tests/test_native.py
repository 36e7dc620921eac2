"""Native (C / cffi) kernels against float64 references built from gguf-py's dequantizers.

Every quant type, odd shapes, 1..17 tokens, 1..4 threads, every ISA this CPU runs plus the scalar
one; error bounds derived from the activation quantization; real tensors of both models; input
validation; the GIL being released; the helpers (RMSNorm, RoPE, softmax, attention) against numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

import minirt
from minirt.kernels import native

REPO = Path(__file__).resolve().parents[1]

# their reference is minirt's numpy spec, itself checked against committed gguf-py / ggml fixtures
# (tests/test_quants.py), so no gguf-py version with these types is needed here
LOWBIT = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"]
QTYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
          "Q6_K", "IQ4_NL", "IQ4_XS"] + LOWBIT

# byte offsets of the f16 scale fields inside one block (random bytes there could spell inf/NaN)
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
    "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
}


def isas_to_test() -> list[str]:
    try:
        native._load()
    except minirt.BackendError:
        return ["scalar"]
    return [i for i in native.supported_isas() if i in ("scalar", "avx2", "avx512", "avx512_amx", "neon")]


def random_weights(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """(rows, row_bytes) uint8: random blocks (every bit pattern) with finite f16 scales."""
    if qtype == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    if qtype == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qtype == "BF16":
        f = rng.standard_normal((rows, cols)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype in LOWBIT:
        from minirt.quants._random import random_matrix

        return np.ascontiguousarray(random_matrix(qtype, rows, cols, rng))
    bs, ts = quants.GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.uniform(0.002, 0.05, size=raw.shape[:2]) * rng.choice([-1, 1], size=raw.shape[:2]))
        raw[..., off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return np.ascontiguousarray(raw.reshape(rows, -1))


def ref_weights(w: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    if qtype in LOWBIT:
        from minirt.quants import dequantize

        return dequantize(w, qtype, (w.shape[0], cols)).astype(np.float64)
    out = quants.dequantize(w, GGMLQuantizationType[qtype])
    return np.asarray(out, dtype=np.float64).reshape(w.shape[0], cols)


def _has_amx() -> bool:
    try:
        return "avx512_amx" in native.supported_isas()
    except minirt.BackendError:
        return False


def _has_amx_int8() -> bool:
    """The avx512_amx ISA with its int8-tile GEMM: the CPU flag, and MINIRT_AMX_INT8 not 0."""
    cpu = Path("/proc/cpuinfo")
    flags = cpu.read_text() if cpu.exists() else ""
    return _has_amx() and " amx_int8" in flags and os.environ.get("MINIRT_AMX_INT8") != "0"


def _amx8_min_tokens(qtype: str) -> int:
    """Where packed matrices take the int8-tile GEMM (the documented thresholds, x86_amx.c's MR_AMX8_MIN_TOKENS*)."""
    return 13 if qtype == "Q6_K" else 10


def error_bound(x: np.ndarray, W: np.ndarray, path: str) -> np.ndarray:
    """Per-element bound on |Y - Y64| (n_tokens, rows).

    int16 path: each activation is rounded to a multiple of its 32-block's max / 32767, an error of at
    most half a step, so |err| <= sum_i |W_ri| * amax_b(i) / 65534 (+ float32 rounding of the sums);
    int8 path: the same with 256-element blocks and max / 127.
    Float paths: float32 accumulation only. The float32 term is 2e-6 * sum_i |W_ri x_i| (about 32
    float32 roundings relative to the absolute sum: the kernels sum in 16-lane partial sums).
    AMX path: weights and activations each split into two bf16 (see native/x86_amx.c); amx-int8: the int16 GEMM's.
    """
    x64 = x.astype(np.float64)
    absdot = np.abs(x64) @ np.abs(W).T
    fp = 2e-6 * absdot + 1e-30
    if path == "amx-bf16":  # each factor hi + lo bf16 within 2^-16 of it, lo * lo left out: 3 * 2^-16 per product
        return 5e-5 * absdot + fp
    if path not in ("int16", "int16-gemm", "amx-int8", "int8"):
        return fp
    # int8 path: one scale per 256 elements, max / 127 (llama.cpp's q8_K), half a step of error
    blk, half_steps = (256, 254.0) if path == "int8" else (32, 65534.0)
    nt, cols = x.shape
    amax = np.abs(x64).reshape(nt, cols // blk, blk).max(axis=2)        # (nt, cols/blk)
    step = np.repeat(amax, blk, axis=1) / half_steps                    # (nt, cols)
    return step @ np.abs(W).T + fp


def check_matmul(rng, qtype, rows, cols, nt, threads, isa, x=None):
    w = random_weights(rng, qtype, rows, cols)
    W = ref_weights(w, qtype, cols)
    if x is None:
        x = rng.standard_normal((nt, cols)).astype(np.float32)
    y = native.matmul(x, w, qtype, threads=threads, isa=isa)
    assert y.shape == (nt, rows) and y.dtype == np.float32
    ref = x.astype(np.float64) @ W.T
    bound = error_bound(x, W, native.matmul_path(qtype, nt, isa=isa))
    err = np.abs(y - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (
        f"{qtype} isa={isa} rows={rows} cols={cols} nt={nt} threads={threads}: |err| {err[worst]:.3g} > "
        f"bound {bound[worst]:.3g} at {worst}")
    return y, ref


# -------------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("isa", isas_to_test())
@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_random_blocks(nat, qtype, isa):
    rng = np.random.default_rng(hash((qtype, isa)) % 2**32)
    block = native.QTYPES[qtype][1]
    bunit = max(block, 32)
    # (rows, blocks per row, n_tokens, threads): odd row counts, 1..many blocks, 1..17 tokens, 1..4 threads
    cases = [(1, 1, 1, 1), (7, 1, 2, 2), (37, 2, 3, 3), (19, 3, 4, 4), (70, 5, 5, 2), (9, 1, 7, 1),
             (33, 2, 17, 3), (3, 4, 1, 4)]
    for rows, nb, nt, th in cases:
        check_matmul(rng, qtype, rows, nb * bunit, nt, th, isa)


@pytest.mark.parametrize("isa", isas_to_test())
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16", "IQ4_NL", "MXFP4", "Q3_K", "Q2_K", "TQ2_0"])
def test_matmul_chunk_boundaries(nat, qtype, isa):
    """Row counts that leave partial chunks / tiles, K spanning several tile chunks (> 1024)."""
    rng = np.random.default_rng(7)
    for rows, cols, nt in [(1001, 256, 1), (263, 1280, 4), (97, 2304, 6), (41, 512, 128), (75, 768, 29)]:
        for th in (1, 2, 3):
            check_matmul(rng, qtype, rows, cols, nt, th, isa)


@pytest.mark.parametrize("isa", isas_to_test())
def test_matmul_mxfp4_exponent_range(nat, isa):
    """MXFP4 e8m0 scales on both sides of the float32 subnormal edge (bytes 0 and 1 decode to
    subnormals, 2 and up to normals) and far from it, so every scale decoder (scalar, gathered,
    table) is checked where the bit tricks differ."""
    rng = np.random.default_rng(11)
    regimes = [(np.array([0, 1, 2, 3], np.uint8), 1e30),             # tiny scales x huge activations
               (np.array([0, 1, 2, 100, 127, 128, 140], np.uint8), 1.0)]
    for exps, xscale in regimes:
        for rows, nb, nt in [(9, 37, 1), (6, 17, 2), (5, 33, 4)]:
            w = random_weights(rng, "MXFP4", rows, nb * 32).reshape(rows, nb, 17)
            w[..., 0] = rng.choice(exps, size=(rows, nb))
            w = np.ascontiguousarray(w.reshape(rows, nb * 17))
            W = ref_weights(w, "MXFP4", nb * 32)
            x = (rng.standard_normal((nt, nb * 32)) * xscale).astype(np.float32)
            y = native.matmul(x, w, "MXFP4", threads=2, isa=isa)
            ref = x.astype(np.float64) @ W.T
            bound = error_bound(x, W, native.matmul_path("MXFP4", nt, isa=isa))
            assert np.all(np.abs(y - ref) <= bound), (isa, exps, rows, nb, nt)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "TQ2_0", "Q4_K", "MXFP4"])
def test_matmul_non_finite_activations_reach_the_output(nat, qtype):
    """A NaN or an infinity in a token's activations makes that token's outputs non-finite (as the float
    product would) on every path and ISA, the int8 activations included; the other tokens are untouched."""
    rng = np.random.default_rng(13)
    w = random_weights(rng, qtype, 9, 512)
    for bad in (np.nan, np.inf):
        for nt in (1, 3, 16):
            x = rng.standard_normal((nt, 512)).astype(np.float32)
            x[0, 300] = bad
            for isa in isas_to_test():
                y = native.matmul(x, w, qtype, threads=2, isa=isa)
                assert not np.isfinite(y[0]).any(), (qtype, bad, nt, isa, native.matmul_path(qtype, nt, isa=isa))
                assert np.isfinite(y[1:]).all(), (qtype, bad, nt, isa)


def test_matmul_float_types_any_cols(nat):
    """F32/F16/BF16 rows need not be a multiple of 32."""
    rng = np.random.default_rng(3)
    for isa in isas_to_test():
        for q in ("F32", "F16", "BF16"):
            for cols in (1, 13, 31, 47):
                for nt in (1, 2, 5):
                    check_matmul(rng, q, 11, cols, nt, 2, isa)


def test_matmul_1d_and_out(nat):
    rng = np.random.default_rng(1)
    w = random_weights(rng, "Q8_0", 40, 64)
    x = rng.standard_normal(64).astype(np.float32)
    y1 = native.matmul(x, w, "Q8_0")
    assert y1.shape == (40,)
    out = np.full((1, 40), np.nan, np.float32)
    r = native.matmul(x[None], w, "q8_0", out=out)
    assert r is out
    np.testing.assert_array_equal(out[0], y1)


def test_threads_and_isas_agree(nat):
    """Same input: every thread count gives bit-identical results (rows are independent)."""
    rng = np.random.default_rng(5)
    w = random_weights(rng, "Q4_K", 301, 1024)
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    for isa in isas_to_test():
        ys = [native.matmul(x, w, "Q4_K", threads=t, isa=isa) for t in (1, 2, 3, 4, 8)]
        for y in ys[1:]:
            np.testing.assert_array_equal(y, ys[0])


def test_paths(nat):
    for isa in isas_to_test():
        if isa == "scalar":
            assert native.matmul_path("Q4_K", 1, isa=isa) == "float-dot"
        else:
            for q in ("Q4_K", "Q5_0", "Q6_K", "Q8_0", "Q2_K", "Q3_K", *LOWBIT):
                # AVX-512 decodes the 2-bit-code super-block types, the i-quants and TQ1_0 with int8
                # activations (q8_K-like)
                int16 = ("Q4_K", "Q5_0", "Q6_K", "Q8_0", "MXFP4")
                want = "int8" if isa.startswith("avx512") and q not in int16 else "int16"
                assert native.matmul_path(q, 1, isa=isa) == want
                assert native.matmul_path(q, 4, isa=isa) == want
        if isa == "avx512":  # the int8 kernels run prefills up to 64 tokens, then the float panel (Q2_K and
            # TQ2_0, one int32 sum per super-block, at any count)
            for q in ("Q2_K", "TQ2_0"):
                assert native.matmul_path(q, 512, isa=isa) == "int8"
                assert native.matmul_path(q, 4096, isa=isa) == "int8"
            assert native.matmul_path("Q3_K", 64, isa=isa) == "int8"
            assert native.matmul_path("Q3_K", 65, isa=isa) == "float-panel"
            assert native.matmul_path("MXFP4", 8, isa=isa) == "int16"
            assert native.matmul_path("MXFP4", 9, isa=isa) == "float-tile"
            assert native.matmul_path("IQ2_XXS", 64, isa=isa) == "int8"
            assert native.matmul_path("IQ2_XXS", 65, isa=isa) == "float-panel"
            assert native.matmul_path("IQ1_M", 48, isa=isa) == "int8"
            assert native.matmul_path("IQ1_M", 49, isa=isa) == "float-panel"
        if isa == "avx512_amx":  # as avx512 below 64 tokens; from 64 on every type takes the AMX tiles
            for q in ("Q4_K", "Q5_0", "Q6_K", "Q8_0", "Q2_K", "Q3_K", "F16", *LOWBIT):
                assert native.matmul_path(q, 64, isa=isa) == "amx-bf16", q
                # none: no packing; packed types of the int8-tile GEMM keep it up to 255 tokens
                int8 = _has_amx_int8() and q in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
                want = ("amx-int8",) if int8 else ("amx-bf16", "none")
                assert native.matmul_path(q, 64, isa=isa, packed=True) in want, q
            assert native.matmul_path("Q3_K", 63, isa=isa) == "int8"
            gemm = "amx-int8" if _has_amx_int8() else "int16-gemm"
            assert native.matmul_path("Q4_K", 63, isa=isa, packed=True) == gemm
            assert native.matmul_path("Q6_K", 17, isa=isa, packed=True) == gemm
            if _has_amx_int8():  # packed Q4_0 / Q5_0 / Q8_0 / Q4_K from 10 tokens to 255 (then bf16), Q6_K from 13
                for q in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"):
                    n0 = _amx8_min_tokens(q)
                    assert native.matmul_path(q, n0 - 1, isa=isa, packed=True) == "int16", q
                    assert native.matmul_path(q, n0, isa=isa, packed=True) == "amx-int8", q
                    assert native.matmul_path(q, 255, isa=isa, packed=True) == "amx-int8", q
                    assert native.matmul_path(q, 256, isa=isa, packed=True) == "amx-bf16", q
        if isa == "avx2":  # the i-quants' row kernels up to 16 tokens
            assert native.matmul_path("IQ2_XXS", 16, isa=isa) == "int16"
            assert native.matmul_path("IQ2_XXS", 17, isa=isa) != "int16"
        assert native.matmul_path("Q4_K", 8, isa=isa) == "float-tile"
        assert native.matmul_path("Q4_K", 64, isa=isa) == {"avx512": "float-panel", "avx512_amx": "amx-bf16"}.get(
            isa, "float-tile")


def test_isa_env_var(nat):
    code = "from minirt.kernels import native; print(native.info()['isa'])"
    for isa in isas_to_test():
        env = dict(os.environ, MINIRT_ISA=isa, PYTHONPATH=str(REPO))
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == isa


def test_info(nat):
    info = native.info()
    assert info["isa"] in info["isas"] and "scalar" in info["isas"]
    assert info["threads"] >= 1 and info["physical_cores"] >= 1
    assert info["build_path"] and os.path.exists(info["build_path"])
    old = native.get_threads()
    try:
        assert native.set_threads(3) == 3 and native.get_threads() == 3
        assert native.set_threads(None) == info["physical_cores"]
    finally:
        native.set_threads(old)


# -------------------------------------------------------------------------------- accuracy on real tensors


def q8_0_activation_error(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """|error| llama.cpp's int8 (Q8_0, per-32) activation quantization gives on the same product."""
    nt, cols = x.shape
    xb = x.astype(np.float64).reshape(nt, cols // 32, 32)
    d = np.abs(xb).max(axis=2, keepdims=True) / 127.0
    q = np.where(d > 0, np.round(xb / np.where(d > 0, d, 1)), 0)
    xq = (q * d).reshape(nt, cols)
    return np.abs(xq @ W.T - x.astype(np.float64) @ W.T)


@pytest.mark.parametrize("model", ["qwen", "gemma"])
def test_real_tensors(nat, model, request):
    path = request.getfixturevalue(f"{model}_path")
    f = minirt.gguf.open(path)
    rng = np.random.default_rng(11)
    seen = set()
    for name, t in f.tensors.items():
        if t.qtype == "F32" or len(t.shape) != 2 or (t.qtype, t.shape) in seen:
            continue
        seen.add((t.qtype, t.shape))
        rows = min(t.shape[0], 512)  # the vocabulary matrices: their first rows
        w = np.ascontiguousarray(t.data.reshape(t.shape[0], -1)[:rows])
        W = t.dequantize().reshape(t.shape)[:rows].astype(np.float64)
        cols = t.shape[1]
        # activations with outlier channels, as hidden states have
        x = rng.standard_normal((5, cols)).astype(np.float32)
        x[:, rng.choice(cols, 4, replace=False)] *= 30
        ref = x.astype(np.float64) @ W.T
        for isa in isas_to_test():
            for nt in (1, 4, 5):
                xs = np.ascontiguousarray(x[:nt])
                y = native.matmul(xs, w, t.qtype, isa=isa)
                err = np.abs(y - ref[:nt])
                bound = error_bound(xs, W, native.matmul_path(t.qtype, nt, isa=isa))
                assert np.all(err <= bound), f"{model} {name} {isa} nt={nt}"
                rel = err.max() / np.abs(ref[:nt]).max()
                assert rel < 5e-4, f"{model} {name} {isa} nt={nt}: relative error {rel:.2e}"
                # far more accurate than int8 activations (llama.cpp's Q8_0 / Q8_K)
                llama_like = q8_0_activation_error(xs, W)
                assert err.mean() < 0.1 * llama_like.mean(), f"{model} {name} {isa} nt={nt}"


# -------------------------------------------------------------------------------- validation


def test_validation_errors(nat):
    rng = np.random.default_rng(0)
    w = random_weights(rng, "Q8_0", 8, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    bad = [
        (dict(x=x.astype(np.float64)), minirt.InvalidRequestError, "float32"),
        (dict(x=x[:, ::2].copy()), minirt.InvalidRequestError, "32 columns need 34"),
        (dict(x=np.ones((2, 128), np.float32)[:, ::2]), minirt.InvalidRequestError, "contiguous"),
        (dict(x=np.ones((1, 2, 64), np.float32)), minirt.InvalidRequestError, "shape"),
        (dict(w=w.view(np.int8)), minirt.InvalidRequestError, "uint8"),
        (dict(w=w[:, :-2].copy()), minirt.InvalidRequestError, "bytes per row"),
        (dict(w=w.ravel()), minirt.InvalidRequestError, "rows, row_bytes"),
        (dict(qtype="Q8_1"), minirt.UnsupportedQuantError, "Q8_1"),
        (dict(qtype="NVFP4"), minirt.UnsupportedQuantError, "NVFP4"),
        (dict(qtype="NOPE"), minirt.UnsupportedQuantError, "NOPE"),
        (dict(qtype=40), minirt.UnsupportedQuantError, "40"),
        (dict(out=np.empty((2, 7), np.float32)), minirt.InvalidRequestError, "shape"),
        (dict(out=np.empty((2, 8), np.float64)), minirt.InvalidRequestError, "float32"),
        (dict(threads=0), minirt.InvalidRequestError, "threads"),
        (dict(isa="sse9"), minirt.InvalidRequestError, "ISA"),
    ]
    for kw, exc, text in bad:
        args = dict(x=x, w=w, qtype="Q8_0")
        args.update(kw)
        with pytest.raises(exc, match=text):
            native.matmul(**args)
    with pytest.raises(minirt.InvalidRequestError, match="multiple of the block"):
        native.matmul(np.ones((1, 48), np.float32), np.zeros((2, 51), np.uint8), "Q8_0")
    with pytest.raises(minirt.InvalidRequestError, match="overlap"):
        buf = np.zeros((1, 64), np.float32)
        native.matmul(buf, random_weights(rng, "Q8_0", 64, 64), "Q8_0", out=buf)
    ro = np.ones((1, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(minirt.InvalidRequestError, match="writeable"):
        native.matmul(x[:1], w, "Q8_0", out=ro)


def test_unsupported_isa_is_refused(nat):
    missing = [i for i in ("avx2", "avx512", "neon") if i not in native.supported_isas()]
    if not missing:
        pytest.skip("this CPU runs every ISA the library has")
    with pytest.raises(minirt.BackendError, match="not supported"):
        native.matmul(np.ones((1, 32), np.float32), np.zeros((1, 34), np.uint8), "Q8_0", isa=missing[0])


# -------------------------------------------------------------------------------- GIL and concurrency


def test_gil_released(nat):
    """While one long native matmul runs in a thread, Python code keeps running in another: the
    longest pause of the watching loop stays far below the duration of the call."""
    rng = np.random.default_rng(2)
    w = random_weights(rng, "Q8_0", 40000, 1024)
    x = rng.standard_normal((128, 1024)).astype(np.float32)
    span = {}

    def call():
        span["t0"] = time.perf_counter()
        native.matmul(x, w, "Q8_0", threads=1)
        span["t1"] = time.perf_counter()

    th = threading.Thread(target=call)
    stamps = []
    th.start()
    while th.is_alive():
        stamps.append(time.perf_counter())
    th.join()
    inside = [t for t in stamps if span["t0"] <= t <= span["t1"]]
    duration = span["t1"] - span["t0"]
    assert duration > 0.05, "the call is too short to tell"
    assert len(inside) > 10, f"the watching loop ran {len(inside)} times during a {duration:.3f} s call"
    gaps = np.diff([span["t0"], *inside, span["t1"]])
    # with the GIL held the loop would stop for the whole call
    assert gaps.max() < duration / 3, f"longest pause {gaps.max():.3f} s of a {duration:.3f} s call"


def test_concurrent_callers(nat):
    rng = np.random.default_rng(4)
    w = random_weights(rng, "Q5_0", 300, 512)
    xs = [rng.standard_normal((n, 512)).astype(np.float32) for n in (1, 3, 8, 1)]
    expected = [native.matmul(x, w, "Q5_0") for x in xs]
    errors = []

    def worker(i):
        for _ in range(30):
            y = native.matmul(xs[i], w, "Q5_0", threads=2)
            if not np.array_equal(y, expected[i]):
                errors.append(i)

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors


# -------------------------------------------------------------------------------- helpers


def test_dequantize_matches_gguf(nat):
    rng = np.random.default_rng(6)
    for q in QTYPES:
        w = random_weights(rng, q, 5, 512)
        np.testing.assert_array_equal(native.dequantize(w, q), ref_weights(w, q, 512).astype(np.float32))


@pytest.mark.parametrize("isa", isas_to_test())
def test_rmsnorm(nat, isa):
    rng = np.random.default_rng(8)
    for n in (1, 17, 640, 896):
        x = rng.standard_normal((3, n)).astype(np.float32) * 5
        wt = rng.standard_normal(n).astype(np.float32)
        x64 = x.astype(np.float64)
        ref = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-6) * wt
        np.testing.assert_allclose(native.rmsnorm(x, wt, 1e-6, isa=isa), ref, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(native.rmsnorm(x[0], None, 1e-6, isa=isa), ref[0] / wt, rtol=2e-6, atol=2e-6)
    with pytest.raises(minirt.InvalidRequestError, match="weight"):
        native.rmsnorm(x, wt[:-1], 1e-6)


def rope_ref(x, pos, freqs, n_rot, neox):
    x = x.astype(np.float64).copy()
    th = pos[:, None].astype(np.float64) * freqs[None, :].astype(np.float64)  # (nt, half)
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    half = n_rot // 2
    if neox:
        a, b = x[..., :half].copy(), x[..., half:n_rot].copy()
        x[..., :half], x[..., half:n_rot] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
        x[..., 0:n_rot:2], x[..., 1:n_rot:2] = a * c - b * s, a * s + b * c
    return x


@pytest.mark.parametrize("neox", [True, False])
def test_rope(nat, neox):
    rng = np.random.default_rng(9)
    for hd, n_rot in ((64, 64), (128, 64), (256, 256)):
        x = rng.standard_normal((5, 3, hd)).astype(np.float32)
        pos = np.array([0, 1, 7, 1000, 40000], dtype=np.int64)
        base = 1e6 if hd == 64 else 1e4
        freqs = (base ** (-2.0 * np.arange(n_rot // 2) / n_rot)).astype(np.float32)
        ref = rope_ref(x, pos, freqs, n_rot, neox)
        th = pos[:, None] * freqs[None, :].astype(np.float64)
        y = native.rope(x.copy(), neox=neox, n_rot=n_rot, cos=np.cos(th).astype(np.float32),
                        sin=np.sin(th).astype(np.float32))
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(x).max())
    with pytest.raises(minirt.InvalidRequestError, match="cos/sin"):
        native.rope(x, neox=neox, cos=np.ones((2, 2), np.float32), sin=np.ones((2, 2), np.float32))


def test_softmax(nat):
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((4, 1000)) * 20).astype(np.float32)
    x[1, :500] = -np.inf
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    ref = e / e.sum(axis=1, keepdims=True)
    for isa in isas_to_test():
        np.testing.assert_allclose(native.softmax(x, isa=isa), ref, rtol=1e-5, atol=1e-9)
        y = x.copy()
        assert native.softmax(y, out=y, isa=isa) is y
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-9)


def attention_ref(q, k, v, n_past, scale, window=0, softcap=0.0):
    n_head, hd = q.shape
    n_kv = k.shape[0]
    start = max(0, n_past - window) if window else 0
    out = np.zeros((n_head, hd))
    for h in range(n_head):
        kv = h // (n_head // n_kv)
        s = k[kv, start:n_past].astype(np.float64) @ q[h].astype(np.float64) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        p = np.exp(s - s.max())
        p /= p.sum()
        out[h] = p @ v[kv, start:n_past].astype(np.float64)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attention_decode(nat, dtype):
    rng = np.random.default_rng(12)
    for n_head, n_kv, hd, n_ctx, n_past, window, softcap in [
        (14, 2, 64, 100, 37, 0, 0.0), (4, 1, 256, 600, 600, 0, 0.0), (8, 8, 32, 50, 50, 16, 0.0),
        (4, 2, 128, 300, 257, 0, 30.0), (2, 1, 16, 8, 1, 0, 0.0),
        # several key chunks merged; a window across chunk edges; more query heads per KV head than lanes
        (14, 2, 64, 1100, 1030, 0, 0.0), (4, 1, 256, 900, 800, 300, 0.0), (40, 2, 16, 600, 513, 0, 0.0)]:
        q = rng.standard_normal((n_head, hd)).astype(np.float32)
        k = rng.standard_normal((n_kv, n_ctx, hd)).astype(dtype)
        v = rng.standard_normal((n_kv, n_ctx, hd)).astype(dtype)
        scale = 1.0 / np.sqrt(hd)
        ref = attention_ref(q, k, v, n_past, scale, window, softcap)
        for isa in isas_to_test():
            for th in (1, 2):
                y = native.attention_decode(q, k, v, n_past, scale, window=window, softcap=softcap, threads=th,
                                            isa=isa)
                np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5)
    with pytest.raises(minirt.InvalidRequestError, match="multiple"):
        native.attention_decode(q, np.zeros((3, 8, 16), dtype), np.zeros((3, 8, 16), dtype), 1, 1.0)
    with pytest.raises(minirt.InvalidRequestError, match="n_past"):
        native.attention_decode(q, k, v, n_ctx + 1, 1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attention_decode_with_sinks(nat, dtype):
    """gpt-oss' attention sinks: a logit per head in each softmax's denominator only, against
    minirt.blocks.attention; one chunk and several merged, a window, sinks far above and below every score."""
    from minirt.blocks import attention

    rng = np.random.default_rng(5)
    for n_head, n_kv, hd, n_ctx, n_past, window, spread in [
            (8, 2, 64, 40, 33, 0, 2.0), (16, 2, 64, 700, 650, 0, 2.0), (16, 2, 64, 700, 650, 128, 2.0),
            (4, 1, 32, 300, 280, 0, 40.0)]:
        q = rng.standard_normal((n_head, hd)).astype(np.float32)
        k = rng.standard_normal((n_kv, n_ctx, hd)).astype(dtype)
        v = rng.standard_normal((n_kv, n_ctx, hd)).astype(dtype)
        sinks = (rng.standard_normal(n_head) * spread).astype(np.float32)
        scale = 1.0 / np.sqrt(hd)
        lo = max(0, n_past - window) if window else 0
        ref = attention(q[None], k[:, lo:n_past].astype(np.float32), v[:, lo:n_past].astype(np.float32),
                        n_past - 1 - lo, scale, window, 0.0, sinks)[0]
        for isa in isas_to_test():
            y = native.attention_decode(q, k, v, n_past, scale, window=window, threads=2, isa=isa, sinks=sinks)
            np.testing.assert_allclose(y, ref.reshape(n_head, hd), rtol=0, atol=2e-5)
    with pytest.raises(minirt.InvalidRequestError, match="sinks"):
        native.attention_decode(q, k, v, 1, 1.0, sinks=sinks[:2])


# -------------------------------------------------------------------------------- on-demand build


@pytest.mark.slow
def test_jit_build_concurrent(tmp_path):
    """Two processes building into an empty cache at once: both load, one build directory results."""
    code = ("import numpy as np; from minirt.kernels import native; "
            "w = np.zeros((2, 34), np.uint8); print(native.info()['build_path'], "
            "native.matmul(np.ones((1, 32), np.float32), w, 'Q8_0')[0])")
    env = dict(os.environ, MINIRT_HOME=str(tmp_path), MINIRT_NATIVE_JIT="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_o, e) in zip(procs, outs):
        if p.returncode != 0 and "no C compiler" in e:
            pytest.skip("no C compiler")
        assert p.returncode == 0, e
    paths = {o.split()[0] for o, _ in outs}
    assert len(paths) == 1 and str(tmp_path) in paths.pop()
    builds = [d for d in (tmp_path / "native").iterdir() if d.is_dir()]
    assert len(builds) == 1, builds


STEAL_SCRIPT = r"""
import sys, time
import numpy as np
sys.path.insert(0, {repo!r})
from tests.test_native import random_weights
from minirt.kernels import native
rng = np.random.default_rng(0)
steals = 0
for qtype, rows, cols, nt in [("Q5_0", 900, 896, 1), ("Q4_K", 700, 1024, 3), ("Q8_0", 333, 512, 40),
                              ("F16", 200, 96, 2)]:
    w = random_weights(rng, qtype, rows, cols)
    x = rng.standard_normal((nt, cols)).astype(np.float32)
    ref = native.matmul(x, w, qtype, threads=1)
    for it in range(150):
        for th in (2, 3, 4):
            out = np.empty((nt, rows), np.float32)
            native.matmul(x, w, qtype, out=out, threads=th)
            steals += len(native._keepalive) > 0
            if not np.array_equal(out, ref):
                print("MISMATCH", qtype, th, it); sys.exit(1)
            out[:] = -7.0  # a late worker must never write here again
    time.sleep(0.05)
    if not np.all(out == -7.0):
        print("LATE WRITE", qtype); sys.exit(1)
print("ok", steals)
"""


def test_steal_stress(nat):
    """Callers that take over in-flight rows at once (patience 0): results stay exact and no late
    worker writes into an output after the call returned."""
    env = dict(os.environ, MINIRT_STEAL_PATIENCE_NS="0", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", STEAL_SCRIPT.format(repo=str(REPO))], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stdout + res.stderr


LATE_WORKER_SCRIPT = r"""
import sys
import numpy as np
sys.path.insert(0, {repo!r})
from tests.arch_parity import ARCH_DIR, decode_logits
from minirt.kernels import native
import minirt
out = {{}}
for arch, quant in {cases!r}:
    d = ARCH_DIR / arch
    tokens = np.load(d / "ref.npz")["tokens"][:1, :14]
    path = d / f"model-{{quant}}.gguf"
    out[arch + "/" + quant] = decode_logits(path, tokens, 8)
    for rep in range(4):
        with minirt.load(str(path), n_ctx=64, backend="native") as llm:
            ids = llm.generate(tokens[0, :8].tolist(), max_tokens=6, temperature=0.0, ignore_eos=True).token_ids
        lib = native._mod.lib
        if not lib.mr_pool_quiescent(lib.mr_pool_generation()):
            print("WORKER INSIDE A CLOSED MODEL'S JOB", arch, quant); sys.exit(1)
    out[arch + "/" + quant + "/ids"] = np.array(ids)
np.savez({dest!r}, steals=native._mod.lib.mr_pool_steals(), **out)
print("ok")
"""


def test_late_workers_after_close(nat, tmp_path):
    """Workers that stall right after claiming rows (a testing delay) while callers take their rows over at
    once: the decode steps of mixtures of experts (fused and per-op experts), the recurrent mixers and a
    dense model give the same logits as undisturbed runs, and when a model has closed no worker is still
    inside one of its jobs (it would read freed weights: a segmentation fault)."""
    cases = [("qwen3moe", "f16"), ("qwen3moe", "q4_k_m"), ("gemma4moe", "f16"), ("qwen35", "f16"),
             ("granitehybrid", "f16"), ("lfm2", "f16"), ("llama", "q8_0")]
    res = {}
    for name, knobs in (("calm", {}), ("late", {"MINIRT_STEAL_PATIENCE_NS": "0",
                                               "MINIRT_TEST_WORKER_DELAY_NS": "20000000"})):
        dest = tmp_path / f"{name}.npz"
        env = dict(os.environ, MINIRT_THREADS="2", PYTHONPATH=str(REPO), **knobs)
        run = subprocess.run([sys.executable, "-c", LATE_WORKER_SCRIPT.format(repo=str(REPO), cases=cases,
                                                                                dest=str(dest))],
                             env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (name, run.returncode,
                                                                            run.stdout[-2000:] + run.stderr[-3000:])
        res[name] = np.load(dest)
    assert int(res["late"]["steals"]) > 0  # the callers did take rows over
    for arch, quant in cases:
        for key in (f"{arch}/{quant}", f"{arch}/{quant}/ids"):
            np.testing.assert_array_equal(res["late"][key], res["calm"][key], err_msg=key)


def _import_build():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_minirt_native_build_t", REPO / "native" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile_selftest(cc: list[str], out: Path) -> subprocess.CompletedProcess:
    native_dir = REPO / "native"
    build = _import_build()
    srcs = [str(native_dir / f) for f in build.SOURCES + ["selftest.c"]]
    return subprocess.run(cc + ["-O2", "-pthread", f"-I{native_dir}", *srcs, "-lm", "-o", str(out)],
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_c_selftest_native(nat, tmp_path):
    """The standalone C self-test (every type, every ISA of this CPU, helpers) built as a program."""
    import shutil

    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    exe = tmp_path / "selftest"
    res = _compile_selftest([cc], exe)
    assert res.returncode == 0, res.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and " 0 failed" in run.stdout, run.stdout[-3000:]


@pytest.mark.slow
def test_c_selftest_aarch64_qemu(tmp_path):
    """The AArch64 build (scalar + NEON paths) under qemu-user, when the cross tools are installed
    (Debian: gcc-aarch64-linux-gnu, qemu-user)."""
    import shutil

    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if not cc or not qemu:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt: gcc-aarch64-linux-gnu qemu-user)")
    exe = tmp_path / "selftest_arm"
    res = _compile_selftest([cc, "-static"], exe)
    assert res.returncode == 0, res.stderr
    run = subprocess.run([qemu, str(exe)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and " 0 failed" in run.stdout, run.stdout[-3000:]
    assert "selected 3" in run.stdout  # NEON chosen


# -------------------------------------------------------------------------------- packed layout

PACKABLE = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]


def _pack_unit(qtype: str) -> int:
    return 256 if qtype.endswith("_K") else 128


@pytest.mark.parametrize("qtype", PACKABLE)
def test_pack_roundtrip_and_matmul(nat, qtype):
    """Packing keeps every byte (unpack gives the ggml rows back) and the packed matmul meets the
    same error bounds as the ggml one: every ISA, odd row counts, 1..40 tokens, 1..3 threads."""
    rng = np.random.default_rng(hash(qtype) % 2**32)
    unit = _pack_unit(qtype)
    for rows, nq in [(1, 1), (4, 2), (7, 1), (37, 3), (130, 5)]:
        cols = nq * unit
        w = random_weights(rng, qtype, rows, cols)
        W = ref_weights(w, qtype, cols)
        extra = 16 * (cols // 256) if qtype == "Q4_K" else 0  # Q4_K: 6-bit scales decoded to bytes
        assert native.pack_size(qtype, rows, cols) == (rows + 3) // 4 * (4 * w.shape[1] + extra)
        pm = native.pack(w, qtype)
        assert pm is not None and (pm.rows, pm.cols, pm.qtype) == (rows, cols, qtype)
        np.testing.assert_array_equal(native.unpack(pm), w)
        for isa in isas_to_test():
            for nt, th in [(1, 1), (2, 2), (3, 3), (4, 2), (5, 1), (8, 2), (11, 3), (16, 2), (17, 3), (40, 2)]:
                x = rng.standard_normal((nt, cols)).astype(np.float32)
                y = native.matmul(x, pm, threads=th, isa=isa)
                ref = x.astype(np.float64) @ W.T
                bound = error_bound(x, W, native.matmul_path(qtype, nt, isa=isa, packed=True))
                err = np.abs(y - ref)
                assert np.all(err <= bound), (qtype, rows, cols, isa, nt, th, float((err / bound).max()))


@pytest.mark.parametrize("qtype", PACKABLE)
def test_packed_rows_equal_ggml_dequantize(nat, qtype):
    """Rows read from the packed copy (the tied embedding lookup) are, bit for bit, gguf.quants'
    dequantization of the same ggml rows: any id order, repeats, odd row counts, last partial group."""
    rng = np.random.default_rng(31 + PACKABLE.index(qtype))
    unit = _pack_unit(qtype)
    for rows, nq in [(1, 1), (6, 2), (37, 3)]:
        cols = nq * unit
        w = random_weights(rng, qtype, rows, cols)
        pm = native.pack(w, qtype)
        ids = np.concatenate([rng.integers(0, rows, 50), [rows - 1, 0, rows - 1]])
        ref = quants.dequantize(w[ids], GGMLQuantizationType[qtype]).reshape(len(ids), cols)
        np.testing.assert_array_equal(native.packed_rows(pm, ids), ref.astype(np.float32))
        assert native.packed_rows(pm, np.zeros(0, np.int64)).shape == (0, cols)
        for bad in ([rows], [-1], [0, 2**40]):
            with pytest.raises(minirt.InvalidRequestError, match="row ids"):
                native.packed_rows(pm, np.array(bad))
        with pytest.raises(minirt.InvalidRequestError, match="1-D"):
            native.packed_rows(pm, np.zeros((2, 2), np.int64))


def test_tied_embedding_reads_the_packed_copy(nat, gemma_path):
    """Gemma 3's output head is its embedding: once packed, the lookup reads the packed copy (the
    GGUF rows' pages were dropped and stay out of memory): the rows it returns do not depend on the
    GGUF bytes, and equal their dequantization."""
    llm = minirt.load(str(gemma_path), n_ctx=64, backend="native")
    m = llm.model
    t, out = m.desc.tok_embd, m.desc.output
    assert out.name == t.name and isinstance(out.backend_data, native.PackedMatrix)
    ids = np.array([0, 2, 1000, 262143, 2, 106])
    ref = quants.dequantize(np.asarray(t.data[ids]), GGMLQuantizationType[t.qtype]).reshape(len(ids), -1)
    got = m.backend.embedding_rows(np.zeros_like(t.data), t.qtype, m.desc.n_embd, ids, out)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(m.embed(ids), ref * np.float32(m.desc.embed_scale))
    # without the tie the GGUF bytes are read (zeros here)
    assert not m.backend.embedding_rows(np.zeros_like(t.data), t.qtype, m.desc.n_embd, ids).any()
    llm.close()


@pytest.mark.parametrize("qtype", PACKABLE)
def test_packed_int_batch_matches_each_token(nat, qtype):
    """The packed integer kernels give every token of a batch (5..10 tokens, up to 16 where the ISA has no
    GEMM: one pass over each row group for all of them) bit for bit what it gets alone (1 token: the
    single-stream kernels)."""
    rng = np.random.default_rng(7 + PACKABLE.index(qtype))
    unit = _pack_unit(qtype)
    for rows, nq in [(37, 3), (64, 1)]:
        cols = nq * unit
        pm = native.pack(random_weights(rng, qtype, rows, cols), qtype)
        for isa in isas_to_test():
            counts = [n for n in range(5, 17) if native.matmul_path(qtype, n, isa=isa, packed=True) == "int16"]
            if not counts:
                continue
            # 5..10 (AVX-512: the GEMM from 11), 5..9 / 5..12 (AMX int8 tiles from 10, Q6_K 13), 5..16 elsewhere
            assert counts == list(range(5, counts[-1] + 1)) and counts[-1] >= 9, (isa, counts)
            x = rng.standard_normal((16, cols)).astype(np.float32)
            alone = np.stack([native.matmul(x[t], pm, threads=1, isa=isa) for t in range(16)])
            for nt in counts:
                y = native.matmul(x[:nt], pm, threads=2, isa=isa)
                np.testing.assert_array_equal(y, alone[:nt], err_msg=f"{qtype} rows={rows} cols={cols} {isa} nt={nt}")


@pytest.mark.parametrize("qtype", PACKABLE)
def test_packed_gemm_matches_each_token(nat, qtype):
    """From 11 tokens the integer GEMM (lanes = tokens) takes over where the ISA has it: every token
    then gets what it gets alone from the decode kernels up to float32 summation order (the same
    int16 activations and integer block sums; only the float accumulation of the blocks differs),
    padding tokens of a last group of 16 change nothing, and more rows than one group of 8 with a
    last partial 4-row group are all written. 16384 columns: the rows go in blocks of one 8-row group and
    the tokens in slices of two groups of 16 (what stays in L2), a last slice of one group; 11..16 tokens, one
    group (a batched decode step), take the GEMM's one-group kernel."""
    rng = np.random.default_rng(11 + PACKABLE.index(qtype))
    unit = _pack_unit(qtype)
    for rows, nq in [(37, 3), (9, 2), (21, 16384 // unit)]:
        cols = nq * unit
        w = random_weights(rng, qtype, rows, cols)
        W = ref_weights(w, qtype, cols)
        pm = native.pack(w, qtype)
        for isa in isas_to_test():
            if native.matmul_path(qtype, 40, isa=isa, packed=True) not in ("int16-gemm", "amx-int8"):
                continue
            x = rng.standard_normal((40, cols)).astype(np.float32)
            alone = np.stack([native.matmul(x[t], pm, threads=1, isa=isa) for t in range(40)])
            if isa == "avx512":
                assert native.matmul_path(qtype, 11, isa=isa, packed=True) == "int16-gemm"
                assert native.matmul_path(qtype, 10, isa=isa, packed=True) == "int16"
            for nt in (11, 13, 16, 17, 31, 32, 33, 40):
                if native.matmul_path(qtype, nt, isa=isa, packed=True) not in ("int16-gemm", "amx-int8"):
                    continue
                y = native.matmul(x[:nt], pm, threads=2, isa=isa)
                # float32 sums of the per-block products in another order (Q4_K: minus its min term,
                # a cancellation of two larger sums): a few float32 roundings of sum |w x|, measured up
                # to 1.3e-6 of it; the error against float64 is 6e-6 of it on either path
                tol = 4e-6 * (np.abs(x[:nt].astype(np.float64)) @ np.abs(W).T)
                assert np.all(np.abs(y - alone[:nt]) <= tol), (qtype, rows, cols, isa, nt)


def test_pack_unsupported_and_validation(nat):
    rng = np.random.default_rng(2)
    assert native.pack(random_weights(rng, "Q5_0", 8, 96), "Q5_0") is None  # 96 columns: no whole tile
    assert native.pack(random_weights(rng, "Q4_1", 8, 128), "Q4_1") is None  # no packed layout for the type
    assert native.pack_size("Q5_K", 8, 256) == 0 and native.pack_size("F32", 8, 128) == 0
    pm = native.pack(random_weights(rng, "Q8_0", 8, 128), "Q8_0")
    with pytest.raises(minirt.InvalidRequestError, match="columns"):
        native.matmul(np.zeros((1, 256), np.float32), pm)
    with pytest.raises(minirt.InvalidRequestError, match="does not match"):
        native.matmul(np.zeros((1, 128), np.float32), pm, "Q4_0")
    y = native.matmul(np.zeros(128, np.float32), pm)
    assert y.shape == (8,) and not y.any()


def test_pack_preferred_follows_isa(nat):
    for isa in isas_to_test():
        for q in PACKABLE:
            assert native.pack_preferred(q, isa=isa) == isa.startswith("avx512")
    assert not native.pack_preferred("Q4_1") and not native.pack_preferred("F16")


@pytest.mark.parametrize("model", ["qwen", "gemma"])
def test_pack_real_tensors(nat, model, request):
    """Every packable tensor shape of both models: byte-exact round trip, error bounds, and packed
    products equal to the ggml-layout ones up to float32 rounding where both quantize activations."""
    path = request.getfixturevalue(f"{model}_path")
    f = minirt.gguf.open(path)
    rng = np.random.default_rng(12)
    seen = set()
    for name, t in f.tensors.items():
        if t.qtype not in PACKABLE or len(t.shape) != 2 or (t.qtype, t.shape) in seen:
            continue
        if native.pack_size(t.qtype, *t.shape) == 0:
            continue
        seen.add((t.qtype, t.shape))
        rows = min(t.shape[0], 256)
        w = np.ascontiguousarray(t.data.reshape(t.shape[0], -1)[:rows])
        pm = native.pack(w, t.qtype)
        np.testing.assert_array_equal(native.unpack(pm), w)
        W = t.dequantize().reshape(t.shape)[:rows].astype(np.float64)
        for nt in (1, 3, 12):
            x = rng.standard_normal((nt, t.shape[1])).astype(np.float32)
            x[:, rng.choice(t.shape[1], 4, replace=False)] *= 30
            y = native.matmul(x, pm)
            y0 = native.matmul(x, w, t.qtype)
            ref = x.astype(np.float64) @ W.T
            assert np.all(np.abs(y - ref) <= error_bound(x, W, native.matmul_path(t.qtype, nt, packed=True))), name
            # same quantized activations on both sides (without packed kernels for this ISA the packed
            # layout is read by the float path)
            if native.matmul_path(t.qtype, nt) == native.matmul_path(t.qtype, nt, packed=True) == "int16":
                np.testing.assert_allclose(y, y0, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert {q for q, _ in seen} >= {"Q5_0", "Q8_0"}


# -------------------------------------------------------------------------------- native decode layers


def _decode_steps(llm, ids: list[int], n_steps: int, native_layers: bool, dtype=np.float32):
    """Prefill ids[:-n_steps] then decode the rest one token at a time; (logits per step, cache)."""
    from minirt.archs.base import Segment
    from minirt.kv_cache import KVCache

    m, c = llm.model, llm.model.cfg
    stack = m.native_stack
    if not native_layers:
        m.native_stack = None
    try:
        cache = KVCache(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, 128, dtype=dtype)
        m.forward(np.array(ids[:-n_steps]), [Segment(cache, len(ids) - n_steps, "last")])
        out = [m.forward(np.array([t]), [Segment(cache, 1, "last")])[0].copy() for t in ids[-n_steps:]]
    finally:
        m.native_stack = stack
    return np.array(out), cache


@pytest.fixture(scope="module", params=["llama", "qwen2-bias"])
def tiny_quant(request, tmp_path_factory):
    """A tiny model with packable weights (128 / 256 columns, Q5_0 and Q8_0 mixed)."""
    from gguf import GGMLQuantizationType as QT

    from tests.tiny_models import TinySpec, write_tiny

    arch, bias = ("qwen2", True) if request.param == "qwen2-bias" else ("llama", False)
    spec = TinySpec(arch=arch, bias=bias, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, qtype=QT.Q5_0, seed=9)
    path = tmp_path_factory.mktemp("tinyq") / f"{request.param}.gguf"
    write_tiny(path, spec)
    llm = minirt.load(str(path), n_ctx=128, backend="native")
    yield request.param, llm
    llm.close()


def test_native_layers_match_python_layers_tiny(tiny_quant):
    name, llm = tiny_quant
    assert llm.model.native_stack is not None, f"{name}: native decode layers not prepared"
    ids = [1] + np.random.default_rng(3).integers(3, 290, 20).tolist()
    a, ca = _decode_steps(llm, ids, 8, True)
    b, cb = _decode_steps(llm, ids, 8, False)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())
    np.testing.assert_allclose(ca.k, cb.k, rtol=0, atol=1e-4 * np.abs(cb.k).max())
    np.testing.assert_allclose(ca.v, cb.v, rtol=0, atol=1e-4 * np.abs(cb.v).max())
    f16, _ = _decode_steps(llm, ids, 8, True, dtype=np.float16)  # float16 caches
    np.testing.assert_allclose(f16, b, rtol=0, atol=5e-3 * np.abs(b).max())


def test_native_layers_batched_sequences(tiny_quant):
    """Several sequences at different positions decoded in one step get what each gets alone."""
    from minirt.archs.base import Segment
    from minirt.kv_cache import KVCache

    _, llm = tiny_quant
    m, c = llm.model, llm.model.cfg
    rng = np.random.default_rng(4)
    prompts = [[1] + rng.integers(3, 290, n).tolist() for n in (5, 11, 2)]
    alone = []
    for p in prompts:
        lg, _ = _decode_steps(llm, p + [7, 8, 9], 3, True)
        alone.append(lg)
    caches = [KVCache(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, 64) for _ in prompts]
    for p, cache in zip(prompts, caches):
        m.forward(np.array(p), [Segment(cache, len(p), "last")])
    for step, tok in enumerate((7, 8, 9)):
        out = m.forward(np.full(len(prompts), tok), [Segment(cc, 1, "last") for cc in caches])
        for i, lg in enumerate(out):
            # bit-identical on the packed AVX-512 kernels; elsewhere a batch's RoPE rows may round in
            # the last bit, which the int16 activation quantization of the next matmul can turn into one
            # quantization step: within the matmul's documented 5e-4 error bound
            np.testing.assert_allclose(lg, alone[i][step], rtol=0, atol=5e-4 * np.abs(lg).max())


@pytest.mark.parametrize("n_seq", [12, 18])
def test_native_layers_batch_takes_the_gemm(tiny_quant, n_seq):
    """12 and 18 sequences in one decode step: from 11 tokens the layer stack's packed matrices take the
    integer GEMM (where the ISA has it; 12: its one-group kernel, the fused decode step; 18: two groups)
    and each sequence still gets what it gets decoded alone (the same int16 activations; float32
    summation order aside)."""
    from minirt.archs.base import Segment
    from minirt.kernels import native
    from minirt.kv_cache import KVCache

    _, llm = tiny_quant
    m, c = llm.model, llm.model.cfg
    assert m.native_stack is not None
    if "avx512" in native.supported_isas():  # the path this test is for, where the CPU has it
        assert native.matmul_path("Q5_0", n_seq, packed=True) in ("int16-gemm", "amx-int8")
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, 290, int(n)).tolist() for n in rng.integers(1, 12, n_seq)]
    alone = [_decode_steps(llm, p + [7, 8], 2, True)[0] for p in prompts]
    caches = [KVCache(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, 64) for _ in prompts]
    for p, cache in zip(prompts, caches):
        m.forward(np.array(p), [Segment(cache, len(p), "last")])
    for step, tok in enumerate((7, 8)):
        out = m.forward(np.full(len(prompts), tok), [Segment(cc, 1, "last") for cc in caches])
        for i, lg in enumerate(out):
            # a different float32 summation order can move an activation across an int16 rounding
            # step of the next matmul: within the matmul's documented 5e-4 bound, as for small batches
            np.testing.assert_allclose(lg, alone[i][step], rtol=0, atol=5e-4 * np.abs(lg).max(), err_msg=f"seq {i}")


def test_layer_stack_refuses_unsupported(nat, tiny_quant):
    import dataclasses

    from minirt.blocks import Linear

    _, llm = tiny_quant
    blocks = llm.model.desc.blocks
    b = blocks[0]
    plain = dataclasses.replace(b, attn=dataclasses.replace(b.attn), mlp=dataclasses.replace(b.mlp))
    for lin_name in ("wq", "wk", "wv", "wo"):  # the ggml layout runs too (no packed copies)
        lin = getattr(plain.attn, lin_name)
        view = lin.rows(0, lin.out_features, "all")
        setattr(plain.attn, lin_name, view)
    native.LayerStack([plain], [0])
    floats = dataclasses.replace(plain, attn=dataclasses.replace(plain.attn))
    f32 = object.__new__(Linear)
    for k in Linear.__slots__:
        setattr(f32, k, getattr(plain.attn.wq, k))
    f32.w, f32.qtype = np.zeros((plain.attn.wq.out_features, 128 * 4), np.uint8), "F32"
    floats.attn.wq = f32
    native.LayerStack([floats], [0])  # float weights run too (dequantized rows, float dots)
    bad = dataclasses.replace(plain, mlp=dataclasses.replace(plain.mlp))
    gate = plain.mlp.gate.rows(0, plain.mlp.gate.out_features, "biased")
    gate.bias = np.zeros(gate.out_features, np.float32)
    bad.mlp.gate = gate  # a gate bias: C refuses it (mr_layer_check)
    with pytest.raises(minirt.BackendError, match="layer 0 cannot run in the native decode step"):
        native.LayerStack([bad], [0])
    no_gate = dataclasses.replace(plain, mlp=dataclasses.replace(plain.mlp, gate=None))
    with pytest.raises(minirt.BackendError, match="layer 0 .*without gate"):
        native.LayerStack([no_gate], [0])


@pytest.mark.parametrize("model", ["qwen", "gemma"])
def test_native_layers_real_models(model, request):
    """Both real models: the native decode step matches the Python layers (same kernels, same
    quantized activations; only summation order and the exp/tanh approximations differ)."""
    path = request.getfixturevalue(f"{model}_path")
    llm = minirt.load(str(path), n_ctx=128, backend="native")
    try:
        assert llm.model.native_stack is not None
        ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Then it ran away, far away.")
        a, ca = _decode_steps(llm, ids, 6, True)
        b, cb = _decode_steps(llm, ids, 6, False)
        assert (a.argmax(-1) == b.argmax(-1)).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * np.abs(b).max())
        np.testing.assert_allclose(ca.k, cb.k, rtol=0, atol=2e-3 * np.abs(cb.k).max())
    finally:
        llm.close()


# -------------------------------------------------------------------------------- prefill attention, activations


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_attention_prefill(nat, dtype):
    """Causal grouped-query attention of many new queries against the numpy implementation of the
    forward pass: windows (crossing the query blocks), softcap, caches holding older positions, items of
    one head or of several heads sharing a KV head."""
    from minirt.blocks import attention

    rng = np.random.default_rng(21)
    for n, n_head, n_kv, hd, p0, window, softcap in [(1, 4, 2, 32, 0, 0, 0.0), (17, 4, 2, 32, 5, 0, 0.0),
                                                     (40, 14, 2, 64, 100, 0, 0.0), (33, 4, 1, 256, 10, 8, 0.0),
                                                     (20, 8, 2, 64, 3, 0, 30.0), (64, 4, 4, 16, 0, 5, 0.0),
                                                     # enough query blocks that one item takes a whole group
                                                     # of heads (each tile converted once for all of them)
                                                     (130, 8, 2, 64, 7, 0, 0.0), (100, 4, 1, 256, 300, 40, 0.0)]:
        n_ctx = p0 + n + 3
        q = rng.standard_normal((n, n_head, hd)).astype(np.float32)
        k = rng.standard_normal((n_kv, n_ctx, hd)).astype(dtype)
        v = rng.standard_normal((n_kv, n_ctx, hd)).astype(dtype)
        lo = max(0, p0 - window + 1) if window else 0
        ref = attention(q, k[:, lo:p0 + n].astype(np.float32), v[:, lo:p0 + n].astype(np.float32), p0 - lo, 0.125,
                        window, softcap)
        for isa in isas_to_test():
            for th in (1, 2):
                y = native.attention_prefill(q, k, v, p0, 0.125, window=window, softcap=softcap, threads=th, isa=isa)
                np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5)
    with pytest.raises(minirt.InvalidRequestError, match="do not fit"):
        native.attention_prefill(q, k, v, n_ctx, 1.0)


def test_act_mul(nat):
    from minirt.blocks import gelu_tanh, silu

    rng = np.random.default_rng(22)
    g = (rng.standard_normal((3, 1001)) * 6).astype(np.float32)
    g[0, :4] = [-100.0, 100.0, 0.0, -0.0]
    u = rng.standard_normal((3, 1001)).astype(np.float32)
    for isa in isas_to_test():
        for act, f in (("silu", silu), ("gelu_tanh", gelu_tanh)):
            ref = f(g.astype(np.float64)) * u
            np.testing.assert_allclose(native.act_mul(g, u, act, isa=isa), ref, rtol=2e-6, atol=1e-6)
    out = g.copy()
    assert native.act_mul(out, u, "silu", out=out) is out
    with pytest.raises(minirt.InvalidRequestError, match="act"):
        native.act_mul(g, u, "relu")


def test_ungated_activation(nat):
    """``native.activation`` (mr_act_mul without u): erf GELU against math.erf in float64 (A&S 7.1.26:
    |erf error| <= 1.5e-7, evaluated in float32: |GELU error| <= 2.5e-7·|x| + float32 rounding of the
    result), SiLU and tanh GELU
    against their numpy definitions, on every ISA; the tails (|x| = 100) exact."""
    import math

    from minirt.blocks import gelu_tanh, silu

    rng = np.random.default_rng(23)
    x = (rng.standard_normal((3, 1001)) * 6).astype(np.float32)
    x[0, :4] = [-100.0, 100.0, 0.0, -0.0]
    x64 = x.astype(np.float64)
    gelu = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    for isa in isas_to_test():
        y = native.activation(x, "gelu", isa=isa)
        assert np.all(np.abs(y - gelu) <= 2.5e-7 * np.abs(x64) + 2e-7 * np.abs(gelu)), isa
        assert y[0, 0] == 0.0 and y[0, 1] == 100.0
        for act, f in (("silu", silu), ("gelu_tanh", gelu_tanh)):
            np.testing.assert_allclose(native.activation(x, act, isa=isa), f(x64), rtol=2e-6, atol=1e-6)
    out = x.copy()
    assert native.activation(out, "gelu", out=out) is out
    with pytest.raises(minirt.InvalidRequestError, match="act"):
        native.activation(x, "relu")


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ2_XXS", "MXFP4"])
def test_backend_decodes_low_bit_types_natively(nat, qtype, monkeypatch):
    """The native kernels of these types agree with the float64 reference for few-token and
    many-token matmuls on every ISA; NativeBackend runs them natively (numba never called) except,
    on an ISA without SIMD kernels for them, the few-token matmuls of NUMBA_DECODE_TYPES, which it
    sends to numba's faster loop."""
    from minirt.kernels import SIMD_INT_ISAS, NativeBackend, numba_backend

    rng = np.random.default_rng(7)
    w = random_weights(rng, qtype, 70, 512)

    class Lin:
        backend_data = None

    lin = Lin()
    lin.w, lin.qtype = w, qtype
    be = NativeBackend(2)
    assert (be.numba_decode_types == set()) == (native.info()["isa"] in SIMD_INT_ISAS)
    ref_w = ref_weights(w, qtype, 512)
    for nt in (1, 3, 9):
        x = rng.standard_normal((nt, 512)).astype(np.float32)
        ref = x.astype(np.float64) @ ref_w.T
        for isa in isas_to_test():
            y_native = be._mod.matmul(x, w, qtype, threads=2, isa=isa)
            # int16 activations: within 1e-4 of the largest output; int8 ones (q8_K-like, AVX-512's
            # Q2_K / Q3_K / TQ2_0): within their rounding bound
            tol = np.maximum(1e-4 * np.abs(ref).max(), error_bound(x, ref_w, native.matmul_path(qtype, nt, isa=isa)))
            assert np.all(np.abs(y_native - ref) <= tol), isa
        with monkeypatch.context() as mp:
            if qtype in be.numba_decode_types and nt <= 4:
                calls = []
                real = numba_backend.matmul
                mp.setattr(numba_backend, "matmul", lambda *a, _c=calls, _r=real, **k: _c.append(1) or _r(*a, **k))
                y = be.matmul(x, lin)
                assert calls, "few-token matmul of a numba_decode_types type did not go to numba"
            else:
                mp.setattr(numba_backend, "matmul", lambda *a, **k: pytest.fail("numba used"))
                y = be.matmul(x, lin)
        tol = np.maximum(1e-4 * np.abs(ref).max(), error_bound(x, ref_w, native.matmul_path(qtype, nt)))
        assert np.all(np.abs(y - ref) <= tol)


def test_stale_installed_extension_is_passed_over():
    """An in-place extension built from other C sources (an editable install after the sources
    changed) must not be used; one built from these sources is."""
    import importlib.util
    from types import SimpleNamespace

    from minirt.kernels import native as nat

    spec = importlib.util.spec_from_file_location("_b", Path(nat.__file__).resolve().parents[2] / "native" / "build.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)

    class FFI:
        @staticmethod
        def string(s):
            return s

    def fake(h):
        return SimpleNamespace(__file__="x.so", ffi=FFI, lib=SimpleNamespace(mr_source_hash=lambda: h.encode()))

    assert nat._stale_installed(fake(b.source_hash())) is None
    assert "other sources" in nat._stale_installed(fake("0" * 16))
    assert "predates" in nat._stale_installed(SimpleNamespace(__file__="x.so", ffi=FFI, lib=SimpleNamespace()))


@pytest.mark.skipif(not _has_amx_int8(), reason="this CPU, OS or compiler has no AMX-INT8 (or MINIRT_AMX_INT8=0)")
@pytest.mark.parametrize("qtype", PACKABLE)
def test_amx_int8_gemm_is_the_int16_gemm(nat, qtype):
    """The avx512_amx ISA's integer GEMM on int8 tiles splits each int16 activation exactly into a high and a low
    byte: its results are the AVX-512 int16 GEMM's bit for bit (same int32 block sums, same scaling order), for
    row groups of 1..16 rows (a chunk's last group), 10..48 tokens (a last group of fewer than 16), per-32 and
    per-16 scales and the k-quant mins. A NaN activation stays in its own token's outputs."""
    rng = np.random.default_rng(11 + PACKABLE.index(qtype))
    unit = _pack_unit(qtype)
    for rows, cols, nt in [(3, unit, 17), (45, 2 * unit, 33), (70, 3 * unit, 48), (20, unit, 21)]:
        w = random_weights(rng, qtype, rows, cols)
        pm = native.pack(w, qtype)
        x = rng.standard_normal((nt, cols)).astype(np.float32)
        assert native.matmul_path(qtype, nt, isa="avx512_amx", packed=True) == "amx-int8"
        assert native.matmul_path(qtype, nt, isa="avx512", packed=True) == "int16-gemm"
        y8 = native.matmul(x, pm, threads=2, isa="avx512_amx")
        y16 = native.matmul(x, pm, threads=2, isa="avx512")
        assert np.array_equal(y8, y16), (qtype, rows, cols, nt, float(np.abs(y8 - y16).max()))
        # from 10 tokens, Q6_K 13 (compared with the int16 GEMM on these tokens twice over, same rows)
        n0 = _amx8_min_tokens(qtype)
        assert native.matmul_path(qtype, n0, isa="avx512_amx", packed=True) == "amx-int8"
        y = native.matmul(x[:n0], pm, threads=2, isa="avx512_amx")
        assert np.array_equal(y, native.matmul(np.concatenate([x[:n0]] * 2), pm, threads=2, isa="avx512")[:n0])
    x2 = x.copy()
    x2[5, 3] = np.nan
    y2 = native.matmul(x2, pm, threads=2, isa="avx512_amx")
    assert np.isnan(y2[5]).all() and np.isfinite(np.delete(y2, 5, axis=0)).all()


@pytest.mark.skipif(not _has_amx(), reason="this CPU, OS or compiler has no AMX (the avx512_amx ISA is absent)")
@pytest.mark.parametrize("qtype", [q for q in QTYPES if q != "F32"])
def test_amx_prefill_every_type(nat, qtype):
    """From 64 tokens the avx512_amx ISA runs every type but F32 on AMX tiles (weights dequantized as the float
    paths do, both factors split into bf16 hi + lo): within its bound of the float64 product (3 * 2^-16 of
    sum |w x| per element) for plain and packed matrices, partial groups of 32 rows and of 16 tokens; a NaN
    activation stays in its own token's outputs. F32 weights keep the float32 paths."""
    assert native.matmul_path("F32", 512, isa="avx512_amx") != "amx-bf16"
    rng = np.random.default_rng(3 + QTYPES.index(qtype))
    unit = 256 if qtype not in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4") \
        else 128
    for rows, cols, nt in [(45, 2 * unit, 64), (70, unit, 77)]:
        w = random_weights(rng, qtype, rows, cols)
        W = ref_weights(w, qtype, cols)
        x = rng.standard_normal((nt, cols)).astype(np.float32)
        ref = x.astype(np.float64) @ W.T
        mats = [w] + ([native.pack(w, qtype)] if qtype in PACKABLE else [])
        for m in mats:
            q = qtype if m is w else None  # a packed matrix knows its type
            y = native.matmul(x, m, q, threads=2, isa="avx512_amx")
            err = np.abs(y - ref)
            assert np.all(err <= error_bound(x, W, "amx-bf16")), (qtype, rows, cols, nt, float(err.max()))
        x2 = x.copy()
        x2[5, 3] = np.nan
        y2 = native.matmul(x2, w, qtype, threads=2, isa="avx512_amx")
        assert np.isnan(y2[5]).all() and np.isfinite(np.delete(y2, 5, axis=0)).all()
