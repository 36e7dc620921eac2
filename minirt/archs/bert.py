"""Encoders for embeddings and reranking: BERT (also RoBERTa / XLM-RoBERTa files, which the
converter writes as ``bert``), nomic-bert, jina-bert-v3 and ModernBERT. All attend bidirectionally
and have no generation head (their tied "output" is never used for text).

- **bert**: token + absolute position + token-type (type 0) embeddings, LayerNorm; post-norm blocks
  ``x = LN(x + attn(x)); x = LN(x + mlp(x))`` with biased Q/K/V/O projections, an erf-GELU MLP with
  biases. bge-reranker style cross-encoders add the ``cls`` / ``cls.output`` classifier (rank pooling).
- **nomic-bert**: the BERT block with rotary embeddings (NEOX pairs) instead of position
  embeddings, a fused ``attn_qkv`` and a SwiGLU MLP.
- **jina-bert-v3** (jina-embeddings-v3, XLM-RoBERTa with rotary positions): the BERT block (biased
  projections, erf-GELU MLP with biases, one token type) with a fused ``attn_qkv`` and rotary
  embeddings (NEOX pairs, ``rope.freq_base``) instead of position embeddings. Its task adapters are
  LoRA files (``minirt.load(..., lora=...)``, :mod:`minirt.lora`).
- **modern-bert**: pre-norm LayerNorm without biases (layer 0's attention norm is the identity),
  fused QKV, GeGLU MLP (``ffn_up`` holds gate then up), rotary on every layer with
  ``rope.freq_base`` on global layers and ``rope.freq_base_swa`` on local ones; local layers see
  ``|i − j| ≤ sliding_window / 2``; every ``sliding_window_pattern``-th layer from layer 0 is global;
  a final LayerNorm.
"""

from __future__ import annotations

from ..blocks import MLP, Block, Linear, ModelDesc, Norm, Rope
from ..errors import GGUFError
from ..gguf import GGUFFile
from .base import (
    HParams,
    attention,
    decoder,
    linear,
    meta_float,
    meta_int,
    meta_str,
    norm,
    read_hparams,
    register,
    rope_from_meta,
    tensor,
    vector,
)
from .pooling import pooling_from_meta


def _ln_eps(f: GGUFFile) -> float:
    return meta_float(f, "attention.layer_norm_epsilon", 1e-12, hi=1.0)


def _encoder(f: GGUFFile, hp: HParams, blocks: list[Block], *, pos: bool, embd_norm: Norm | None,
             cls_act: str = "tanh") -> ModelDesc:
    """The description around encoder blocks: bidirectional attention, input embeddings, the final
    LayerNorm where the file has one, pooling (CLS when the file does not say)."""
    for b in blocks:
        b.attn.causal = False
    if "output_norm.weight" in f.tensors:
        desc = decoder(f, hp, blocks, output_norm="layer")
    else:
        tok = tensor(f, "token_embd.weight", (hp.n_vocab, hp.n_embd))
        desc = ModelDesc(arch=hp.arch, n_vocab=hp.n_vocab, n_embd=hp.n_embd, n_ctx_train=hp.n_ctx_train,
                         tok_embd=tok, blocks=blocks, output=Linear(tok), output_norm=None)
    if pos:
        t = tensor(f, "position_embd.weight")
        if len(t.shape) != 2 or t.shape[1] != hp.n_embd:
            raise GGUFError(f"{f.path}: tensor 'position_embd.weight' has shape {t.shape}, expected (n, {hp.n_embd})")
        Linear(t)  # its type must be one we can dequantize
        desc.pos_embd = t
        desc.n_ctx_train = min(desc.n_ctx_train, t.shape[0])
    t = f.tensors.get("token_types.weight")
    if t is not None:  # (n_types, d); one type is stored as a vector (d,)
        n_types = 1 if len(t.shape) == 1 else t.shape[0]
        if t.shape[-1] != hp.n_embd or len(t.shape) > 2:
            raise GGUFError(f"{f.path}: tensor 'token_types.weight' has shape {t.shape}, expected (n, {hp.n_embd})")
        desc.type_embd = vector(f, "token_types.weight", n_types * hp.n_embd).reshape(n_types, hp.n_embd)
    desc.embd_norm = embd_norm
    desc.pooling = pooling_from_meta(f, hp, default="cls", cls_act=cls_act)
    return desc


