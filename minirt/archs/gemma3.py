"""Gemma 3: embeddings scaled by sqrt(n_embd), per-head RMSNorm of queries and keys, norms after
attention and after the MLP as well as before, GELU-tanh gated MLP, output tied to the embedding.

Layers alternate between sliding-window ("local") and full ("global") attention: every
``sliding_window_pattern``-th layer (default 6, as llama.cpp) is global. Local layers see only the
last ``sliding_window`` positions and use ``rope.freq_base_swa`` (default 10000) unscaled; global ones use
``rope.freq_base`` and the file's RoPE scaling (the 4B / 12B / 27B models ship linear factor 8 for
those layers only). Queries are scaled by 1/sqrt(head_dim) unless ``attention.scale`` says
otherwise (the 27B's query_pre_attn_scalar = n_embd / n_head, written by the converter).
"""

from __future__ import annotations

import math

from ..blocks import ModelDesc
from ..gguf import GGUFFile
from .base import (
    decoder,
    meta_float,
    meta_int,
    read_hparams,
    register,
    rope_from_meta,
    swa_pattern,
)
from .gemma import sandwich_block

ROPE_BASE_LOCAL = 10000.0


@register("gemma3")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    window = meta_int(f, "attention.sliding_window", 0, lo=0, hi=1 << 24)
    local = swa_pattern(f, hp.n_layer, 6) if window else [False] * hp.n_layer
    if not f.metadata.get("gemma3.attention.scale") and hp.n_layer == 62:
        # older 27B files lack attention.scale: query_pre_attn_scalar = n_embd / n_head (as llama.cpp)
        hp.attn_scale = 1.0 / math.sqrt(hp.n_embd / hp.n_head)
    rope_global = rope_from_meta(f, hp, neox=True)
    base_local = meta_float(f, "rope.freq_base_swa", ROPE_BASE_LOCAL, lo=1e-3)
    rope_local = rope_from_meta(f, hp, neox=True, base=base_local, scaled=False)
    blocks = [sandwich_block(f, i, hp, rope_local if local[i] else rope_global, window if local[i] else 0, qk_norm=True)
              for i in range(hp.n_layer)]
    return decoder(f, hp, blocks, embed_scale=math.sqrt(hp.n_embd))
