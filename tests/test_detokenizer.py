"""Streaming detokenizer: deltas pushed token by token add up to decode(all ids), UTF-8 safe."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import reference_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minirt import gguf as mgguf
from minirt.detokenizer import StreamDecoder, clean_spaces
from minirt.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def qwen(qwen_path) -> Tokenizer:
    with mgguf.open(qwen_path) as f:
        return Tokenizer.from_gguf(f)


@pytest.fixture(scope="module")
def gemma_md(gemma_path) -> dict:
    with mgguf.open(gemma_path) as f:
        return dict(f.metadata)


@pytest.fixture(scope="module")
def gemma(gemma_md) -> Tokenizer:
    return Tokenizer.from_metadata(gemma_md)


@pytest.fixture(scope="module")
def gemma_prefixed(gemma_md) -> Tokenizer:
    """Gemma's vocabulary with add_space_prefix (as Llama 2 / Mistral / TinyLlama vocabularies have)."""
    return Tokenizer.from_metadata({**gemma_md, "tokenizer.ggml.add_space_prefix": True})


@pytest.fixture(scope="module")
def qwen_gpt2(qwen_path) -> Tokenizer:
    """Qwen's vocabulary with the gpt-2 pre-tokenizer, whose detokenizer cleans spaces (clean_spaces)."""
    with mgguf.open(qwen_path) as f:
        return Tokenizer.from_metadata({**f.metadata, "tokenizer.ggml.pre": "gpt-2"})


def stream(tok: Tokenizer, ids, skip_special: bool = False) -> list[str]:
    dec = tok.stream_decoder(skip_special=skip_special)
    deltas = [dec.push(i) for i in ids]
    deltas.append(dec.finish())
    return deltas


def _tok(request, key: str) -> Tokenizer:
    return request.getfixturevalue(key)


KEYS = ["qwen", "gemma", "gemma_prefixed", "qwen_gpt2"]
_HC = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


# ---------------------------------------------------------------------------------------------
# the reference strings, token by token
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["qwen", "gemma"])
def test_stream_equals_decode_on_reference(request, key):
    tok = _tok(request, key)
    for r in reference_jsonl(key, "tokenizer"):
        for ids in (r["ids"], r["ids_special"]):
            deltas = stream(tok, ids)
            assert "".join(deltas) == tok.decode(ids), r["text"]
            if "\ufffd" not in r["text"]:
                assert not any("\ufffd" in d for d in deltas), (r["text"], deltas)
        assert "".join(stream(tok, r["ids"])) == r["detok"]


def test_split_characters_wait_for_their_last_byte(qwen, gemma):
    # a CJK character and an emoji spread over several byte-level / byte-fallback tokens
    for tok, text in ((qwen, "鿿"), (gemma, "鿿"), (qwen, "\U0001fae8"), (gemma, "\U0001fae8"), (qwen, "𠀋")):
        ids = tok.encode(text)
        assert len(ids) > 1, "test needs a character split across tokens"
        deltas = stream(tok, ids)
        assert deltas[0] == "" and "".join(deltas) == text and "\ufffd" not in "".join(deltas)


def test_leading_space_is_stripped_like_llama_cpp(gemma_prefixed):
    tok = gemma_prefixed
    ids = tok.encode("Hello world")
    assert tok.token_text(ids[0]) == "▁Hello"
    assert tok.decode(ids) == "Hello world"
    assert stream(tok, ids)[0] == "Hello"
    # only the first piece loses its space
    ids2 = ids + tok.encode("again")
    assert "".join(stream(tok, ids2)) == tok.decode(ids2) == "Hello world again"


def test_finish_flushes_incomplete_bytes_and_reset(gemma):
    e4 = gemma.token_to_id("<0xE4>")
    dec = gemma.stream_decoder()
    assert dec.push(e4) == ""
    assert dec.finish() == "\ufffd" == gemma.decode([e4])
    dec.reset()
    assert dec.push(gemma.token_to_id("<0x41>")) == "A"
    dec.reset()
    b8 = gemma.token_to_id("<0xB8>")
    assert [dec.push(i) for i in (gemma.token_to_id("<0xE4>"), b8, gemma.token_to_id("<0xAD>"))] == ["", "", "中"]


def test_skip_special(qwen):
    ids = qwen.encode("<|im_start|>assistant\nHi<|im_end|>", parse_special=True)
    assert "".join(stream(qwen, ids)) == "<|im_start|>assistant\nHi<|im_end|>"
    assert "".join(stream(qwen, ids, skip_special=True)) == "assistant\nHi" == qwen.decode(ids, skip_special=True)


