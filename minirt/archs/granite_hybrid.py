"""Granite 4.0-H (``granitehybrid``; also Bamba, which the converter writes under the same name): a hybrid
of Mamba-2 layers (:class:`minirt.blocks.Mamba2`) and grouped-query attention layers, pre-norm RMSNorm
blocks, each followed by a mixture of experts with a shared expert (softmax router, top
``expert_used_count`` renormalised, the shared expert ``ffn_*_shexp`` always on; Granite 4.0-H-Tiny /
Small) or by a dense SwiGLU MLP where the file has no experts (H-Micro, H-1B), and Granite's four
multipliers (embedding, residual, attention and logit scale, see :mod:`.granite`).

A layer is a Mamba-2 layer when the file's ``attention.head_count_kv`` is 0 for it. Attention layers use
RoPE only where ``rope.scaling.finetuned`` is true (llama.cpp's switch; the converter writes false for
Granite 4.0-H, which has no positions in its attention, and true for Bamba).

Mamba-2 layers (``ssm.*`` metadata, llama.cpp's names): ``ssm_in`` gives z (``ssm.inner_size``), the
convolution's input xBC (inner + 2 · ``ssm.group_count`` · ``ssm.state_size``) and dt of
``ssm.time_step_rank`` heads; ``ssm_conv1d`` (``ssm.conv_kernel`` taps, bias), ``ssm_dt.bias``,
``ssm_a`` (−exp(A_log)), ``ssm_d``, ``ssm_norm`` (gated RMSNorm per group) and ``ssm_out``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..blocks import Block, Mamba2, ModelDesc, Norm
from ..errors import GGUFError
from ..gguf import GGUFFile
from .base import (
    HParams,
    attention,
    decoder,
    gated_mlp,
    linear,
    meta_bool,
    meta_float,
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
MAX_STATE = 4096  # state size N (128 in Granite 4.0-H)


def mamba2_mixer(f: GGUFFile, i: int, hp: HParams) -> Mamba2:
    """Block i's Mamba-2 mixer from the file's ``ssm_*`` tensors, every size checked against the metadata
    (``ssm_norm`` where the file has it)."""
    p, d = f"blk.{i}.", hp.n_embd
    taps = meta_int(f, "ssm.conv_kernel", required=True, lo=2, hi=MAX_TAPS)
    N = meta_int(f, "ssm.state_size", required=True, hi=MAX_STATE)
    G = meta_int(f, "ssm.group_count", required=True, hi=MAX_HEADS)
    H = meta_int(f, "ssm.time_step_rank", required=True, hi=MAX_HEADS)
    inner = meta_int(f, "ssm.inner_size", required=True, hi=MAX_HEADS * MAX_STATE)
    if inner % H or H % G:
        raise GGUFError(f"{f.path}: ssm.time_step_rank {H} must divide ssm.inner_size {inner} and be a multiple "
                        f"of ssm.group_count {G}")
    conv_dim = inner + 2 * G * N
    w = tensor(f, p + "ssm_conv1d.weight", (conv_dim, taps)).dequantize().reshape(conv_dim, taps)
    a = vector(f, p + "ssm_a", H)
    if not np.all(a <= 0):
        raise GGUFError(f"{f.path}: {p}ssm_a must be −exp(A_log) (no positive values)")
    bias = vector(f, p + "ssm_conv1d.bias", conv_dim) if p + "ssm_conv1d.bias" in f.tensors else None
    return Mamba2(in_proj=linear(f, p + "ssm_in", 2 * inner + 2 * G * N + H, d, bias=False),
                  conv=np.ascontiguousarray(w, dtype=np.float32), conv_bias=bias,
                  dt_bias=vector(f, p + "ssm_dt.bias", H), a=a, d_skip=vector(f, p + "ssm_d", H),
                  norm=Norm(vector(f, p + "ssm_norm.weight", inner), hp.rms_eps) if p + "ssm_norm.weight" in f.tensors
                  else None,
                  out_proj=linear(f, p + "ssm_out", d, inner, bias=False),
                  n_head=H, head_dim=inner // H, d_state=N, n_group=G)


@register("granitehybrid")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f, varying=("attention.head_count_kv",))
    d, eps = hp.n_embd, hp.rms_eps
    heads_kv = meta_layers(f, "attention.head_count_kv", hp.n_layer) or [hp.n_head_kv] * hp.n_layer
    rope = rope_from_meta(f, hp, neox=False) if meta_bool(f, "rope.scaling.finetuned", True) else None
    moe = meta_int(f, "expert_count", 0, lo=0) > 0
    blocks = []
    for i, hk in enumerate(heads_kv):
        p = f"blk.{i}."
        if hk == 0:
            mixer = mamba2_mixer(f, i, hp)
        else:
            if hp.n_head % hk:
                raise GGUFError(f"{f.path}: layer {i}: head_count {hp.n_head} is not a multiple of head_count_kv {hk}")
            mixer = attention(f, i, dataclasses.replace(hp, n_head_kv=hk), rope)
        mlp = moe_ffn(f, i, hp, norm_topk=True) if moe else gated_mlp(f, i, hp)
        blocks.append(Block(attn_norm=norm(f, p + "attn_norm", d, eps), attn=mixer,
                            ffn_norm=norm(f, p + "ffn_norm", d, eps), mlp=mlp,
                            residual_scale=meta_float(f, "residual_scale", 1.0, hi=1e6)))
    return decoder(f, hp, blocks, embed_scale=meta_float(f, "embedding_scale", 1.0, hi=1e6),
                   logit_scale=1.0 / meta_float(f, "logit_scale", 1.0, lo=1e-6, hi=1e6))
