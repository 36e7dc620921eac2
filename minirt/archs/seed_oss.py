"""Seed-OSS: the Llama block with NEOX RoPE and Q/K/V biases; its pre-MLP norm is stored as
``post_attention_norm`` (the name of its Hugging Face original)."""

from __future__ import annotations

from ..blocks import Block, ModelDesc
from ..gguf import GGUFFile
from .base import (
    attention,
    decoder,
    gated_mlp,
    norm,
    read_hparams,
    register,
    rope_from_meta,
)


@register("seed_oss")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    d, eps = hp.n_embd, hp.rms_eps
    blocks = [Block(attn_norm=norm(f, f"blk.{i}.attn_norm", d, eps), attn=attention(f, i, hp, rope),
                    ffn_norm=norm(f, f"blk.{i}.post_attention_norm", d, eps), mlp=gated_mlp(f, i, hp))
              for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
