"""Regenerate the per-architecture reference fixtures under ``tests/data/archs/``.

For every architecture in :data:`ARCHS` this script

1. builds a tiny, randomly initialised model from the transformers config class (seeded; no
   weights are downloaded) and saves it with a tiny tokenizer (a SentencePiece model trained here,
   or a byte-level BPE ``tokenizer.json``);
2. converts it with llama.cpp's own ``convert_hf_to_gguf.py`` (``--outtype f16``) and makes Q8_0 and
   Q4_K_M copies with ``llama-quantize``;
3. computes logits at every position of a few random token sequences with transformers (float32,
   eager attention) and with llama.cpp (Python binding, ``logits_all=True``) for each GGUF;
4. writes ``<arch>/model-{f16,q8_0,q4_k_m}.gguf``, ``<arch>/ref.npz`` and ``<arch>/meta.json``.

It needs torch + transformers, the ``gguf`` package from the vendored llama.cpp tree, sentencepiece,
tokenizers and the ``llama_cpp`` binding; the repository's tests need none of them.  See
``tools/arch_fixtures/README.md`` for the exact command.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("make_fixtures")

HIDDEN = 256          # a multiple of 256 so the K-quants apply to every row
FFN = 256           # small enough that all fixtures stay near 100 MB
N_SEQ = 3
SEQ_LEN = 48          # every sliding window below is shorter than this
QUANTS = ("q8_0", "q4_k_m")

# --------------------------------------------------------------------------------------------------
# architectures: HF config class, model class, config overrides, tokenizer kind
# --------------------------------------------------------------------------------------------------

GEMMA_SPECIALS = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}
LLAMA_SPECIALS = {"unk": 0, "bos": 1, "eos": 2}


def _common(vocab: int = 512, layers: int = 2, heads: int = 4, kv: int = 2, head_dim: int = 64,
            tied: bool = False, hidden: int = HIDDEN) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=FFN, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                max_position_embeddings=4096, tie_word_embeddings=tied)


def _layer_types(n: int, pattern: int) -> list[str]:
    """``pattern - 1`` sliding layers then one full-attention layer, repeated (Gemma 3 / Cohere 2 style)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def _gemma4_kw(layers: int, **extra: Any) -> dict[str, Any]:
    """Gemma 4 fixtures' shared config: sliding (window 16) / full layers alternating, global head_dim 128
    with "proportional" partial RoPE, final softcap 30, GELU-tanh, tied."""
    return dict(_common(layers=layers, tied=True), rms_norm_eps=1e-6, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                global_head_dim=128, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1000000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, **extra)


