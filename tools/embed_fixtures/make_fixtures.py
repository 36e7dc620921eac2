"""Regenerate the embedding / reranking reference fixtures under ``tests/data/embed/``.

For each model in :data:`MODELS` this script

1. builds a tiny, randomly initialised transformers model (seeded; nothing downloaded) with a tiny
   tokenizer and, where the model family has them, the sentence-transformers files the converter
   reads (``modules.json``, ``1_Pooling/config.json``, EmbeddingGemma's ``2_Dense`` / ``3_Dense``);
2. converts it with llama.cpp's ``convert_hf_to_gguf.py --outtype f16`` and quantizes Q8_0 / Q4_K_M
   with ``llama-quantize`` (only for the models listed in ``quants``, to keep the fixtures small);
3. computes reference outputs for a few random token sequences of different lengths:
   transformers float32 (eager attention) final hidden states pooled with sentence-transformers'
   semantics (mean over the tokens / first token / last token, then the Dense modules, then L2
   normalization), or the sequence-classification logit of a cross-encoder; and llama.cpp's
   pooled output (binding, ``embedding=True``) for every GGUF;
4. writes ``<name>/model-<type>.gguf``, ``<name>/ref.npz`` and ``<name>/meta.json``.

Run it with the same environment as ``tools/arch_fixtures/make_fixtures.py`` (see that README):

    PYTHONPATH=$LCP LLAMA_CPP_LIB_PATH=$LCP/vendor/llama.cpp/build/bin \\
      python tools/embed_fixtures/make_fixtures.py --llama-cpp $LCP/vendor/llama.cpp [names...]
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def _arch_fixtures() -> Any:
    """The architecture fixtures' generator (its corpus, vocabularies, reinit, converter wrapper)."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "arch_fixtures" / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("arch_fixtures_make", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


af = _arch_fixtures()

log = logging.getLogger("embed_fixtures")

HIDDEN = 256  # K-quants need rows of 256
FFN = 256
VOCAB = 320
LENGTHS = (5, 17, 40)  # one sequence each; different lengths exercise batching
POOLING = {"mean": 1, "cls": 2, "last": 3, "rank": 4}


def _bert_kw(layers: int) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                num_attention_heads=4, max_position_embeddings=128, hidden_act="gelu", layer_norm_eps=1e-12)


