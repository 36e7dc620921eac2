"""EmbeddingGemma (``gemma-embedding``): the Gemma 3 decoder attending bidirectionally (local layers
see ``|i − j| ≤ sliding_window / 2``, as transformers' bidirectional sliding mask and llama.cpp's
symmetric SWA), mean pooling, then the sentence-transformers Dense projections ``dense_2`` and
``dense_3`` (768 → 3072 → 768 in the released model) when the file has them."""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import read_hparams, register
from .gemma3 import describe as describe_gemma3
from .pooling import pooling_from_meta


@register("gemma-embedding")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    desc = describe_gemma3(f, n_ctx)
    for b in desc.blocks:
        b.attn.causal = False
    desc.pooling = pooling_from_meta(f, read_hparams(f), default="mean")
    return desc
