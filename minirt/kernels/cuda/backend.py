"""The CUDA backend: quantized weights in VRAM, kernels from :mod:`.kernels`, whole forward on
the device.

Two ways in:

- :meth:`CudaBackend.matmul` ``(x, lin)`` — the per-op contract every backend has: host float32
  in, host float32 out, weight already in VRAM. Used for architectures without a device forward.
- :meth:`CudaBackend.forward` ``(model, tokens, segments)`` — the whole decoder on the device for
  the descriptions :meth:`CudaBackend._unsupported` accepts (attention, short-convolution, gated
  delta-net or Mamba-2 mixers; dense, ungated or mixture-of-experts feed-forwards): embeddings, every layer,
  final norm and output
  projection run as kernels over device buffers; per call one host→device copy of the token ids
  and positions and one device→host copy of the requested logits.
  Returns ``None`` for a model it does not handle, so the caller can use the host path.

KV cache: the device cache is the cache. Each :class:`~minirt.kv_cache.KVCache` the device has seen
gets a float16 copy in VRAM (a *mirror*, in the code); a forward writes its new keys and values
there only and marks them in ``KVCache.device_rows``. The host arrays of a KVCache are reserved,
not resident (anonymous pages), and stay untouched while a conversation runs on the device: no
host memory and no device→host copy per step. Host code that reads or writes the rows (prefix copy,
context shift, state save/load, a host-path forward) goes through ``KVCache.k`` / ``v`` /
``layer``, which first has the device copy its rows back (:meth:`CudaBackend._flush`) and counts
the access in ``host_epoch``. A forward trusts a mirror whose cache the host has not touched since
(same epoch, same token ids); otherwise it compares the newest key row of layer 0 with what the
device last saw, and re-uploads the cache once after a context shift, a prefix copy or a state
load changed it. Mirrors grow by doubling (copied on the device) and are evicted
least-recently-used beyond a VRAM budget, after their rows are copied back to the host: the host
arrays hold a sequence only when VRAM does not.

Recurrent state (the delta-net's and Mamba-2's convolution inputs and scan state): the same rule. A mirror
holds each such layer's state in float32; a forward updates it there and sets ``KVCache.device_state``;
every host access to the state (``KVCache.state``, export / import, prefix copy, truncation to a snapshot)
first has ``_flush`` copy it back, and bumps ``host_epoch``, after which the next forward uploads the host's
state again. The snapshot a prefill leaves (the state before its last token, which the prefix cache
continues from) is copied to the host as it is taken.

Launch overhead: a single-sequence decode step (one token, the case that dominates generation)
is captured once per mirror into a CUDA graph through CuPy and replayed, since its kernels read
positions from device memory. Prefill (many tokens) runs eagerly: its kernels are few and large.
Prefill matmuls dequantize a tile of weight rows into a scratch buffer and call cuBLAS SGEMM
through CuPy (accumulating into the residual stream in place); without CuPy a tiled quantized
GEMM kernel does the same.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import cuda

from ...blocks import Attention, GatedDeltaNet, Mamba2, MoE, ParallelMixer, ParallelMoE, ShortConv
from ...errors import BackendError
from ...forward import batch_spans, logit_rows, split_logits
from ..base import Backend
from . import simulator_active
from .kernels import MAX_EXPERTS_USED, LaunchConfig, get_kernels
from .quant import SUPPORTED_TYPES, TYPE_SIZES

log = logging.getLogger(__name__)

UPLOAD_CHUNK = 32 << 20  # bytes per host→device copy through the pinned staging buffer
WTMP_BYTES = 8 << 20  # dequantized weight tile for the cuBLAS path
LOGITS_BYTES = 32 << 20  # output-projection rows computed per chunk (Model.logits asks for all)
MIN_KV_CAP = 256  # first capacity of a KV mirror (positions); grows by doubling


@dataclass
class DeviceWeight:
    """One 2-D weight in VRAM: the raw blocks and their float16/float32 views (see quant.py)."""

    name: str
    qtype: str
    rows: int
    cols: int
    w8: Any
    w16: Any
    w32: Any

    @property
    def args(self) -> tuple[Any, Any, Any]:
        return self.w8, self.w16, self.w32


@dataclass
class _Buffers:
    """Activations for up to ``tcap`` tokens (one set for decode, one grown for batches)."""

    tcap: int
    x: Any  # (tcap, d) residual stream
    h: Any  # (tcap, d) normed input of a sublayer
    a: Any  # (tcap, d) sublayer output before a post-norm (gemma3)
    qkv: Any  # (tcap, H*Dk + Hkv*Dk + Hkv*Dv)
    attn: Any  # (tcap, H*Dv)
    gu: Any  # (tcap, 2F) gate | up
    ff: Any  # (tcap, F) view of gu[:, :F]: the gated activation is written over the gate half
    ip_dev: Any  # int32 (3*tcap): ids | positions | rows whose logits are wanted
    ip_host: np.ndarray
    ids: Any
    pos: Any
    lrows: Any
    rchunk: int  # most logits rows per output-projection chunk
    moe: Any = None  # _MoEBuffers of a model with mixture-of-experts layers
    mix: Any = None  # _MixBuffers of a model with short-convolution, delta-net or Mamba-2 layers
    qg: Any = None  # (tcap, H*(Dk+Dv)) queries and output gates of gated attention (Qwen3.5)
    og: Any = None  # (tcap, H*Dv) those output gates
    hrows: Any = None  # (rows, d), rows <= rchunk, grown on demand
    logits: Any = None  # (rows, V)
    logits_host: Any = None
    nbytes: int = 0


@dataclass
class _MoEBuffers:
    """Mixture-of-experts scratch for up to tcap tokens choosing k experts each (P = tcap * k pairs)."""

    rl: Any  # (tcap, E) router logits
    ids: Any  # int32 (P,) chosen experts, pair j = t * k + slot
    w: Any  # (P,) their weights
    eg: Any  # (P, 2 Fe) an expert's gate | up per pair (prefill: per row of one expert's group)
    ea: Any  # (P, Fe) view of eg[:, :Fe]: the gated activation
    ey: Any  # (P, d) each pair's expert output
    xg: Any  # (tcap, d) one expert's gathered inputs (prefill)
    yg: Any  # (tcap, d) its outputs
    sh: Any  # (tcap, d) the shared expert's output
    sg: Any  # (tcap, 1) the shared expert's gate logit
    order: Any  # int32 (P,) pairs sorted by expert (prefill)
    ids_host: np.ndarray
    order_host: np.ndarray


@dataclass
class _MixBuffers:
    """Scratch of the mixers that take attention's place (see :meth:`CudaBackend._mixer`)."""

    proj: Any  # (tcap, widest input projection) what in_proj (or the delta-net's projections) give
    conv: Any  # (tcap, widest convolution) the convolution's output
    out: Any  # (tcap, widest out_proj input)
    gates: Any  # (tcap, 2 Hv) the delta-net's decay | beta
    snap: Any  # (most taps - 1, widest convolution) a prefill's convolution inputs before its last token


@dataclass
class _Mirror:
    """The device copy (float16) of one KVCache plus what is needed to check it is still current."""

    cap: int
    k: list  # per layer (Hkv, cap, Dk) float16; None for a layer without rows (a recurrent state instead)
    v: list  # per layer (Hkv, cap, Dv) float16; None also for LFM2's convolution rows (keys only)
    state: list = field(default_factory=list)  # per layer None or its recurrent state arrays (float32)
    shadow_layer: int = -1  # the layer whose newest key row ``shadow`` keeps (the plan's shadow_layer)
    n_valid: int = 0
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    shadow: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # layer-0 keys, host form
    epoch: int = -1  # the cache's host_epoch when the device last checked its host rows
    nbytes: int = 0
    last_used: int = 0
    graph: Any = None  # captured decode step
    decode_steps: int = 0


@dataclass
class _Plan:
    """How one model's description runs on the device: per-layer weights, norms and settings, constants."""

    layers: list  # per layer: a dict of device weights / vectors and the layer's settings
    tok_embd: DeviceWeight
    output: DeviceWeight
    output_norm: Any
    post_norms: bool  # some layer has a norm after attention or MLP (needs the extra buffer)
    d: int
    H: int
    Hkv: int
    Dk: int
    Dv: int
    F: int
    V: int
    n_layer: int
    eps: np.float32
    final_softcap: np.float32
    embed_scale: np.float32
    qkvw: int
    moe: tuple[int, int, int] = (0, 0, 0)  # largest (experts, experts per token, expert width); 0: no MoE
    kv_shapes: list = field(default_factory=list)  # per layer (heads, Dk, Dv) of its cache rows, or None
    states: list = field(default_factory=list)  # per layer the shapes of its recurrent state, or None
    shadow_layer: int = -1  # the first layer with cache rows (_mirror_current compares its newest row)
    mix: tuple[int, int, int, int] = (0, 0, 0, 0)  # widest mixer projection, convolution, out_proj input, gates
    out_gate: bool = False  # some attention layer gates its output (Qwen3.5)

    @property
    def has_state(self) -> bool:
        return any(s is not None for s in self.states)


_ACTS = {"silu": 0, "gelu_tanh": 1}
_GATING = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}
_EXPERT_ACTS = {**_ACTS, "swiglu_oai": 2}  # act_mul's kinds (the fused dense GLU kernel has the first two)
_UNGATED_ACTS = {**_ACTS, "relu2": 3}  # the activation kernel's kinds: down(act(up(x))) MLPs (Nemotron-H)
_NO_PARAM = np.float32(0.0)


