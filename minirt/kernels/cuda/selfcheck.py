"""Every CUDA kernel against its numpy reference on random data.

Used by the tests (tiny sizes under numba's CUDA simulator, real sizes on a GPU) and by
``bench/gpu_check.py``. References: ``gguf.quants.dequantize`` for the weight formats, plain
float64 numpy for the arithmetic, :mod:`minirt.blocks` for the RoPE tables. Each check returns
a :class:`Check` with the worst error relative to the reference's largest magnitude.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from .quant import SUPPORTED_TYPES, TYPE_SIZES

# byte offsets of the float16 scale fields of each block (random bytes there could spell inf/NaN)
_F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
MATMUL_TOL = 2e-5  # float32 accumulation in a different order than the float64 reference


@dataclass
class Check:
    name: str
    err: float  # max |got - ref| / max |ref|
    tol: float
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.err <= self.tol)

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return f"{self.name:<28} err {self.err:9.2e} (tol {self.tol:.0e}) {verdict} {self.seconds:6.2f}s"


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return math.inf
    if not np.all(np.isfinite(got)):
        return math.inf
    scale = max(float(np.abs(ref).max()), 1e-30) if ref.size else 1.0
    return float(np.abs(got - ref).max() / scale) if ref.size else 0.0


# typical |scale x quant| product of each type: random blocks get d ~ target / this
_TYPICAL = {"Q4_0": 4, "Q4_1": 8, "Q5_0": 8, "Q5_1": 16, "Q8_0": 64, "Q2_K": 16, "Q3_K": 64, "Q4_K": 256,
            "Q5_K": 512, "Q6_K": 2048}


_LOWBIT = frozenset({"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"})


def random_raw(qtype: str, rows: int, cols: int, rng: np.random.Generator, target: float = 0.05) -> np.ndarray:
    """Random raw blocks uint8 (rows, row_bytes) of ``qtype`` whose weights are ~``target`` in size."""
    tsize, qk = TYPE_SIZES[qtype]
    if qtype == "F32":
        return (rng.standard_normal((rows, cols)) * target).astype(np.float32).view(np.uint8).reshape(rows, -1)
    if qtype == "F16":
        return (rng.standard_normal((rows, cols)) * target).astype(np.float16).view(np.uint8).reshape(rows, -1)
    nb = rows * cols // qk
    blocks = rng.integers(0, 256, size=(nb, tsize), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        v = (rng.standard_normal(nb) * (target / _TYPICAL[qtype])).astype("<f2")
        blocks[:, off:off + 2] = v.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def random_weight(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random raw blocks uint8 (rows, row_bytes) of ``qtype`` and their float32 values (gguf.quants)."""
    import gguf

    if qtype in _LOWBIT:  # reference: minirt's numpy spec (checked against gguf-py / ggml fixtures)
        from ...quants import dequantize
        from ...quants._random import random_matrix

        raw = np.ascontiguousarray(random_matrix(qtype, rows, cols, rng, scale=0.02))
        return raw, dequantize(raw, qtype, (rows, cols))
    raw = random_raw(qtype, rows, cols, rng, target=1.0)
    if qtype == "F32":
        return raw, raw.view(np.float32).reshape(rows, cols)
    if qtype == "F16":
        return raw, raw.view(np.float16).reshape(rows, cols).astype(np.float32)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(rows, cols).astype(np.float32)
    return raw, ref


def _timed(fn: Callable[[], Check]) -> Check:
    t = time.perf_counter()
    c = fn()
    c.seconds = time.perf_counter() - t
    return c


def _dev(a: np.ndarray) -> Any:
    return cuda.to_device(np.ascontiguousarray(a))


