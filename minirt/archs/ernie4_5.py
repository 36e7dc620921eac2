"""ERNIE 4.5 (dense): the Llama block, RoPE on consecutive pairs, no biases, output tied to the
embedding when ``output.weight`` is absent."""

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


@register("ernie4_5")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=False)
    blocks = [pre_norm_block(f, i, hp, rope, bias=False) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