MODELS: dict[str, dict[str, Any]] = {
    "bert": dict(
        config="BertConfig", model="BertModel", tokenizer="wordpiece", pre="default", pooling="mean", alt_pooling="cls",
        features="BERT post-norm encoder, absolute positions, 2 token types, WordPiece; mean pooling in the "
                 "file, CLS pooling checked with pooling='cls'", quants=True,
        kwargs=dict(_bert_kw(2), type_vocab_size=2)),
    "xlmr_rerank": dict(
        config="XLMRobertaConfig", model="XLMRobertaForSequenceClassification", tokenizer="unigram",
        pooling="rank", features="XLM-RoBERTa cross-encoder (bge-reranker layout): position offset 2, one token "
                                 "type, Unigram vocab, classifier dense+tanh+out_proj, 1 label", quants=True,
        kwargs=dict(_bert_kw(2), type_vocab_size=1, num_labels=1, pad_token_id=1, bos_token_id=0,
                    eos_token_id=2)),
    "qwen3_embed": dict(
        config="Qwen3Config", model="Qwen3Model", tokenizer="bpe", pre="qwen2", pooling="last",
        features="Qwen3 decoder (causal) with last-token pooling (Qwen3-Embedding layout)", quants=True,
        kwargs=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                    rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen3_rerank": dict(
        config="Qwen3Config", model="Qwen3ForCausalLM", tokenizer="bpe", pre="qwen2", pooling="rank",
        yes_no=True, readme="# Qwen3-Reranker\n", lengths=(5, 17, 40, 8, 23, 31, 12, 3, 27, 36, 19, 44),
        features="Qwen3-Reranker layout: a causal Qwen3 LM whose converter keeps the lm_head rows of 'yes' and "
                 "'no' as the classifier (cls_out, 2 labels); score = softmax over (yes, no) at the last token",
        quants=True,
        kwargs=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                    rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "nomic_bert": dict(
        config=None, model=None, hf_model="NomicBertModel", tokenizer="wordpiece", pre="default", pooling="mean",
        quants=True,
        features="nomic-bert: post-norm, rotary (NEOX, base 1000), fused Wqkv, SwiGLU, no biases, 2 token "
                 "types. The checkpoint is written here in nomic's own layout (what the converter reads); "
                 "transformers' NomicBertModel (5.x) loads that layout and is the reference",
        kwargs=dict(vocab_size=VOCAB, n_embd=HIDDEN, n_inner=FFN, n_layer=2, n_head=4, n_positions=2048,
                    max_trained_positions=2048, activation_function="swiglu", causal=False, qkv_proj_bias=False,
                    mlp_fc1_bias=False, mlp_fc2_bias=False, prenorm=False, rotary_emb_fraction=1.0,
                    rotary_emb_interleaved=False, rotary_emb_scale_base=None, rotary_emb_base=1000,
                    type_vocab_size=2, layer_norm_epsilon=1e-12, architectures=["NomicBertModel"],
                    model_type="nomic_bert", pad_token_id=0,
                    # the names the converter's generic readers look up first
                    hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=4)),
    "jina_bert_v3": dict(
        config=None, model=None, tokenizer="unigram", pooling="mean", quants=True, jina=True,
        tasks=("retrieval.query", "text-matching"),
        features="jina-bert-v3 (jina-embeddings-v3): XLM-RoBERTa post-norm blocks with rotary positions (NEOX, "
                 "base 20000), fused biased Wqkv, erf-GELU MLP with biases, one token type, Unigram vocab; two "
                 "task LoRA adapters (rank 4, alpha 1) on every matrix and the token embedding, written by the "
                 "converter as separate adapter GGUFs. Reference: jina's own remote-code model "
                 "(XLMRobertaLoRA, --jina-impl) in float32, without and with each task's adapter",
        kwargs=dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=FFN, max_position_embeddings=8194, type_vocab_size=1, layer_norm_eps=1e-5,
                    position_embedding_type="rotary", rotary_emb_base=20000.0, use_flash_attn=False,
                    lora_adaptations=["retrieval.query", "text-matching"],
                    task_instructions={"retrieval.query": "Represent the query for retrieving evidence documents: ",
                                       "text-matching": ""},
                    lora_rank=4, lora_alpha=1, lora_dropout_p=0.0, lora_main_params_trainable=False,
                    load_trained_adapters=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                    architectures=["XLMRobertaModel"], model_type="xlm-roberta")),
    "modern_bert": dict(
        config="ModernBertConfig", model="ModernBertModel", tokenizer="bpe", pre="modern-bert", pooling="mean",
        features="ModernBERT: pre-norm LayerNorm without bias, layer 0 without attention norm, GeGLU, "
                 "global layer 0 (rope 160000) and local layer 1 (window 16, rope 10000)", quants=True,
        kwargs=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=128, global_attn_every_n_layers=2,
                    local_attention=16, hidden_activation="gelu", norm_eps=1e-5,
                    layer_norm_eps=1e-5,  # the name the converter reads
                    cls_token_id=1, sep_token_id=0)),  # the tiny BPE vocabulary's bos / eos
    "gemma_embedding": dict(
        config="Gemma3TextConfig", model="Gemma3TextModel", tokenizer="spm", pooling="mean", dense=(512,),
        features="EmbeddingGemma: Gemma 3 layers attending bidirectionally (symmetric window 16, two "
                 "local layers), mean pooling, Dense 256->512->256 after pooling", quants=False,
        # llama.cpp (this build) aborts on the file: GGML_ASSERT(buffer) in llama_context::encode, in
        # llama-embedding too; transformers is the only reference
        llamacpp=False,
        specials=af.GEMMA_SPECIALS,
        kwargs=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                    rms_norm_eps=1e-6, sliding_window=16, use_bidirectional_attention=True,
                    # the converter writes no sliding_window_pattern: readers use EmbeddingGemma's 5 local
                    # + 1 global, so both layers of this 2-layer model are local ones
                    layer_types=["sliding_attention", "sliding_attention"], query_pre_attn_scalar=64,
                    hidden_activation="gelu_pytorch_tanh")),
}


# --------------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------------

def write_wordpiece(out: Path, vocab: int) -> dict[str, int]:
    """A WordPiece ``vocab.txt`` in BERT's layout ([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103)."""
    from transformers import BertTokenizerFast
    toks = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = sorted({c for line in af._corpus() for c in line.lower() if not c.isspace()})
    toks += chars + ["##" + c for c in chars if c.isalpha()]
    words: dict[str, int] = {}
    for line in af._corpus():
        for w in line.lower().replace(".", " ").replace(",", " ").split():
            words[w] = words.get(w, 0) + 1
    for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(toks) >= vocab:
            break
        if w not in toks:
            toks.append(w)
    toks = toks[:vocab]
    (out / "vocab.txt").write_text("\n".join(toks) + "\n")
    BertTokenizerFast(vocab_file=str(out / "vocab.txt")).save_pretrained(str(out))
    return {"pad": 0}


