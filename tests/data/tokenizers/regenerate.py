"""Rebuild the small vocabularies in this folder and llama.cpp's token ids for them.

    PYTHONPATH=/path/to/llama_cpp_python LLAMA_CPP_LIB_PATH=/path/to/llama.cpp/build/bin \\
        python tests/data/tokenizers/regenerate.py --llama-cpp /path/to/llama.cpp [--vocabs]

``--vocabs`` also rebuilds the vocabulary files (``*.gguf.gz``) from the vocab-only GGUFs that
llama.cpp ships in ``models/`` (cut down so they stay small) and from token lists written here
(RWKV, PLaMo-2). Without it the committed vocabularies are kept and only the references are
recomputed. References are llama.cpp's own ``llama_tokenize`` / ``llama_detokenize`` (through
llama-cpp-python's ctypes binding) on exactly these files; each BPE pre-tokenizer is run by
writing the byte-level vocabulary again with that ``tokenizer.ggml.pre`` value.

Output: ``references.json.gz``: ``{"corpus": [texts], "cases": [{"vocab", "model", "pre", "ids",
"ids_special", "ids_add", "detok", "detok_hidden"}]}``, one list entry per corpus text:
``ids`` (no BOS/EOS, special-token text as text), ``ids_special`` (special-token text parsed),
``ids_add`` (BOS/EOS as the vocabulary asks), ``ids_invalid`` (the raw bytes of ``invalid_utf8``,
hex), ``detok`` (``llama_detokenize`` of ``ids_special``
with special tokens rendered), ``detok_hidden`` (same, control tokens dropped), ``special``
(BOS / EOS / EOT / SEP ids, add_bos / add_eos, the end-of-generation set, every token's attribute
bits where they are not just NORMAL).
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from minirt import gguf as mgguf  # noqa: E402
from minirt.pretokenizers import PRE_NAMES, RAW_UTF8_TYPES  # noqa: E402

CORPUS = [
    "", " ", "  ", "\t", "\n", "\n\n\n", " \n \n\n \t\t \r\n", "a", "Hello world", " Hello World!",
    "  leading spaces\t\ttabs\n\n\nnewlines \r\n", "trailing spaces   ", "mixed \t \n\t\n  x",
    "1 12 123 1234 12345 1234567890 3.14159 1,000,000 -42 ٣٤٥ ①②", "007 0x1F 1e-9 2024-12-01",
    "def f(x):\n    return x**2  # comment\n\nif __name__ == '__main__':\n\tprint(f(3))\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 2; } // C++\n", "<div class=\"x\">&amp;</div>",
    "中文测试，你好世界！日本語のテキスト。ひらがな カタカナ 한국어 텍스트", "日本語 and English混合text123",
    "emoji 👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 😀😃 🚀", "ab😀cd\U0001F9D1\u200D\U0001F4BB", "café café naïve Ångström",
    "x\u0301y\u0308 e\u0301 \u0915\u094d\u0937", "ÀÉÎÕÜ àéîõü ǅ ﬁ ı İ ß ẞ Σσς", "Ünïcödé — “quotes” ‘single’ …",
    "I'm you're he'll we've they'd IT'S 'LL 's 'T", "The QUICK brown FOX's tail, isn't it?",
    "Hello, world! How's it going? Fine . , ! ?", "$100 + 50% = ~€150 | <html> @user #tag ^_^",
    "\u00a0nbsp\u3000ideographic\u2028sep\u2029para\u0085nel", "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f\x7f",
    "\x00nul\ufeffbom\ufffdrepl\ue000pua", "Привет мир! Ελληνικά עברית العربية हिन्दी ไทย",
    "<|endoftext|><|im_start|>user\nhi<|im_end|>", "<s>[INST] x [/INST]</s> <unk> <pad>",
    "a<think>b</think> c <think>", "  <|im_start|>  spaced  <|im_end|>  ", "[CLS] [SEP] [MASK] [UNK] x",
    "<|plamo:bos|>plamo<|plamo:eos|>", "\\x41\\n\\\\ back\\slash", "<0x41> <0xE4>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "                                        x",
    "\U0001D400\U0001D401 \U00010400 \U00020000\U0002A700 \u1c89\u0870",
    "\ufffd\ufffd x \ufffd",  # what invalid UTF-8 becomes once decoded with errors="replace"
    "gene <dna>acgtACGTTTGAcc</dna> done <dna>GGGNNNcat", "<dna></dna><dna>a", "<dna>acé中gtacgtac</dna>",
]

# invalid UTF-8, given to llama.cpp as raw bytes (minirt: decode_utf8_like_llama, then encode)
INVALID = [b"\xff", b"abc\x80def", b"\xe4\xb8", b"\xe4\xb8 x\xe4", b"\xc3\x28 caf\xc3", b"\xf0\x9f\x98 ok",
           b"\xc0\xaf overlong", b"\xfe\xfe\xff\xff", b"a\xe4\xb8\xad\xe6\x96 b"]

BYTELEVEL = "bpe-bytelevel.gguf.gz"
TRAINED = "bpe-trained.gguf.gz"
DNA = "bpe-dna.gguf.gz"
GEMMA4 = "bpe-gemma4.gguf.gz"
WPM = "wpm.gguf.gz"
SPM = "spm.gguf.gz"
UGM = "ugm.gguf.gz"
RWKV = "rwkv.gguf.gz"
PLAMO2 = "plamo2.gguf.gz"

_HPARAMS = {  # llama.cpp loads a model's hyper-parameters even for vocab_only: a small "llama"
    "general.architecture": "llama", "llama.block_count": 1, "llama.context_length": 512,
    "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 4, "llama.attention.layer_norm_rms_epsilon": 1e-5,
}


# ---------------------------------------------------------------------------------------------
# writing GGUF files
# ---------------------------------------------------------------------------------------------

def write_gguf(path: Path, md: dict[str, Any]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in md.items():
        if k == "general.architecture":
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, np.ndarray) and v.dtype.itemsize == 1:  # precompiled_charsmap
            w.add_key_value(k, v.astype(np.uint8).tolist(), gguf.GGUFValueType.ARRAY,
                            sub_type=gguf.GGUFValueType.UINT8)
        elif isinstance(v, np.ndarray) and v.dtype.kind == "f":
            w.add_key_value(k, [float(x) for x in v], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        elif isinstance(v, np.ndarray):
            w.add_key_value(k, [int(x) for x in v], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
            w.add_array(k, list(v))
        else:
            raise TypeError(f"{k}: {type(v)}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_md(path: Path) -> dict[str, Any]:
    """Metadata of a (possibly gzipped) GGUF file, arrays as lists / numpy arrays."""
    if path.suffix == ".gz":
        with tempfile.TemporaryDirectory() as td:
            raw = Path(td) / path.stem
            raw.write_bytes(gzip.decompress(path.read_bytes()))
            return read_md(raw)
    f = mgguf.open(str(path))
    md = {}
    for k, v in f.metadata.items():
        if isinstance(v, np.ndarray):
            v = v.copy()
        elif isinstance(v, (list, tuple)):
            v = list(v)
        md[k] = v
    return md


def save_gz(name: str, md: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as td:
        p = Path(td) / "v.gguf"
        write_gguf(p, md)
        (HERE / name).write_bytes(gzip.compress(p.read_bytes(), 9, mtime=0))
    print(f"wrote {name}: {(HERE / name).stat().st_size} bytes", flush=True)


# ---------------------------------------------------------------------------------------------
# the vocabularies
# ---------------------------------------------------------------------------------------------

def _base(md: dict[str, Any]) -> dict[str, Any]:
    return dict(_HPARAMS)


def build_bytelevel(models: Path, n_merges: int = 5000) -> None:
    """Qwen2's byte-level BPE cut to its first ``n_merges`` merges (its ids follow merge ranks)."""
    src = read_md(models / "ggml-vocab-qwen2.gguf")
    tokens, merges = src["tokenizer.ggml.tokens"], src["tokenizer.ggml.merges"]
    keep = tokens[:256 + n_merges]
    for k in range(n_merges):
        assert "".join(merges[k].split(" ", 1)) == keep[256 + k]
    specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4)]
    md = _base(src)
    md.update({
        "general.name": "bpe-bytelevel", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": keep + [t for t, _ in specials],
        "tokenizer.ggml.token_type": np.array([1] * len(keep) + [ty for _, ty in specials], np.int32),
        "tokenizer.ggml.merges": merges[:n_merges],
        "tokenizer.ggml.eos_token_id": len(keep), "tokenizer.ggml.bos_token_id": len(keep),
    })
    save_gz(BYTELEVEL, md)


