"""Compute backends: the operations of the forward pass (:class:`~minirt.kernels.base.Backend` lists
them), never architectures.

``matmul(x, lin) -> y`` takes float32 ``x (T, in_features)`` and a :class:`minirt.blocks.Linear`
whose weight stays quantized. :func:`select_backend` picks the device (CUDA when usable, else the
CPU) and :func:`get_backend` the CPU backend by name, fastest first:

- ``native``: C kernels (SIMD chosen at run time) through cffi — needs the built extension or a
  C compiler on first use;
- ``numba``: portable JIT kernels, always available;
- ``reference``: dequantize once to float32 and use BLAS (memory-hungry; for checking only).

``MINIRT_BACKEND=native|numba|reference`` forces one; ``auto`` takes native when it loads and
falls back to numba with one logged warning.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BackendError, InvalidRequestError
from .base import Backend

log = logging.getLogger(__name__)

BACKENDS = ("native", "numba", "reference")
_warned = False
_lock = threading.Lock()


class ReferenceBackend(Backend):
    """Dequantize each weight once (cached on the Linear) and multiply with numpy's BLAS."""

    name = "reference"

    def matmul(self, x: np.ndarray, lin: Any) -> np.ndarray:
        w = lin.backend_data
        if w is None:
            from ..quants import dequantize

            w = lin.backend_data = dequantize(lin.w, lin.qtype, (lin.out_features, lin.in_features))
        return x @ w.T


# Types whose native integer decode kernel is the portable (compiler-vectorized) one except on the
# ISAs of SIMD_INT_ISAS: there numba's fused per-block loop reads them ~3.5x faster (bench/kernels.py
# on an AVX-512 machine: Q2_K 1.46 vs 0.40 GB/s, Q3_K 1.6-1.7 vs 0.46-0.54), so on those ISAs a
# few-token matmul of these goes to numba and the native layer stack is not used. AVX2 and AVX-512
# have hand-written kernels for them (Q2_K 7-8 GB/s, Q3_K 7-8 at 1 thread, 4096 x 14336).
NUMBA_DECODE_TYPES = frozenset({"Q2_K", "Q3_K"})
SIMD_INT_ISAS = frozenset({"avx2", "avx512", "avx512_amx"})


class NumbaBackend(Backend):
    """numba kernels over the raw blocks (``minirt.kernels.numba_backend``)."""

    name = "numba"

    def __init__(self, threads: int | None = None) -> None:
        from . import numba_backend

        super().__init__(threads)
        self._mod = numba_backend
        if threads:
            import numba

            numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))

    def matmul(self, x: np.ndarray, lin: Any) -> np.ndarray:
        return self._mod.matmul(x, lin.w, lin.qtype)

    def activation(self, x: np.ndarray, act: str, params: Sequence[float] = ()) -> np.ndarray:
        """The erf GELU compiled (the numpy reference took half of an encoder's time); others as the base."""
        if act == "gelu" and x.dtype == np.float32:
            return self._mod.gelu_erf(x)
        return super().activation(x, act, params)

    def info(self) -> dict[str, Any]:
        import numba

        return {"backend": self.name, "threads": numba.get_num_threads()}


