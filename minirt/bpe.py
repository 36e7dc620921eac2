"""Byte-level BPE merges, compiled: llama.cpp's ``llm_tokenizer_bpe_session::tokenize`` on many
words at once.

Why not HF ``tokenizers`` here: its merge loop is the same algorithm, but one call per batch of new
words costs ~2 µs a word in conversions (to byte-level strings, into Rust and back), which made a
cold 100 KB text slower than llama.cpp on small vocabularies. This works on the words' UTF-8 bytes
and token ids directly. Raw-UTF-8 vocabularies (Gemma 4 and others whose symbols are characters)
stay on the ``tokenizers`` path in :mod:`minirt.tokenizer`.

Semantics (each as llama.cpp): a word starts as one symbol per byte (the token of that byte's
byte-level character; a byte whose character is no token is dropped at the end); the adjacent pair
with the lowest merge rank is merged first, the leftmost of equal ranks; a repeated merge rule
keeps its first rank; every rule's parts and result are tokens (checked when the table is built).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .quants._jit import jit


class ByteLevelMerges:
    """The merge table of a byte-level BPE vocabulary as arrays, and the compiled merge of words.

    ``byte_chars``: the byte-level character of each byte; ``vocab``: token text -> id;
    ``pairs``: the merge rules (left, right) in rank order, each already known to name tokens."""

    def __init__(self, byte_chars: Sequence[str], vocab: Mapping[str, int], pairs: Sequence[tuple[str, str]]) -> None:
        self.byte_ids = np.asarray([vocab.get(c, -1) for c in byte_chars], np.int64)
        n_vocab = max(vocab.values(), default=-1) + 1
        left = np.fromiter((vocab[a] for a, _ in pairs), np.int64, len(pairs))
        right = np.fromiter((vocab[b] for _, b in pairs), np.int64, len(pairs))
        merged = np.fromiter((vocab[a + b] for a, b in pairs), np.int64, len(pairs))
        bits = max(4, int(2 * max(len(pairs), 1) - 1).bit_length())  # load factor <= 1/2
        self.n_vocab = max(n_vocab, 1)
        self._keys = np.full(1 << bits, -1, np.int64)
        self._rank = np.zeros(1 << bits, np.int64)
        self._merged = np.zeros(1 << bits, np.int64)
        _table_build(left * self.n_vocab + right, merged, self._keys, self._rank, self._merged, bits)
        self._bits = bits

    def merge(self, data: np.ndarray, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ids of the words data[offs[w]:offs[w + 1]] (UTF-8 bytes, uint8): (ids, counts), word w's
        ids being the counts[w] after those of the words before it."""
        nw = len(offs) - 1
        ids = np.empty(len(data), np.int64)  # at most one token per byte
        counts = np.empty(nw, np.int64)
        longest = int(np.max(np.diff(offs))) if nw else 0
        _merge_words(data, offs, self.byte_ids, self._keys, self._rank, self._merged, self._bits, self.n_vocab,
                     ids, counts, longest)
        return ids, counts


@jit(inline=True)
def _slot(key, bits):  # pragma: no cover - compiled
    """The first table slot for key (Fibonacci hashing)."""
    return np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits))


@jit()
def _table_build(keys_in, merged_in, keys, rank, merged, bits):  # pragma: no cover - compiled
    """Open-addressing table: pair key (left * n_vocab + right) -> (rank, merged id); a key seen
    again keeps its first rank."""
    mask = (1 << bits) - 1
    for r in range(keys_in.shape[0]):
        k = keys_in[r]
        s = _slot(k, bits)
        while keys[s] != -1 and keys[s] != k:
            s = (s + 1) & mask
        if keys[s] == -1:
            keys[s] = k
            rank[s] = r
            merged[s] = merged_in[r]


@jit(inline=True)
def _find(keys, bits, k):  # pragma: no cover - compiled
    """The slot holding key k, or -1."""
    mask = (1 << bits) - 1
    s = _slot(k, bits)
    while keys[s] != -1:
        if keys[s] == k:
            return s
        s = (s + 1) & mask
    return -1


@jit(inline=True)
def _heap_push(heap, size, v):  # pragma: no cover - compiled
    i = size
    heap[i] = v
    while i > 0:
        p = (i - 1) >> 1
        if heap[p] <= heap[i]:
            break
        heap[p], heap[i] = heap[i], heap[p]
        i = p
    return size + 1


@jit(inline=True)
def _heap_pop(heap, size):  # pragma: no cover - compiled
    """Removes heap[0] (the caller read it); returns the new size."""
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and heap[c + 1] < heap[c]:
            c += 1
        if heap[i] <= heap[c]:
            break
        heap[i], heap[c] = heap[c], heap[i]
        i = c
    return size


@jit()
def _merge_words(data, offs, byte_ids, keys, rank, merged, bits, n_vocab, ids, counts, longest):  # pragma: no cover
    """Merge each word (see ByteLevelMerges.merge). Per word: sym[i] the token at symbol i (-1: a
    byte without a token, never merged), nxt / prv the linked list of live symbols, and a min-heap
    of rank * stride + left position over the adjacent pairs queued; a popped pair is stale when
    its left symbol is gone or the pair now there has another rank (symbols only grow)."""
    stride = np.int64(longest + 1)
    sym = np.empty(longest + 1, np.int64)
    nxt = np.empty(longest + 1, np.int64)
    prv = np.empty(longest + 1, np.int64)
    heap = np.empty(3 * longest + 3, np.int64)
    k = 0
    for w in range(offs.shape[0] - 1):
        a = offs[w]
        n = offs[w + 1] - a
        for i in range(n):
            sym[i] = byte_ids[data[a + i]]
            nxt[i] = i + 1 if i + 1 < n else -1
            prv[i] = i - 1
        size = 0
        for i in range(n - 1):
            if sym[i] >= 0 and sym[i + 1] >= 0:
                s = _find(keys, bits, sym[i] * n_vocab + sym[i + 1])
                if s >= 0:
                    size = _heap_push(heap, size, rank[s] * stride + i)
        while size > 0:
            top = heap[0]
            size = _heap_pop(heap, size)
            r = top // stride
            left = top - r * stride
            right = nxt[left]
            if sym[left] < 0 or right < 0 or sym[right] < 0:
                continue
            s = _find(keys, bits, sym[left] * n_vocab + sym[right])
            if s < 0 or rank[s] != r:
                continue  # one side was merged since this pair was queued
            sym[left] = merged[s]
            sym[right] = -2  # gone
            nr = nxt[right]
            nxt[left] = nr
            if nr >= 0:
                prv[nr] = left
            p = prv[left]
            if p >= 0 and sym[p] >= 0:
                s = _find(keys, bits, sym[p] * n_vocab + sym[left])
                if s >= 0:
                    size = _heap_push(heap, size, rank[s] * stride + p)
            if nr >= 0 and sym[nr] >= 0:
                s = _find(keys, bits, sym[left] * n_vocab + sym[nr])
                if s >= 0:
                    size = _heap_push(heap, size, rank[s] * stride + left)
        k0 = k
        i = 0 if n else -1
        while i >= 0:
            if sym[i] >= 0:
                ids[k] = sym[i]
                k += 1
            i = nxt[i]
        counts[w] = k - k0
