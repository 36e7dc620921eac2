"""What architecture files are written with: checked metadata readers, tensor loaders, builders of
the common parts of a description (attention, gated MLP, RoPE from metadata, the decoder around the
blocks), and the registry that maps ``general.architecture`` to an architecture's ``describe``.

An architecture file turns a GGUF into a :class:`~minirt.blocks.ModelDesc` and says nothing about
computing it. Hyperparameters come from metadata only, never from tensor names, sizes or layer counts.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..blocks import MLP, Attention, Block, Linear, ModelDesc, MoE, Norm, Rope, Router
from ..errors import GGUFError, UnsupportedArchitectureError
from ..forward import Config, Segment, Transformer  # noqa: F401  (Segment re-exported: a batch's sequences)
from ..gguf import GGUFFile, GGUFTensor

log = logging.getLogger(__name__)

# Sanity bounds: far beyond any real model, small enough that nothing sized by them can exhaust memory.
MAX_LAYERS = 1024
MAX_DIM = 1 << 20


# ----------------------------------------------------------------------------------------------
# metadata
# ----------------------------------------------------------------------------------------------
def _meta(f: GGUFFile, key: str, default: Any = None, required: bool = False) -> Any:
    v = f.metadata.get(f"{f.architecture}.{key}", default)
    if required and v is None:
        raise GGUFError(f"{f.path}: metadata key '{f.architecture}.{key}' is required for this architecture")
    return v


def _show(v: Any) -> str:
    r = repr(v.tolist() if isinstance(v, np.ndarray) else v)
    return f"{type(v).__name__} {r[:60]}"


def meta_int(f: GGUFFile, key: str, default: Any = None, required: bool = False, lo: int = 1,
             hi: int = MAX_DIM) -> int:
    """An integer hyperparameter ``<arch>.<key>``, type- and range-checked (GGUFError naming the key)."""
    v = _meta(f, key, default, required)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be an integer, got {_show(v)}")
    if not lo <= int(v) <= hi:
        raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' = {int(v)} is out of range [{lo}, {hi}]")
    return int(v)


def meta_float(f: GGUFFile, key: str, default: Any = None, required: bool = False, lo: float = 0.0,
               hi: float = 1e30) -> float:
    """A finite float hyperparameter ``<arch>.<key>`` within [lo, hi] (GGUFError naming the key)."""
    v = _meta(f, key, default, required)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be a number, got {_show(v)}")
    v = float(v)
    if not (math.isfinite(v) and lo <= v <= hi):
        raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' = {v} is out of range [{lo}, {hi}]")
    return v


def meta_str(f: GGUFFile, key: str, default: str | None = None) -> str | None:
    v = _meta(f, key, default)
    if v is not None and not isinstance(v, str):
        raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be a string, got {_show(v)}")
    return v


def meta_bool(f: GGUFFile, key: str, default: bool) -> bool:
    """A boolean hyperparameter ``<arch>.<key>`` (GGUFError naming the key for another type)."""
    v = _meta(f, key, default)
    if not isinstance(v, (bool, np.bool_)):
        raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be a boolean, got {_show(v)}")
    return bool(v)


def meta_layers(f: GGUFFile, key: str, n_layer: int, default: Any = None) -> list[int] | None:
    """A per-layer integer list ``<arch>.<key>`` (one value is repeated for every layer); None if absent."""
    v = _meta(f, key, default)
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.size != n_layer or v.dtype.kind not in "biu":
            raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must hold {n_layer} integers, got {_show(v)}")
        return [int(x) for x in v]
    if isinstance(v, (bool, np.bool_, int, np.integer)):
        return [int(v)] * n_layer
    raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be an integer or {n_layer} integers, "
                    f"got {_show(v)}")


def _per_layer(f: GGUFFile, key: str, n_layer: int, default: Any = None, required: bool = False,
               varying: bool = False) -> int:
    """A head count or width; some GGUFs store one per layer, which must then be uniform (``varying``:
    may differ, the largest is returned; the architecture reads each layer's with :func:`meta_layers`)."""
    v = _meta(f, key, default, required)
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.size != n_layer or v.dtype.kind not in "iu":
            raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be an integer or {n_layer} integers, "
                            f"got {_show(v)}")
        if not varying and len(set(v.tolist())) != 1:
            raise UnsupportedArchitectureError(
                f"per-layer {key} {v.tolist()[:8]}... is not supported (must be uniform)")
        v = int(v.max(initial=0))
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 1 <= int(v) <= MAX_DIM:
        raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be an integer in [1, {MAX_DIM}], "
                        f"got {_show(v)}")
    return int(v)


