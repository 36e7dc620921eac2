"""OLMo 2: norms after attention and after the MLP only (no pre-norms), RMSNorm of queries and keys
over the whole projection (not per head) before NEOX RoPE, SwiGLU."""

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


@register("olmo2")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    d, eps = hp.n_embd, hp.rms_eps
    blocks = [Block(attn=attention(f, i, hp, rope, qk_norm=True, qk_norm_per_head=False),
                    post_attn_norm=norm(f, f"blk.{i}.post_attention_norm", d, eps),
                    mlp=gated_mlp(f, i, hp), post_ffn_norm=norm(f, f"blk.{i}.post_ffw_norm", d, eps))
              for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
