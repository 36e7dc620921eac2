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

QTYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
          "Q6_K", "IQ4_NL", "IQ4_XS"]

# byte offsets of the f16 scale fields inside one block (random bytes there could spell inf/NaN)
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
    "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
}


@pytest.fixture(scope="module")
def nat():
    """The loaded native module; skips only when the machine has no C compiler at all."""
    try:
        native._load()
    except minirt.BackendError as e:
        if "no C compiler" in str(e):
            pytest.skip(f"native kernels unavailable: {e}")
        raise
    return native


def isas_to_test() -> list[str]:
    try:
        native._load()
    except minirt.BackendError:
        return ["scalar"]
    return [i for i in native.supported_isas() if i in ("scalar", "avx2", "avx512", "neon")]


def random_weights(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """(rows, row_bytes) uint8: random blocks (every bit pattern) with finite f16 scales."""
    if qtype == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    if qtype == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if qtype == "BF16":
        f = rng.standard_normal((rows, cols)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    bs, ts = quants.GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.uniform(0.002, 0.05, size=raw.shape[:2]) * rng.choice([-1, 1], size=raw.shape[:2]))
        raw[..., off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return np.ascontiguousarray(raw.reshape(rows, -1))


def ref_weights(w: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    out = quants.dequantize(w, GGMLQuantizationType[qtype])
    return np.asarray(out, dtype=np.float64).reshape(w.shape[0], cols)


def error_bound(x: np.ndarray, W: np.ndarray, path: str) -> np.ndarray:
    """Per-element bound on |Y - Y64| (n_tokens, rows).

    int16 path: each activation is rounded to a multiple of its 32-block's max / 32767, an error of at
    most half a step, so |err| <= sum_i |W_ri| * amax_b(i) / 65534 (+ float32 rounding of the sums).
    Float paths: float32 accumulation only. The float32 term is 2e-6 * sum_i |W_ri x_i| (about 32
    float32 roundings relative to the absolute sum: the kernels sum in 16-lane partial sums).
    """
    x64 = x.astype(np.float64)
    absdot = np.abs(x64) @ np.abs(W).T
    fp = 2e-6 * absdot + 1e-30
    if path != "int16":
        return fp
    nt, cols = x.shape
    amax = np.abs(x64).reshape(nt, cols // 32, 32).max(axis=2)          # (nt, cols/32)
    step = np.repeat(amax, 32, axis=1) / 65534.0                        # (nt, cols)
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
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0", "F16"])
def test_matmul_chunk_boundaries(nat, qtype, isa):
    """Row counts that leave partial chunks / tiles, K spanning several tile chunks (> 1024)."""
    rng = np.random.default_rng(7)
    for rows, cols, nt in [(1001, 256, 1), (263, 1280, 4), (97, 2304, 6), (41, 512, 128), (75, 768, 29)]:
        for th in (1, 2, 3):
            check_matmul(rng, qtype, rows, cols, nt, th, isa)


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
            for q in ("Q4_K", "Q5_0", "Q6_K", "Q8_0"):
                assert native.matmul_path(q, 1, isa=isa) == "int16"
                assert native.matmul_path(q, 4, isa=isa) == "int16"
        assert native.matmul_path("Q4_K", 8, isa=isa) == "float-tile"
        assert native.matmul_path("Q4_K", 64, isa=isa) == ("float-panel" if isa == "avx512" else "float-tile")


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
        (dict(qtype="IQ2_XXS"), minirt.UnsupportedQuantError, "IQ2_XXS"),
        (dict(qtype="NOPE"), minirt.UnsupportedQuantError, "NOPE"),
        (dict(qtype=16), minirt.UnsupportedQuantError, "16"),
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
        freqs = native.rope_freqs(n_rot, 1e6 if hd == 64 else 1e4)
        ref = rope_ref(x, pos, freqs, n_rot, neox)
        y = native.rope(x.copy(), pos, neox=neox, n_rot=n_rot, freq_base=1e6 if hd == 64 else 1e4)
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * np.abs(x).max())
        th = pos[:, None] * freqs[None, :].astype(np.float64)
        y2 = native.rope(x.copy(), neox=neox, n_rot=n_rot, cos=np.cos(th).astype(np.float32),
                         sin=np.sin(th).astype(np.float32))
        np.testing.assert_allclose(y2, ref, rtol=0, atol=2e-6 * np.abs(x).max())
    with pytest.raises(minirt.InvalidRequestError, match="positions"):
        native.rope(x, np.zeros(2, np.int32), neox=neox)


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
        (4, 2, 128, 300, 257, 0, 30.0), (2, 1, 16, 8, 1, 0, 0.0)]:
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
    for p, (o, e) in zip(procs, outs):
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


def _compile_selftest(cc: list[str], out: Path) -> subprocess.CompletedProcess:
    native_dir = REPO / "native"
    srcs = [str(native_dir / f) for f in ("scalar.c", "x86_avx2.c", "x86_avx512.c", "arm_neon.c", "dispatch.c",
                                          "pool.c", "ops.c", "selftest.c")]
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