class NativeBackend(Backend):
    """C kernels through cffi (``minirt.kernels.native``)."""

    name = "native"

    def __init__(self, threads: int | None = None) -> None:
        from . import native

        super().__init__(threads)
        native._load()  # raises BackendError with the reason when the kernels cannot be built or loaded
        self._mod = native
        # the types sent to numba for few-token matmuls on this CPU (none where the ISA has SIMD kernels;
        # the ISA is the one selected when the backend is made)
        self.numba_decode_types = frozenset() if native.info()["isa"] in SIMD_INT_ISAS else NUMBA_DECODE_TYPES

    def prepare(self, model: Any) -> None:
        """Repack the model's weight matrices for the decode kernels, once, at load.

        The packed copies (same bytes, reordered into tiles of 4 rows, one huge-page arena) go to
        ``lin.backend_data``; types and shapes the layout does not cover, or that the CPU's ISA has
        no packed kernels for, stay as they are. ``MINIRT_PACK=0`` disables it. Then, when the
        architecture describes its blocks, the decode step is prepared to run natively
        (``MINIRT_NATIVE_LAYERS=0`` disables that).
        """
        mod = self._mod
        if os.environ.get("MINIRT_PACK", "1") == "0":
            self._prepare_layers(model)
            return
        # (linear, address of its ggml bytes, packed size); tied weights (output = embedding) have one
        # address and share one packed copy
        todo = [(lin, mod._address(lin.w), mod.pack_size(lin.qtype, lin.out_features, lin.in_features))
                for lin in model.linears() if lin.backend_data is None and mod.pack_preferred(lin.qtype)]
        todo = [t for t in todo if t[2] > 0]
        if not todo:
            self._prepare_layers(model)
            return
        unique: dict[int, tuple[Any, int]] = {}
        for lin, key, n in todo:
            unique.setdefault(key, (lin, n))
        total = sum(n + 64 for _, n in unique.values())
        path = getattr(getattr(model, "file", None), "path", None)
        cache = (mod.PackCache.for_model(path, [(lin.w, lin.qtype, n) for lin, n in unique.values()], total)
                 if path else None)
        packed: dict[int, Any] = {}
        arena = mod.PackArena(total)
        if cache is not None and cache.read_into(arena):
            # the same sizes taken in the same order give the same offsets as when it was written
            for key, (lin, n) in unique.items():
                packed[key] = mod.PackedMatrix(arena.take(n), lin.qtype, lin.out_features, lin.in_features)
            if all(mod.spot_check_packed(pm, unique[k][0].w) for k, pm in packed.items()):
                for lin, _ in unique.values():  # the GGUF copy is not read: drop its pages
                    mod.release_file_pages(lin.w)
            else:
                log.warning("pack cache %s does not match the model's weights; repacking", cache.path)
                packed.clear()
                arena = mod.PackArena(total)
        if not packed:
            for key, (lin, _) in unique.items():
                # the file pages of the ggml copy are not read any more: released as packing goes,
                # resident memory stays at one copy
                packed[key] = mod.pack(lin.w, lin.qtype, arena=arena, threads=self.threads, stream_file_pages=True)
            if cache is not None:
                cache.store(arena.buffer)
        for lin, key, _ in todo:
            lin.backend_data = packed[key]

        self._prepare_layers(model)

    def _prepare_layers(self, model: Any) -> None:
        """Prepare the native decode step for the model's blocks when every block can run there
        (``MINIRT_NATIVE_LAYERS=0`` disables it); otherwise decode steps run the per-op path."""
        if os.environ.get("MINIRT_NATIVE_LAYERS", "1") == "0":
            return
        desc = model.desc
        slow = {lin.qtype for lin in desc.linears()[1:]} & self.numba_decode_types
        if slow:
            log.info("native decode layers not used: the model has %s weights (numba decodes them faster on "
                     "this CPU)", "/".join(sorted(slow)))
            return
        keys = [r.key() for r in model.ropes]
        index = [keys.index(b.attn.rope.key()) if b.attn.rope is not None else -1 for b in desc.blocks]
        try:
            model.native_stack = self._mod.LayerStack(desc.blocks, index, key_offsets=model.cfg.kv_offsets)
        except (BackendError, InvalidRequestError) as e:
            log.info("native decode layers unavailable for this model (%s); decode runs layer by layer", e)

    def decode_layers(self, model: Any, x: np.ndarray, caches: list[tuple[np.ndarray, np.ndarray, int]],
                      tables: Any, per_layer: np.ndarray | None = None) -> bool:
        """Run every layer of a decode step natively (x updated in place); False when not prepared."""
        stack = getattr(model, "native_stack", None)
        if stack is None or len(caches) > 16:
            return False
        stack.run(x, caches, list(tables), threads=self.threads, per_layer=per_layer)
        return True

    def matmul(self, x: np.ndarray, lin: Any) -> np.ndarray:
        pw = lin.backend_data
        if pw is not None and isinstance(pw, self._mod.PackedMatrix):
            return self._mod.matmul(x, pw, threads=self.threads)
        if lin.qtype in self.numba_decode_types and x.ndim == 2 and x.shape[0] <= 4:
            from . import numba_backend

            return numba_backend.matmul(x, lin.w, lin.qtype)
        return self._mod.matmul(x, lin.w, lin.qtype, threads=self.threads)

    # the small per-layer ops: native versions avoid numpy temporaries on the decode hot path
    def rms_norm(self, x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        """RMSNorm over the last axis of x (..., n)."""
        x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        return self._mod.rmsnorm(x2, w, eps).reshape(x.shape)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool, rope_dim: int) -> None:
        """Rotate x (T, heads, head_dim) in place with cos/sin tables (T, rope_dim/2)."""
        if not x.flags.c_contiguous:
            super().rope(x, cos, sin, neox, rope_dim)
            return
        self._mod.rope(x, neox=neox, n_rot=rope_dim, cos=cos, sin=sin)

    def attention(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, p0: int, scale: float, window: int,
                  softcap: float, causal: bool = True, kv_types: tuple[str, str] | None = None) -> np.ndarray:
        """Attention of q (n, H, D) at positions p0.. over one layer's cache (Hkv, n_ctx, width)
        that holds their keys, in its stored types: the native single-query kernel for decode, the
        native tiled prefill kernel where it beats numpy's BLAS (or the cache is quantized), else
        the numpy version (also for non-causal attention, which the native kernels do not mask)."""
        n = q.shape[0]
        if not causal:
            return super().attention(q, kc, vc, p0, scale, window, softcap, causal=False, kv_types=kv_types)
        quantized = kv_types is not None and (kv_types[0] not in ("f32", "f16") or kv_types[1] not in ("f32", "f16"))
        if self._native_cache(kc, vc, kv_types, q.shape[-1]):
            if n == 1:
                return self._mod.attention_decode(q[0], kc, vc, p0 + 1, scale, window=window, softcap=softcap,
                                                  threads=self.threads, kv_types=kv_types).reshape(1, -1)
            if quantized or self._mod.attention_fast():
                return self._mod.attention_prefill(np.ascontiguousarray(q), kc, vc, p0, scale, window=window,
                                                   softcap=softcap, threads=self.threads, kv_types=kv_types)
        return super().attention(q, kc, vc, p0, scale, window, softcap, kv_types)

    def _native_cache(self, kc: np.ndarray, vc: np.ndarray, kv_types: tuple[str, str] | None, D: int) -> bool:
        """Whether the native attention kernels can read one layer's cache (Hkv, n_ctx, width) as it is."""
        return (kc.shape[:2] == vc.shape[:2] and kc.flags.c_contiguous and vc.flags.c_contiguous
                and (kv_types is None or self._mod.kv_types_fit(kc, vc, kv_types, D)))

    def attention_sinks(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, p0: int, scale: float, window: int,
                        softcap: float, sinks: np.ndarray, kv_types: tuple[str, str] | None = None) -> np.ndarray:
        """:meth:`attention` with per-head sink logits (gpt-oss): the native single-query kernel for decode
        (the sinks join its merged denominator), the numpy version for several queries."""
        if q.shape[0] == 1 and self._native_cache(kc, vc, kv_types, q.shape[-1]):
            return self._mod.attention_decode(q[0], kc, vc, p0 + 1, scale, window=window, softcap=softcap,
                                              threads=self.threads, kv_types=kv_types,
                                              sinks=np.ascontiguousarray(sinks, dtype=np.float32)).reshape(1, -1)
        return super().attention_sinks(q, kc, vc, p0, scale, window, softcap, sinks, kv_types)

    def delta_rule(self, S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray,
                   beta: np.ndarray) -> np.ndarray:
        """The gated delta rule in C, a value head per thread item (the numpy version loops per token)."""
        return self._mod.delta_rule(S, np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                                    np.ascontiguousarray(decay), np.ascontiguousarray(beta), threads=self.threads)

    def causal_conv(self, rows: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """The causal depthwise convolution in C (one pass over the rows; numpy makes two per tap)."""
        return self._mod.causal_conv(np.ascontiguousarray(rows), w, bias, threads=self.threads)

    def ssm_scan(self, S: np.ndarray, x: np.ndarray, dt: np.ndarray, a: np.ndarray, B: np.ndarray,
                 C: np.ndarray) -> np.ndarray:
        """Mamba-2's selective scan in C, a head per thread item (the numpy version loops per token)."""
        return self._mod.ssm_scan(S, np.ascontiguousarray(x), np.ascontiguousarray(dt), a, np.ascontiguousarray(B),
                                  np.ascontiguousarray(C), threads=self.threads)

    def moe_experts(self, x: np.ndarray, m: Any, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The routed experts in one native call (``mr_moe_experts``: tokens grouped by expert, each
        chosen expert's packed or ggml rows read once); the per-op loop where it cannot run them."""
        es = getattr(self, "_expert_sets", None)
        if es is None:
            es = self._expert_sets = {}
        key = id(m)
        entry = es.get(key)
        if entry is None or entry[0] is not m:
            try:
                entry = (m, self._mod.ExpertSet(m))
            except BackendError as e:
                log.info("%s; the experts run per op", e)
                entry = (m, None)
            es[key] = entry
        if entry[1] is None:
            return super().moe_experts(x, m, ids, w)
        return self._mod.moe_experts(entry[1], np.ascontiguousarray(x, dtype=np.float32), ids, w, threads=self.threads)

    def close(self) -> None:
        """Drop the references the kernels keep for late pool workers (see ``native.drain_keepalive``)
        so that a closed model's weights and mapping can go."""
        self._expert_sets = {}
        self._mod.drain_keepalive()

    def dequantize_rows(self, rows: np.ndarray, qtype: str, cols: int) -> np.ndarray:
        """ggml rows (n, row_bytes) uint8 → float32 (n, cols)."""
        if qtype not in self._mod.QTYPES or rows.ndim != 2:
            return super().dequantize_rows(rows, qtype, cols)
        return self._mod.dequantize(np.ascontiguousarray(rows), qtype, cols)

    def embedding_rows(self, data: np.ndarray, qtype: str, cols: int, ids: np.ndarray, tied: Any = None) -> np.ndarray:
        """As the base method; a tied embedding whose output head was packed is read from the packed
        copy, whose rows dequantize to the same values: after packing, the GGUF pages of the matrix
        were dropped, and reading them again would keep both copies resident (Gemma 3's 262k-row
        embedding: 170 MiB more)."""
        pm = getattr(tied, "backend_data", None)
        if isinstance(pm, self._mod.PackedMatrix) and pm.rows == data.shape[0] and pm.cols == cols:
            return self._mod.packed_rows(pm, ids)
        return super().embedding_rows(data, qtype, cols, ids)

    def act_mul(self, g: np.ndarray, u: np.ndarray, act: str) -> np.ndarray:
        """``act(g) * u`` for g, u (T, n_ff) float32, computed into g where the kernel has ``act``."""
        if not (g.flags.c_contiguous and u.flags.c_contiguous and g.dtype == np.float32 and u.dtype == np.float32) \
                or act not in self._mod._ACTS:  # e.g. erf GELU: the numpy version
            return super().act_mul(g, u, act)
        return self._mod.act_mul(g, u, act, out=g)

    def activation(self, x: np.ndarray, act: str, params: Sequence[float] = ()) -> np.ndarray:
        """``act(x)`` of an ungated MLP, x (T, n_ff), in place where the native kernel has ``act``."""
        if act not in self._mod._UNGATED_ACTS or not (x.flags.c_contiguous and x.dtype == np.float32 and x.ndim <= 2):
            return super().activation(x, act, params)
        return self._mod.activation(x, act, out=x)

    def info(self) -> dict[str, Any]:
        d = dict(self._mod.info())
        d["backend"] = self.name
        return d


def get_backend(name: str | None = None, threads: int | None = None) -> Any:
    """Backend by name (``auto``/None: ``$MINIRT_BACKEND`` or native → numba)."""
    global _warned
    name = (name or os.environ.get("MINIRT_BACKEND") or "auto").lower()
    if name == "reference":
        return ReferenceBackend(threads)
    if name == "numba":
        return NumbaBackend(threads)
    if name == "native":
        return NativeBackend(threads)
    if name != "auto":
        raise InvalidRequestError(f"unknown backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    try:
        return NativeBackend(threads)
    except (BackendError, ImportError) as e:
        with _lock:
            if not _warned:
                log.warning("native kernels unavailable (%s); using the numba backend", e)
                _warned = True
        return NumbaBackend(threads)


def select_backend(device: str, name: str | None, threads: int | None, gguf_file: Any) -> tuple[str, Backend]:
    """The one place a model's backend is chosen: ``(device, backend)``.

    ``device`` "cuda" or "auto" takes the CUDA backend when a usable GPU is there (uploading the
    file's weights); "cuda" raises :class:`BackendError` when none is; otherwise the CPU backend
    ``name`` (see :func:`get_backend`)."""
    if device not in ("auto", "cpu", "cuda"):
        raise InvalidRequestError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device in ("cuda", "auto"):
        try:
            from . import cuda

            if cuda.available():
                b = cuda.CudaBackend(gguf_file)
                log.info("device: cuda (%s)", b.info().get("name", "GPU"))
                return "cuda", b
            if device == "cuda":
                raise BackendError(f"device='cuda' requested but no usable GPU: {cuda.unavailable_reason()}")
        except (ImportError, BackendError) as e:
            if device == "cuda":
                if isinstance(e, BackendError):
                    raise
                raise BackendError(f"device='cuda' requested but the CUDA backend cannot load: {e}") from e
            log.warning("CUDA unavailable (%s); using the CPU", e)
    b = get_backend(name, threads)
    log.info("device: cpu (%s backend)", b.name)
    return "cpu", b