def build_dna() -> None:
    """The byte-level vocabulary plus hybriddna's tags and all DNA 6-mers (with its marker suffix)."""
    import itertools

    md = read_md(HERE / BYTELEVEL)
    kmers = ["".join(p) + "\ue000" for p in itertools.product("ACGT", repeat=6)]
    extra = ["<dna>", "</dna>", "<oov>"] + kmers
    md["general.name"] = "bpe-dna"
    md["tokenizer.ggml.model"] = "hybriddna"
    md["tokenizer.ggml.tokens"] = list(md["tokenizer.ggml.tokens"]) + extra
    md["tokenizer.ggml.token_type"] = np.concatenate([np.asarray(md["tokenizer.ggml.token_type"]),
                                                      np.ones(len(extra), np.int32)]).astype(np.int32)
    save_gz(DNA, md)


def build_trained(models: Path, vocab_size: int = 3000) -> None:
    """A byte-level BPE trained (HF ``tokenizers``) on text that was *not* pre-tokenized, so its
    merges cross word, digit, space and punctuation boundaries: every difference between two
    pre-tokenizers' splits shows in the ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models as hm
    from tokenizers import pre_tokenizers, trainers

    texts = list(CORPUS) * 3
    for inp in sorted(models.glob("ggml-vocab-*.gguf.inp")):
        texts += inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    tok = HFTokenizer(hm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    spec = json.loads(tok.to_str())["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    tokens = [t for t, _ in vocab]
    specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4)]
    types = [1] * len(tokens)
    for t, ty in specials:  # a special text that training made a token keeps its id
        if t in tokens:
            types[tokens.index(t)] = ty
        else:
            tokens.append(t)
            types.append(ty)
    md = dict(_HPARAMS)
    md.update({
        "general.name": "bpe-trained", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
    })
    save_gz(TRAINED, md)


def build_gemma4(models: Path, n_merges: int = 6000) -> None:
    """Gemma 4's raw-UTF-8 BPE cut down: its special tokens, byte tokens, the first merges."""
    src = read_md(models / "ggml-vocab-gemma-4.gguf")
    tokens, merges = src["tokenizer.ggml.tokens"], src["tokenizer.ggml.merges"]
    types = np.asarray(src["tokenizer.ggml.token_type"])
    scores = np.asarray(src["tokenizer.ggml.scores"], np.float32)
    want = {t for t, ty in zip(tokens, types) if ty != 1}
    want |= {t for t in tokens if len(t) == 1 and (ord(t) < 0x250 or t == "\u2581")}
    want |= {"\n" * k for k in range(1, 32)} | {"\u2581" * k for k in range(1, 32)} | {"</s>"}
    kept_merges = []
    for m in merges[:n_merges]:
        a, b = m.split(" ", 1)
        kept_merges.append(m)
        want |= {a, b, a + b}
    ids = [i for i, t in enumerate(tokens) if t in want]
    remap = {old: new for new, old in enumerate(ids)}
    md = _base(src)
    md.update({
        "general.name": "bpe-gemma4", "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": [tokens[i] for i in ids], "tokenizer.ggml.scores": scores[ids],
        "tokenizer.ggml.token_type": types[ids].astype(np.int32), "tokenizer.ggml.merges": kept_merges,
        "tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": True,
    })
    for key in ("bos", "eos", "unknown", "padding", "mask"):
        k = f"tokenizer.ggml.{key}_token_id"
        md[k] = remap[int(src[k])]
    save_gz(GEMMA4, md)