class CudaBackend(Backend):
    """Quantized weights in VRAM, fused dequantizing kernels, whole forward on the device."""

    name = "cuda"

    def __init__(self, gguf_file: Any, *, progress: Callable[[int, int], Any] | None = None,
                 launch: LaunchConfig | None = None, use_cupy: bool | None = None,
                 use_graphs: bool | None = None, kv_vram_bytes: int | None = None,
                 allow_simulator: bool = False, blas: Callable[..., None] | None = None) -> None:
        """Upload every 2-D weight of ``gguf_file`` (a :class:`minirt.gguf.GGUFFile`) to the GPU.

        progress(done_bytes, total_bytes) is called after each tensor. ``launch`` overrides the
        block/grid configuration; ``use_cupy`` / ``use_graphs`` force CuPy (cuBLAS prefill, CUDA
        graphs) on or off; ``kv_vram_bytes`` bounds the KV mirrors; ``allow_simulator`` lets tests
        run under numba's CUDA simulator; ``blas`` replaces the cuBLAS call (tests).
        """
        self.sim = simulator_active()
        if self.sim and not allow_simulator:
            raise BackendError("numba's CUDA simulator is active; the CUDA backend needs a GPU")
        self._lock = threading.RLock()
        self.file = gguf_file
        self.lc = launch or (LaunchConfig.simulator() if self.sim else LaunchConfig.from_env())
        self.k = get_kernels(self.lc)
        self._closed = False
        self._bytes = {"weights": 0, "scratch": 0}  # KV mirrors are counted from the live mirrors
        self._cp = None
        if use_cupy is None:
            use_cupy = not self.sim
        self.cp_stream = None
        if use_cupy:
            try:
                import cupy

                # one stream shared by CuPy (cuBLAS, graph capture) and numba's launches
                self.cp_stream = cupy.cuda.Stream(non_blocking=True)
                self.stream = cuda.external_stream(self.cp_stream.ptr)
                self._cp = cupy
            except Exception as e:  # ImportError, or a CuPy built for another CUDA
                log.warning("CuPy unusable (%s): prefill uses the numba GEMM, decode runs without CUDA graphs", e)
                self.cp_stream = None
        if not self.sim:
            import numba

            numba.config.CUDA_LOW_OCCUPANCY_WARNINGS = 0  # small decode grids are intended
        if self._cp is None:
            self.cp_stream = None
            self.stream = 0 if self.sim else cuda.stream()
        self.use_graphs = bool(self._cp is not None and not self.sim) if use_graphs is None else use_graphs
        self._blas = blas
        if blas is None and self._cp is not None:
            self._blas = self._cublas_sgemm
            self._alpha = np.ones(1, np.float32)
            self._betas = (np.zeros(1, np.float32), np.ones(1, np.float32))
        self._dummy32 = cuda.to_device(np.zeros((1, 1), np.float32))
        self._dummy_bias = cuda.to_device(np.zeros(1, np.float32))
        self.weights: dict[str, DeviceWeight] = {}
        self._vectors: dict[int, tuple[np.ndarray, Any]] = {}  # id(host array) → (array, device copy)
        self._plans: weakref.WeakKeyDictionary[Any, _Plan | None] = weakref.WeakKeyDictionary()
        self._bufs: dict[str, _Buffers] = {}
        self._mirrors: weakref.WeakKeyDictionary[Any, _Mirror] = weakref.WeakKeyDictionary()
        self._clock = 0
        self._wtmp = None
        self._arange = None
        self._views: dict[tuple, Any] = {}
        self.skipped: dict[str, str] = {}
        self._staging = None
        self._upload(progress)
        if kv_vram_bytes is None:
            kv_vram_bytes = 8 << 30
            if not self.sim:  # at most half of what is free once the weights are in
                free, _total = cuda.current_context().get_memory_info()
                kv_vram_bytes = int(min(kv_vram_bytes, 0.5 * free))
        self.kv_vram_bytes = kv_vram_bytes

    # -- memory ----------------------------------------------------------------------------------
    def _alloc(self, shape: Any, dtype: Any, kind: str = "scratch") -> Any:
        a = cuda.device_array(shape, dtype=dtype)
        if kind in self._bytes:
            self._bytes[kind] += a.nbytes
        return a

    def _upload(self, progress: Callable[[int, int], Any] | None) -> None:
        """Copy each supported 2-D weight from the mapped file to VRAM, one tensor at a time.

        Rows travel through one pinned staging buffer of UPLOAD_CHUNK bytes, so host memory holds
        at most one chunk beyond the mapping, never the whole file.
        """
        if self.file is None:
            return
        todo = []
        for name, t in self.file.tensors.items():
            if len(t.shape) not in (2, 3):  # 3-D: experts, uploaded as one matrix of n_expert * rows rows
                continue
            why = self.unsupported_reason(t.qtype, t.shape[1])
            if why:
                self.skipped[name] = why
                continue
            todo.append((name, t))
        total = sum(t.data.nbytes for _, t in todo)
        done = 0
        for name, t in todo:
            self.add_weight(name, t.qtype, t.data.reshape(-1, t.row_bytes))
            done += t.data.nbytes
            if progress is not None:
                progress(done, total)
        self._staging = None
        if self.skipped:
            log.info("CUDA backend: %d tensors stay on the host: %s", len(self.skipped),
                     "; ".join(f"{k}: {v}" for k, v in list(self.skipped.items())[:5]))

    @staticmethod
    def unsupported_reason(qtype: str, cols: int) -> str:
        """Why a weight of this type and row length cannot live on the device ('' if it can)."""
        if qtype not in SUPPORTED_TYPES:
            return f"type {qtype} has no CUDA kernel"
        if cols % 32:
            return f"{cols} columns is not a multiple of 32"
        if qtype == "MXFP4" and cols % 64:  # 17-byte blocks: an odd count leaves rows unaligned for the f16 view
            return f"an odd number of MXFP4 blocks per row ({cols} columns)"
        return ""

    def add_weight(self, name: str, qtype: str, raw: np.ndarray) -> DeviceWeight:
        """Upload one weight: raw uint8 (rows, row_bytes) ggml blocks of ``qtype`` (e.g. a mapped view)."""
        tsize, qk = TYPE_SIZES[qtype]
        rows, row_bytes = raw.shape
        cols = row_bytes // tsize * qk
        why = self.unsupported_reason(qtype, cols)
        if why or row_bytes % tsize:
            raise BackendError(f"tensor {name!r}: {why or 'row size is not a whole number of blocks'}")
        dev = self._alloc(raw.shape, np.uint8, "weights")
        if self.sim:
            dev.copy_to_device(np.ascontiguousarray(raw))
        else:
            if self._staging is None:
                self._staging = cuda.pinned_array(UPLOAD_CHUNK, dtype=np.uint8)
            staging = self._staging
            rows_per = max(1, staging.size // row_bytes)
            if rows_per * row_bytes > staging.size:  # one row larger than the staging buffer
                dev.copy_to_device(np.ascontiguousarray(raw))
            else:
                for r0 in range(0, rows, rows_per):
                    r1 = min(rows, r0 + rows_per)
                    buf = staging[:(r1 - r0) * row_bytes].reshape(r1 - r0, row_bytes)
                    buf[...] = raw[r0:r1]  # mapped pages → pinned memory, one chunk at a time
                    dev[r0:r1].copy_to_device(buf)
        w16 = dev.view(np.float16)
        w32 = dev.view(np.float32) if qtype == "F32" else self._dummy32
        dw = DeviceWeight(name, qtype, rows, cols, dev, w16, w32)
        self.weights[name] = dw
        return dw

    def _vector(self, v: np.ndarray) -> Any:
        """Device float32 copy of a small host vector (norm gains, biases), uploaded once."""
        e = self._vectors.get(id(v))
        if e is None or e[0] is not v:
            e = (v, cuda.to_device(np.ascontiguousarray(v, dtype=np.float32)))
            self._bytes["weights"] += e[1].nbytes
            self._vectors[id(v)] = e
        return e[1]

    def weight(self, lin: Any) -> DeviceWeight | None:
        """The device copy of a :class:`~minirt.blocks.Linear` (None if it stays on the host)."""
        dw = lin.backend_data
        if isinstance(dw, DeviceWeight):
            return dw
        dw = self.weights.get(lin.name)
        if dw is None and lin.parent is not None:  # rows of a fused tensor: a view of its device copy
            whole = self.weights.get(lin.parent[0])
            if whole is not None and whole.cols == lin.in_features:
                r0 = lin.parent[1]
                dev = whole.w8[r0:r0 + lin.out_features]
                w32 = dev.view(np.float32) if whole.qtype == "F32" else self._dummy32
                dw = DeviceWeight(lin.name, whole.qtype, lin.out_features, whole.cols, dev, dev.view(np.float16), w32)
        if dw is not None and (dw.rows, dw.cols) == (lin.out_features, lin.in_features):
            lin.backend_data = dw
            return dw
        return None

    # -- launching ---------------------------------------------------------------------------------
    def _launch(self, kern: Any, grid: Any, block: int, *args: Any) -> None:
        if self.sim:
            kern[grid, block](*args)
        else:
            kern[grid, block, self.stream](*args)

    def _ew_grid(self, total: int) -> int:
        return self.lc.grid((total + self.lc.threads - 1) // self.lc.threads)

    def _arange_dev(self, n: int) -> Any:
        if self._arange is None or self._arange.shape[0] < n:
            self._views.clear()
            if self._arange is not None:
                self._bytes["scratch"] -= self._arange.nbytes
            size = max(n, 1024)
            self._arange = self._alloc(size, np.int32)
            self._arange.copy_to_device(np.arange(size, dtype=np.int32))
        return self._arange

    def _wtmp_dev(self) -> Any:
        if self._wtmp is None:
            self._wtmp = self._alloc(WTMP_BYTES // 4, np.float32)
        return self._wtmp

    def _mm(self, dw: DeviceWeight, x: Any, T: int, y: Any, ycol: int, bias: Any = None, acc: bool = False) -> None:
        """``y[:T, ycol:ycol+N] (+)= x[:T] @ W.T (+ bias)`` on the device; x (>=T, K), y (>=T, >=ycol+N)."""
        N, K = dw.rows, dw.cols
        lc = self.lc
        hb = bias is not None
        b = bias if hb else self._dummy_bias
        if T <= lc.mv_max_tokens:
            rpb = lc.mv_threads // lc.tpr(K)
            self._launch(self.k.matvec(dw.qtype, K), (lc.grid((N + rpb - 1) // rpb), lc.grid_y(T)), lc.mv_threads,
                         dw.w8, dw.w16, dw.w32, x, T, y, ycol, b, int(hb), int(acc), N, K)
        elif self._blas is not None:
            wtmp = self._wtmp_dev()
            per = max(1, wtmp.shape[0] // K)
            ar = self._arange_dev(N)
            deq = self.k.dequant_rows(dw.qtype)
            for r0 in range(0, N, per):
                nr = min(per, N - r0)
                # device-array views cost tens of microseconds to make: reuse them across calls
                key = (id(wtmp), id(ar), r0, nr, K)
                v = self._views.get(key)
                if v is None:
                    v = self._views[key] = (wtmp[:nr * K].reshape(nr, K), ar[r0:r0 + nr])
                tile, rows = v
                self._launch(deq, self._ew_grid(nr * K // 8), lc.threads, dw.w8, dw.w16, dw.w32, rows,
                             tile, nr, K, np.float32(1.0))
                self._blas(tile, nr, K, x, T, y, ycol + r0, acc)
            if hb:
                self._launch(self.k.bias_add, self._ew_grid(T * N), lc.threads, y, ycol, b, T, N)
        else:
            bm, bn = lc.gemm_gt * lc.gemm_gm, lc.gemm_gt * lc.gemm_gn
            self._launch(self.k.gemm(dw.qtype), (lc.grid((N + bm - 1) // bm), lc.grid_y((T + bn - 1) // bn)),
                         lc.gemm_gt * lc.gemm_gt, dw.w8, dw.w16, dw.w32, x, T, y, ycol, b, int(hb), int(acc), N, K)

    def _cublas_sgemm(self, tile: Any, nr: int, K: int, x: Any, T: int, y: Any, ycol: int, acc: bool) -> None:
        """y[:T, ycol:ycol+nr] (+)= x[:T] @ tile.T with cuBLAS (column-major view of row-major data)."""
        cublas = self._cublas_mod()
        handle = self._cp.cuda.device.get_cublas_handle()
        with self.cp_stream:
            # C (nr x T, ld = y's row length) = A^T (A: K x nr, ld K) * B (K x T, ld K)
            cublas.sgemm(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, nr, T, K,
                         self._alpha.ctypes.data, _ptr(tile), K, _ptr(x), x.strides[0] // 4,
                         self._betas[int(acc)].ctypes.data, _ptr(y) + 4 * ycol, y.strides[0] // 4)

    def _cublas_mod(self) -> Any:
        try:
            from cupy_backends.cuda.libs import cublas
        except ImportError:  # older CuPy layouts
            from cupy.cuda import cublas  # type: ignore[no-redef]
        return cublas

    # -- per-op API --------------------------------------------------------------------------------
    def matmul(self, x: np.ndarray, lin: Any) -> np.ndarray:
        """``x (T, in) @ W.T`` with W in VRAM (bias not added: the caller adds it). Host in/out."""
        with self._lock:
            self._check_open()
            dw = self.weight(lin)
            if dw is None:  # a type without a kernel: dequantize on the host
                from .. import get_backend

                return get_backend("numba").matmul(x, lin)
            x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, dw.cols)
            T = x2.shape[0]
            xd = cuda.to_device(x2)
            yd = cuda.device_array((T, dw.rows), np.float32)
            self._mm(dw, xd, T, yd, 0)
            out = yd.copy_to_host(stream=self.stream if not self.sim else 0)
            self._sync()
            return out.reshape(*x.shape[:-1], dw.rows) if x.ndim != 2 else out

    def _sync(self) -> None:
        if self.sim:
            return
        if self.cp_stream is not None:
            self.cp_stream.synchronize()
        else:
            self.stream.synchronize()

    # -- whole forward ------------------------------------------------------------------------------
    def _plan(self, model: Any) -> _Plan | None:
        if model in self._plans:
            return self._plans[model]
        p = self._make_plan(model)
        self._plans[model] = p
        return p

    def _make_plan(self, model: Any) -> _Plan | None:
        """The device plan of ``model.desc``, or None (logged) when some feature has no kernel here."""
        why = self._unsupported(model.desc)
        if why:
            log.info("no device forward for this model (%s); using per-op CUDA matmuls", why)
            return None
        desc = model.desc
        c = model.cfg
        tok = self.weights.get(desc.tok_embd.name)
        out = self.weight(desc.output)
        if tok is None or out is None:
            log.info("the embedding or output matrix stays on the host; using per-op CUDA matmuls")
            return None
        attns = [b.attn for b in desc.blocks if isinstance(b.attn, Attention)]
        a0 = attns[0] if attns else None
        H, Hkv, Dk, Dv = (a0.n_head, a0.n_head_kv, a0.head_dim_k, a0.head_dim_v) if a0 is not None else (0, 0, 0, 0)
        layers = []
        widths, moe_dims, mix_dims = [0], [(0, 0, 0)], [(0, 0, 0, 0)]
        for blk in desc.blocks:
            a, m = blk.attn, blk.mlp
            L: dict[str, Any] = {}
            dense = m.shared if isinstance(m, MoE) else m  # the MLP run by _mlp (a MoE's shared expert)
            if isinstance(a, Attention):
                mats = [("wq", a.wq), ("wk", a.wk), ("wv", a.wv), ("wo", a.wo)]
            else:
                mats, dims = self._mixer_plan(a, L)
                mix_dims.append(dims)
            if dense is not None:
                mats += [("up", dense.up), ("down", dense.down)] + ([("gate", dense.gate)] if dense.gate else [])
                widths.append(dense.n_ff)
            if isinstance(m, MoE):
                L["moe"] = self._moe_plan(m)
                if L["moe"] is None:
                    return None
                moe_dims.append((m.n_expert, m.router.n_used, m.n_ff))
            for key, lin in mats:
                dw = self.weight(lin)
                if dw is None:
                    log.info("tensor %s stays on the host; using per-op CUDA matmuls", lin.name)
                    return None
                L[key] = dw
                L[key + ".bias"] = self._vector(lin.bias) if lin.bias is not None else None
            for key, n in (("attn_norm", blk.attn_norm), ("q_norm", getattr(a, "q_norm", None)),
                           ("k_norm", getattr(a, "k_norm", None)), ("post_attn_norm", blk.post_attn_norm),
                           ("ffn_norm", blk.ffn_norm), ("post_ffn_norm", blk.post_ffn_norm)):
                L[key] = self._vector(n.weight) if n is not None else None
            # Granite's residual multiplier s (x += s·W·y) scales each sublayer's last input instead
            L["res_scale"] = np.float32(blk.residual_scale)
            L["eps"] = np.float32(next((n.eps for n in (blk.attn_norm, blk.ffn_norm, getattr(a, "q_norm", None),
                                                        blk.post_attn_norm, blk.post_ffn_norm) if n is not None), 1e-6))
            if isinstance(a, Attention):
                L["kind"] = "attn"
                # q/k norms over each head (Dk) or over the whole projection (one "head" of H·Dk)
                L["qk_heads"] = (a.n_head, a.n_head_kv, a.head_dim_k) if a.qk_norm_per_head else (1, 1, 0)
                L["inv"] = cuda.to_device(np.ascontiguousarray(a.rope.inv_freq())) if a.rope is not None else None
                L["rope_dim"] = a.rope.dim if a.rope is not None else 0
                L["neox"] = int(a.rope.neox) if a.rope is not None else 0
                L["msc"] = np.float64(a.rope.mscale()) if a.rope is not None else np.float64(1.0)
                L["sinks"] = self._vector(a.sinks) if a.sinks is not None else None
                L["window"], L["scale"], L["softcap"] = int(a.window), np.float32(a.scale), np.float32(a.softcap)
                L["qk_after_rope"] = bool(a.qk_norm_after_rope)
                L["out_gate"] = bool(a.out_gate)
            if dense is not None:
                L["gated"] = dense.gate is not None
                L["act"] = _ACTS[dense.act] if L["gated"] else _UNGATED_ACTS[dense.act]
                L["glu"] = L["gated"] and L["gate"].qtype == L["up"].qtype
                L["F"] = dense.n_ff
            layers.append(L)
        big = max([Dk, Dv] + [d for L in layers for d in L.get("local", ())])
        if big > self.lc.max_head_dim:
            log.info("head or state size %d exceeds the kernels' %d", big, self.lc.max_head_dim)
            return None
        # row indices for every weight's tiles, allocated once (no reallocation while kernels run)
        F = max(widths)
        self._arange_dev(max(c.n_vocab, 2 * F, c.n_embd, 1024))
        kv_shapes = list(desc.kv_layers())
        return _Plan(
            # Granite's logit multiplier folded into the output norm's gain (logits = W·(scale·norm(x)))
            layers=layers, tok_embd=tok, output=out, output_norm=self._vector(
                desc.output_norm.weight * np.float32(desc.logit_scale) if desc.logit_scale != 1.0
                else desc.output_norm.weight),
            post_norms=any(b.post_attn_norm is not None or b.post_ffn_norm is not None for b in desc.blocks),
            d=c.n_embd, H=H, Hkv=Hkv, Dk=Dk, Dv=Dv, F=F, V=c.n_vocab,
            n_layer=c.n_layer, eps=np.float32(desc.output_norm.eps), final_softcap=np.float32(desc.final_softcap),
            embed_scale=np.float32(desc.embed_scale), qkvw=H * Dk + Hkv * (Dk + Dv),
            moe=tuple(max(x) for x in zip(*moe_dims)), kv_shapes=kv_shapes, states=list(desc.recurrent_states()),
            shadow_layer=next((i for i, s in enumerate(kv_shapes) if s is not None), -1),
            mix=tuple(max(x) for x in zip(*mix_dims)), out_gate=any(a.out_gate for a in attns))

    def _mixer_plan(self, a: Any, L: dict[str, Any]) -> tuple[list[tuple[str, Any]], tuple[int, int, int, int]]:
        """Settings of a short-convolution, delta-net or Mamba-2 mixer into L; returns its matrices (out_proj as
        "wo", so that _residual adds it as it adds attention's) and its (projection, convolution, out_proj
        input, gates) widths of the scratch buffers (see :meth:`_mixer`)."""
        L["conv"] = self._vector(a.weight if isinstance(a, ShortConv) else a.conv)  # (channels, taps)
        L["taps"] = a.taps
        if isinstance(a, ShortConv):
            d = a.n_embd
            L.update(kind="short", d=d, Dh=d // a.cache_heads)
            return [("in", a.in_proj), ("wo", a.out_proj)], (3 * d, 0, d, 0)
        if isinstance(a, GatedDeltaNet):
            Hk, Hv, Dk, Dv = a.n_k_heads, a.n_v_heads, a.head_dim_k, a.head_dim_v
            F, cd = Hv * Dv, a.conv_dim
            L.update(kind="delta", Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, cd=cd, grouped=int(a.grouped), local=(Dk,),
                     dt_bias=self._vector(a.dt_bias), a=self._vector(a.a), norm=self._vector(a.norm.weight),
                     norm_eps=np.float32(a.norm.eps), qscale=np.float32(1.0 / np.sqrt(Dk)))
            mats = [("in", a.qkv_proj), ("z", a.z_proj), ("wo", a.out_proj)]
            mats += [("ba", a.ba_proj)] if a.ba_proj is not None else [("beta", a.beta_proj), ("alpha", a.alpha_proj)]
            return mats, (2 * F + cd + 2 * Hv, cd, F, 2 * Hv)
        # Mamba-2: z | xBC | dt from in_proj; the scan's output overwrites xBC's first d_inner columns
        di, cd, H = a.d_inner, a.conv_dim, a.n_head
        L.update(kind="mamba", di=di, cd=cd, H=H, P=a.head_dim, N=a.d_state, G=a.n_group, local=(a.d_state,),
                 conv_b=self._vector(a.conv_bias) if a.conv_bias is not None else None,
                 dt_bias=self._vector(a.dt_bias), a=self._vector(a.a), dskip=self._vector(a.d_skip),
                 norm=self._vector(a.norm.weight) if a.norm is not None else None,
                 norm_eps=np.float32(a.norm.eps if a.norm is not None else 0.0))
        return [("in", a.in_proj), ("wo", a.out_proj)], (di + cd + H, cd, di, 0)

    def _moe_plan(self, m: MoE) -> dict[str, Any] | None:
        """Device weights and settings of a mixture-of-experts feed-forward (None: an expert stays on the host).

        Each expert set (gate, up, down) is one stacked device matrix of its 3-D tensor plus a table of
        every expert's first row in it (fused gate_up tensors: two tables into the same matrix); the
        per-expert views serve prefill, which runs each chosen expert once over its tokens."""
        r = m.router
        router = self.weight(r.gate)
        M: dict[str, Any] = {"router": router, "router.bias": self._vector(r.gate.bias) if r.gate.bias is not None
                             else None, "E": m.n_expert, "k": r.n_used, "Fe": m.n_ff,
                             "gated": m.gate is not None,
                             "act": _EXPERT_ACTS[m.act] if m.gate is not None else _UNGATED_ACTS[m.act],
                             "act_params": tuple(np.float32(v) for v in m.act_params) if m.act == "swiglu_oai"
                             else (_NO_PARAM, _NO_PARAM),
                             "gating": _GATING[r.gating], "norm": int(r.norm_topk), "scale": np.float32(r.scale),
                             "selb": self._vector(r.selection_bias) if r.selection_bias is not None else None}
        if router is None:
            log.info("tensor %s stays on the host; using per-op CUDA matmuls", r.gate.name)
            return None
        for key, lins in (("gate", m.gate), ("up", m.up), ("down", m.down)):
            if lins is None:  # experts without a gate: down(act(up(x)))
                continue
            views = [self.weight(lin) for lin in lins]
            whole = self.weights.get(lins[0].parent[0]) if lins[0].parent is not None else None
            if any(v is None for v in views) or whole is None:
                log.info("experts %s stay on the host; using per-op CUDA matmuls", lins[0].name)
                return None
            M[key] = views
            M[key + ".all"] = whole
            M[key + ".off"] = cuda.to_device(np.array([lin.parent[1] for lin in lins], np.int32))
            # biased experts (gpt-oss): one bias per row of the stacked matrix (decode), each expert's own (prefill)
            M[key + ".biases"] = [self._vector(lin.bias) if lin.bias is not None else None for lin in lins]
            M[key + ".bias"] = None
            if any(lin.bias is not None for lin in lins):
                full = np.zeros(whole.rows, np.float32)
                for lin in lins:
                    if lin.bias is not None:
                        full[lin.parent[1]:lin.parent[1] + lin.out_features] = lin.bias
                M[key + ".bias"] = self._vector(full)
        sg = m.shared_gate
        M["shared_gate"] = None
        if sg is not None:  # (1, d), a 1-D tensor in the file: a float32 device row, dequantized once
            M["shared_gate"] = self.weight(sg) or self.add_weight(
                sg.name, "F32", self.dequantize_rows(sg.w, sg.qtype, sg.in_features).view(np.uint8))
            M["shared_gate.bias"] = self._vector(sg.bias) if sg.bias is not None else None
        return M

    @staticmethod
    def _unsupported(desc: Any) -> str:
        """Which feature of a description the device forward has no kernel for ('' if none)."""
        if desc.output_norm is None or desc.output_norm.kind != "rms" or desc.output_norm.weight is None:
            return "an output norm other than RMSNorm"
        if desc.pos_embd is not None or desc.type_embd is not None or desc.embd_norm is not None:
            return "position / token-type embeddings or an embedding norm"
        if any(isinstance(b.attn, ParallelMixer) for b in desc.blocks):
            return "attention and a Mamba-2 mixer side by side"
        attns = [b.attn for b in desc.blocks if isinstance(b.attn, Attention)]
        if desc.per_layer_inputs is not None or len({a.kv_shape for a in attns}) > 1:
            return "per-layer inputs or layers with different KV shapes"
        for i, b in enumerate(desc.blocks):
            a, m = b.attn, b.mlp
            if isinstance(a, GatedDeltaNet) and (a.n_v_heads % a.n_k_heads or a.norm.kind != "rms"
                                                 or a.norm.weight is None):
                return f"layer {i}: {a.n_v_heads} value heads over {a.n_k_heads} key heads or a norm other than RMS"
            if isinstance(a, Mamba2) and (a.n_head % a.n_group or a.norm is not None and a.norm.weight is None):
                return f"layer {i}: {a.n_head} Mamba-2 heads in {a.n_group} groups or a norm without gains"
            if not isinstance(a, (Attention, ShortConv, GatedDeltaNet, Mamba2)):
                return f"layer {i}: a {type(a).__name__} mixer"
            if isinstance(m, ParallelMoE):
                return f"layer {i}: a mixture-of-experts feed-forward beside a dense MLP"
            if isinstance(m, MoE):
                why = CudaBackend._moe_unsupported(m)
                if why:
                    return f"layer {i}: a mixture-of-experts feed-forward {why}"
                m = m.shared
            norms = [b.attn_norm, b.post_attn_norm, b.ffn_norm, b.post_ffn_norm, getattr(a, "q_norm", None),
                     getattr(a, "k_norm", None)]
            if b.parallel:
                return f"layer {i}: parallel blocks"
            down = m.down if m is not None else None  # m: the dense MLP or a MoE's shared expert here
            wo = a.wo if isinstance(a, Attention) else a.out_proj
            if b.residual_scale != 1.0 and (b.post_attn_norm is not None or b.post_ffn_norm is not None
                                            or wo.bias is not None or (down is not None and down.bias is not None)):
                return f"layer {i}: residual scaling of post-normed or biased sublayers"
            if any(n is not None and (n.kind != "rms" or n.weight is None or n.bias is not None) for n in norms):
                return f"layer {i}: norms other than RMSNorm with gains"
            if len({float(n.eps) for n in norms if n is not None}) > 1:
                return f"layer {i}: norms with different eps"
            if m is not None and m.act not in (_ACTS if m.gate is not None else _UNGATED_ACTS):
                return f"layer {i}: an MLP with activation {m.act!r}"
            if b.per_layer is not None or b.out_scale != 1.0 or b.norm_residual:
                return f"layer {i}: per-layer inputs, an output scale or norms of the residual sum"
            if not isinstance(a, Attention):
                continue
            if a.kv_source is not None or a.v_norm is not None:
                return f"layer {i}: KV shared with another layer or a value norm"
            if not a.causal:
                return f"layer {i}: non-causal attention"
            if a.n_head != attns[0].n_head:
                return f"layer {i}: the head count differs between layers"
            if (a.q_norm is None) != (a.k_norm is None):
                return f"layer {i}: a q norm without k norm"
        return ""

    @staticmethod
    def _moe_unsupported(m: MoE) -> str:
        """What the device's experts cannot run of a MoE ('' if nothing)."""
        r = m.router
        if m.act not in (_EXPERT_ACTS if m.gate is not None else _UNGATED_ACTS):
            return f"with activation {m.act!r}"
        if r.gating not in _GATING or r.n_used > MAX_EXPERTS_USED:
            return f"with {r.gating} gating of {r.n_used} experts"
        if m.latent_down is not None:
            return "with latent expert projections"
        if any(lin.parent is None for lin in (m.up[0], m.down[0]) + ((m.gate[0],) if m.gate else ())):
            return "whose experts are not rows of 3-D tensors"
        if m.shared is not None and m.shared.act not in (_ACTS if m.shared.gate is not None else _UNGATED_ACTS):
            return f"with a shared expert of activation {m.shared.act!r}"
        if m.shared_gate is not None and m.shared_gate.out_features != 1:
            return "with a shared-expert gate of more than one row"
        return ""

    def _buffers(self, p: _Plan, T: int) -> _Buffers:
        key = "decode" if T == 1 else "batch"
        b = self._bufs.get(key)
        if b is not None and b.tcap >= T:
            return b
        if b is not None:
            self._bytes["scratch"] -= b.nbytes
            self._bufs.pop(key)
        tcap = 1 if T == 1 else max(16, 1 << (T - 1).bit_length())
        before = self._bytes["scratch"]
        rchunk = max(1, min(tcap, LOGITS_BYTES // (4 * p.V)))
        al = self._alloc
        ip_dev = al(3 * tcap, np.int32)
        gu = al((tcap, 2 * p.F), np.float32)
        pinned = self._host_buffer
        b = _Buffers(
            tcap=tcap, x=al((tcap, p.d), np.float32), h=al((tcap, p.d), np.float32),
            a=al((tcap, p.d), np.float32) if p.post_norms else None,
            qkv=al((tcap, max(1, p.qkvw)), np.float32), attn=al((tcap, max(1, p.H * p.Dv)), np.float32),
            gu=gu, ff=gu[:, :p.F],
            ip_dev=ip_dev, ip_host=pinned(3 * tcap, np.int32),
            ids=ip_dev[0:tcap], pos=ip_dev[tcap:2 * tcap], lrows=ip_dev[2 * tcap:3 * tcap],
            rchunk=rchunk)
        if p.moe[0]:
            E, k, Fe = p.moe
            P = tcap * k
            eg = al((P, 2 * Fe), np.float32)
            b.moe = _MoEBuffers(rl=al((tcap, E), np.float32), ids=al(P, np.int32), w=al(P, np.float32), eg=eg,
                                ea=eg[:, :Fe], ey=al((P, p.d), np.float32), xg=al((tcap, p.d), np.float32),
                                yg=al((tcap, p.d), np.float32), sh=al((tcap, p.d), np.float32),
                                sg=al((tcap, 1), np.float32), order=al(P, np.int32),
                                ids_host=pinned(P, np.int32), order_host=pinned(P, np.int32))
        if p.mix[0]:
            pw, cw, ow, gw = p.mix
            convs = [sh[0] for sh in p.states if sh is not None] or [(1, 1)]
            b.mix = _MixBuffers(proj=al((tcap, pw), np.float32), conv=al((tcap, max(1, cw)), np.float32),
                                out=al((tcap, ow), np.float32), gates=al((tcap, max(1, gw)), np.float32),
                                snap=al(tuple(max(x) for x in zip(*convs)), np.float32))
        if p.out_gate:
            b.qg, b.og = al((tcap, p.H * (p.Dk + p.Dv)), np.float32), al((tcap, p.H * p.Dv), np.float32)
        b.nbytes = self._bytes["scratch"] - before
        self._bufs[key] = b
        return b

    def _host_buffer(self, shape: Any, dtype: Any) -> np.ndarray:
        """Page-locked host memory (asynchronous copies); plain numpy under the simulator."""
        return np.zeros(shape, dtype) if self.sim else cuda.pinned_array(shape, dtype)

    def _ensure_logits(self, p: _Plan, b: _Buffers, rows: int) -> None:
        """Output-projection buffers for ``rows`` rows (allocated on demand: decode needs one)."""
        if b.logits is not None and b.logits.shape[0] >= rows:
            return
        if b.logits is not None:
            self._bytes["scratch"] -= b.logits.nbytes + b.hrows.nbytes
            b.nbytes -= b.logits.nbytes + b.hrows.nbytes
        before = self._bytes["scratch"]
        b.hrows = self._alloc((rows, p.d), np.float32)
        b.logits = self._alloc((rows, p.V), np.float32)
        b.logits_host = self._host_buffer((rows, p.V), np.float32)
        b.nbytes += self._bytes["scratch"] - before

    # KV caches on the device ------------------------------------------------------------------------
    def _mirror(self, p: _Plan, cache: Any, need: int, busy: set) -> _Mirror:
        """The device copy of ``cache``, current for positions 0..n_past-1 and with room for ``need``; its
        recurrent state (hybrid models) current too."""
        m = self._mirrors.get(cache)
        p0 = cache.n_past
        if p.has_state and cache._state_pos != p0:  # as KVCache.state says it on the host path
            raise ValueError(f"the recurrent state is not at position {p0} (a step failed); the cache must be cleared")
        if m is not None and m.cap < need:  # grow: a larger copy, filled on the device
            old = m
            m = self._new_mirror(p, cache, min(cache.n_ctx, max(need, 2 * old.cap)), busy, old.state)
            n = old.n_valid
            for src, dst in ((old.k, m.k), (old.v, m.v)):
                for a, b in zip(src, dst):
                    if a is None or b is None:
                        continue
                    for h in range(a.shape[0]):
                        b[h, :n].copy_to_device(a[h, :n], **({} if self.sim else {"stream": self.stream}))
            m.tokens[:n], m.shadow[:n] = old.tokens[:n], old.shadow[:n]
            m.n_valid, m.epoch = n, old.epoch
        elif m is None:
            if cache.device_rows is not None or cache.device_state:  # pragma: no cover - eviction copies back first
                raise BackendError("a KV cache lost the rows only the device held")
            m = self._new_mirror(p, cache, min(cache.n_ctx, need if self.sim else max(need, MIN_KV_CAP)), busy)
        current = self._mirror_current(m, cache, p0)
        if not current:
            self._upload_cache(p, m, cache, p0)
        # the host changed the state (a prefix copy, state load, truncation) or the conversation starts over
        if p.has_state and (not current or p0 == 0 or m.epoch != cache.host_epoch):
            self._upload_state(m, cache)
        m.epoch = cache.host_epoch
        self._clock += 1
        m.last_used = self._clock
        return m

    def _new_mirror(self, p: _Plan, cache: Any, cap: int, busy: set, state: list | None = None) -> _Mirror:
        """A device copy of ``cache`` with room for ``cap`` positions (``state``: the recurrent state arrays of
        the copy it replaces, which do not depend on the capacity)."""
        self._evict(p, cap, busy)
        al = self._alloc
        k = [None if s is None else al((s[0], cap, s[1]), np.float16, "kv") for s in p.kv_shapes]
        v = [None if s is None or not s[2] else al((s[0], cap, s[2]), np.float16, "kv") for s in p.kv_shapes]
        if state is None:
            state = [None if sh is None else tuple(al(x, np.float32, "kv") for x in sh) for sh in p.states]
        sh = p.kv_shapes[p.shadow_layer] if p.shadow_layer >= 0 else (0, 0, 0)
        m = _Mirror(cap=cap, k=k, v=v, state=state, tokens=np.zeros(cap, np.int32),
                    shadow=np.zeros((cap, sh[0] * sh[1]), np.float32), shadow_layer=p.shadow_layer)
        m.nbytes = sum(a.nbytes for a in k + v + [x for st in state for x in st or ()] if a is not None)
        self._mirrors[cache] = m
        return m

    @staticmethod
    def _mirror_current(m: _Mirror, cache: Any, p0: int) -> bool:
        if p0 == 0:
            return True
        if m.n_valid < p0 or not np.array_equal(m.tokens[:p0], cache.tokens[:p0]):
            return False
        if m.epoch == cache.host_epoch or m.shadow_layer < 0:  # the host has not touched the rows since
            return True
        # it has (and holds every row now): a context shift, prefix copy or state load rewrites the newest
        # row, compare the first layer's with rows (the raw array: KVCache.k would count another access)
        k = _host_kv(cache, m.shadow_layer)[0]
        return bool(np.array_equal(k[:, p0 - 1, :].reshape(-1), m.shadow[p0 - 1]))

    def _upload_cache(self, p: _Plan, m: _Mirror, cache: Any, p0: int) -> None:
        log.debug("uploading %d cached positions to the device", p0)
        if cache.device_rows is not None:  # pragma: no cover - only a current mirror has rows the host lacks
            raise BackendError("a KV cache's device rows would be overwritten by stale host rows")
        if p0:
            for i in range(p.n_layer):
                for dev, host in zip((m.k[i], m.v[i]), _host_kv(cache, i)):
                    if dev is None:
                        continue
                    a16 = host[:, :p0, :].astype(np.float16)
                    for h in range(dev.shape[0]):
                        dev[h, :p0].copy_to_device(np.ascontiguousarray(a16[h]))
            self._shadow_from_host(m, cache, 0, p0)
            m.tokens[:p0] = cache.tokens[:p0]
        m.n_valid = p0
        m.graph = None

    def _upload_state(self, m: _Mirror, cache: Any) -> None:
        """The host's recurrent state (current: every host access brought the device's back first) to the device."""
        for dev, host in zip(m.state, cache._state):
            for a, b in zip(dev or (), host or ()):
                self._h2d(a, b)

    def _flush(self, cache: Any) -> None:
        """``KVCache.device_sync``: copy the rows only the device holds (``cache.device_rows``) into the
        host arrays, float16-rounded as the device stores them, and the recurrent state the device holds
        (``cache.device_state``). Called before any host access to them."""
        with self._lock:
            rows, cache.device_rows = cache.device_rows, None
            state, cache.device_state = cache.device_state, False
            m = self._mirrors.get(cache)
            if rows is None and not state:
                return
            if m is None:  # pragma: no cover - eviction and close copy rows back before dropping a copy
                raise BackendError("a KV cache lost the rows only the device held")
            self._sync()
            if state:
                for dev, host in zip(m.state, cache._state):
                    for a, b in zip(dev or (), host or ()):
                        b[...] = a.copy_to_host()
            if rows is None:
                return
            lo, hi = rows[0], min(rows[1], cache.n_past, m.n_valid)
            if hi <= lo:
                return
            log.debug("copying %d device-only positions back to the host cache", hi - lo)
            for i, (kd, vd) in enumerate(zip(m.k, m.v)):
                for dev, host in zip((kd, vd), _host_kv(cache, i)):
                    if dev is None:
                        continue
                    for h in range(dev.shape[0]):
                        host[h, lo:hi] = dev[h, lo:hi].copy_to_host()
            self._shadow_from_host(m, cache, lo, hi)

    @staticmethod
    def _shadow_from_host(m: _Mirror, cache: Any, lo: int, hi: int) -> None:
        """What the device saw of positions lo..hi-1: the first layer with rows, its keys as the host holds
        them (the raw array: KVCache.k would count another host access), the rows _mirror_current compares."""
        if m.shadow_layer >= 0:
            k = _host_kv(cache, m.shadow_layer)[0]
            m.shadow[lo:hi] = k[:, lo:hi, :].transpose(1, 0, 2).reshape(hi - lo, -1)

    def _drop_mirror(self, cache: Any) -> None:
        self._flush(cache)  # rows only the device holds go to the host first
        self._mirrors.pop(cache, None)

    def _evict(self, p: _Plan, cap: int, busy: set) -> None:
        need = 2 * cap * sum(s[0] * (s[1] + s[2]) for s in p.kv_shapes if s is not None)
        need += 4 * sum(int(np.prod(x)) for sh in p.states if sh is not None for x in sh)
        live = [(m.last_used, id(c), c) for c, m in self._mirrors.items() if id(c) not in busy]
        live.sort()
        total = sum(m.nbytes for m in self._mirrors.values())
        for _, _, c in live:
            if total + need <= self.kv_vram_bytes:
                break
            total -= self._mirrors[c].nbytes
            self._drop_mirror(c)
    # the forward pass ----------------------------------------------------------------------------
    def forward(self, model: Any, tokens: np.ndarray, segments: Sequence[Any]) -> list[np.ndarray | None] | None:
        """``Transformer.forward`` on the device; None when this model needs the host path.

        Same contract: ``tokens`` (T,) are the concatenated new tokens of each segment, every
        segment's cache grows by its count, and the result holds per segment (n_vocab,) for
        "last", (n_tokens, n_vocab) for "all", None for "none".
        """
        if getattr(model, "lora", None) is not None:
            return None  # LoRA adapters are applied next to each host-path matmul (minirt.lora)
        with self._lock:
            self._check_open()
            p = self._plan(model)
            if p is None:
                return None
            tokens = np.asarray(tokens).reshape(-1)
            T = int(tokens.shape[0])
            spans = batch_spans(segments)
            n = sum(seg.n_tokens for seg in segments)
            if n != T:
                raise ValueError(f"segments hold {n} tokens but {T} were given")
            if T == 0:
                return [None if seg.logits == "none" else np.zeros((0, p.V), np.float32) for seg in segments]
            if tokens.min() < 0 or tokens.max() >= p.V:
                from ...errors import InvalidRequestError

                raise InvalidRequestError(f"token id out of range [0, {p.V})")
            b = self._buffers(p, T)
            busy = {id(seg.cache) for seg in segments}
            mirrors = [self._mirror(p, seg.cache, p0 + seg.n_tokens, busy) for seg, _, p0 in spans]
            rows = logit_rows(spans)
            tc = b.tcap
            ip = b.ip_host
            ip[:T] = tokens
            for seg, s0, p0 in spans:
                ip[tc + s0:tc + s0 + seg.n_tokens] = np.arange(p0, p0 + seg.n_tokens, dtype=np.int32)
            R = len(rows)
            first = rows[:b.rchunk]
            ip[2 * tc:2 * tc + len(first)] = first
            self._ensure_logits(p, b, len(first))
            self._h2d(b.ip_dev, ip)
            graphable = (self.use_graphs and T == 1 and len(spans) == 1 and R == 1)
            try:
                if graphable:
                    m = mirrors[0]
                    m.decode_steps += 1
                    if m.graph is None and m.decode_steps >= 2:
                        m.graph = self._capture(p, b, spans, mirrors, len(first))
                    if m.graph is not None:
                        m.graph.launch(stream=self.cp_stream)
                    else:
                        self._run(p, b, T, spans, mirrors, len(first))
                else:
                    self._run(p, b, T, spans, mirrors, len(first))
                results_rows = self._collect_logits(p, b, rows, T)
                self._sync()
            except BaseException:
                for seg in segments:  # a recurrent state may be half-updated: only its snapshot stays usable
                    seg.cache.step_failed()
                raise
            self._advance(spans, mirrors)
            return split_logits(spans, results_rows)

    def _h2d(self, dev: Any, host: np.ndarray) -> None:
        if self.sim:
            dev.copy_to_device(host)
        else:
            dev.copy_to_device(host, stream=self.stream)

    def _d2h(self, dev: Any, host: np.ndarray) -> None:
        if self.sim:
            host[...] = dev.copy_to_host()
        else:
            dev.copy_to_host(host, stream=self.stream)

    def _capture(self, p: _Plan, b: _Buffers, spans: list, mirrors: list, nrows: int) -> Any:
        """Record one decode step (T=1, one sequence) into a CUDA graph; None if capture fails."""
        s = self.cp_stream
        graph = None
        try:
            with cuda.defer_cleanup():
                s.begin_capture()
                try:
                    self._run(p, b, 1, spans, mirrors, nrows)
                finally:
                    graph = s.end_capture()
        except Exception as e:
            log.warning("CUDA graph capture failed (%s); decode continues without graphs", e)
            self.use_graphs = False
            return None
        return graph

    def _run(self, p: _Plan, b: _Buffers, T: int, spans: list, mirrors: list, nrows: int) -> None:
        """Every kernel of one forward up to the first chunk of logits (graph-capturable for one token)."""
        K = self.k
        ar = self._arange_dev(max(b.tcap, 1))
        self._launch(K.dequant_rows(p.tok_embd.qtype), self._ew_grid(T * p.d // 8), self.lc.threads,
                     *p.tok_embd.args, b.ids, b.x, T, p.d, p.embed_scale)
        for i, L in enumerate(p.layers):
            eps = L["eps"]
            h = self._pre_norm(p, b, L["attn_norm"], T, eps, ar)
            if L["kind"] == "attn":
                src = self._attend(p, i, L, b, T, h, spans, mirrors, ar)
            else:
                src = self._mixer(i, L, b, T, h, spans, mirrors, ar)
            self._residual(p, b, L, "wo", src, T, L["post_attn_norm"], ar)  # x += [norm](Wo·attn)
            if "moe" in L:
                self._moe(p, L, b, T, ar, self._pre_norm(p, b, L["ffn_norm"], T, eps, ar))
            elif "F" in L:  # a block without a feed-forward half (Nemotron-H, Mamba-2) has no "F"
                self._mlp(p, L, b, T, self._pre_norm(p, b, L["ffn_norm"], T, eps, ar))
                self._residual(p, b, L, "down", b.ff, T, L["post_ffn_norm"], ar)
        if nrows:
            self._logits_chunk(p, b, nrows)

    def _attend(self, p: _Plan, i: int, L: dict, b: _Buffers, T: int, h: Any, spans: list, mirrors: list,
                ar: Any) -> Any:
        """Layer i's attention of the normed input h: projections, q/k norms, RoPE, cache append, attention
        (per segment) into b.attn, which it returns; Qwen3.5's output gate applied there."""
        lc, K, NT, eps = self.lc, self.k, self.lc.threads, L["eps"]
        qcol, kcol, vcol = 0, p.H * p.Dk, p.H * p.Dk + p.Hkv * p.Dk
        if L["out_gate"]:  # wq gives each head its query then its gate: queries into qkv, gates into og
            self._mm(L["wq"], h, T, b.qg, 0, L["wq.bias"])
            self._launch(K.split_gate, self._ew_grid(T * p.H * (p.Dk + p.Dv)), NT, b.qg, T, p.H, p.Dk, p.Dv, b.qkv,
                         b.og)
        else:
            self._mm(L["wq"], h, T, b.qkv, qcol, L["wq.bias"])
        self._mm(L["wk"], h, T, b.qkv, kcol, L["wk.bias"])
        self._mm(L["wv"], h, T, b.qkv, vcol, L["wv.bias"])
        for step in (("rope", "qk") if L["qk_after_rope"] else ("qk", "rope")):
            if step == "qk" and L["q_norm"] is not None:
                hq, hk, dh = L["qk_heads"]
                self._norm(b.qkv, ar, L["q_norm"], b.qkv, T, qcol, hq, dh or p.H * p.Dk, eps, 0)
                self._norm(b.qkv, ar, L["k_norm"], b.qkv, T, kcol, hk, dh or p.Hkv * p.Dk, eps, 0)
            if step == "rope" and L["inv"] is not None:
                self._launch(K.rope, self._ew_grid(T * (p.H + p.Hkv) * (L["rope_dim"] // 2)), NT, b.qkv, b.pos,
                             0, T, 0, p.H + p.Hkv, p.Dk, L["inv"], L["rope_dim"], L["neox"], L["msc"])
        for (seg, s0, _), m in zip(spans, mirrors):
            n = seg.n_tokens
            self._launch(K.kv_store, self._ew_grid(n * p.Hkv * max(p.Dk, p.Dv)), NT, b.qkv, b.pos, s0, n,
                         kcol, vcol, p.Hkv, p.Dk, p.Dv, m.k[i], m.v[i])
            self._launch(K.attention, lc.grid(n * p.H), NT, b.qkv, m.k[i], m.v[i], b.attn, b.pos, s0, n,
                         p.H, p.Hkv, p.Dk, p.Dv, L["scale"], L["window"], L["softcap"],
                         L["sinks"] if L["sinks"] is not None else self._dummy_bias, int(L["sinks"] is not None))
        if L["out_gate"]:
            self._launch(K.sigmoid_mul, self._ew_grid(T * p.H * p.Dv), NT, b.attn, b.og, T, p.H * p.Dv)
        return b.attn

    def _mixer(self, i: int, L: dict, b: _Buffers, T: int, h: Any, spans: list, mirrors: list, ar: Any) -> Any:
        """Layer i's short convolution (LFM2), gated delta-net (Qwen3.5) or Mamba-2 mixer of the normed input h,
        as minirt.forward's short_conv / delta_net / mamba2 compute it; returns the out_proj input (b.mix.out).

        Buffer columns (B = b.mix): short conv: proj = B | C | x (3 d). Delta-net: proj = z (F = Hv·Dv) | o (F) |
        qkv (conv_dim) | beta, alpha; conv = the convolution's output, q and k L2-normalised in place; the scan
        writes o, normed per head in place, and out = silu(z)·o. Mamba-2: proj = z (d_inner) | xBC (conv_dim) |
        dt (H); conv = silu(conv(xBC)) = x | B | C; the scan writes y over xBC's first d_inner columns (read
        by then), out = silu(z)·y, group-normed in place. Each segment continues from its own cache rows or
        recurrent state and leaves them after its last token; a prefill segment's state after its
        next-to-last token goes to the host as the cache's snapshot (KVCache.snapshot), as on the host path."""
        B, K, NT, lc = b.mix, self.k, self.lc.threads, self.lc
        ew = self._ew_grid
        kind, taps, w = L["kind"], L["taps"], L["conv"]
        self._mm(L["in"], h, T, B.proj, 0 if kind != "delta" else 2 * L["Hv"] * L["Dv"], L["in.bias"])
        if kind == "short":
            d, Dh = L["d"], L["Dh"]
            for (seg, s0, _), m in zip(spans, mirrors):
                n = seg.n_tokens
                self._launch(K.short_conv, ew(n * d), NT, B.proj, m.k[i], B.out, b.pos, s0, n, d, Dh, w, taps)
                self._launch(K.short_conv_store, ew(n * d), NT, B.proj, m.k[i], b.pos, s0, n, d, Dh)
            return B.out
        cd = L["cd"]
        if kind == "delta":
            Hk, Hv, Dk, Dv = L["Hk"], L["Hv"], L["Dk"], L["Dv"]
            F = Hv * Dv
            scol, gcol = 2 * F, 2 * F + cd
            self._mm(L["z"], h, T, B.proj, 0, L["z.bias"])
            if "ba" in L:  # per key head: its value heads' beta rows, then their alpha rows
                rep = Hv // Hk
                self._mm(L["ba"], h, T, B.proj, gcol, L["ba.bias"])
                gates = (gcol, gcol + rep, rep, 2 * rep)
            else:
                self._mm(L["beta"], h, T, B.proj, gcol, L["beta.bias"])
                self._mm(L["alpha"], h, T, B.proj, gcol + Hv, L["alpha.bias"])
                gates = (gcol, gcol + Hv, Hv, 0)
            self._launch(K.dn_gates, ew(T * Hv), NT, B.proj, *gates, T, Hv, L["dt_bias"], L["a"], B.gates)
            bias, has_bias = self._dummy_bias, 0
        else:
            di, H, P, N, G = L["di"], L["H"], L["P"], L["N"], L["G"]
            scol = di
            bias, has_bias = (L["conv_b"], 1) if L["conv_b"] is not None else (self._dummy_bias, 0)
        for (seg, s0, _), m in zip(spans, mirrors):
            self._launch(K.rconv, ew(seg.n_tokens * cd), NT, B.proj, scol, m.state[i][0], B.conv, s0, seg.n_tokens,
                         cd, w, taps, bias, has_bias)
        if kind == "delta":
            self._launch(K.l2norm, lc.grid(T * 2 * Hk), NT, B.conv, T, 0, 2 * Hk, Dk, L["norm_eps"])

            def scan(S: Any, r0: int, n: int) -> None:
                self._launch(K.delta_scan, ew(Hv * Dv), NT, B.conv, B.gates, B.proj, F, S, r0, n, Hk, Hv, Dk, Dv,
                             L["grouped"], L["qscale"])
        else:
            def scan(S: Any, r0: int, n: int) -> None:
                self._launch(K.ssm_scan, ew(H * P), NT, B.conv, B.proj, di + cd, L["dt_bias"], L["a"], L["dskip"],
                             B.proj, di, S, r0, n, H, P, N, G)
        for (seg, s0, p0), m in zip(spans, mirrors):
            n = seg.n_tokens
            conv_state, S = m.state[i]
            # the convolution inputs after this segment's tokens (read before a Mamba-2 scan overwrites them)
            if n > 1:  # and after n - 1 of them, for the snapshot
                self._launch(K.rconv_state, ew(cd), NT, B.proj, scol, conv_state, B.snap, s0, n - 1, cd, taps)
            self._launch(K.rconv_state, ew(cd), NT, B.proj, scol, conv_state, conv_state, s0, n, cd, taps)
            if n == 1:
                scan(S, s0, 1)
                continue
            scan(S, s0, n - 1)
            conv_snap = np.empty(B.snap.shape, np.float32)
            s_snap = np.empty(S.shape, np.float32)
            self._d2h(B.snap, conv_snap)
            self._d2h(S, s_snap)
            self._sync()
            seg.cache.snapshot(i, p0 + n - 1, conv_snap[:taps - 1, :cd], s_snap)
            scan(S, s0 + n - 1, 1)
        if kind == "delta":
            self._norm(B.proj, ar, L["norm"], B.proj, T, F, Hv, Dv, L["norm_eps"], 0)
            self._launch(K.act_mul, ew(T * F), NT, B.proj, B.out, T, F, 0, _NO_PARAM, _NO_PARAM)
        else:
            self._launch(K.act_mul, ew(T * di), NT, B.proj, B.out, T, di, 0, _NO_PARAM, _NO_PARAM)
            if L["norm"] is not None:
                self._norm(B.out, ar, L["norm"], B.out, T, 0, G, di // G, L["norm_eps"], 0, di // G)
        return B.out

    def _residual(self, p: _Plan, b: _Buffers, L: dict, key: str, src: Any, T: int, post: Any, ar: Any) -> None:
        """x += W·src, or x += norm(W·src) when the block has a post-norm there; src is first scaled by
        the layer's residual multiplier (Granite: x += s·W·src, with no post-norm or bias there)."""
        self._scale(src, T, L[key].cols, L["res_scale"])
        if post is None:
            self._mm(L[key], src, T, b.x, 0, L[key + ".bias"], acc=True)
            return
        self._mm(L[key], src, T, b.a, 0, L[key + ".bias"])
        self._norm(b.a, ar, post, b.x, T, 0, 1, p.d, L["eps"], 1)

    def _norm(self, x: Any, rows: Any, w: Any, out: Any, n: int, col: int, nheads: int, D: int,
              eps: np.float32, add: int, wh: int = 0) -> None:
        """RMSNorm of nheads heads of D columns from col (see the kernel); wh: D where each head has its own gains."""
        self._launch(self.k.rmsnorm, self.lc.grid(n * nheads), self.lc.threads, x, rows, w, out, n, col, nheads,
                     D, eps, add, wh)

    def _pre_norm(self, p: _Plan, b: _Buffers, w: Any, T: int, eps: np.float32, ar: Any) -> Any:
        """The sublayer's input: norm(x) in b.h, or x itself for a block without that pre-norm (OLMo 2)."""
        if w is None:
            return b.x
        self._norm(b.x, ar, w, b.h, T, 0, 1, p.d, eps, 0)
        return b.h

    def _mlp(self, p: _Plan, L: dict, b: _Buffers, T: int, h: Any) -> None:
        """ff[:, :F] = act(Wgate·h) * (Wup·h), or act(Wup·h) without a gate; F the layer's width."""
        lc, F = self.lc, L["F"]
        if not L["gated"]:
            self._mm(L["up"], h, T, b.gu, 0, L["up.bias"])
            self._launch(self.k.act, self._ew_grid(T * F), lc.threads, b.ff, T, F, L["act"])
            return
        if L["glu"] and T <= lc.mv_max_tokens and L["gate.bias"] is None and L["up.bias"] is None:
            g, u = L["gate"], L["up"]
            rpb = lc.mv_threads // lc.tpr(p.d)
            grid = (lc.grid((F + rpb - 1) // rpb), lc.grid_y(T))
            self._launch(self.k.matvec_glu(g.qtype, p.d), grid, lc.mv_threads, *g.args, *u.args, h, T, b.ff, L["act"],
                         F, p.d)
            return
        self._mm(L["gate"], h, T, b.gu, 0, L["gate.bias"])
        self._mm(L["up"], h, T, b.gu, F, L["up.bias"])
        self._launch(self.k.act_mul, self._ew_grid(T * F), lc.threads, b.gu, b.ff, T, F, L["act"], _NO_PARAM, _NO_PARAM)

    def _moe(self, p: _Plan, L: dict, b: _Buffers, T: int, ar: Any, h: Any) -> None:
        """x += [post-norm](sum over the chosen experts of w · expert(h) + [gate ·] shared(h)).

        The router and the choice run on the device. Up to mv_max_tokens tokens (decode, captured in
        the graph) every (token, slot) pair's matvecs read its expert's rows through the id table;
        more tokens (prefill) are grouped by expert on the host from the chosen ids, and each chosen
        expert runs once over all its tokens (gathered, then its outputs scattered back to the pairs)."""
        M, B, lc, K = L["moe"], b.moe, self.lc, self.k
        E, k, Fe, act, d = M["E"], M["k"], M["Fe"], M["act"], p.d
        P = T * k
        self._mm(M["router"], h, T, B.rl, 0, M["router.bias"])
        selb = M["selb"]
        self._launch(K.route, self._ew_grid(T), lc.threads, B.rl, T, E, k, M["gating"],
                     selb if selb is not None else self._dummy_bias, int(selb is not None), M["norm"],
                     M["scale"] * L["res_scale"], B.ids, B.w)
        if T <= lc.mv_max_tokens:
            if M["gated"]:
                self._mm_id(M["gate.all"], M["gate.off"], B.ids, h, k, P, B.eg, 0, Fe, M["gate.bias"])
                self._mm_id(M["up.all"], M["up.off"], B.ids, h, k, P, B.eg, Fe, Fe, M["up.bias"])
                self._launch(K.act_mul, self._ew_grid(P * Fe), lc.threads, B.eg, B.ea, P, Fe, act, *M["act_params"])
            else:
                self._mm_id(M["up.all"], M["up.off"], B.ids, h, k, P, B.eg, 0, Fe, M["up.bias"])
                self._launch(K.act, self._ew_grid(P * Fe), lc.threads, B.ea, P, Fe, act)
            self._mm_id(M["down.all"], M["down.off"], B.ids, B.ea, 1, P, B.ey, 0, d, M["down.bias"])
        else:
            self._d2h(B.ids[:P], B.ids_host[:P])
            self._sync()
            ids = B.ids_host[:P]
            B.order_host[:P] = np.argsort(ids, kind="stable")
            self._h2d(B.order[:P], B.order_host[:P])
            counts = np.bincount(ids, minlength=E)
            start = 0
            for e in np.flatnonzero(counts):
                n = int(counts[e])
                self._launch(K.pairs_gather, self._ew_grid(n * d), lc.threads, h, B.order, start, n, k, B.xg, d)
                if M["gated"]:
                    self._mm(M["gate"][e], B.xg, n, B.eg, 0, M["gate.biases"][e])
                    self._mm(M["up"][e], B.xg, n, B.eg, Fe, M["up.biases"][e])
                    self._launch(K.act_mul, self._ew_grid(n * Fe), lc.threads, B.eg, B.ea, n, Fe, act,
                                 *M["act_params"])
                else:
                    self._mm(M["up"][e], B.xg, n, B.eg, 0, M["up.biases"][e])
                    self._launch(K.act, self._ew_grid(n * Fe), lc.threads, B.ea, n, Fe, act)
                self._mm(M["down"][e], B.ea, n, B.yg, 0, M["down.biases"][e])
                self._launch(K.pairs_scatter, self._ew_grid(n * d), lc.threads, B.yg, B.order, start, n, B.ey, d)
                start += n
        has_sh, sg = "F" in L, M["shared_gate"]  # "F": the width of a shared expert
        if has_sh:
            self._mlp(p, L, b, T, h)
            self._scale(b.ff, T, L["F"], L["res_scale"])
            self._mm(L["down"], b.ff, T, B.sh, 0, L["down.bias"])
            if sg is not None:
                self._mm(sg, h, T, B.sg, 0, M["shared_gate.bias"])
        post = L["post_ffn_norm"]
        out = b.x if post is None else b.a
        self._launch(K.moe_combine, self._ew_grid(T * d), lc.threads, out, int(post is None), B.ey, B.w, T, k, d,
                     B.sh, int(has_sh), B.sg, int(has_sh and sg is not None))
        if post is not None:
            self._norm(b.a, ar, post, b.x, T, 0, 1, d, L["eps"], 1)

    def _scale(self, y: Any, T: int, N: int, s: np.float32) -> None:
        """y[:T, :N] *= s (nothing for 1)."""
        if s != 1.0:
            self._launch(self.k.scale_rows, self._ew_grid(T * N), self.lc.threads, y, T, N, s)

    def _mm_id(self, dw: DeviceWeight, off: Any, ids: Any, x: Any, xdiv: int, P: int, y: Any, ycol: int,
               N: int, bias: Any = None) -> None:
        """``y[j, ycol:ycol+N] = x[j // xdiv] @ W_e.T (+ b_e)`` for pairs j < P, e = ids[j], W_e the N rows of
        ``dw`` from off[e] (b_e: the same rows of ``bias``, one per row of dw)."""
        lc, K = self.lc, dw.cols
        rpb = lc.mv_threads // lc.tpr(K)
        self._launch(self.k.matvec_id(dw.qtype, K), (lc.grid((N + rpb - 1) // rpb), lc.grid_y(P)), lc.mv_threads,
                     dw.w8, dw.w16, dw.w32, off, ids, x, xdiv, P, y, ycol,
                     bias if bias is not None else self._dummy_bias, int(bias is not None), N, K)

    def _logits_chunk(self, p: _Plan, b: _Buffers, nrows: int) -> None:
        """logits[:nrows] = output(norm(x[lrows[:nrows]])) (soft-capped when the model says so)."""
        self._norm(b.x, b.lrows, p.output_norm, b.hrows, nrows, 0, 1, p.d, p.eps, 0)
        self._mm(p.output, b.hrows, nrows, b.logits, 0)
        if p.final_softcap:
            self._launch(self.k.softcap, self._ew_grid(nrows * p.V), self.lc.threads, b.logits, nrows, p.final_softcap)

    def _collect_logits(self, p: _Plan, b: _Buffers, rows: list, T: int) -> np.ndarray | None:
        """Copy the requested logits rows to the host (first chunk already computed by _run)."""
        R = len(rows)
        if R == 0:
            return None
        out = np.empty((R, p.V), np.float32)
        for a in range(0, R, b.rchunk):
            nb = min(b.rchunk, R - a)
            if a:
                b.ip_host[2 * b.tcap:2 * b.tcap + nb] = rows[a:a + nb]
                self._h2d(b.lrows, b.ip_host[2 * b.tcap:3 * b.tcap])
                self._logits_chunk(p, b, nb)
            self._d2h(b.logits[:nb], b.logits_host[:nb])
            self._sync()
            out[a:a + nb] = b.logits_host[:nb]
        return out

    def _advance(self, spans: list, mirrors: list) -> None:
        """The caches grew by their segments' tokens, on the device only (see the module's docstring)."""
        for (seg, _, p0), m in zip(spans, mirrors):
            cache, p1 = seg.cache, p0 + seg.n_tokens
            m.tokens[p0:p1] = cache.tokens[p0:p1]
            m.n_valid = p1
            cache.n_past = p1
            if cache.has_state:  # the live state is the device's now (KVCache.state brings it back)
                cache.device_state = True
                cache.step_done(seg.n_tokens)
            r = cache.device_rows
            cache.device_rows = (p0 if r is None else min(r[0], p0), p1)
            cache.device_sync = self._flush

    # -- device-side helpers exposed for callers and benchmarks --------------------------------------
    def argmax(self, logits: np.ndarray) -> np.ndarray:
        """Row-wise argmax on the device (greedy sampling): logits (n, V) float32 → (n,) int64."""
        with self._lock:
            self._check_open()
            x = np.ascontiguousarray(np.atleast_2d(logits), dtype=np.float32)
            d = cuda.to_device(x)
            o = cuda.device_array(x.shape[0], np.int32)
            self._launch(self.k.argmax, self.lc.grid(x.shape[0]), self.lc.threads, d, x.shape[0], o)
            r = o.copy_to_host()
            return r.astype(np.int64)

    # -- lifecycle -----------------------------------------------------------------------------------
    def vram_bytes(self) -> dict[str, int]:
        """Bytes this backend holds in VRAM, by kind: weights, scratch (activations), kv (mirrors)."""
        d = dict(self._bytes)
        d["kv"] = sum(m.nbytes for m in list(self._mirrors.values()))
        d["total"] = sum(d.values())
        return d

    def info(self) -> dict[str, Any]:
        """Device name, VRAM use and how the kernels run."""
        d: dict[str, Any] = {"backend": self.name, "kernels": "numba-cuda",
                             "prefill_gemm": "cuBLAS SGEMM over dequantized tiles (CuPy)" if self._cp is not None
                             else "numba tiled quantized GEMM",
                             "decode": "fused dequant-matvec" + (", CUDA graphs" if self.use_graphs else ""),
                             "simulator": self.sim, "tensors_on_host": len(self.skipped)}
        v = self.vram_bytes()
        d.update({f"vram_{k}_bytes": n for k, n in v.items()})
        d["vram_used_bytes"] = v["total"]
        if not self.sim and not self._closed:
            dev = cuda.get_current_device()
            d["name"] = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
            d["compute_capability"] = tuple(dev.compute_capability)
            free, total = cuda.current_context().get_memory_info()
            d["device_memory_used_bytes"] = int(total - free)
            d["device_memory_total_bytes"] = int(total)
        else:
            d["name"] = "numba CUDA simulator" if self.sim else "closed"
        return d

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("the CUDA backend is closed")

    def close(self) -> None:
        """Free every device buffer (weights, activations, KV mirrors, graphs). Idempotent."""
        with self._lock:
            if self._closed:
                return
            for c in list(self._mirrors.keys()):  # the host arrays hold the caches from now on
                try:
                    self._drop_mirror(c)
                except Exception as e:  # pragma: no cover - a failed device: those rows are lost
                    log.warning("could not copy a KV cache back from the device: %s", e)
                c.device_sync = None
            self._closed = True
            self._mirrors = weakref.WeakKeyDictionary()
            self._bufs.clear()
            self._plans = weakref.WeakKeyDictionary()
            self._vectors.clear()
            self.weights.clear()
            self._wtmp = self._arange = None
            self._views.clear()
            self._bytes = {k: 0 for k in self._bytes}
            if not self.sim:
                try:
                    cuda.current_context().deallocations.clear()
                except Exception:  # pragma: no cover - best effort
                    pass
                if self._cp is not None:
                    self._cp.get_default_memory_pool().free_all_blocks()


def _host_kv(cache: Any, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer i's host rows (heads, n_ctx, width) of keys and values, without counting a host access (the
    raw arrays, or a layer's carved views when the layers' shapes differ)."""
    if cache._views is not None:  # None: a layer without rows of its own
        return cache._views[i] or (None, None)
    return cache._k[i], cache._v[i]


def _ptr(a: Any) -> int:
    """Device address of a numba device array (or view)."""
    return int(a.__cuda_array_interface__["data"][0])