def check_dequant(be: Any, qtype: str, rows: int, cols: int, rng: np.random.Generator) -> Check:
    """Row gather + dequantize + scale (embedding lookup) is exact."""
    def run() -> Check:
        raw, ref = random_weight(qtype, rows, cols, rng)
        dw = be.add_weight(f"check.{qtype}.deq", qtype, raw)
        idx = rng.permutation(rows).astype(np.int32)[: max(1, rows - 1)]
        out = cuda.device_array((len(idx), cols), np.float32)
        scale = np.float32(1.5)
        be._launch(be.k.dequant_rows(qtype), be._ew_grid(len(idx) * cols // 8), be.lc.threads, *dw.args,
                   _dev(idx), out, len(idx), cols, scale)
        got = out.copy_to_host()
        be.weights.pop(dw.name)
        return Check(f"dequant {qtype}", rel_err(got, ref[idx] * scale), 1e-6)
    return _timed(run)


def check_matmul(be: Any, qtype: str, rows: int, cols: int, T: int, rng: np.random.Generator,
                 path: str = "auto") -> Check:
    """``y[:, col:col+N] (+)= x @ W.T + b`` through the backend's dispatch (matvec / GEMM / BLAS tiles).

    path: "matvec" forces T <= mv_max_tokens semantics by the caller's choice of T; the name only
    labels the check. Output is written at a column offset with accumulation to cover both epilogues.
    """
    def run() -> Check:
        raw, W = random_weight(qtype, rows, cols, rng)
        dw = be.add_weight(f"check.{qtype}.mm", qtype, raw)
        x = rng.standard_normal((T, cols)).astype(np.float32)
        bias = rng.standard_normal(rows).astype(np.float32)
        col = 3
        y0 = rng.standard_normal((T, rows + 5)).astype(np.float32)
        yd = _dev(y0)
        be._mm(dw, _dev(x), T, yd, col, _dev(bias), acc=True)
        be._sync()
        got = yd.copy_to_host()
        ref = y0.astype(np.float64)
        ref[:, col:col + rows] += x.astype(np.float64) @ W.astype(np.float64).T + bias
        be.weights.pop(dw.name)
        return Check(f"{path} {qtype} {rows}x{cols} T={T}", rel_err(got, ref), MATMUL_TOL)
    return _timed(run)


def check_glu(be: Any, qtype: str, rows: int, cols: int, T: int, kind: int, rng: np.random.Generator) -> Check:
    """Fused gate/up matvec with SiLU (kind 0) or GELU-tanh (kind 1)."""
    def run() -> Check:
        rg, G = random_weight(qtype, rows, cols, rng)
        ru, U = random_weight(qtype, rows, cols, rng)
        g = be.add_weight("check.g", qtype, rg)
        u = be.add_weight("check.u", qtype, ru)
        x = (rng.standard_normal((T, cols)) * 2).astype(np.float32)
        out = cuda.device_array((T, rows), np.float32)
        lc = be.lc
        rpb = lc.mv_threads // lc.tpr(cols)
        be._launch(be.k.matvec_glu(qtype, cols), (lc.grid((rows + rpb - 1) // rpb), lc.grid_y(T)), lc.mv_threads,
                   *g.args, *u.args, _dev(x), T, out, kind, rows, cols)
        got = out.copy_to_host()
        a = x.astype(np.float64) @ G.astype(np.float64).T
        b = x.astype(np.float64) @ U.astype(np.float64).T
        ref = (_silu(a) if kind == 0 else _gelu(a)) * b
        be.weights.pop("check.g")
        be.weights.pop("check.u")
        return Check(f"glu {'silu' if kind == 0 else 'gelu'} {qtype}", rel_err(got, ref), MATMUL_TOL)
    return _timed(run)


def _silu(a: np.ndarray) -> np.ndarray:
    return a / (1.0 + np.exp(-a))


def _gelu(a: np.ndarray) -> np.ndarray:
    return 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3)))


