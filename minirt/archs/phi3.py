"""Phi-3 / 3.5 / 4-mini: pre-norm blocks with a fused ``attn_qkv`` and a fused gate+up ``ffn_up``
(split into row views), NEOX RoPE over the first ``rope.dimension_count`` dims (partial rotary),
SwiGLU, optional sliding window on every layer.

LongRoPE (the 128k models): per-frequency divisors ``rope_factors_long`` when the context exceeds
``rope.scaling.original_context_length``, ``rope_factors_short`` otherwise (as llama.cpp chooses by
the context it runs with), and cos/sin scaled by ``rope.scaling.attn_factor``.
"""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    meta_float,
    meta_int,
    pre_norm_block,
    read_hparams,
    register,
    rope_factors,
    rope_from_meta,
)


@register("phi3")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True, longrope=True)
    short, long_ = f.tensors.get("rope_factors_short.weight"), f.tensors.get("rope_factors_long.weight")
    if short is not None or long_ is not None:
        orig = meta_int(f, "rope.scaling.original_context_length", hp.n_ctx_train, hi=1 << 24)
        ctx = hp.n_ctx_train if n_ctx is None else n_ctx
        t = long_ if (ctx > orig and long_ is not None) or short is None else short
        rope.factors = rope_factors(f, t, rope.dim)
        rope.attn_factor = meta_float(f, "rope.scaling.attn_factor", 1.0, hi=1e3)
    window = meta_int(f, "attention.sliding_window", 0, lo=0, hi=1 << 24)
    blocks = [pre_norm_block(f, i, hp, rope, window=window) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
