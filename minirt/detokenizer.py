"""Streaming detokenizer: token ids in, UTF-8-safe text deltas out.

A token is a run of *bytes*, not of characters: a byte-level BPE piece or an SPM ``<0xNN>`` byte
token can end in the middle of a multi-byte character. :class:`StreamDecoder` feeds the bytes of
each token to an incremental UTF-8 decoder, which holds an incomplete character back until the
bytes that finish it arrive, so no U+FFFD is ever emitted for a character that is merely split
across tokens. The text it emits, concatenated with :meth:`StreamDecoder.finish`, equals
``tokenizer.decode(all ids)``:

* the leading space of the first piece is dropped when the vocabulary has ``add_space_prefix``
  (llama.cpp's detokenizer does the same, so ``"▁Hello"`` streams as ``"Hello"``) — except for
  generated text, which continues a prompt (``continuation=True``) and keeps it;
* where llama.cpp cleans spaces before punctuation (``clean_spaces``, some BPE pre-tokenizers) the
  same cleaning is applied, holding back only the few characters a later token could still change;
* bytes that can never form a character become U+FFFD, exactly where the one-shot decode puts them.
"""

from __future__ import annotations

import codecs
import re
from typing import Protocol


class PieceSource(Protocol):
    """What the decoder needs of a tokenizer (:class:`minirt.tokenizer.Tokenizer` is one); the
    dependency runs one way, tokenizer -> detokenizer."""

    add_space_prefix: bool
    clean_spaces: bool

    def token_to_piece(self, token_id: int, skip_special: bool = False) -> bytes: ...


_SPACE_BEFORE_PUNCT = re.compile(r" (?=[?!.,])")
_SPACE_BEFORE_CONTRACTION = re.compile(r" (?='(?:s|m|re|ve))")
_QUOTE = re.compile(r" ' ")


def clean_spaces(text: str) -> str:
    """llama.cpp's ``clean_spaces`` detokenizer pass.

    Removes the space in ``" ?"``, ``" !"``, ``" ."``, ``" ,"``; turns ``" ' "`` into ``"'"``;
    removes the space before ``'s``, ``'m``, ``'re``, ``'ve`` — three passes, in that order.
    """
    text = _SPACE_BEFORE_PUNCT.sub("", text)
    text = text.replace(" ' ", "'")
    return _SPACE_BEFORE_CONTRACTION.sub("", text)


class _StreamingClean:
    """:func:`clean_spaces` applied to text that arrives in pieces: each of its three passes is a
    left-to-right rewrite with at most three characters of lookahead, so each runs as a small
    transducer that holds back only a possible partial match (at most 1 + 2 + 3 characters in
    all). ``feed(a) + feed(b) + ... + finish() == clean_spaces(a + b + ...)``; each call costs
    O(its text)."""

    def __init__(self) -> None:
        self._h1 = ""  # pass 1: a trailing space (its next character decides it)
        self._h2 = ""  # pass 2: a partial " ' " (" " or " '")
        self._h3 = ""  # pass 3: from a space whose "'s" / "'re" ... is not complete yet

    def feed(self, text: str, final: bool = False) -> str:
        # pass 1: " " before ?!., is removed
        buf = self._h1 + text
        self._h1 = ""
        if buf.endswith(" ") and not final:
            buf, self._h1 = buf[:-1], " "  # undecided until the next character comes
        t1 = _SPACE_BEFORE_PUNCT.sub("", buf)
        # pass 2: " ' " -> "'" (leftmost, non-overlapping: str.replace's order)
        buf = self._h2 + t1
        self._h2 = ""
        if not final:
            # a partial match can only start after the last complete one (the scan's alignment)
            last_end = 0
            for m in _QUOTE.finditer(buf):
                last_end = m.end()
            if buf.endswith(" '") and len(buf) - 2 >= last_end:
                buf, self._h2 = buf[:-2], " '"
            elif buf.endswith(" ") and len(buf) - 1 >= last_end:
                buf, self._h2 = buf[:-1], " "
        t2 = buf.replace(" ' ", "'")
        # pass 3: " " before 's 'm 're 've is removed
        buf = self._h3 + t2
        self._h3 = ""
        if not final:
            for k in (3, 2, 1):
                j = len(buf) - k
                if j >= 0 and buf[j] == " " and buf[j + 1:] in ("", "'", "'r", "'v"):
                    buf, self._h3 = buf[:j], buf[j:]
                    break
        return _SPACE_BEFORE_CONTRACTION.sub("", buf)

    def held(self) -> int:
        """Characters held back (tests bound it)."""
        return len(self._h1) + len(self._h2) + len(self._h3)


class StreamDecoder:
    """Incremental detokenizer for one sequence; get one from ``tokenizer.stream_decoder()``.

    ``push(id)`` returns the text that became final with that token (often ``""`` while a
    character is incomplete); ``finish()`` returns whatever is held back, ending the sequence.
    ``reset()`` starts a new sequence. ``"".join(pushes) + finish() == tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: PieceSource, skip_special: bool = False, continuation: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        # text that continues a prompt keeps its leading space (" Paris" after "... is")
        self._strip_first = tokenizer.add_space_prefix and not continuation
        self._clean = tokenizer.clean_spaces
        self.reset()

    def reset(self) -> None:
        """Forget everything pushed so far; the next token starts a new sequence."""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True
        self._cleaner = _StreamingClean()  # clean_spaces, a few characters held back
        self.token_ids: list[int] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (may be empty)."""
        piece = self._tok.token_to_piece(token_id, self._skip)
        self.token_ids.append(int(token_id))
        if self._first:
            self._first = False
            if self._strip_first and piece[:1] == b" ":
                piece = piece[1:]
        text = self._utf8.decode(piece)
        if not self._clean:
            return text
        return self._emit(text, final=False)

    def finish(self) -> str:
        """End the sequence: flush held-back bytes (an incomplete character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        if self._clean:
            text = self._emit(text, final=True)
        self._utf8.reset()
        return text

    def _emit(self, text: str, final: bool) -> str:
        return self._cleaner.feed(text, final)
