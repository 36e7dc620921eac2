"""EXAONE 4.0: norms after attention and after the MLP only, per-head RMSNorm of queries and keys
before NEOX RoPE, SwiGLU. Files with ``attention.sliding_window`` (the 32B) alternate three
sliding-window layers with one global layer (``sliding_window_pattern``, default 4); the global
layers use no RoPE, the local ones ``rope.freq_base_swa`` (default: the global base)."""

from __future__ import annotations

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    meta_float,
    meta_int,
    post_norm_block,
    read_hparams,
    register,
    rope_from_meta,
    swa_pattern,
)


@register("exaone4")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    window = meta_int(f, "attention.sliding_window", 0, lo=0, hi=1 << 24)
    local = swa_pattern(f, hp.n_layer, 4) if window else [False] * hp.n_layer
    rope = rope_from_meta(f, hp, neox=True)
    rope_local = rope_from_meta(f, hp, neox=True, base=meta_float(f, "rope.freq_base_swa", hp.rope_base, lo=1e-3))
    blocks = [post_norm_block(f, i, hp, (rope_local if local[i] else None) if window else rope, qk_norm=True,
                              window=window if local[i] else 0) for i in range(hp.n_layer)]
    return decoder(f, hp, blocks)
