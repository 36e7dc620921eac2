"""ERNIE 4.5 (dense): the Llama block, RoPE on consecutive pairs, no biases, output tied to the
embedding when ``output.weight`` is absent."""

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


@register("ernie4_5")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=False)
    d, eps = hp.n_embd, hp.rms_eps
    blocks = [Block(attn_norm=norm(f, f"blk.{i}.attn_norm", d, eps), attn=attention(f, i, hp, rope, bias=False),
                    ffn_norm=norm(f, f"blk.{i}.ffn_norm", d, eps), mlp=gated_mlp(f, i, hp))
              for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
