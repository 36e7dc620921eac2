"""Every vocabulary kind and BPE pre-tokenizer of llama.cpp against llama.cpp's own ids.

The vocabularies and references live in ``tests/data/tokenizers`` (see its README): small
vocab-only GGUFs (cut from the ones llama.cpp ships, or written by ``regenerate.py``) and, for
each case (vocabulary x ``tokenizer.ggml.model`` x ``tokenizer.ggml.pre``), llama.cpp's
``llama_tokenize`` / ``llama_detokenize`` results on a corpus of whitespace runs, digits, code,
CJK, emoji, accents, contractions, special-token text and U+FFFD.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import minirt
from minirt.pretokenizers import PRE_NAMES
from minirt.tokenizer import SUPPORTED_MODELS, Tokenizer, decode_utf8_like_llama

DATA = Path(__file__).parent / "data" / "tokenizers"


@functools.cache
def _refs() -> dict[str, Any]:
    return json.loads(gzip.decompress((DATA / "references.json.gz").read_bytes()))



@functools.cache
def _metadata(vocab: str, tmp: Path) -> dict[str, Any]:
    raw = tmp / vocab.removesuffix(".gz")
    raw.write_bytes(gzip.decompress((DATA / vocab).read_bytes()))
    f = minirt.gguf.open(str(raw))
    return dict(f.metadata)


@pytest.fixture(scope="module")
def tmpdir_vocabs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vocabs")


def _case_id(case: dict[str, Any]) -> str:
    return f"{case['vocab'].split('.')[0]}-{case['model']}-{case['pre']}"


CASES = _refs()["cases"]


def _tokenizer(case: dict[str, Any], tmp: Path, **kw: Any) -> Tokenizer:
    md = dict(_metadata(case["vocab"], tmp))
    md["tokenizer.ggml.model"] = case["model"]
    if case["pre"] is not None:
        md["tokenizer.ggml.pre"] = case["pre"]
    return Tokenizer.from_metadata(md, **kw)


def _check(tok: Tokenizer, case: dict[str, Any]) -> list[str]:
    bad = []
    for k, text in enumerate(_refs()["corpus"]):
        for field, add, special in (("ids", False, False), ("ids_special", False, True), ("ids_add", True, False)):
            got = tok.encode(text, add_special=add, parse_special=special)
            if got != case[field][k]:
                bad.append(f"{field} {text!r}: {got} != llama.cpp {case[field][k]}")
    return bad


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ids_equal_llama_cpp(case, tmpdir_vocabs):
    tok = _tokenizer(case, tmpdir_vocabs)
    bad = _check(tok, case)
    assert not bad, "\n".join(bad[:5])


@pytest.mark.parametrize("case", [c for c in CASES if c["model"] in ("gpt2", "gemma4", "whitespace")][::4],
                         ids=_case_id)
def test_python_bpe_loop_equals_llama_cpp(case, tmpdir_vocabs):
    # the pure-Python merge loop (used without HF tokenizers) gives the same ids
    tok = _tokenizer(case, tmpdir_vocabs, use_hf_bpe=False)
    bad = _check(tok, case)
    assert not bad, "\n".join(bad[:5])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_detokenize_and_stream_equal_llama_cpp(case, tmpdir_vocabs):
    tok = _tokenizer(case, tmpdir_vocabs)
    for k, text in enumerate(_refs()["corpus"]):
        ids = case["ids_special"][k]
        for skip, field in ((False, "detok"), (True, "detok_hidden")):
            assert tok.decode(ids, skip_special=skip) == case[field][k], (text, skip)
            dec = tok.stream_decoder(skip_special=skip)
            streamed = "".join(dec.push(i) for i in ids) + dec.finish()
            assert streamed == case[field][k], (text, skip)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_special_tokens_equal_llama_cpp(case, tmpdir_vocabs):
    # special ids, BOS/EOS flags, end-of-generation set and token attributes (control,
    # user-defined, byte, unknown, unused, lstrip / rstrip) as llama.cpp's loader sets them
    tok = _tokenizer(case, tmpdir_vocabs)
    want = case["special"]
    got_ids = {"bos": tok.bos_id, "eos": tok.eos_id, "sep": tok.sep_id}
    assert got_ids == {k: want[k] for k in got_ids}
    # EOT found by its text: llama.cpp takes the first candidate in its hash map's order, minirt the
    # lowest id; both are end-of-generation tokens, so only which one is named EOT can differ
    if tok.eot_id != want["eot"]:
        assert {tok.eot_id, want["eot"]} <= set(want["eog"]) and tok.is_control(want["eot"])
    assert (tok.add_bos, tok.add_eos) == (want["add_bos"], want["add_eos"])
    assert sorted(tok.eog_ids) == want["eog"]
    attrs = {str(i): a for i in range(tok.n_vocab) if (a := tok.token_attr(i)) != 4}
    assert attrs == want["attrs"]


_RAW_BYTE_MODELS = ("llama", "rwkv", "t5", "test")


@pytest.mark.parametrize("case", [c for c in CASES if c["model"] not in _RAW_BYTE_MODELS], ids=_case_id)
def test_invalid_utf8_decoded_like_llama_cpp(case, tmpdir_vocabs):
    # llama.cpp reads each byte that starts no complete UTF-8 sequence as U+FFFD; SPM, RWKV and
    # Unigram (its charsmap matches raw bytes) and test vocabularies see raw bytes, which a str cannot carry
    tok = _tokenizer(case, tmpdir_vocabs)
    for raw, want in zip(_refs()["invalid_utf8"], case["ids_invalid"]):
        assert tok.encode(decode_utf8_like_llama(bytes.fromhex(raw))) == want, raw


def test_decode_utf8_like_llama():
    assert decode_utf8_like_llama(b"\xe4\xb8 x") == "\ufffd\ufffd x"  # Python's "replace" gives one U+FFFD
    assert decode_utf8_like_llama(b"\xc0\xaf") == "/"  # only the lead/continuation bits are checked
    assert decode_utf8_like_llama("héllo 中".encode()) == "héllo 中"


def test_every_llama_cpp_pre_tokenizer_and_model_is_covered():
    covered = {(c["model"], PRE_NAMES[c["pre"]] if c["pre"] else None) for c in CASES}
    specs = {spec for _, spec in covered}
    missing = sorted(n for n, spec in PRE_NAMES.items() if spec not in specs)
    assert not missing, f"pre-tokenizers without a llama.cpp reference: {missing}"
    assert SUPPORTED_MODELS == {c["model"] for c in CASES}
    # the names llama.cpp knows for the most used models of 2025-26
    assert {"qwen35", "gpt-4o", "tekken", "llama4", "kimi-k2", "seed-coder", "deepseek-coder", "falcon",
            "deepseek-v3", "gemma4", "glm4", "minimax-m2", "afmoe", "superbpe", "tiny_aya"} <= set(PRE_NAMES)


def test_committed_vocabularies_stay_small():
    sizes = {p.name: p.stat().st_size for p in DATA.glob("*.gz")}
    assert sizes and max(sizes.values()) < 256 * 1024, sizes


def test_unknown_model_names_the_key(tmpdir_vocabs):
    md = dict(_metadata("wpm.gguf.gz", tmpdir_vocabs))
    md["tokenizer.ggml.model"] = "no_vocab"
    with pytest.raises(minirt.TokenizerError, match="tokenizer.ggml.model 'no_vocab'"):
        Tokenizer.from_metadata(md)


@pytest.mark.parametrize("vocab, change, match", [
    ("bpe-gemma4.gguf.gz", {"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing"),
    ("ugm.gguf.gz", {"tokenizer.ggml.precompiled_charsmap": np.zeros(3, np.uint8)}, "precompiled_charsmap"),
    ("ugm.gguf.gz", {"tokenizer.ggml.precompiled_charsmap": np.array([255, 255, 0, 0, 1, 2], np.uint8)},
     "precompiled_charsmap"),
    ("plamo2.gguf.gz", {"tokenizer.ggml.token_type": "drop-bytes"}, "byte token <0x00>"),
    ("bpe-bytelevel.gguf.gz", {"tokenizer.ggml.pre": "no-such-pre"}, "'no-such-pre'"),
])
def test_bad_vocabularies_raise_typed_errors(vocab, change, match, tmpdir_vocabs):
    md = dict(_metadata(vocab, tmpdir_vocabs))
    for k, v in change.items():
        if v is None:
            md.pop(k)
        elif isinstance(v, str) and v == "drop-bytes":  # plamo2 without byte tokens: their types become NORMAL
            md[k] = np.where(np.asarray(md[k]) == 6, 1, np.asarray(md[k])).astype(np.int32)
        else:
            md[k] = v
    with pytest.raises(minirt.TokenizerError, match=match):
        Tokenizer.from_metadata(md)


def test_wordpiece_add_special_needs_sep(tmpdir_vocabs):
    md = dict(_metadata("wpm.gguf.gz", tmpdir_vocabs))
    tok = Tokenizer.from_metadata(md)
    assert tok.encode("hi", add_special=True)[-1] == tok.sep_id
    md.pop("tokenizer.ggml.seperator_token_id")
    md["tokenizer.ggml.tokens"] = list(md["tokenizer.ggml.tokens"])[:102]  # default SEP id 102 out of range
    md["tokenizer.ggml.token_type"] = np.asarray(md["tokenizer.ggml.token_type"])[:102]
    md.pop("tokenizer.ggml.mask_token_id")
    tok = Tokenizer.from_metadata(md)
    assert tok.sep_id is None
    with pytest.raises(minirt.TokenizerError, match="SEP"):
        tok.encode("hi", add_special=True)


_UGM: dict[str, Any] = {}


def _ugm_case() -> dict[str, Any]:
    return next(c for c in CASES if c["model"] == "t5")


def _hf_unigram(md: dict[str, Any]) -> Any:
    """HF tokenizers' Precompiled normaliser and Unigram lattice on the GGUF's vocabulary, with
    llama.cpp's space handling (this vocabulary: a space prefix, runs of spaces merged): an
    implementation nobody here wrote. It agrees with llama.cpp except where text holds a
    user-defined token's first character (llama.cpp copies the longest user-token prefix
    unnormalised) or normalises to U+10FFFF (the name given here to the pieces llama.cpp never
    matches): None there."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers

    texts = list(md["tokenizer.ggml.tokens"])
    types = [int(t) for t in md["tokenizer.ggml.token_type"]]  # 1 normal, 4 user-defined, 5 unused
    scores = [float(np.float32(s)) for s in md["tokenizer.ggml.scores"]]
    floor = min(s for s, t in zip(scores, types) if t == 1)
    never = "\U0010ffff"
    vocab = [(t, 0.0) if ty == 4 else (t, s) if ty in (1, 5) and t else (never * 2 + str(i), floor)
             for i, (t, ty, s) in enumerate(zip(texts, types, scores))]
    hf = HFTokenizer(models.Unigram(vocab, int(md["tokenizer.ggml.unknown_token_id"]), False))
    norm = normalizers.Precompiled(np.asarray(md["tokenizer.ggml.precompiled_charsmap"]).astype(np.uint8).tobytes())
    avoid = {t[0] for t, ty in zip(texts, types) if ty == 4 and t}

    def encode(text: str) -> list[int] | None:
        if avoid & set(text):
            return None
        s = norm.normalize_str(text)
        if never in s:
            return None
        s = "".join("\u2581" + w for w in s.split(" ") if w)
        return hf.encode(s, add_special_tokens=False).ids if s else []

    return encode


