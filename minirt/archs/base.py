"""Shared decoder machinery: hyperparameters from GGUF metadata, the layers every architecture is
built from (RMSNorm, RoPE, grouped-query attention over the KV cache, gated MLP), and the
layer-by-layer forward pass over a batch that may mix several sequences.

Step 4 of the pipeline. Architectures (``llama.py``, ``qwen2.py``, ``gemma3.py`` ...) only say how
their block differs; everything here reads hyperparameters from metadata, never from tensor names
or sizes guessed after the fact.

Shapes: ``T`` tokens in the batch, ``d`` = n_embd, ``H`` / ``Hkv`` query / KV heads, ``Dk`` / ``Dv``
head sizes. Activations are float32 row-major ``(T, features)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ContextOverflowError, GGUFError, UnsupportedArchitectureError, UnsupportedQuantError
from ..gguf import GGUFFile, GGUFTensor
from ..kv_cache import KVCache


# ----------------------------------------------------------------------------------------------
# hyperparameters
# ----------------------------------------------------------------------------------------------
@dataclass
class Config:
    """Hyperparameters of a decoder, all read from ``<arch>.*`` metadata keys."""

    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float = 10000.0
    rope_dim: int = 0  # rotated dims per head (may be < head_dim)
    rope_neox: bool = False  # NEOX pairs (i, i + r/2) vs normal pairs (2i, 2i + 1)
    rope_freq_scale: float = 1.0  # linear scaling: positions multiplied by this
    rope_freq_factors: np.ndarray | None = None  # llama3-style per-frequency divisors (r/2,)
    attn_scale: float = 0.0  # multiplier of q·k; 0 → 1/sqrt(head_dim_k)
    sliding_window: int = 0  # window of local layers (0 = none)
    swa_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window
    rope_base_swa: float = 0.0  # RoPE base of sliding-window layers (0 = rope_base)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    embed_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_group(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_head_kv


def _meta(f: GGUFFile, key: str, default: Any = None, required: bool = False) -> Any:
    v = f.metadata.get(f"{f.architecture}.{key}", default)
    if required and v is None:
        raise GGUFError(f"{f.path}: metadata key '{f.architecture}.{key}' is required for this architecture")
    return v


# Sanity bounds: far beyond any real model, small enough that nothing sized by them can exhaust memory.
MAX_LAYERS = 1024
MAX_DIM = 1 << 20


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


def _show(v: Any) -> str:
    r = repr(v.tolist() if isinstance(v, np.ndarray) else v)
    return f"{type(v).__name__} {r[:60]}"


def _per_layer(f: GGUFFile, key: str, n_layer: int, default: Any = None, required: bool = False) -> int:
    """A head count or width; some GGUFs store one per layer, which must then be uniform."""
    v = _meta(f, key, default, required)
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.size != n_layer or v.dtype.kind not in "iu":
            raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be an integer or {n_layer} integers, "
                            f"got {_show(v)}")
        if len(set(v.tolist())) != 1:
            raise UnsupportedArchitectureError(f"per-layer {key} {v.tolist()[:8]}... is not supported (must be uniform)")
        v = int(v[0])
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 1 <= int(v) <= MAX_DIM:
        raise GGUFError(f"{f.path}: metadata '{f.architecture}.{key}' must be an integer in [1, {MAX_DIM}], got {_show(v)}")
    return int(v)


def read_config(f: GGUFFile) -> Config:
    """Common hyperparameters; architectures refine the result in their ``configure``.

    Every value is type- and range-checked: a malformed file raises GGUFError naming the key,
    never a stray ValueError or an allocation sized by a corrupt count."""
    arch = f.architecture or "?"
    n_layer = meta_int(f, "block_count", required=True, hi=MAX_LAYERS)
    n_embd = meta_int(f, "embedding_length", required=True)
    n_head = _per_layer(f, "attention.head_count", n_layer, required=True)
    n_head_kv = _per_layer(f, "attention.head_count_kv", n_layer, default=n_head)
    n_ff = _per_layer(f, "feed_forward_length", n_layer, required=True)
    if n_head % n_head_kv:
        raise GGUFError(f"{f.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    head_dim_k = meta_int(f, "attention.key_length", max(1, n_embd // n_head))
    head_dim_v = meta_int(f, "attention.value_length", max(1, n_embd // n_head))
    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' is missing")
    if len(emb.shape) != 2 or emb.shape[1] != n_embd:
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' has shape {emb.shape}, expected (n_vocab, {n_embd})")
    n_vocab = emb.shape[0]
    rope_dim = meta_int(f, "rope.dimension_count", head_dim_k)
    if rope_dim > head_dim_k or rope_dim % 2:
        raise GGUFError(f"{f.path}: rope.dimension_count {rope_dim} invalid for head size {head_dim_k}")
    cfg = Config(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
        head_dim_k=head_dim_k, head_dim_v=head_dim_v, n_vocab=n_vocab,
        n_ctx_train=meta_int(f, "context_length", 2048, hi=1 << 24),
        rms_eps=meta_float(f, "attention.layer_norm_rms_epsilon", 1e-5, hi=1.0),
        rope_base=meta_float(f, "rope.freq_base", 10000.0, lo=1e-3),
        rope_dim=rope_dim,
        attn_scale=meta_float(f, "attention.scale", 0.0, hi=1e6),
        attn_softcap=meta_float(f, "attn_logit_softcapping", 0.0, hi=1e6),
        final_softcap=meta_float(f, "final_logit_softcapping", 0.0, hi=1e6),
    )
    scaling = _meta(f, "rope.scaling.type")
    if scaling is not None and not isinstance(scaling, str):
        raise GGUFError(f"{f.path}: metadata '{arch}.rope.scaling.type' must be a string, got {_show(scaling)}")
    factor = meta_float(f, "rope.scaling.factor", 0.0, hi=1e6)
    if scaling in (None, "none") and factor and factor != 1.0:
        scaling = "linear"  # older GGUFs store only the factor
    if scaling == "linear" and factor:
        cfg.rope_freq_scale = 1.0 / factor
    elif scaling not in (None, "none", "linear"):
        raise UnsupportedArchitectureError(f"RoPE scaling type {scaling!r} is not supported (supported: none, linear, llama3 freq factors)")
    rf = f.tensors.get("rope_freqs.weight")
    if rf is not None:
        ff = rf.dequantize().reshape(-1)
        if ff.size != rope_dim // 2:
            raise GGUFError(f"{f.path}: rope_freqs.weight has {ff.size} entries, expected {rope_dim // 2}")
        if not np.all(np.isfinite(ff)) or np.any(ff <= 0):
            raise GGUFError(f"{f.path}: rope_freqs.weight must hold finite positive factors")
        cfg.rope_freq_factors = ff.astype(np.float32)
    cfg.swa_layers = (False,) * n_layer
    return cfg


# ----------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------
class Linear:
    """A (possibly quantized) weight ``W (out_features, in_features)`` with an optional bias.

    The weight stays in the mapped file; ``backend.matmul`` dequantizes on the fly.
    """

    __slots__ = ("name", "w", "qtype", "out_features", "in_features", "bias", "backend_data")

    def __init__(self, t: GGUFTensor, bias: GGUFTensor | None = None) -> None:
        if len(t.shape) != 2:
            raise GGUFError(f"tensor {t.name!r}: expected 2 dimensions, got shape {t.shape}")
        from ..quants import get_spec

        try:
            get_spec(t.qtype)
        except UnsupportedQuantError as e:
            raise UnsupportedQuantError(f"tensor {t.name!r}: {e}") from None
        self.name = t.name
        self.w = t.data  # uint8 (out, row_bytes), zero-copy
        self.qtype = t.qtype
        self.out_features, self.in_features = t.shape
        self.bias = None
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise GGUFError(f"tensor {bias.name!r}: shape {bias.shape} does not match {t.name} {t.shape}")
            self.bias = bias.dequantize()
        self.backend_data: Any = None  # a backend may cache a repacked/uploaded copy here

    @property
    def nbytes(self) -> int:
        return self.w.nbytes


def vector(f: GGUFFile, name: str, size: int) -> np.ndarray:
    """A 1-D float32 weight (norm gains, biases) checked against its expected length."""
    t = f.tensors.get(name)
    if t is None:
        raise GGUFError(f"{f.path}: tensor {name!r} is missing")
    try:
        v = t.dequantize().reshape(-1)
    except UnsupportedQuantError as e:
        raise UnsupportedQuantError(f"tensor {name!r}: {e}") from None
    if v.size != size:
        raise GGUFError(f"{f.path}: tensor {name!r} has {v.size} elements, expected {size}")
    return np.ascontiguousarray(v, dtype=np.float32)


def tensor(f: GGUFFile, name: str, shape: tuple[int, ...] | None = None) -> GGUFTensor:
    """A required tensor, optionally checked against an expected numpy shape."""
    t = f.tensors.get(name)
    if t is None:
        raise GGUFError(f"{f.path}: tensor {name!r} is missing")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise GGUFError(f"{f.path}: tensor {name!r} has shape {t.shape}, expected {shape}")
    return t


def linear(f: GGUFFile, name: str, out_f: int, in_f: int, bias: bool | None = False) -> Linear:
    """Linear layer ``name.weight`` (+ ``name.bias``: True = required, None = if present)."""
    w = tensor(f, name + ".weight", (out_f, in_f))
    b = f.tensors.get(name + ".bias")
    if bias is True and b is None:
        raise GGUFError(f"{f.path}: tensor {name + '.bias'!r} is missing")
    return Linear(w, b if bias is not False else None)


# ----------------------------------------------------------------------------------------------
# layers (numpy float32; hot ones have native versions selected by the backend)
# ----------------------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x**2) + eps) * w`` over the last axis. x: (..., n)."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    y = x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(np.float32)
    if w is not None:
        y *= w
    return y


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(_GELU_C * (x + np.float32(0.044715) * x * x * x)))


def rope_cos_sin(positions: np.ndarray, cfg: Config, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables (T, rope_dim/2) for integer positions (T,)."""
    half = cfg.rope_dim // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    if cfg.rope_freq_factors is not None:
        inv = inv / cfg.rope_freq_factors.astype(np.float64)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * (inv[None, :] * cfg.rope_freq_scale)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool, rope_dim: int) -> None:
    """Rotate ``x (T, heads, head_dim)`` in place; the first ``rope_dim`` dims of each head rotate."""
    half = rope_dim // 2
    c = cos[:, None, :]
    s = sin[:, None, :]
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
              softcap: float = 0.0) -> np.ndarray:
    """Causal grouped-query attention of new queries over the cached keys/values.

    q: (n, H, Dk) queries at positions p0..p0+n-1; kc: (Hkv, L, Dk), vc: (Hkv, L, Dv) hold
    positions 0..L-1 with L = p0 + n. ``window`` > 0 limits each query to its last ``window``
    positions (sliding-window layers). Returns (n, H * Dv).
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
    masked = kpos > qpos
    if window:
        masked |= (qpos - kpos) >= window
    if masked.any():
        s[..., masked] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = np.matmul(s.reshape(Hkv, g * n, L), vc)  # (Hkv, g*n, Dv)
    return o.reshape(H, n, Dv).transpose(1, 0, 2).reshape(n, H * Dv)


# ----------------------------------------------------------------------------------------------
# the forward pass
# ----------------------------------------------------------------------------------------------
@dataclass
class Segment:
    """Tokens of one sequence inside a batch: appended to ``cache`` at ``cache.n_past``."""

    cache: KVCache
    n_tokens: int
    logits: str = "last"  # "last" | "all" | "none"


class Transformer:
    """Decoder-only transformer over mapped GGUF weights; subclasses define ``load_block``/``block``."""

    arch: str = ""

    def __init__(self, f: GGUFFile, backend: Any) -> None:
        self.file = f
        self.backend = backend
        self.cfg = read_config(f)
        self.configure(self.cfg)
        c = self.cfg
        self.tok_embd = tensor(f, "token_embd.weight", (c.n_vocab, c.n_embd))
        Linear(self.tok_embd)  # validates that its type can be dequantized (names the tensor if not)
        self.output_norm = vector(f, "output_norm.weight", c.n_embd)
        out = f.tensors.get("output.weight")
        self.output = Linear(out if out is not None else self.tok_embd)  # tied to the embedding when absent
        if (self.output.out_features, self.output.in_features) != (c.n_vocab, c.n_embd):
            raise GGUFError(f"{f.path}: {self.output.name} has shape {(self.output.out_features, self.output.in_features)}, "
                            f"expected ({c.n_vocab}, {c.n_embd}) to match the {c.n_vocab} rows of token_embd.weight")
        self.blocks = [self.load_block(i) for i in range(c.n_layer)]
        self.scale = c.attn_scale or 1.0 / math.sqrt(c.head_dim_k)
        # small ops: the backend's versions when it has them (native), numpy otherwise
        self.norm = getattr(backend, "rms_norm", rms_norm)
        self.rope = getattr(backend, "rope", apply_rope)
        self._attn_decode = getattr(backend, "attention_decode", None)
        self._attn_prefill = getattr(backend, "attention_prefill", None)
        self._act_mul = getattr(backend, "act_mul", None)
        self._backend_forward = getattr(backend, "forward", None)
        self._decode_layers = getattr(backend, "decode_layers", None)
        self.native_stack: Any = None  # set by a backend that runs decode steps natively
        prepare = getattr(backend, "prepare", None)
        if prepare is not None:  # e.g. repack weights for the backend's kernels, once
            prepare(self)

    # -- hooks ---------------------------------------------------------------------------------
    def configure(self, cfg: Config) -> None:
        """Architecture-specific metadata (RoPE style, windows, scales)."""

    def load_block(self, i: int) -> dict[str, Any]:
        raise NotImplementedError

    def native_layer_specs(self) -> list[dict[str, Any]] | None:
        """Each block described for a backend's fused decode step (see ``LayerStack`` in
        ``minirt.kernels.native``), or None when this architecture has no such description."""
        return None

    def _layer_spec(self, i: int, act: str, q_norm: Any = None, k_norm: Any = None, post_attn_norm: Any = None,
                    post_ffn_norm: Any = None) -> dict[str, Any]:
        """The common part of a block's description: sizes, RoPE/attention settings, weights."""
        b, c = self.blocks[i], self.cfg
        swa = c.swa_layers[i]
        return dict(n_embd=c.n_embd, n_ff=c.n_ff, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim_k=c.head_dim_k,
                    head_dim_v=c.head_dim_v, rope_dim=c.rope_dim, eps=c.rms_eps, attn_scale=self.scale,
                    softcap=c.attn_softcap, window=c.sliding_window if swa else 0, rope_neox=c.rope_neox, act=act,
                    local=swa, attn_norm=b["attn_norm"], ffn_norm=b["ffn_norm"], q_norm=q_norm, k_norm=k_norm,
                    post_attn_norm=post_attn_norm, post_ffn_norm=post_ffn_norm, wq=b["wq"], wk=b["wk"], wv=b["wv"],
                    wo=b["wo"], gate=b["gate"], up=b["up"], down=b["down"])

    def block(self, i: int, x: np.ndarray, ctx: "ForwardContext") -> np.ndarray:
        raise NotImplementedError

    # -- shared pieces ---------------------------------------------------------------------------
    def linears(self) -> list[Linear]:
        """Every quantized weight the forward pass streams (for backends that prepare them)."""
        out = [self.output]
        for b in self.blocks:
            out += [v for v in b.values() if isinstance(v, Linear)]
        return out

    def shift_cache(self, cache: KVCache, n_keep: int, n_discard: int) -> None:
        """Context shift: drop positions ``n_keep .. n_keep+n_discard-1`` and move the rest down.

        Cached keys carry RoPE of their old positions; rotating them by ``-n_discard`` positions
        (RoPE is a rotation, so rotations compose) gives exactly the keys of their new positions.
        """
        c = self.cfg
        n_past = cache.n_past
        src0 = n_keep + n_discard
        if not (0 <= n_keep and n_discard > 0 and src0 <= n_past):
            raise ValueError(f"invalid context shift keep={n_keep} discard={n_discard} of {n_past}")
        n_move = n_past - src0
        delta = np.full(n_move, -n_discard, dtype=np.int64)
        tables = {}
        for i in range(c.n_layer):
            swa = c.swa_layers[i]
            if swa not in tables:
                base = c.rope_base_swa if (swa and c.rope_base_swa) else c.rope_base
                tables[swa] = rope_cos_sin(delta, c, base)
            kc, vc = cache.layer(i)
            k = kc[:, src0:n_past].transpose(1, 0, 2).copy()  # (n_move, Hkv, Dk)
            apply_rope(k, *tables[swa], c.rope_neox, c.rope_dim)
            kc[:, n_keep:n_keep + n_move] = k.transpose(1, 0, 2)
            vc[:, n_keep:n_keep + n_move] = vc[:, src0:n_past].copy()
        cache.tokens[n_keep:n_keep + n_move] = cache.tokens[src0:n_past].copy()
        cache.n_past = n_keep + n_move

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """(T,) token ids → (T, d) float32, dequantizing only the rows used."""
        rows = self.tok_embd.data[ids]
        x = None
        dq = getattr(self.backend, "dequantize_rows", None)
        if dq is not None:
            x = dq(rows, self.tok_embd.qtype, self.cfg.n_embd)
        if x is None:
            from ..quants import dequantize

            x = dequantize(rows, self.tok_embd.qtype, (len(ids), self.cfg.n_embd))
        if self.cfg.embed_scale != 1.0:
            x *= np.float32(self.cfg.embed_scale)
        return x

    def gated(self, g: np.ndarray, u: np.ndarray, act: str) -> np.ndarray:
        """``act(g) * u`` of a gated MLP (act "silu" or "gelu_tanh"); may overwrite g."""
        if self._act_mul is not None:
            out = self._act_mul(g, u, act)
            if out is not None:
                return out
        return (silu(g) if act == "silu" else gelu_tanh(g)) * u

    def mm(self, lin: Linear, x: np.ndarray) -> np.ndarray:
        """x (T, in) → (T, out) through the quantized kernel, plus bias."""
        y = self.backend.matmul(x, lin)
        if lin.bias is not None:
            y += lin.bias
        return y

    def attend(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, ctx: "ForwardContext") -> np.ndarray:
        """RoPE q/k, append k/v to each sequence's cache, attend. q (T,H,Dk) k (T,Hkv,Dk) v (T,Hkv,Dv)."""
        c = self.cfg
        swa = c.swa_layers[i]
        cos, sin = ctx.rope_tables(swa)
        self.rope(q, cos, sin, c.rope_neox, c.rope_dim)
        self.rope(k, cos, sin, c.rope_neox, c.rope_dim)
        out = np.empty((q.shape[0], c.n_head * c.head_dim_v), dtype=np.float32)
        window = c.sliding_window if swa else 0
        for seg, s0, p0 in ctx.spans:
            n = seg.n_tokens
            kc, vc = seg.cache.layer(i)
            kc[:, p0:p0 + n] = k[s0:s0 + n].transpose(1, 0, 2)
            vc[:, p0:p0 + n] = v[s0:s0 + n].transpose(1, 0, 2)
            if n == 1 and self._attn_decode is not None:
                o = self._attn_decode(q[s0], kc, vc, p0 + 1, self.scale, window, c.attn_softcap)
                if o is not None:
                    out[s0] = o.reshape(-1)
                    continue
            elif n > 1 and self._attn_prefill is not None:
                o = self._attn_prefill(q[s0:s0 + n], kc, vc, p0, self.scale, window, c.attn_softcap)
                if o is not None:
                    out[s0:s0 + n] = o
                    continue
            lo = max(0, p0 - window + 1) if window else 0  # keys older than the window are never read
            out[s0:s0 + n] = attention(q[s0:s0 + n], kc[:, lo:p0 + n], vc[:, lo:p0 + n], p0 - lo,
                                       self.scale, window, c.attn_softcap)
        return out

    def forward(self, tokens: np.ndarray, segments: Sequence[Segment]) -> list[np.ndarray | None]:
        """Run ``tokens`` (T,) — the concatenated new tokens of each segment — through every layer.

        Each segment's cache grows by its token count. Returns per segment the logits it asked for:
        (n_vocab,) for "last", (n_tokens, n_vocab) for "all", None for "none".
        """
        fwd = self._backend_forward
        if fwd is not None:  # a device backend runs the whole pass where activations live (GPU)
            out = fwd(self, tokens, segments)
            if out is not None:
                return out
        ctx = ForwardContext(self, segments)
        x = self.embed(tokens)
        if not self._native_decode(x, ctx):
            for i in range(self.cfg.n_layer):
                x = self.block(i, x, ctx)
        for seg in segments:
            seg.cache.n_past += seg.n_tokens
        # only rows whose logits were asked for go through the (large) output matmul
        rows: list[int] = []
        for seg, s0, _ in ctx.spans:
            if seg.logits == "all":
                rows.extend(range(s0, s0 + seg.n_tokens))
            elif seg.logits == "last":
                rows.append(s0 + seg.n_tokens - 1)
        logits = None
        if rows:
            h = self.norm(x[rows], self.output_norm, self.cfg.rms_eps)
            logits = self.mm(self.output, h)
            if self.cfg.final_softcap:
                sc = np.float32(self.cfg.final_softcap)
                logits = np.tanh(logits / sc) * sc
        return split_logits(ctx.spans, logits)

    def _native_decode(self, x: np.ndarray, ctx: "ForwardContext") -> bool:
        """Decode steps (one new token per sequence): every layer in one backend call when the
        backend offers it; x (T, d) is updated in place. False: run the Python layers."""
        if self.native_stack is None or self._decode_layers is None:
            return False
        caches = []
        for seg, _, p0 in ctx.spans:
            k, v = getattr(seg.cache, "k", None), getattr(seg.cache, "v", None)
            if seg.n_tokens != 1 or not isinstance(k, np.ndarray) or not isinstance(v, np.ndarray):
                return False
            caches.append((k, v, p0))
        local = ctx.rope_tables(True) if any(self.cfg.swa_layers) else None
        return bool(self._decode_layers(self, x, caches, ctx.rope_tables(False), local))