def check_act_mul(be: Any, T: int, F: int, rng: np.random.Generator) -> list[Check]:
    """SiLU, GELU-tanh and gpt-oss' clamped SwiGLU (:func:`minirt.blocks.swiglu_oai`, alpha 1.702,
    limit 7 as the released models set them; the inputs reach beyond the limit); the ungated activations in
    place (:func:`minirt.blocks.activation`) and Qwen3.5's output-gate split and sigmoid product."""
    from ...blocks import activation, sigmoid, swiglu_oai

    out = []
    alpha, limit = np.float32(1.702), np.float32(7.0)
    for kind, name in ((0, "silu"), (1, "gelu"), (2, "swiglu_oai")):
        gu = (rng.standard_normal((T, 2 * F)) * 4).astype(np.float32)
        o = cuda.device_array((T, F), np.float32)
        be._launch(be.k.act_mul, be._ew_grid(T * F), be.lc.threads, _dev(gu), o, T, F, kind, alpha, limit)
        a = gu[:, :F].astype(np.float64)
        ref = (swiglu_oai(gu[:, :F], gu[:, F:], float(alpha), float(limit)) if kind == 2 else
               (_silu(a) if kind == 0 else _gelu(a)) * gu[:, F:])
        out.append(Check(f"act_mul {name}", rel_err(o.copy_to_host(), ref), 1e-5))
    for kind, name in ((0, "silu"), (1, "gelu_tanh"), (3, "relu2")):  # ungated MLPs, in place
        y = (rng.standard_normal((T, F + 2)) * 4).astype(np.float32)
        yd = _dev(y)
        be._launch(be.k.act, be._ew_grid(T * F), be.lc.threads, yd, T, F, kind)
        ref = y.copy()
        ref[:, :F] = activation(name, y[:, :F])
        out.append(Check(f"act {name}", rel_err(yd.copy_to_host(), ref), 1e-5))
    # Qwen3.5's gated attention: per head a query then a gate, split; then the output times sigmoid(gate)
    H, Dk, Dv = 3, 4, 2
    src = rng.standard_normal((T, H * (Dk + Dv))).astype(np.float32) * 3
    qkv, gate = cuda.device_array((T, H * Dk + 5), np.float32), cuda.device_array((T, H * Dv), np.float32)
    be._launch(be.k.split_gate, be._ew_grid(T * H * (Dk + Dv)), be.lc.threads, _dev(src), T, H, Dk, Dv, qkv, gate)
    heads = src.reshape(T, H, Dk + Dv)
    att = rng.standard_normal((T, H * Dv)).astype(np.float32)
    ad = _dev(att)
    be._launch(be.k.sigmoid_mul, be._ew_grid(T * H * Dv), be.lc.threads, ad, gate, T, H * Dv)
    err = max(rel_err(qkv.copy_to_host()[:, :H * Dk], heads[:, :, :Dk].reshape(T, -1)),
              rel_err(ad.copy_to_host(), att * sigmoid(heads[:, :, Dk:].reshape(T, -1))))
    out.append(Check("out gate split / sigmoid", err, 1e-5))
    return out


