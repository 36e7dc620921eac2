"""OLMo 2: norms after attention and after the MLP only (no pre-norms), RMSNorm of queries and keys
over the whole projection (not per head) before NEOX RoPE, SwiGLU."""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    post_norm_block,
    read_hparams,
    register,
    rope_from_meta,
)


@register("olmo2")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [post_norm_block(f, i, hp, rope, qk_norm=True, qk_norm_per_head=False) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
