"""GLM-4 (0414 dense): pre- and post-norms around attention and the MLP, Q/K/V biases, RoPE on
consecutive pairs over the first ``rope.dimension_count`` dims (partial rotary), SwiGLU with gate and
up fused in ``ffn_up``."""

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


@register("glm4")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=False)
    d, eps = hp.n_embd, hp.rms_eps
    blocks = []
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        blocks.append(Block(attn_norm=norm(f, p + "attn_norm", d, eps), attn=attention(f, i, hp, rope),
                            post_attn_norm=norm(f, p + "post_attention_norm", d, eps),
                            ffn_norm=norm(f, p + "ffn_norm", d, eps), mlp=gated_mlp(f, i, hp),
                            post_ffn_norm=norm(f, p + "post_ffw_norm", d, eps)))
    return decoder(f, hp, blocks)
