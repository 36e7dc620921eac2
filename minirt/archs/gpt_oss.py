"""gpt-oss (``gpt-oss``): pre-norm blocks (the feed-forward's norm is stored as
``post_attention_norm``), Q/K/V and output biases, NEOX RoPE with the file's YaRN scaling,
per-head attention sinks (``attn_sinks``: a logit per head that joins each softmax's denominator),
sliding-window attention on every other layer (``sliding_window_pattern``, default 2: layers 0, 2,
... are local), and a mixture-of-experts feed-forward: the router (with bias) picks the top
``expert_used_count`` logits and softmaxes them among themselves; the experts have biases and the
clamped SwiGLU ``min(g, 7)·sigmoid(1.702·min(g, 7))·(clamp(u, ±7) + 1)`` (the constants llama.cpp
uses for every file)."""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    meta_float,
    meta_int,
    moe_block,
    read_hparams,
    register,
    rope_from_meta,
    swa_pattern,
    vector,
)

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


@register("gpt-oss")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    window = meta_int(f, "attention.sliding_window", required=True, lo=1, hi=1 << 24)
    local = swa_pattern(f, hp.n_layer, 2)
    rope = rope_from_meta(f, hp, neox=True)
    base_swa = meta_float(f, "rope.freq_base_swa", 0.0, hi=1e12)
    rope_local = rope_from_meta(f, hp, neox=True, base=base_swa) if base_swa and base_swa != hp.rope_base else rope
    moe = dict(gating="softmax_topk", norm_topk=False, act="swiglu_oai", act_params=(SWIGLU_ALPHA, SWIGLU_LIMIT))
    blocks = []
    for i in range(hp.n_layer):
        b = moe_block(f, i, hp, rope_local if local[i] else rope, ffn_norm="post_attention_norm", bias=True,
                      out_bias=True, window=window if local[i] else 0, moe=moe)
        b.attn.sinks = vector(f, f"blk.{i}.attn_sinks.weight", hp.n_head)
        blocks.append(b)
    return decoder(f, hp, blocks)