def write_unigram(out: Path, vocab: int) -> None:
    """A SentencePiece Unigram ``sentencepiece.bpe.model`` (the XLM-RoBERTa file name and layout)."""
    import io

    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(af._corpus()), model_writer=buf, vocab_size=vocab,
                                   model_type="unigram", character_coverage=1.0, num_threads=1,
                                   minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    (out / "sentencepiece.bpe.model").write_bytes(buf.getvalue())
    from transformers import XLMRobertaTokenizer
    XLMRobertaTokenizer(vocab_file=str(out / "sentencepiece.bpe.model")).save_pretrained(str(out))


def write_st_modules(out: Path, pooling: str, dense: tuple[int, ...], model: Any, seed: int) -> list[np.ndarray]:
    """sentence-transformers' ``modules.json``, ``1_Pooling`` and ``k_Dense`` folders; returns the
    Dense weights (out, in) in order."""
    import torch
    from safetensors.torch import save_file
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": pooling == "last", "include_prompt": True}))
    weights = []
    gen = torch.Generator().manual_seed(seed + 7)
    n_in = HIDDEN
    for k, n_out in enumerate(list(dense) + ([HIDDEN] if dense else [])):
        path = f"{k + 2}_Dense"
        (out / path).mkdir()
        w = torch.randn((n_out, n_in), generator=gen) * (1.0 / n_in ** 0.5)
        save_file({"linear.weight": w.contiguous()}, str(out / path / "model.safetensors"))
        (out / path / "config.json").write_text(json.dumps({"in_features": n_in, "out_features": n_out,
                                                            "bias": False, "activation_function":
                                                            "torch.nn.modules.linear.Identity"}))
        mods.append({"idx": k + 2, "name": str(k + 2), "path": path, "type": "sentence_transformers.models.Dense"})
        weights.append(w.numpy())
        n_in = n_out
    mods.append({"idx": len(mods), "name": str(len(mods)), "path": f"{len(mods)}_Normalize",
                 "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(mods, indent=1))
    return weights


# --------------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------------

def build(spec: dict[str, Any], out: Path, seed: int) -> tuple[dict[str, Any], list[np.ndarray]]:
    import torch
    import transformers
    kw = json.loads(json.dumps(spec["kwargs"]))
    tk = spec["tokenizer"]
    if tk == "wordpiece":
        write_wordpiece(out, kw["vocab_size"])
        kw.update(pad_token_id=0)
    elif tk == "unigram":
        write_unigram(out, kw["vocab_size"])
    elif tk == "spm":
        specials = spec.get("specials", af.LLAMA_SPECIALS)
        af.write_spm(out, kw["vocab_size"], specials, [])
        kw.update(bos_token_id=specials["bos"], eos_token_id=specials["eos"], pad_token_id=specials.get("pad"))
    else:
        # Qwen3 rerankers read 'yes' / 'no' (and '|') as tokens: added when the tiny vocabulary lacks them
        specials = af.write_bpe(out, kw["vocab_size"], ("yes", "no", "|") if spec.get("yes_no") else ())
        kw.update(bos_token_id=specials["bos"], eos_token_id=specials["eos"], pad_token_id=specials.get("pad"))
    if spec.get("jina"):  # jina's remote code (XLMRobertaLoRA) builds and saves the checkpoint
        return write_jina(out, kw, seed), []
    if spec["config"] is None:  # no transformers class: the checkpoint in the family's own layout
        return write_nomic(out, kw, seed), []
    config = getattr(transformers, spec["config"])(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model"])(config).to(torch.float32)
    af.reinit(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    if spec.get("readme"):  # what the converter reads to recognise a Qwen3 reranker
        (out / "README.md").write_text(spec["readme"])
    dense: list[np.ndarray] = []
    if spec["pooling"] != "rank":  # (nomic: written by write_nomic)
        dense = write_st_modules(out, spec["pooling"], spec.get("dense", ()), model, seed)
    return json.loads((out / "config.json").read_text()), dense


def write_nomic(out: Path, kw: dict[str, Any], seed: int) -> dict[str, Any]:
    """A NomicBertModel checkpoint (config.json + model.safetensors with nomic's tensor names),
    weights drawn as :func:`reinit` does (matrices N(0, 0.05), norm gains 1 + N(0, 0.1), biases N(0, 0.05))."""
    import torch
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    d, f, n_l = kw["n_embd"], kw["n_inner"], kw["n_layer"]

    def mat(*shape: int) -> Any:
        return torch.randn(shape, generator=gen) * 0.05

    def gain() -> Any:
        return 1 + torch.randn((d,), generator=gen) * 0.1

    t = {"embeddings.word_embeddings.weight": mat(kw["vocab_size"], d),
         "embeddings.token_type_embeddings.weight": mat(kw["type_vocab_size"], d),
         "emb_ln.weight": gain(), "emb_ln.bias": mat(d)}
    for i in range(n_l):
        p = f"encoder.layers.{i}."
        t.update({p + "attn.Wqkv.weight": mat(3 * d, d), p + "attn.out_proj.weight": mat(d, d),
                  p + "mlp.fc11.weight": mat(f, d), p + "mlp.fc12.weight": mat(f, d), p + "mlp.fc2.weight": mat(d, f),
                  p + "norm1.weight": gain(), p + "norm1.bias": mat(d), p + "norm2.weight": gain(),
                  p + "norm2.bias": mat(d)})
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(kw, indent=1))
    write_st_modules(out, "mean", (), None, seed)
    return kw


JINA_IMPL: Path | None = None  # --jina-impl: jina's xlm-roberta-flash-implementation folder


def _jina_module(name: str) -> Any:
    """A module of jina's remote code (relative imports inside it), imported as package ``jina_xlmr``."""
    import importlib
    import importlib.util
    if JINA_IMPL is None:
        raise SystemExit("jina_bert_v3 needs --jina-impl DIR (jina's xlm-roberta-flash-implementation code)")
    if "jina_xlmr" not in sys.modules:
        init = JINA_IMPL / "__init__.py"
        spec = importlib.util.spec_from_file_location("jina_xlmr", init if init.exists() else None,
                                                      submodule_search_locations=[str(JINA_IMPL)])
        pkg = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules["jina_xlmr"] = pkg
    return importlib.import_module(f"jina_xlmr.{name}")


def _jina_model(out: Path, kw: dict[str, Any]) -> Any:
    cfg = _jina_module("configuration_xlm_roberta").XLMRobertaFlashConfig(**kw)
    cfg._name_or_path = str(out)  # the model loads its tokenizer from here
    return _jina_module("modeling_lora").XLMRobertaLoRA(cfg).to("cpu").float().eval()


def write_jina(out: Path, kw: dict[str, Any], seed: int) -> dict[str, Any]:
    """jina-embeddings-v3's checkpoint made by its own code: every tensor redrawn as :func:`write_nomic`
    draws them (the LoRA factors too: N(0, 0.05), so that each adapter changes the output), saved
    with the parametrized names the converter reads; config.json as the real model's."""
    import torch
    from safetensors.torch import save_file
    model = _jina_model(out, kw)
    gen = torch.Generator().manual_seed(seed)
    sd = model.state_dict()
    new = {}
    for k, v in sd.items():
        if k.endswith("norm1.weight") or k.endswith("norm2.weight") or k.endswith("emb_ln.weight"):
            new[k] = 1 + torch.randn(v.shape, generator=gen) * 0.1
        elif k.endswith("lora_A") or k.endswith("lora_B"):
            new[k] = torch.randn(v.shape, generator=gen) * 0.05
        else:
            new[k] = torch.randn(v.shape, generator=gen) * 0.05
    model.load_state_dict(new)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(kw, indent=1))
    write_st_modules(out, "mean", (), None, seed)
    return kw


def jina_outputs(model_dir: Path, kw: dict[str, Any], seqs: list[np.ndarray], task: str | None) -> np.ndarray:
    """jina's model in float32, mean-pooled and normalized, without an adapter (task None) or with the
    task's adapter (its ``adapter_mask``), one sequence at a time."""
    import torch
    from safetensors.torch import load_file
    model = _jina_model(model_dir, kw)
    model.load_state_dict(load_file(str(model_dir / "model.safetensors")))
    outs = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.from_numpy(s.astype(np.int64))[None]
            extra = {} if task is None else {"adapter_mask": torch.tensor([kw["lora_adaptations"].index(task)],
                                                                          dtype=torch.int32)}
            h = model.roberta(ids, **extra).last_hidden_state[0].double().numpy()
            v = h.mean(0)
            outs.append(v / np.linalg.norm(v))
    return np.asarray(outs, dtype=np.float32)


def hf_outputs(spec: dict[str, Any], model_dir: Path, seqs: list[np.ndarray], dense: list[np.ndarray],
               pooling: str) -> np.ndarray:
    """transformers float32 outputs, one sequence at a time (no padding): ST-pooled normalized
    vectors (n, dim), or the cross-encoder's logits (n,)."""
    import torch
    import transformers
    cls = getattr(transformers, spec.get("hf_model") or spec["model"])
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()
    outs = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.from_numpy(s.astype(np.int64))[None]
            if pooling == "rank" and spec.get("yes_no"):
                # Qwen3-Reranker's score: P(yes) of the softmax over the 'yes' and 'no' logits at the
                # last position (its model card's compute_logits)
                tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
                lg = model(input_ids=ids).logits[0, -1].double()
                pair = torch.stack([lg[tok.convert_tokens_to_ids("yes")], lg[tok.convert_tokens_to_ids("no")]])
                outs.append(torch.softmax(pair, 0)[0].item())
                continue
            if pooling == "rank":
                outs.append(model(input_ids=ids).logits[0, 0].item())
                continue
            h = model(input_ids=ids).last_hidden_state[0].double().numpy()
            v = {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]
            for w in dense:
                v = w.astype(np.float64) @ v
            outs.append(v / np.linalg.norm(v))
    return np.asarray(outs, dtype=np.float32)


def convert(llama_dir: Path, model_dir: Path, out: Path, pre: str | None, dense: bool) -> None:
    cmd = [sys.executable, "-c", af._CONVERT, str(llama_dir), pre or "", str(model_dir), "--outtype", "f16",
           "--outfile", str(out)] + (["--sentence-transformers-dense-modules"] if dense else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")


def _no_repack(llama_cpp: Any) -> None:
    """Load without llama.cpp's extra (repacked) weight buffers: on the AMX machine these fixtures
    were made on, the repacked Q8_0 / Q4_K encoder matmuls die with SIGILL (``llama-embedding -nr``
    works); plain ggml weights give the reference numbers."""
    low = llama_cpp.llama_cpp
    if getattr(low, "_embed_fixtures_patched", False):
        return
    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    low._embed_fixtures_patched = True


def llamacpp_outputs(path: Path, seqs: list[np.ndarray], pooling: str, lora: Path | None = None) -> np.ndarray:
    """llama.cpp's pooled output per sequence (binding, embedding=True, one sequence per decode),
    L2-normalized like the HF reference (rank: the raw score); ``lora``: with that adapter (scale 1)."""
    import llama_cpp
    _no_repack(llama_cpp)
    llm = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=256, n_batch=256, n_ubatch=256,
                          n_threads=2, verbose=False, pooling_type=POOLING[pooling],
                          lora_path=None if lora is None else str(lora))
    n_out = 1 if pooling == "rank" else llm.n_embd()
    outs = []
    for s in seqs:
        llm._ctx.kv_cache_clear()
        llm._batch.reset()
        llm._batch.add_sequence(s.tolist(), 0, False)
        llm._ctx.decode(llm._batch)
        ptr = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
        v = np.array(ptr[:n_out], dtype=np.float64)
        outs.append(v[0] if pooling == "rank" else v / np.linalg.norm(v))
    llm.close()
    return np.asarray(outs, dtype=np.float32)


def token_pool(path: Path) -> np.ndarray:
    """Ids of ordinary tokens (NORMAL, USER_DEFINED or BYTE; never a special id): the sequences
    avoid control tokens (and XLM-RoBERTa's padding id, whose position would differ)."""
    import gguf
    r = gguf.GGUFReader(str(path))
    types = np.asarray(r.fields["tokenizer.ggml.token_type"].contents())
    special = {int(f.contents()) for k, f in r.fields.items() if k.startswith("tokenizer.ggml.") and k.endswith("_id")}
    return np.array([i for i in np.flatnonzero(np.isin(types, (1, 5, 6))) if int(i) not in special])


def cosines(a: np.ndarray, b: np.ndarray) -> list[float]:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return [float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))) for x, y in zip(a64, b64, strict=True)]


