"""HunYuan dense: the Llama block with NEOX RoPE (the converter folds the NTK alpha into
``rope.freq_base``) and per-head RMSNorm of queries and keys applied after RoPE."""

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


@register("hunyuan-dense")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [pre_norm_block(f, i, hp, rope, qk_norm=True) for i in range(hp.n_layer)]
    for b in blocks:
        b.attn.qk_norm_after_rope = True
    return decoder(f, hp, blocks)
