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
from hypothesis import given, settings
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


def _ugm_engine(tmp: Path) -> Any:
    case = next(c for c in CASES if c["model"] == "t5")
    return _tokenizer(case, tmp)._engine


def test_unigram_fast_path_is_used_and_equals_llama_cpp(tmpdir_vocabs):
    """The Unigram tokenizer runs through HF tokenizers (Rust) wherever that is exact: most of the
    corpus takes that path, and every id there equals llama.cpp's (test_ids_equal_llama_cpp checks
    the whole tokenizer; this checks which path ran)."""
    eng = _ugm_engine(tmpdir_vocabs)
    assert eng._hf is not None
    case = next(c for c in CASES if c["model"] == "t5")
    fast = 0
    for k, text in enumerate(_refs()["corpus"]):
        got = eng._fast(text)
        if got is not None:
            fast += 1
            assert list(got) == case["ids"][k], text
    assert fast >= len(_refs()["corpus"]) * 0.7, fast


_UGM_ALPHABET = st.sampled_from(list("abcdefxyz ABCX  \t\n0123456789.,-") +
                                ["é", "e\u0301", "ﬁ", "Å", "Ａ", "①", "日", "本", "\u3000", "\u00a0", "😀", "\ufeff",
                                 "\u200b", "ß", "İ", "\x00", "\ufffd", "\U0010ffff"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_UGM_ALPHABET, max_size=40).map("".join))
def test_unigram_fast_path_equals_the_llama_cpp_port(tmp_path_factory, text):
    """On random text heavy in what the charsmap rewrites (compatibility forms, combining marks,
    odd spaces, NUL), the tokenizers path gives the ids of the hand-written port of llama.cpp."""
    eng = _UGM.get("e")
    if eng is None:
        eng = _UGM["e"] = _ugm_engine(tmp_path_factory.mktemp("ugm"))
    fast = eng._fast(text)
    if fast is not None:
        assert list(fast) == list(eng._viterbi(eng.normalize(text))), repr(text)
