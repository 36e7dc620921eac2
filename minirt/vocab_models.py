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
from collections.abc import Iterable, Sequence
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


def _trie_add(root: dict[int, Any], key: Iterable[int], tid: Any) -> None:
    """Insert ``key`` (bytes, or code points) into a trie (label -> child, ``tid`` under key -1)."""
    node = root
    for b in key:
        node = node.setdefault(b, {})
    node[-1] = tid


def _flatten_trie(trie: dict[int, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[Any], int]:
    """A :func:`_trie_add` trie as arrays for compiled walks (:func:`_trie_child`): nodes numbered
    breadth-first from the root (0); node k's children are edges first[k] .. first[k] + count[k] - 1,
    sorted by label, leading to enode[e]. Returns (first, count, label, enode, the value under -1 of
    each node (None: none), the deepest node's depth)."""
    nodes: list[dict[int, Any]] = [trie]
    first, count, label, enode, value = [], [], [], [], []
    depth = [0]
    k = 0
    while k < len(nodes):
        node = nodes[k]
        kids = sorted(c for c in node if c != -1)
        first.append(len(label))
        count.append(len(kids))
        value.append(node.get(-1))
        for c in kids:
            label.append(c)
            enode.append(len(nodes))
            nodes.append(node[c])
            depth.append(depth[k] + 1)
        k += 1
    return (np.asarray(first, np.int64), np.asarray(count, np.int64), np.asarray(label, np.int64),
            np.asarray(enode, np.int64), value, max(depth))


@jit(inline=True)
def _trie_child(first, count, label, enode, node, c):  # pragma: no cover - compiled
    """The child of ``node`` along label c in a :func:`_flatten_trie` trie (binary search), or -1."""
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
    """BERT-style WordPiece over a GGUF vocabulary whose word-initial pieces start with ``▁``."""

    def __init__(self, texts: Sequence[str], unk_id: int | None, lowercase: bool, strip_accents: bool) -> None:
        self._tok = {t.encode("utf-8", "surrogateescape"): i for i, t in enumerate(texts)}
        self._max_len = max(len(t.encode("utf-8", "surrogateescape")) for t in texts)
        self.unk_id = unk_id
        self.lowercase = lowercase
        self.strip_accents = strip_accents
        self._cache: dict[str, tuple[int, ...]] = {}

    def words(self, text: str) -> list[str]:
        """llama.cpp ``preprocess``: normalise and split into words (vectorised: one class letter
        per code point, then runs of word characters and single punctuation characters)."""
        if not text:
            return []
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
            return []
        # a token starts at every punctuation character and at a word character after a non-word one;
        # it ends at the next start or whitespace (word boundaries found in numpy, not by a regex)
        word = ~ws & ~punct
        after_word = np.zeros(n, dtype=bool)
        after_word[1:] = word[:-1]
        start = punct | (word & ~after_word)
        starts = np.flatnonzero(start)
        stops = np.append(np.flatnonzero(start | ws), n)
        ends = stops[np.searchsorted(stops, starts, side="right")]
        norm = cps.astype(np.uint32).tobytes().decode("utf-32-le")
        return [norm[a:b] for a, b in zip(starts.tolist(), ends.tolist())]

    def encode(self, text: str, out: list[int]) -> None:
        cache = self._cache
        get = cache.get
        for w in self.words(text):
            ids = get(w)
            if ids is None:
                ids = cache[w] = self._word(w)
            out.extend(ids)

    def _word(self, word: str) -> tuple[int, ...]:
        b = (_SPACE + word).encode("utf-8")
        n = len(b)
        tok = self._tok
        out: list[int] = []
        i = 0
        while i < n:
            for j in range(min(n, i + self._max_len + 1), i, -1):
                tid = tok.get(b[i:j])
                if tid is not None:
                    out.append(tid)
                    i = j
                    break
            else:
                out = []  # one unmatched position discards the whole word
                break
        if not out:
            if self.unk_id is None:
                raise TokenizerError(f"word {word!r} has no WordPiece tokens and the vocabulary has no unknown token")
            return (self.unk_id,)
        return tuple(out)


# ---------------------------------------------------------------------------------------------
# Unigram (llama.cpp llm_tokenizer_ugm / _session)
# ---------------------------------------------------------------------------------------------

def _utf8_len(b0: int) -> int:
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[b0 >> 4]


def _valid_utf8_prefix(data: bytes, off: int) -> int:
    """Length of the valid UTF-8 sequence at ``off`` (llama.cpp ``unicode_cpt_from_utf8``), 0 if invalid."""
    b0 = data[off]
    if not b0 & 0x80:
        return 1
    if b0 & 0x40 == 0:
        return 0
    need = 2 if b0 & 0x20 == 0 else 3 if b0 & 0x10 == 0 else 4 if b0 & 0x08 == 0 else 0
    if need == 0 or off + need > len(data):
        return 0
    for k in range(1, need):
        if data[off + k] & 0xC0 != 0x80:
            return 0
    return need


class Unigram:
    """SentencePiece-style Unigram with llama.cpp's normaliser and Viterbi search."""

    def __init__(self, texts: Sequence[str], attrs: Sequence[int], scores: Sequence[float], unk_id: int | None,
                 charsmap: Any, add_space_prefix: bool, remove_extra_ws: bool, escape_ws: bool = True,
                 treat_ws_as_suffix: bool = False) -> None:
        self.unk_id = unk_id
        self._scores = [float(np.float32(s)) for s in scores]
        self._user = [bool(a & ATTR_USER_DEFINED) for a in attrs]
        normal_scores = [s for s, a in zip(self._scores, attrs) if a & ATTR_NORMAL]
        min_score = min(normal_scores) if normal_scores else float(np.finfo(np.float32).max)
        self._unk_score = float(np.float32(min_score - np.float32(10.0)))
        self._texts, self._attrs = texts, attrs
        self._tries: tuple[dict[int, Any], dict[int, Any]] | None = None  # built on first use (_trie)
        self._xcda: np.ndarray | None = None
        self._repl = b""
        if charsmap is not None and len(charsmap):
            blob = np.asarray(charsmap).astype(np.uint8).tobytes()
            if len(blob) < 4:
                raise TokenizerError("tokenizer.ggml.precompiled_charsmap is too small for its header")
            (size,) = struct.unpack_from("<I", blob, 0)
            if size + 4 >= len(blob):
                raise TokenizerError("tokenizer.ggml.precompiled_charsmap: index out of bounds")
            self._xcda = np.frombuffer(blob, dtype="<u4", count=size // 4, offset=4).astype(np.int64)
            self._repl = blob[4 + size:]
            self._charsmap_blob = blob
        self._space = _SPACE.encode() if escape_ws else b" "
        self._prepend = add_space_prefix and not treat_ws_as_suffix
        self._append = add_space_prefix and treat_ws_as_suffix
        self._merge = remove_extra_ws
        self._cache: dict[Any, tuple[int, ...]] = {}  # fragment text, or ("w", word) of the fast path
        self._space_str = self._space.decode()
        self._split_words = False
        self._hf, self._hf_norm, self._hf_avoid = self._build_fast(texts, attrs, min_score if normal_scores else 0.0)

    # ---- the fast path: HF tokenizers' Precompiled normaliser and Unigram lattice (Rust) ----
    # The hand-written path below follows llama.cpp byte for byte but runs at ~0.15 MB/s in Python;
    # tokenizers computes the same charsmap normalisation and the same Viterbi (float32 scores summed
    # in double, unknown characters at the lowest normal score - 10, runs of them fused) 10-20x
    # faster. What it cannot reproduce stays on the hand-written path: text holding the first
    # character of a user-defined token (llama.cpp copies the longest user-token prefix unnormalised)
    # and text normalising to U+10FFFF, which names the tokens llama.cpp never matches (control,
    # unknown, byte) in the lattice's vocabulary.
    _NEVER = "\U0010ffff"

    def _build_fast(self, texts: Sequence[str], attrs: Sequence[int], floor: float) -> tuple[Any, Any, frozenset]:
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import models, normalizers
        except ImportError:  # pragma: no cover - a dependency; the exact Python path still works
            return None, None, frozenset()
        if self.unk_id is None or not self._scores:
            return None, None, frozenset()
        vocab = []
        for i, (t, a) in enumerate(zip(texts, attrs)):
            if a & ATTR_USER_DEFINED:
                vocab.append((t, 0.0))
            elif a & (ATTR_NORMAL | ATTR_UNUSED) and t:
                vocab.append((t, self._scores[i]))
            else:  # never matched; at the floor so that the unknown score (floor - 10) is llama.cpp's
                vocab.append((self._NEVER * 2 + str(i), floor))
        try:
            hf = HFTokenizer(models.Unigram(vocab, self.unk_id, False))
            norm = normalizers.Precompiled(self._charsmap_blob) if self._xcda is not None else None
        except Exception:  # noqa: BLE001 - a vocabulary tokenizers refuses: the exact Python path
            return None, None, frozenset()
        avoid = frozenset(t[0] for t, a in zip(texts, attrs) if a & ATTR_USER_DEFINED and t)
        # When no piece holds the space symbol past its first character (and the symbol alone is a
        # piece, so it is never part of an unknown run), no piece crosses the point before a space
        # symbol: the best segmentation of the whole string is that of its space-led words joined,
        # which are then encoded once each (cached) instead of one lattice over the whole text.
        sp = self._space_str
        self._split_words = bool(sp) and any(t == sp for t, _ in vocab) and not any(sp in t[1:] for t, _ in vocab)
        return hf, norm, avoid

    def _fast(self, text: str) -> tuple[int, ...] | None:
        """Ids through tokenizers, or None where only the hand-written path is exact."""
        if self._hf is None or (self._hf_avoid and not self._hf_avoid.isdisjoint(text)):
            return None
        norm = self._hf_norm.normalize_str(text) if self._hf_norm is not None else text
        if self._NEVER in norm:
            return None
        space = self._space_str
        if self._merge:  # every run of non-spaces after one space, spaces dropped
            s = "".join(space + w for w in norm.split(" ") if w)
        else:
            s = norm.replace(" ", space)
            if self._prepend:
                k = len(norm) - len(norm.lstrip(" "))
                if k < len(norm):
                    s = s[:k] + space + s[k:]
        if self._append:
            s += space
        if not s:
            return ()
        if not self._split_words:
            return tuple(self._hf.encode(s, add_special_tokens=False).ids)
        parts = s.split(space)
        words = ([parts[0]] if parts[0] else []) + [space + w for w in parts[1:]]
        cache = self._cache
        todo = list(dict.fromkeys(w for w in words if ("w", w) not in cache))
        if todo:
            if len(cache) > 1 << 16:
                cache.clear()
            enc = self._hf.encode  # one call per new word: encode_batch's thread pool was slower here
            for w in todo:
                cache[("w", w)] = tuple(enc(w, add_special_tokens=False).ids)  # (tuple keys: never a fragment)
        out: list[int] = []
        for w in words:
            out.extend(cache[("w", w)])
        return tuple(out)

    @property
    def _trie(self) -> dict[int, Any]:
        return self._byte_tries()[0]

    @property
    def _user_trie(self) -> dict[int, Any]:
        return self._byte_tries()[1]

    def _byte_tries(self) -> tuple[dict[int, Any], dict[int, Any]]:
        """Byte tries (byte -> child, id under key -1) of the matchable and the user-defined tokens,
        built when the hand-written path first runs (seconds for a 250k vocabulary that the fast
        path may never need)."""
        if self._tries is None:
            trie: dict[int, Any] = {}
            user: dict[int, Any] = {}
            for i, (t, a) in enumerate(zip(self._texts, self._attrs)):
                if a & (ATTR_NORMAL | ATTR_USER_DEFINED | ATTR_UNUSED):
                    _trie_add(trie, t.encode("utf-8", "surrogateescape"), i)
                if a & ATTR_USER_DEFINED:
                    _trie_add(user, t.encode("utf-8", "surrogateescape"), i)
            self._tries = (trie, user)
        return self._tries

    # ---- normalisation ----

    def _node(self, i: int) -> int:
        if self._xcda is None or i >= len(self._xcda):
            raise TokenizerError("tokenizer.ggml.precompiled_charsmap: index out of bounds")
        return int(self._xcda[i])

    def _prefix(self, data: bytes, off: int) -> tuple[bytes, int]:
        """llama.cpp ``normalize_prefix``: (replacement bytes, input bytes consumed)."""
        node = self._user_trie
        best = 0
        k = off
        while k < len(data):
            node = node.get(data[k])
            if node is None:
                break
            k += 1
            best = k - off  # llama.cpp's naive_trie: longest path walked, token or not
        if best > 0:
            return data[off:off + best], best
        longest = 0
        rep_off = 0
        if self._xcda is not None and len(self._xcda):
            def base(p: int) -> int:
                return (p >> 10) << ((p & (1 << 9)) >> 6)

            ni = base(self._node(0))
            for k in range(off, len(data)):
                c = data[k]
                if c == 0:
                    break
                ni ^= c
                p = self._node(ni)
                if p & ((1 << 31) | 0xFF) != c:
                    break
                leaf = (p >> 8) & 1
                ni ^= base(p)
                if leaf:
                    longest = k - off + 1
                    rep_off = self._node(ni) & ((1 << 31) - 1)
        if longest > 0:
            if rep_off >= len(self._repl):
                raise TokenizerError("tokenizer.ggml.precompiled_charsmap: index out of bounds")
            end = self._repl.find(b"\0", rep_off)
            if end < 0:
                raise TokenizerError("tokenizer.ggml.precompiled_charsmap: unterminated string")
            return self._repl[rep_off:end], longest
        n = _valid_utf8_prefix(data, off)
        if n:
            return data[off:off + n], n
        return b"\xef\xbf\xbd", 1

    def normalize(self, text: str) -> bytes:
        data = text.encode("utf-8")
        out = bytearray()
        space = self._space
        prepended = False
        non_ws = False
        off = 0
        while off < len(data):
            rep, used = self._prefix(data, off)
            for c in rep:
                if c != 0x20:
                    if not non_ws:
                        non_ws = True
                        if (self._prepend and not prepended) or self._merge:
                            out += space
                            prepended = True
                    out.append(c)
                else:
                    non_ws = False
                    if not self._merge:
                        out += space
            off += used
        if self._append:
            out += space
        return bytes(out)

    # ---- Viterbi ----

    def encode(self, text: str, out: list[int]) -> None:
        if len(text) > 256:  # long fragments are rarely repeated: not worth keeping
            fast = self._fast(text)
            out.extend(fast if fast is not None else self._viterbi(self.normalize(text)))
            return
        ids = self._cache.get(text)
        if ids is None:
            ids = self._fast(text)
            if ids is None:
                ids = self._viterbi(self.normalize(text))
            if len(self._cache) > 1 << 15:
                self._cache.clear()
            self._cache[text] = ids
        out.extend(ids)

    def _viterbi(self, s: bytes) -> tuple[int, ...]:
        n = len(s)
        if n == 0:
            return ()
        unk = self.unk_id if self.unk_id is not None else -1
        best_id = [unk] * (n + 1)
        best_from = [0] * (n + 1)
        best = [-math.inf] * (n + 1)  # llama.cpp: -DBL_MAX
        best[0] = 0.0
        scores = self._scores
        user = self._user
        root = self._trie
        off = 0
        while off < n:
            cu = min(_utf8_len(s[off]), n - off)
            cur = best[off]
            single = False
            node = root.get(s[off])
            k = off + 1
            while node is not None:
                tid = node.get(-1)
                if tid is not None:
                    if k - off == cu:
                        single = True
                    sc = cur + (0.0 if user[tid] else scores[tid])
                    if sc > best[k]:
                        best[k] = sc
                        best_id[k] = tid
                        best_from[k] = off
                if k >= n:
                    break
                node = node.get(s[k])
                k += 1
            if not single:
                sc = cur + self._unk_score
                e = off + cu
                if sc > best[e]:
                    best[e] = sc
                    best_id[e] = unk
                    best_from[e] = off
            off += cu
        res: list[int] = []
        prev_unk = False
        p = n
        while True:
            tid = best_id[p]
            is_unk = tid == unk
            if not (prev_unk and is_unk):
                res.append(tid)
            if best_from[p] == 0:
                break
            prev_unk = is_unk
            p = best_from[p]
        if unk < 0 and -1 in res:
            raise TokenizerError("text needs the unknown token, but the vocabulary has none")
        res.reverse()
        return tuple(res)


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
        trie: dict[int, Any] = {}
        for i, p in enumerate(self.pieces):
            _trie_add(trie, p, i)
        self.unk_id = unk_id
        first, count, label, enode, tok, _ = _flatten_trie(trie)
        self._arrays = (first, count, label, enode, np.asarray([-1 if t is None else t for t in tok], np.int64))
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
        trie: dict[Any, Any] = {}
        for i, (t, a) in enumerate(zip(texts, attrs)):
            if a & ATTR_BYTE:
                m = BYTE_TOKEN_RE.fullmatch(t)
                if m is not None:
                    byte_ids[int(m.group(1), 16)] = i
                continue
            sc = float(np.float32(scores[i]))
            if not math.isfinite(sc):  # a piece without a usable score is never chosen
                continue
            _trie_add(trie, map(ord, t), (i, _round_half_away(sc * 1e4)))
        missing = [b for b in range(256) if byte_ids[b] == 0]
        if missing:
            raise TokenizerError(f"PLaMo-2 vocabulary lacks byte token <0x{missing[0]:02X}>")
        self._bytes = np.asarray(byte_ids, np.int64)
        # tok[k] / cost[k]: the piece ending at trie node k (-1: none)
        first, count, label, enode, value, self._max_len = _flatten_trie(trie)
        tok = np.asarray([-1 if v is None else v[0] for v in value], np.int64)
        cost = np.asarray([0 if v is None else v[1] for v in value], np.int64)
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
        data = text.encode("utf-8")
        full = len(data) // 5 * 5
        if full:  # whole chunks at once: uint64 arithmetic wraps as the 64-bit hash does
            c = np.frombuffer(data[:full], np.uint8).reshape(-1, 5).astype(np.uint64)
            h = c[:, 0]
            for j in range(1, 5):
                h = h * np.uint64(31) + c[:, j]
            out.extend((h % np.uint64(self.n_vocab)).tolist())
        if full < len(data):
            h = 0
            for b in data[full:]:
                h = (h * 31 + b) & ((1 << 64) - 1)
            out.append(h % self.n_vocab)