def _ugm(tmp: Path) -> tuple[Tokenizer, Any]:
    if not _UGM:
        case = _ugm_case()
        _UGM["tok"] = _tokenizer(case, tmp)
        _UGM["hf"] = _hf_unigram(dict(_metadata(case["vocab"], tmp)))
    return _UGM["tok"], _UGM["hf"]


def test_unigram_reference_holds_on_the_corpus(tmpdir_vocabs):
    """The tokenizers reference of the property test below gives llama.cpp's ids wherever it
    answers, on most of the corpus (else the property test would check little)."""
    _, hf = _ugm(tmpdir_vocabs)
    case = _ugm_case()
    answered = 0
    for k, text in enumerate(_refs()["corpus"]):
        want = hf(text)
        if want is not None:
            answered += 1
            assert want == case["ids"][k], text
    assert answered >= len(_refs()["corpus"]) * 0.7, answered


_UGM_ALPHABET = st.sampled_from(list("abcdefxyz ABCX  \t\n0123456789.,-") +
                                ["é", "e\u0301", "ﬁ", "Å", "Ａ", "①", "日", "本", "\u3000", "\u00a0", "😀", "\ufeff",
                                 "\u200b", "ß", "İ", "\x00", "\ufffd", "\U0010ffff", "the", " world", "ing"])


