"""Granite MoE (3.x MoE, ``granitemoe``; also Granite MoE Shared): Granite's four multipliers
(embedding, residual, attention and logit scale, see :mod:`.granite`) around a mixture-of-experts
feed-forward: softmax router, top ``expert_used_count`` experts renormalised to sum 1, plus the
ungated shared expert ``ffn_*_shexp`` where the file has one (``expert_shared_feed_forward_length``)."""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    meta_float,
    moe_block,
    read_hparams,
    register,
    rope_from_meta,
)


@register("granitemoe")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=False)
    residual = meta_float(f, "residual_scale", 1.0, hi=1e6)
    blocks = [moe_block(f, i, hp, rope, out_bias=None, moe=dict(norm_topk=True)) for i in range(hp.n_layer)]
    for b in blocks:
        b.residual_scale = residual
    return decoder(f, hp, blocks, embed_scale=meta_float(f, "embedding_scale", 1.0, hi=1e6),
                   logit_scale=1.0 / meta_float(f, "logit_scale", 1.0, lo=1e-6, hi=1e6))
