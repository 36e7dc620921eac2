"""Apertus: pre-norm blocks, per-head RMSNorm of queries and keys before NEOX RoPE (llama3 frequency
factors where the file has them), and an MLP without gate: ``down(xielu(up(x)))`` with the per-layer
xIELU parameters ``xielu.alpha_n / alpha_p / beta / eps`` (keys without the architecture prefix;
the constants are alpha_n = beta + softplus(alpha_n), alpha_p = softplus(alpha_p), as in the
original model)."""

from __future__ import annotations

from ..blocks import MLP, Block, ModelDesc
from ..errors import GGUFError
from ..gguf import GGUFFile
from .base import (
    attention,
    decoder,
    linear,
    norm,
    read_hparams,
    register,
    rope_from_meta,
)


def _per_layer_floats(f: GGUFFile, key: str, n: int) -> list[float]:
    import math

    import numpy as np

    v = f.metadata.get(key)  # written without the architecture prefix
    if v is None:
        raise GGUFError(f"{f.path}: metadata key {key!r} is required for this architecture")
    vals = [float(x) for x in np.asarray(v, dtype=np.float64).reshape(-1)] if isinstance(v, (np.ndarray, list)) else [v]
    if len(vals) == 1:
        vals = vals * n
    if len(vals) != n or not all(isinstance(x, float) and math.isfinite(x) for x in vals):
        raise GGUFError(f"{f.path}: metadata {key!r} must hold {n} finite numbers")
    return vals


def _softplus(v: float) -> float:
    import math

    return v if v > 20 else math.log1p(math.exp(v))


@register("apertus")
def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    d, eps, F = hp.n_embd, hp.rms_eps, hp.n_ff
    raw = [_per_layer_floats(f, f"xielu.{k}", hp.n_layer) for k in ("alpha_n", "alpha_p", "beta", "eps")]
    # the file stores the trained parameters; the activation's constants are softplus of them
    params = [(b + _softplus(an), _softplus(ap), b, e) for an, ap, b, e in zip(*raw, strict=True)]
    blocks = []
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        mlp = MLP(act="xielu", up=linear(f, p + "ffn_up", F, d, bias=False), down=linear(f, p + "ffn_down", d, F),
                  act_params=tuple(params[i]))
        blocks.append(Block(attn_norm=norm(f, p + "attn_norm", d, eps), attn=attention(f, i, hp, rope, qk_norm=True),
                            ffn_norm=norm(f, p + "ffn_norm", d, eps), mlp=mlp))
    return decoder(f, hp, blocks)
