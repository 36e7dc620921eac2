"""HunYuan dense: the Llama block with NEOX RoPE (the converter folds the NTK alpha into
``rope.freq_base``) and per-head RMSNorm of queries and keys applied after RoPE."""

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


@register("hunyuan-dense")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    d, eps = hp.n_embd, hp.rms_eps
    blocks = []
    for i in range(hp.n_layer):
        a = attention(f, i, hp, rope, qk_norm=True)
        a.qk_norm_after_rope = True
        blocks.append(Block(attn_norm=norm(f, f"blk.{i}.attn_norm", d, eps), attn=a,
                            ffn_norm=norm(f, f"blk.{i}.ffn_norm", d, eps), mlp=gated_mlp(f, i, hp)))
    return decoder(f, hp, blocks)
