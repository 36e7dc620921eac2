"""OLMoE (``olmoe``): pre-norm blocks, q/k RMSNorm over the whole projection (as OLMo 2), NEOX RoPE
and a mixture-of-experts feed-forward: softmax router, top ``expert_used_count`` experts with their
probabilities as they are (not renormalised)."""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    moe_block,
    read_hparams,
    register,
    rope_from_meta,
)


@register("olmoe")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [moe_block(f, i, hp, rope, qk_norm=True, qk_norm_per_head=False, moe=dict(norm_topk=False))
              for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