@settings(max_examples=400, deadline=None)
@given(st.lists(_UGM_ALPHABET, max_size=60).map("".join))
def test_unigram_equals_hf_tokenizers(tmp_path_factory, text):
    """On random text heavy in what the charsmap rewrites (compatibility forms, combining marks,
    odd spaces, NUL), the compiled port of llama.cpp's normaliser and search gives tokenizers' ids."""
    if not _UGM:
        _ugm(tmp_path_factory.mktemp("ugm"))
    tok, hf = _UGM["tok"], _UGM["hf"]
    want = hf(text)
    assume(want is not None)
    assert tok.encode(text) == want, repr(text)


def test_unigram_long_text_and_growth(tmpdir_vocabs):
    """A text whose normal form is longer than three bytes per input byte (U+FDFA becomes 33
    bytes) grows the compiled normaliser's buffer; a 200 KB text is encoded in one search."""
    tok, hf = _ugm(tmpdir_vocabs)
    text = "\ufdfa" * 300 + " x"
    assert len(tok._engine.normalize(text)) > 3 * len(text.encode())
    assert tok.encode(text) == hf(text)
    big = ("Hello world, the tokens 12 345 café ﬁne  日本語\n" * 4000)
    assert tok.encode(big) == hf(big)


def test_unigram_malformed_charsmap_raises_when_walked(tmpdir_vocabs):
    """A double array whose entries point past its end is refused with a typed error when a
    walk reaches them (llama.cpp throws there too), not read out of bounds."""
    md = dict(_metadata("ugm.gguf.gz", tmpdir_vocabs))
    xcda = np.zeros(256, "<u4")  # root base 0: byte c leads to entry c, which checks no byte ...
    xcda[0x40] = 0x40 | 1 << 8 | 0x1FFFFF << 10  # ... but '@': a leaf whose value lies past the end
    md["tokenizer.ggml.precompiled_charsmap"] = np.frombuffer(
        np.uint32(xcda.nbytes).tobytes() + xcda.tobytes() + b"x\0", np.uint8)
    tok = Tokenizer.from_metadata(md)
    assert tok.encode("zz") == tok.encode("zz")  # no walk past the root's children
    with pytest.raises(minirt.TokenizerError, match="precompiled_charsmap"):
        tok.encode("@")


def test_wordpiece_word_without_pieces(tmpdir_vocabs):
    """A word with a position no piece starts at is the unknown token as a whole (llama.cpp); with
    no unknown token in the vocabulary that is a typed error naming the word."""
    tok = _tokenizer(next(c for c in CASES if c["model"] == "bert"), tmpdir_vocabs)
    assert tok.token_to_id("\u2603") is None and tok.token_to_id("##\u2603") is None
    ids = tok.encode("hello ab\u2603cd world")
    assert ids == tok.encode("hello") + [tok.unk_id] + tok.encode("world")
    tok._engine.unk_id = None
    with pytest.raises(minirt.TokenizerError, match="ab\u2603cd"):
        tok.encode("hello ab\u2603cd")
