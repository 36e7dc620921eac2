"""Qwen2 / Qwen2.5 (and Qwen3): the Llama block with NEOX-style RoPE; Qwen2 has Q/K/V biases,
Qwen3 drops them and RMS-normalizes each query and key head before RoPE."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import register, vector
from .llama import Llama


@register
class Qwen2(Llama):
    arch = "qwen2"
    qkv_bias = True

    def configure(self, cfg) -> None:
        cfg.rope_neox = True


@register
class Qwen3(Llama):
    arch = "qwen3"
    qkv_bias = False

    def configure(self, cfg) -> None:
        cfg.rope_neox = True

    def load_block(self, i: int) -> dict[str, Any]:
        b = super().load_block(i)
        p, c = f"blk.{i}.", self.cfg
        b["q_norm"] = vector(self.file, p + "attn_q_norm.weight", c.head_dim_k)
        b["k_norm"] = vector(self.file, p + "attn_k_norm.weight", c.head_dim_k)
        return b

    def native_layer_specs(self) -> list[dict[str, Any]] | None:
        return [self._layer_spec(i, "silu", q_norm=self.blocks[i]["q_norm"], k_norm=self.blocks[i]["k_norm"])
                for i in range(self.cfg.n_layer)]

    def qkv(self, b: dict[str, Any], h: np.ndarray):
        q, k, v = super().qkv(b, h)
        eps = self.cfg.rms_eps
        return self.norm(q, b["q_norm"], eps), self.norm(k, b["k_norm"], eps), v
