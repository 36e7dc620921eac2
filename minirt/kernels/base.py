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

    def attention(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, p0: int, scale: float, window: int,
                  softcap: float, kv_types: tuple[str, str] | None = None) -> np.ndarray:
        """Causal attention of n queries q (n, H, Dk) at positions p0.. over one layer's cache
        kc (Hkv, n_ctx, width_k), vc (Hkv, n_ctx, width_v) that already holds their keys → (n, H·Dv).
        ``kv_types``: the stored element types (None: float32 / float16 arrays). This reference
        version converts the visible rows to float32 first."""
        from .. import kv_types as kvt

        n = q.shape[0]
        lo = max(0, p0 - window + 1) if window else 0  # keys older than the window are never read
        k, v = kc[:, lo:p0 + n], vc[:, lo:p0 + n]
        if kv_types is not None and (kv_types[0] not in ("f32", "f16") or kv_types[1] not in ("f32", "f16")):
            from ..kv_cache import dequantize_rows

            k, v = dequantize_rows(k, kvt.get(kv_types[0])), dequantize_rows(v, kvt.get(kv_types[1]))
        if k.dtype != np.float32 or v.dtype != np.float32:
            k, v = k.astype(np.float32), v.astype(np.float32)
        return blocks.attention(q, k, v, p0 - lo, scale, window, softcap)

    # -- whole-pass hooks ------------------------------------------------------------------------------
    def decode_layers(self, model: Any, x: np.ndarray, caches: list[tuple[np.ndarray, np.ndarray, int]],
                      tables: Sequence[tuple[np.ndarray, np.ndarray]]) -> bool:
        """Every layer of a decode step (one token per sequence) in one call, x (n_seq, d) in place;
        ``tables``: (cos, sin) for each of ``model.ropes``. False: not prepared for it."""
        return False

    def forward(self, model: Any, tokens: np.ndarray, segments: Sequence[Any]) -> list[np.ndarray | None] | None:
        """The whole forward pass where the activations live (a device); None: run it on the host."""
        return None
