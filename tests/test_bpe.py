"""The compiled byte-level BPE merges (minirt.bpe) against the pure-Python port of llama.cpp's merge
loop (``Tokenizer._bpe_merge_word``, itself checked against llama.cpp's ids in
test_tokenizer_vocabs.py) on random words, long words and hand-made rule tables."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minirt
from minirt.bpe import ByteLevelMerges
from minirt.tokenizer import _BYTE_TO_CHAR, Tokenizer, _to_byte_level

DATA = Path(__file__).parent / "data" / "tokenizers"
_TOK: dict[str, Tokenizer] = {}


def _trained(tmp: Path) -> Tokenizer:
    if "t" not in _TOK:
        raw = tmp / "bpe-trained.gguf"
        raw.write_bytes(gzip.decompress((DATA / "bpe-trained.gguf.gz").read_bytes()))
        md = dict(minirt.gguf.open(str(raw)).metadata)
        md["tokenizer.ggml.pre"] = "gpt-2"
        _TOK["t"] = Tokenizer.from_metadata(md)
    return _TOK["t"]


def _compiled(tok: Tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    enc = [w.encode("utf-8") for w in words]
    offs = np.zeros(len(enc) + 1, np.int64)
    np.cumsum([len(e) for e in enc], out=offs[1:])
    ids, counts = tok._merger.merge(np.frombuffer(b"".join(enc), np.uint8), offs)
    out, pos = [], 0
    for c in counts.tolist():
        out.append(tuple(ids[pos:pos + c].tolist()))
        pos += c
    return out


def test_the_byte_level_vocabularies_take_the_compiled_path(tmp_path):
    tok = _trained(tmp_path)
    assert tok._merger is not None and tok._hf is None


_WORDS = st.lists(st.text(st.sampled_from(list("abcdefghij tehinsor'0123.,") + ["é", "日", "😀", "\x00", "ÿ"]),
                          min_size=1, max_size=30), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(_WORDS)
def test_compiled_merges_equal_the_python_port(tmp_path_factory, words):
    tok = _trained(tmp_path_factory.mktemp("bpe"))
    want = [tok._bpe_merge_word(_to_byte_level(w)) for w in words]
    assert _compiled(tok, words) == want


def test_long_words_and_empty_input(tmp_path):
    """A word of 60k bytes merges through the heap (not a quadratic scan) to the port's ids."""
    tok = _trained(tmp_path)
    words = ["the" * 20000, "a" * 4097, "x", " tokenizer" * 500]
    assert _compiled(tok, words) == [tok._bpe_merge_word(_to_byte_level(w)) for w in words]
    assert _compiled(tok, []) == []


def _toy(pairs: list[tuple[str, str]], extra: list[str] = ()) -> ByteLevelMerges:
    vocab = {c: i for i, c in enumerate(_BYTE_TO_CHAR) if c not in "q"}  # byte 'q' has no token
    for t in [a + b for a, b in pairs] + list(extra):
        vocab.setdefault(t, len(vocab))
    return ByteLevelMerges(_BYTE_TO_CHAR, vocab, pairs), vocab


def _merge_one(m: ByteLevelMerges, word: bytes) -> list[int]:
    ids, counts = m.merge(np.frombuffer(word, np.uint8), np.array([0, len(word)], np.int64))
    return ids[:counts[0]].tolist()


def test_rank_order_leftmost_ties_and_repeated_rules():
    m, v = _toy([("b", "c"), ("a", "b"), ("a", "bc"), ("b", "c")])
    assert _merge_one(m, b"abc") == [v["abc"]]  # b c first (rank 0), then a bc
    assert _merge_one(m, b"ab") == [v["ab"]]
    # equal ranks: the leftmost pair first: "bcbc" -> bc bc
    assert _merge_one(m, b"bcbc") == [v["bc"], v["bc"]]
    m2, v2 = _toy([("a", "a")])
    assert _merge_one(m2, b"aaa") == [v2["aa"], v2["a"]]  # leftmost "a a" merges, the last a stays
    # a repeated rule keeps its first rank: ("b","c") is rank 0 even though it is also rank 3
    m3, v3 = _toy([("a", "b"), ("b", "c"), ("x", "y"), ("a", "b")])
    assert _merge_one(m3, b"abc") == [v3["ab"], v3["c"]]


def test_a_byte_without_a_token_is_dropped_and_never_merged():
    m, v = _toy([("a", "b")])
    assert _merge_one(m, b"aqb") == [v["a"], v["b"]]
    assert _merge_one(m, b"qq") == []


def test_a_rule_naming_no_token_is_a_typed_error(tmp_path):
    raw = tmp_path / "bpe-trained.gguf"
    raw.write_bytes(gzip.decompress((DATA / "bpe-trained.gguf.gz").read_bytes()))
    md = dict(minirt.gguf.open(str(raw)).metadata)
    md["tokenizer.ggml.pre"] = "gpt-2"
    md["tokenizer.ggml.merges"] = list(md["tokenizer.ggml.merges"]) + ["zzzq zzzw"]
    with pytest.raises(minirt.TokenizerError, match="zzzq"):
        Tokenizer.from_metadata(md)