def batch_spans(segments: Sequence["Segment"]) -> list[tuple["Segment", int, int]]:
    """(segment, row offset in the batch, first position) of each segment, in order; raises
    ContextOverflowError when a segment's new tokens do not fit its cache."""
    spans = []
    s0 = 0
    for seg in segments:
        p0 = seg.cache.n_past
        if p0 + seg.n_tokens > seg.cache.n_ctx:
            raise ContextOverflowError(
                f"{seg.n_tokens} new tokens at position {p0} exceed the context of {seg.cache.n_ctx} tokens")
        spans.append((seg, s0, p0))
        s0 += seg.n_tokens
    return spans


def split_logits(spans: Sequence[tuple[Any, int, int]], out: np.ndarray | None) -> list[np.ndarray | None]:
    """Each segment's share of ``out``, the logits of the rows asked for, in span order: (n, V) for
    ``logits="all"``, (V,) for ``"last"``, None for segments that asked for none."""
    res: list[np.ndarray | None] = []
    j = 0
    for seg, _, _ in spans:
        if seg.logits == "all":
            res.append(out[j:j + seg.n_tokens])
            j += seg.n_tokens
        elif seg.logits == "last":
            res.append(out[j])
            j += 1
        else:
            res.append(None)
    return res


class ForwardContext:
    """Per-call bookkeeping: where each segment's tokens sit in the batch and their positions."""

    def __init__(self, model: Transformer, segments: Sequence[Segment]) -> None:
        self.model = model
        self.spans = batch_spans(segments)  # (segment, row offset in batch, first position)
        pos = [np.arange(p0, p0 + seg.n_tokens) for seg, _, p0 in self.spans]
        self.positions = np.concatenate(pos) if pos else np.zeros(0, dtype=np.int64)
        self._rope: dict[bool, tuple[np.ndarray, np.ndarray]] = {}

    def rope_tables(self, swa: bool) -> tuple[np.ndarray, np.ndarray]:
        t = self._rope.get(swa)
        if t is None:
            c = self.model.cfg
            base = c.rope_base_swa if (swa and c.rope_base_swa) else c.rope_base
            t = self._rope[swa] = rope_cos_sin(self.positions, c, base)
        return t


# ----------------------------------------------------------------------------------------------
# registry of architectures
# ----------------------------------------------------------------------------------------------
ARCHITECTURES: dict[str, Callable[[GGUFFile, Any], Transformer]] = {}


def register(cls: type[Transformer]) -> type[Transformer]:
    ARCHITECTURES[cls.arch] = cls
    return cls


def build(f: GGUFFile, backend: Any) -> Transformer:
    """Instantiate the architecture named by ``general.architecture``."""
    from . import gemma3, llama, qwen2  # noqa: F401  (registration)

    arch = f.architecture
    cls = ARCHITECTURES.get(arch or "")
    if cls is None:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return cls(f, backend)
