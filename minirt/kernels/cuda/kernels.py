"""numba-cuda kernels of the CUDA backend.

All kernels loop grid-stride, so any grid size is correct: the backend launches large grids on a
GPU and tiny ones under numba's CUDA simulator (where every CUDA thread is a Python thread).
Block-level reductions go through shared memory (no warp shuffles), so the same code runs, and is
tested, in the simulator. Block sizes are compile-time constants of a :class:`LaunchConfig`;
kernels are built (and compiled on first launch) per config and per weight type.

Conventions: activations are float32 row-major ``(T, features)``; a weight is the triple
``(w8, w16, w32)`` described in :mod:`.quant`; a KV cache layer is float16 ``(Hkv, cap, D)``;
token positions come from a device int32 array so that a captured CUDA graph stays valid as the
sequence grows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from numba import cuda, float32, float64, int32

from ...errors import BackendError
from .quant import DEQUANTIZERS, GROUP

GELU_C = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class LaunchConfig:
    """Block shapes (compile-time constants) and grid caps."""

    threads: int = 128  # generic block size (norms, attention, argmax, elementwise); power of 2
    mv_threads: int = 256  # matvec block size
    mv_tpr: int = 32  # matvec threads per weight row (power of 2, divides mv_threads)
    mv_tpr_long: int = 128  # ... for rows of at least mv_long_k weights (few long rows: more threads each)
    mv_long_k: int = 2048
    gemm_gt: int = 16  # tiled GEMM: gt x gt threads ...
    gemm_gm: int = 4  # ... each computing gm weight rows x gn tokens
    gemm_gn: int = 4
    max_grid: int = 1 << 20  # cap of blocks along x for grid-stride kernels
    max_grid_y: int = 65535
    max_head_dim: int = 512  # shared-memory size of the attention kernel
    mv_max_tokens: int = 4  # up to this many tokens a matmul runs as matvec, above as GEMM

    @staticmethod
    def simulator() -> LaunchConfig:
        """Tiny blocks and grids: the simulator runs each CUDA thread as a Python thread."""
        return LaunchConfig(threads=8, mv_threads=8, mv_tpr=4, mv_tpr_long=8, mv_long_k=256, gemm_gt=2, gemm_gm=2,
                            gemm_gn=2, max_grid=3, max_grid_y=2, max_head_dim=128, mv_max_tokens=2)

    @staticmethod
    def simulator_fast() -> LaunchConfig:
        """Simulator config with one thread per weight row and wide GEMM tiles: few barriers (which
        the simulator makes slow), for whole-model runs; :meth:`simulator` exercises the reductions."""
        return LaunchConfig(threads=4, mv_threads=8, mv_tpr=1, mv_tpr_long=1, gemm_gt=2, gemm_gm=8, gemm_gn=8,
                            max_grid=2, max_grid_y=2, max_head_dim=64, mv_max_tokens=2)

    @staticmethod
    def from_env() -> LaunchConfig:
        """Defaults overridden by ``MINIRT_CUDA_LAUNCH="field=value,..."`` (tuning without code edits)."""
        spec = os.environ.get("MINIRT_CUDA_LAUNCH", "").strip()
        if not spec:
            return LaunchConfig()
        kw = {}
        names = {f.name for f in fields(LaunchConfig)}
        for item in spec.split(","):
            k, _, v = item.partition("=")
            k = k.strip()
            if k not in names or not v.strip().lstrip("-").isdigit():
                raise BackendError(f"MINIRT_CUDA_LAUNCH: bad item {item!r} (fields: {', '.join(sorted(names))})")
            kw[k] = int(v)
        return LaunchConfig(**kw)

    def tpr(self, K: int) -> int:
        """Matvec threads per row for rows of K weights."""
        return self.mv_tpr_long if K >= self.mv_long_k else self.mv_tpr

    def grid(self, n: int) -> int:
        return max(1, min(n, self.max_grid))

    def grid_y(self, n: int) -> int:
        return max(1, min(n, self.max_grid_y))


@cuda.jit(device=True)
def _activation(a, kind):
    """SiLU (kind 0), GELU with the tanh approximation (1) or squared ReLU (3) of one float32."""
    if kind == 0:
        return a / (float32(1.0) + math.exp(-a))
    if kind == 1:
        return float32(0.5) * a * (float32(1.0) + math.tanh(float32(GELU_C) * (a + float32(0.044715) * a * a * a)))
    r = max(a, float32(0.0))
    return r * r


# ---------------------------------------------------------------------------------------------
# block-level reductions (shared memory; every thread of the block must call them)
# ---------------------------------------------------------------------------------------------
def _make_reducers(NT: int) -> tuple[Callable, Callable]:
    @cuda.jit(device=True)
    def block_sum(red, tid, v):
        red[tid] = v
        cuda.syncthreads()
        s = NT // 2
        while s > 0:
            if tid < s:
                red[tid] += red[tid + s]
            cuda.syncthreads()
            s //= 2
        r = red[0]
        cuda.syncthreads()  # red is reused by the caller
        return r

    @cuda.jit(device=True)
    def block_max(red, tid, v):
        red[tid] = v
        cuda.syncthreads()
        s = NT // 2
        while s > 0:
            if tid < s:
                if red[tid + s] > red[tid]:
                    red[tid] = red[tid + s]
            cuda.syncthreads()
            s //= 2
        r = red[0]
        cuda.syncthreads()
        return r

    return block_sum, block_max


class Kernels:
    """Kernels for one :class:`LaunchConfig`; per-type kernels are created on first request."""

    def __init__(self, cfg: LaunchConfig) -> None:
        for v in (cfg.threads, cfg.mv_threads, cfg.mv_tpr, cfg.mv_tpr_long):
            if v & (v - 1):
                raise BackendError(f"block sizes must be powers of two, got {v}")
        if max(cfg.mv_tpr, cfg.mv_tpr_long) > cfg.mv_threads:
            raise BackendError("matvec threads per row cannot exceed the block size")
        self.cfg = cfg
        self._mv: dict[tuple[str, int], Any] = {}
        self._glu: dict[tuple[str, int], Any] = {}
        self._gemm: dict[str, Any] = {}
        self._deq: dict[str, Any] = {}
        NT = cfg.threads
        self.block_sum, self.block_max = _make_reducers(NT)
        self.rmsnorm = _make_rmsnorm(NT, self.block_sum)
        self.rope = _make_rope()
        self.kv_store = _make_kv_store()
        self.attention = _make_attention(NT, cfg.max_head_dim, self.block_sum, self.block_max)
        self.act_mul = _make_act_mul()
        self.act = _make_act()
        self.bias_add = _make_bias_add()
        self.softcap = _make_softcap()
        self.scale_rows = _make_scale_rows()
        self.argmax = _make_argmax(NT)
        self.route = _make_route()
        self.pairs_gather, self.pairs_scatter = _make_pair_moves()
        self.moe_combine = _make_moe_combine()
        self.split_gate, self.sigmoid_mul = _make_out_gate()
        self.l2norm = _make_l2norm(NT, self.block_sum)
        self.short_conv, self.short_conv_store = _make_short_conv()
        self.rconv, self.rconv_state = _make_rconv()
        self.dn_gates = _make_dn_gates()
        self.delta_scan = _make_delta_scan(cfg.max_head_dim)
        self.ssm_scan = _make_ssm_scan(cfg.max_head_dim)
        self._mvid: dict[tuple[str, int], Any] = {}

    # per-type kernels ------------------------------------------------------------------------
    def _row_kernel(self, table: dict, make: Callable, qtype: str, K: int) -> Any:
        """The kernel ``make`` builds for ``qtype`` with the threads per row that rows of K weights get,
        compiled once per (type, layout) in ``table``."""
        tpr = self.cfg.tpr(K)
        k = table.get((qtype, tpr))
        if k is None:
            k = table[(qtype, tpr)] = make(DEQUANTIZERS[qtype], self.cfg.mv_threads, tpr)
        return k

    def matvec(self, qtype: str, K: int) -> Any:
        """Matvec kernel for rows of K weights of ``qtype`` (block layout chosen by K)."""
        return self._row_kernel(self._mv, _make_matvec, qtype, K)

    def matvec_id(self, qtype: str, K: int) -> Any:
        """As :meth:`matvec` with each (token, slot) pair's rows chosen by an expert id."""
        return self._row_kernel(self._mvid, _make_matvec_id, qtype, K)

    def matvec_glu(self, qtype: str, K: int) -> Any:
        """Gate, up and the gated activation of a dense MLP's decode in one pass."""
        return self._row_kernel(self._glu, _make_matvec_glu, qtype, K)

    def gemm(self, qtype: str) -> Any:
        k = self._gemm.get(qtype)
        if k is None:
            c = self.cfg
            k = self._gemm[qtype] = _make_gemm(DEQUANTIZERS[qtype], c.gemm_gt, c.gemm_gm, c.gemm_gn)
        return k

    def dequant_rows(self, qtype: str) -> Any:
        k = self._deq.get(qtype)
        if k is None:
            k = self._deq[qtype] = _make_dequant_rows(DEQUANTIZERS[qtype])
        return k


