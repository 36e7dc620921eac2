"""What a compute backend provides: the operations of the forward pass, nothing about architectures.

:class:`Backend` lists every operation :class:`minirt.forward.Transformer` calls, with the numpy
reference version of each (from :mod:`minirt.blocks`); a backend overrides what it does faster.
Only ``matmul`` has no default. The optional whole-pass hooks (``decode_layers``, ``forward``)
answer False / None when the backend did not prepare the model for them, and the reference
interpreter then runs the layers with the per-op methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import blocks


class Backend:
    """Base class of the CPU and CUDA backends; see the module docstring."""

    name = "base"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads

    # -- lifecycle -----------------------------------------------------------------------------------
    def prepare(self, model: Any) -> None:
        """Called once when ``model`` (a Transformer over ``model.desc``) is built: repack or upload
        weights, build fused stacks. A description feature the backend cannot run must be refused
        here (logged once), leaving the per-op path, never run wrongly."""

    def close(self) -> None:
        """Release what the backend holds for its models."""

    def info(self) -> dict[str, Any]:
        return {"backend": self.name}

    # -- operations ----------------------------------------------------------------------------------
    def matmul(self, x: np.ndarray, lin: Any) -> np.ndarray:
        """``x (T, in) @ W.T → (T, out)`` straight from the quantized weight ``lin`` (no bias)."""
        raise NotImplementedError

    def dequantize_rows(self, rows: np.ndarray, qtype: str, cols: int) -> np.ndarray:
        """ggml rows (n, row_bytes) uint8 → float32 (n, cols) (the embedding lookup)."""
        from ..quants import dequantize

        return dequantize(rows, qtype, (rows.shape[0], cols))

    def embedding_rows(self, data: np.ndarray, qtype: str, cols: int, ids: np.ndarray, tied: Any = None) -> np.ndarray:
        """Rows ``ids`` (T,) of the embedding ``data`` (n_vocab, row_bytes) ggml rows → float32 (T, cols).
        ``tied``: the output head's Linear when it is this embedding; a backend that keeps its own
        copy of that weight (``backend_data``) may read the rows from there instead."""
        return self.dequantize_rows(data[ids], qtype, cols)

    def rms_norm(self, x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
        """RMSNorm over the last axis of x (..., n)."""
        return blocks.rms_norm(x, w, eps)

    def layer_norm(self, x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, eps: float) -> np.ndarray:
        """LayerNorm over the last axis of x (..., n)."""
        return blocks.layer_norm(x, w, b, eps)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool, rope_dim: int) -> None:
        """Rotate x (T, heads, head_dim) in place with cos/sin tables (T, rope_dim/2)."""
        blocks.apply_rope(x, cos, sin, neox, rope_dim)

    def act_mul(self, g: np.ndarray, u: np.ndarray, act: str) -> np.ndarray:
        """``act(g) * u`` of a gated MLP, g and u (T, n_ff); may overwrite g."""
        return blocks.activation(act, g) * u

    def activation(self, x: np.ndarray, act: str, params: Sequence[float] = ()) -> np.ndarray:
        """``act(x)`` of an ungated MLP, x (T, n_ff) float32; may overwrite x."""
        return blocks.activation(act, x, params)

    def attention(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, p0: int, scale: float, window: int,
                  softcap: float, causal: bool = True, kv_types: tuple[str, str] | None = None) -> np.ndarray:
        """Causal attention of n queries q (n, H, Dk) at positions p0.. over one layer's cache
        kc (Hkv, n_ctx, width_k), vc (Hkv, n_ctx, width_v) that already holds their keys → (n, H·Dv).
        ``causal`` False: the n queries are a whole sequence (p0 = 0) and see each other both ways.
        ``kv_types``: the stored element types (None: float32 / float16 arrays). This reference
        version converts the visible rows to float32 first."""
        n = q.shape[0]
        if not causal:
            k, v = _visible(kc, vc, 0, p0 + n, kv_types)
            return blocks.attention(q, k, v, p0, scale, window, softcap, causal=False)
        lo = max(0, p0 - window + 1) if window else 0  # keys older than the window are never read
        k, v = _visible(kc, vc, lo, p0 + n, kv_types)
        return blocks.attention(q, k, v, p0 - lo, scale, window, softcap)

    def delta_rule(self, S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray,
                   beta: np.ndarray) -> np.ndarray:
        """The gated delta rule over n tokens (:func:`minirt.blocks.delta_rule`): S (H, Dk, Dv) updated
        in place, returns o (n, H, Dv)."""
        return blocks.delta_rule(S, q, k, v, decay, beta)

    def causal_conv(self, rows: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """A causal depthwise convolution (:func:`minirt.blocks.causal_conv`): rows (taps − 1 + n, c), w (c, taps)
        → (n, c)."""
        return blocks.causal_conv(rows, w, bias)

    def ssm_scan(self, S: np.ndarray, x: np.ndarray, dt: np.ndarray, a: np.ndarray, B: np.ndarray,
                 C: np.ndarray) -> np.ndarray:
        """Mamba-2's selective scan over n tokens (:func:`minirt.blocks.ssm_scan`): S (H, P, N) updated in
        place, returns y (n, H, P)."""
        return blocks.ssm_scan(S, x, dt, a, B, C)

    def attention_sinks(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, p0: int, scale: float, window: int,
                        softcap: float, sinks: np.ndarray, kv_types: tuple[str, str] | None = None) -> np.ndarray:
        """:meth:`attention` with per-head sink logits ``sinks`` (H,) in each softmax's denominator."""
        n = q.shape[0]
        lo = max(0, p0 - window + 1) if window else 0
        k, v = _visible(kc, vc, lo, p0 + n, kv_types)
        return blocks.attention(q, k, v, p0 - lo, scale, window, softcap, sinks)

    def moe(self, x: np.ndarray, m: Any) -> np.ndarray:
        """A mixture-of-experts feed-forward (:class:`minirt.blocks.MoE`) of x (T, d) → (T, d).

        Tokens are grouped by expert: each chosen expert runs once, over all the tokens that chose
        it, through this backend's ``matmul`` on that expert's row view of the 3-D tensor, so only
        the chosen experts' bytes are read (a decode step reads ``n_used`` experts per layer)."""
        r = m.router
        ids, w = blocks.route(self._mm_bias(r.gate, x), r)
        if m.latent_down is None:
            out = self.moe_experts(x, m, ids, w)
        else:  # latent experts: they read and write the latent width
            out = self._mm_bias(m.latent_up, self.moe_experts(self._mm_bias(m.latent_down, x), m, ids, w))
        if m.shared is not None:
            s = m.shared
            u = self._mm_bias(s.up, x)
            if s.gate is None:
                a = blocks.activation(s.act, u, s.act_params)
            else:
                a = self.act_mul(self._mm_bias(s.gate, x), u, s.act)
            y = self._mm_bias(s.down, np.ascontiguousarray(a))
            if m.shared_gate is not None:
                g = self._mm_bias(m.shared_gate, x)  # (T, 1)
                y *= np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
            out += y
        return out

    def moe_experts(self, x: np.ndarray, m: Any, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """The routed experts' weighted sum (T, d) for tokens x (T, d) that chose ``ids`` (T, k) with
        weights ``w`` (T, k): each chosen expert's matmuls once over all its tokens."""
        out = np.zeros((x.shape[0], m.down[0].out_features), dtype=np.float32)
        for e, rows, slot in blocks.group_by_expert(ids, m.n_expert):
            xe = np.ascontiguousarray(x[rows])
            u = self._mm_bias(m.up[e], xe)
            if m.gate is None:
                a = blocks.activation(m.act, u, m.act_params)
            elif m.act == "swiglu_oai":
                a = blocks.swiglu_oai(self._mm_bias(m.gate[e], xe), u, *m.act_params)
            else:
                a = self.act_mul(self._mm_bias(m.gate[e], xe), u, m.act)
            y = self._mm_bias(m.down[e], np.ascontiguousarray(a))
            out[rows] += w[rows, slot][:, None] * y  # rows are distinct within one expert
        return out

    def _mm_bias(self, lin: Any, x: np.ndarray) -> np.ndarray:
        """``matmul`` plus the bias."""
        y = self.matmul(x, lin)
        if lin.bias is not None:
            y += lin.bias
        return y

    # -- whole-pass hooks ------------------------------------------------------------------------------
    def decode_layers(self, model: Any, x: np.ndarray, caches: list[tuple[np.ndarray, np.ndarray, int]],
                      tables: Sequence[tuple[np.ndarray, np.ndarray]], per_layer: np.ndarray | None = None) -> bool:
        """Every layer of a decode step (one token per sequence) in one call, x (n_seq, d) in place;
        ``tables``: (cos, sin) for each of ``model.ropes``; ``per_layer``: the per-layer inputs
        (n_seq, n_layer, width) of a model that has them. False: not prepared for it."""
        return False

    def forward(self, model: Any, tokens: np.ndarray, segments: Sequence[Any]) -> list[np.ndarray | None] | None:
        """The whole forward pass where the activations live (a device); None: run it on the host."""
        return None


def _visible(kc: np.ndarray, vc: np.ndarray, lo: int, hi: int,
             kv_types: tuple[str, str] | None) -> tuple[np.ndarray, np.ndarray]:
    """Rows lo..hi-1 of one layer's cache (Hkv, n_ctx, width) as float32 (Hkv, hi - lo, D)
    arrays, dequantized from the stored types where they are block types."""
    k, v = kc[:, lo:hi], vc[:, lo:hi]
    if kv_types is not None and (kv_types[0] not in ("f32", "f16") or kv_types[1] not in ("f32", "f16")):
        from .. import kv_types as kvt
        from ..kv_cache import dequantize_rows

        k, v = dequantize_rows(k, kvt.get(kv_types[0])), dequantize_rows(v, kvt.get(kv_types[1]))
    if k.dtype != np.float32 or v.dtype != np.float32:
        k, v = k.astype(np.float32), v.astype(np.float32)
    return k, v
