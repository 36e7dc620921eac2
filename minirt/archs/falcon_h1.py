"""Falcon-H1 (``falcon-h1``: Falcon-H1 0.5B–34B, Falcon-H1R): in every layer, grouped-query attention with
NEOX RoPE and a Mamba-2 mixer (:class:`minirt.blocks.Mamba2`, usually without SSM norm) read the same
RMS-normed input and their outputs are summed into the residual (:class:`minirt.blocks.ParallelMixer`),
then a SwiGLU MLP, pre-norm. The µP multipliers of the released checkpoints (embedding, LM head, MLP,
attention in / out, key, SSM in / out and the per-part z / x / B / C / dt ones) are folded into the weights
by llama.cpp's converter, so the file needs none at run time. The pre-FFN norm is stored as ``ffn_norm``
without the ``.weight`` suffix (the converter's name; a suffixed one is read too).
"""

from __future__ import annotations

from ..blocks import Block, ModelDesc, Norm, ParallelMixer
from ..gguf import GGUFFile
from .base import attention, decoder, gated_mlp, norm, read_hparams, register, rope_from_meta, vector
from .granite_hybrid import mamba2_mixer


@register("falcon-h1")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    d, eps = hp.n_embd, hp.rms_eps
    blocks = []
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        ffn_norm = Norm(vector(f, p + "ffn_norm", d), eps) if p + "ffn_norm" in f.tensors else \
            norm(f, p + "ffn_norm", d, eps)
        blocks.append(Block(attn_norm=norm(f, p + "attn_norm", d, eps),
                            attn=ParallelMixer(attn=attention(f, i, hp, rope), ssm=mamba2_mixer(f, i, hp)),
                            ffn_norm=ffn_norm, mlp=gated_mlp(f, i, hp)))
    return decoder(f, hp, blocks)
