"""Gemma 4 (text): Gemma 3's sandwich-normed blocks with GELU-tanh MLPs and alternating sliding / full
attention, plus:

- other head sizes (``attention.key_length_swa``) and RoPE (``rope.dimension_count_swa``,
  ``rope.freq_base_swa``, unscaled) on the sliding layers; the full layers' "proportional" partial
  RoPE is in the file's ``rope_freqs.weight`` (factor 1e30 for the dims that do not rotate);
- q/k RMSNorm per head, values RMS-normed without gains, and no 1/sqrt(d) query scale;
- per-layer token embeddings (``embedding_length_per_layer_input``): a per-layer input made once
  from the tokens and the scaled embeddings, gated into the residual after each block's MLP;
- KV sharing: the last ``attention.shared_kv_layers`` layers store no keys / values and read those
  of the last earlier layer of their kind (sliding or full), as transformers' Gemma 4 does;
- per-layer MLP widths (``feed_forward_length`` per layer: the shared layers' double-wide MLP),
  ``layer_output_scale`` per block, final logit soft-cap, output tied to the embedding.

The MoE variant (``ffn_gate_inp``: Gemma 4 26B-A4B) runs the dense MLP and a mixture of experts
side by side in every such layer (:class:`minirt.blocks.ParallelMoE`): the MLP between ``ffn_norm`` and
``post_ffw_norm_1``, the experts (fused ``ffn_gate_up_exps``, GELU-tanh, per-expert
``ffn_down_exps.scale``) between ``pre_ffw_norm_2`` and ``post_ffw_norm_2``, their router on the
RMS-normed residual times ``ffn_gate_inp.scale`` and d^-0.5 (softmax, top-k renormalised); the sum
goes through ``post_ffw_norm``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..blocks import Attention, Block, ModelDesc, Norm, ParallelMoE, PerLayerGate, PerLayerInputs, Rope
from ..errors import GGUFError
from ..gguf import GGUFFile
from .base import (
    HParams,
    attention,
    decoder,
    gated_mlp,
    linear,
    meta_float,
    meta_int,
    meta_layers,
    moe_ffn,
    norm,
    read_hparams,
    register,
    rope_from_meta,
    swa_pattern,
    tensor,
    vector,
)


def _kv_sources(local: list[bool], n_shared: int) -> list[int | None]:
    """Layer whose cache each layer reads: its own (None) or, for the last ``n_shared``, the last
    earlier non-shared layer of the same kind."""
    first = len(local) - n_shared
    out: list[int | None] = [None] * len(local)
    for i in range(first, len(local)):
        src = [j for j in range(first) if local[j] == local[i]]
        if not src:
            raise GGUFError(f"layer {i} shares the KV of an earlier {'sliding' if local[i] else 'full'} layer, "
                            "and there is none")
        out[i] = src[-1]
    return out


def _block(f: GGUFFile, i: int, hp: HParams, rope: Rope, window: int, source: int | None,
           per_layer: int) -> Block:
    p, d, eps = f"blk.{i}.", hp.n_embd, hp.rms_eps
    if source is not None:  # queries only: keys and values are layer `source`'s
        H, Dk = hp.n_head, hp.head_dim_k
        a = Attention(n_head=H, n_head_kv=hp.n_head_kv, head_dim_k=Dk, head_dim_v=hp.head_dim_v,
                      wq=linear(f, p + "attn_q", H * Dk, d, bias=False), wk=None, wv=None,
                      wo=linear(f, p + "attn_output", d, H * hp.head_dim_v, bias=False), scale=1.0, rope=rope,
                      q_norm=norm(f, p + "attn_q_norm", Dk, eps), window=window, kv_source=source)
    else:
        if p + "attn_v.weight" not in f.tensors and p + "attn_qkv.weight" not in f.tensors:
            # attention_k_eq_v (the 31B's full layers): the values are the key projection, normed as values
            k = linear(f, p + "attn_k", hp.n_head_kv * hp.head_dim_k, d, bias=False)
            H, Dk = hp.n_head, hp.head_dim_k
            a = Attention(n_head=H, n_head_kv=hp.n_head_kv, head_dim_k=Dk, head_dim_v=Dk,
                          wq=linear(f, p + "attn_q", H * Dk, d, bias=False), wk=k, wv=k,
                          wo=linear(f, p + "attn_output", d, H * Dk, bias=False), scale=1.0, rope=rope,
                          q_norm=norm(f, p + "attn_q_norm", Dk, eps), k_norm=norm(f, p + "attn_k_norm", Dk, eps),
                          window=window)
        else:
            a = attention(f, i, hp, rope, qk_norm=True, window=window, bias=False, out_bias=False, scale=1.0)
        a.v_norm = Norm(None, eps)
    mlp = gated_mlp(f, i, hp, act="gelu_tanh")
    ffn_norm: Norm | None = norm(f, p + "ffn_norm", d, eps)
    if p + "ffn_gate_inp.weight" in f.tensors:  # 26B-A4B: the dense MLP and the experts side by side
        moe = moe_ffn(f, i, hp, norm_topk=True, act="gelu_tanh")
        mlp = ParallelMoE(mlp=mlp, moe=moe, pre_1=ffn_norm, post_1=norm(f, p + "post_ffw_norm_1", d, eps),
                          pre_2=norm(f, p + "pre_ffw_norm_2", d, eps), post_2=norm(f, p + "post_ffw_norm_2", d, eps),
                          router_norm=Norm(None, eps),
                          router_scale=vector(f, p + "ffn_gate_inp.scale", d) * np.float32(d ** -0.5),
                          expert_scale=vector(f, p + "ffn_down_exps.scale", moe.n_expert))
        ffn_norm = None  # each path has its own
    b = Block(attn_norm=norm(f, p + "attn_norm", d, eps), attn=a,
              post_attn_norm=norm(f, p + "post_attention_norm", d, eps), ffn_norm=ffn_norm,
              mlp=mlp, post_ffn_norm=norm(f, p + "post_ffw_norm", d, eps))
    if per_layer:
        b.per_layer = PerLayerGate(gate=linear(f, p + "inp_gate", per_layer, d, bias=False),
                                   proj=linear(f, p + "proj", d, per_layer, bias=False),
                                   post_norm=norm(f, p + "post_norm", d, eps))
    if p + "layer_output_scale.weight" in f.tensors:
        b.out_scale = float(vector(f, p + "layer_output_scale.weight", 1)[0])
    return b


@register("gemma4")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f, varying=("attention.head_count_kv", "feed_forward_length"))
    L, d = hp.n_layer, hp.n_embd
    window = meta_int(f, "attention.sliding_window", 0, lo=0, hi=1 << 24)
    local = swa_pattern(f, L, 0) if window else [False] * L
    heads_kv = meta_layers(f, "attention.head_count_kv", L) or [hp.n_head_kv] * L
    n_ff = meta_layers(f, "feed_forward_length", L) or [hp.n_ff] * L
    dk_swa = meta_int(f, "attention.key_length_swa", hp.head_dim_k)
    dv_swa = meta_int(f, "attention.value_length_swa", hp.head_dim_v)
    rot_swa = meta_int(f, "rope.dimension_count_swa", hp.rope_dim)
    if rot_swa > dk_swa or rot_swa % 2:
        raise GGUFError(f"{f.path}: rope.dimension_count_swa {rot_swa} invalid for head size {dk_swa}")
    rope_full = rope_from_meta(f, hp, neox=True)
    rope_local = Rope(dim=rot_swa, base=meta_float(f, "rope.freq_base_swa", 10000.0, lo=1e-3), neox=True)
    sources = _kv_sources(local, meta_int(f, "attention.shared_kv_layers", 0, lo=0, hi=L - 1))
    E = meta_int(f, "embedding_length_per_layer_input", 0, lo=0)
    blocks = []
    for i in range(L):
        src = sources[i]
        hk = heads_kv[i if src is None else src]
        if hp.n_head % hk:
            raise GGUFError(f"{f.path}: layer {i}: head_count {hp.n_head} is not a multiple of head_count_kv {hk}")
        lhp = dataclasses.replace(hp, n_head_kv=hk, n_ff=n_ff[i], head_dim_k=dk_swa if local[i] else hp.head_dim_k,
                                  head_dim_v=dv_swa if local[i] else hp.head_dim_v)
        blocks.append(_block(f, i, lhp, rope_local if local[i] else rope_full, window if local[i] else 0, src, E))
    desc = decoder(f, hp, blocks, embed_scale=math.sqrt(d))
    if E:
        desc.per_layer_inputs = PerLayerInputs(
            tok_embd=tensor(f, "per_layer_token_embd.weight", (hp.n_vocab, L * E)),
            model_proj=linear(f, "per_layer_model_proj", L * E, d, bias=False),
            norm=norm(f, "per_layer_proj_norm", E, hp.rms_eps), width=E, embd_scale=math.sqrt(E),
            proj_scale=1.0 / math.sqrt(d), input_scale=1.0 / math.sqrt(2.0))
    return desc