# ---------------------------------------------------------------------------------------------
# property tests: random text and random token sequences, both models
# ---------------------------------------------------------------------------------------------

_unicode = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)
_cjk_emoji = st.text(alphabet=st.one_of(
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK ideographs
    st.characters(min_codepoint=0x3040, max_codepoint=0x30FF),  # kana
    st.characters(min_codepoint=0xAC00, max_codepoint=0xD7A3),  # hangul
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
    st.characters(min_codepoint=0x0300, max_codepoint=0x036F),  # combining marks
    st.sampled_from(["\u200d", "\ufe0f", " ", "e", "\n", "'", ",", "?", "."]),
), max_size=30)


@settings(max_examples=120, deadline=None, suppress_health_check=_HC)
@given(s=st.one_of(_unicode, _cjk_emoji))
@pytest.mark.parametrize("key", KEYS)
def test_stream_equals_decode_random_text(request, key, s):
    tok = _tok(request, key)
    ids = tok.encode(s)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    if "\ufffd" not in tok.decode(ids):  # text holding U+FFFD itself streams it, as it should
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=120, deadline=None, suppress_health_check=_HC)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 40), skip=st.booleans())
@pytest.mark.parametrize("key", KEYS)
def test_stream_equals_decode_random_ids(request, key, seed, n, skip):
    """Arbitrary id sequences, invalid UTF-8 included: U+FFFD exactly where decode puts it."""
    tok = _tok(request, key)
    rnd = random.Random(seed)
    pool = [rnd.randrange(tok.n_vocab) for _ in range(8)]
    pool += [tok.token_to_id(t) for t in ("<0xE4>", "<0xB8>", "<0xAD>", "<0xF0>", "ä", "Ġ", ",", "'s", "Ġ'", "Ġ?")
             if tok.token_to_id(t) is not None]
    pool += sorted(tok.eog_ids)
    ids = [rnd.choice(pool) if rnd.random() < 0.7 else rnd.randrange(tok.n_vocab) for _ in range(n)]
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip)


def test_numpy_ids_are_accepted(qwen):
    ids = np.array(qwen.encode("numpy ids"), dtype=np.int32)
    assert "".join(stream(qwen, ids)) == "numpy ids"
    assert qwen.decode(ids) == "numpy ids"


# ---------------------------------------------------------------------------------------------
# clean_spaces, against a character-by-character port of llama.cpp's three passes
# ---------------------------------------------------------------------------------------------

def _clean_spaces_spec(text: str) -> str:
    t = list(text)

    def pass1(t):
        out = t[:1]
        for i in range(1, len(t)):
            if t[i - 1] == " " and t[i] in "?!.,":
                out.pop()
            out.append(t[i])
        return out

    def pass2(t):
        out = t[:1]
        i = 1
        while i < len(t):
            x = t[i]
            if x == "'" and i + 1 < len(t) and t[i - 1] == " " and t[i + 1] == " ":
                out.pop()
                t[i + 1] = "\0"
                i += 1
            out.append(x)
            i += 1
        return out

    def pass3(t):
        out = t[:1]
        for i in range(1, len(t)):
            x = t[i]
            if t[i - 1] == " " and x == "'" and i + 1 < len(t):
                x1 = t[i + 1]
                if x1 in "sm" or (i + 2 < len(t) and (x1, t[i + 2]) in (("r", "e"), ("v", "e"))):
                    out.pop()
            out.append(x)
        return out

    return "".join(pass3(pass2(pass1(t))))


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=" '?!.,smrevtdlxé中", max_size=24))
def test_clean_spaces_matches_llama_cpp_passes(s):
    assert clean_spaces(s) == _clean_spaces_spec(s)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([" ", "'", "?", ",", ".", "!", "s", "re", "ve", "m", "t", "ll", "x", " '", " ?", "' "]),
                max_size=25))
def test_clean_spaces_streaming(qwen_gpt2, parts):
    tok = qwen_gpt2
    ids = [i for p in parts for i in tok.encode(p)]
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == _clean_spaces_spec("".join(parts))


def test_stream_decoder_is_exported(qwen):
    dec = qwen.stream_decoder()
    assert isinstance(dec, StreamDecoder)
    dec.push(9707)
    assert dec.token_ids == [9707]
