"""The forward pass: the reference interpreter of a :class:`~minirt.blocks.ModelDesc`.

Step 4 of the pipeline. :class:`Transformer` runs any description layer by layer over a batch that
may mix several sequences, with the backend's operations (matmul, norms, RoPE, attention); a
backend that runs whole decode steps natively (``decode_layers``) or the whole pass on a device
(``forward``) takes over where it prepared itself for the description at load.

Shapes: ``T`` tokens in the batch, ``d`` = n_embd, ``H`` / ``Hkv`` query / KV heads, ``Dk`` / ``Dv``
head sizes. Activations are float32 row-major ``(T, features)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .blocks import (
    MLP,
    Block,
    GatedDeltaNet,
    Linear,
    Mamba2,
    ModelDesc,
    MoE,
    Norm,
    ParallelMixer,
    ParallelMoE,
    Rope,
    ShortConv,
    activation,
    apply_rope,
    l2_normalize,
    route,
    sigmoid,
)
from .errors import ContextOverflowError
from .kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass
class Config:
    """The hyperparameters the rest of the runtime sizes things by (KV cache, context, vocabulary)."""

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
    # per layer (n_head_kv, head_dim_k, head_dim_v) of its own cache, None for a layer reading another's;
    # None: every layer has the shape above
    kv_layers: tuple[tuple[int, int, int] | None, ...] | None = field(default=None, kw_only=True)
    # per layer whether its cache rows are attention keys / values (KVCache's rotate); None: every layer
    kv_rotate: tuple[bool, ...] | None = field(default=None, kw_only=True)
    # per layer the (n_head_kv, head_dim_k) constant a block-quantized cache takes off its keys
    # (Attention.key_offset), None for none; None: no layer has one
    kv_offsets: tuple[np.ndarray | None, ...] | None = field(default=None, kw_only=True, compare=False)
    # per layer the window of a causal sliding-window layer (0: full context); None: no such layer
    kv_windows: tuple[int, ...] | None = field(default=None, kw_only=True)
    # per layer the powers of two (n_head_kv, head_dim_k) a block-quantized cache scales its keys by
    # (minirt.kv_balance), None for none; None: the model was not balanced
    kv_scales: tuple[np.ndarray | None, ...] | None = field(default=None, kw_only=True, compare=False)
    # per layer the shapes of its per-sequence recurrent state (GatedDeltaNet / Mamba2 .state_shapes), None for a
    # layer without one; None: no layer has one
    recurrent: tuple[tuple[tuple[int, ...], ...] | None, ...] | None = field(default=None, kw_only=True)


def config_of(desc: ModelDesc) -> Config:
    """The :class:`Config` summary of a description; with layers of different KV shapes (or layers that
    share another's), the head counts and sizes are the largest and ``kv_layers`` has each layer's."""
    hkv, dk, dv = desc.kv_shape()
    layers = tuple(desc.kv_layers())
    rot = tuple(desc.kv_rotate())
    offsets = tuple(desc.key_offsets())
    windows = tuple(desc.kv_windows())
    n_head = next((b.attn.n_head for b in desc.blocks if hasattr(b.attn, "n_head")), 0)
    # the first block's feed-forward width (a Nemotron-H block may have none)
    n_ff = next((b.mlp.n_ff for b in desc.blocks if b.mlp is not None), 0)
    return Config(arch=desc.arch, n_layer=len(desc.blocks), n_embd=desc.n_embd, n_ff=n_ff,
                  n_head=n_head, n_head_kv=hkv, head_dim_k=dk, head_dim_v=dv, n_vocab=desc.n_vocab,
                  n_ctx_train=desc.n_ctx_train,
                  kv_layers=None if all(s == (hkv, dk, dv) for s in layers) else layers,
                  kv_rotate=None if all(rot) else rot,
                  kv_offsets=None if all(o is None for o in offsets) else offsets,
                  kv_windows=windows if any(windows) else None,
                  recurrent=tuple(desc.recurrent_states()) if any(desc.recurrent_states()) else None)


def kv_cache_for(cfg: Config, n_ctx: int, type_k: str | None = None, type_v: str | None = None) -> KVCache:
    """An empty cache of ``n_ctx`` positions laid out for the model ``cfg`` summarises."""
    return KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim_k, cfg.head_dim_v, n_ctx, type_k=type_k, type_v=type_v,
                   layers=cfg.kv_layers, rotate=cfg.kv_rotate, key_offsets=cfg.kv_offsets, windows=cfg.kv_windows,
                   key_scales=cfg.kv_scales, recurrent=cfg.recurrent)


@dataclass
class Segment:
    """Tokens of one sequence inside a batch: appended to ``cache`` at ``cache.n_past``."""

    cache: KVCache
    n_tokens: int
    logits: str = "last"  # "last" | "all" | "none"


class Transformer:
    """A decoder described by ``desc``, run with ``backend``'s operations over mapped GGUF weights."""

    def __init__(self, desc: ModelDesc, backend: Any, file: Any = None) -> None:
        self.desc = desc
        self.file = file
        self.backend = backend
        self.cfg = config_of(desc)
        self.arch = desc.arch
        self.native_stack: Any = None  # set by a backend that runs decode steps natively
        # called as probe(layer, cache_layer, q (T, H, Dk), k (T, Hkv, Dk) or None) with each layer's
        # queries and keys as attention sees them (minirt.kv_balance measures them); None: not called
        self.probe: Any = None
        self.lora: Any = None  # minirt.lora.LoraSet: adapters applied next to each matmul (attach_lora)
        self.ropes = desc.ropes()  # distinct RoPE variants, in the order the fused decode step indexes them
        backend.prepare(self)  # e.g. repack weights for the backend's kernels, once

    def set_kv_scales(self, scales: Sequence[np.ndarray | None] | None) -> None:
        """Set the key scales of block-quantized caches made for this model from now on
        (``cfg.kv_scales``, :mod:`minirt.kv_balance`), and the native decode step's."""
        self.cfg = replace(self.cfg, kv_scales=None if scales is None or all(s is None for s in scales)
                           else tuple(scales))
        if self.native_stack is not None:
            self.native_stack.set_key_scales(self.cfg.kv_scales)

    def attach_lora(self, adapters: Sequence[Any]) -> None:
        """Run with these LoRA adapters (:mod:`minirt.lora`) from now on. The fused native decode step
        knows no adapters: decode then runs layer by layer."""
        from .errors import UnsupportedArchitectureError
        from .lora import LoraSet

        # a mixture of experts runs inside the backend (router, experts and shared expert together)
        moe = {lin.source[0] for b in self.desc.blocks if isinstance(b.mlp, MoE) for lin in b.mlp.linears()}
        for ad in adapters:
            hit = sorted(moe & set(ad.pairs))
            if hit:
                raise UnsupportedArchitectureError(f"{ad.path}: LoRA on mixture-of-experts tensors ({hit[0]}) is "
                                                   "not supported")
        self.lora = LoraSet(adapters) if adapters else None
        if self.lora is not None and self.native_stack is not None:
            self.native_stack = None
            log.info("LoRA adapters: decode runs layer by layer (the fused native step has no adapters)")

    # -- shared pieces ---------------------------------------------------------------------------
    def linears(self) -> list[Linear]:
        """Every quantized weight the forward pass streams (for backends that prepare them)."""
        return self.desc.linears()

    @property
    def output(self) -> Linear:
        return self.desc.output

    def norm(self, x: np.ndarray, n: Norm | None) -> np.ndarray:
        """``n`` applied over the last axis of x (..., n); None: x itself."""
        if n is None:
            return x
        if n.kind == "rms":
            return self.backend.rms_norm(x, n.weight, n.eps)
        return self.backend.layer_norm(x, n.weight, n.bias, n.eps)

    def mm(self, lin: Linear, x: np.ndarray) -> np.ndarray:
        """x (T, in) → (T, out) through the quantized kernel, plus bias."""
        y = self.backend.matmul(x, lin)
        if lin.bias is not None:
            y += lin.bias
        if self.lora is not None:
            self.lora.add_linear(y, x, lin)
        return y

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """(T,) token ids → (T, d) float32, dequantizing only the rows used."""
        t, out = self.desc.tok_embd, self.desc.output
        x = self.backend.embedding_rows(t.data, t.qtype, self.desc.n_embd, ids, out if out.name == t.name else None)
        if self.lora is not None:
            self.lora.add_embedding(x, ids, t.name)
        if self.desc.embed_scale != 1.0:
            x *= np.float32(self.desc.embed_scale)
        return x

    # -- one block ---------------------------------------------------------------------------------
    def block(self, i: int, x: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        b = self.desc.blocks[i]
        s = np.float32(b.residual_scale)
        h = self.norm(x, b.attn_norm)
        a = self.attention(i, b, h, ctx)
        if not b.norm_residual:
            a = self.norm(a, b.post_attn_norm)
        if b.parallel:
            m = self.norm(self.mlp(b, h), b.post_ffn_norm)
            return x + s * (a + m) if s != 1 else x + a + m
        if b.norm_residual:  # post-norm (BERT): the norms normalize the residual sums
            x = self.norm(x + a if s == 1 else x + s * a, b.post_attn_norm)
            m = self.mlp(b, self.norm(x, b.ffn_norm))
            return self.norm(x + m if s == 1 else x + s * m, b.post_ffn_norm)
        x = x + s * a if s != 1 else x + a
        if b.mlp is not None:
            m = self.norm(self.mlp(b, self.norm(x, b.ffn_norm)), b.post_ffn_norm)
            x = x + s * m if s != 1 else x + m
        if b.per_layer is not None:
            g = b.per_layer
            h = activation(g.act, self.mm(g.gate, x)) * ctx.per_layer[:, i]
            x = x + self.norm(self.mm(g.proj, h), g.post_norm)
        if b.out_scale != 1.0:
            x *= np.float32(b.out_scale)
        return x

    def _qk_norm(self, a: Any, q: np.ndarray, k: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """q (T, H, Dk), k (T, Hkv, Dk) (None: a layer reading another's keys) through their norms,
        per head or over the whole projection."""
        def one(x: np.ndarray | None, n: Norm | None) -> np.ndarray | None:
            if x is None:
                return None
            if a.qk_norm_per_head:
                return self.norm(x, n)
            return self.norm(x.reshape(x.shape[0], -1), n).reshape(x.shape)

        return one(q, a.q_norm), one(k, a.k_norm)

    def mlp(self, b: Block, h: np.ndarray) -> np.ndarray:
        m = b.mlp
        if isinstance(m, MoE):
            return self.backend.moe(h, m)
        if isinstance(m, ParallelMoE):
            return self.parallel_moe(m, h)
        return self.dense(m, h)

    def parallel_moe(self, m: ParallelMoE, x: np.ndarray) -> np.ndarray:
        """Gemma 4's dense MLP and experts side by side on the residual x (T, d) → (T, d)."""
        y = self.norm(self.dense(m.mlp, self.norm(x, m.pre_1)), m.post_1)
        r = m.moe.router
        ids, w = route(self.mm(r.gate, self.norm(x, m.router_norm) * m.router_scale), r)
        w *= m.expert_scale[ids]
        e = self.backend.moe_experts(np.ascontiguousarray(self.norm(x, m.pre_2)), m.moe, ids, w)
        return y + self.norm(e, m.post_2)

    def dense(self, m: MLP, h: np.ndarray) -> np.ndarray:
        """A dense MLP of h (T, d)."""
        u = self.mm(m.up, h)
        if m.gate is None:
            return self.mm(m.down, self.backend.activation(u, m.act, m.act_params))
        return self.mm(m.down, self.backend.act_mul(self.mm(m.gate, h), u, m.act))

    def short_conv(self, i: int, c: ShortConv, h: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """LFM2's gated short convolution of the normed input h (T, d) → (T, d); each segment's
        ``B·x`` rows are appended to its cache (layer i) and the convolution reads the ``taps − 1``
        rows before the segment from there (in the cache's K type; its own rows exact)."""
        T, d = h.shape
        bcx = self.mm(c.in_proj, h)
        B, C, x = bcx[:, :d], bcx[:, d:2 * d], bcx[:, 2 * d:]
        bx = B * x
        H, L = c.cache_heads, c.taps
        y = np.empty((T, d), dtype=np.float32)
        for seg, s0, p0 in ctx.spans:
            n = seg.n_tokens
            cache = seg.cache
            cache.store(i, p0, bx[s0:s0 + n].reshape(n, H, d // H).transpose(1, 0, 2), None)
            lo = max(0, p0 - (L - 1))
            # the rows before this call as stored, this call's own exact (as the fused decode step reads them)
            before = cache.read(i, lo, p0)[0].transpose(1, 0, 2).reshape(-1, d)
            pad = np.zeros((lo - (p0 - (L - 1)), d), np.float32)  # zeros before position 0
            rows = np.concatenate([pad, before, bx[s0:s0 + n]])  # (taps − 1 + n, d)
            y[s0:s0 + n] = C[s0:s0 + n] * self.backend.causal_conv(rows, c.weight)
        return self.mm(c.out_proj, y)

    def delta_net(self, i: int, g: GatedDeltaNet, h: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """Qwen3.5's gated delta-net of the normed input h (T, d) → (T, d): each segment continues from the
        convolution inputs and delta-rule state its cache keeps for layer i (:meth:`KVCache.state`) and
        leaves them there after its last token (a snapshot after its next-to-last too, see
        :meth:`KVCache.snapshot`)."""
        T = h.shape[0]
        Hk, Hv, Dk, Dv, L = g.n_k_heads, g.n_v_heads, g.head_dim_k, g.head_dim_v, g.taps
        mixed = self.mm(g.qkv_proj, h)  # (T, conv_dim)
        z = self.mm(g.z_proj, h).reshape(T, Hv, Dv)
        if g.ba_proj is not None:  # per key head: its value heads' beta rows, then their alpha rows
            ba = self.mm(g.ba_proj, h).reshape(T, Hk, 2, Hv // Hk)
            b_in, a_in = ba[:, :, 0].reshape(T, Hv), ba[:, :, 1].reshape(T, Hv)
        else:
            b_in, a_in = self.mm(g.beta_proj, h), self.mm(g.alpha_proj, h)  # type: ignore[arg-type]
        beta = sigmoid(b_in)  # (T, Hv)
        decay = np.exp(g.a * np.logaddexp(0.0, a_in + g.dt_bias)).astype(np.float32)
        o = np.empty((T, Hv, Dv), dtype=np.float32)
        for seg, s0, p0 in ctx.spans:
            n = seg.n_tokens
            conv_state, S = seg.cache.state(i)
            rows = np.concatenate([conv_state, mixed[s0:s0 + n]])  # (taps − 1 + n, conv_dim)
            x = self.backend.activation(self.backend.causal_conv(rows, g.conv), "silu")  # (n, conv_dim)
            q = l2_normalize(x[:, :Hk * Dk].reshape(n, Hk, Dk), g.norm.eps)
            k = l2_normalize(x[:, Hk * Dk:2 * Hk * Dk].reshape(n, Hk, Dk), g.norm.eps)
            v = x[:, 2 * Hk * Dk:].reshape(n, Hv, Dv)
            rep = Hv // Hk  # value head j reads key head j mod Hk (tiled) or j // rep (grouped)
            if g.grouped:
                q, k = np.repeat(q, rep, axis=1) * np.float32(1.0 / np.sqrt(Dk)), np.repeat(k, rep, axis=1)
            else:
                q, k = np.tile(q, (1, rep, 1)) * np.float32(1.0 / np.sqrt(Dk)), np.tile(k, (1, rep, 1))
            dr, bt = decay[s0:s0 + n], beta[s0:s0 + n]
            o[s0:s0 + n] = _recur(seg.cache, i, p0, rows, L, S, self.backend.delta_rule, (q, k, v, dr, bt))
            conv_state[:] = rows[n:]
        # silu(z) * norm(o) through the backend's gated activation (numpy's silu took ~10 % of a prefill)
        y = self.backend.act_mul(np.ascontiguousarray(z.reshape(T, Hv * Dv)), self.norm(o, g.norm).reshape(T, Hv * Dv),
                                 "silu")
        return self.mm(g.out_proj, y)

    def mamba2(self, i: int, m: Mamba2, h: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """Mamba-2's mixer of the normed input h (T, d) → (T, d): each segment continues from the convolution
        inputs and SSM state its cache keeps for layer i and leaves them there (a snapshot before its last
        token too), as :meth:`delta_net` does."""
        T = h.shape[0]
        H, P, N, G, L, di, cd = m.n_head, m.head_dim, m.d_state, m.n_group, m.taps, m.d_inner, m.conv_dim
        zxbcdt = self.mm(m.in_proj, h)  # (T, 2·d_inner + 2·G·N + H)
        z, xbc = zxbcdt[:, :di], zxbcdt[:, di:di + cd]
        dt = np.logaddexp(np.float32(0.0), zxbcdt[:, di + cd:] + m.dt_bias).astype(np.float32)  # softplus, (T, H)
        y = np.empty((T, H, P), dtype=np.float32)

        def scan(S: np.ndarray, x: np.ndarray, d: np.ndarray, B: np.ndarray, C: np.ndarray) -> np.ndarray:
            return self.backend.ssm_scan(S, x, d, m.a, B, C)

        for seg, s0, p0 in ctx.spans:
            n = seg.n_tokens
            conv_state, S = seg.cache.state(i)
            rows = np.concatenate([conv_state, xbc[s0:s0 + n]])  # (taps − 1 + n, conv_dim)
            xs = self.backend.activation(self.backend.causal_conv(rows, m.conv, m.conv_bias), "silu")
            x = np.ascontiguousarray(xs[:, :di].reshape(n, H, P))
            B = np.ascontiguousarray(xs[:, di:di + G * N].reshape(n, G, N))
            C = np.ascontiguousarray(xs[:, di + G * N:].reshape(n, G, N))
            d = dt[s0:s0 + n]
            y[s0:s0 + n] = _recur(seg.cache, i, p0, rows, L, S, scan, (x, d, B, C))
            y[s0:s0 + n] += x * m.d_skip[:, None]
            conv_state[:] = rows[n:]
        g = self.backend.act_mul(np.ascontiguousarray(z), y.reshape(T, di), "silu")  # gated, then RMS per group
        if m.norm is not None:
            g = self.backend.rms_norm(g.reshape(T * G, di // G), None, m.norm.eps).reshape(T, di) * m.norm.weight
        return self.mm(m.out_proj, g)

    def attention(self, i: int, b: Block, h: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """Block i's mixer of the normed input h (T, d) → (T, d): attention or what takes its place."""
        a = b.attn
        if isinstance(a, ShortConv):
            return self.short_conv(i, a, h, ctx)
        if isinstance(a, GatedDeltaNet):
            return self.delta_net(i, a, h, ctx)
        if isinstance(a, Mamba2):
            return self.mamba2(i, a, h, ctx)
        if isinstance(a, ParallelMixer):
            return self.attend(i, a.attn, h, ctx) + self.mamba2(i, a.ssm, h, ctx)
        return self.attend(i, a, h, ctx)

    def attend(self, i: int, a: Any, h: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """Projections, q/k norms, RoPE, cache append (layer i) and attention of the normed input h (T, d) → (T, d)."""
        T = h.shape[0]
        q = self.mm(a.wq, h)
        gate = None
        if a.out_gate:  # per head: its query, then its output gate
            qg = q.reshape(T, a.n_head, a.head_dim_k + a.head_dim_v)
            q, gate = qg[:, :, :a.head_dim_k], qg[:, :, a.head_dim_k:].reshape(T, -1)
        q = q.reshape(T, a.n_head, a.head_dim_k)
        k = v = None  # a layer with kv_source reads what that layer stored for these positions
        if a.kv_source is None:
            k = self.mm(a.wk, h).reshape(T, a.n_head_kv, a.head_dim_k)
            v = self.mm(a.wv, h).reshape(T, a.n_head_kv, a.head_dim_v)
            if a.v_norm is not None:
                v = self.norm(v, a.v_norm)
        if not a.qk_norm_after_rope:
            q, k = self._qk_norm(a, q, k)
        q = np.ascontiguousarray(q)
        k = None if k is None else np.ascontiguousarray(k)
        if a.rope is not None:
            cos, sin = ctx.rope_tables(a.rope)
            self.backend.rope(q, cos, sin, a.rope.neox, a.rope.dim)
            if k is not None:
                self.backend.rope(k, cos, sin, a.rope.neox, a.rope.dim)
        if a.qk_norm_after_rope:
            q, k = self._qk_norm(a, q, k)
        if self.probe is not None:
            self.probe(i, i if a.kv_source is None else a.kv_source, q, k)
        out = np.empty((T, a.n_head * a.head_dim_v), dtype=np.float32)
        for seg, s0, p0 in ctx.spans:
            n = seg.n_tokens
            cache = seg.cache
            if k is not None:
                cache.store(i, p0, k[s0:s0 + n].transpose(1, 0, 2), v[s0:s0 + n].transpose(1, 0, 2))
            src = i if a.kv_source is None else a.kv_source
            kc, vc = cache.layer(src)
            qs = cache.rotate_queries(src, q[s0:s0 + n])  # the basis the stored keys are in
            if a.sinks is not None:
                o = self.backend.attention_sinks(qs, kc, vc, p0, a.scale, a.window, a.softcap, a.sinks,
                                                 kv_types=cache.types)
            else:  # causal False: the whole sequence is in this call (checked by encode)
                o = self.backend.attention(qs, kc, vc, p0, a.scale, a.window, a.softcap, causal=a.causal,
                                           kv_types=cache.types)
            out[s0:s0 + n] = cache.unrotate_output(src, o)
        if gate is not None:
            out *= sigmoid(gate)
        return self.mm(a.wo, out)

    # -- the whole pass ----------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, segments: Sequence[Segment]) -> list[np.ndarray | None]:
        """Run ``tokens`` (T,) — the concatenated new tokens of each segment — through every layer.

        Each segment's cache grows by its token count. Returns per segment the logits it asked for:
        (n_vocab,) for "last", (n_tokens, n_vocab) for "all", None for "none".
        """
        check = getattr(self.file, "check_intact", None)
        if check is not None:  # a mapped file truncated since load: a typed error, not SIGBUS in a kernel
            check()
        out = self.backend.forward(self, tokens, segments)  # a device backend runs the whole pass
        if out is not None:
            return out
        ctx = ForwardContext(self, segments)
        x = self.inputs(tokens, ctx)
        try:
            if not self._native_decode(x, ctx):
                for i in range(len(self.desc.blocks)):
                    x = self.block(i, x, ctx)
        except BaseException:
            for seg in segments:  # a recurrent state may be half-updated: only its snapshot stays usable
                seg.cache.step_failed()
            raise
        for seg in segments:
            seg.cache.n_past += seg.n_tokens
            seg.cache.step_done(seg.n_tokens)
            seg.cache.release_stale()  # sliding-window layers: rows no query reads any more
        # only rows whose logits were asked for go through the (large) output matmul
        rows = logit_rows(ctx.spans)
        logits = self.head(x[rows]) if rows else None
        return split_logits(ctx.spans, logits)

    def inputs(self, tokens: np.ndarray, ctx: ForwardContext) -> np.ndarray:
        """The first block's input (T, d): token embeddings plus, for encoders, position and
        token-type embeddings and the embedding norm."""
        x = self.embed(tokens)
        d = self.desc
        if d.pos_embd is not None:
            pos = ctx.positions
            if len(pos) and int(pos.max()) >= d.pos_embd.shape[0]:
                raise ContextOverflowError(f"position {int(pos.max())} is beyond the {d.pos_embd.shape[0]} "
                                           "position embeddings of the model")
            x += self.backend.dequantize_rows(d.pos_embd.data[pos], d.pos_embd.qtype, d.n_embd)
        if d.type_embd is not None:
            x += d.type_embd[0]  # every token is of type 0 ("sentence A"), as llama.cpp feeds them
            if self.lora is not None:  # (llama.cpp leaves the type embedding's adapter out; jina's model applies it)
                x += self.lora.row_delta("token_types.weight", 0, d.n_embd)
        if d.per_layer_inputs is not None:
            ctx.per_layer = self.per_layer_inputs(tokens, x)
        return self.norm(x, d.embd_norm)

    def per_layer_inputs(self, tokens: np.ndarray, x0: np.ndarray) -> np.ndarray:
        """Gemma 4's per-layer inputs (T, n_layer, width) of tokens (T,) whose first block input is x0 (T, d)."""
        p = self.desc.per_layer_inputs
        T, L = len(tokens), len(self.desc.blocks)
        proj = self.mm(p.model_proj, x0)
        proj *= np.float32(p.proj_scale)
        proj = self.norm(proj.reshape(T, L, p.width), p.norm)
        t = p.tok_embd
        e = self.backend.dequantize_rows(t.data[tokens], t.qtype, L * p.width).reshape(T, L, p.width)
        out = proj + e * np.float32(p.embd_scale)
        out *= np.float32(p.input_scale)
        return out

    def encode(self, tokens: np.ndarray, segments: Sequence[Segment]) -> np.ndarray:
        """Final hidden states (T, d) after the output norm of ``tokens`` (T,), the concatenated
        tokens of each segment (embedding models; no logits). Non-causal models need each sequence
        whole in one call: every segment must start at position 0."""
        ctx = ForwardContext(self, segments)
        if not self.desc.causal and any(p0 for _, _, p0 in ctx.spans):
            raise ContextOverflowError("a bidirectional model needs each sequence in one pass (starting at 0)")
        x = self.inputs(tokens, ctx)
        try:
            for i in range(len(self.desc.blocks)):
                x = self.block(i, x, ctx)
        except BaseException:
            for seg in segments:
                seg.cache.step_failed()
            raise
        for seg in segments:
            seg.cache.n_past += seg.n_tokens
            seg.cache.step_done(seg.n_tokens)
        return self.norm(x, self.desc.output_norm)

    def head(self, x: np.ndarray) -> np.ndarray:
        """Final norm, output matmul, logit scale and soft-cap of rows x (n, d) → (n, n_vocab)."""
        d = self.desc
        logits = self.mm(d.output, self.norm(x, d.output_norm))
        if d.logit_scale != 1.0:
            logits *= np.float32(d.logit_scale)
        if d.final_softcap:
            sc = np.float32(d.final_softcap)
            logits = np.tanh(logits / sc) * sc
        return logits

    def _native_decode(self, x: np.ndarray, ctx: ForwardContext) -> bool:
        """Decode steps (one new token per sequence): every layer in one backend call when the
        backend prepared that; x (T, d) is updated in place. False: run the layers here."""
        if self.native_stack is None:
            return False
        caches = []
        for seg, _, p0 in ctx.spans:
            k, v = getattr(seg.cache, "k", None), getattr(seg.cache, "v", None)
            if seg.n_tokens != 1 or not isinstance(k, np.ndarray) or not isinstance(v, np.ndarray):
                return False
            cache = seg.cache
            states = [cache.state(i) if sh is not None else None for i, sh in enumerate(cache.recurrent)] \
                if cache.has_state else None
            caches.append((k, v, p0, cache.types, states))
        tables = [ctx.rope_tables(r) for r in self.ropes]
        if ctx.per_layer is None:
            return bool(self.backend.decode_layers(self, x, caches, tables))
        return bool(self.backend.decode_layers(self, x, caches, tables, per_layer=ctx.per_layer))

    def shift_cache(self, cache: KVCache, n_keep: int, n_discard: int) -> None:
        """Context shift: drop positions ``n_keep .. n_keep+n_discard-1`` and move the rest down.

        Cached keys carry RoPE of their old positions; rotating them by ``-n_discard`` positions
        (RoPE is a rotation, so rotations compose) gives exactly the keys of their new positions.
        """
        if cache.has_state:
            raise ContextOverflowError(
                f"the context of {cache.n_ctx} tokens is full and this model's recurrent (linear-attention) "
                "state cannot be shifted: use a larger n_ctx or context_overflow='stop'")
        n_past = cache.n_past
        src0 = n_keep + n_discard
        if not (0 <= n_keep and n_discard > 0 and src0 <= n_past):
            raise ValueError(f"invalid context shift keep={n_keep} discard={n_discard} of {n_past}")
        n_move = n_past - src0
        delta = np.full(n_move, -n_discard, dtype=np.int64)
        tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        for i, b in enumerate(self.desc.blocks):
            if b.attn.kv_source is not None:  # moved with the layer it reads
                continue
            kc, vc = cache.layer(i)
            r = b.attn.rope
            if r is not None:  # quantized keys: dequantize, rotate, quantize again (as llama.cpp does)
                k = cache.read(i, src0, n_past)[0].transpose(1, 0, 2).copy()  # (n_move, Hkv, Dk) float32
                if r.key() not in tables:
                    tables[r.key()] = r.cos_sin(delta, magnitude=False)
                apply_rope(k, *tables[r.key()], r.neox, r.dim)
                cache.store(i, n_keep, k.transpose(1, 0, 2), None)
            else:  # stored rows move as they are
                kc[:, n_keep:n_keep + n_move] = kc[:, src0:n_past].copy()
            vc[:, n_keep:n_keep + n_move] = vc[:, src0:n_past].copy()
        cache.tokens[n_keep:n_keep + n_move] = cache.tokens[src0:n_past].copy()
        cache.n_past = n_keep + n_move
        cache.stale_after_shift(n_keep, n_discard)


def _recur(cache: KVCache, i: int, p0: int, rows: np.ndarray, taps: int, S: np.ndarray,
           step: Callable[..., np.ndarray], per_token: tuple[np.ndarray, ...]) -> np.ndarray:
    """A recurrent layer's outputs for a segment's n tokens at positions p0.. of layer i: ``step(S, *arrays)``
    advances the state S over the tokens of the ``per_token`` arrays (n, ...) it is given and returns their
    outputs. With n > 1 it runs over the first n − 1 tokens, the state then (convolution inputs from ``rows``,
    (taps − 1 + n, conv_dim), and S) becomes the cache's snapshot — a prompt's reusable prefix
    (CachePool.acquire) — and it runs over the last token."""
    n = rows.shape[0] - (taps - 1)
    if n <= 1:
        return step(S, *per_token)
    m = n - 1
    first = step(S, *(a[:m] for a in per_token))
    cache.snapshot(i, p0 + m, rows[m:m + taps - 1], S)
    return np.concatenate([first, step(S, *(a[m:] for a in per_token))])


def batch_spans(segments: Sequence[Segment]) -> list[tuple[Segment, int, int]]:
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


def logit_rows(spans: Sequence[tuple[Any, int, int]]) -> list[int]:
    """Batch rows whose logits the segments asked for, in span order."""
    rows: list[int] = []
    for seg, s0, _ in spans:
        if seg.logits == "all":
            rows.extend(range(s0, s0 + seg.n_tokens))
        elif seg.logits == "last":
            rows.append(s0 + seg.n_tokens - 1)
    return rows


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
    """Per-call bookkeeping: where each segment's tokens sit in the batch, their positions, and the
    RoPE tables of those positions (computed once per call for each distinct RoPE variant)."""

    def __init__(self, model: Transformer, segments: Sequence[Segment]) -> None:
        self.model = model
        self.spans = batch_spans(segments)  # (segment, row offset in batch, first position)
        pos = [np.arange(p0, p0 + seg.n_tokens) for seg, _, p0 in self.spans]
        self.positions = np.concatenate(pos) if pos else np.zeros(0, dtype=np.int64)
        self.per_layer: np.ndarray | None = None  # (T, n_layer, width): per-layer inputs, set by Transformer.inputs
        self._rope: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def rope_tables(self, rope: Rope) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) of this call's positions, (T, rope.dim / 2) each."""
        key = rope.key()
        t = self._rope.get(key)
        if t is None:
            t = self._rope[key] = rope.cos_sin(self.positions)
        return t