def build_spm(models: Path, n: int = 8000) -> None:
    """LLaMA's SentencePiece vocabulary (scores, byte tokens) cut to its first ``n`` pieces."""
    src = read_md(models / "ggml-vocab-llama-spm.gguf")
    md = _base(src)
    md.update({
        "general.name": "spm", "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": src["tokenizer.ggml.tokens"][:n],
        "tokenizer.ggml.scores": np.asarray(src["tokenizer.ggml.scores"][:n], np.float32),
        "tokenizer.ggml.token_type": np.asarray(src["tokenizer.ggml.token_type"][:n], np.int32),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
    })
    save_gz(SPM, md)


def build_wpm(models: Path, n: int = 6000) -> None:
    """BGE's WordPiece vocabulary, first ``n`` entries (specials, characters, frequent words)."""
    src = read_md(models / "ggml-vocab-bert-bge.gguf")
    md = _base(src)
    md.update({
        "general.name": "wpm", "tokenizer.ggml.model": "bert", "tokenizer.ggml.pre": "bert-bge",
        "tokenizer.ggml.tokens": src["tokenizer.ggml.tokens"][:n],
        "tokenizer.ggml.token_type": np.asarray(src["tokenizer.ggml.token_type"][:n], np.int32),
    })
    for key in ("unknown", "seperator", "padding", "mask"):
        k = f"tokenizer.ggml.{key}_token_id"
        md[k] = int(src[k])
    md["tokenizer.ggml.bos_token_id"] = int(src["tokenizer.ggml.cls_token_id"])
    save_gz(WPM, md)