def _granite_layer_names(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 saves Granite 4.0-H's layer types as linear / full attention; the released checkpoints
    (and llama.cpp's converter) name them mamba / attention."""
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    cfg["layer_types"] = [names.get(t, t) for t in cfg["layer_types"]]
    return cfg


def _bamba_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The released Bamba checkpoints name their rotary width ``attn_rotary_emb`` (what llama.cpp's converter
    reads); transformers 5 keeps it as rope_parameters.partial_rotary_factor."""
    rp = cfg.get("rope_parameters") or {}
    cfg["attn_rotary_emb"] = int(cfg["head_dim"] * rp.get("partial_rotary_factor", 1.0))
    return cfg


_NEMOTRON_CODES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                   "moe": "E"}
_NEMOTRON_MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "moe_shared_expert_intermediate_size", "n_shared_experts", "moe_latent_size",
                      "moe_shared_expert_overlap", "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob")


def _nemotron_pattern(cfg: dict[str, Any]) -> dict[str, Any]:
    """The released Nemotron-H checkpoints describe their layers with ``hybrid_override_pattern`` (M: Mamba-2,
    *: attention, -: MLP, E: experts), which llama.cpp's converter reads (and transformers still loads); a dense
    model's config has no MoE keys (the converter takes ``num_experts_per_tok`` for a mixture of experts)."""
    types = cfg.pop("layers_block_type", None) or cfg.pop("layer_types")
    cfg["hybrid_override_pattern"] = "".join(_NEMOTRON_CODES[t] for t in types)
    cfg["num_hidden_layers"] = len(types)
    if "moe" not in types:
        for k in _NEMOTRON_MOE_KEYS:
            cfg.pop(k, None)
    return cfg


def ROUTER(name: str) -> dict[str, float]:  # noqa: N802 (reads like a constant in the table)
    """Router weights x8 (logits with a standard deviation of about 4 over the experts, as trained
    routers are decisive): with N(0, 0.05) routers the top-k choice is a near tie at many positions
    and every rounding error of either runtime sends a token to other experts."""
    return {name: 8.0}


ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(
        config="LlamaConfig", model="LlamaForCausalLM", tokenizer="bpe", pre="llama-bpe",
        features="GQA 4/2, llama3 rope scaling (rope_freqs.weight), BPE vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-5, max_position_embeddings=131072,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192})),
    "llama_tied": dict(
        config="LlamaConfig", model="LlamaForCausalLM", tokenizer="spm",
        features="GQA 4/1, tied output, plain rope (theta 10000), SentencePiece vocab",
        kwargs=dict(_common(layers=2, kv=1, tied=True), rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2": dict(
        config="Qwen2Config", model="Qwen2ForCausalLM", tokenizer="bpe", pre="qwen2",
        features="GQA 4/2, q/k/v bias, BPE vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen2_yarn": dict(
        config="Qwen2Config", model="Qwen2ForCausalLM", tokenizer="bpe", pre="qwen2",
        features="as qwen2 with YaRN rope scaling as Qwen2.5's model cards enable it (factor 4, original 32768, context 131072, "
                 "HF's default beta 32/1 and truncation; attention factor 0.1 ln 4 + 1)",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-6, max_position_embeddings=131072,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                     "rope_theta": 1000000.0})),
    "qwen3": dict(
        config="Qwen3Config", model="Qwen3ForCausalLM", tokenizer="bpe", pre="qwen2",
        features="GQA 4/2, per-head q/k RMSNorm, head_dim 64 with 4 heads, tied output, BPE vocab",
        kwargs=dict(_common(layers=2, tied=True), rms_norm_eps=1e-6, attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gemma3": dict(
        config="Gemma3TextConfig", model="Gemma3ForCausalLM", tokenizer="spm", specials=GEMMA_SPECIALS,
        features="7 layers: 5 sliding (window 16), 1 global, 1 sliding (llama.cpp's fixed pattern 6), "
                 "linear rope factor 8 on global layers only (theta 1e6), local theta 10000, "
                 "q/k norm, pre+post norms, GQA 4/2, tied, SentencePiece vocab",
        kwargs=dict(_common(layers=7, tied=True), rms_norm_eps=1e-6, sliding_window=16,
                    layer_types=_layer_types(7, 6), query_pre_attn_scalar=64,
                    hidden_activation="gelu_pytorch_tanh",
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1000000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "mistral": dict(
        config="MistralConfig", model="MistralForCausalLM", tokenizer="spm",
        features="GQA 4/2, no sliding window (as Mistral v0.2+ ship; see README: the converter drops a window), "
                 "SentencePiece vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-5, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "phi3": dict(
        config="Phi3Config", model="Phi3ForCausalLM", tokenizer="spm", n_ctx=256,
        # llama.cpp's vocabulary loader looks these up by text for files named phi3
        spm_control=["<|endoftext|>", "<|end|>"],
        features="fused qkv and gate_up, GQA 4/2, partial rotary 0.75, LongRoPE short/long factors "
                 "(original ctx 32 < T: long factors in both HF and llama.cpp), SentencePiece vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-5, partial_rotary_factor=0.75,
                    original_max_position_embeddings=32,
                    rope_parameters="phi3_longrope")),
    "phi3_short": dict(
        config="Phi3Config", model="Phi3ForCausalLM", tokenizer="spm", n_ctx=256,
        spm_control=["<|endoftext|>", "<|end|>"],
        features="as phi3 but original ctx 4096 > T and > n_ctx (max 131072): short factors in both HF and "
                 "llama.cpp, attention factor sqrt(1 + ln 32 / ln 4096)",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-5, partial_rotary_factor=0.75,
                    max_position_embeddings=131072, original_max_position_embeddings=4096,
                    rope_parameters="phi3_longrope")),
    "gemma": dict(
        config="GemmaConfig", model="GemmaForCausalLM", tokenizer="spm", specials=GEMMA_SPECIALS,
        features="MQA 4/1, GELU-tanh MLP, embedding scale sqrt(d), (1+w) norms, tied, SentencePiece vocab",
        kwargs=dict(_common(layers=2, kv=1, tied=True), rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gemma2": dict(
        config="Gemma2Config", model="Gemma2ForCausalLM", tokenizer="spm", specials=GEMMA_SPECIALS,
        features="4 layers alternating sliding (window 16) / global, attention softcap 50, final softcap 30, "
                 "pre+post norms, query_pre_attn_scalar 64, GQA 4/2, tied, SentencePiece vocab",
        kwargs=dict(_common(layers=4, tied=True), rms_norm_eps=1e-6, sliding_window=16,
                    layer_types=_layer_types(4, 2), query_pre_attn_scalar=64,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    hidden_activation="gelu_pytorch_tanh",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "granite": dict(
        config="GraniteConfig", model="GraniteForCausalLM", tokenizer="bpe", pre="refact",
        features="embedding x12, residual x0.22, attention scale 1/64 (not 1/sqrt(hd)), logits /4, GQA 4/2, "
                 "tied, BPE vocab",
        kwargs=dict(_common(layers=2, tied=True), rms_norm_eps=1e-5, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=4.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "olmo2": dict(
        config="Olmo2Config", model="Olmo2ForCausalLM", tokenizer="bpe", pre="dbrx",
        features="post-attention/post-MLP norms only (no pre-norms), q/k RMSNorm over the whole projection, "
                 "GQA 4/2, BPE vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "smollm3": dict(
        config="SmolLM3Config", model="SmolLM3ForCausalLM", tokenizer="bpe", pre="llama-bpe",
        features="4 layers, every 4th layer NoPE (no_rope_layer_interval 4, llama.cpp's fixed step), "
                 "GQA 4/2, tied, BPE vocab",
        kwargs=dict(_common(layers=4, tied=True), rms_norm_eps=1e-6, no_rope_layer_interval=4,
                    use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0})),
    "glm4": dict(
        config="Glm4Config", model="Glm4ForCausalLM", tokenizer="bpe", pre="chatglm-bpe",
        features="partial rotary 0.5 (interleaved pairs), q/k/v bias, post-attention and post-MLP norms, "
                 "fused gate_up, GQA 4/2, BPE vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-5, attention_bias=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.5})),
    "cohere2": dict(
        config="Cohere2Config", model="Cohere2ForCausalLM", tokenizer="bpe", pre="command-r",
        features="4 layers: 3 sliding (window 16, interleaved rope) : 1 global NoPE, parallel attention+MLP "
                 "with one LayerNorm (no bias), logit_scale 0.25, GQA 4/2, tied, BPE vocab",
        kwargs=dict(_common(layers=4, tied=True), layer_norm_eps=1e-5, sliding_window=16,
                    layer_types=_layer_types(4, 4), logit_scale=0.25, rotary_pct=1.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    "exaone4": dict(
        config="Exaone4Config", model="Exaone4ForCausalLM", tokenizer="bpe", pre="exaone4",
        features="post-norms only (no pre-norms), q/k RMSNorm, GQA 4/2, no sliding window (as EXAONE 4.0 1.2B "
                 "ships; llama.cpp applies the LLLG window/NoPE pattern only to 64-layer files, see README), BPE vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-5, sliding_window=None,
                    layer_types=["full_attention"] * 2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "seed_oss": dict(
        config="SeedOssConfig", model="SeedOssForCausalLM", tokenizer="bpe", pre="qwen2",
        features="q/k/v bias, no output bias, GQA 4/2, BPE vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-6, attention_bias=True, attention_out_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0})),
    "ernie4_5": dict(
        config="Ernie4_5Config", model="Ernie4_5ForCausalLM", tokenizer="spm",
        features="interleaved rope, GQA 4/2, no biases, tied, SentencePiece vocab",
        kwargs=dict(_common(layers=2, tied=True), rms_norm_eps=1e-5, use_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "hunyuan_dense": dict(
        config="HunYuanDenseV1Config", model="HunYuanDenseV1ForCausalLM", tokenizer="bpe", pre="hunyuan",
        features="NTK-alpha rope (alpha 1000, folded into the base by the converter), q/k RMSNorm after rope, "
                 "GQA 4/2, tied, BPE vocab",
        kwargs=dict(_common(layers=2, tied=True), rms_norm_eps=1e-5, max_position_embeddings=32768,
                    rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                     "rope_theta": 10000.0})),
    "apertus": dict(
        config="ApertusConfig", model="ApertusForCausalLM", tokenizer="bpe", pre="llama-bpe",
        features="xIELU MLP (no gate), q/k RMSNorm, llama3 rope scaling, GQA 4/2, BPE vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-5, max_position_embeddings=65536,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192})),
    # mixtures of experts: hidden 128 (head size 32) keeps the files small (the K-quants then fall back
    # to llama-quantize's 32-block types); qwen3moe has hidden 256 so that its experts are Q4_K / Q6_K
    "qwen2moe": dict(
        config="Qwen2MoeConfig", model="Qwen2MoeForCausalLM", no_repack=True, scale=ROUTER("mlp.gate.weight"), tokenizer="bpe", pre="qwen2",
        features="4 experts top-2 (softmax, not renormalised), expert FFN 128, shared expert FFN 256 with "
                 "sigmoid gate, q/k/v bias, GQA 4/2, hidden 128, BPE vocab",
        kwargs=dict(_common(layers=2, head_dim=32, hidden=128), rms_norm_eps=1e-6, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                    norm_topk_prob=False, qkv_bias=True, decoder_sparse_step=1, mlp_only_layers=[],
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3moe": dict(
        config="Qwen3MoeConfig", model="Qwen3MoeForCausalLM", no_repack=True, scale=ROUTER("mlp.gate.weight"), tokenizer="bpe", pre="qwen2",
        features="4 experts top-2 (softmax, renormalised as Qwen3-30B-A3B), expert FFN 256, per-head q/k "
                 "RMSNorm, GQA 4/2, hidden 256 (K-quant experts), BPE vocab",
        kwargs=dict(_common(layers=2), rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=256, norm_topk_prob=True, attention_bias=False, decoder_sparse_step=1,
                    mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "olmoe": dict(
        config="OlmoeConfig", model="OlmoeForCausalLM", no_repack=True, scale=ROUTER("mlp.gate.weight"), tokenizer="bpe", pre="olmo",
        features="8 experts top-2 (softmax, not renormalised), expert FFN 128, q/k RMSNorm over the whole "
                 "projection, MHA 4/4 (llama.cpp's olmoe sizes the k norm by n_embd), hidden 128, BPE vocab",
        kwargs=dict(_common(layers=2, kv=4, head_dim=32, hidden=128), intermediate_size=128, rms_norm_eps=1e-5,
                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "granitemoe": dict(
        config="GraniteMoeConfig", model="GraniteMoeForCausalLM", no_repack=True, scale=ROUTER("router.layer.weight"), tokenizer="bpe", pre="refact",
        features="4 experts top-2 (softmax over the top-2), expert FFN 128, embedding x12, residual x0.22, "
                 "attention scale 1/32, logits /4, GQA 4/2, hidden 128, tied, BPE vocab",
        kwargs=dict(_common(layers=2, head_dim=32, hidden=128, tied=True), intermediate_size=128,
                    rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=0.03125, logits_scaling=4.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gpt_oss": dict(
        config="GptOssConfig", model="GptOssForCausalLM", no_repack=True, scale=ROUTER("mlp.router.weight"), tokenizer="bpe", pre="gpt-4o",
        extra_quants=("mxfp4_moe",),  # how gpt-oss ships: MXFP4 experts, the rest Q8_0
        features="2 layers: sliding (window 16) then full, attention sinks, q/k/v/o biases, YaRN rope "
                 "(factor 32, original 4096), 4 biased experts top-2 (softmax over the chosen logits), clamped "
                 "SwiGLU (alpha 1.702, limit 7), expert FFN 128, GQA 4/2, hidden 128, BPE vocab",
        kwargs=dict(_common(layers=2, head_dim=32, hidden=128), intermediate_size=128, rms_norm_eps=1e-5,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], attention_bias=True,
                    swiglu_limit=7.0,
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096,
                                     "rope_theta": 150000.0})),
    "lfm2": dict(
        config="Lfm2Config", model="Lfm2ForCausalLM", tokenizer="bpe", pre="lfm2",
        features="6 layers conv, conv, full, conv, full, conv: gated short convolutions (3 taps) between GQA 4/2 "
                 "attention layers with per-head q/k RMSNorm, FFN auto-adjusted (768 -> 512, multiple of 256), "
                 "tied, BPE vocab",
        kwargs=dict(_common(layers=6, tied=True), intermediate_size=768, norm_eps=1e-5, conv_L_cache=3,
                    conv_bias=False, block_auto_adjust_ff_dim=True, block_multiple_of=256,
                    block_ffn_dim_multiplier=1.0,
                    layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "lfm2moe": dict(
        config="Lfm2MoeConfig", model="Lfm2MoeForCausalLM", no_repack=True, tokenizer="bpe", pre="lfm2",
        # sigmoid routing: x8 routers saturate most experts' scores near 1 (near ties again); x3 spreads them
        scale={"feed_forward.gate.weight": 3.0}, buffers={"expert_bias": 0.1},
        features="LFM2-MoE (LFM2-8B-A1B layout): 4 layers conv, full, conv, full; layer 0 dense (FFN 512), "
                 "then 4 experts top-2 of FFN 256 with sigmoid routing, a selection bias (expert_bias) and "
                 "renormalised weights; GQA 4/2 with per-head q/k RMSNorm, tied, BPE vocab",
        kwargs=dict(_common(layers=4, tied=True), intermediate_size=512, moe_intermediate_size=256, norm_eps=1e-5,
                    conv_L_cache=3, conv_bias=False, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                    use_expert_bias=True, routed_scaling_factor=1.0, norm_topk_prob=True,
                    layer_types=["conv", "full_attention", "conv", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3.5: gated delta-net layers between gated attention layers; 2 key heads / 4 value heads so the
    # converter's tiled value-head order (value head j reads key head j mod 2) is exercised
    "qwen35": dict(
        config="Qwen3_5TextConfig", model="Qwen3_5ForCausalLM", tokenizer="bpe", pre="qwen35",
        convert_args=("--no-mtp",),  # a model made from a config has no multi-token-prediction layer
        features="4 layers linear, linear, full, linear: gated delta-net (conv 4 taps, 2 key heads / 4 value "
                 "heads of 32) and gated attention (sigmoid output gate from q_proj, per-head q/k RMSNorm, "
                 "partial rotary 0.25, multi-section rope), (1 + w) norms, GQA 4/2, BPE vocab",
        kwargs=dict(_common(layers=4), rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [3, 3, 2], "mrope_interleaved": True})),
    "qwen35moe": dict(
        config="Qwen3_5MoeTextConfig", model="Qwen3_5MoeForCausalLM", no_repack=True, scale=ROUTER("mlp.gate.weight"),
        tokenizer="bpe", pre="qwen35", convert_args=("--no-mtp",),
        features="as qwen35 (linear, full, linear, full) with 4 experts top-2 (softmax, renormalised), expert FFN "
                 "256, shared expert FFN 256 with sigmoid gate, BPE vocab",
        kwargs=dict(_common(layers=4), rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                    shared_expert_intermediate_size=256,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [3, 3, 2], "mrope_interleaved": True})),
    "qwen3next": dict(
        config="Qwen3NextConfig", model="Qwen3NextForCausalLM", no_repack=True, scale=ROUTER("mlp.gate.weight"),
        tokenizer="bpe", pre="qwen2", convert_args=("--no-mtp",),
        features="Qwen3-Next: linear, linear, linear, full; gated delta-net with the converter's reordered qkvz "
                 "(value head j reads key head j // 2) and fused beta/alpha rows, gated attention with per-head "
                 "q/k RMSNorm (1 + w norms), partial RoPE 0.25; 4 experts top-2 (softmax, renormalised), expert "
                 "FFN 256, shared expert FFN 256 with sigmoid gate, BPE vocab",
        kwargs=dict(_common(layers=4), rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                    shared_expert_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[],
                    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                     "partial_rotary_factor": 0.25})),
    # Granite 4.0-H: Mamba-2 layers between attention layers without positions (position_embedding_type None,
    # which the converter writes as rope.scaling.finetuned false); Granite's four multipliers
    "granitehybrid": dict(
        config="GraniteMoeHybridConfig", model="GraniteMoeHybridForCausalLM", no_repack=True,
        scale=ROUTER("router.layer.weight"), tokenizer="bpe", pre="refact", config_fix=_granite_layer_names,
        features="Granite 4.0-H-Tiny layout: 4 layers mamba, mamba, attention, mamba; Mamba-2 mixers (8 heads of "
                 "64, 2 groups, state 32, conv 4 taps with bias, D skip, gated grouped RMSNorm), attention without "
                 "RoPE (GQA 4/2); 4 experts top-2 (softmax, renormalised, FFN 128) plus a shared expert (FFN 256); "
                 "embedding x12, residual x0.22, attention scale 1/64, logits /4, tied, BPE vocab",
        kwargs=dict(_common(layers=4, tied=True), intermediate_size=128, shared_intermediate_size=256,
                    rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=1 / 64, logits_scaling=4.0,
                    position_embedding_type=None, layer_types=["mamba", "mamba", "attention", "mamba"],
                    mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=32, mamba_d_head=64, mamba_d_conv=4,
                    mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False)),
    "granitehybrid_dense": dict(
        config="GraniteMoeHybridConfig", model="GraniteMoeHybridForCausalLM", tokenizer="bpe", pre="refact",
        config_fix=_granite_layer_names,
        features="Granite 4.0-H-Micro layout (no experts): 4 layers attention, mamba, mamba, mamba; Mamba-2 mixers "
                 "(16 heads of 32, 1 group, state 64, conv 4 taps with bias), attention without RoPE (GQA 4/1); "
                 "dense SwiGLU MLP (FFN 512, the converter's ffn_gate/up/down); embedding x4, residual x0.5, "
                 "attention scale 1/32, logits /2, untied, BPE vocab",
        kwargs=dict(_common(layers=4, kv=1), intermediate_size=512, shared_intermediate_size=512,
                    rms_norm_eps=1e-5, num_local_experts=0, num_experts_per_tok=0, embedding_multiplier=4.0,
                    residual_multiplier=0.5, attention_multiplier=1 / 32, logits_scaling=2.0,
                    position_embedding_type=None, layer_types=["attention", "mamba", "mamba", "mamba"],
                    mamba_n_heads=16, mamba_n_groups=1, mamba_d_state=64, mamba_d_head=32, mamba_d_conv=4,
                    mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False)),
    # Bamba: the same file architecture (granitehybrid) with RoPE on its attention layers and no multipliers
    "bamba": dict(
        config="BambaConfig", model="BambaForCausalLM", tokenizer="bpe", pre="refact", config_fix=_bamba_rope,
        features="Bamba-9B layout (converted to granitehybrid): 4 layers mamba, mamba, attention, mamba; Mamba-2 "
                 "mixers (8 heads of 64, 2 groups, state 32, conv 4 taps with bias); attention with RoPE over the "
                 "whole head (rope.scaling.finetuned true; Bamba-9B's half-head RoPE is not reproduced: llama.cpp's "
                 "converter permutes q/k over the whole head, so its file disagrees with transformers there), GQA "
                 "4/2; dense SwiGLU MLP (FFN 256), untied, BPE vocab",
        kwargs=dict(_common(layers=4), rms_norm_eps=1e-5, attn_layer_indices=[2],
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0),
                    mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=32, mamba_d_head=64, mamba_d_conv=4,
                    mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False)),
    # Nemotron-H: one mixer or feed-forward per layer (Mamba-2, attention without positions, relu² MLP, experts)
    "nemotron_h": dict(
        config="NemotronHConfig", model="NemotronHForCausalLM", tokenizer="bpe", pre="refact",
        config_fix=_nemotron_pattern, raw_config=True,
        features="Nemotron-H / Nemotron Nano 2 layout: 8 layers M - M * - M M - (Mamba-2: 8 heads of 64, 2 groups, "
                 "state 32, conv 4 taps with bias; attention without RoPE, GQA 4/2; relu² MLP of 512 without gate), "
                 "consecutive Mamba layers, untied, BPE vocab",
        kwargs=dict(_common(layers=8), intermediate_size=512, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
                    layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "mamba", "mlp"],
                    ssm_state_size=32, mamba_num_heads=8, mamba_head_dim=64, n_groups=2, conv_kernel=4, expand=2,
                    use_conv_bias=True, mamba_proj_bias=False, use_mamba_kernels=False)),
    # pure Mamba-2: every layer a pre-norm Mamba-2 mixer, nothing else
    "mamba2": dict(
        config="Mamba2Config", model="Mamba2ForCausalLM", tokenizer="bpe", pre="gpt-2",
        features="Mamba-2 layout (state-spaces mamba2 / Mamba-Codestral): 3 layers of Mamba-2 mixers only (8 heads "
                 "of 64, 2 groups, state 32, conv 4 taps with bias, gated grouped RMSNorm), untied, BPE vocab",
        kwargs=dict(vocab_size=512, hidden_size=HIDDEN, num_hidden_layers=3, num_heads=8, head_dim=64, expand=2,
                    n_groups=2, state_size=32, conv_kernel=4, use_conv_bias=True, use_bias=False,
                    layer_norm_epsilon=1e-5, tie_word_embeddings=False)),
    "nemotron_h_moe": dict(
        config="NemotronHConfig", model="NemotronHForCausalLM", no_repack=True, tokenizer="bpe", pre="refact",
        config_fix=_nemotron_pattern, raw_config=True, scale={"mixer.gate.weight": 3.0}, buffers={"e_score_correction_bias": 0.1},
        features="Nemotron 3 Nano layout: 7 layers M E M * E M E (Mamba-2: 8 heads of 64, 2 groups, state 32); "
                 "experts: 4 of FFN 128 top-2, relu² without gate, sigmoid router with a selection bias, "
                 "renormalised, scaled x2.5, a relu² shared expert of 256; attention without RoPE, GQA 4/2, "
                 "untied, BPE vocab",
        kwargs=dict(_common(layers=7), intermediate_size=512, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
                    layers_block_type=["mamba", "moe", "mamba", "attention", "moe", "mamba", "moe"],
                    ssm_state_size=32, mamba_num_heads=8, mamba_head_dim=64, n_groups=2, conv_kernel=4, expand=2,
                    use_conv_bias=True, mamba_proj_bias=False, use_mamba_kernels=False, n_routed_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
                    n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer; the converter folds the µP multipliers
    # into the weights, so non-trivial ones check that folding against transformers' runtime multiplications
    "falcon_h1": dict(
        config="FalconH1Config", model="FalconH1ForCausalLM", tokenizer="bpe", pre="refact",
        features="3 layers, each attention (GQA 4/2, NEOX RoPE) + Mamba-2 (8 heads of 64, 2 groups, state 32, conv 4 "
                 "taps with bias, no SSM norm) on the same normed input, summed, then a SwiGLU MLP; µP multipliers "
                 "(embedding x3, lm head x0.5, MLP 0.8/1.2, key 0.7, attention in 1.1 / out 0.9, SSM in 1.2 / out 0.8, "
                 "z/x/B/C/dt 1.0/0.5/1.3/0.9/1.1) folded by the converter; untied, BPE vocab",
        kwargs=dict(_common(layers=3), intermediate_size=512, rms_norm_eps=1e-5, mamba_d_ssm=512, mamba_n_heads=8,
                    mamba_d_head=64, mamba_n_groups=2, mamba_d_state=32, mamba_d_conv=4, mamba_conv_bias=True,
                    mamba_proj_bias=False, mamba_rms_norm=False, lm_head_multiplier=0.5, embedding_multiplier=3.0,
                    mlp_multipliers=[0.8, 1.2], key_multiplier=0.7, attention_in_multiplier=1.1,
                    attention_out_multiplier=0.9, ssm_multipliers=[1.0, 0.5, 1.3, 0.9, 1.1], ssm_in_multiplier=1.2,
                    ssm_out_multiplier=0.8, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "gemma4": dict(
        config="Gemma4TextConfig", model="Gemma4ForCausalLM", tokenizer="hf_spm", specials=GEMMA_SPECIALS,
        # attention scale is 1 (q/k are RMS-normed): q/k norm weights ~1/3 keep q.k ~ N(0, 1) instead of a
        # near one-hot softmax that turns every rounding error into a different attention pattern
        scale={"self_attn.q_norm": 0.33, "self_attn.k_norm": 0.33},
        features="6 layers s,f,s,f,s,f (window 16; pattern written to the GGUF), sliding head_dim 64 / global "
                 "head_dim 128, global rope 'proportional' partial 0.25 theta 1e6 (rope_freqs.weight), local theta "
                 "10000, per-layer token embeddings (64 per layer), last 2 layers reuse earlier KV, double-wide MLP "
                 "on KV-shared layers, q/k/v norms (q/k norm weights ~0.33), final softcap 30, tied, gemma4 vocab",
        # llama.cpp's KV reuse takes the last non-shared layer as full and the one before as sliding
        kwargs=_gemma4_kw(6, vocab_size_per_layer_input=512, hidden_size_per_layer_input=64, num_kv_shared_layers=2,
                          use_double_wide_mlp=True, attention_k_eq_v=False)),
    "gemma4moe": dict(
        config="Gemma4TextConfig", model="Gemma4ForCausalLM", tokenizer="hf_spm", specials=GEMMA_SPECIALS,
        no_repack=True,
        # the router reads its input times d^-0.5: x64 (not ROUTER's x8) gives logits of std ~3, decisive
        scale={"self_attn.q_norm": 0.33, "self_attn.k_norm": 0.33, "router.proj.weight": 64.0},
        features="Gemma 4 MoE (26B-A4B layout): 4 layers s,f,s,f (window 16), sliding head_dim 64 / global 128, "
                 "proportional partial rope on global layers; every layer a dense GeGLU MLP (FFN 256) beside 4 "
                 "experts top-2 (FFN 256) with their own pre/post norms, the router on the RMS-normed residual "
                 "(scale vector, d^-0.5), softmax, renormalised, per-expert scales; final softcap 30, tied, "
                 "gemma4 vocab",
        kwargs=_gemma4_kw(4, hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_k_eq_v=False,
                          enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=256)),
}
# Nemotron 3 Super: Nemotron 3 Nano's layout with latent experts (they read latent_down · x, their sum goes
# through latent_up), 5 layers
ARCHS["nemotron_h_moe_latent"] = dict(
    ARCHS["nemotron_h_moe"],
    features="Nemotron 3 Super layout: 5 layers M E * E M (Mamba-2: 8 heads of 64, 2 groups, state 32); "
             "latent experts (latent width 128 of 256): 4 of FFN 128 top-2, relu² without gate, sigmoid "
             "router with a selection bias, renormalised, scaled x2.5, a relu² shared expert of 256 on the "
             "full width; attention without RoPE, GQA 4/2, untied, BPE vocab",
    kwargs=dict(ARCHS["nemotron_h_moe"]["kwargs"], num_hidden_layers=5,
                layers_block_type=["mamba", "moe", "attention", "moe", "mamba"],
                moe_latent_size=128))


def _phi3_rope(kw: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE parameters with distinct short and long factors for the rotary half-dims."""
    rot = int(kw["head_dim"] * kw["partial_rotary_factor"])
    rng = np.random.default_rng(3)
    short = (1.0 + 0.5 * rng.random(rot // 2)).round(4).tolist()
    long = np.linspace(1.0, 16.0, rot // 2).round(4).tolist()
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": kw["original_max_position_embeddings"]}


# --------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------

def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text (syllable words, digits, punctuation) to train a tiny vocabulary on."""
    rng = random.Random(seed)
    syl = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "qu", "ng"]
    words = ["".join(rng.choice(syl) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    lines = []
    for _ in range(n_lines):
        ws = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws)), str(rng.randint(0, 9999)))
        line = " ".join(ws)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "!", "?", ",", ";"]))
    return lines


def write_spm(out: Path, vocab: int, specials: dict[str, int], control: list[str]) -> None:
    """Train a SentencePiece BPE model with byte fallback (the Llama/Gemma layout) of exactly ``vocab`` pieces.

    ``control`` adds control pieces a converter or llama.cpp looks up by text (Phi-3's ``<|endoftext|>``).
    """
    import sentencepiece as spm
    buf = io.BytesIO()
    ids = {f"{k}_id": -1 for k in ("pad", "eos", "bos", "unk")}
    ids.update({f"{k}_id": v for k, v in specials.items()})
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=vocab, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, num_threads=1, split_digits=True,
        add_dummy_prefix=True, normalization_rule_name="identity", minloglevel=2,
        control_symbols=control or None, **ids)
    (out / "tokenizer.model").write_bytes(buf.getvalue())


BPE_SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|pad|>", "<|user|>"]


def write_bpe(out: Path, vocab: int, extra: tuple[str, ...] = ()) -> dict[str, int]:
    """Train a byte-level BPE ``tokenizer.json`` of ``vocab`` entries, the last ones the ``extra``
    words as added (non-special) tokens; returns the special token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(extra), special_tokens=BPE_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if extra:
        tok.add_tokens([w for w in extra if tok.token_to_id(w) is None])
    assert tok.get_vocab_size() <= vocab, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=BPE_SPECIALS[0], bos_token=BPE_SPECIALS[1],
                                   pad_token=BPE_SPECIALS[2])
    fast.save_pretrained(str(out))
    return {"eos": 0, "bos": 1, "pad": 2}


def write_hf_spm(out: Path, vocab: int, specials: dict[str, int]) -> None:
    """A SentencePiece-style BPE ``tokenizer.json`` (byte fallback, ``\u2581`` spaces; Gemma 4's layout).

    The pieces come from a SentencePiece model trained as in :func:`write_spm`; the merges are every
    split of a piece into two pieces, ranked by the piece's id (what transformers' extractor does).
    """
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    tmp = out / "_spm"
    tmp.mkdir()
    write_spm(tmp, vocab, specials, [])
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "tokenizer.model"))
    shutil.rmtree(tmp)
    pieces = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, i in pieces.items():
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i):
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in pieces and b in pieces:
                merges.append((i, pieces[a], pieces[b], a, b))
    merges.sort()
    unk = sp.id_to_piece(specials["unk"])
    tok = Tokenizer(models.BPE(vocab=pieces, merges=[(a, b) for *_, a, b in merges], unk_token=unk,
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    names = {k: sp.id_to_piece(v) for k, v in specials.items()}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in names.items()})
    fast.save_pretrained(str(out))


# --------------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------------

def reinit(model, seed: int, scale: dict[str, float] | None = None) -> None:
    """Random weights with enough scale that logits are not flat.

    Matrices get N(0, 0.05) (logits then have a standard deviation of about 0.8 over the vocabulary), biases
    N(0, 0.05), and every other vector (norm weights, scalars) keeps its default value plus N(0, 0.1)
    noise: ones for ``w * x`` norms, zeros for Gemma's ``(1 + w) * x`` norms, so both conventions are
    exercised around their neutral point. ``scale`` multiplies the parameters whose name contains a key
    (after the above), e.g. q/k norm weights where attention has no 1/sqrt(d) scale.
    """
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            else:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            for key, factor in (scale or {}).items():
                if key in name:
                    p.mul_(factor)


def build_hf(spec: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    """Build, re-initialise and save the tiny HF model plus its tokenizer; returns the config dict."""
    import torch
    import transformers
    kw = json.loads(json.dumps(spec["kwargs"]))
    if kw.get("rope_parameters") == "phi3_longrope":
        kw["rope_parameters"] = _phi3_rope(kw)
    vocab = kw["vocab_size"]
    if spec["tokenizer"] == "spm":
        specials = spec.get("specials", LLAMA_SPECIALS)
        write_spm(out, vocab, specials, spec.get("spm_control", []))
    elif spec["tokenizer"] == "hf_spm":
        specials = spec.get("specials", LLAMA_SPECIALS)
        write_hf_spm(out, vocab, specials)
    else:
        specials = write_bpe(out, vocab)
    kw.update(bos_token_id=specials["bos"], eos_token_id=specials["eos"], pad_token_id=specials.get("pad"))
    config = getattr(transformers, spec["config"])(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model"])(config).to(torch.float32)
    reinit(model, seed, spec.get("scale"))
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():  # buffers the file carries (e.g. LFM2-MoE's expert selection bias): N(0, sd)
        for key, sd in (spec.get("buffers") or {}).items():
            for name, b in sorted(model.named_buffers()):
                if key in name:
                    b.copy_(torch.randn(b.shape, generator=gen) * sd)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    fix = spec.get("config_fix")
    if fix is not None:  # the config.json layout the released checkpoints use (and the converter reads)
        cfg = fix(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


def hf_logits(spec: dict[str, Any], model_dir: Path, tokens: np.ndarray) -> np.ndarray:
    """transformers' float32 eager forward over each whole sequence: (n_seq, T, V) logits."""
    import torch
    import transformers
    cls = getattr(transformers, spec["model"])
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)), use_cache=False).logits
    return out.float().numpy()


# --------------------------------------------------------------------------------------------------
# llama.cpp
# --------------------------------------------------------------------------------------------------

_CONVERT = r"""
import os, runpy, sys
llama_dir, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, llama_dir)
if pre:
    # the tiny BPE vocabulary matches none of the converter's known pre-tokenizer hashes: name the
    # pre-tokenizer instead of hashing; weights and all other metadata are the converter's own
    import conversion.base as cb
    cb.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
if os.environ.get("FIXTURE_RAW_CONFIG"):
    # read config.json as written, as the converter does when transformers cannot load it (the released
    # Nemotron-H configs before transformers 5): AutoConfig would rewrite the layer pattern into a list
    # and add MoE defaults that make the converter take a dense model for a mixture of experts
    import json, pathlib
    import conversion.base as cb
    cb.ModelBase.load_hparams = staticmethod(
        lambda d, is_mistral_format=False: json.loads((pathlib.Path(d) / "config.json").read_text(encoding="utf-8")))
sys.argv = [llama_dir + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(llama_dir + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(llama_dir: Path, model_dir: Path, out: Path, pre: str | None, extra: tuple[str, ...] = (),
            raw_config: bool = False) -> None:
    """``convert_hf_to_gguf.py --outtype f16`` (with the pre-tokenizer named for BPE vocabularies);
    ``extra``: more converter options (the spec's ``convert_args``); ``raw_config``: the converter reads
    config.json itself instead of through transformers' AutoConfig (the spec's ``raw_config``)."""
    cmd = [sys.executable, "-c", _CONVERT, str(llama_dir), pre or "", str(model_dir), "--outtype", "f16",
           "--outfile", str(out), *extra]
    env = dict(os.environ, FIXTURE_RAW_CONFIG="1") if raw_config else None
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"convert failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")


def quantize(bin_dir: Path, src: Path, dst: Path, qtype: str) -> str:
    res = subprocess.run([str(bin_dir / "llama-quantize"), str(src), str(dst), qtype.upper(), "2"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"quantize failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


_LLAMACPP_CHILD = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from make_fixtures import _llamacpp_logits_here
logits, info = _llamacpp_logits_here(sys.argv[2], np.load(sys.argv[3]), int(sys.argv[4]), sys.argv[6] == "1")
np.save(sys.argv[5], logits)
print(json.dumps(info))
"""


def llamacpp_logits(path: Path, tokens: np.ndarray, n_ctx: int, no_repack: bool = False) -> tuple[np.ndarray, dict[str, Any]]:
    """llama.cpp's logits at every position, one fresh KV cache per sequence: (n_seq, T, V).

    Run in a child process: with torch loaded in the same process, llama.cpp's MoE graphs crash
    (both bring an OpenMP runtime). ``no_repack``: ``use_extra_bufts = False`` (no CPU weight
    repacking; its MoE kernels crash on the small quantized expert tensors, see README)."""
    with tempfile.TemporaryDirectory() as tmp:
        tok, out = Path(tmp) / "tokens.npy", Path(tmp) / "logits.npy"
        np.save(tok, tokens)
        res = subprocess.run([sys.executable, "-c", _LLAMACPP_CHILD, str(Path(__file__).resolve().parent), str(path),
                              str(tok), str(n_ctx), str(out), "1" if no_repack else "0"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"llama.cpp on {path} failed ({res.returncode}):\n{res.stderr[-3000:]}")
        return np.load(out), json.loads(res.stdout.strip().splitlines()[-1])


def _llamacpp_logits_here(path: str, tokens: np.ndarray, n_ctx: int,
                          no_repack: bool) -> tuple[np.ndarray, dict[str, Any]]:
    import llama_cpp
    if no_repack:
        from llama_cpp import llama as llama_mod
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p
        llama_mod.llama_cpp.llama_model_default_params = params
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_threads=2,
                          verbose=False, seed=0)
    outs = []
    for seq in tokens:
        llm.reset()
        llm.eval(seq.tolist())
        outs.append(np.array(llm.scores[: len(seq)], dtype=np.float32))
    info = {"n_ctx": llm.n_ctx(), "n_vocab": llm.n_vocab(), "weight_repacking": not no_repack}
    llm.close()
    return np.stack(outs), info


# --------------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------------

BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges")


def gguf_summary(path: Path) -> dict[str, Any]:
    """Tensor names/types/shapes and the small metadata values of one GGUF (read with gguf.GGUFReader)."""
    import gguf
    r = gguf.GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        if name in BIG_ARRAYS:
            meta[name] = f"<{len(field.data)} entries>"
            continue
        val = field.contents()
        if isinstance(val, list) and len(val) > 64:
            val = f"<{len(val)} entries>"
        meta[name] = val
    tensors = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(x) for x in t.shape]}
               for t in r.tensors]
    return {"metadata": meta, "tensors": tensors}


def token_pool(path: Path) -> np.ndarray:
    """Ids of ordinary tokens (NORMAL or BYTE types): the random sequences avoid control/unused ones."""
    import gguf
    r = gguf.GGUFReader(str(path))
    types = np.asarray(r.fields["tokenizer.ggml.token_type"].contents())
    return np.flatnonzero((types == 1) | (types == 6))


def errors(a: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Relative RMS over all positions and argmax agreement of ``a`` against ``ref``."""
    a64, r64 = a.astype(np.float64), ref.astype(np.float64)
    rel = math.sqrt(np.mean((a64 - r64) ** 2)) / math.sqrt(np.mean(r64 ** 2))
    agree = float(np.mean(a.argmax(-1) == ref.argmax(-1)))
    return {"rel_rms": rel, "argmax_agreement": agree}


# --------------------------------------------------------------------------------------------------

def make(arch: str, spec: dict[str, Any], out_root: Path, llama_dir: Path, bin_dir: Path, seed: int,
         work: Path) -> dict[str, Any]:
    """Build everything for one architecture; returns its meta dict (also written to meta.json)."""
    import transformers
    import torch
    out = out_root / arch
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model_dir = work / arch
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    hf_config = build_hf(spec, model_dir, seed)

    files = {"f16": out / "model-f16.gguf"}
    convert(llama_dir, model_dir, files["f16"], spec.get("pre") if spec["tokenizer"] == "bpe" else None,
            tuple(spec.get("convert_args", ())), spec.get("raw_config", False))
    quant_logs = {}
    for q in QUANTS + tuple(spec.get("extra_quants", ())):
        files[q] = out / f"model-{q}.gguf"
        quant_logs[q] = quantize(bin_dir, files["f16"], files[q], q)

    pool = token_pool(files["f16"])
    rng = np.random.default_rng(seed)
    tokens = rng.choice(pool, size=(N_SEQ, SEQ_LEN)).astype(np.int32)

    arrays: dict[str, np.ndarray] = {"tokens": tokens, "hf": hf_logits(spec, model_dir, tokens)}
    n_ctx = spec.get("n_ctx", 256)
    cpp_info = {}
    for q, path in files.items():
        arrays[f"llamacpp_{q}"], cpp_info[q] = llamacpp_logits(path, tokens, n_ctx, spec.get("no_repack", False))
    np.savez_compressed(out / "ref.npz", **arrays)

    err = {q: errors(arrays[f"llamacpp_{q}"], arrays["hf"]) for q in files}
    ggufs = {q: gguf_summary(p) for q, p in files.items()}
    hf_std = float(arrays["hf"].std(-1).mean())
    meta = {
        "arch": arch,
        "gguf_architecture": ggufs["f16"]["metadata"].get("general.architecture"),
        "hf_model_class": spec["model"],
        "hf_config_class": spec["config"],
        "features": spec["features"],
        "hf_config": hf_config,
        "seed": seed,
        "tokens": {"n_seq": N_SEQ, "seq_len": SEQ_LEN, "pool": "ids whose GGUF token_type is NORMAL or BYTE"},
        "tokenizer": {"kind": spec["tokenizer"], "pre_named_by_script": spec.get("pre") if spec["tokenizer"] == "bpe" else None},
        "convert": {"outtype": "f16", "script": "vendor/llama.cpp/convert_hf_to_gguf.py"},
        "llamacpp": {"n_ctx_requested": n_ctx, "n_threads": 2, "kv_cache_type": "f16 (llama.cpp's default)",
                     **{q: i for q, i in cpp_info.items()}},
        "hf_logit_std_over_vocab": hf_std,
        "llamacpp_vs_hf": err,
        "files": {q: {"file": p.name, "bytes": p.stat().st_size,
                      "tensor_types": sorted({t["type"] for t in ggufs[q]["tensors"]}),
                      "tensors": ggufs[q]["tensors"],
                      "metadata": {k: v for k, v in ggufs[q]["metadata"].items()
                                   if not k.startswith("tokenizer.ggml.") or k in ("tokenizer.ggml.model", "tokenizer.ggml.pre")}}
                  for q, p in files.items()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    # the tokenizer keys are the same in every file: keep them once
    meta["tokenizer_metadata"] = {k: v for k, v in ggufs["f16"]["metadata"].items() if k.startswith("tokenizer.")}
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    return meta


def index_line(meta: dict[str, Any]) -> str:
    errs = "; ".join(f"{q} {e['rel_rms']:.4g} / {e['argmax_agreement']:.3f}" for q, e in meta["llamacpp_vs_hf"].items())
    files = ", ".join(f["file"] for f in meta["files"].values())
    return (f"| {meta['arch']} | {meta['gguf_architecture']} | {meta['hf_model_class']} | {meta['features']} | "
            f"{files} | {errs} |")


INDEX_HEAD = """# Architecture fixtures

One folder per architecture, made by `tools/arch_fixtures/make_fixtures.py` (see its README). Error columns:
llama.cpp's logits on that GGUF against transformers' float32 forward of the same HF model, relative RMS over
all positions / argmax agreement. minirt's bar per architecture and file: error <= llama.cpp's, agreement >=
llama.cpp's. On these random weights judge the quantized files by the error, not by argmax.

| folder | GGUF arch | HF class | features | files | llama.cpp vs HF: quant rel-RMS / argmax |
|---|---|---|---|---|---|
"""


def write_index(out_root: Path) -> None:
    """(Re)write ``INDEX.md`` from every ``<arch>/meta.json`` present, in :data:`ARCHS` order."""
    lines = [index_line(json.loads((out_root / a / "meta.json").read_text()))
             for a in ARCHS if (out_root / a / "meta.json").is_file()]
    (out_root / "INDEX.md").write_text(INDEX_HEAD + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arch", nargs="*", help=f"architectures to build (default: all of {', '.join(ARCHS)})")
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (has convert_hf_to_gguf.py)")
    ap.add_argument("--bin", type=Path, help="directory with llama-quantize (default: <llama-cpp>/build/bin)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests" / "data" / "archs")
    ap.add_argument("--work", type=Path, help="where the HF checkpoints are kept (default: a temporary directory)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch
    torch.set_num_threads(2)
    bin_dir = args.bin or args.llama_cpp / "build" / "bin"
    names = args.arch or list(ARCHS)
    unknown = [a for a in names if a not in ARCHS]
    if unknown:
        ap.error(f"unknown architecture(s): {', '.join(unknown)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="arch_fixtures_"))
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    for arch in names:
        meta = make(arch, ARCHS[arch], args.out, args.llama_cpp, bin_dir, args.seed, work)
        log.info("%s", index_line(meta))
        write_index(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
