"""Tiny random GGUF models written with gguf.GGUFWriter, plus an independent float64 reference
forward pass for them (written from the architectures' published definitions, sharing no code
with minirt)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT


def spm_vocab(w: gguf.GGUFWriter, n_extra: int = 0, specials: tuple[str, ...] = ()) -> int:
    """A minimal SentencePiece-style vocab: <unk> <s> </s>, 256 byte tokens, a few pieces, then
    ``specials`` as user-defined tokens (e.g. ``<think>``, as Qwen3's vocabulary has them)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁", "▁the", "▁a", "e", "t", "th", "▁capital", "▁of", "▁France", "?", "▁is", "▁Paris", "."]
    pieces += [f"▁w{i}" for i in range(max(0, n_extra - len(pieces)))]
    tokens += pieces + list(specials)
    types += [1] * len(pieces) + [4] * len(specials)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * len(specials)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    return len(tokens)


@dataclass
class TinySpec:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 96
    rope_base: float = 10000.0
    eps: float = 1e-5
    n_ctx: int = 256
    qtype: QT = QT.F32  # type of the 2-D weights
    rope_scale: float = 0.0  # linear scaling factor (0 = none)
    freq_factors: bool = False  # llama3-style rope_freqs.weight
    tied: bool = False
    bias: bool = False
    k_bias_outlier: float = 0.0  # with bias: the last two channels of each K head's bias get this value (Qwen2.5-like)
    # > 1: K rows of each RoPE pair scaled by qk_skew^u (u uniform in [-1, 1], per KV head and pair) and the
    # matching Q rows by its inverse: keys and queries of unequal channel sizes (what kv_balance evens out)
    qk_skew: float = 0.0
    seed: int = 0
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # float32 as stored (after quant round trip)
    specials: tuple[str, ...] = ()  # user-defined tokens appended to the vocabulary


def write_tiny(path: Path, spec: TinySpec) -> TinySpec:
    """Write a random model; ``spec.weights`` receives the exact float values the file holds."""
    rng = np.random.default_rng(spec.seed)
    w = gguf.GGUFWriter(str(path), spec.arch)
    n_vocab = spm_vocab(w, n_extra=40, specials=spec.specials)
    w.add_block_count(spec.n_layer)
    w.add_context_length(spec.n_ctx)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(spec.eps)
    w.add_rope_freq_base(spec.rope_base)
    hd = spec.n_embd // spec.n_head
    w.add_rope_dimension_count(hd)
    if spec.rope_scale:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(spec.rope_scale)

    def add(name: str, arr: np.ndarray, qtype: QT = QT.F32) -> None:
        arr = arr.astype(np.float32)
        if qtype == QT.F32 or arr.ndim == 1:
            w.add_tensor(name, arr)
            spec.weights[name] = arr
            return
        q = gguf.quants.quantize(arr, qtype)
        w.add_tensor(name, q, raw_dtype=qtype)
        spec.weights[name] = gguf.quants.dequantize(q, qtype).reshape(arr.shape).astype(np.float32)

    d, f, H, Hkv = spec.n_embd, spec.n_ff, spec.n_head, spec.n_head_kv
    add("token_embd.weight", rng.normal(0, 1, (n_vocab, d)), spec.qtype)
    add("output_norm.weight", 1 + 0.1 * rng.normal(size=d))
    if not spec.tied:
        add("output.weight", rng.normal(0, 0.3, (n_vocab, d)), spec.qtype)
    if spec.freq_factors:
        add("rope_freqs.weight", rng.uniform(1.0, 8.0, hd // 2))
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + 0.1 * rng.normal(size=d))
        wq, wk = rng.normal(0, 0.2, (H * hd, d)), rng.normal(0, 0.2, (Hkv * hd, d))
        if spec.qk_skew > 1:  # its own generator: the other weights stay those of the spec without it
            g = spec.qk_skew ** np.random.default_rng(spec.seed + 1000 + i).uniform(-1, 1, (Hkv, hd // 2))
            g = np.repeat(g, 2, axis=1)  # consecutive RoPE pairs (llama)
            wk = wk * g.reshape(-1, 1)
            wq = wq / np.repeat(g, H // Hkv, axis=0).reshape(-1, 1)
        add(p + "attn_q.weight", wq, spec.qtype)
        add(p + "attn_k.weight", wk, spec.qtype)
        add(p + "attn_v.weight", rng.normal(0, 0.2, (Hkv * hd, d)), spec.qtype)
        if spec.bias:
            add(p + "attn_q.bias", rng.normal(0, 0.1, H * hd))
            kb = rng.normal(0, 0.1, (Hkv, hd))
            if spec.k_bias_outlier:
                kb[:, -2:] = spec.k_bias_outlier
            add(p + "attn_k.bias", kb.reshape(-1))
            add(p + "attn_v.bias", rng.normal(0, 0.1, Hkv * hd))
        add(p + "attn_output.weight", rng.normal(0, 0.2, (d, H * hd)), spec.qtype)
        add(p + "ffn_norm.weight", 1 + 0.1 * rng.normal(size=d))
        add(p + "ffn_gate.weight", rng.normal(0, 0.2, (f, d)), spec.qtype)
        add(p + "ffn_up.weight", rng.normal(0, 0.2, (f, d)), spec.qtype)
        add(p + "ffn_down.weight", rng.normal(0, 0.2, (d, f)), spec.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return spec


def reference_llama(spec: TinySpec, ids: list[int], neox: bool = False) -> np.ndarray:
    """float64 forward of the Llama block (RMSNorm, RoPE, GQA causal attention, SwiGLU) → logits (T, V)."""
    W = {k: v.astype(np.float64) for k, v in spec.weights.items()}
    d, H, Hkv = spec.n_embd, spec.n_head, spec.n_head_kv
    hd = d // H
    T = len(ids)

    def norm(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + spec.eps) * g

    inv = spec.rope_base ** (-np.arange(0, hd, 2) / hd)
    if spec.freq_factors:
        inv = inv / W["rope_freqs.weight"]
    scale = 1.0 / spec.rope_scale if spec.rope_scale else 1.0
    ang = np.arange(T)[:, None] * inv[None, :] * scale  # (T, hd/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # (T, heads, hd)
        y = x.copy()
        if neox:
            a, b = x[..., : hd // 2], x[..., hd // 2:]
            y[..., : hd // 2], y[..., hd // 2:] = a * cos - b * sin, a * sin + b * cos
        else:
            a, b = x[..., 0::2], x[..., 1::2]
            y[..., 0::2], y[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return y

    x = W["token_embd.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q = h @ W[p + "attn_q.weight"].T + W.get(p + "attn_q.bias", 0)
        k = h @ W[p + "attn_k.weight"].T + W.get(p + "attn_k.bias", 0)
        v = h @ W[p + "attn_v.weight"].T + W.get(p + "attn_v.bias", 0)
        q, k, v = rope(q.reshape(T, H, hd)), rope(k.reshape(T, Hkv, hd)), v.reshape(T, Hkv, hd)
        o = np.zeros((T, H, hd))
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(hd) + mask
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o[:, hh] = pr @ v[:, kv]
        x = x + o.reshape(T, d) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g = h @ W[p + "ffn_gate.weight"].T
        u = h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    out = W["token_embd.weight"] if spec.tied else W["output.weight"]
    return norm(x, W["output_norm.weight"]) @ out.T
