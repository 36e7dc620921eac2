"""The typed description of a decoder: what every backend runs, and the one place shared facts live.

An architecture file (``minirt/archs/<arch>.py``) reads GGUF metadata and tensor names into a
:class:`ModelDesc`; it says nothing about how anything is computed. Backends (the numpy reference
interpreter in :mod:`minirt.forward`, the native fused stack, CUDA) read the description and nothing
else: they know operations, never architectures. A backend that cannot run some feature of a
description refuses it at load time (then the reference path runs it, logged once).

Also here, once: RoPE tables (:meth:`Rope.cos_sin`, with linear / llama3 / LongRoPE factors, YaRN and
the attention factor, as ggml's ``rope_ext`` defines them) and the numpy reference versions of the
small layers (RMSNorm, LayerNorm, activations, attention).

Shapes: ``T`` tokens, ``d`` = n_embd, ``H`` / ``Hkv`` query / KV heads, ``Dk`` / ``Dv`` head sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import GGUFError, UnsupportedQuantError
from .gguf import GGUFTensor

ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "xielu", "swiglu_oai", "relu2")
GATINGS = ("softmax", "sigmoid", "softmax_topk")
POOLING_TYPES = ("none", "mean", "cls", "last", "rank")  # llama.cpp LLAMA_POOLING_TYPE_* order
NORM_KINDS = ("rms", "layer")


# ----------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------
class Linear:
    """A (possibly quantized) weight ``W (out_features, in_features)`` with an optional bias.

    The weight stays in the mapped file; a backend's ``matmul`` dequantizes on the fly. Fused GGUF
    tensors (``attn_qkv``, phi3's gate+up ``ffn_up``) are split into row views with :meth:`rows`:
    a ggml row is self-contained, so a row range is a zero-copy slice that every kernel can read.

    A 3-D expert tensor ``(n_expert, rows, in_features)`` (``ffn_*_exps``) is one Linear of
    ``n_expert · rows`` rows (expert e's rows are a contiguous block, as ggml stores them); its
    per-expert matrices are the zero-copy row views of :meth:`experts`. A bias of such a tensor
    has shape ``(n_expert, rows)``.
    """

    __slots__ = ("name", "w", "qtype", "out_features", "in_features", "bias", "backend_data", "parent", "n_expert")

    def __init__(self, t: GGUFTensor, bias: GGUFTensor | np.ndarray | None = None) -> None:
        if len(t.shape) not in (2, 3) or 0 in t.shape:
            raise GGUFError(f"tensor {t.name!r}: expected 2 dimensions (3 for experts), got shape {t.shape}")
        from .quants import get_spec

        try:
            get_spec(t.qtype)
        except UnsupportedQuantError as e:
            raise UnsupportedQuantError(f"tensor {t.name!r}: {e}") from None
        self.name = t.name
        self.n_expert = t.shape[0] if len(t.shape) == 3 else 0  # 0: an ordinary matrix
        self.w = t.data.reshape(-1, t.row_bytes)  # uint8 (out, row_bytes), zero-copy
        self.qtype = t.qtype
        self.out_features, self.in_features = self.w.shape[0], t.shape[-1]
        self.bias: np.ndarray | None = None
        if bias is not None:
            b = bias if isinstance(bias, np.ndarray) else bias.dequantize()
            b = b.reshape(-1) if b.size == self.out_features else b
            if b.shape != (self.out_features,):
                name = getattr(bias, "name", "bias")
                raise GGUFError(f"tensor {name!r}: shape {b.shape} does not match {t.name} {t.shape}")
            self.bias = np.ascontiguousarray(b, dtype=np.float32)
        self.backend_data: Any = None  # a backend may cache a repacked/uploaded copy here
        self.parent: tuple[str, int] | None = None  # (tensor name, first row) of a row view

    @property
    def source(self) -> tuple[str, int]:
        """(tensor name, first row) of the file rows this matrix reads."""
        return self.parent if self.parent is not None else (self.name, 0)

    def experts(self) -> list[Linear]:
        """The per-expert matrices ``(rows, in_features)`` of a 3-D expert tensor, as row views
        named ``<name>[e<i>]`` (zero-copy: a kernel given expert i reads only its bytes)."""
        if not self.n_expert:
            raise GGUFError(f"tensor {self.name!r} is not a 3-D expert tensor")
        n = self.out_features // self.n_expert
        return [self.rows(e * n, (e + 1) * n, f"e{e}") for e in range(self.n_expert)]

    def rows(self, r0: int, r1: int, suffix: str) -> Linear:
        """Rows ``r0:r1`` as a Linear of their own (zero-copy), named ``<name>[suffix]``."""
        if not 0 <= r0 < r1 <= self.out_features:
            raise GGUFError(f"tensor {self.name!r}: rows {r0}:{r1} outside its {self.out_features} rows")
        out = object.__new__(Linear)
        out.name = f"{self.name}[{suffix}]"
        out.w = self.w[r0:r1]
        out.qtype = self.qtype
        out.out_features, out.in_features = r1 - r0, self.in_features
        out.bias = None if self.bias is None else self.bias[r0:r1].copy()
        out.backend_data = None
        out.n_expert = 0
        out.parent = (self.name, r0) if self.parent is None else (self.parent[0], self.parent[1] + r0)
        return out

    def split(self, sizes: Sequence[int], names: Sequence[str]) -> list[Linear]:
        """Consecutive row blocks of the given sizes (a fused tensor's parts)."""
        if sum(sizes) != self.out_features:
            want = " + ".join(map(str, sizes))
            raise GGUFError(f"tensor {self.name!r} has {self.out_features} rows, expected {want}")
        out, r = [], 0
        for n, nm in zip(sizes, names, strict=True):
            out.append(self.rows(r, r + n, nm))
            r += n
        return out

    @property
    def nbytes(self) -> int:
        return self.w.nbytes


# ----------------------------------------------------------------------------------------------
# the description
# ----------------------------------------------------------------------------------------------
@dataclass
class Norm:
    """``kind`` "rms": x / sqrt(mean(x²) + eps) · weight; "layer": (x − mean) / sqrt(var + eps) · weight + bias."""

    weight: np.ndarray | None  # (n,) float32 gains (None: no scaling)
    eps: float
    kind: str = "rms"
    bias: np.ndarray | None = None  # (n,) LayerNorm only


_MEAN_COS_SIN: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # Rope.mean_cos_sin, per table and length


@dataclass
class Rope:
    """Rotary embedding of the first ``dim`` dims of each head, as ggml's ``rope_ext``.

    Angle of pair i at position p: ``p · base^(−2i/dim) / factors[i]``, then linear scaling by
    ``freq_scale``; with ``ext_factor`` > 0 YaRN blends scaled and unscaled angles over the
    dimensions between the correction bounds (``beta_fast``, ``beta_slow`` for ``n_ctx_orig``)
    and scales cos/sin by ``attn_factor · (1 + 0.1 ln(1/freq_scale))``; otherwise cos/sin are
    scaled by ``attn_factor`` (LongRoPE's magnitude factor).
    """

    dim: int
    base: float
    neox: bool  # pairs (i, i + dim/2) vs consecutive pairs (2i, 2i + 1)
    freq_scale: float = 1.0
    factors: np.ndarray | None = None  # (dim/2,) divisors: llama3 rope_freqs, LongRoPE short/long factors
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0

    def inv_freq(self) -> np.ndarray:
        """Effective angle per position of each pair, (dim/2,) float64 (every scaling applied)."""
        half = self.dim // 2
        theta = self.base ** (-np.arange(half, dtype=np.float64) * 2.0 / self.dim)
        if self.factors is not None:
            theta = theta / self.factors.astype(np.float64)
        if self.ext_factor == 0.0:
            return theta * self.freq_scale
        lo, hi = self._yarn_corr_dims()
        y = (np.arange(half, dtype=np.float64) - lo) / max(0.001, hi - lo)
        mix = (1.0 - np.clip(y, 0.0, 1.0)) * self.ext_factor
        return theta * (self.freq_scale * (1.0 - mix) + mix)

    def mscale(self) -> float:
        """Magnitude of the rotation tables (1 for plain RoPE)."""
        m = self.attn_factor
        if self.ext_factor != 0.0 and self.freq_scale > 0:
            m *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        return m

    def _yarn_corr_dims(self) -> tuple[float, float]:
        n_ctx = self.n_ctx_orig or 1

        def corr(n_rot: float) -> float:
            return self.dim * math.log(n_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(self.base))

        lo = math.floor(corr(self.beta_fast))
        hi = math.ceil(corr(self.beta_slow))
        return max(0.0, lo), min(self.dim - 1.0, hi)

    def cos_sin(self, positions: np.ndarray, magnitude: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin tables (T, dim/2) float32 for integer positions (T,). ``magnitude=False``: a pure
        rotation (for moving cached keys, which already carry the magnitude)."""
        ang = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq()[None, :]
        m = self.mscale() if magnitude else 1.0
        return (m * np.cos(ang)).astype(np.float32), (m * np.sin(ang)).astype(np.float32)

    def mean_cos_sin(self, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """cos / sin tables (1, dim/2) averaged over positions 0..n_positions-1 (what a constant vector
        turns into on average); computed once per distinct table and length, shared by the layers."""
        k = (self.key(), n_positions)
        got = _MEAN_COS_SIN.get(k)
        if got is None:
            cos, sin = self.cos_sin(np.arange(max(1, n_positions)))
            got = _MEAN_COS_SIN[k] = (cos.mean(0, keepdims=True), sin.mean(0, keepdims=True))
        return got

    def key(self) -> tuple:
        """Identity of the tables this RoPE produces (layers with equal keys share one table)."""
        f = None if self.factors is None else self.factors.tobytes()
        return (self.dim, self.base, self.freq_scale, f, self.ext_factor, self.attn_factor, self.beta_fast,
                self.beta_slow, self.n_ctx_orig)


@dataclass
class Attention:
    """Grouped-query self-attention over the KV cache (causal unless ``causal`` is False).

    ``rope`` None: a NoPE layer. ``qk_norm_per_head``: q/k norms over each head (Dk,) or over the
    whole projection (H·Dk,) (OLMo 2); they apply before RoPE unless ``qk_norm_after_rope``.
    ``window`` > 0: each query sees its last ``window`` positions.
    ``sinks``: per-head attention-sink logits (gpt-oss): each joins its head's softmax denominator only.
    ``causal`` False: every query sees every position of its sequence (encoders, EmbeddingGemma); a
    window then extends both ways (``|q − k| ≤ window // 2``, ModernBERT's local layers,
    EmbeddingGemma, llama.cpp's symmetric SWA).
    ``kv_source``: the layer reads the keys and values that an earlier layer (same head sizes) stored
    for the same positions and stores none (Gemma 4's KV sharing); its ``wk`` / ``wv`` are unused.
    ``out_gate``: the query projection also gives a per-head sigmoid gate of the output (Qwen3.5).
    """

    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    wq: Linear
    wk: Linear | None  # None only with kv_source
    wv: Linear | None
    wo: Linear
    scale: float
    rope: Rope | None
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    qk_norm_per_head: bool = True
    qk_norm_after_rope: bool = False  # HunYuan normalizes the rotated q/k
    softcap: float = 0.0
    window: int = 0
    sinks: np.ndarray | None = None
    causal: bool = True
    v_norm: Norm | None = None  # per-head norm of the values (Gemma 4: RMSNorm without gains)
    kv_source: int | None = None  # a layer that reuses layer kv_source's cached keys/values (no K/V of its own)
    # wq gives each head its query and then an output gate of head_dim_v (H · (Dk + Dv) rows, Qwen3.5):
    # each head's attention output is multiplied by sigmoid(gate) before wo
    out_gate: bool = False

    @property
    def kv_shape(self) -> tuple[int, int, int] | None:
        """(n_head_kv, head_dim_k, head_dim_v) of this layer's own cache; None when it reads another's."""
        return None if self.kv_source is not None else (self.n_head_kv, self.head_dim_k, self.head_dim_v)

    # its cached rows are keys and values: a block-quantized cache may store them Hadamard-rotated
    # (KVCache.rotation), attention rotating its queries alike
    kv_rotate = True

    def key_offset(self, n_positions: int) -> np.ndarray | None:
        """A constant (n_head_kv, head_dim_k) a block-quantized cache subtracts from every key it stores
        (adding it back when it reads them), or None.

        Softmax ignores a shift of all of one query's scores, and q·(k − c) = q·k − q·c shifts them all
        by the same q·c: attention over keys minus any constant c is exactly attention over the keys.
        A K bias b (Qwen2 / 2.5: up to 145 in its first layer) is such a near-constant part of every
        key, and the largest values of a q8_0 block set its step, so storing keys without it loses
        far less: c is b after RoPE averaged over positions 0..n_positions-1 (the least-squares
        constant; the low-frequency channels where the large bias values sit barely turn). Not where
        the shift does not cancel: score soft-capping, attention sinks, a K norm after the bias."""
        bias = None if self.wk is None or self.kv_source is not None else self.wk.bias
        if bias is None or self.k_norm is not None or self.softcap or self.sinks is not None:
            return None
        c = np.asarray(bias, dtype=np.float32).reshape(1, self.n_head_kv, self.head_dim_k).copy()
        if self.rope is not None:
            apply_rope(c, *self.rope.mean_cos_sin(n_positions), self.rope.neox, self.rope.dim)
        return c[0]


@dataclass
class ShortConv:
    """LFM2's gated short convolution, a block's mixer in place of attention::

        B, C, x = split(in_proj(h), 3)                       (T, d) each
        y[t] = C[t] · sum_j weight[:, j] · (B · x)[t − taps + 1 + j]    (causal; zeros before position 0)
        out = out_proj(y)

    The cache keeps ``B · x`` of every position, split into ``cache_heads`` rows of d / cache_heads
    (the layer's cache shape, see :meth:`ModelDesc.kv_layers`), so prefix reuse, state files, batching
    and context shift treat these rows as they treat keys; they are stored in the K cache type."""

    in_proj: Linear  # (3d, d)
    out_proj: Linear  # (d, d)
    weight: np.ndarray  # (d, taps) float32
    cache_heads: int = 1
    rope = None  # what generic code reads of a mixer: no positions, own cache, causal
    kv_source = None
    causal = True
    kv_rotate = False  # its rows are convolution inputs, stored as they are

    def key_offset(self, n_positions: int) -> None:
        """No constant is taken off its rows (see :meth:`Attention.key_offset`)."""
        return None

    @property
    def taps(self) -> int:
        return int(self.weight.shape[1])

    @property
    def n_embd(self) -> int:
        return int(self.weight.shape[0])

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """Its cache: the B·x rows as ``cache_heads`` keys of n_embd / cache_heads, no values."""
        return self.cache_heads, self.n_embd // self.cache_heads, 0


class RecurrentMixer:
    """What Qwen3.5's delta-net and Mamba-2 share as a block's mixer: no positions and no rows in the KV
    cache (a per-sequence state instead, their ``state_shapes``), causal, and a causal depthwise convolution
    ``conv`` (conv_dim, taps) float32 in front."""

    rope = None  # what generic code reads of a mixer
    kv_source = None
    causal = True
    kv_rotate = False
    kv_shape = None
    conv: np.ndarray

    def key_offset(self, n_positions: int) -> None:
        """No KV rows, so no key offset (see :meth:`Attention.key_offset`)."""
        return None

    @property
    def taps(self) -> int:
        return int(self.conv.shape[1])

    @property
    def conv_dim(self) -> int:
        return int(self.conv.shape[0])


@dataclass
class GatedDeltaNet(RecurrentMixer):
    """Qwen3.5's gated delta-net linear attention, a block's mixer in place of attention::

        qkv = conv(qkv_proj(h)) then SiLU          causal depthwise, ``taps`` per channel (conv_dim = 2·Hk·Dk + Hv·Dv)
        q, k, v = split(qkv)                         (T, Hk, Dk), (T, Hk, Dk), (T, Hv, Dv); q, k L2-normalised
        g = a · softplus(alpha_proj(h) + dt_bias)    (T, Hv) log decay, a = −exp(A_log) as the file stores it
        beta = sigmoid(beta_proj(h))                 (T, Hv)
        per value head j (key head j mod Hk, Qwen3.5's tiled order; Qwen3-Next: ``grouped``, key head
        j // (Hv/Hk), with beta and alpha from one ``ba_proj`` holding per key head [beta (Hv/Hk), alpha
        (Hv/Hk)] rows), state S (Dk, Dv), from zeros:
            S = exp(g_t) · S;  S += k_t ⊗ beta_t · (v_t − Sᵀ k_t);  o_t = Sᵀ q_t / sqrt(Dk)
        out = out_proj(rmsnorm(o) · norm.weight · silu(z_proj(h)))   (norm over each head's Dv)

    Its per-sequence state is not one row per position: the last ``taps − 1`` convolution inputs and S
    of every value head (:attr:`state_shapes`), kept by the cache beside its positions
    (:class:`minirt.kv_cache.KVCache`), valid at one position (and a snapshot), so a prefix is reused
    only where a state was kept and a context cannot be shifted."""

    qkv_proj: Linear  # (conv_dim, d)
    z_proj: Linear  # (Hv·Dv, d)
    beta_proj: Linear | None  # (Hv, d); None with ba_proj
    alpha_proj: Linear | None  # (Hv, d); None with ba_proj
    dt_bias: np.ndarray  # (Hv,) float32
    a: np.ndarray  # (Hv,) float32, negative
    conv: np.ndarray  # (conv_dim, taps) float32
    norm: Norm  # (Dv,)
    out_proj: Linear  # (d, Hv·Dv)
    n_k_heads: int
    n_v_heads: int
    head_dim_k: int
    head_dim_v: int
    ba_proj: Linear | None = None  # (2·Hv, d): per key head [beta rows, alpha rows] (Qwen3-Next)
    grouped: bool = False  # value head j reads key head j // (Hv/Hk) instead of j mod Hk

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(taps − 1, conv_dim) convolution inputs and (Hv, Dk, Dv) delta-rule state, float32."""
        return (self.taps - 1, self.conv_dim), (self.n_v_heads, self.head_dim_k, self.head_dim_v)


@dataclass
class Mamba2(RecurrentMixer):
    """Mamba-2's selective state-space mixer (Granite 4.0-H, Bamba; ``build_mamba2_layer`` in llama.cpp),
    a block's mixer in place of attention::

        z, xBC, dt = split(in_proj(h), [d_inner, conv_dim, H])       conv_dim = d_inner + 2·G·N
        xBC = silu(conv(xBC) + conv_bias)                              causal depthwise, ``taps`` per channel
        x, B, C = split(xBC, [d_inner, G·N, G·N])                      (T, H, P), (T, G, N), (T, G, N)
        dt = softplus(dt + dt_bias)                                    (T, H)
        per head h (group g = h // (H/G)), state S (P, N), from zeros:
            S = exp(dt_t · a) · S + (dt_t · x_t) ⊗ B_t;   y_t = S C_t + d_skip · x_t
        out = out_proj(grouped_rmsnorm(y · silu(z)) · norm.weight)    (RMS over each group's d_inner / G; no
                                                                       norm where the file has none)

    Its per-sequence state, as :class:`GatedDeltaNet`'s: the last ``taps − 1`` convolution inputs and S of
    every head (:attr:`state_shapes`), kept by the cache beside its positions."""

    in_proj: Linear  # (2·d_inner + 2·G·N + H, d)
    conv: np.ndarray  # (conv_dim, taps) float32
    conv_bias: np.ndarray | None  # (conv_dim,) float32
    dt_bias: np.ndarray  # (H,) float32
    a: np.ndarray  # (H,) float32, negative (−exp(A_log), as the file stores it)
    d_skip: np.ndarray  # (H,) float32
    norm: Norm | None  # (d_inner,) weight, the RMS taken over each of n_group groups; None: no norm (Falcon-H1)
    out_proj: Linear  # (d, d_inner)
    n_head: int
    head_dim: int
    d_state: int
    n_group: int

    @property
    def d_inner(self) -> int:
        return self.n_head * self.head_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(taps − 1, conv_dim) convolution inputs and (H, P, N) SSM state, float32."""
        return (self.taps - 1, self.conv_dim), (self.n_head, self.head_dim, self.d_state)


@dataclass
class ParallelMixer:
    """Falcon-H1's mixer: attention and a Mamba-2 mixer read the same normed input and their outputs are
    summed. Its layer keeps both the attention's KV rows and the Mamba-2 state; what generic code reads of a
    mixer comes from the attention (positions, cache rows) and the SSM (recurrent state)."""

    attn: Attention
    ssm: Mamba2
    kv_source = None
    causal = True

    @property
    def rope(self) -> Rope | None:
        return self.attn.rope

    @property
    def kv_shape(self) -> tuple[int, int, int] | None:
        return self.attn.kv_shape

    @property
    def kv_rotate(self) -> bool:
        return self.attn.kv_rotate

    @property
    def window(self) -> int:
        return self.attn.window

    @property
    def n_head(self) -> int:
        return self.attn.n_head

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.ssm.state_shapes

    def key_offset(self, n_positions: int) -> np.ndarray | None:
        return self.attn.key_offset(n_positions)


@dataclass
class MLP:
    """``down(act(gate(x)) · up(x))``, or ``down(act(up(x)))`` when ``gate`` is None.

    ``act_params``: the activation's constants (xIELU: alpha_n, alpha_p, beta, eps)."""

    act: str
    up: Linear
    down: Linear
    gate: Linear | None = None
    act_params: tuple[float, ...] = ()

    @property
    def n_ff(self) -> int:
        return self.down.in_features

    def linears(self) -> list[Linear]:
        return ([self.gate] if self.gate is not None else []) + [self.up, self.down]


@dataclass
class ParallelMoE:
    """Gemma 4's MoE layers: a dense MLP and a mixture of experts side by side on the block's
    residual x (T, d), each with its own norms::

        y = post_1(mlp(pre_1(x))) + post_2(experts(pre_2(x)))      (the block's post-FFN norm follows)

    The experts' router reads ``rmsnorm(x) · router_scale`` (``router_scale`` holds the file's scale
    vector times d^-0.5), softmax, top-k renormalised; each chosen expert's weight is multiplied by
    its ``expert_scale``."""

    mlp: MLP
    moe: MoE
    pre_1: Norm
    post_1: Norm
    pre_2: Norm
    post_2: Norm
    router_norm: Norm  # RMSNorm without gain
    router_scale: np.ndarray  # (d,) float32
    expert_scale: np.ndarray  # (n_expert,) float32

    @property
    def n_ff(self) -> int:
        return self.mlp.n_ff

    def linears(self) -> list[Linear]:
        return self.mlp.linears() + self.moe.linears()


@dataclass
class Router:
    """Which experts each token goes to, and with what weight.

    ``logits = gate(x) (+ gate bias)``; probabilities by ``gating``: "softmax" over all experts,
    "sigmoid" of each, or "softmax_topk" (the chosen logits softmaxed among themselves, gpt-oss).
    The top ``n_used`` by probability (plus ``selection_bias``, which only chooses: DeepSeek-V3's
    ``exp_probs_b``) are taken; their probabilities are renormalised to sum 1 when ``norm_topk``
    and multiplied by ``scale``.
    """

    gate: Linear  # (n_expert, d)
    n_used: int
    gating: str = "softmax"
    norm_topk: bool = False
    scale: float = 1.0
    selection_bias: np.ndarray | None = None  # (n_expert,) float32


@dataclass
class MoE:
    """A mixture-of-experts feed-forward::

        y = sum over the chosen e of w_e · down_e(act(gate_e(x)) · up_e(x))   (+ bias of each)
          + [sigmoid(shared_gate · x)] · shared(x)

    The experts are the per-expert row views of the 3-D ``ffn_*_exps`` tensors (``Linear.experts``),
    each an ordinary (possibly biased) matrix, so every backend's matmul runs them; only the experts
    some token chose are read. ``shared``: the always-on expert (qwen2moe, granitemoe shared);
    ``shared_gate``: its (1, d) sigmoid gate, None for an ungated one. ``act_params`` as for MLP
    ("swiglu_oai": alpha, limit). ``latent_down`` (latent, d) / ``latent_up`` (d, latent): Nemotron 3
    Super's latent experts, which read ``latent_down · x`` (the router still reads x) and whose weighted
    sum goes through ``latent_up`` before the shared expert's output is added.
    """

    router: Router
    act: str
    up: list[Linear]  # per expert (n_ff, d)
    down: list[Linear]  # per expert (d, n_ff)
    gate: list[Linear] | None = None  # per expert (n_ff, d); None: down(act(up(x)))
    act_params: tuple[float, ...] = ()
    shared: MLP | None = None
    shared_gate: Linear | None = None
    latent_down: Linear | None = None
    latent_up: Linear | None = None

    @property
    def n_expert(self) -> int:
        return len(self.up)

    @property
    def n_ff(self) -> int:
        """Width of one routed expert."""
        return self.down[0].in_features

    def linears(self) -> list[Linear]:
        """Every matrix of this feed-forward (router, experts, shared expert and its gate)."""
        out = [self.router.gate] + (list(self.gate) if self.gate is not None else []) + list(self.up) + list(self.down)
        out += [lin for lin in (self.latent_down, self.latent_up) if lin is not None]
        if self.shared is not None:
            out += self.shared.linears()
        if self.shared_gate is not None:
            out.append(self.shared_gate)
        return out


@dataclass
class PerLayerGate:
    """Gemma 4's per-layer input of one block, after its feed-forward residual::

        x = x + post_norm(proj(act(gate(x)) · inputs[:, layer]))

    ``inputs`` (T, n_layer, width) are the model's :class:`PerLayerInputs`."""

    gate: Linear  # (width, d)
    proj: Linear  # (d, width)
    post_norm: Norm  # (d,)
    act: str = "gelu_tanh"


@dataclass
class PerLayerInputs:
    """Per-layer token embeddings (Gemma 4 / 3n), computed once per pass from the token ids and the
    first block's input x0 (T, d)::

        inputs = (norm(model_proj(x0) · proj_scale) + tok_embd[ids] · embd_scale) · input_scale

    reshaped to (T, n_layer, width) (``norm`` over each layer's ``width``); block i reads ``inputs[:, i]``."""

    tok_embd: GGUFTensor  # (n_vocab, n_layer · width), rows dequantized on lookup
    model_proj: Linear  # (n_layer · width, d)
    norm: Norm  # (width,)
    width: int
    embd_scale: float
    proj_scale: float
    input_scale: float


@dataclass
class Block:
    """One decoder layer. Sequential (default)::

        h = attn(pre(x)); x = x + s · post_attn(h)
        h = mlp(ffn_pre(x)); x = x + s · post_ffn(h)

    ``parallel``: ``x = x + s · (attn(pre(x)) + mlp(pre(x)))`` (Cohere; ``ffn_norm`` unused).
    Any norm may be None (OLMo 2 has post-norms only). ``s`` = ``residual_scale`` (Granite).
    ``norm_residual`` (BERT's post-norm layout): the post norms apply to the residual sum instead,
    ``x = post_attn(x + attn(x)); x = post_ffn(x + mlp(x))``.
    Then ``per_layer`` (Gemma 4, see :class:`PerLayerGate`), and the output is multiplied by
    ``out_scale`` (Gemma 4's ``layer_output_scale``). ``mlp`` None: the block has no feed-forward half
    (Nemotron-H, whose layers are a mixer or a feed-forward each, where a mixer is followed by another).
    """

    attn: Attention | ShortConv | GatedDeltaNet | Mamba2 | ParallelMixer
    mlp: MLP | MoE | ParallelMoE | None
    attn_norm: Norm | None = None
    post_attn_norm: Norm | None = None
    ffn_norm: Norm | None = None
    post_ffn_norm: Norm | None = None
    parallel: bool = False
    residual_scale: float = 1.0
    norm_residual: bool = False
    per_layer: PerLayerGate | None = None
    out_scale: float = 1.0


@dataclass
class Pooling:
    """How an embedding model turns the final hidden states (T, d) of one sequence into its output.

    ``kind`` (GGUF ``<arch>.pooling_type``): "none" (one vector per token), "mean", "cls" (first
    token), "last" (last token), "rank" (a reranker's relevance score: the ``cls_pool`` token (or the mean)
    through the classifier head ``cls`` → ``cls_act`` → ``cls_norm``, then ``cls_out`` → (n_cls_out,)).
    ``dense``: projections applied after pooling, in order (EmbeddingGemma's sentence-transformers
    Dense modules, no activation). ``labels``: the classifier's output names.
    """

    kind: str
    cls: Linear | None = None
    cls_act: str = "tanh"
    cls_norm: Norm | None = None
    cls_out: Linear | None = None
    cls_pool: str = "cls"  # "cls" | "mean" | "last": the vector the classifier reads
    softmax: bool = False  # a softmax over the classifier outputs
    dense: list[Linear] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)

    @property
    def n_out(self) -> int | None:
        """Width of one pooled output (None for per-token output, whose width is n_embd)."""
        if self.kind == "rank":
            return self.cls_out.out_features if self.cls_out is not None else None
        return self.dense[-1].out_features if self.dense else None


@dataclass
class ModelDesc:
    """A whole decoder: embedding, blocks, output head.

    ``logits = final_softcap(logit_scale · output(output_norm(x)))``; the input of the first block
    is ``embed_scale · token_embd[ids]``.
    """

    arch: str
    n_vocab: int
    n_embd: int
    n_ctx_train: int
    tok_embd: GGUFTensor  # (n_vocab, d) rows dequantized on lookup
    blocks: list[Block]
    output: Linear  # (n_vocab, d); the embedding itself when tied
    output_norm: Norm | None
    embed_scale: float = 1.0
    logit_scale: float = 1.0
    final_softcap: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # informational (shown by `minirt info`)
    # encoder inputs: x = embd_norm(embed_scale · tok_embd[ids] + pos_embd[positions] + type_embd[0])
    pos_embd: GGUFTensor | None = None  # (n_pos, d) absolute position embeddings (BERT)
    type_embd: np.ndarray | None = None  # (n_types, d) token-type embeddings; type 0 is added, as llama.cpp
    embd_norm: Norm | None = None
    pooling: Pooling | None = None  # None: a generative model without an embedding output
    per_layer_inputs: PerLayerInputs | None = None  # Gemma 4's per-layer token embeddings

    @property
    def causal(self) -> bool:
        """True when every layer attends causally (then prompts may be split into chunks)."""
        return all(b.attn.causal for b in self.blocks)

    def recurrent_states(self) -> list[tuple[tuple[int, ...], ...] | None]:
        """Per layer, the shapes of its per-sequence recurrent state (:attr:`GatedDeltaNet.state_shapes`),
        None for a layer without one."""
        return [getattr(b.attn, "state_shapes", None) for b in self.blocks]

    def linears(self) -> list[Linear]:
        """Every matrix the forward pass streams, output first."""
        out = [self.output]
        for b in self.blocks:
            a, m = b.attn, b.mlp
            if isinstance(a, (ShortConv, Mamba2)):
                out += [a.in_proj, a.out_proj]
            elif isinstance(a, ParallelMixer):
                out += [a.attn.wq, a.attn.wk, a.attn.wv, a.attn.wo, a.ssm.in_proj, a.ssm.out_proj]
            elif isinstance(a, GatedDeltaNet):
                out += [lin for lin in (a.qkv_proj, a.z_proj, a.beta_proj, a.alpha_proj, a.ba_proj, a.out_proj)
                        if lin is not None]
            else:
                out += [a.wq, a.wo] if a.kv_source is not None else [a.wq, a.wk, a.wv, a.wo]
            out += m.linears() if m is not None else []
            if b.per_layer is not None:
                out += [b.per_layer.gate, b.per_layer.proj]
        p = self.pooling
        if p is not None:
            out += [lin for lin in (p.cls, p.cls_out, *p.dense) if lin is not None]
        if self.per_layer_inputs is not None:
            out.append(self.per_layer_inputs.model_proj)
        seen: set[int] = set()  # a matrix used twice (Gemma 4's V = K) is listed once
        return [lin for lin in out if not (id(lin) in seen or seen.add(id(lin)))]

    def kv_layers(self) -> list[tuple[int, int, int] | None]:
        """Per layer, the (n_head_kv, head_dim_k, head_dim_v) of its own cache; None for a layer that
        reads another's (``kv_source``) or keeps a recurrent state instead (:class:`GatedDeltaNet`, :class:`Mamba2`)."""
        return [b.attn.kv_shape for b in self.blocks]

    def key_offsets(self) -> list[np.ndarray | None]:
        """Per layer, :meth:`Attention.key_offset` over the training context (at most 32768 positions),
        None for layers without one."""
        n = min(self.n_ctx_train or 4096, 32768)
        return [b.attn.key_offset(n) for b in self.blocks]

    def kv_windows(self) -> list[int]:
        """Per layer the window of a causal sliding-window layer with a cache of its own, else 0: the
        rows such a layer's cache must keep (:meth:`minirt.kv_cache.KVCache.release_stale`)."""
        w = [int(getattr(b.attn, "window", 0)) if b.attn.causal else 0 for b in self.blocks]
        for j, b in enumerate(self.blocks):  # a layer reading another's cache needs those rows too
            s = b.attn.kv_source
            if s is not None:
                w[s] = max(w[s], w[j]) if w[s] and w[j] else 0
                w[j] = 0
        return w

    def kv_rotate(self) -> list[bool]:
        """Per layer, whether its cache rows are attention keys / values (rotatable, see
        :meth:`minirt.kv_cache.KVCache.rotation`)."""
        return [b.attn.kv_rotate for b in self.blocks]

    def kv_shape(self) -> tuple[int, int, int]:
        """(n_head_kv, head_dim_k, head_dim_v) of the cache: the layers' own, or each the largest
        over the layers when they differ (a cache then gives each layer its own shape); (1, 1, 1) when
        every layer keeps a recurrent state instead (pure Mamba-2: the cache holds no rows)."""
        shapes = [s for s in self.kv_layers() if s is not None]
        if not shapes:
            if all(s is not None for s in self.recurrent_states()):
                return 1, 1, 1
            from .errors import UnsupportedArchitectureError

            raise UnsupportedArchitectureError("no layer has a KV cache of its own")
        return max(s[0] for s in shapes), max(s[1] for s in shapes), max(s[2] for s in shapes)

    def ropes(self) -> list[Rope]:
        """The distinct RoPE variants of the layers, in first-use order."""
        seen: dict[tuple, Rope] = {}
        for b in self.blocks:
            r = b.attn.rope
            if r is not None:
                seen.setdefault(r.key(), r)
        return list(seen.values())


# ----------------------------------------------------------------------------------------------
# numpy reference layers
# ----------------------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2) + eps) * w`` over the last axis. x: (..., n)."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    y = x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(np.float32)
    if w is not None:
        y *= w
    return y


def layer_norm(x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, eps: float) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last axis. x: (..., n)."""
    c = x - np.mean(x, axis=-1, keepdims=True, dtype=np.float32)
    y = rms_norm(c, w, eps)  # var of the centred row is its mean square
    if b is not None:
        y += b
    return y


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^−x), written with tanh so that large |x| neither overflows nor warns."""
    return (np.float32(0.5) * np.tanh(np.float32(0.5) * x) + np.float32(0.5)).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def l2_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """x / max(‖x‖, eps) over the last axis (ggml's l2_norm)."""
    n = np.sqrt(np.einsum("...i,...i->...", x, x, dtype=np.float32))[..., None]
    return (x / np.maximum(n, np.float32(eps))).astype(np.float32)


def delta_rule(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray,
               beta: np.ndarray) -> np.ndarray:
    """The gated delta rule over n tokens, one value head per row of S (H, Dk, Dv), updated in place::

        S = decay_t · S;  S += k_t ⊗ beta_t · (v_t − Sᵀ k_t);  o_t = Sᵀ q_t

    q, k (n, H, Dk) (q already scaled), v (n, H, Dv), decay = exp(g) and beta (n, H). Returns o (n, H, Dv)."""
    o = np.empty(v.shape, dtype=np.float32)
    for t in range(q.shape[0]):
        S *= decay[t][:, None, None]
        kv = np.einsum("hk,hkv->hv", k[t], S)
        delta = (v[t] - kv) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hk,hkv->hv", q[t], S)
    return o


def ssm_scan(S: np.ndarray, x: np.ndarray, dt: np.ndarray, a: np.ndarray, B: np.ndarray,
             C: np.ndarray) -> np.ndarray:
    """Mamba-2's selective scan over n tokens, one head per row of S (H, P, N), updated in place::

        S = exp(dt_t · a) · S + (dt_t · x_t) ⊗ B_t;  y_t = S C_t

    x (n, H, P), dt (n, H) (softplus already applied), a (H,), B and C (n, G, N) with head h reading
    group h // (H / G). Returns y (n, H, P) (without the D skip)."""
    rep = S.shape[0] // B.shape[1]
    y = np.empty(x.shape, dtype=np.float32)
    decay = np.exp(dt * a).astype(np.float32)  # (n, H)
    for t in range(x.shape[0]):
        Bt, Ct = np.repeat(B[t], rep, axis=0), np.repeat(C[t], rep, axis=0)  # (H, N)
        S *= decay[t][:, None, None]
        S += (x[t] * dt[t][:, None])[:, :, None] * Bt[:, None, :]
        y[t] = np.einsum("hpn,hn->hp", S, Ct)
    return y


def causal_conv(rows: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """A causal depthwise convolution: rows (taps − 1 + n, c) are the taps − 1 inputs before the n new ones
    and those; w (c, taps), tap j multiplying position t − taps + 1 + j. Returns (n, c)."""
    L = w.shape[1]
    n = rows.shape[0] - (L - 1)
    acc = np.zeros((n, rows.shape[1]), dtype=np.float32)
    if bias is not None:
        acc += bias
    for j in range(L):
        acc += rows[j:j + n] * w[:, j]
    return acc


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))


def xielu(x: np.ndarray, alpha_n: float, alpha_p: float, beta: float, eps: float) -> np.ndarray:
    """xIELU (Apertus) with its constants (already through softplus): ``alpha_p·x² + beta·x`` for x > 0,
    ``(expm1(min(x, eps)) − x)·alpha_n + beta·x`` otherwise."""
    x = x.astype(np.float32, copy=False)
    neg = (np.expm1(np.minimum(x, np.float32(eps))) - x) * np.float32(alpha_n) + np.float32(beta) * x
    pos = np.float32(alpha_p) * x * x + np.float32(beta) * x
    return np.where(x > 0, pos, neg).astype(np.float32)


def swiglu_oai(g: np.ndarray, u: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss' clamped SwiGLU (as ggml's ``swiglu_oai``): with ``g' = min(g, limit)``,
    ``g' · sigmoid(alpha · g') · (clamp(u, −limit, limit) + 1)``."""
    g = np.minimum(g, np.float32(limit))
    u = np.clip(u, np.float32(-limit), np.float32(limit))
    return (g / (np.float32(1.0) + np.exp(np.float32(-alpha) * g)) * (u + np.float32(1.0))).astype(np.float32)


def route(logits: np.ndarray, r: Router) -> tuple[np.ndarray, np.ndarray]:
    """The experts each token goes to and their weights, from router logits (T, n_expert) (the
    gate's output, bias added): ``(ids (T, n_used) int64, weights (T, n_used) float32)``, ids in
    descending order of selection score (ties: lower id first)."""
    logits = logits.astype(np.float32, copy=False)
    if r.gating == "sigmoid":
        probs = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))
    elif r.gating == "softmax":
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
    elif r.gating == "softmax_topk":
        probs = logits
    else:
        raise ValueError(f"unknown gating {r.gating!r}")
    sel = probs if r.selection_bias is None else probs + r.selection_bias
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, :r.n_used]
    w = np.take_along_axis(probs, ids, axis=-1).astype(np.float32)
    if r.gating == "softmax_topk":
        w = np.exp(w - w.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
    if r.norm_topk:
        w /= np.maximum(w.sum(axis=-1, keepdims=True), np.float32(6.103515625e-5))  # as llama.cpp: f16's min normal
    if r.scale != 1.0:
        w *= np.float32(r.scale)
    return ids.astype(np.int64), w


def group_by_expert(ids: np.ndarray, n_expert: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """For each expert some token chose: ``(expert, token rows (n,), slot in the token's choices (n,))``,
    experts ascending, rows ascending (so a prefill runs each chosen expert once over all its tokens)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=n_expert)
    out, start = [], 0
    for e in np.flatnonzero(counts):
        sel = order[start:start + counts[e]]
        start += counts[e]
        out.append((int(e), sel // k, sel % k))
    return out
def erf(x: np.ndarray) -> np.ndarray:
    """The error function in float32 (numpy has none): Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7
    (float32 rounding level)."""
    x64 = np.asarray(x, dtype=np.float64)
    a = np.abs(x64)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y = 1.0 - poly * np.exp(-a * a)
    return (np.sign(x64) * y).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU with the error function, ``0.5·x·(1 + erf(x/√2))`` (BERT's ``gelu``)."""
    return np.float32(0.5) * x * (np.float32(1.0) + erf(x * np.float32(1.0 / math.sqrt(2.0))))


def activation(name: str, x: np.ndarray, params: Sequence[float] = ()) -> np.ndarray:
    if name == "silu":
        return silu(x)
    if name == "gelu_tanh":
        return gelu_tanh(x)
    if name == "gelu":
        return gelu(x)
    if name == "tanh":
        return np.tanh(x)
    if name == "xielu":
        return xielu(x, *params)
    if name == "relu2":  # squared ReLU (Nemotron-H)
        r = np.maximum(x, np.float32(0.0))
        return r * r
    raise ValueError(f"unknown activation {name!r}")


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool, rope_dim: int) -> None:
    """Rotate ``x (T, heads, head_dim)`` in place; the first ``rope_dim`` dims of each head rotate."""
    half = rope_dim // 2
    c = cos[:, None, :half]
    s = sin[:, None, :half]
    if neox:
        a = x[..., :half].copy()
        b = x[..., half:rope_dim]
        x[..., :half] = a * c - b * s
        x[..., half:rope_dim] = a * s + b * c
    else:
        a = x[..., 0:rope_dim:2].copy()
        b = x[..., 1:rope_dim:2]
        x[..., 0:rope_dim:2] = a * c - b * s
        x[..., 1:rope_dim:2] = a * s + b * c


def attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, p0: int, scale: float, window: int,
              softcap: float = 0.0, sinks: np.ndarray | None = None, causal: bool = True) -> np.ndarray:
    """Grouped-query attention of new queries over the cached keys/values.

    q: (n, H, Dk) queries at positions p0..p0+n-1; kc: (Hkv, L, Dk), vc: (Hkv, L, Dv) hold
    positions 0..L-1 with L = p0 + n. ``window`` > 0 limits each query to its last ``window``
    positions (sliding-window layers). ``sinks`` (H,): per-head logits that join each softmax's
    denominator only (gpt-oss' attention sinks). ``causal`` False: no causal mask (the whole
    sequence is in kc/vc), and a window is symmetric, ``|q − k| <= window // 2``.
    Returns (n, H * Dv).
    """
    n, H, Dk = q.shape
    Hkv, L, Dv = vc.shape
    g = H // Hkv
    qg = q.transpose(1, 0, 2).reshape(Hkv, g * n, Dk)  # head h ↔ kv head h // g
    s = np.matmul(qg, kc.transpose(0, 2, 1)).reshape(Hkv, g, n, L)  # (Hkv, g, n, L)
    s *= np.float32(scale)
    if softcap:
        s = np.tanh(s / np.float32(softcap)) * np.float32(softcap)
    qpos = p0 + np.arange(n)[:, None]
    kpos = np.arange(L)[None, :]
    if causal:
        masked = kpos > qpos
        if window:
            masked |= (qpos - kpos) >= window
    else:
        masked = np.abs(qpos - kpos) > window // 2 if window else np.zeros((n, L), dtype=bool)
    if masked.any():
        s[..., masked] = -np.inf
    if sinks is None:
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
    else:
        sk = sinks.astype(np.float32).reshape(Hkv, g, 1, 1)  # head h = kv head h // g, member h % g
        mx = np.maximum(s.max(axis=-1, keepdims=True), sk)
        s -= mx
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True) + np.exp(sk - mx)
    o = np.matmul(s.reshape(Hkv, g * n, L), vc)  # (Hkv, g*n, Dv)
    return o.reshape(H, n, Dv).transpose(1, 0, 2).reshape(n, H * Dv)