@dataclass
class HParams(Config):
    """The hyperparameters every decoder has, read and checked once (the :class:`Config` summary plus
    what the description builders need)."""

    rms_eps: float
    rope_dim: int
    rope_base: float
    attn_scale: float  # multiplier of q·k (1/sqrt(head_dim_k) unless the file says otherwise)
    attn_softcap: float
    final_softcap: float


def read_hparams(f: GGUFFile, varying: tuple[str, ...] = (), attention: bool = True) -> HParams:
    """Common hyperparameters; every value type- and range-checked (GGUFError naming the key, never a
    stray ValueError or an allocation sized by a corrupt count). ``varying``: the keys among
    ``attention.head_count_kv`` and ``feed_forward_length`` that the architecture allows per layer
    (their largest value is given here). ``attention=False``: a model without attention or MLP layers
    (pure Mamba-2, whose converter writes head count and feed-forward length 0): those keys are not read,
    one nominal head of n_embd and n_ff 0 stand in."""
    n_layer = meta_int(f, "block_count", required=True, hi=MAX_LAYERS)
    n_embd = meta_int(f, "embedding_length", required=True)
    if attention:
        n_head = _per_layer(f, "attention.head_count", n_layer, required=True)
        n_head_kv = _per_layer(f, "attention.head_count_kv", n_layer, default=n_head,
                               varying="attention.head_count_kv" in varying)
        n_ff = _per_layer(f, "feed_forward_length", n_layer, required=True, varying="feed_forward_length" in varying)
    else:
        n_head = n_head_kv = 1
        n_ff = 0
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    head_dim_k = meta_int(f, "attention.key_length", max(1, n_embd // n_head))
    head_dim_v = meta_int(f, "attention.value_length", max(1, n_embd // n_head))
    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' is missing")
    if len(emb.shape) != 2 or emb.shape[1] != n_embd:
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' has shape {emb.shape}, expected (n_vocab, {n_embd})")
    rope_dim = meta_int(f, "rope.dimension_count", head_dim_k)
    if rope_dim > head_dim_k or rope_dim % 2:
        raise GGUFError(f"{f.path}: rope.dimension_count {rope_dim} invalid for head size {head_dim_k}")
    scale = meta_float(f, "attention.scale", 0.0, hi=1e6)
    return HParams(
        arch=f.architecture or "?", n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        head_dim_k=head_dim_k, head_dim_v=head_dim_v, n_vocab=emb.shape[0],
        n_ctx_train=meta_int(f, "context_length", 2048, hi=1 << 24),
        rms_eps=meta_float(f, "attention.layer_norm_rms_epsilon", 1e-5, hi=1.0),
        rope_dim=rope_dim, rope_base=meta_float(f, "rope.freq_base", 10000.0, lo=1e-3),
        attn_scale=scale or 1.0 / math.sqrt(head_dim_k),
        attn_softcap=meta_float(f, "attn_logit_softcapping", 0.0, hi=1e6),
        final_softcap=meta_float(f, "final_logit_softcapping", 0.0, hi=1e6),
    )


def rope_from_meta(f: GGUFFile, hp: HParams, neox: bool, base: float | None = None, scaled: bool = True,
                   dim: int | None = None, longrope: bool = False) -> Rope:
    """RoPE as the file's ``rope.*`` metadata describes it (linear, llama3 frequency factors, YaRN).

    ``base``: another base (e.g. Gemma 3's local layers); ``scaled=False``: ignore the scaling
    (layers the model applies it to only partly); ``longrope``: the caller sets LongRoPE's factors
    itself (a scaling type "longrope" is refused otherwise)."""
    r = Rope(dim=hp.rope_dim if dim is None else dim, base=hp.rope_base if base is None else base, neox=neox)
    if not scaled:
        return r
    kind = meta_str(f, "rope.scaling.type")
    factor = meta_float(f, "rope.scaling.factor", 0.0, hi=1e6)
    if kind in (None, "none") and factor and factor != 1.0:
        kind = "linear"  # older GGUFs store only the factor
    if kind in ("linear", "yarn") and factor:
        r.freq_scale = 1.0 / factor
    if kind == "yarn":
        r.ext_factor = meta_float(f, "rope.scaling.yarn_ext_factor", 1.0, lo=-1.0, hi=1e3) if factor > 1 else 0.0
        r.attn_factor = meta_float(f, "rope.scaling.attn_factor", 1.0, hi=1e3)
        r.beta_fast = meta_float(f, "rope.scaling.yarn_beta_fast", 32.0, hi=1e6)
        r.beta_slow = meta_float(f, "rope.scaling.yarn_beta_slow", 1.0, hi=1e6)
        r.n_ctx_orig = meta_int(f, "rope.scaling.original_context_length", hp.n_ctx_train, hi=1 << 24)
    elif kind not in (None, "none", "linear") and not (kind == "longrope" and longrope):
        raise UnsupportedArchitectureError(f"RoPE scaling type {kind!r} is not supported "
                                           "(supported: none, linear, yarn, llama3 frequency factors)")
    rf = f.tensors.get("rope_freqs.weight")
    if rf is not None:
        r.factors = rope_factors(f, rf, r.dim)
    return r


def rope_factors(f: GGUFFile, t: GGUFTensor, dim: int) -> np.ndarray:
    """Per-frequency divisors (dim/2,) from a tensor, checked finite and positive."""
    ff = t.dequantize().reshape(-1)
    if ff.size != dim // 2:
        raise GGUFError(f"{f.path}: {t.name} has {ff.size} entries, expected {dim // 2}")
    if not np.all(np.isfinite(ff)) or np.any(ff <= 0):
        raise GGUFError(f"{f.path}: {t.name} must hold finite positive factors")
    return ff.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------
def tensor(f: GGUFFile, name: str, shape: tuple[int, ...] | None = None) -> GGUFTensor:
    """A required tensor, optionally checked against an expected numpy shape."""
    t = f.tensors.get(name)
    if t is None:
        raise GGUFError(f"{f.path}: tensor {name!r} is missing")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise GGUFError(f"{f.path}: tensor {name!r} has shape {t.shape}, expected {shape}")
    return t


def vector(f: GGUFFile, name: str, size: int) -> np.ndarray:
    """A 1-D float32 weight (norm gains, biases) checked against its expected length."""
    from ..errors import UnsupportedQuantError

    t = tensor(f, name)
    try:
        v = t.dequantize().reshape(-1)
    except UnsupportedQuantError as e:
        raise UnsupportedQuantError(f"tensor {name!r}: {e}") from None
    if v.size != size:
        raise GGUFError(f"{f.path}: tensor {name!r} has {v.size} elements, expected {size}")
    return np.ascontiguousarray(v, dtype=np.float32)


def linear(f: GGUFFile, name: str, out_f: int, in_f: int, bias: bool | None = None) -> Linear:
    """Linear layer ``name.weight`` (+ ``name.bias``: True = required, None = if present, False = never)."""
    w = tensor(f, name + ".weight", (out_f, in_f))
    b = f.tensors.get(name + ".bias")
    if bias is True and b is None:
        raise GGUFError(f"{f.path}: tensor {name + '.bias'!r} is missing")
    return Linear(w, b if bias is not False else None)


def norm(f: GGUFFile, name: str, size: int, eps: float, kind: str = "rms", required: bool = True) -> Norm | None:
    """``name.weight`` (and ``name.bias`` for LayerNorm, if present) as a Norm; None when absent and
    not required."""
    if name + ".weight" not in f.tensors and not required:
        return None
    bias = vector(f, name + ".bias", size) if kind == "layer" and name + ".bias" in f.tensors else None
    return Norm(vector(f, name + ".weight", size), eps, kind, bias)


# ----------------------------------------------------------------------------------------------
# common parts of a description
# ----------------------------------------------------------------------------------------------
def attention(f: GGUFFile, i: int, hp: HParams, rope: Rope | None, *, qk_norm: bool | None = False,
              qk_norm_per_head: bool = True, window: int = 0, bias: bool | None = None,
              out_bias: bool | None = None, scale: float | None = None) -> Attention:
    """Self-attention of block i from ``attn_q/k/v`` or a fused ``attn_qkv`` (split into row views),
    ``attn_output``; q/k norms ``attn_q_norm``/``attn_k_norm`` (``qk_norm`` None: if present)."""
    p = f"blk.{i}."
    H, Hkv, Dk, Dv, d = hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v, hp.n_embd
    if p + "attn_qkv.weight" in f.tensors:
        qkv = linear(f, p + "attn_qkv", H * Dk + Hkv * (Dk + Dv), d, bias=bias)
        wq, wk, wv = qkv.split([H * Dk, Hkv * Dk, Hkv * Dv], ["q", "k", "v"])
    else:
        wq = linear(f, p + "attn_q", H * Dk, d, bias=bias)
        wk = linear(f, p + "attn_k", Hkv * Dk, d, bias=bias)
        wv = linear(f, p + "attn_v", Hkv * Dv, d, bias=bias)
    a = Attention(n_head=H, n_head_kv=Hkv, head_dim_k=Dk, head_dim_v=Dv, wq=wq, wk=wk, wv=wv,
                  wo=linear(f, p + "attn_output", d, H * Dv, bias=out_bias),
                  scale=hp.attn_scale if scale is None else scale,
                  rope=rope, qk_norm_per_head=qk_norm_per_head, softcap=hp.attn_softcap, window=window)
    if qk_norm is not False:
        required = qk_norm is True
        nq, nk = (Dk, Dk) if qk_norm_per_head else (H * Dk, Hkv * Dk)
        a.q_norm = norm(f, p + "attn_q_norm", nq, hp.rms_eps, required=required)
        a.k_norm = norm(f, p + "attn_k_norm", nk, hp.rms_eps, required=required)
    return a


def gated_mlp(f: GGUFFile, i: int, hp: HParams, act: str = "silu") -> MLP:
    """``ffn_down(act(ffn_gate(x)) · ffn_up(x))``; a fused gate+up ``ffn_up`` (2·n_ff rows, no
    ``ffn_gate``) is split into row views."""
    p = f"blk.{i}."
    d, F = hp.n_embd, hp.n_ff
    down = linear(f, p + "ffn_down", d, F, bias=None)
    if p + "ffn_gate.weight" not in f.tensors:
        gate, up = linear(f, p + "ffn_up", 2 * F, d, bias=False).split([F, F], ["gate", "up"])
    else:
        gate, up = linear(f, p + "ffn_gate", F, d, bias=False), linear(f, p + "ffn_up", F, d, bias=False)
    return MLP(act=act, gate=gate, up=up, down=down)


MAX_EXPERTS = 4096
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # GGUF expert_gating_func values (gguf.ExpertGatingFuncType)


def _expert_linear(f: GGUFFile, name: str, shape: tuple[int, int, int]) -> Linear:
    """A 3-D expert tensor ``name.weight`` (n_expert, rows, cols) with its ``name.bias`` (n_expert, rows) if present."""
    w = tensor(f, name + ".weight", shape)
    b = f.tensors.get(name + ".bias")
    if b is not None and tuple(b.shape) != shape[:2]:
        raise GGUFError(f"{f.path}: tensor {name + '.bias'!r} has shape {b.shape}, expected {shape[:2]}")
    return Linear(w, b)


def moe_ffn(f: GGUFFile, i: int, hp: HParams, *, n_ff: int | None = None, norm_topk: bool = False,
            gating: str | None = None, act: str = "silu", act_params: tuple[float, ...] = (),
            shared_ff: int | None = None, shared_act: str = "silu") -> MoE:
    """The mixture-of-experts feed-forward of block i from ``expert_count`` / ``expert_used_count``,
    the router ``ffn_gate_inp`` (+ bias), the experts ``ffn_{gate,up,down}_exps`` (or a fused
    ``ffn_gate_up_exps``, gate rows first in each expert) with their biases where present, the
    selection bias ``exp_probs_b`` where present and the shared expert ``ffn_*_shexp`` (gated by
    ``ffn_gate_inp_shexp`` where present).

    Arguments are the architecture's defaults, each overridden by the file's metadata where it has
    the key: ``n_ff`` the expert width (``expert_feed_forward_length``; default the file's
    ``feed_forward_length``), ``norm_topk`` (``expert_weights_norm``), ``gating``
    (``expert_gating_func``; default softmax), scale (``expert_weights_scale``; 0 or absent: 1),
    ``shared_ff`` (``expert_shared_feed_forward_length``; default ``feed_forward_length``); ``shared_act`` the
    shared expert's activation. Latent experts (``ffn_latent_down`` / ``ffn_latent_up``, Nemotron 3 Super)
    read and write ``moe_latent_size`` features instead of n_embd."""
    p, d = f"blk.{i}.", hp.n_embd
    latent = p + "ffn_latent_down.weight" in f.tensors
    de = meta_int(f, "moe_latent_size", required=True, hi=d) if latent else d  # the experts' input width
    E = meta_int(f, "expert_count", required=True, hi=MAX_EXPERTS)
    k = meta_int(f, "expert_used_count", required=True, hi=E)
    F = meta_int(f, "expert_feed_forward_length", n_ff if n_ff is not None else hp.n_ff)
    gf = _meta(f, "expert_gating_func")
    if gf is not None:
        g = meta_int(f, "expert_gating_func", lo=0, hi=16)
        if g not in GATING_FUNCS:
            raise UnsupportedArchitectureError(f"expert gating function {g} is not supported "
                                               f"(supported: {', '.join(f'{k} {v}' for k, v in GATING_FUNCS.items())})")
        gating = gating if gating == "softmax_topk" else GATING_FUNCS[g]
    if meta_int(f, "expert_group_count", 1, lo=0, hi=MAX_EXPERTS) > 1:
        raise UnsupportedArchitectureError("expert groups (expert_group_count > 1) are not supported")
    scale = meta_float(f, "expert_weights_scale", 0.0, hi=1e6) or 1.0
    gate_in = f.tensors.get(p + "ffn_gate_inp.bias")
    router = Router(gate=Linear(tensor(f, p + "ffn_gate_inp.weight", (E, d)), gate_in), n_used=k,
                    gating=gating or "softmax", norm_topk=meta_bool(f, "expert_weights_norm", norm_topk), scale=scale)
    if p + "exp_probs_b.bias" in f.tensors:
        router.selection_bias = vector(f, p + "exp_probs_b.bias", E)
    if p + "ffn_gate_up_exps.weight" in f.tensors:
        gate, up = [], []
        for lin in _expert_linear(f, p + "ffn_gate_up_exps", (E, 2 * F, de)).experts():
            g_e, u_e = lin.split([F, F], ["gate", "up"])
            gate.append(g_e)
            up.append(u_e)
    else:
        up = _expert_linear(f, p + "ffn_up_exps", (E, F, de)).experts()
        gate = (_expert_linear(f, p + "ffn_gate_exps", (E, F, de)).experts()
                if p + "ffn_gate_exps.weight" in f.tensors else None)
    down = _expert_linear(f, p + "ffn_down_exps", (E, de, F)).experts()
    m = MoE(router=router, act=act, up=up, down=down, gate=gate, act_params=act_params)
    if latent:
        m.latent_down = linear(f, p + "ffn_latent_down", de, d, bias=False)
        m.latent_up = linear(f, p + "ffn_latent_up", d, de, bias=False)
    if p + "ffn_up_shexp.weight" in f.tensors:
        Fs = meta_int(f, "expert_shared_feed_forward_length", shared_ff if shared_ff is not None else hp.n_ff)
        sg = linear(f, p + "ffn_gate_shexp", Fs, d, bias=False) if p + "ffn_gate_shexp.weight" in f.tensors else None
        m.shared = MLP(act=shared_act, gate=sg, up=linear(f, p + "ffn_up_shexp", Fs, d, bias=False),
                       down=linear(f, p + "ffn_down_shexp", d, Fs, bias=False))
        if p + "ffn_gate_inp_shexp.weight" in f.tensors:
            t = tensor(f, p + "ffn_gate_inp_shexp.weight")
            if tuple(t.shape) not in ((d,), (1, d)):
                raise GGUFError(f"{f.path}: tensor {t.name!r} has shape {t.shape}, expected ({d},)")
            m.shared_gate = Linear(dataclasses.replace(t, shape=(1, d)))
    return m


def moe_block(f: GGUFFile, i: int, hp: HParams, rope: Rope | None, *, ffn_norm: str = "ffn_norm",
              moe: dict[str, Any] | None = None, **attn: Any) -> Block:
    """:func:`pre_norm_block` with the MoE feed-forward of :func:`moe_ffn` (keyword arguments
    ``moe``), or its dense gated MLP for the first ``leading_dense_block_count`` layers."""
    b = pre_norm_block(f, i, hp, rope, ffn_norm=ffn_norm, mlp=False, **attn)
    dense = meta_int(f, "leading_dense_block_count", 0, lo=0, hi=MAX_LAYERS)
    b.mlp = gated_mlp(f, i, hp) if i < dense else moe_ffn(f, i, hp, **(moe or {}))
    return b


def pre_norm_block(f: GGUFFile, i: int, hp: HParams, rope: Rope | None, *, act: str = "silu",
                   ffn_norm: str = "ffn_norm", mlp: bool = True, **attn: Any) -> Block:
    """The common block: RMSNorm ``attn_norm`` → attention → residual, RMSNorm ``ffn_norm`` (the
    name the file uses) → gated MLP → residual. ``attn``: keyword arguments of :func:`attention`.
    ``mlp=False``: the caller sets ``mlp`` (a placeholder until then)."""
    p, d, eps = f"blk.{i}.", hp.n_embd, hp.rms_eps
    return Block(attn_norm=norm(f, p + "attn_norm", d, eps), attn=attention(f, i, hp, rope, **attn),
                 ffn_norm=norm(f, p + ffn_norm, d, eps), mlp=gated_mlp(f, i, hp, act) if mlp else None)


def post_norm_block(f: GGUFFile, i: int, hp: HParams, rope: Rope | None, **attn: Any) -> Block:
    """OLMo 2 / EXAONE 4 block: no pre-norms; RMSNorm after attention and after the MLP."""
    p, d, eps = f"blk.{i}.", hp.n_embd, hp.rms_eps
    return Block(attn=attention(f, i, hp, rope, **attn), post_attn_norm=norm(f, p + "post_attention_norm", d, eps),
                 mlp=gated_mlp(f, i, hp), post_ffn_norm=norm(f, p + "post_ffw_norm", d, eps))


def decoder(f: GGUFFile, hp: HParams, blocks: list[Block], *, embed_scale: float = 1.0, logit_scale: float = 1.0,
            output_norm: str = "rms", output_norm_name: str = "output_norm", **extra: Any) -> ModelDesc:
    """The description around the blocks: embedding, final norm (``output_norm_name``), output head
    (tied to the embedding when ``output.weight`` is absent)."""
    tok = tensor(f, "token_embd.weight", (hp.n_vocab, hp.n_embd))
    Linear(tok)  # validates that its type can be dequantized (names the tensor if not)
    out = f.tensors.get("output.weight")
    output = Linear(out if out is not None else tok)
    if (output.out_features, output.in_features) != (hp.n_vocab, hp.n_embd):
        raise GGUFError(f"{f.path}: {output.name} has shape {(output.out_features, output.in_features)}, "
                        f"expected ({hp.n_vocab}, {hp.n_embd}) to match the {hp.n_vocab} rows of token_embd.weight")
    eps = hp.rms_eps if output_norm == "rms" else meta_float(f, "attention.layer_norm_epsilon", 1e-5, hi=1.0)
    from .pooling import pooling_from_meta  # here: pooling builds on this module

    pooling = pooling_from_meta(f, hp, softmax=hp.arch in ("qwen3", "qwen3vl"), causal=True)  # as llama.cpp
    return ModelDesc(arch=hp.arch, n_vocab=hp.n_vocab, n_embd=hp.n_embd, n_ctx_train=hp.n_ctx_train, tok_embd=tok,
                     blocks=blocks, output=output, output_norm=norm(f, output_norm_name, hp.n_embd, eps, output_norm),
                     embed_scale=embed_scale, logit_scale=logit_scale, final_softcap=hp.final_softcap, pooling=pooling,
                     extra=dict(extra))


def swa_pattern(f: GGUFFile, n_layer: int, default_period: int) -> list[bool]:
    """Which layers use the sliding window: ``attention.sliding_window_pattern`` as per-layer
    booleans, or a period n (layer i is local unless i % n == n - 1; 0: none)."""
    pattern = _meta(f, "attention.sliding_window_pattern", default_period)
    if isinstance(pattern, np.ndarray):
        if pattern.ndim != 1 or pattern.size != n_layer or pattern.dtype.kind not in "biu":
            raise GGUFError(f"{f.path}: metadata '{f.architecture}.attention.sliding_window_pattern' must hold "
                            f"{n_layer} booleans, got {pattern.dtype} of shape {pattern.shape}")
        return [bool(v) for v in pattern]
    n = meta_int(f, "attention.sliding_window_pattern", default_period, lo=0, hi=1 << 16)
    return [n > 0 and (i % n) < n - 1 for i in range(n_layer)]


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------
Describe = Callable[[GGUFFile, "int | None"], ModelDesc]
ARCHITECTURES: dict[str, Describe] = {}


def register(*names: str) -> Callable[[Describe], Describe]:
    """Decorator: ``describe(f, n_ctx) -> ModelDesc`` serves the GGUF architectures ``names``.

    ``n_ctx`` is the context the model will run with (None: not known yet); only descriptions that
    depend on it (LongRoPE's short / long factors) read it."""

    def deco(fn: Describe) -> Describe:
        for n in names:
            ARCHITECTURES[n] = fn
        return fn

    return deco


def _load_all() -> None:
    import importlib
    import pkgutil

    from .. import archs

    for m in pkgutil.iter_modules(archs.__path__):
        if m.name != "base":
            importlib.import_module(f"{archs.__name__}.{m.name}")


def supported() -> list[str]:
    """GGUF architecture names that load."""
    _load_all()
    return sorted(ARCHITECTURES)


def describe(f: GGUFFile, n_ctx: int | None = None) -> ModelDesc:
    """The description of the architecture named by ``general.architecture`` (for a context of
    ``n_ctx`` positions when known)."""
    _load_all()
    fn = ARCHITECTURES.get(f.architecture or "")
    if fn is None:
        raise UnsupportedArchitectureError(
            f"architecture {f.architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return fn(f, n_ctx)


def build(f: GGUFFile, backend: Any, n_ctx: int | None = None) -> Transformer:
    """The runnable model (:class:`minirt.forward.Transformer`) of a GGUF file on ``backend``."""
    return Transformer(describe(f, n_ctx), backend, file=f)


def read_config(f: GGUFFile) -> Any:
    """The :class:`minirt.forward.Config` summary of a file's model (what ``minirt info`` shows)."""
    from ..forward import config_of

    return config_of(describe(f))
