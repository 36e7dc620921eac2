"""LFM2 (Liquid AI): a hybrid of gated short-convolution layers and grouped-query attention layers,
each followed by a SwiGLU MLP, pre-norm (RMSNorm) blocks, output tied to the embedding.

A layer is a convolution layer when the file's ``attention.head_count_kv`` is 0 for it (the
converter writes one value per layer). Its mixer (:class:`minirt.blocks.ShortConv`) is
``out_proj(C · conv(B · x))`` with ``B, C, x = in_proj(h)`` and a causal depthwise convolution of
``shortconv.l_cache`` taps (``shortconv.conv``). Attention layers have per-head q/k RMSNorm and
NEOX RoPE. The final norm is the file's ``token_embd_norm`` (the converter's name for it).

The MoE variant (``lfm2moe``, LFM2-8B-A1B / LFM2-24B-A2B) has the same mixers; its first
``leading_dense_block_count`` layers keep the dense SwiGLU MLP and the others a mixture of experts:
sigmoid router (``expert_gating_func``), selection bias ``exp_probs_b``, top-k weights renormalised
(unless the file's ``expert_weights_norm`` says otherwise; the converter writes none).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..blocks import Block, ModelDesc, ShortConv
from ..errors import GGUFError
from ..gguf import GGUFFile
from .base import (
    attention,
    decoder,
    gated_mlp,
    linear,
    meta_int,
    meta_layers,
    moe_ffn,
    norm,
    read_hparams,
    register,
    rope_from_meta,
    tensor,
)

MAX_TAPS = 64


@register("lfm2")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _describe(f, moe=False)


@register("lfm2moe")
def describe_moe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _describe(f, moe=True)


def _describe(f: GGUFFile, moe: bool) -> ModelDesc:
    hp = read_hparams(f, varying=("attention.head_count_kv",))
    dense = meta_int(f, "leading_dense_block_count", 0, lo=0, hi=hp.n_layer) if moe else hp.n_layer
    d, eps = hp.n_embd, hp.rms_eps
    heads_kv = meta_layers(f, "attention.head_count_kv", hp.n_layer) or [hp.n_head_kv] * hp.n_layer
    taps = meta_int(f, "shortconv.l_cache", 3, lo=2, hi=MAX_TAPS)
    rope = rope_from_meta(f, hp, neox=True)
    window = meta_int(f, "attention.sliding_window", 0, lo=0, hi=1 << 24)
    # the convolution rows go into the cache as that many rows of d / heads (the attention layers'
    # KV head count: their slots then fit without padding the attention layers' ones much)
    heads = max(heads_kv)
    heads = heads if heads and d % heads == 0 else 1
    blocks = []
    for i, hk in enumerate(heads_kv):
        p = f"blk.{i}."
        if hk == 0:
            w = tensor(f, p + "shortconv.conv.weight", (d, taps)).dequantize().reshape(d, taps)
            mixer = ShortConv(in_proj=linear(f, p + "shortconv.in_proj", 3 * d, d, bias=False),
                              out_proj=linear(f, p + "shortconv.out_proj", d, d, bias=False),
                              weight=np.ascontiguousarray(w, dtype=np.float32), cache_heads=heads)
        else:
            if hp.n_head % hk:
                raise GGUFError(f"{f.path}: layer {i}: head_count {hp.n_head} is not a multiple of head_count_kv {hk}")
            mixer = attention(f, i, dataclasses.replace(hp, n_head_kv=hk), rope, qk_norm=True, window=window,
                              bias=False, out_bias=False)
        mlp = gated_mlp(f, i, hp) if i < dense else moe_ffn(f, i, hp, norm_topk=True)
        blocks.append(Block(attn_norm=norm(f, p + "attn_norm", d, eps), attn=mixer,
                            ffn_norm=norm(f, p + "ffn_norm", d, eps), mlp=mlp))
    return decoder(f, hp, blocks, output_norm_name="token_embd_norm")