def _post_norm_block(f: GGUFFile, i: int, hp: HParams, rope: Rope | None, act: str, gated: bool) -> Block:
    p, d, eps = f"blk.{i}.", hp.n_embd, _ln_eps(f)
    attn = attention(f, i, hp, rope, bias=None, out_bias=None)
    if gated:
        down = linear(f, p + "ffn_down", d, hp.n_ff, bias=None)
        if p + "ffn_gate.weight" in f.tensors:
            gate = linear(f, p + "ffn_gate", hp.n_ff, d, bias=None)
            up = linear(f, p + "ffn_up", hp.n_ff, d, bias=None)
        else:
            gate, up = linear(f, p + "ffn_up", 2 * hp.n_ff, d, bias=None).split([hp.n_ff, hp.n_ff], ["gate", "up"])
        mlp = MLP(act=act, gate=gate, up=up, down=down)
    else:
        mlp = MLP(act=act, up=linear(f, p + "ffn_up", hp.n_ff, d, bias=None),
                  down=linear(f, p + "ffn_down", d, hp.n_ff, bias=None))
    return Block(attn=attn, mlp=mlp, norm_residual=True,
                 post_attn_norm=norm(f, p + "attn_output_norm", d, eps, kind="layer"),
                 post_ffn_norm=norm(f, p + "layer_output_norm", d, eps, kind="layer"))


def _embd_norm(f: GGUFFile, hp: HParams) -> Norm | None:
    return norm(f, "token_embd_norm", hp.n_embd, _ln_eps(f), kind="layer", required=False)


@register("bert")
def describe_bert(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    blocks = [_post_norm_block(f, i, hp, None, "gelu", gated=False) for i in range(hp.n_layer)]
    return _encoder(f, hp, blocks, pos=True, embd_norm=_embd_norm(f, hp))


def _rotary_encoder(f: GGUFFile, act: str, gated: bool) -> ModelDesc:
    """BERT blocks with rotary positions (NEOX pairs) instead of position embeddings."""
    hp = read_hparams(f)
    rope = rope_from_meta(f, hp, neox=True)
    blocks = [_post_norm_block(f, i, hp, rope, act, gated=gated) for i in range(hp.n_layer)]
    return _encoder(f, hp, blocks, pos=False, embd_norm=_embd_norm(f, hp))


@register("nomic-bert")
def describe_nomic_bert(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _rotary_encoder(f, "silu", gated=True)


@register("jina-bert-v3")
def describe_jina_bert_v3(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    return _rotary_encoder(f, "gelu", gated=False)


@register("modern-bert")
def describe_modern_bert(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    hp = read_hparams(f)
    eps = _ln_eps(f)
    window = meta_int(f, "attention.sliding_window", 0, lo=0, hi=1 << 24)
    period = meta_int(f, "attention.sliding_window_pattern", 3, lo=1, hi=1 << 16)
    act = {"gelu": "gelu", "silu": "silu", "swiglu": "silu"}.get(meta_str(f, "hidden_act") or "gelu", "gelu")
    rope_global = rope_from_meta(f, hp, neox=True)
    rope_local = rope_from_meta(f, hp, neox=True, base=meta_float(f, "rope.freq_base_swa", 10000.0, lo=1e-3),
                                scaled=False)
    blocks = []
    d = hp.n_embd
    for i in range(hp.n_layer):
        local = bool(window) and i % period != 0
        p = f"blk.{i}."
        an = norm(f, p + "attn_norm", d, eps, kind="layer", required=i != 0)
        a = attention(f, i, hp, rope_local if local else rope_global, window=window if local else 0, bias=False,
                      out_bias=False)
        down = linear(f, p + "ffn_down", d, hp.n_ff, bias=False)
        gate, up = linear(f, p + "ffn_up", 2 * hp.n_ff, d, bias=False).split([hp.n_ff, hp.n_ff], ["gate", "up"])
        blocks.append(Block(attn_norm=an, attn=a, ffn_norm=norm(f, p + "ffn_norm", d, eps, kind="layer"),
                            mlp=MLP(act=act, gate=gate, up=up, down=down)))
    return _encoder(f, hp, blocks, pos=False, embd_norm=norm(f, "token_embd_norm", d, eps, kind="layer"),
                    cls_act="gelu")