def check_rmsnorm(be: Any, n_rows: int, d: int, H: int, D: int, rng: np.random.Generator) -> list[Check]:
    """Plain norm with a row gather, per-head norm in place, and the add (post-norm) mode."""
    res = []
    eps = np.float32(1e-6)
    x = rng.standard_normal((n_rows, d)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    rows = rng.permutation(n_rows).astype(np.int32)[: max(1, n_rows - 1)]

    def norm(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        v = v.astype(np.float64)
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + float(eps)) * g

    out = cuda.device_array((len(rows), d), np.float32)
    be._norm(_dev(x), _dev(rows), _dev(w), out, len(rows), 0, 1, d, eps, 0)
    res.append(Check("rmsnorm gather", rel_err(out.copy_to_host(), norm(x[rows], w)), 1e-5))
    # heads: columns [col, col + H*D) of a wider row, normalised per head in place
    col = 5
    y = rng.standard_normal((n_rows, col + H * D + 3)).astype(np.float32)
    wh = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    yd = _dev(y)
    be._norm(yd, be._arange_dev(n_rows), _dev(wh), yd, n_rows, col, H, D, eps, 0)
    ref = y.astype(np.float64)
    ref[:, col:col + H * D] = norm(y[:, col:col + H * D].reshape(n_rows, H, D), wh).reshape(n_rows, H * D)
    res.append(Check("rmsnorm heads in place", rel_err(yd.copy_to_host(), ref), 1e-5))
    # add mode: out += norm(x) * w
    base = rng.standard_normal((n_rows, d)).astype(np.float32)
    od = _dev(base)
    be._norm(_dev(x), be._arange_dev(n_rows), _dev(w), od, n_rows, 0, 1, d, eps, 1)
    res.append(Check("rmsnorm add", rel_err(od.copy_to_host(), base + norm(x, w)), 1e-5))
    return res


def check_rope(be: Any, T: int, nheads: int, D: int, rope_dim: int, rng: np.random.Generator) -> list[Check]:
    """Both pair layouts against :func:`minirt.blocks.apply_rope` at arbitrary positions."""
    from ...blocks import Rope, apply_rope

    res = []
    for neox, yarn in ((False, False), (True, False), (True, True)):
        rope = Rope(dim=rope_dim, base=10000.0, neox=neox, freq_scale=0.5,
                    factors=rng.uniform(1.0, 4.0, rope_dim // 2).astype(np.float32))
        if yarn:  # YaRN: ramped frequencies and a magnitude (mscale 1 + 0.1 ln 2) on cos and sin
            rope = Rope(dim=rope_dim, base=10000.0, neox=neox, freq_scale=0.5, ext_factor=1.0, n_ctx_orig=64)
        pos = rng.integers(0, 5000, T).astype(np.int32)
        x = rng.standard_normal((T, nheads * D + 4)).astype(np.float32)
        ref = x.copy()
        v = ref[:, 4:].reshape(T, nheads, D)
        apply_rope(v, *rope.cos_sin(pos), neox, rope_dim)
        ref[:, 4:] = v.reshape(T, -1)
        half = rope_dim // 2
        inv = rope.inv_freq()
        xd = _dev(x)
        be._launch(be.k.rope, be._ew_grid(T * nheads * half), be.lc.threads, xd, _dev(pos), 0, T, 4, nheads, D,
                   _dev(inv), rope_dim, int(neox), np.float64(rope.mscale()))
        name = f"rope {'neox' if neox else 'normal'}{' yarn' if yarn else ''} dim {rope_dim}/{D}"
        res.append(Check(name, rel_err(xd.copy_to_host(), ref), 1e-5))
    return res


def check_attention(be: Any, n: int, p0: int, H: int, Hkv: int, D: int, window: int, softcap: float,
                    rng: np.random.Generator, sinks: bool = False) -> Check:
    """kv_store then attention for n new rows at positions p0.. over a float16 cache, against
    :func:`minirt.blocks.attention` on the same (float16-rounded) keys and values (``sinks``: with
    random per-head sink logits, some above every score)."""
    from ...blocks import attention

    def run() -> Check:
        cap = p0 + n + 3
        L = p0 + n
        Dk = Dv = D
        W = H * Dk + Hkv * (Dk + Dv)
        s0 = 2  # the segment's rows start inside a larger batch
        qkv = rng.standard_normal((s0 + n, W)).astype(np.float32)
        old_k = rng.standard_normal((Hkv, p0, Dk)).astype(np.float16)
        old_v = rng.standard_normal((Hkv, p0, Dv)).astype(np.float16)
        Kc = np.zeros((Hkv, cap, Dk), np.float16)
        Vc = np.zeros((Hkv, cap, Dv), np.float16)
        Kc[:, :p0], Vc[:, :p0] = old_k, old_v
        kd, vd = _dev(Kc), _dev(Vc)
        pos = np.zeros(s0 + n, np.int32)
        pos[s0:] = np.arange(p0, p0 + n)
        posd = _dev(pos)
        qd = _dev(qkv)
        kcol, vcol = H * Dk, H * Dk + Hkv * Dk
        be._launch(be.k.kv_store, be._ew_grid(n * Hkv * D), be.lc.threads, qd, posd, s0, n, kcol, vcol,
                   Hkv, Dk, Dv, kd, vd)
        out = cuda.device_array((s0 + n, H * Dv), np.float32)
        scale = np.float32(1.0 / math.sqrt(Dk))
        sk = (rng.standard_normal(H) * 4).astype(np.float32) if sinks else None
        be._launch(be.k.attention, be.lc.grid(n * H), be.lc.threads, qd, kd, vd, out, posd, s0, n, H, Hkv, Dk,
                   Dv, scale, window, np.float32(softcap), _dev(sk if sinks else np.zeros(1, np.float32)), int(sinks))
        be._sync()
        new_k = qkv[s0:, kcol:vcol].reshape(n, Hkv, Dk).astype(np.float16).transpose(1, 0, 2)
        new_v = qkv[s0:, vcol:].reshape(n, Hkv, Dv).astype(np.float16).transpose(1, 0, 2)
        kc = np.concatenate([old_k, new_k], axis=1).astype(np.float32)
        vc = np.concatenate([old_v, new_v], axis=1).astype(np.float32)
        q = qkv[s0:, :kcol].reshape(n, H, Dk).copy()
        lo = max(0, p0 - window + 1) if window else 0
        ref = attention(q, kc[:, lo:L], vc[:, lo:L], p0 - lo, float(scale), window, softcap, sinks=sk)
        err = rel_err(out.copy_to_host()[s0:], ref)
        kc_got = kd.copy_to_host()[:, :L].astype(np.float32)
        err_store = max(rel_err(kc_got, kc), rel_err(vd.copy_to_host()[:, :L].astype(np.float32), vc))
        name = f"attention H{H}/{Hkv} D{D} n{n} p0 {p0}" + (f" win{window}" if window else "") + \
            (f" cap{softcap:g}" if softcap else "") + (" sinks" if sinks else "")
        return Check(name, max(err, err_store), 1e-5)
    return _timed(run)


def check_recurrent(be: Any, n: int, rng: np.random.Generator, real: bool = False) -> list[Check]:
    """The hybrid mixers' kernels over a segment of n rows (starting at row 2 of a larger batch) against
    :mod:`minirt.blocks`: the convolution with its state (:func:`~minirt.blocks.causal_conv`, SiLU) and the
    state it leaves, the L2 norm, the delta-net's gates and scan (:func:`~minirt.blocks.delta_rule`, tiled and
    grouped key heads), Mamba-2's scan with its D skip (:func:`~minirt.blocks.ssm_scan`) and LFM2's short
    convolution over cached float16 rows."""
    from ... import blocks

    out: list[Check] = []
    s0, L = 2, 4
    T = s0 + n
    Hk, Hv, Dk, Dv = (4, 16, 128, 128) if real else (2, 4, 8, 4)
    cd = 2 * Hk * Dk + Hv * Dv
    # convolution with state
    src = rng.standard_normal((T, 3 + cd)).astype(np.float32)
    st = rng.standard_normal((L - 1, cd)).astype(np.float32)
    w = rng.standard_normal((cd, L)).astype(np.float32) * 0.5
    bias = rng.standard_normal(cd).astype(np.float32) * 0.1
    rows = np.concatenate([st, src[s0:, 3:]])
    ref = blocks.silu(blocks.causal_conv(rows, w, bias))
    conv, std, snap = cuda.device_array((T, cd), np.float32), _dev(st), cuda.device_array((L - 1, cd), np.float32)
    be._launch(be.k.rconv, be._ew_grid(n * cd), be.lc.threads, _dev(src), 3, std, conv, s0, n, cd, _dev(w), L,
               _dev(bias), 1)
    be._launch(be.k.rconv_state, be._ew_grid(cd), be.lc.threads, _dev(src), 3, std, snap, s0, n - 1, cd, L)
    be._launch(be.k.rconv_state, be._ew_grid(cd), be.lc.threads, _dev(src), 3, std, std, s0, n, cd, L)
    got = conv.copy_to_host()[s0:]
    out.append(Check(f"conv+silu n{n}", rel_err(got, ref), 1e-5))
    out.append(Check(f"conv state n{n}", max(rel_err(std.copy_to_host(), rows[n:]),
                                             rel_err(snap.copy_to_host(), rows[n - 1:n - 1 + L - 1])), 0.0))
    # L2 norm of q | k heads in place, then the gated delta rule from a random state
    x = np.zeros((T, cd), np.float32)
    x[s0:] = got
    xd = _dev(x)
    eps = np.float32(1e-6)
    be._launch(be.k.l2norm, be.lc.grid(T * 2 * Hk), be.lc.threads, xd, T, 0, 2 * Hk, Dk, eps)
    qk = blocks.l2_normalize(x[:, :2 * Hk * Dk].reshape(T, 2 * Hk, Dk), float(eps)).reshape(T, -1)
    out.append(Check("l2norm heads", rel_err(xd.copy_to_host()[:, :2 * Hk * Dk], qk), 1e-5))
    proj = rng.standard_normal((T, 5 + 2 * Hv)).astype(np.float32) * 2
    dt_bias = rng.standard_normal(Hv).astype(np.float32) * 0.5
    a = -rng.uniform(0.5, 2.0, Hv).astype(np.float32)
    gates = cuda.device_array((T, 2 * Hv), np.float32)
    be._launch(be.k.dn_gates, be._ew_grid(T * Hv), be.lc.threads, _dev(proj), 5, 5 + Hv, Hv, 0, T, Hv, _dev(dt_bias),
               _dev(a), gates)
    decay = np.exp(a * np.logaddexp(0.0, proj[:, 5 + Hv:] + dt_bias))
    beta = blocks.sigmoid(proj[:, 5:5 + Hv])
    out.append(Check("delta-net gates", rel_err(gates.copy_to_host(), np.concatenate([decay, beta], 1)), 1e-5))
    rep = Hv // Hk
    xs = xd.copy_to_host()[s0:]
    for grouped in (0, 1):
        S0 = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32) * 0.3
        q = xs[:, :Hk * Dk].reshape(n, Hk, Dk)
        k = xs[:, Hk * Dk:2 * Hk * Dk].reshape(n, Hk, Dk)
        v = xs[:, 2 * Hk * Dk:].reshape(n, Hv, Dv)
        heads = (lambda z: np.repeat(z, rep, axis=1)) if grouped else (lambda z: np.tile(z, (1, rep, 1)))
        S_ref = S0.copy()
        o_ref = blocks.delta_rule(S_ref, heads(q) / np.sqrt(Dk), heads(k), v, decay[s0:], beta[s0:])
        Sd = _dev(S0)
        o = cuda.device_array((T, 3 + Hv * Dv), np.float32)
        be._launch(be.k.delta_scan, be._ew_grid(Hv * Dv), be.lc.threads, xd, gates, o, 3, Sd, s0, n, Hk, Hv, Dk,
                   Dv, grouped, np.float32(1.0 / np.sqrt(Dk)))
        err = max(rel_err(o.copy_to_host()[s0:, 3:], o_ref.reshape(n, -1)), rel_err(Sd.copy_to_host(), S_ref))
        out.append(Check(f"delta scan {'grouped' if grouped else 'tiled'} n{n}", err, 1e-5))
    # Mamba-2's scan: H heads of P in G groups of state N
    H, P, N, G = (48, 64, 128, 1) if real else (4, 3, 8, 2)
    xbc = rng.standard_normal((T, H * P + 2 * G * N)).astype(np.float32)
    pr = rng.standard_normal((T, 2 + H)).astype(np.float32)
    dtb = rng.standard_normal(H).astype(np.float32) * 0.5
    am = -rng.uniform(0.5, 2.0, H).astype(np.float32)
    dsk = rng.standard_normal(H).astype(np.float32)
    S0 = rng.standard_normal((H, P, N)).astype(np.float32) * 0.3
    dt = np.logaddexp(np.float32(0.0), pr[s0:, 2:] + dtb).astype(np.float32)
    xm = xbc[s0:, :H * P].reshape(n, H, P)
    Bm = xbc[s0:, H * P:H * P + G * N].reshape(n, G, N)
    Cm = xbc[s0:, H * P + G * N:].reshape(n, G, N)
    S_ref = S0.copy()
    y_ref = blocks.ssm_scan(S_ref, xm, dt, am, Bm, Cm) + xm * dsk[:, None]
    Sd = _dev(S0)
    y = cuda.device_array((T, 1 + H * P), np.float32)
    be._launch(be.k.ssm_scan, be._ew_grid(H * P), be.lc.threads, _dev(xbc), _dev(pr), 2, _dev(dtb), _dev(am),
               _dev(dsk), y, 1, Sd, s0, n, H, P, N, G)
    err = max(rel_err(y.copy_to_host()[s0:, 1:], y_ref.reshape(n, -1)), rel_err(Sd.copy_to_host(), S_ref))
    out.append(Check(f"ssm scan n{n}", err, 1e-5))
    # LFM2's short convolution: cached B·x rows (float16) before position p0, this segment's own exact
    d, Hc, p0 = (1024, 2, 37) if real else (8, 2, 5)
    Dh = d // Hc
    bcx = rng.standard_normal((T, 3 * d)).astype(np.float32)
    cache = np.zeros((Hc, p0 + n, Dh), np.float16)
    old = rng.standard_normal((p0, d)).astype(np.float16)
    cache[:, :p0] = old.reshape(p0, Hc, Dh).transpose(1, 0, 2)
    wc = rng.standard_normal((d, L)).astype(np.float32)
    pos = np.zeros(T, np.int32)
    pos[s0:] = np.arange(p0, p0 + n)
    kd, yd = _dev(cache), cuda.device_array((T, d), np.float32)
    be._launch(be.k.short_conv, be._ew_grid(n * d), be.lc.threads, _dev(bcx), kd, yd, _dev(pos), s0, n, d, Dh,
               _dev(wc), L)
    be._launch(be.k.short_conv_store, be._ew_grid(n * d), be.lc.threads, _dev(bcx), kd, _dev(pos), s0, n, d, Dh)
    bx = bcx[s0:, :d] * bcx[s0:, 2 * d:]
    rows = np.concatenate([old[p0 - (L - 1):].astype(np.float32), bx])
    ref = bcx[s0:, d:2 * d] * blocks.causal_conv(rows, wc)
    stored = kd.copy_to_host()[:, p0:].transpose(1, 0, 2).reshape(n, d).astype(np.float32)
    out.append(Check(f"short conv n{n}", max(rel_err(yd.copy_to_host()[s0:], ref),
                                             rel_err(stored, bx.astype(np.float16).astype(np.float32))), 1e-5))
    return out


def check_argmax_softcap(be: Any, n: int, V: int, rng: np.random.Generator) -> list[Check]:
    y = rng.standard_normal((n, V)).astype(np.float32)
    y[0, V // 3] = y[0, V - 1] = 9.0  # a tie: the first index wins, as numpy's argmax
    o = cuda.device_array(n, np.int32)
    be._launch(be.k.argmax, be.lc.grid(n), be.lc.threads, _dev(y), n, o)
    got = o.copy_to_host()
    res = [Check("argmax (ties → first)", float(np.sum(got != y.argmax(-1))), 0.0)]
    yd = _dev(y)
    be._launch(be.k.softcap, be._ew_grid(n * V), be.lc.threads, yd, n, np.float32(5.0))
    res.append(Check("softcap", rel_err(yd.copy_to_host(), np.tanh(y / 5.0) * 5.0), 1e-6))
    return res


def run_all(be: Any, rng: np.random.Generator, real: bool = False, types: tuple[str, ...] = SUPPORTED_TYPES,
            log: Callable[[str], Any] | None = None) -> list[Check]:
    """Every check at tiny sizes (simulator) or at sizes of the real models (``real=True``)."""
    out: list[Check] = []

    def add(c: Check | list[Check]) -> None:
        for x in (c if isinstance(c, list) else [c]):
            out.append(x)
            if log is not None:
                log(str(x))

    lc = be.lc
    for qt in types:
        qk = TYPE_SIZES[qt][1]
        if real:
            rows, cols = 4864, (896 if qk == 32 else 1024)
        else:
            rows, cols = 5, (3 * 32 if qk == 32 else 256)
        add(check_dequant(be, qt, 7 if not real else 2048, cols, rng))
        add(check_matmul(be, qt, rows, cols, min(2, lc.mv_max_tokens), rng, "matvec"))
        add(check_matmul(be, qt, rows, cols, lc.mv_max_tokens + 3 if not real else 512, rng,
                         "cublas" if be._blas is not None else "gemm"))
    gq = "Q5_0" if "Q5_0" in types else types[0]
    for kind in (0, 1):
        add(check_glu(be, gq, 4864 if real else 5, 896 if real else 64, 1, kind, rng))
    add(check_act_mul(be, 8 if real else 3, 4864 if real else 10, rng))
    add(check_rmsnorm(be, 64 if real else 3, 896 if real else 24, 14 if real else 2, 64 if real else 8, rng))
    add(check_rope(be, 64 if real else 3, 16 if real else 2, 64 if real else 8, 64 if real else 6, rng))
    if real:
        for n, p0, H, Hkv, D, win, cap in [(1, 700, 14, 2, 64, 0, 0.0), (512, 0, 14, 2, 64, 0, 0.0),
                                            (64, 300, 4, 1, 256, 512, 0.0), (1, 900, 4, 1, 256, 512, 0.0),
                                            (8, 40, 8, 8, 128, 0, 30.0)]:
            add(check_attention(be, n, p0, H, Hkv, D, win, cap, rng))
        add(check_attention(be, 1, 900, 64, 8, 64, 128, 0.0, rng, sinks=True))  # gpt-oss' layout
    else:
        for n, p0, H, Hkv, D, win, cap in [(3, 4, 4, 2, 8, 0, 0.0), (2, 9, 2, 1, 8, 3, 0.0),
                                            (1, 5, 2, 2, 4, 0, 20.0)]:
            add(check_attention(be, n, p0, H, Hkv, D, win, cap, rng))
    for n in ((1, 130) if real else (1, 3)):
        add(check_recurrent(be, n, rng, real))
    add(check_argmax_softcap(be, 3 if not real else 8, 50 if not real else 151936, rng))
    return out
