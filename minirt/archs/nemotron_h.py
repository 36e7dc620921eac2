"""Nemotron-H (``nemotron_h``: Nemotron-H 8B / 47B, Nemotron Nano 9B / 12B v2) and its mixture of experts
(``nemotron_h_moe``: Nemotron 3 Nano 30B-A3B). Every layer of the file is one pre-norm residual step
``x = x + f(rmsnorm(x))`` whose f is one of:

- a Mamba-2 mixer (:class:`minirt.blocks.Mamba2`; ``attention.head_count_kv`` and ``feed_forward_length`` both
  0 for the layer, as llama.cpp reads them);
- grouped-query attention without positions (``feed_forward_length`` 0, ``head_count_kv`` > 0);
- a feed-forward (``feed_forward_length`` > 0): ``ffn_down(relu(ffn_up(x))²)`` without gate, or, in
  ``nemotron_h_moe``, experts of that form with a sigmoid router, selection bias ``exp_probs_b``,
  renormalised (``expert_weights_norm``) and scaled (``expert_weights_scale``) top-k weights, plus an
  always-on squared-ReLU shared expert.

A mixer layer and the feed-forward layer after it make one :class:`minirt.blocks.Block` (the same
computation: attention-then-MLP blocks are two such steps); a mixer followed by another mixer is a block
without feed-forward. A feed-forward layer that follows another feed-forward is refused (no released model
has one). Multi-token-prediction layers (``nextn_predict_layers``, after the main ones) are not run; Nemotron
3 Super's experts work in a latent width (``ffn_latent_down`` / ``ffn_latent_up``, :class:`minirt.blocks.MoE`).
"""

from __future__ import annotations

import dataclasses

from ..blocks import MLP, Block, ModelDesc
from ..errors import GGUFError, UnsupportedArchitectureError
from ..gguf import GGUFFile
from .base import (
    HParams,
    attention,
    decoder,
    linear,
    meta_float,
    meta_int,
    meta_layers,
    moe_ffn,
    norm,
    read_hparams,
    register,
)
from .granite_hybrid import mamba2_mixer


def _ffn(f: GGUFFile, i: int, hp: HParams, n_ff: int, moe: bool) -> MLP:
    p, d = f"blk.{i}.", hp.n_embd
    if not moe:
        return MLP(act="relu2", gate=None, up=linear(f, p + "ffn_up", n_ff, d), down=linear(f, p + "ffn_down", d, n_ff))
    return moe_ffn(f, i, hp, n_ff=n_ff, gating="sigmoid", act="relu2", shared_act="relu2")


@register("nemotron_h", "nemotron_h_moe")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f, varying=("attention.head_count_kv", "feed_forward_length"))
    eps = meta_float(f, "attention.layer_norm_rms_epsilon", 0.0, hi=1.0) or \
        meta_float(f, "attention.layer_norm_epsilon", hp.rms_eps, hi=1.0)  # the converter writes the latter
    hp = dataclasses.replace(hp, rms_eps=eps)
    n_main = hp.n_layer - meta_int(f, "nextn_predict_layers", 0, lo=0, hi=hp.n_layer - 1)
    heads_kv = (meta_layers(f, "attention.head_count_kv", hp.n_layer) or [hp.n_head_kv] * hp.n_layer)[:n_main]
    n_ffs = (meta_layers(f, "feed_forward_length", hp.n_layer) or [hp.n_ff] * hp.n_layer)[:n_main]
    moe = f.architecture == "nemotron_h_moe"
    d = hp.n_embd
    blocks: list[Block] = []
    for i, (hk, ff) in enumerate(zip(heads_kv, n_ffs, strict=True)):
        p = f"blk.{i}."
        if ff:
            b = blocks[-1] if blocks and blocks[-1].mlp is None and blocks[-1].ffn_norm is None else None
            if b is None:
                raise UnsupportedArchitectureError(f"layer {i}: a feed-forward layer that does not follow a mixer "
                                                   "layer is not supported")
            b.ffn_norm, b.mlp = norm(f, p + "attn_norm", d, eps), _ffn(f, i, hp, ff, moe)
            continue
        if hk == 0:
            mixer = mamba2_mixer(f, i, hp)
        else:
            if hp.n_head % hk:
                raise GGUFError(f"{f.path}: layer {i}: head_count {hp.n_head} is not a multiple of head_count_kv {hk}")
            mixer = attention(f, i, dataclasses.replace(hp, n_head_kv=hk), None)
        blocks.append(Block(attn_norm=norm(f, p + "attn_norm", d, eps), attn=mixer, mlp=None))
    if not blocks:
        raise GGUFError(f"{f.path}: no layers")
    return decoder(f, hp, blocks)
