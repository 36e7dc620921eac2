"""Granite (3.x dense): the Llama block with four multipliers from metadata: the embedding is
scaled by ``embedding_scale``, each block's output by ``residual_scale`` before it joins the
residual stream, attention by ``attention.scale`` (instead of 1/sqrt(head_dim)), and the logits are
divided by ``logit_scale``."""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    meta_float,
    pre_norm_block,
    read_hparams,
    register,
    rope_from_meta,
)


@register("granite")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=False)
    residual = meta_float(f, "residual_scale", 1.0, hi=1e6)
    blocks = [pre_norm_block(f, i, hp, rope) for i in range(hp.n_layer)]
    for b in blocks:
        b.residual_scale = residual
    return decoder(f, hp, blocks, embed_scale=meta_float(f, "embedding_scale", 1.0, hi=1e6),
                   logit_scale=1.0 / meta_float(f, "logit_scale", 1.0, lo=1e-6, hi=1e6))
