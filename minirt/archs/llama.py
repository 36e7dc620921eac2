"""Llama family (Llama 2 / 3 / 3.1 / 3.2 with llama3 RoPE frequency factors, TinyLlama, SmolLM, Mistral
files written as ``llama``): pre-norm blocks with RMSNorm, GQA attention with RoPE on consecutive
pairs (the converter permuted Q/K rows for that), SwiGLU MLP; biases used where the file has them,
output tied to the embedding when ``output.weight`` is absent."""

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


@register("llama")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=False)
    blocks = [pre_norm_block(f, i, hp, rope) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