def build_ugm(models: Path, n: int = 6000) -> None:
    """XLM-R's Unigram vocabulary (from nomic-bert-moe) cut to ``n`` pieces, with its
    precompiled_charsmap, plus a user-defined token."""
    src = read_md(models / "ggml-vocab-nomic-bert-moe.gguf")
    tokens = src["tokenizer.ggml.tokens"][:n] + ["<ud>", "<ud_long>"]
    types = np.concatenate([np.asarray(src["tokenizer.ggml.token_type"][:n]), [4, 4]]).astype(np.int32)
    scores = np.concatenate([np.asarray(src["tokenizer.ggml.scores"][:n], np.float32), [0, 0]]).astype(np.float32)
    md = _base(src)
    md.update({
        "general.name": "ugm", "tokenizer.ggml.model": "t5", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_space_prefix": True, "tokenizer.ggml.remove_extra_whitespaces": True,
        "tokenizer.ggml.precompiled_charsmap": np.asarray(src["tokenizer.ggml.precompiled_charsmap"]).astype(np.uint8),
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True,
    })
    for key in ("bos", "eos", "unknown", "seperator", "padding"):
        k = f"tokenizer.ggml.{key}_token_id"
        md[k] = int(src[k])
    save_gz(UGM, md)


_WORDS = (
    "the of and to in is was for on that with as by at from this be are it or "
    "an not have which hello world token tokens tok en ize izer code def return print int float string 12 "
    "123 00 000 ing ed er es ly tion ment ness able ous"
).split()


