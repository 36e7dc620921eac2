"""Command R7B (``cohere2``): parallel blocks, ``x + attn(n(x)) + mlp(n(x))`` with one LayerNorm
(no bias); three sliding-window layers with RoPE on consecutive pairs, then one global layer without
RoPE (``sliding_window_pattern``, default 4); logits multiplied by ``logit_scale``; output tied."""

from __future__ import annotations

from ..blocks import Block, ModelDesc
from ..gguf import GGUFFile
from .base import (
    attention,
    decoder,
    gated_mlp,
    meta_float,
    meta_int,
    norm,
    read_hparams,
    register,
    rope_from_meta,
    swa_pattern,
)


@register("cohere2")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    eps = meta_float(f, "attention.layer_norm_epsilon", 1e-5, hi=1.0)
    window = meta_int(f, "attention.sliding_window", required=True, lo=1, hi=1 << 24)
    local = swa_pattern(f, hp.n_layer, 4)
    rope = rope_from_meta(f, hp, neox=False)
    blocks = [Block(attn_norm=norm(f, f"blk.{i}.attn_norm", hp.n_embd, eps, kind="layer"),
                    attn=attention(f, i, hp, rope if local[i] else None, window=window if local[i] else 0),
                    mlp=gated_mlp(f, i, hp), parallel=True)
              for i in range(hp.n_layer)]
    return decoder(f, hp, blocks, logit_scale=meta_float(f, "logit_scale", 1.0, hi=1e6), output_norm="layer")
