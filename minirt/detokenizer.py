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


def clean_spaces(text: str) -> str:
    """llama.cpp's ``clean_spaces`` detokenizer pass.

    Removes the space in ``" ?"``, ``" !"``, ``" ."``, ``" ,"``; turns ``" ' "`` into ``"'"``;
    removes the space before ``'s``, ``'m``, ``'re``, ``'ve`` — three passes, in that order.
    """
    text = _SPACE_BEFORE_PUNCT.sub("", text)
    text = text.replace(" ' ", "'")
    return _SPACE_BEFORE_CONTRACTION.sub("", text)


# Every pattern clean_spaces rewrites starts with a space and spans at most 4 characters, and it
# only ever deletes spaces; so text can be cleaned in two parts split at a point whose previous
# 3 characters contain no space, and the results joined, with the same result as one pass.
_CLEAN_WINDOW = 3


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
        self._pending = ""  # decoded text not yet emitted (clean_spaces only)
        self._tail = ""  # last characters already emitted (clean_spaces context)
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
        pending = self._pending + text
        if final:
            cut = len(pending)
        else:
            # largest cut whose 3 preceding characters (emitted tail included) hold no space
            ctx = self._tail + pending
            off = len(self._tail)
            cut = len(ctx)
            while cut > off and " " in ctx[max(0, cut - _CLEAN_WINDOW):cut]:
                cut = ctx.rfind(" ", 0, cut)
            cut -= off
            if cut <= 0:
                self._pending = pending
                return ""
        done, self._pending = pending[:cut], pending[cut:]
        self._tail = (self._tail + done)[-_CLEAN_WINDOW:]
        return clean_spaces(done)
