"""Qwen1.5-MoE / Qwen2-MoE (``qwen2moe``) and Qwen3-MoE (``qwen3moe``): the Qwen2 / Qwen3 attention
(NEOX RoPE; Q/K/V biases in Qwen2-MoE, per-head q/k RMSNorm in Qwen3-MoE) with a mixture-of-experts
feed-forward: softmax router, top ``expert_used_count`` experts. Qwen2-MoE keeps the chosen
probabilities as they are and adds a shared expert scaled by ``sigmoid(ffn_gate_inp_shexp · x)``;
Qwen3-MoE renormalises the chosen probabilities to sum 1 (as llama.cpp does for every Qwen3-MoE
file) and has no shared expert."""

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


@register("qwen2moe")
def describe_qwen2moe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [moe_block(f, i, hp, rope, bias=None, moe=dict(norm_topk=False)) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)


@register("qwen3moe")
def describe_qwen3moe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [moe_block(f, i, hp, rope, qk_norm=True, moe=dict(norm_topk=True)) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
