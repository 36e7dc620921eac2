"""Llama family: Llama 2 / 3 (incl. llama3 RoPE frequency factors), Mistral, TinyLlama, SmolLM.

Pre-norm blocks: ``x += Wo·attn(RoPE(Wq·n(x)), RoPE(Wk·n(x)), Wv·n(x))`` then
``x += Wdown·(silu(Wgate·n(x)) * Wup·n(x))`` with RMSNorm ``n``. RoPE rotates consecutive pairs
(the GGUF converter permuted Q/K rows for that), optional biases are used when present.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import ForwardContext, Transformer, linear, register, vector


@register
class Llama(Transformer):
    arch = "llama"
    qkv_bias: bool | None = None  # None: use biases when the file has them

    def configure(self, cfg) -> None:
        cfg.rope_neox = False

    def load_block(self, i: int) -> dict[str, Any]:
        f, c, p = self.file, self.cfg, f"blk.{i}."
        return {
            "attn_norm": vector(f, p + "attn_norm.weight", c.n_embd),
            "wq": linear(f, p + "attn_q", c.n_head * c.head_dim_k, c.n_embd, bias=self.qkv_bias),
            "wk": linear(f, p + "attn_k", c.n_head_kv * c.head_dim_k, c.n_embd, bias=self.qkv_bias),
            "wv": linear(f, p + "attn_v", c.n_head_kv * c.head_dim_v, c.n_embd, bias=self.qkv_bias),
            "wo": linear(f, p + "attn_output", c.n_embd, c.n_head * c.head_dim_v, bias=None),
            "ffn_norm": vector(f, p + "ffn_norm.weight", c.n_embd),
            "gate": linear(f, p + "ffn_gate", c.n_ff, c.n_embd),
            "up": linear(f, p + "ffn_up", c.n_ff, c.n_embd),
            "down": linear(f, p + "ffn_down", c.n_embd, c.n_ff),
        }

    def native_layer_specs(self) -> list[dict[str, Any]] | None:
        return [self._layer_spec(i, "silu") for i in range(self.cfg.n_layer)]

    def qkv(self, b: dict[str, Any], h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Projections of the normed input h (T, d) → q (T,H,Dk), k (T,Hkv,Dk), v (T,Hkv,Dv)."""
        c, T = self.cfg, h.shape[0]
        q = self.mm(b["wq"], h).reshape(T, c.n_head, c.head_dim_k)
        k = self.mm(b["wk"], h).reshape(T, c.n_head_kv, c.head_dim_k)
        v = self.mm(b["wv"], h).reshape(T, c.n_head_kv, c.head_dim_v)
        return q, k, v

    def mlp(self, b: dict[str, Any], h: np.ndarray) -> np.ndarray:
        g = self.mm(b["gate"], h)
        u = self.mm(b["up"], h)
        return self.mm(b["down"], self.gated(g, u, "silu"))

    def block(self, i: int, x: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        b, eps = self.blocks[i], self.cfg.rms_eps
        q, k, v = self.qkv(b, self.norm(x, b["attn_norm"], eps))
        x = x + self.mm(b["wo"], self.attend(i, q, k, v, ctx))
        return x + self.mlp(b, self.norm(x, b["ffn_norm"], eps))
