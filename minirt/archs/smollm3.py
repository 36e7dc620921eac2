"""SmolLM3: the Llama block (RoPE on consecutive pairs) where every fourth layer uses no RoPE. The
converter writes no key for that interval; llama.cpp fixes it at 4 (the released models' value), and
so does this description."""

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

NO_ROPE_LAYER_STEP = 4


@register("smollm3")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=False)
    blocks = [pre_norm_block(f, i, hp, rope if (i + 1) % NO_ROPE_LAYER_STEP else None) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
