"""Gemma (1) and Gemma 2: embeddings scaled by sqrt(n_embd), GELU-tanh gated MLP, NEOX RoPE, output
tied to the embedding (the converter stores the norms' ``1 + w`` gains).

Gemma 2 adds norms after attention and after the MLP, soft-capped attention logits and final
logits, and alternates sliding-window (even layers) and global attention. Queries are scaled by
1/sqrt(head_dim) unless ``attention.scale`` says otherwise; the 27B (46 layers) scales by
1/sqrt(n_embd / n_head), as llama.cpp does for files without the key.
"""

from __future__ import annotations

import math

from ..blocks import Block, ModelDesc, Rope
from ..gguf import GGUFFile
from .base import (
    HParams,
    attention,
    decoder,
    gated_mlp,
    meta_int,
    norm,
    pre_norm_block,
    read_hparams,
    register,
    rope_from_meta,
    swa_pattern,
)


def sandwich_block(f: GGUFFile, i: int, hp: HParams, rope: Rope | None, window: int, qk_norm: bool = False) -> Block:
    """Gemma 2 / 3 block: RMSNorm before and after both attention and the GELU-tanh MLP."""
    p, d, eps = f"blk.{i}.", hp.n_embd, hp.rms_eps
    return Block(attn_norm=norm(f, p + "attn_norm", d, eps),
                 attn=attention(f, i, hp, rope, qk_norm=qk_norm, window=window),
                 post_attn_norm=norm(f, p + "post_attention_norm", d, eps),
                 ffn_norm=norm(f, p + "ffn_norm", d, eps),
                 mlp=gated_mlp(f, i, hp, act="gelu_tanh"),
                 post_ffn_norm=norm(f, p + "post_ffw_norm", d, eps))


@register("gemma")
def describe_gemma(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [pre_norm_block(f, i, hp, rope, act="gelu_tanh") for i in range(hp.n_layer)]
    return decoder(f, hp, blocks, embed_scale=math.sqrt(hp.n_embd))


@register("gemma2")
def describe_gemma2(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    if not f.metadata.get("gemma2.attention.scale") and hp.n_layer == 46:
        hp.attn_scale = 1.0 / math.sqrt(hp.n_embd / hp.n_head)
    window = meta_int(f, "attention.sliding_window", 0, lo=0, hi=1 << 24)
    local = swa_pattern(f, hp.n_layer, 2) if window else [False] * hp.n_layer
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [sandwich_block(f, i, hp, rope, window if local[i] else 0) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks, embed_scale=math.sqrt(hp.n_embd))