_KERNELS: dict[LaunchConfig, Kernels] = {}


def get_kernels(cfg: LaunchConfig) -> Kernels:
    """The shared :class:`Kernels` of a config (compiled code is reused by every backend instance)."""
    k = _KERNELS.get(cfg)
    if k is None:
        k = _KERNELS[cfg] = Kernels(cfg)
    return k


# ---------------------------------------------------------------------------------------------
# quantized matmuls
# ---------------------------------------------------------------------------------------------
def _make_row_dot(deq: Callable, THREADS: int, TPR: int) -> Any:
    """``sum_c W[row, c] * x[t, c]`` by the TPR threads of one row (lanes of a block of THREADS), each taking
    groups of 8 weights strided by TPR (consecutive threads read consecutive bytes); the partial sums meet
    in the shared ``red``. Every thread of the block must call it (barriers inside); ``valid`` False: this
    thread's row is past the end and adds nothing. The result is complete in lane 0 of the row."""

    @cuda.jit(device=True)
    def row_dot(w8, w16, w32, row, valid, x, t, K, tid, lane, red, vals):
        s = float32(0.0)
        if valid:
            for g in range(lane, K // GROUP, TPR):
                c = g * GROUP
                deq(w8, w16, w32, row, c, vals)
                for i in range(GROUP):
                    s += vals[i] * x[t, c + i]
        if TPR > 1:  # compile-time constant: one thread per row needs no reduction
            red[tid] = s
            cuda.syncthreads()
            st = TPR // 2
            while st > 0:
                if lane < st:
                    red[tid] += red[tid + st]
                cuda.syncthreads()
                st //= 2
            s = red[tid]
        return s

    return row_dot


def _make_matvec(deq: Callable, THREADS: int, TPR: int) -> Any:
    """Fused dequant-matvec for a few tokens (decode).

    ``y[t, ycol + r] = (y[t, ycol + r] if acc) + sum_c W[r, c] * x[t, c] + (bias[r] if has_bias)``
    x (>= T, K) f32; W (N, K) quantized; y (T, >= ycol + N) f32; bias (N,) f32 (any size when unused).
    Block = RPB rows x TPR threads (:func:`_make_row_dot`). Grid: x over row tiles, y over tokens (both
    grid-stride).
    """
    RPB = THREADS // TPR
    row_dot = _make_row_dot(deq, THREADS, TPR)

    @cuda.jit
    def matvec(w8, w16, w32, x, T, y, ycol, bias, has_bias, acc, N, K):
        tid = cuda.threadIdx.x
        rr = tid // TPR
        lane = tid - rr * TPR
        red = cuda.shared.array(THREADS, float32)
        vals = cuda.local.array(GROUP, float32)
        for t in range(cuda.blockIdx.y, T, cuda.gridDim.y):
            for r0 in range(cuda.blockIdx.x * RPB, N, cuda.gridDim.x * RPB):
                r = r0 + rr
                s = row_dot(w8, w16, w32, r, r < N, x, t, K, tid, lane, red, vals)
                if lane == 0 and r < N:
                    if has_bias:
                        s += bias[r]
                    if acc:
                        s += y[t, ycol + r]
                    y[t, ycol + r] = s
                if TPR > 1:
                    cuda.syncthreads()

    return matvec


def _make_matvec_id(deq: Callable, THREADS: int, TPR: int) -> Any:
    """Decode matvecs of the chosen experts, every (token, slot) pair with its own expert's rows.

    ``y[j, ycol + r] = sum_c W[off[ids[j]] + r, c] * x[j // xdiv, c] (+ bias[off[ids[j]] + r] if has_bias)``
    for pairs j < P, rows r < N: W (n_expert * N (+ more), K) quantized, the experts' rows stacked (the
    3-D GGUF tensor); bias: one per row of W; off (n_expert,) int32 the first row of each expert; ids
    (P,) int32; x (>= P / xdiv, K); y (P, >= ycol + N).
    Only the chosen experts' rows are read. Launch as :func:`_make_matvec` with the pairs along y.
    """
    RPB = THREADS // TPR
    row_dot = _make_row_dot(deq, THREADS, TPR)

    @cuda.jit
    def matvec_id(w8, w16, w32, off, ids, x, xdiv, P, y, ycol, bias, has_bias, N, K):
        tid = cuda.threadIdx.x
        rr = tid // TPR
        lane = tid - rr * TPR
        red = cuda.shared.array(THREADS, float32)
        vals = cuda.local.array(GROUP, float32)
        for j in range(cuda.blockIdx.y, P, cuda.gridDim.y):
            base = off[ids[j]]
            for r0 in range(cuda.blockIdx.x * RPB, N, cuda.gridDim.x * RPB):
                r = r0 + rr
                s = row_dot(w8, w16, w32, base + r, r < N, x, j // xdiv, K, tid, lane, red, vals)
                if lane == 0 and r < N:
                    if has_bias:
                        s += bias[base + r]
                    y[j, ycol + r] = s
                if TPR > 1:
                    cuda.syncthreads()

    return matvec_id


def _make_matvec_glu(deq: Callable, THREADS: int, TPR: int) -> Any:
    """Gate and up projections plus the gated activation in one pass (decode MLP).

    ``out[t, r] = act(Wg[r] . x[t]) * (Wu[r] . x[t])`` with act = SiLU (kind 0) or GELU-tanh
    (kind 1); Wg, Wu (F, K) of the same type; x (T, K); out (T, F).
    """
    RPB = THREADS // TPR

    @cuda.jit
    def matvec_glu(g8, g16, g32, u8, u16, u32, x, T, out, kind, N, K):
        tid = cuda.threadIdx.x
        rr = tid // TPR
        lane = tid - rr * TPR
        red = cuda.shared.array(THREADS, float32)
        red2 = cuda.shared.array(THREADS, float32)
        vals = cuda.local.array(GROUP, float32)
        ng = K // GROUP
        for t in range(cuda.blockIdx.y, T, cuda.gridDim.y):
            for r0 in range(cuda.blockIdx.x * RPB, N, cuda.gridDim.x * RPB):
                r = r0 + rr
                sg = float32(0.0)
                su = float32(0.0)
                if r < N:
                    for g in range(lane, ng, TPR):
                        c = g * GROUP
                        deq(g8, g16, g32, r, c, vals)
                        for i in range(GROUP):
                            sg += vals[i] * x[t, c + i]
                        deq(u8, u16, u32, r, c, vals)
                        for i in range(GROUP):
                            su += vals[i] * x[t, c + i]
                if TPR > 1:
                    red[tid] = sg
                    red2[tid] = su
                    cuda.syncthreads()
                    st = TPR // 2
                    while st > 0:
                        if lane < st:
                            red[tid] += red[tid + st]
                            red2[tid] += red2[tid + st]
                        cuda.syncthreads()
                        st //= 2
                    sg = red[tid]
                    su = red2[tid]
                if lane == 0 and r < N:
                    out[t, r] = _activation(sg, kind) * su
                if TPR > 1:
                    cuda.syncthreads()

    return matvec_glu


def _make_gemm(deq: Callable, GT: int, GM: int, GN: int) -> Any:
    """Tiled quantized GEMM (prefill without cuBLAS).

    Same contract as the matvec. A block owns a tile of BM = GT*GM weight rows x BN = GT*GN
    tokens; per step of BK = 32 columns it dequantizes the BM x BK weight tile into shared memory
    once and reuses it for all BN tokens (and the x tile for all BM rows).
    """
    BK = 32
    BK1 = BK + 1
    BM = GT * GM
    BN = GT * GN
    NTH = GT * GT
    GPR = BK // GROUP  # groups per tile row

    @cuda.jit
    def gemm(w8, w16, w32, x, T, y, ycol, bias, has_bias, acc, N, K):
        tid = cuda.threadIdx.x
        ty = tid // GT
        tx = tid - ty * GT
        Ws = cuda.shared.array((BM, BK1), float32)  # +1: no bank conflicts on column reads
        Xs = cuda.shared.array((BN, BK1), float32)
        vals = cuda.local.array(GROUP, float32)
        accum = cuda.local.array((GM, GN), float32)
        for tr in range(cuda.blockIdx.x * BM, N, cuda.gridDim.x * BM):
            for tt in range(cuda.blockIdx.y * BN, T, cuda.gridDim.y * BN):
                for i in range(GM):
                    for j in range(GN):
                        accum[i, j] = float32(0.0)
                for k0 in range(0, K, BK):
                    for gi in range(tid, BM * GPR, NTH):
                        rr = gi // GPR
                        gg = gi - rr * GPR
                        r = tr + rr
                        if r < N:
                            deq(w8, w16, w32, r, k0 + gg * GROUP, vals)
                            for i in range(GROUP):
                                Ws[rr, gg * GROUP + i] = vals[i]
                        else:
                            for i in range(GROUP):
                                Ws[rr, gg * GROUP + i] = float32(0.0)
                    for xi in range(tid, BN * BK, NTH):
                        tj = xi // BK
                        kk = xi - tj * BK
                        t = tt + tj
                        if t < T:
                            Xs[tj, kk] = x[t, k0 + kk]
                        else:
                            Xs[tj, kk] = float32(0.0)
                    cuda.syncthreads()
                    for kk in range(BK):
                        for i in range(GM):
                            a = Ws[ty + i * GT, kk]
                            for j in range(GN):
                                accum[i, j] += a * Xs[tx + j * GT, kk]
                    cuda.syncthreads()
                for i in range(GM):
                    r = tr + ty + i * GT
                    if r < N:
                        for j in range(GN):
                            t = tt + tx + j * GT
                            if t < T:
                                v = accum[i, j]
                                if has_bias:
                                    v += bias[r]
                                if acc:
                                    v += y[t, ycol + r]
                                y[t, ycol + r] = v

    return gemm


def _make_dequant_rows(deq: Callable) -> Any:
    """``out[i, :] = W[rows[i], :] * scale`` (embedding lookup; weight tiles for cuBLAS).

    rows (n,) int32; out (>= n, K) f32. One thread per group of 8 weights, grid-stride.
    """

    @cuda.jit
    def dequant_rows(w8, w16, w32, rows, out, n, K, scale):
        vals = cuda.local.array(GROUP, float32)
        ng = K // GROUP
        for idx in range(cuda.grid(1), n * ng, cuda.gridsize(1)):
            i = idx // ng
            c = (idx - i * ng) * GROUP
            deq(w8, w16, w32, rows[i], c, vals)
            for j in range(GROUP):
                out[i, c + j] = vals[j] * scale

    return dequant_rows


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------
def _make_rmsnorm(NT: int, block_sum: Callable) -> Any:
    """RMSNorm over heads of D features: one block per (row, head), grid-stride.

    ``out[i, col + h*D + c] (=|+=) x[rows[i], col + h*D + c] / sqrt(mean_c(x^2) + eps) * w[h*wh + c]``
    (``+=`` when add). Plain norms use nheads=1, D=n_embd; Qwen3/Gemma's per-head q/k norms use
    the head layout of the fused q|k|v buffer (out is x itself there). ``wh``: 0 where every head
    shares the gains (D,), D where each head has its own (Mamba-2's grouped norm, gains (nheads*D,)).
    """

    @cuda.jit
    def rmsnorm(x, rows, w, out, n, col, nheads, D, eps, add, wh):
        tid = cuda.threadIdx.x
        red = cuda.shared.array(NT, float32)
        for item in range(cuda.blockIdx.x, n * nheads, cuda.gridDim.x):
            i = item // nheads
            h = item - i * nheads
            src = rows[i]
            c0 = col + h * D
            s = float32(0.0)
            for c in range(tid, D, NT):
                v = x[src, c0 + c]
                s += v * v
            ms = block_sum(red, tid, s) / float32(D)
            inv = float32(1.0) / math.sqrt(ms + eps)
            w0 = h * wh
            for c in range(tid, D, NT):
                v = x[src, c0 + c] * inv * w[w0 + c]
                if add:
                    out[i, c0 + c] += v
                else:
                    out[i, c0 + c] = v
            cuda.syncthreads()  # in-place: every read of this row precedes the next item's writes

    return rmsnorm


def _make_rope() -> Any:
    """Rotate heads in place: x (T, W), heads of D at columns col + h*D, rows row0..row0+n-1.

    Angle of pair i at position p: ``p * inv[i]`` computed in float64 (inv (rope_dim/2,) float64
    already holds the base, frequency factors and linear scaling), as the CPU tables are; cos and
    sin times ``msc`` (YaRN's / LongRoPE's magnitude, 1 for plain RoPE). NEOX pairs (i, i + rope_dim/2),
    normal pairs (2i, 2i + 1).
    """

    @cuda.jit
    def rope(x, pos, row0, n, col, nheads, D, inv, rope_dim, neox, msc):
        half = rope_dim // 2
        total = n * nheads * half
        for idx in range(cuda.grid(1), total, cuda.gridsize(1)):
            i = idx % half
            th = idx // half
            h = th % nheads
            t = row0 + th // nheads
            ang = float64(pos[t]) * inv[i]
            c = float32(msc * math.cos(ang))
            s = float32(msc * math.sin(ang))
            base = col + h * D
            if neox:
                ia = base + i
                ib = base + i + half
            else:
                ia = base + 2 * i
                ib = base + 2 * i + 1
            a = x[t, ia]
            b = x[t, ib]
            x[t, ia] = a * c - b * s
            x[t, ib] = a * s + b * c

    return rope


def _make_kv_store() -> Any:
    """Append keys and values of rows row0..row0+n-1 to one sequence's cache layer (float16).

    k at qkv[:, kcol + h*Dk + d], v at qkv[:, vcol + h*Dv + d]; Kc (Hkv, cap, Dk), Vc (Hkv, cap, Dv)
    float16 at positions pos[t] (the device cache is the cache: nothing is copied to the host).
    """

    @cuda.jit
    def kv_store(qkv, pos, row0, n, kcol, vcol, Hkv, Dk, Dv, Kc, Vc):
        Dm = max(Dk, Dv)
        total = n * Hkv * Dm
        for idx in range(cuda.grid(1), total, cuda.gridsize(1)):
            d = idx % Dm
            th = idx // Dm
            h = th % Hkv
            t = row0 + th // Hkv
            p = pos[t]
            if d < Dk:
                Kc[h, p, d] = qkv[t, kcol + h * Dk + d]
            if d < Dv:
                Vc[h, p, d] = qkv[t, vcol + h * Dv + d]

    return kv_store


def _make_attention(NT: int, MAXD: int, block_sum: Callable, block_max: Callable) -> Any:
    """Causal grouped-query attention of rows row0..row0+n-1 over one sequence's cache.

    One block per (query row, head), grid-stride. Query head h reads KV head h // (H/Hkv); the
    query at position p sees keys lo..p with lo = max(0, p - window + 1) when window > 0 (sliding
    window) else 0. Keys are taken NT at a time with an online softmax (running max and sum), so
    the context length is not bounded by shared memory. q at qkv[t, h*Dk + d]; out (T, H*Dv).
    ``sinks`` (H,) (when has_sinks): per-head logits that join each softmax's denominator only
    (gpt-oss' attention sinks).
    """

    @cuda.jit
    def attention(qkv, Kc, Vc, out, pos, row0, n, H, Hkv, Dk, Dv, scale, window, softcap, sinks, has_sinks):
        tid = cuda.threadIdx.x
        qs = cuda.shared.array(MAXD, float32)
        accs = cuda.shared.array(MAXD, float32)
        ps = cuda.shared.array(NT, float32)
        red = cuda.shared.array(NT, float32)
        g = H // Hkv
        for item in range(cuda.blockIdx.x, n * H, cuda.gridDim.x):
            t = row0 + item // H
            h = item % H
            kh = h // g
            p = pos[t]
            lo = 0
            if window > 0:
                lo = max(0, p - window + 1)
            for d in range(tid, Dk, NT):
                qs[d] = qkv[t, h * Dk + d]
            for d in range(tid, Dv, NT):
                accs[d] = float32(0.0)
            cuda.syncthreads()
            m = float32(-math.inf)
            l = float32(0.0)
            for j0 in range(lo, p + 1, NT):
                j = j0 + tid
                s = float32(-math.inf)
                if j <= p:
                    s = float32(0.0)
                    for d in range(Dk):
                        s += qs[d] * float32(Kc[kh, j, d])
                    s *= scale
                    if softcap > 0:
                        s = math.tanh(s / softcap) * softcap
                mx = block_max(red, tid, s)
                mnew = max(m, mx)
                alpha = math.exp(m - mnew)  # 0 on the first tile (m = -inf)
                e = float32(0.0)
                if j <= p:
                    e = math.exp(s - mnew)
                ps[tid] = e
                l = l * alpha + block_sum(red, tid, e)  # block_sum's barrier also publishes ps
                nj = min(NT, p + 1 - j0)
                for d in range(tid, Dv, NT):
                    a = accs[d] * alpha
                    for jj in range(nj):
                        a += ps[jj] * float32(Vc[kh, j0 + jj, d])
                    accs[d] = a
                m = mnew
                cuda.syncthreads()
            f = float32(1.0) / l
            if has_sinks:  # exp(sink) in the denominator, both sides scaled by the larger maximum
                ms = max(m, sinks[h])
                r = math.exp(m - ms)
                f = r / (l * r + math.exp(sinks[h] - ms))
            for d in range(tid, Dv, NT):
                out[t, h * Dv + d] = accs[d] * f
            cuda.syncthreads()

    return attention


def _make_act_mul() -> Any:
    """out[t, c] = act(gu[t, c]) * gu[t, F + c] for t < n, c < F (SiLU kind 0, GELU-tanh kind 1);
    kind 2 is gpt-oss' clamped SwiGLU: g = min(gu[t, c], limit), u = clamp(gu[t, F + c], ±limit),
    out = g * sigmoid(alpha * g) * (u + 1) (alpha and limit unused by the other kinds)."""

    @cuda.jit
    def act_mul(gu, out, n, F, kind, alpha, limit):
        for idx in range(cuda.grid(1), n * F, cuda.gridsize(1)):
            t = idx // F
            c = idx - t * F
            a = gu[t, c]
            u = gu[t, F + c]
            if kind != 2:
                a = _activation(a, kind)
            else:
                a = min(a, limit)
                a = a / (float32(1.0) + math.exp(-alpha * a))
                u = min(max(u, -limit), limit) + float32(1.0)
            out[t, c] = a * u

    return act_mul


def _make_act() -> Any:
    """y[t, c] = act(y[t, c]) in place for t < n, c < F: an MLP without a gate, down(act(up(x))); SiLU kind 0,
    GELU-tanh kind 1, squared ReLU kind 3 (Nemotron-H)."""

    @cuda.jit
    def act(y, n, F, kind):
        for idx in range(cuda.grid(1), n * F, cuda.gridsize(1)):
            t = idx // F
            y[t, idx - t * F] = _activation(y[t, idx - t * F], kind)

    return act


MAX_EXPERTS_USED = 16  # most experts a token may choose (route's local array)


def _make_route() -> Any:
    """The router's choice per token, as :func:`minirt.blocks.route`, one thread per token.

    rl (>= T, E) router logits; gating 0 softmax, 1 sigmoid, 2 softmax over the chosen logits;
    selb (E,) selection bias (used when has_selb); ids (T * k,) int32 the chosen experts in
    descending order of score (ties: lower id first); w (T * k,) their weights, renormalised to sum
    1 when ``norm`` and times ``scale``.
    """

    @cuda.jit(device=True)
    def prob(rl, t, e, gating, mx, ssum):
        v = rl[t, e]
        if gating == 0:
            return math.exp(v - mx) / ssum
        if gating == 1:
            return float32(1.0) / (float32(1.0) + math.exp(-v))
        return v

    @cuda.jit
    def route(rl, T, E, k, gating, selb, has_selb, norm, scale, ids, w):
        chosen = cuda.local.array(MAX_EXPERTS_USED, int32)
        for t in range(cuda.grid(1), T, cuda.gridsize(1)):
            mx = rl[t, 0]
            for e in range(1, E):
                mx = max(mx, rl[t, e])
            ssum = float32(0.0)
            if gating == 0:
                for e in range(E):
                    ssum += math.exp(rl[t, e] - mx)
            for s in range(k):
                best = -1
                bv = float32(0.0)
                for e in range(E):
                    taken = False
                    for q in range(s):
                        if chosen[q] == e:
                            taken = True
                    if taken:
                        continue
                    v = prob(rl, t, e, gating, mx, ssum)
                    if has_selb:
                        v += selb[e]
                    if best < 0 or v > bv:
                        best = e
                        bv = v
                chosen[s] = best
                ids[t * k + s] = best
                w[t * k + s] = prob(rl, t, best, gating, mx, ssum)
            if gating == 2:  # softmax among the chosen
                m2 = w[t * k]
                for s in range(1, k):
                    m2 = max(m2, w[t * k + s])
                tot = float32(0.0)
                for s in range(k):
                    w[t * k + s] = math.exp(w[t * k + s] - m2)
                    tot += w[t * k + s]
                for s in range(k):
                    w[t * k + s] /= tot
            if norm:
                tot = float32(0.0)
                for s in range(k):
                    tot += w[t * k + s]
                tot = max(tot, float32(6.103515625e-5))  # as llama.cpp: f16's smallest normal
                for s in range(k):
                    w[t * k + s] /= tot
            for s in range(k):
                w[t * k + s] *= scale

    return route


def _make_pair_moves() -> tuple[Any, Any]:
    """Prefill's grouping of (token, slot) pairs by expert: ``order`` (P,) int32 holds pair indices
    t * k + slot sorted by expert; an expert's pairs are order[start:start + n].

    pairs_gather: dst[j, :d] = src[order[start + j] // k, :d] (the tokens' inputs, j < n);
    pairs_scatter: dst[order[start + j], :d] = src[j, :d] (the expert's outputs to their pairs).
    """

    @cuda.jit
    def pairs_gather(src, order, start, n, k, dst, d):
        for idx in range(cuda.grid(1), n * d, cuda.gridsize(1)):
            j = idx // d
            c = idx - j * d
            dst[j, c] = src[order[start + j] // k, c]

    @cuda.jit
    def pairs_scatter(src, order, start, n, dst, d):
        for idx in range(cuda.grid(1), n * d, cuda.gridsize(1)):
            j = idx // d
            c = idx - j * d
            dst[order[start + j], c] = src[j, c]

    return pairs_gather, pairs_scatter


def _make_moe_combine() -> Any:
    """out[t, c] = (out[t, c] if acc) + sum_s w[t*k + s] * ey[t*k + s, c]
    + (sigmoid(sgl[t, 0]) if has_sg else 1) * sh[t, c] (if has_sh), for t < T, c < d."""

    @cuda.jit
    def moe_combine(out, acc, ey, w, T, k, d, sh, has_sh, sgl, has_sg):
        for idx in range(cuda.grid(1), T * d, cuda.gridsize(1)):
            t = idx // d
            c = idx - t * d
            v = float32(0.0)
            for s in range(k):
                v += w[t * k + s] * ey[t * k + s, c]
            if has_sh:
                g = float32(1.0)
                if has_sg:
                    g = float32(1.0) / (float32(1.0) + math.exp(-sgl[t, 0]))
                v += g * sh[t, c]
            if acc:
                v += out[t, c]
            out[t, c] = v

    return moe_combine


def _make_scale_rows() -> Any:
    """y[t, c] *= s for t < n, c < N (Granite's residual multiplier on a sublayer's input)."""

    @cuda.jit
    def scale_rows(y, n, N, s):
        for idx in range(cuda.grid(1), n * N, cuda.gridsize(1)):
            t = idx // N
            y[t, idx - t * N] *= s

    return scale_rows


def _make_bias_add() -> Any:
    """y[t, col + c] += bias[c] for t < n, c < N (after a cuBLAS GEMM)."""

    @cuda.jit
    def bias_add(y, col, bias, n, N):
        for idx in range(cuda.grid(1), n * N, cuda.gridsize(1)):
            t = idx // N
            c = idx - t * N
            y[t, col + c] += bias[c]

    return bias_add


def _make_softcap() -> Any:
    """y = tanh(y / cap) * cap over the first n rows (final logit soft-capping)."""

    @cuda.jit
    def softcap(y, n, cap):
        V = y.shape[1]
        for idx in range(cuda.grid(1), n * V, cuda.gridsize(1)):
            t = idx // V
            c = idx - t * V
            y[t, c] = math.tanh(y[t, c] / cap) * cap

    return softcap


# ---------------------------------------------------------------------------------------------
# what takes attention's place in hybrid models (LFM2, Qwen3.5, Mamba-2), and Qwen3.5's output gate
# ---------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _softplus(x):
    # log(1 + e^x) without overflow (numpy's logaddexp(0, x))
    return max(x, float32(0.0)) + math.log1p(math.exp(-abs(x)))


@cuda.jit(device=True)
def _sigmoid(x):
    # the tanh form minirt.blocks.sigmoid uses: no overflow for large |x|
    return float32(0.5) * math.tanh(float32(0.5) * x) + float32(0.5)


def _make_out_gate() -> tuple[Any, Any]:
    """Qwen3.5's gated attention. ``split_gate``: src (T, H*(Dk+Dv)) holds per head its query (Dk)
    then its output gate (Dv); queries go to qkv[t, h*Dk + d], gates to gate[t, h*Dv + d].
    ``sigmoid_mul``: y[t, c] *= sigmoid(g[t, c]) for t < n, c < N."""

    @cuda.jit
    def split_gate(src, T, H, Dk, Dv, qkv, gate):
        W = Dk + Dv
        for idx in range(cuda.grid(1), T * H * W, cuda.gridsize(1)):
            t = idx // (H * W)
            r = idx - t * H * W
            h = r // W
            d = r - h * W
            if d < Dk:
                qkv[t, h * Dk + d] = src[t, r]
            else:
                gate[t, h * Dv + d - Dk] = src[t, r]

    @cuda.jit
    def sigmoid_mul(y, g, n, N):
        for idx in range(cuda.grid(1), n * N, cuda.gridsize(1)):
            t = idx // N
            c = idx - t * N
            y[t, c] *= _sigmoid(g[t, c])

    return split_gate, sigmoid_mul


def _make_l2norm(NT: int, block_sum: Callable) -> Any:
    """x[t, col + h*D + c] /= max(||x[t, col + h*D : col + (h+1)*D]||, eps) in place, t < n, h < nheads
    (ggml's l2_norm, :func:`minirt.blocks.l2_normalize`); one block per (row, head)."""

    @cuda.jit
    def l2norm(x, n, col, nheads, D, eps):
        tid = cuda.threadIdx.x
        red = cuda.shared.array(NT, float32)
        for item in range(cuda.blockIdx.x, n * nheads, cuda.gridDim.x):
            t = item // nheads
            c0 = col + (item - t * nheads) * D
            s = float32(0.0)
            for c in range(tid, D, NT):
                v = x[t, c0 + c]
                s += v * v
            inv = float32(1.0) / max(math.sqrt(block_sum(red, tid, s)), eps)
            for c in range(tid, D, NT):
                x[t, c0 + c] *= inv
            cuda.syncthreads()

    return l2norm


def _make_short_conv() -> tuple[Any, Any]:
    """LFM2's gated short convolution of one segment, rows row0..row0+n-1 at positions pos[t].

    bcx (T, 3d) holds B | C | x; the cache layer Kc (Hc, cap, d/Hc) float16 keeps B·x of every earlier
    position (channel c at head c // Dh, column c % Dh). ``short_conv``: out[t, c] = C[t, c] * sum_j
    w[c, j] * bx(pos[t] - taps + 1 + j, c), bx of this segment's own positions exact from bcx (as the
    host path reads them), earlier ones from the cache, zero before position 0. ``short_conv_store``
    appends this segment's B·x to the cache."""

    @cuda.jit
    def short_conv(bcx, Kc, out, pos, row0, n, d, Dh, w, L):
        pseg = pos[row0]
        for idx in range(cuda.grid(1), n * d, cuda.gridsize(1)):
            i = idx // d
            c = idx - i * d
            t = row0 + i
            p = pos[t]
            h = c // Dh
            e = c - h * Dh
            acc = float32(0.0)
            for j in range(L):
                q = p - L + 1 + j
                if q >= pseg:
                    t2 = row0 + q - pseg
                    acc += w[c, j] * (bcx[t2, c] * bcx[t2, 2 * d + c])
                elif q >= 0:
                    acc += w[c, j] * float32(Kc[h, q, e])
            out[t, c] = bcx[t, d + c] * acc

    @cuda.jit
    def short_conv_store(bcx, Kc, pos, row0, n, d, Dh):
        for idx in range(cuda.grid(1), n * d, cuda.gridsize(1)):
            i = idx // d
            c = idx - i * d
            t = row0 + i
            h = c // Dh
            Kc[h, pos[t], c - h * Dh] = bcx[t, c] * bcx[t, 2 * d + c]

    return short_conv, short_conv_store


def _make_rconv() -> tuple[Any, Any]:
    """The causal depthwise convolution in front of a delta-net or Mamba-2 scan, for one segment.

    Its inputs are the taps − 1 rows of ``state`` (taps − 1, C) then the segment's rows src[row0 + i,
    scol : scol + C], i < n. ``rconv``: out[row0 + i, c] = silu(bias[c] + sum_j w[c, j] * input(i + j))
    (bias when has_bias). ``rconv_state``: dst = the taps − 1 inputs after the first ``shift`` rows, i.e.
    the state after ``shift`` tokens; dst may be state itself (one thread per channel walks its rows
    upwards, each read above the rows written before it)."""

    @cuda.jit
    def rconv(src, scol, state, out, row0, n, C, w, L, bias, has_bias):
        for idx in range(cuda.grid(1), n * C, cuda.gridsize(1)):
            i = idx // C
            c = idx - i * C
            acc = float32(0.0)
            if has_bias:
                acc = bias[c]
            for j in range(L):
                r = i + j  # index into [state rows | segment rows]
                if r < L - 1:
                    acc += w[c, j] * state[r, c]
                else:
                    acc += w[c, j] * src[row0 + r - (L - 1), scol + c]
            out[row0 + i, c] = acc / (float32(1.0) + math.exp(-acc))

    @cuda.jit
    def rconv_state(src, scol, state, dst, row0, shift, C, L):
        for c in range(cuda.grid(1), C, cuda.gridsize(1)):
            for j in range(L - 1):
                r = shift + j
                if r < L - 1:
                    dst[j, c] = state[r, c]
                else:
                    dst[j, c] = src[row0 + r - (L - 1), scol + c]

    return rconv, rconv_state


def _make_dn_gates() -> Any:
    """The delta-net's per (token, value head) gates: g[t, j] = exp(a[j] * softplus(alpha + dt_bias[j]))
    (the decay) and g[t, Hv + j] = sigmoid(beta), for t < T, j < Hv. Value head j's beta sits at
    proj[t, bcol + (j // rep) * grp + j % rep] and its alpha at acol + the same offset (separate
    projections: rep = Hv, grp = 0; Qwen3-Next's ba_proj: per key head rep beta then rep alpha rows)."""

    @cuda.jit
    def dn_gates(proj, bcol, acol, rep, grp, T, Hv, dt_bias, a, g):
        for idx in range(cuda.grid(1), T * Hv, cuda.gridsize(1)):
            t = idx // Hv
            j = idx - t * Hv
            off = (j // rep) * grp + j % rep
            g[t, j] = math.exp(a[j] * _softplus(proj[t, acol + off] + dt_bias[j]))
            g[t, Hv + j] = _sigmoid(proj[t, bcol + off])

    return dn_gates


def _make_delta_scan(MAXD: int) -> Any:
    """The gated delta rule over one segment's rows row0..row0+n-1 (:func:`minirt.blocks.delta_rule`).

    qkv (T, 2*Hk*Dk + Hv*Dv): the convolution's output with q and k L2-normalised; value head j reads key
    head j // (Hv/Hk) when grouped, else j % Hk; g from dn_gates; S (Hv, Dk, Dv) the sequence's state,
    updated. One thread per (value head, value column) keeps its column of S (Dk <= MAXD) in local
    memory over the tokens: S = decay S; S += k (beta (v - S^T k)); out[t, ocol + j*Dv + e] = S^T q * qscale."""

    @cuda.jit
    def delta_scan(qkv, g, out, ocol, S, row0, n, Hk, Hv, Dk, Dv, grouped, qscale):
        col = cuda.local.array(MAXD, float32)
        rep = Hv // Hk
        for idx in range(cuda.grid(1), Hv * Dv, cuda.gridsize(1)):
            j = idx // Dv
            e = idx - j * Dv
            kh = j // rep if grouped else j % Hk
            q0 = kh * Dk
            k0 = Hk * Dk + kh * Dk
            v0 = 2 * Hk * Dk + j * Dv + e
            for r in range(Dk):
                col[r] = S[j, r, e]
            for t in range(row0, row0 + n):
                dec = g[t, j]
                kv = float32(0.0)
                for r in range(Dk):
                    s = col[r] * dec
                    col[r] = s
                    kv += s * qkv[t, k0 + r]
                delta = (qkv[t, v0] - kv) * g[t, Hv + j]
                o = float32(0.0)
                for r in range(Dk):
                    s = col[r] + qkv[t, k0 + r] * delta
                    col[r] = s
                    o += s * qkv[t, q0 + r]
                out[t, ocol + j * Dv + e] = o * qscale
            for r in range(Dk):
                S[j, r, e] = col[r]

    return delta_scan


def _make_ssm_scan(MAXD: int) -> Any:
    """Mamba-2's selective scan over one segment's rows row0..row0+n-1 (:func:`minirt.blocks.ssm_scan`),
    the D skip included.

    xbc (T, H*P + 2*G*N): the convolution's output x | B | C; dt raw at proj[t, dtcol + h] (softplus of it
    plus dt_bias[h] here); head h reads group h // (H/G); S (H, P, N) updated. One thread per (head, row
    p) keeps its row of S (N <= MAXD) in local memory: S = exp(dt a) S + (dt x) B; out[t, ocol + h*P + p]
    = S C + d_skip x."""

    @cuda.jit
    def ssm_scan(xbc, proj, dtcol, dt_bias, a, dskip, out, ocol, S, row0, n, H, P, N, G):
        row = cuda.local.array(MAXD, float32)
        rep = H // G
        for idx in range(cuda.grid(1), H * P, cuda.gridsize(1)):
            h = idx // P
            p = idx - h * P
            g = h // rep
            b0 = H * P + g * N
            c0 = H * P + G * N + g * N
            for r in range(N):
                row[r] = S[h, p, r]
            for t in range(row0, row0 + n):
                dt = _softplus(proj[t, dtcol + h] + dt_bias[h])
                dec = math.exp(dt * a[h])
                x = xbc[t, h * P + p]
                dx = dt * x
                y = float32(0.0)
                for r in range(N):
                    s = row[r] * dec + dx * xbc[t, b0 + r]
                    row[r] = s
                    y += s * xbc[t, c0 + r]
                out[t, ocol + h * P + p] = y + dskip[h] * x
            for r in range(N):
                S[h, p, r] = row[r]

    return ssm_scan


def _make_argmax(NT: int) -> Any:
    """out[t] = first index of the maximum of y[t, :] for t < n (greedy sampling on the device)."""

    @cuda.jit
    def argmax(y, n, out):
        tid = cuda.threadIdx.x
        rv = cuda.shared.array(NT, float32)
        ri = cuda.shared.array(NT, int32)
        V = y.shape[1]
        for t in range(cuda.blockIdx.x, n, cuda.gridDim.x):
            best = float32(-math.inf)
            bi = int32(V)
            for c in range(tid, V, NT):
                v = y[t, c]
                if v > best:  # strided scan: the first hit is this thread's lowest index
                    best = v
                    bi = c
            rv[tid] = best
            ri[tid] = bi
            cuda.syncthreads()
            s = NT // 2
            while s > 0:
                if tid < s:
                    ov = rv[tid + s]
                    oi = ri[tid + s]
                    if ov > rv[tid] or (ov == rv[tid] and oi < ri[tid]):
                        rv[tid] = ov
                        ri[tid] = oi
                cuda.syncthreads()
                s //= 2
            if tid == 0:
                out[t] = ri[0]
            cuda.syncthreads()

    return argmax