def make(name: str, spec: dict[str, Any], out_root: Path, llama_dir: Path, bin_dir: Path, seed: int) -> None:
    out = out_root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as td:
        hf_dir = Path(td) / "hf"
        hf_dir.mkdir()
        config, dense = build(spec, hf_dir, seed)
        f16 = out / "model-f16.gguf"
        convert(llama_dir, hf_dir, f16, spec.get("pre"), bool(spec.get("dense")))
        files = {"f16": f16}
        if spec.get("quants"):
            for q in af.QUANTS:
                files[q] = out / f"model-{q}.gguf"
                af.quantize(bin_dir, f16, files[q], q)
        pool_ids = token_pool(f16)
        rng = np.random.default_rng(seed)
        lengths = spec.get("lengths", LENGTHS)  # more sequences where a score is one number per sequence
        seqs = [rng.choice(pool_ids, size=n).astype(np.int32) for n in lengths]
        poolings = [spec["pooling"]] + ([spec["alt_pooling"]] if spec.get("alt_pooling") else [])
        ref: dict[str, np.ndarray] = {f"tokens_{i}": s for i, s in enumerate(seqs)}
        meta: dict[str, Any] = {"name": name, "features": spec["features"], "hf_config": config,
                                "poolings": poolings, "lengths": list(lengths), "llamacpp_vs_hf": {},
                                "gguf": {k: af.gguf_summary(v) for k, v in files.items()}}
        for pooling in poolings:
            if spec.get("jina"):
                hf = jina_outputs(hf_dir, config, seqs, None)
            else:
                hf = hf_outputs(spec, hf_dir, seqs, dense, pooling) if spec["model"] or spec.get("hf_model") \
                    else None
            if hf is None:  # llama.cpp's F16 result is the reference
                hf = llamacpp_outputs(files["f16"], seqs, pooling)
            ref[f"hf_{pooling}"] = hf
            for k, path in files.items():
                if not spec.get("llamacpp", True):
                    continue
                cpp = llamacpp_outputs(path, seqs, pooling)
                ref[f"llamacpp_{pooling}_{k}"] = cpp
                if pooling == "rank":
                    meta["llamacpp_vs_hf"][f"{pooling}_{k}"] = {"abs_err": np.abs(cpp - hf).tolist()}
                else:
                    meta["llamacpp_vs_hf"][f"{pooling}_{k}"] = {"cosine": cosines(cpp, hf)}
        if spec.get("jina"):
            jina_references(spec, config, hf_dir, out, files, seqs, ref, meta)
        np.savez_compressed(out / "ref.npz", **ref)
        (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    log.info("%s: %s", name, json.dumps(meta["llamacpp_vs_hf"]))


def jina_references(spec: dict[str, Any], config: dict[str, Any], hf_dir: Path, out: Path, files: dict[str, Path],
                    seqs: list[np.ndarray], ref: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """The converter's task adapters (``lora-<task>-model-f16.gguf``, moved to ``lora-<task>.gguf``) and,
    per task, jina's float32 output with the adapter (``hf_mean_lora_<task>``) and llama.cpp's on every
    base file with the adapter (``llamacpp_mean_lora_<task>_<type>``)."""
    meta["lora"] = {}
    for task in spec["tasks"]:
        made = out / f"lora-{task}-model-f16.gguf"
        dst = out / f"lora-{task}.gguf"
        made.rename(dst)
        hf = jina_outputs(hf_dir, config, seqs, task)
        ref[f"hf_mean_lora_{task}"] = hf
        meta["lora"][task] = {"file": dst.name, "llamacpp_vs_hf": {}}
        for k, path in files.items():
            cpp = llamacpp_outputs(path, seqs, "mean", lora=dst)
            ref[f"llamacpp_mean_lora_{task}_{k}"] = cpp
            meta["lora"][task]["llamacpp_vs_hf"][k] = {"cosine": cosines(cpp, hf)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"models to make (default all: {', '.join(MODELS)})")
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the llama.cpp tree (with build/bin)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests" / "data" / "embed")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--jina-impl", type=Path, help="jina's xlm-roberta-flash-implementation code (for jina_bert_v3; "
                                                   "its imports need transformers < 5)")
    args = ap.parse_args(argv)
    global JINA_IMPL
    JINA_IMPL = args.jina_impl
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = args.names or [n for n in MODELS if JINA_IMPL or not MODELS[n].get("jina")]
    if not args.names and not JINA_IMPL:
        log.info("jina_bert_v3 skipped: it needs --jina-impl")
    for name in names:
        make(name, MODELS[name], args.out, args.llama_cpp, args.llama_cpp / "build" / "bin", args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