def build_rwkv() -> None:
    """An RWKV "world"-style vocabulary: every byte (escaped as RWKV's converter writes it),
    words with and without a leading space, some CJK and emoji pieces."""
    def esc(b: bytes) -> str:
        out = []
        for c in b:
            if c == 0x5C:
                out.append("\\\\")
            elif 0x20 <= c < 0x7F:
                out.append(chr(c))
            elif c == 9:
                out.append("\\t")
            elif c == 10:
                out.append("\\n")
            elif c == 13:
                out.append("\\r")
            else:
                out.append("\\x%02x" % c)
        return "".join(out)

    pieces = [bytes([b]) for b in range(256)]
    for w in _WORDS:
        pieces += [w.encode(), b" " + w.encode()]
    pieces += [b"\n\n", b"  ", b"    ", b"\r\n", "中文".encode(), "你好".encode(), "世界".encode(),
               "こんにちは".encode(), "😀".encode(), "é".encode(), "ü".encode(), b"\xe4\xb8"]
    texts, seen = [], set()
    for p in pieces:
        t = esc(p) if (p in (b"\xe4\xb8",) or len(p) == 1) else p.decode("utf-8").replace("\\", "\\\\").replace(
            "\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
        if t not in seen:
            seen.add(t)
            texts.append(t)
    texts = ["<s>"] + texts
    md = dict(_HPARAMS)
    md.update({"general.name": "rwkv", "tokenizer.ggml.model": "rwkv",
               "tokenizer.ggml.tokens": texts,
               "tokenizer.ggml.token_type": np.array([3] + [1] * (len(texts) - 1), np.int32)})
    save_gz(RWKV, md)


def build_plamo2() -> None:
    """A PLaMo-2-style vocabulary: control tokens, all 256 byte tokens, scored pieces (with ties)."""
    rng = np.random.default_rng(0)
    pieces = ["\u2581" + w for w in _WORDS] + _WORDS + [" " + w for w in _WORDS] + [
        "中", "文", "中文", "你好", "世界", "日本", "日本語", "語", "é", "ü", "café", "  ", "\n", "\n\n", "😀",
        "a", "b", "c", "ab", "bc", "abc", "aa", "aaa"]
    pieces = list(dict.fromkeys(pieces))
    texts = ["<|plamo:unk|>", "<|plamo:bos|>", "<|plamo:eos|>", "<|plamo:pad|>"]
    types = [2, 3, 3, 3]
    scores = [0.0] * 4
    texts += ["<0x%02X>" % b for b in range(256)]
    types += [6] * 256
    scores += [0.0] * 256
    for p in pieces:
        texts.append(p)
        types.append(1)
        scores.append(float(np.round(-rng.uniform(1, 12), 1)))  # one decimal: equal costs happen
    md = dict(_HPARAMS)
    md.update({"general.name": "plamo2", "tokenizer.ggml.model": "plamo2", "tokenizer.ggml.tokens": texts,
               "tokenizer.ggml.token_type": np.array(types, np.int32),
               "tokenizer.ggml.scores": np.array(scores, np.float32),
               "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
               "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 3})
    save_gz(PLAMO2, md)


# ---------------------------------------------------------------------------------------------
# references from llama.cpp
# ---------------------------------------------------------------------------------------------

def pre_cases() -> list[str]:
    """One tokenizer.ggml.pre name per distinct llama.cpp behaviour (type + flags)."""
    seen: dict[Any, str] = {}
    for name, spec in PRE_NAMES.items():
        seen.setdefault(spec, name)
    return list(seen.values())


def cases() -> list[tuple[str, str, str | None]]:
    """(vocabulary file, tokenizer.ggml.model, tokenizer.ggml.pre) for every reference case."""
    out: list[tuple[str, str, str | None]] = []
    for name in pre_cases():
        if PRE_NAMES[name].type in RAW_UTF8_TYPES:
            # llama.cpp asserts a raw-UTF-8 BPE word has no space: "whitespace" needs its own model
            model = {"gemma4": "gemma4", "whitespace": "whitespace"}.get(PRE_NAMES[name].type, "gpt2")
            out.append((GEMMA4, model, name))
        else:
            out += [(BYTELEVEL, "gpt2", name), (TRAINED, "gpt2", name)]
    out += [(BYTELEVEL, "whitespace", "gpt-2"), (DNA, "hybriddna", "qwen2"), (WPM, "test", None),
            (SPM, "llama", None), (WPM, "bert", None), (UGM, "t5", None), (RWKV, "rwkv", None),
            (PLAMO2, "plamo2", None)]
    return out


def case_metadata(vocab: str, model: str, pre: str | None) -> dict[str, Any]:
    """The metadata of one case: the vocabulary file with its model / pre keys set."""
    md = read_md(HERE / vocab)
    md["tokenizer.ggml.model"] = model
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    return md


def llama_refs(path: Path) -> dict[str, list[Any]]:
    import llama_cpp

    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab = llama_cpp.llama_model_get_vocab(model)

    def tok(text: str | bytes, add: bool, special: bool) -> list[int]:
        b = text if isinstance(text, bytes) else text.encode("utf-8")
        cap = len(b) * 4 + 16
        arr = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(vocab, b, len(b), arr, cap, add, special)
        assert n >= 0, n
        return list(arr[:n])

    def detok(ids: list[int], unparse: bool) -> str:
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        buf = ctypes.create_string_buffer(len(ids) * 64 + 64)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, unparse)
        assert n >= 0, n
        return buf.raw[:n].decode("utf-8", "replace")

    out: dict[str, list[Any]] = {"ids": [], "ids_special": [], "ids_add": [], "detok": [], "detok_hidden": [],
                                 "ids_invalid": [tok(b, False, False) for b in INVALID]}
    for text in CORPUS:
        out["ids"].append(tok(text, False, False))
        sp = tok(text, False, True)
        out["ids_special"].append(sp)
        out["ids_add"].append(tok(text, True, False))
        out["detok"].append(detok(sp, True))
        out["detok_hidden"].append(detok(sp, False))
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def tid(t: int) -> int | None:
        return None if t < 0 else int(t)

    out["special"] = {
        "bos": tid(llama_cpp.llama_vocab_bos(vocab)), "eos": tid(llama_cpp.llama_vocab_eos(vocab)),
        "eot": tid(llama_cpp.llama_vocab_eot(vocab)), "sep": tid(llama_cpp.llama_vocab_sep(vocab)),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "eog": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        # attribute bits of every token that is not a plain NORMAL one
        "attrs": {str(i): a for i in range(n_vocab) if (a := int(llama_cpp.llama_vocab_get_attr(vocab, i))) != 4},
    }
    llama_cpp.llama_model_free(model)
    return out


def check_shipped(models: Path) -> int:
    """Compare minirt with llama.cpp on every full-size ``ggml-vocab-*.gguf`` llama.cpp ships, on
    this corpus and the ``.inp`` texts beside them (a development check; nothing is written)."""
    from minirt.tokenizer import Tokenizer

    bad_total = 0
    for path in sorted(models.glob("ggml-vocab-*.gguf")):
        texts = list(CORPUS)
        inp = path.with_name(path.name + ".inp")
        if inp.exists():
            texts += inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
        saved = list(CORPUS)
        CORPUS[:] = texts
        try:
            refs = llama_refs(path)
        finally:
            CORPUS[:] = saved
        tok = Tokenizer.from_gguf(mgguf.open(str(path)))
        bad = 0
        for k, text in enumerate(texts):
            for field, add, special in (("ids", False, False), ("ids_special", False, True), ("ids_add", True, False)):
                bad += tok.encode(text, add_special=add, parse_special=special) != refs[field][k]
            bad += tok.decode(refs["ids_special"][k]) != refs["detok"][k]
        bad += sorted(tok.eog_ids) != refs["special"]["eog"]
        print(f"{path.name}: {len(texts)} texts, {bad} differences", flush=True)
        bad_total += bad
    return 1 if bad_total else 0


def fuzz(seed: int, n: int = 250) -> int:
    """Compare minirt with llama.cpp on every case for ``n`` random texts (a development check)."""
    import random

    from minirt.tokenizer import Tokenizer

    pool = list("abcdeXYZ  \t\n\r'’sStLlmMdDreve0123456789.,!?;:-_()[]{}<>/\\\"#$%&*+=|~^`@") + list(
        "éèüñßİıΣσ中文日本語カタカナ한국어👍🏽😀\u200d\u0301\u0308\u00a0\u3000\u2028\u0085\ufffd\u1c89٣①ǅﬁ") + [
        "<|endoftext|>", "<|im_start|>", "<think>", "<dna>", "</dna>", "<ud>", "[SEP]", "<s>", "</s>", "ACGT"]
    rnd = random.Random(seed)
    texts = ["".join(rnd.choice(pool) for _ in range(rnd.randint(1, 40))) for _ in range(n)]
    saved = list(CORPUS)
    CORPUS[:] = texts
    bad_cases = 0
    td = Path(tempfile.mkdtemp())
    try:
        for vocab, model, pre in cases():
            md = case_metadata(vocab, model, pre)
            write_gguf(td / "case.gguf", md)
            refs = llama_refs(td / "case.gguf")
            tok = Tokenizer.from_metadata(md)
            bad = [(f, t) for k, t in enumerate(texts)
                   for f, a, sp in (("ids", False, False), ("ids_special", False, True), ("ids_add", True, False))
                   if tok.encode(t, add_special=a, parse_special=sp) != refs[f][k]]
            bad += [("detok", t) for k, t in enumerate(texts) if tok.decode(refs["ids_special"][k]) != refs["detok"][k]]
            if bad:
                bad_cases += 1
                print(f"{vocab} {model} {pre}: {len(bad)} differences, e.g. {bad[:2]}", flush=True)
    finally:
        CORPUS[:] = saved
        shutil.rmtree(td)
    print(f"seed {seed}: {n} random texts, {bad_cases} cases with differences")
    return 1 if bad_cases else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (its models/ folder)")
    ap.add_argument("--vocabs", action="store_true", help="rebuild the vocabulary files too")
    ap.add_argument("--check-shipped", action="store_true",
                    help="only compare with llama.cpp on the full vocabularies it ships (writes nothing)")
    ap.add_argument("--fuzz", type=int, metavar="SEED", help="only compare on random texts (writes nothing)")
    args = ap.parse_args()
    models = args.llama_cpp / "models"
    if args.fuzz is not None:
        return fuzz(args.fuzz)
    if args.check_shipped:
        return check_shipped(models)
    if args.vocabs:
        build_bytelevel(models)
        build_trained(models)
        build_dna()
        build_gemma4(models)
        build_spm(models)
        build_wpm(models)
        build_ugm(models)
        build_rwkv()
        build_plamo2()
    result: dict[str, Any] = {"corpus": CORPUS, "invalid_utf8": [b.hex() for b in INVALID], "cases": []}
    td = Path(tempfile.mkdtemp())
    try:
        for vocab, model, pre in cases():
            p = td / "case.gguf"
            write_gguf(p, case_metadata(vocab, model, pre))
            refs = llama_refs(p)
            result["cases"].append({"vocab": vocab, "model": model, "pre": pre, **refs})
            print(f"{vocab} {model} {pre}: {sum(map(len, refs['ids']))} ids", flush=True)
    finally:
        shutil.rmtree(td)
    raw = json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode()
    (HERE / "references.json.gz").write_bytes(gzip.compress(raw, 9, mtime=0))
    print(f"wrote references.json.gz ({len(result['cases'])} cases)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("LLAMA_LOG_LEVEL", "error")
    sys.exit(main())
