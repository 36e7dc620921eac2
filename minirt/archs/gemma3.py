"""Gemma 3: embeddings scaled by sqrt(n_embd), per-head RMSNorm of queries and keys, norms after
attention and after the MLP as well as before, GELU-tanh gated MLP, output tied to the embedding.

Layers alternate between sliding-window ("local") attention and full ("global") attention: every
``sliding_window_pattern``-th layer (default 6, as llama.cpp) is global. Local layers see only the
last ``sliding_window`` positions and use RoPE base 10000; global ones use ``rope.freq_base`` and the
file's RoPE scaling. Queries are scaled by 1/sqrt(head_dim) (by 1/sqrt(n_embd/n_head) for 27B-style
configs that say so through ``attention.scale``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import GGUFError
from .base import ForwardContext, Transformer, gelu_tanh, linear, meta_int, register, vector

SWA_PATTERN_DEFAULT = 6
ROPE_BASE_LOCAL = 10000.0


@register
class Gemma3(Transformer):
    arch = "gemma3"

    def configure(self, cfg) -> None:
        f = self.file
        cfg.rope_neox = True
        cfg.embed_scale = math.sqrt(cfg.n_embd)
        cfg.sliding_window = meta_int(f, "attention.sliding_window", 0, lo=0, hi=1 << 24)
        pattern = f.arch_get("attention.sliding_window_pattern", SWA_PATTERN_DEFAULT)
        if isinstance(pattern, np.ndarray):  # per-layer booleans in newer files
            if pattern.ndim != 1 or pattern.size != cfg.n_layer or pattern.dtype.kind not in "biu":
                raise GGUFError(f"{f.path}: metadata 'gemma3.attention.sliding_window_pattern' must hold "
                                f"{cfg.n_layer} booleans, got {pattern.dtype} of shape {pattern.shape}")
            cfg.swa_layers = tuple(bool(v) for v in pattern)
        else:
            n = meta_int(f, "attention.sliding_window_pattern", SWA_PATTERN_DEFAULT, lo=0, hi=1 << 16)
            cfg.swa_layers = tuple(n > 0 and (i % n) < n - 1 for i in range(cfg.n_layer))
        if not cfg.sliding_window:
            cfg.swa_layers = (False,) * cfg.n_layer
        cfg.rope_base_swa = ROPE_BASE_LOCAL
        if not cfg.attn_scale and cfg.n_layer == 62:
            # the 27B configuration scales queries by 1/sqrt(n_embd / n_head) (query_pre_attn_scalar)
            cfg.attn_scale = 1.0 / math.sqrt(cfg.n_embd / cfg.n_head)

    def load_block(self, i: int) -> dict[str, Any]:
        f, c, p = self.file, self.cfg, f"blk.{i}."
        return {
            "attn_norm": vector(f, p + "attn_norm.weight", c.n_embd),
            "wq": linear(f, p + "attn_q", c.n_head * c.head_dim_k, c.n_embd),
            "wk": linear(f, p + "attn_k", c.n_head_kv * c.head_dim_k, c.n_embd),
            "wv": linear(f, p + "attn_v", c.n_head_kv * c.head_dim_v, c.n_embd),
            "q_norm": vector(f, p + "attn_q_norm.weight", c.head_dim_k),
            "k_norm": vector(f, p + "attn_k_norm.weight", c.head_dim_k),
            "wo": linear(f, p + "attn_output", c.n_embd, c.n_head * c.head_dim_v),
            "post_attn_norm": vector(f, p + "post_attention_norm.weight", c.n_embd),
            "ffn_norm": vector(f, p + "ffn_norm.weight", c.n_embd),
            "gate": linear(f, p + "ffn_gate", c.n_ff, c.n_embd),
            "up": linear(f, p + "ffn_up", c.n_ff, c.n_embd),
            "down": linear(f, p + "ffn_down", c.n_embd, c.n_ff),
            "post_ffn_norm": vector(f, p + "post_ffw_norm.weight", c.n_embd),
        }

    def native_layer_specs(self) -> list[dict[str, Any]] | None:
        return [self._layer_spec(i, "gelu_tanh", q_norm=b["q_norm"], k_norm=b["k_norm"],
                                 post_attn_norm=b["post_attn_norm"], post_ffn_norm=b["post_ffn_norm"])
                for i, b in enumerate(self.blocks)]

    def block(self, i: int, x: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        b, c = self.blocks[i], self.cfg
        eps, T = c.rms_eps, x.shape[0]
        h = self.norm(x, b["attn_norm"], eps)
        q = self.norm(self.mm(b["wq"], h).reshape(T, c.n_head, c.head_dim_k), b["q_norm"], eps)
        k = self.norm(self.mm(b["wk"], h).reshape(T, c.n_head_kv, c.head_dim_k), b["k_norm"], eps)
        v = self.mm(b["wv"], h).reshape(T, c.n_head_kv, c.head_dim_v)
        a = self.mm(b["wo"], self.attend(i, q, k, v, ctx))
        x = x + self.norm(a, b["post_attn_norm"], eps)
        h = self.norm(x, b["ffn_norm"], eps)
        m = self.mm(b["down"], self.gated(self.mm(b["gate"], h), self.mm(b["up"], h), "gelu_tanh"))
        return x + self.norm(m, b["post_ffn_norm"], eps)
