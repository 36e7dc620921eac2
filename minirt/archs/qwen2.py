"""Qwen2 / Qwen2.5 and Qwen3: the Llama block with NEOX-style RoPE. Qwen2 has Q/K/V biases; Qwen3
drops them and RMS-normalizes each query and key head before RoPE."""

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


def _describe(f: GGUFFile, qk_norm: bool) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [pre_norm_block(f, i, hp, rope, qk_norm=qk_norm, bias=not qk_norm) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)


@register("qwen2")
def describe_qwen2(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _describe(f, qk_norm=False)


@register("qwen3")
def describe_qwen3(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _describe(f, qk_norm=True)
