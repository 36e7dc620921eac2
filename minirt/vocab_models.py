"""The non-BPE, non-SPM vocabularies of llama.cpp: WordPiece (``bert``), Unigram (``t5``), RWKV
(``rwkv``) and PLaMo-2 (``plamo2``), each ported from ``src/llama-vocab.cpp`` rule for rule.

Why hand-written: each of these follows llama.cpp's own normalisation, not a library's.
llama.cpp's WordPiece lower-cases and strips accents with its own Unicode tables (NFD keeps only
a code point's first decomposed character) and splits punctuation as BERT does, but matches
``▁``-prefixed words greedily over bytes; its Unigram runs a Viterbi search over the *bytes* of
the text normalised by the GGUF's ``precompiled_charsmap`` (SentencePiece's XOR-compressed double
array), scoring user-defined tokens 0; HF ``tokenizers`` and ``sentencepiece`` differ from both in
details that change ids (and ``sentencepiece`` needs a ``.model`` protobuf a GGUF does not carry).

Each class takes the vocabulary (texts, attributes, scores) and appends the ids of one text
fragment to a list: the special-token partition, BOS/EOS and decoding stay in
:class:`minirt.tokenizer.Tokenizer`.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import TokenizerError
from .pretokenizers import (
    F_CONTROL,
    F_MARK,
    F_PUNCT,
    F_SYMBOL,
    F_WHITESPACE,
    codepoints,
    flag_table,
    lowercase_map,
    nfd_map,
)
from .quants._jit import jit
from .token_attrs import (
    ATTR_BYTE,
    ATTR_NORMAL,
    ATTR_UNUSED,
    ATTR_USER_DEFINED,
    BYTE_TOKEN_RE,
)

_SPACE = "\u2581"


# ---------------------------------------------------------------------------------------------
# WordPiece (llama.cpp llm_tokenizer_wpm_session)
# ---------------------------------------------------------------------------------------------

# llama.cpp's "Chinese character" ranges (0x2B920, not 0x2B820, as in HF's Rust code)
_CHINESE = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
            (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


@functools.cache
def _map_table(kind: str) -> np.ndarray:
    """Code point -> code point array for ``lowercase_map()`` or ``nfd_map()`` (identity elsewhere)."""
    table = np.arange(0x110000, dtype=np.uint32)
    m = lowercase_map() if kind == "lower" else nfd_map()
    table[np.fromiter(m.keys(), np.int64)] = np.fromiter(m.values(), np.uint32)
    return table


def _build_trie(keys: Sequence[bytes] | Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                 np.ndarray, int]:
    """A trie of ``keys`` (all bytes, or all str: labels are bytes or code points) as arrays for
    compiled walks (:func:`_trie_child`): node 0 is the root; node k's children are edges
    first[k] .. first[k] + count[k] - 1, sorted by label, leading to enode[e]. Returns (first,
    count, label, enode, value, the longest key's length): value[k] is the index in ``keys`` of the
    key ending at node k (the last one of equal keys), -1 where none ends.

    The keys are sorted (Python's sort orders bytes and str as their labels) and the trie is built
    from them in one compiled pass: a dict-of-dicts trie took 2.7 s for a 250k vocabulary."""
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: equal keys keep their order
    if keys and isinstance(keys[0], str):
        flat = np.frombuffer("".join(keys[i] for i in order).encode("utf-32-le", "surrogatepass"), np.uint32)
    else:
        flat = np.frombuffer(b"".join(keys[i] for i in order), np.uint8)  # type: ignore[arg-type]
    lens = np.fromiter((len(keys[i]) for i in order), np.int64, len(keys))
    offs = np.zeros(len(keys) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    depth = int(lens.max()) if len(keys) else 0
    first, count, label, enode, value = _trie_from_sorted(flat.astype(np.int64), offs,
                                                          np.asarray(order, np.int64), depth)
    return first, count, label, enode, value, depth


@jit()
def _trie_from_sorted(flat, offs, idx, depth):  # pragma: no cover - compiled
    """The arrays of :func:`_build_trie` from keys sorted: key j is flat[offs[j]:offs[j + 1]], its
    index idx[j]. Nodes are made in preorder (each key adds the nodes past its common prefix
    with the one before), so each node's children are made in label order; the edges are then
    grouped by parent, keeping that order."""
    n = idx.shape[0]
    cap = flat.shape[0] + 1
    parent = np.empty(cap, np.int64)
    lab = np.empty(cap, np.int64)
    value = np.full(cap, -1, np.int64)
    path = np.zeros(depth + 1, np.int64)  # path[d]: the node of the current key's first d labels
    nodes = 1
    prev = 0
    prev_len = 0
    for j in range(n):
        s = offs[j]
        ln = offs[j + 1] - s
        c = 0
        m = min(ln, prev_len)
        while c < m and flat[s + c] == flat[prev + c]:
            c += 1
        for d in range(c, ln):
            parent[nodes] = path[d]
            lab[nodes] = flat[s + d]
            path[d + 1] = nodes
            nodes += 1
        value[path[ln]] = idx[j]
        prev = s
        prev_len = ln
    count = np.zeros(nodes, np.int64)
    for k in range(1, nodes):
        count[parent[k]] += 1
    first = np.zeros(nodes, np.int64)
    for k in range(1, nodes):
        first[k] = first[k - 1] + count[k - 1]
    fill = first.copy()
    label = np.empty(nodes - 1, np.int64)
    enode = np.empty(nodes - 1, np.int64)
    for k in range(1, nodes):
        e = fill[parent[k]]
        label[e] = lab[k]
        enode[e] = k
        fill[parent[k]] = e + 1
    return first, count, label, enode, value[:nodes].copy()


@jit(inline=True)
def _trie_child(first, count, label, enode, node, c):  # pragma: no cover - compiled
    """The child of ``node`` along label c in a :func:`_build_trie` trie (binary search), or -1."""
    lo = first[node]
    hi = lo + count[node]
    while lo < hi:
        mid = (lo + hi) >> 1
        e = label[mid]
        if e < c:
            lo = mid + 1
        elif e > c:
            hi = mid
        else:
            return enode[mid]
    return -1


class WordPiece:
    """BERT-style WordPiece over a GGUF vocabulary whose word-initial pieces start with ``▁``: each
    word takes the longest piece at each position, greedily, through a byte trie walked by a
    compiled loop (:func:`_wpm_greedy`; per word in Python it ran at 0.7x llama.cpp's speed)."""

    def __init__(self, texts: Sequence[str], unk_id: int | None, lowercase: bool, strip_accents: bool) -> None:
        first, count, label, enode, tok, _ = _build_trie([t.encode("utf-8", "surrogateescape") for t in texts])
        root = np.full(256, -1, np.int64)  # the node of each one-byte prefix
        root[label[:count[0]]] = enode[:count[0]]
        self._trie = (first, count, label, enode, root, tok)
        self.unk_id = unk_id
        self.lowercase = lowercase
        self.strip_accents = strip_accents

    def _spans(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """llama.cpp ``preprocess``: the normalised code points and each word's [start, end) in
        them (vectorised: one class per code point, then runs of word characters and single
        punctuation characters)."""
        empty = np.zeros(0, np.int64)
        if not text:
            return empty.astype(np.uint32), empty, empty
        cps = codepoints(text)
        if self.strip_accents:
            cps = _map_table("nfd")[cps]
        fl = flag_table()[cps]
        ws = (fl & F_WHITESPACE) != 0
        skip = ~ws & ((cps == 0) | (cps == 0xFFFD) | ((fl & F_CONTROL) != 0))
        if self.strip_accents:
            skip |= ~ws & ((fl & F_MARK) != 0)
        punct = ((fl & F_PUNCT) != 0) | ((cps < 0x7F) & ((fl & F_SYMBOL) != 0))
        for lo, hi in _CHINESE:
            punct |= (cps >= lo) & (cps <= hi)
        keep = ~skip
        cps, ws, punct = cps[keep], ws[keep], punct[keep]  # skipped characters do not end a word
        if self.lowercase:
            cps = _map_table("lower")[cps]
        n = len(cps)
        if n == 0:
            return cps.astype(np.uint32), empty, empty
        # a token starts at every punctuation character and at a word character after a non-word one;
        # it ends at the next start or whitespace (word boundaries found in numpy, not by a regex)
        word = ~ws & ~punct
        after_word = np.zeros(n, dtype=bool)
        after_word[1:] = word[:-1]
        start = punct | (word & ~after_word)
        starts = np.flatnonzero(start)
        stops = np.append(np.flatnonzero(start | ws), n)
        ends = stops[np.searchsorted(stops, starts, side="right")]
        return cps.astype(np.uint32), starts, ends

    def encode(self, text: str, out: list[int]) -> None:
        cps, starts, ends = self._spans(text)
        if not len(starts):
            return
        # UTF-8 of the normalised text, and each word's byte span in it
        nbytes = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
        offs = np.zeros(len(cps) + 1, np.int64)
        np.cumsum(nbytes, out=offs[1:])
        data = np.frombuffer(cps.tobytes().decode("utf-32-le").encode("utf-8"), np.uint8)
        bstart, bend = offs[starts], offs[ends]
        ids = np.empty(int((bend - bstart).sum()) + 3 * len(starts), np.int64)  # at most a token per byte
        k = _wpm_greedy(data, bstart, bend, *self._trie, -1 if self.unk_id is None else int(self.unk_id), ids)
        if k < 0:
            word = data[bstart[-k - 1]:bend[-k - 1]].tobytes().decode("utf-8", "replace")
            raise TokenizerError(f"word {word!r} has no WordPiece tokens and the vocabulary has no unknown token")
        out.extend(ids[:k].tolist())


@jit()
def _wpm_greedy(data, starts, ends, first, count, label, enode, root, tok, unk, ids):  # pragma: no cover
    """WordPiece (llama.cpp ``llm_tokenizer_wpm_session``) of the words data[starts[w]:ends[w]]
    (UTF-8 bytes), each read with ``▁`` (E2 96 81) before it: at each position the longest piece
    (trie: first, count, label, enode, root[byte] the first step, tok the id ending at a node),
    a word with a position no piece starts at becomes the one id unk. ids[:k] = the ids, returns
    k; -(w + 1) when word w needs the unknown token and unk < 0."""
    k = 0
    for w in range(starts.shape[0]):
        s = starts[w] - 3  # virtual offset: positions 0-2 are the space symbol
        n = ends[w] - s
        k0 = k
        i = 0
        while i < n:
            b = 0xE2 if i == 0 else 0x96 if i == 1 else 0x81 if i == 2 else data[s + i]
            node = root[b]
            j = i + 1
            best = -1
            stop = 0
            while node >= 0:
                if tok[node] >= 0:
                    best = tok[node]
                    stop = j
                if j >= n:
                    break
                b = 0x96 if j == 1 else 0x81 if j == 2 else data[s + j]
                node = _trie_child(first, count, label, enode, node, b)
                j += 1
            if best < 0:
                if unk < 0:
                    return -(w + 1)
                k = k0  # one unmatched position discards the whole word
                ids[k] = unk
                k += 1
                break
            ids[k] = best
            k += 1
            i = stop
    return k


# ---------------------------------------------------------------------------------------------
# Unigram (llama.cpp llm_tokenizer_ugm / _session)
# ---------------------------------------------------------------------------------------------

# Why compiled, not HF tokenizers: tokenizers' Precompiled normaliser and Unigram lattice agree
# with llama.cpp except on text holding a user-defined token's first character (llama.cpp copies
# the longest user-token prefix unnormalised) and on pieces llama.cpp never matches (control,
# unknown, byte), and calling it once per new word ran at 0.4-0.8x llama.cpp's speed. The port
# below follows llama.cpp byte for byte, compiled: no fallback path, and faster than both.

class Unigram:
    """SentencePiece-style Unigram: llama.cpp's normaliser (the GGUF's ``precompiled_charsmap``, a
    XOR-compressed double array) and Viterbi search over the normalised bytes, compiled
    (:func:`_ugm_normalize`, :func:`_ugm_viterbi`)."""

    ERRORS = {1: "tokenizer.ggml.precompiled_charsmap: index out of bounds",
              2: "tokenizer.ggml.precompiled_charsmap: replacement offset out of bounds",
              3: "tokenizer.ggml.precompiled_charsmap: unterminated replacement string",
              4: "text needs the unknown token, but the vocabulary has none"}

    def __init__(self, texts: Sequence[str], attrs: Sequence[int], scores: Sequence[float], unk_id: int | None,
                 charsmap: Any, add_space_prefix: bool, remove_extra_ws: bool, escape_ws: bool = True,
                 treat_ws_as_suffix: bool = False) -> None:
        self.unk_id = unk_id
        attr = np.asarray(attrs, np.int64)
        score = np.asarray(scores, np.float32)
        normal = score[(attr & ATTR_NORMAL) != 0]
        normal = normal[~np.isnan(normal)]  # llama.cpp's std::min skips NaN
        min_score = normal.min() if len(normal) else np.float32(np.finfo(np.float32).max)
        self._unk_score = float(np.float32(min_score - np.float32(10.0)))  # float arithmetic, as llama.cpp
        raw = [t.encode("utf-8", "surrogateescape") for t in texts]
        matched = np.flatnonzero(attr & (ATTR_NORMAL | ATTR_USER_DEFINED | ATTR_UNUSED))
        first, count, label, enode, value, _ = _build_trie([raw[i] for i in matched])
        ends = value >= 0
        tok = np.full(len(value), -1, np.int64)
        tok[ends] = matched[value[ends]]
        # each node's score as a double: user-defined tokens score 0 (llama.cpp), the rest their float32
        node_score = np.zeros(len(value), np.float64)
        node_score[ends] = np.where(attr[tok[ends]] & ATTR_USER_DEFINED, 0.0, score[tok[ends]].astype(np.float64))
        root = np.full(256, -1, np.int64)  # the node of each one-byte prefix: a table instead of a search
        root[label[:count[0]]] = enode[:count[0]]
        self._tokens = (first, count, label, enode, root, tok, node_score)
        user = np.flatnonzero(attr & ATTR_USER_DEFINED)
        self._user = _build_trie([raw[i] for i in user])[:4]
        xcda = np.zeros(0, np.int64)
        repl = np.zeros(0, np.uint8)
        if charsmap is not None and len(charsmap):
            blob = np.asarray(charsmap).astype(np.uint8).tobytes()
            if len(blob) < 4:
                raise TokenizerError("tokenizer.ggml.precompiled_charsmap is too small for its header")
            (size,) = struct.unpack_from("<I", blob, 0)
            if size + 4 >= len(blob):
                raise TokenizerError("tokenizer.ggml.precompiled_charsmap: index out of bounds")
            xcda = np.frombuffer(blob, dtype="<u4", count=size // 4, offset=4).astype(np.int64)
            repl = np.frombuffer(blob, np.uint8, offset=4 + size).copy()
        self._charsmap = (xcda, repl)
        self._space = np.frombuffer((_SPACE if escape_ws else " ").encode(), np.uint8).copy()
        prepend = add_space_prefix and not treat_ws_as_suffix
        append = add_space_prefix and treat_ws_as_suffix
        self._flags = np.asarray([prepend, append, remove_extra_ws], np.int64)
        self._cache: dict[str, tuple[int, ...]] = {}  # short fragments (chat turns repeat them)

    def _check(self, code: int) -> None:
        if code:
            raise TokenizerError(self.ERRORS[code])

    def _normalized(self, text: str) -> tuple[np.ndarray, int]:
        out, m, code = _ugm_normalize(np.frombuffer(text.encode("utf-8"), np.uint8), *self._user,
                                      *self._charsmap, self._space, self._flags)
        self._check(code)
        return out, m

    def normalize(self, text: str) -> bytes:
        """The bytes the Viterbi search reads (llama.cpp ``normalize``)."""
        out, m = self._normalized(text)
        return out[:m].tobytes()

    def _ids(self, text: str) -> list[int]:
        out, m = self._normalized(text)
        ids = _ugm_viterbi(out, m, *self._tokens, -1 if self.unk_id is None else int(self.unk_id), self._unk_score)
        if len(ids) and ids[0] == -2:
            self._check(4)
        return ids.tolist()

    def encode(self, text: str, out: list[int]) -> None:
        if len(text) > 256:  # long fragments are rarely repeated: not worth keeping
            out.extend(self._ids(text))
            return
        ids = self._cache.get(text)
        if ids is None:
            ids = tuple(self._ids(text))
            if len(self._cache) > 1 << 15:
                self._cache.clear()
            self._cache[text] = ids
        out.extend(ids)


@jit()
def _ugm_normalize(data, uf, uc, ul, ue, xcda, repl, space, flags):  # pragma: no cover - compiled
    """llama.cpp's Unigram ``normalize`` of the UTF-8 bytes data (n,): returns (buffer, m, code),
    the normalised bytes buffer[:m]; code 1-3: the charsmap is malformed (Unigram.ERRORS).

    At each offset the longest walk through the user-defined tokens' trie (uf, uc, ul, ue; a walk,
    token or not, as llama.cpp's naive_trie) is copied as it is; else the longest charsmap match
    (xcda: the double array, repl: NUL-terminated replacements) is replaced; else one valid UTF-8
    character is copied, or one invalid byte becomes U+FFFD. Spaces in the result become ``space``,
    with flags = (prepend one before the first word, append one at the end, merge runs)."""
    n = data.shape[0]
    out = np.empty(3 * n + 16, np.uint8)
    m = 0
    prepend = flags[0] != 0
    merge = flags[2] != 0
    nsp = space.shape[0]
    xs = xcda.shape[0]
    nr = repl.shape[0]
    prepended = False
    non_ws = False
    off = 0
    while off < n:
        k = off  # 1. user-defined tokens
        node = 0
        while k < n:
            nxt = _trie_child(uf, uc, ul, ue, node, data[k])
            if nxt < 0:
                break
            node = nxt
            k += 1
        src = 0  # where the replacement's bytes are: 0 data, 1 repl, 2 U+FFFD
        start = off
        length = k - off
        used = length
        if length == 0:
            longest = 0  # 2. the charsmap
            rep = 0
            if xs > 0:
                p = xcda[0]
                ni = (p >> 10) << ((p & 512) >> 6)
                for j in range(off, n):
                    c = np.int64(data[j])
                    if c == 0:
                        break
                    ni ^= c
                    if ni >= xs:
                        return out, 0, 1
                    p = xcda[ni]
                    if p & 0x800000FF != c:
                        break
                    leaf = (p >> 8) & 1
                    ni ^= (p >> 10) << ((p & 512) >> 6)
                    if leaf:
                        if ni >= xs:
                            return out, 0, 1
                        longest = j - off + 1
                        rep = xcda[ni] & 0x7FFFFFFF
            if longest > 0:
                if rep >= nr:
                    return out, 0, 2
                end = rep
                while end < nr and repl[end] != 0:
                    end += 1
                if end == nr:
                    return out, 0, 3
                src = 1
                start = rep
                length = end - rep
                used = longest
            else:  # 3. one character (llama.cpp unicode_cpt_from_utf8: lead and continuation bits)
                b0 = data[off]
                need = 1 if b0 < 0x80 else 0 if b0 < 0xC0 else 2 if b0 < 0xE0 else 3 if b0 < 0xF0 \
                    else 4 if b0 < 0xF8 else 0
                if need > 1:
                    if off + need > n:
                        need = 0
                    else:
                        for q in range(1, need):
                            if data[off + q] & 0xC0 != 0x80:
                                need = 0
                                break
                if need:
                    length = need
                    used = need
                else:
                    src = 2
                    length = 3
                    used = 1
        if m + length * nsp + nsp > out.shape[0]:  # each byte may become a space symbol, plus a prefix
            grown = np.empty(2 * out.shape[0] + length * nsp + nsp, np.uint8)
            grown[:m] = out[:m]
            out = grown
        for i in range(length):
            if src == 0:
                c8 = data[start + i]
            elif src == 1:
                c8 = repl[start + i]
            else:
                c8 = 0xEF if i == 0 else 0xBF if i == 1 else 0xBD
            if c8 != 0x20:
                if not non_ws:
                    non_ws = True
                    if (prepend and not prepended) or merge:
                        for q in range(nsp):
                            out[m + q] = space[q]
                        m += nsp
                        prepended = True
                out[m] = c8
                m += 1
            else:
                non_ws = False
                if not merge:
                    for q in range(nsp):
                        out[m + q] = space[q]
                    m += nsp
        off += used
    if flags[1] != 0:
        if m + nsp > out.shape[0]:
            grown = np.empty(m + nsp, np.uint8)
            grown[:m] = out[:m]
            out = grown
        for q in range(nsp):
            out[m + q] = space[q]
        m += nsp
    return out, m, 0


@jit()
def _ugm_viterbi(s, m, first, count, label, enode, root, tok, node_score, unk, unk_score):  # pragma: no cover
    """llama.cpp's Unigram search over s[:m] (normalised bytes): the ids of the best-scoring
    segmentation, runs of unknown tokens fused into one; [-2] when that needs the unknown token
    and unk < 0. Steps one UTF-8 character at a time; each vocabulary piece starting there (the
    token trie: first, count, label, enode, root[byte] the first step, tok / node_score the id and
    score ending at a node) competes for the offset it ends at (scores summed in double); a
    character no single piece covers may be the unknown token at unk_score."""
    if m == 0:
        return np.empty(0, np.int64)
    best = np.full(m + 1, -np.inf)  # llama.cpp: -DBL_MAX, the same order for finite sums
    best[0] = 0.0
    best_id = np.full(m + 1, unk, np.int64)
    best_from = np.zeros(m + 1, np.int64)
    off = 0
    while off < m:
        b0 = s[off]
        cu = 1 if b0 < 0xC0 else 2 if b0 < 0xE0 else 3 if b0 < 0xF0 else 4  # llama.cpp unicode_len_utf8
        if cu > m - off:
            cu = m - off
        cur = best[off]
        single = False
        node = root[b0]
        k = off + 1
        while node >= 0:
            t = tok[node]
            if t >= 0:
                if k - off == cu:
                    single = True
                sc = cur + node_score[node]
                if sc > best[k]:
                    best[k] = sc
                    best_id[k] = t
                    best_from[k] = off
            if k >= m:
                break
            node = _trie_child(first, count, label, enode, node, s[k])
            k += 1
        if not single:
            sc = cur + unk_score
            e = off + cu
            if sc > best[e]:
                best[e] = sc
                best_id[e] = unk
                best_from[e] = off
        off += cu
    # back from the end: count, then fill in reverse
    n_ids = 0
    prev_unk = False
    p = m
    while True:
        is_unk = best_id[p] == unk
        if not (prev_unk and is_unk):
            n_ids += 1
            if unk < 0 and is_unk:
                return np.full(1, -2, np.int64)
        if best_from[p] == 0:
            break
        prev_unk = is_unk
        p = best_from[p]
    ids = np.empty(n_ids, np.int64)
    prev_unk = False
    p = m
    j = n_ids
    while True:
        is_unk = best_id[p] == unk
        if not (prev_unk and is_unk):
            j -= 1
            ids[j] = best_id[p]
        if best_from[p] == 0:
            break
        prev_unk = is_unk
        p = best_from[p]
    return ids


# ---------------------------------------------------------------------------------------------
# RWKV (llama.cpp llm_tokenizer_rwkv_session): greedy longest match over escaped byte tokens
# ---------------------------------------------------------------------------------------------

def rwkv_unescape(escaped: str) -> bytes:
    """llama.cpp ``llama_unescape_rwkv_token``: ``\\t \\n \\r \\xNN`` and ``\\c`` escapes to bytes."""
    out = bytearray()
    esc = False
    hex_left = 0
    acc = 0
    for c in escaped.encode("utf-8"):
        if hex_left:
            v = c - 0x61 + 10 if c >= 0x61 else c - 0x30
            acc = ((acc << 4) + v) & 0xFF
            hex_left -= 1
            if hex_left == 0:
                out.append(acc)
                acc = 0
            continue
        if esc:
            if c == 0x74:
                out.append(9)
            elif c == 0x6E:
                out.append(10)
            elif c == 0x72:
                out.append(13)
            elif c == 0x78:
                hex_left = 2
            else:
                out.append(c)
            esc = False
            continue
        if c == 0x5C:
            esc = True
            continue
        out.append(c)
    return bytes(out)


class RWKV:
    """RWKV's "world" tokenizer: the longest vocabulary entry (as bytes) at each position.

    The byte trie is flattened into arrays and walked by a compiled loop (:func:`_rwkv_longest`):
    a Python loop over the bytes ran at a fifth of llama.cpp's speed."""

    def __init__(self, texts: Sequence[str], unk_id: int | None) -> None:
        self.pieces = [rwkv_unescape(t) for t in texts]
        self.unk_id = unk_id
        first, count, label, enode, tok, _ = _build_trie(self.pieces)  # tok: the id ending at each node
        self._arrays = (first, count, label, enode, tok)
        # root[b]: the node of the one-byte prefix b (-1: none), a table instead of a search
        self._root = np.full(256, -1, np.int64)
        self._root[label[:count[0]]] = enode[:count[0]]

    def encode(self, text: str, out: list[int]) -> None:
        data = np.frombuffer(text.encode("utf-8"), np.uint8)
        ids = np.empty(len(data), np.int64)  # at most one token per byte
        err = np.zeros(1, np.int64)
        n = _rwkv_longest(data, self._root, *self._arrays, -1 if self.unk_id is None else int(self.unk_id), ids, err)
        if n == -1:
            raise TokenizerError(f"byte 0x{int(data[err[0]]):02x} has no RWKV token and there is no unknown token")
        if n == -2:
            raise TokenizerError("RWKV vocabulary lacks a token for a byte prefix it extends")
        out.extend(ids[:n].tolist())


@jit()
def _rwkv_longest(data, root, first, count, label, enode, tok, unk, ids, err):  # pragma: no cover - compiled
    """Greedy longest match of data (n,) uint8 over the flattened trie (see RWKV): ids[:k] = the
    tokens, returns k; -1: data[err[0]] starts no token and unk < 0; -2: a walk ended with no token."""
    n = data.shape[0]
    pos = 0
    k = 0
    while pos < n:
        node = root[data[pos]]
        if node < 0:
            if unk < 0:
                err[0] = pos
                return -1
            ids[k] = unk
            k += 1
            pos += 1
            continue
        tid = -1
        end = 0
        p = pos
        while True:
            t = tok[node]
            if t >= 0:
                tid = t
                end = p + 1
            if p + 1 >= n:
                break
            p += 1
            nxt = _trie_child(first, count, label, enode, node, data[p])
            if nxt < 0:
                break
            node = nxt
        if tid < 0:
            err[0] = pos
            return -2
        ids[k] = tid
        k += 1
        pos = end
    return k


# ---------------------------------------------------------------------------------------------
# PLaMo-2 (llama.cpp llm_tokenizer_plamo2): lowest-cost segmentation, byte fallback
# ---------------------------------------------------------------------------------------------

_P2_UNKNOWN = -10000000


def _round_half_away(x: float) -> int:
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


class Plamo2:
    """PLaMo-2's tokenizer: dynamic programming over code points; each piece costs
    ``-round(score * 1e4)``, a code point no token covers costs 1e7 and becomes byte tokens.

    The longest of equally cheap pieces wins (llama.cpp tries longer pieces first, strict ``<``).
    The code-point trie is flattened into arrays and the search runs compiled (:func:`_plamo2_dp`):
    in a Python loop it ran at a third of llama.cpp's speed."""

    def __init__(self, texts: Sequence[str], attrs: Sequence[int], scores: Sequence[float]) -> None:
        byte_ids = [0] * 256
        keys: list[str] = []
        key_ids: list[int] = []
        key_costs: list[int] = []
        for i, (t, a) in enumerate(zip(texts, attrs)):
            if a & ATTR_BYTE:
                m = BYTE_TOKEN_RE.fullmatch(t)
                if m is not None:
                    byte_ids[int(m.group(1), 16)] = i
                continue
            sc = float(np.float32(scores[i]))
            if not math.isfinite(sc):  # a piece without a usable score is never chosen
                continue
            keys.append(t)
            key_ids.append(i)
            key_costs.append(_round_half_away(sc * 1e4))
        missing = [b for b in range(256) if byte_ids[b] == 0]
        if missing:
            raise TokenizerError(f"PLaMo-2 vocabulary lacks byte token <0x{missing[0]:02X}>")
        self._bytes = np.asarray(byte_ids, np.int64)
        # tok[k] / cost[k]: the piece ending at trie node k (-1: none)
        first, count, label, enode, value, self._max_len = _build_trie(keys)
        ends = value >= 0
        tok = np.full(len(value), -1, np.int64)
        tok[ends] = np.asarray(key_ids, np.int64)[value[ends]]
        cost = np.zeros(len(value), np.int64)
        cost[ends] = np.asarray(key_costs, np.int64)[value[ends]]
        self._arrays = (first, count, label, enode, tok, cost)

    def encode(self, text: str, out: list[int]) -> None:
        if text[:1] == "\ufeff":
            text = text[1:]
        if not text:
            return
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.int64)
        ids = np.empty(4 * len(cps), np.int64)  # at most 4 byte tokens per code point
        n = _plamo2_dp(cps, *self._arrays, self._bytes, np.empty((2, self._max_len + 1), np.int64), ids)
        out.extend(ids[:n].tolist())


@jit()
def _plamo2_dp(cps, first, count, label, enode, tok, cost, byte_ids, cand, ids):  # pragma: no cover - compiled
    """PLaMo-2's search over code points cps (n,) (see Plamo2): ids[:k] = the tokens, returns k.
    cand: (2, longest piece + 1) scratch, the trie node and length of each piece starting at i."""
    n = cps.shape[0]
    big = np.int64(1) << 60
    best_cost = np.full(n + 1, big, np.int64)
    best_cost[n] = 0
    step = np.zeros(n + 1, np.int64)
    best_tok = np.full(n + 1, -1, np.int64)
    for i in range(n - 1, -1, -1):
        nc = 0  # candidates (trie nodes of pieces starting at i), shortest first
        node = 0
        k = i
        while k < n:
            nxt = _trie_child(first, count, label, enode, node, cps[k])
            if nxt < 0:
                break
            node = nxt
            k += 1
            if tok[node] >= 0:
                cand[0, nc] = node
                cand[1, nc] = k - i
                nc += 1
        best = best_cost[i]
        for j in range(nc - 1, -1, -1):  # longest first, strict <
            nd = cand[0, j]
            ln = cand[1, j]
            s = best_cost[i + ln] - cost[nd]
            if s < best:
                best = s
                step[i] = ln
                best_tok[i] = tok[nd]
        s = best_cost[i + 1] - _P2_UNKNOWN
        if s < best:
            best = s
            step[i] = 1
            best_tok[i] = -1
        best_cost[i] = best
    pos = 0
    m = 0
    while pos < n:
        t = best_tok[pos]
        if t >= 0:
            ids[m] = t
            m += 1
        else:  # the code point's UTF-8 bytes as byte tokens
            c = cps[pos]
            if c < 0x80:
                ids[m] = byte_ids[c]
                m += 1
            elif c < 0x800:
                ids[m] = byte_ids[0xC0 | (c >> 6)]
                ids[m + 1] = byte_ids[0x80 | (c & 0x3F)]
                m += 2
            elif c < 0x10000:
                ids[m] = byte_ids[0xE0 | (c >> 12)]
                ids[m + 1] = byte_ids[0x80 | ((c >> 6) & 0x3F)]
                ids[m + 2] = byte_ids[0x80 | (c & 0x3F)]
                m += 3
            else:
                ids[m] = byte_ids[0xF0 | (c >> 18)]
                ids[m + 1] = byte_ids[0x80 | ((c >> 12) & 0x3F)]
                ids[m + 2] = byte_ids[0x80 | ((c >> 6) & 0x3F)]
                ids[m + 3] = byte_ids[0x80 | (c & 0x3F)]
                m += 4
        pos += step[pos]
    return m


# ---------------------------------------------------------------------------------------------
# llama.cpp's "test" vocabulary: a hash of each 5-byte chunk
# ---------------------------------------------------------------------------------------------

class HashTest:
    """llama.cpp's ``test`` tokenizer (for its own tests): each 5-byte chunk of a fragment's
    UTF-8 is one id, ``hash * 31 + byte`` over the chunk (64-bit) modulo the vocabulary size."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab

    def encode(self, text: str, out: list[int]) -> None:
        data = np.frombuffer(text.encode("utf-8"), np.uint8)
        ids = np.empty((len(data) + 4) // 5, np.int64)
        _hash_chunks(data, self.n_vocab, ids)
        out.extend(ids.tolist())


@jit()
def _hash_chunks(data, n_vocab, ids):  # pragma: no cover - compiled
    """ids[i] = the 64-bit hash (h * 31 + byte, wrapping) of data[5i:5i + 5] modulo n_vocab."""
    m = np.uint64(n_vocab)
    c = np.uint64(31)
    full = data.shape[0] // 5
    for i in range(full):  # whole chunks unrolled
        j = 5 * i
        h = np.uint64(data[j]) * c + np.uint64(data[j + 1])
        h = (h * c + np.uint64(data[j + 2])) * c + np.uint64(data[j + 3])
        ids[i] = np.int64((h * c + np.uint64(data[j + 4])) % m)
    if full < ids.shape[0]:
        h = np.uint64(0)
        for j in range(5 * full, data.shape[0]):
            h = h * c + np.uint64(data[j])
        ids[full] = np.int64(h % m)
