"""Mamba-2 (``mamba2``: state-spaces' Mamba-2 130M–2.7B, Mamba-Codestral 7B): every layer is
``x = x + mamba2_mixer(rmsnorm(x))`` (:class:`minirt.blocks.Mamba2`: in-projection, causal depthwise
convolution, selective scan with a per-head scalar decay, gated grouped RMSNorm, out-projection), no
attention and no feed-forward; the per-sequence state (convolution rows and scan state) lives beside
the (empty) KV cache like the hybrids' Mamba-2 layers."""

from __future__ import annotations

from ..blocks import Block, ModelDesc
from ..gguf import GGUFFile
from .base import decoder, norm, read_hparams, register
from .granite_hybrid import mamba2_mixer


@register("mamba2")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f, attention=False)
    blocks = [Block(attn_norm=norm(f, f"blk.{i}.attn_norm", hp.n_embd, hp.rms_eps), attn=mamba2_mixer(f, i, hp),
                    mlp=None) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
