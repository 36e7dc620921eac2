"""Seed-OSS: the Llama block with NEOX RoPE and Q/K/V biases; its pre-MLP norm is stored as
``post_attention_norm`` (the name of its Hugging Face original)."""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    pre_norm_block,
    read_hparams,
    register,
    rope_from_meta,
)


@register("seed_oss")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [pre_norm_block(f, i, hp, rope, ffn_norm="post_attention_norm") for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
