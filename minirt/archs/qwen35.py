"""Qwen3.5 (``qwen35``) and Qwen3.5-MoE (``qwen35moe``): a hybrid of gated delta-net linear-attention
layers (:class:`minirt.blocks.GatedDeltaNet`) and gated grouped-query attention layers, each followed
by a SwiGLU MLP (``qwen35``) or a mixture of experts with a gated shared expert (``qwen35moe``:
softmax router, chosen probabilities renormalised), pre-norm RMSNorm blocks (the pre-FFN norm is the
file's ``post_attention_norm``).

Which layers are recurrent: the file's ``attention.recurrent_layers`` flags, else every layer but each
``full_attention_interval``-th (default 4), as llama.cpp reads them. Attention layers: ``attn_q``
gives each head its query and a sigmoid output gate, per-head q/k RMSNorm, RoPE over the first
``rope.dimension_count`` dimensions of each head (the file's multi-section RoPE reduces to that for
text, where every section has the same position). Delta-net layers: ``attn_qkv`` (the convolution's
input), ``attn_gate`` (the output gate z), ``ssm_beta`` / ``ssm_alpha``, ``ssm_dt.bias``, ``ssm_a``
(−exp(A_log)), ``ssm_conv1d`` (``ssm.conv_kernel`` taps), ``ssm_norm`` and ``ssm_out``; ``ssm.group_count``
key heads and ``ssm.time_step_rank`` value heads of ``ssm.state_size`` (the converter stores value heads
in tiled order: value head j reads key head j mod group_count).

Qwen3-Next (``qwen3next``) has the same layers and MoE: the converter reorders its interleaved
``in_proj_qkvz`` into the same ``attn_qkv`` / ``attn_gate`` but keeps the value heads grouped by key head
(value head j reads key head j // (value heads / key heads)), and its beta / alpha projection is one
``ssm_ba`` with, per key head, the beta rows then the alpha rows of its value heads.

Multi-token prediction layers (``nextn_predict_layers``, stored after the main ones) are not run.
"""

from __future__ import annotations

import numpy as np

from ..blocks import Attention, Block, GatedDeltaNet, ModelDesc
from ..errors import GGUFError
from ..gguf import GGUFFile
from .base import (
    MAX_LAYERS,
    HParams,
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
    vector,
)

MAX_TAPS = 64
MAX_HEADS = 4096
MAX_STATE = 1024  # head size of the delta rule (128 in every released model)


def _recurrent_layers(f: GGUFFile, n_layer: int) -> list[bool]:
    flags = meta_layers(f, "attention.recurrent_layers", n_layer)
    if flags is not None:
        return [bool(x) for x in flags]
    every = meta_int(f, "full_attention_interval", 4, hi=MAX_LAYERS)
    return [(i + 1) % every != 0 for i in range(n_layer)]


def _delta_net(f: GGUFFile, i: int, hp: HParams, grouped: bool = False) -> GatedDeltaNet:
    p, d = f"blk.{i}.", hp.n_embd
    taps = meta_int(f, "ssm.conv_kernel", required=True, lo=2, hi=MAX_TAPS)
    Dk = meta_int(f, "ssm.state_size", required=True, hi=MAX_STATE)
    Hk = meta_int(f, "ssm.group_count", required=True, hi=MAX_HEADS)
    Hv = meta_int(f, "ssm.time_step_rank", required=True, hi=MAX_HEADS)
    inner = meta_int(f, "ssm.inner_size", required=True, hi=MAX_HEADS * MAX_STATE)
    if Hv % Hk or inner % Hv:
        raise GGUFError(f"{f.path}: ssm.time_step_rank {Hv} must be a multiple of ssm.group_count {Hk} "
                        f"and divide ssm.inner_size {inner}")
    Dv = inner // Hv
    conv_dim = 2 * Hk * Dk + Hv * Dv
    w = tensor(f, p + "ssm_conv1d.weight", (conv_dim, taps)).dequantize().reshape(conv_dim, taps)
    a = vector(f, p + "ssm_a", Hv)
    if not np.all(a <= 0):
        raise GGUFError(f"{f.path}: {p}ssm_a must be −exp(A_log) (no positive values)")
    fused_ba = p + "ssm_ba.weight" in f.tensors  # Qwen3-Next: per key head [beta, alpha] rows
    return GatedDeltaNet(qkv_proj=linear(f, p + "attn_qkv", conv_dim, d, bias=False),
                         z_proj=linear(f, p + "attn_gate", Hv * Dv, d, bias=False),
                         beta_proj=None if fused_ba else linear(f, p + "ssm_beta", Hv, d, bias=False),
                         alpha_proj=None if fused_ba else linear(f, p + "ssm_alpha", Hv, d, bias=False),
                         ba_proj=linear(f, p + "ssm_ba", 2 * Hv, d, bias=False) if fused_ba else None,
                         grouped=grouped,
                         dt_bias=vector(f, p + "ssm_dt.bias", Hv), a=a,
                         conv=np.ascontiguousarray(w, dtype=np.float32),
                         norm=norm(f, p + "ssm_norm", Dv, hp.rms_eps),
                         out_proj=linear(f, p + "ssm_out", d, Hv * Dv, bias=False),
                         n_k_heads=Hk, n_v_heads=Hv, head_dim_k=Dk, head_dim_v=Dv)


def _describe(f: GGUFFile, moe: bool, grouped: bool = False) -> ModelDesc:
    hp = read_hparams(f)
    if hp.head_dim_k != hp.head_dim_v:
        raise GGUFError(f"{f.path}: key and value head sizes differ ({hp.head_dim_k}, {hp.head_dim_v})")
    n_main = hp.n_layer - meta_int(f, "nextn_predict_layers", 0, lo=0, hi=hp.n_layer - 1)
    rope = rope_from_meta(f, hp, neox=True)
    H, Hkv, Dk, d, eps = hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.n_embd, hp.rms_eps
    blocks = []
    for i, rec in enumerate(_recurrent_layers(f, hp.n_layer)[:n_main]):
        p = f"blk.{i}."
        if rec:
            mixer: Attention | GatedDeltaNet = _delta_net(f, i, hp, grouped)
        else:  # attn_q is (H · 2·Dk, d): each head's query, then its output gate
            mixer = Attention(n_head=H, n_head_kv=Hkv, head_dim_k=Dk, head_dim_v=Dk,
                              wq=linear(f, p + "attn_q", H * 2 * Dk, d, bias=False),
                              wk=linear(f, p + "attn_k", Hkv * Dk, d, bias=False),
                              wv=linear(f, p + "attn_v", Hkv * Dk, d, bias=False),
                              wo=linear(f, p + "attn_output", d, H * Dk, bias=False), scale=hp.attn_scale,
                              rope=rope, q_norm=norm(f, p + "attn_q_norm", Dk, eps),
                              k_norm=norm(f, p + "attn_k_norm", Dk, eps), out_gate=True)
        mlp = moe_ffn(f, i, hp, norm_topk=True) if moe else gated_mlp(f, i, hp)
        blocks.append(Block(attn_norm=norm(f, p + "attn_norm", d, eps), attn=mixer,
                            ffn_norm=norm(f, p + "post_attention_norm", d, eps), mlp=mlp))
    return decoder(f, hp, blocks)


@register("qwen35")
def describe_qwen35(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _describe(f, moe=False)


@register("qwen35moe")
def describe_qwen35moe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _describe(f, moe=True)


@register("qwen3next")
def describe_qwen3next(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _describe(f, moe=True, grouped=True)
