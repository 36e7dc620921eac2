"""Text ⇄ token ids from the ``tokenizer.ggml.*`` metadata of a GGUF file, the way llama.cpp does it.

Every ``tokenizer.ggml.model`` llama.cpp reads is handled: ``llama`` (SPM) and ``gpt2`` / ``gemma4`` /
``whitespace`` / ``hybriddna`` (BPE) here, with the pre-tokenizers of :mod:`minirt.pretokenizers`;
``bert`` (WordPiece), ``t5`` (Unigram), ``rwkv``, ``plamo2`` and ``test`` in
:mod:`minirt.vocab_models`. The SPM and byte-level BPE rules follow.

Nothing outside the GGUF is read. :meth:`Tokenizer.from_gguf` builds the vocabulary from
``tokenizer.ggml.tokens`` / ``scores`` / ``token_type`` / ``merges`` / ``pre`` and the special ids,
and reproduces llama.cpp's ``llama_vocab`` (``src/llama-vocab.cpp``) rule for rule:

``encode(text, add_special, parse_special)``
    1. *Special-token partition* (llama.cpp ``tokenizer_st_partition``): the special tokens (token
       type CONTROL / USER_DEFINED / UNKNOWN) are cut out of the text, longest text first, leftmost
       occurrence first within each remaining text fragment, honouring the lstrip / rstrip
       attributes. USER_DEFINED tokens are always cut out; CONTROL and UNKNOWN ones only with
       ``parse_special=True``.
    2. Each remaining text fragment is tokenized on its own:

       * ``tokenizer.ggml.model == "llama"`` (SentencePiece-style, SPM): a space is prepended when
         ``add_space_prefix`` is set and the fragment starts the text or follows a special token,
         spaces become ``▁``, then the characters are merged pairwise, the pair whose merged text
         is the vocabulary entry with the highest score first (leftmost on ties), and whatever is
         not a vocabulary entry at the end falls back to ``<0xNN>`` byte tokens.
       * ``"gpt2"`` (byte-level BPE): the fragment is split by the pre-tokenizer regexes named by
         ``tokenizer.ggml.pre``, each piece is mapped byte → printable character (GPT-2's
         byte↔unicode table) and merged by the ranked ``tokenizer.ggml.merges`` list, lowest rank
         first, leftmost on ties.
    3. ``add_special=True`` adds BOS / EOS as ``add_bos_token`` / ``add_eos_token`` say.

``decode`` concatenates the token pieces (``▁`` → space for SPM normal tokens, byte-level
characters → bytes for BPE, ``<0xNN>`` → that byte), strips the leading space of the first piece
when ``add_space_prefix`` is set, and cleans spaces before punctuation for the BPE pre-tokenizers
where llama.cpp does (``clean_spaces``); :mod:`minirt.detokenizer` does the same incrementally.

Libraries used, and why:

* ``regex`` for the BPE pre-tokenizers. llama.cpp hand-codes these regexes over its own Unicode
  15.1 category table. ``regex``'s ``\\p{L}``, ``\\p{N}``, ``\\p{P}`` and ``\\s`` agree with that table
  on every code point assigned in Unicode 15.1; code points assigned later (which llama.cpp treats
  as unassigned symbols) are found once per process by comparing ``regex`` against the 15.1
  ranges kept at the end of this file, and a text that contains one is split with the slower,
  exact patterns where those code points are subtracted from the classes.
* The byte-level BPE merge loop is compiled here (:mod:`minirt.bpe`, numba over token ids): HF
  ``tokenizers`` applies merges by (rank, leftmost position) exactly like llama.cpp's
  ``llm_tokenizer_bpe_session`` too, but its per-call conversions cost more than the merges on a
  cold text. HF ``tokenizers`` (``models.BPE``, Rust) runs the raw-UTF-8 vocabularies (Gemma 4
  and others whose symbols are characters, with ``<0xNN>`` byte fallback). Words are split here,
  and results are cached per word. :meth:`Tokenizer._bpe_merge_word` is the same loop in Python:
  the executable spec, the path of ``use_hf_bpe=False`` (or without ``tokenizers``), and what
  the tests compare the compiled and Rust paths against.
* The SPM merge is written here: no library runs llama.cpp's score-ordered bigram merge over a
  bare vocabulary (``sentencepiece`` needs the ``.model`` protobuf, which a GGUF does not carry).
  It runs per ``▁``-separated piece (a cut no vocabulary entry spans, so the result is the same as
  one pass over the whole fragment) with a per-piece cache.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import regex

from . import vocab_models
from .bpe import ByteLevelMerges
from .detokenizer import StreamDecoder, clean_spaces
from .errors import TokenizerError
from .pretokenizers import (
    DEEPSEEK_LETTERS,
    F_WHITESPACE,
    PRE_NAMES,
    RAW_UTF8_TYPES,
    PreSpec,
    codepoints,
    flags_of,
    lowercase_map,
    splitter,
)
from .token_attrs import (  # noqa: F401 - re-exported: minirt.tokenizer.ATTR_* is public
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_NORMALIZED,
    ATTR_RSTRIP,
    ATTR_SINGLE_WORD,
    ATTR_UNDEFINED,
    ATTR_UNKNOWN,
    ATTR_UNUSED,
    ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNDEFINED,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
)
from .token_attrs import BYTE_TOKEN_RE as _BYTE_TOKEN_RE
from .token_attrs import TYPE_TO_ATTR as _TYPE_TO_ATTR

if TYPE_CHECKING:  # pragma: no cover
    from .gguf import GGUFFile

log = logging.getLogger(__name__)

_ATTR_SPECIAL = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # what the partition cuts out
_ATTR_HIDDEN = ATTR_CONTROL | ATTR_UNKNOWN  # what decode(skip_special=True) drops

_SPM_SPACE = "\u2581"  # ▁
_DNA_MARKER = "\ue000"  # hybriddna: suffix that keeps DNA k-mers apart from equal BPE tokens
_C_SPACE = " \t\n\v\f\r"  # C isspace(), used for lstrip / rstrip of special tokens
_MAX_CACHE = 1 << 17  # per-word / per-piece encode caches are cleared past this many entries
_MAX_CACHED_PIECE = 256  # longer SPM pieces (runs of spaces, long words) are not cached

# Token texts that mark the end of generation (llama.cpp's vocab loader, EOG detection by text).
_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
])
# Texts by which llama.cpp finds special ids the metadata does not name.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                  "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                  "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                  "\u2581<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)

# metadata key suffix -> attribute name holding the id
_SPECIAL_KEYS = (
    ("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"), ("eom_token_id", "eom"),
    ("unknown_token_id", "unk"), ("seperator_token_id", "sep"), ("padding_token_id", "pad"),
    ("mask_token_id", "mask"), ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"),
    ("fim_mid_token_id", "fim_mid"), ("fim_pad_token_id", "fim_pad"), ("fim_rep_token_id", "fim_rep"),
    ("fim_sep_token_id", "fim_sep"),
    # deprecated spellings of the FIM ids
    ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"), ("middle_token_id", "fim_mid"),
)


# ---------------------------------------------------------------------------------------------
# byte-level BPE: GPT-2's byte <-> printable character table
# ---------------------------------------------------------------------------------------------

def _bytes_to_unicode() -> list[str]:
    """GPT-2's table: byte b -> a printable character (printable Latin-1 bytes map to themselves)."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out = [""] * 256
    n = 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
# str.translate tables: latin-1 decoded bytes -> byte-level characters, and back
_ENCODE_TABLE = {b: c for b, c in enumerate(_BYTE_TO_CHAR)}
_DECODE_TABLE: dict[int, int | str] = {ord(c): b for b, c in enumerate(_BYTE_TO_CHAR)}
# characters below 256 that are no byte-level character must not pass through as latin-1 bytes:
# send them to the slow path, which writes llama.cpp's [UNK_BYTE_...] marker
_DECODE_TABLE.update({c: "\uffff" for c in range(256) if c not in _DECODE_TABLE})


def _to_byte_level(word: str) -> str:
    """UTF-8 bytes of ``word`` as GPT-2 byte-level characters."""
    return word.encode("utf-8").decode("latin-1").translate(_ENCODE_TABLE)


def raw_bytes(text: str) -> bytes:
    """The bytes of a vocabulary entry as stored in the file. The GGUF reader decodes strings
    with ``surrogateescape``, so an entry that is not valid UTF-8 (some vocabularies hold raw
    bytes) gets its original bytes back, as llama.cpp, which never decodes, uses them."""
    return text.encode("utf-8", "surrogateescape")


def _is_text(s: str) -> bool:
    """True when ``s`` is valid Unicode (no surrogates: no raw bytes from the file)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_token_texts(texts: Sequence[str]) -> None:
    """Refuse at load an entry no file could hold: a surrogate that is not an escaped byte."""
    try:
        "".join(texts).encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        for i, t in enumerate(texts):
            try:
                t.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError as e:
                raise TokenizerError(f"tokenizer.ggml.tokens[{i}] is not valid text (code point "
                                     f"U+{ord(t[e.start]):04X} at index {e.start})") from None


def _from_byte_level(text: str) -> bytes:
    """Inverse of :func:`_to_byte_level` for a vocabulary entry (llama.cpp ``llama_decode_text``).

    A character outside the table is written as ``[UNK_BYTE_0x..<text>]`` like llama.cpp does.
    """
    mapped = text.translate(_DECODE_TABLE)
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:
        out = bytearray()
        for ch in text:
            b = _CHAR_TO_BYTE.get(ch)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + raw_bytes(ch).hex().encode() + raw_bytes(text) + b"]"
        return bytes(out)


# ---------------------------------------------------------------------------------------------
# Unicode classes of llama.cpp (Unicode 15.1) on top of the `regex` module
# ---------------------------------------------------------------------------------------------

_WS_CHARS = ("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
             "\u2028\u2029\u202f\u205f\u3000")
_WS_CLASS = r"\t-\r\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"  # White_Space
# deepseek-llm runs some of its regexes on a copy of the text where non-ASCII whitespace is \x0b
# (llama.cpp does this because std::wregex's \s only knows ASCII whitespace)
_WS_TO_VT = {ord(c): 0x0B for c in _WS_CHARS if ord(c) > 0x7F}


def _parse_ranges(spec: str) -> list[tuple[int, int]]:
    out = []
    for part in spec.split():
        a, _, b = part.partition("-")
        out.append((int(a, 16), int(b or a, 16)))
    return out


def _range_diff(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Code point ranges in ``a`` and not in ``b`` (both sorted, non-overlapping, inclusive)."""
    out: list[tuple[int, int]] = []
    j = 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j][1] < cur:
            j += 1
        k = j
        while cur <= hi:
            if k >= len(b) or b[k][0] > hi:
                out.append((cur, hi))
                break
            blo, bhi = b[k]
            if blo > cur:
                out.append((cur, blo - 1))
            cur = max(cur, bhi + 1)
            k += 1
    return out


def _class_body(ranges: list[tuple[int, int]]) -> str:
    def esc(c: int) -> str:
        return "\\U%08x" % c

    return "".join(esc(lo) if lo == hi else esc(lo) + "-" + esc(hi) for lo, hi in ranges)


class _UnicodeClasses:
    """The regex fragments for llama.cpp's letter / number / punctuation / whitespace classes.

    ``fast[name]`` uses ``regex``'s own Unicode database; ``exact[name]`` subtracts (and adds) the
    code points where that database disagrees with Unicode 15.1; ``risky`` matches any such code
    point, so the fast patterns are used whenever a text contains none of them.
    """

    _instance: _UnicodeClasses | None = None

    def __init__(self) -> None:
        # every code point except surrogates, as one string (UTF-32 decode is the fast way)
        cps = array("I", range(0xD800))
        cps.extend(range(0xE000, 0x110000))
        everything = cps.tobytes().decode("utf-32-le" if cps.itemsize == 4 else "utf-32")

        def runs(prop: str) -> list[tuple[int, int]]:
            return [(ord(m.group()[0]), ord(m.group()[-1])) for m in regex.finditer(r"%s+" % prop, everything)]

        self.fast = {"L": r"\p{L}", "N": r"\p{N}", "P": r"\p{P}", "WS": r"\s", "NWS": r"\S"}
        self.exact: dict[str, str] = {}
        risky: list[tuple[int, int]] = []
        for name, spec in (("L", _RANGES_L), ("N", _RANGES_N), ("P", _RANGES_P)):
            want = _parse_ranges(spec)
            have = runs(r"\p{%s}" % name)
            extra, missing = _range_diff(have, want), _range_diff(want, have)
            risky += extra + missing
            body = r"\p{%s}" % name
            if extra:
                body = r"[\p{%s}--[%s]]" % (name, _class_body(extra))
            if missing:
                body = "[%s%s]" % (body, _class_body(missing))
            self.exact[name] = body
        want_ws = sorted((ord(c), ord(c)) for c in _WS_CHARS)
        have_ws = runs(r"\s")
        risky += _range_diff(have_ws, want_ws) + _range_diff(want_ws, have_ws)
        self.exact["WS"] = "[%s]" % _WS_CLASS
        self.exact["NWS"] = "[^%s]" % _WS_CLASS
        risky.sort()
        # a table, not a regex class: searching 100 KB for a class of hundreds of ranges took 18 ms
        self.risky: np.ndarray | None = None
        if risky:
            self.risky = np.zeros(0x110000, dtype=bool)
            for a, b in risky:
                self.risky[a:b + 1] = True
        self.ascii_safe = self.risky is None or not self.risky[:128].any()
        if risky:
            log.debug("regex module's Unicode differs from llama.cpp's 15.1 table on %d ranges", len(risky))

    @classmethod
    def get(cls) -> _UnicodeClasses:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


# ---------------------------------------------------------------------------------------------
# BPE pre-tokenizers (tokenizer.ggml.pre)
# ---------------------------------------------------------------------------------------------

# Regexes in llama.cpp's order of application, written with {L} {N} {P} {WS} {NWS} placeholders.
# Each regex splits every current piece into its matches and the text between them.
# (pattern, runs_on_ws_substituted_text)
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?{L}+| ?{N}+| ?[^{WS}{L}{N}]+|{WS}+(?!{NWS})|{WS}+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = _CONTRACTIONS + r"|[^\r\n{L}{N}]?{L}+|{N}{1,3}| ?[^{WS}{L}{N}]+[\r\n]*|{WS}*[\r\n]+|{WS}+(?!{NWS})|{WS}+"
_QWEN2_RE = _CONTRACTIONS + r"|[^\r\n{L}{N}]?{L}+|{N}| ?[^{WS}{L}{N}]+[\r\n]*|{WS}*[\r\n]+|{WS}+(?!{NWS})|{WS}+"
_PRE_GROUPS: dict[str, list[tuple[str, bool]]] = {
    "default": [(r"[{P}\$\+<=>\^~\|]+", False), (_GPT2_RE, False), (r"{N}+", False), (r"[0-9][0-9][0-9]", False)],
    "gpt2": [(_GPT2_RE, False)],
    "llama3": [(_LLAMA3_RE, False)],
    "qwen2": [(_QWEN2_RE, False)],
    "starcoder": [(r"{N}", False), (_GPT2_RE, False)],
    "deepseek-llm": [
        (r"[\r\n]", True),
        (r"\s?[" + DEEPSEEK_LETTERS + r"]+", True),
        (r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", True),
        (r"\s+\Z", True),  # std::regex "$": end of the piece only
        (r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", True),
        (r"{N}+", False),
    ],
}
# groups whose single regex matches every character (so findall() covers the text)
_COVERING = frozenset(["gpt2", "llama3", "qwen2"])


# pre-tokenizer types (minirt.pretokenizers) whose regexes one of the groups above runs with
# the faster regex module classes; every other type runs through pretokenizers.Splitter
_GROUP_OF_TYPE = {"default": "default", "gpt2": "gpt2", "llama3": "llama3", "dbrx": "llama3", "chatglm4": "llama3",
                  "qwen2": "qwen2", "grok-2": "qwen2", "starcoder": "starcoder", "deepseek-llm": "deepseek-llm"}

SUPPORTED_PRE_TOKENIZERS = frozenset(PRE_NAMES)
# tokenizer.ggml.model -> vocabulary kind (llama.cpp llama_vocab::impl::load)
_MODEL_KIND = {"llama": "spm", "gpt2": "bpe", "gemma4": "bpe", "whitespace": "bpe", "hybriddna": "bpe",
               "bert": "wpm", "t5": "ugm", "rwkv": "rwkv", "test": "test",
               "plamo2": "plamo2"}
SUPPORTED_MODELS = frozenset(_MODEL_KIND)


class _Splitter:
    """Applies one group of pre-tokenizer regexes; see :data:`_PRE_GROUPS`."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.steps = _PRE_GROUPS[group]
        self.covering = group in _COVERING
        self._fast: list[Any] | None = None
        self._exact: list[Any] | None = None
        # the cut of each piece by each step after the first, per regex set: words repeat, and a
        # piece's cut is a function of the piece alone (the Python loop over pieces was most of
        # the time for the types with several steps)
        self._cuts: dict[tuple[bool, int], dict[str, list[str]]] = {}

    def clear_cache(self) -> None:
        """Forget the cuts remembered per piece."""
        self._cuts.clear()

    def _compile(self, exact: bool) -> list[Any]:
        uc = _UnicodeClasses.get()
        frag = uc.exact if exact else uc.fast
        out = []
        for pat, _ in self.steps:
            for name in ("NWS", "WS", "L", "N", "P"):  # NWS before WS: "{NWS}" contains "WS}"
                pat = pat.replace("{%s}" % name, frag[name])
            out.append(regex.compile(pat, regex.V1 if exact else regex.V0))
        return out

    def split(self, text: str) -> list[str]:
        uc = _UnicodeClasses.get()
        if uc.risky is not None and not (uc.ascii_safe and text.isascii()) and uc.risky[codepoints(text)].any():
            if self._exact is None:
                self._exact = self._compile(True)
            rxs = self._exact
        else:
            if self._fast is None:
                self._fast = self._compile(False)
            rxs = self._fast
        if self.covering:
            words = rxs[0].findall(text)
            if sum(map(len, words)) == len(text):
                return words
        exact = rxs is self._exact
        pieces = _cut(rxs[0], self.steps[0][1], text)
        for k in range(1, len(rxs)):
            rx, on_vt = rxs[k], self.steps[k][1]
            cuts = self._cuts.get((exact, k))
            if cuts is None or len(cuts) > _MAX_CACHE:
                cuts = self._cuts[(exact, k)] = {}
            get = cuts.get
            out: list[str] = []
            for piece in pieces:
                cut = get(piece)
                if cut is None:
                    cut = _cut(rx, on_vt, piece)
                    if len(piece) <= _MAX_CACHED_PIECE:
                        cuts[piece] = cut
                out += cut
            pieces = out
        return pieces


def _cut(rx: Any, on_vt: bool, piece: str) -> list[str]:
    """``piece`` cut into the matches of ``rx`` and the gaps between them (``on_vt``: matched on
    the text with whitespace as vertical tabs, cut from the original)."""
    src = piece.translate(_WS_TO_VT) if on_vt else piece
    out: list[str] = []
    pos = 0
    for m in rx.finditer(src):
        a, b = m.span()
        if a > pos:
            out.append(piece[pos:a])
        if b > a:
            out.append(piece[a:b])
        pos = b
    if pos < len(piece):
        out.append(piece[pos:])
    return out


def _trie_regex(words: Iterable[str]) -> str:
    """An alternation of ``words`` as a trie; at each position it matches the longest word.

    Built without recursion and without copying (a special token may be thousands of characters
    long): a run of single-child nodes becomes one literal, groups open only where the trie
    branches or a word ends."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = True
    out: list[str] = []
    stack: list[Any] = [trie]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        kids = sorted((ch, sub) for ch, sub in item.items() if ch != "")
        if not kids:
            continue
        opt, alt = "" in item, len(kids) > 1
        seq: list[Any] = [("(?:" if opt else "") + ("(?:" if alt else "")]
        for j, (ch, sub) in enumerate(kids):
            if j:
                seq.append("|")
            seq.append(regex.escape(ch))
            seq.append(sub)
        seq.append((")" if alt else "") + (")?" if opt else ""))
        stack.extend(reversed(seq))
    return "".join(out)


def decode_utf8_like_llama(data: bytes) -> str:
    """Bytes -> str the way llama.cpp reads a tokenizer's input (``unicode_cpts_from_utf8``).

    :meth:`Tokenizer.encode` takes ``str``; llama.cpp takes ``char *`` and turns each byte that
    does not start a complete sequence into one U+FFFD (Python's ``errors="replace"`` would merge a
    truncated sequence into one). For BPE, WordPiece and PLaMo-2 vocabularies,
    ``encode(decode_utf8_like_llama(b))`` gives llama.cpp's ids for the raw bytes ``b``. (SPM,
    RWKV, Unigram and "test" vocabularies read raw bytes: invalid bytes have no ``str`` equivalent.)
    Like llama.cpp, lead/continuation bits are all that is checked (an overlong form decodes).
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    out: list[str] = []
    i, n = 0, len(data)
    while i < n:
        b0 = data[i]
        need = 1 if b0 < 0x80 else 0 if b0 < 0xC0 else 2 if b0 < 0xE0 else 3 if b0 < 0xF0 else 4 if b0 < 0xF8 else 0
        if need and i + need <= n and all(data[i + k] & 0xC0 == 0x80 for k in range(1, need)):
            cp = b0 if need == 1 else b0 & (0x7F >> need)
            for k in range(1, need):
                cp = (cp << 6) | (data[i + k] & 0x3F)
            out.append(chr(cp))
            i += need
        else:
            out.append("\ufffd")
            i += 1
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------

def _split_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    """``"left right"`` merge rules → (left, right), split as llama.cpp does: at the first space after
    the first character. Raises TokenizerError naming a rule without one."""
    joined = "\n".join(merges)
    if joined.count("\n") == len(merges) - 1 and joined.count(" ") == len(merges) and not joined.startswith(" ") \
            and "\n " not in joined:
        # every rule has exactly one space, not at its start: split them all at C speed
        parts = joined.replace(" ", "\n").split("\n")
        return list(zip(parts[0::2], parts[1::2]))
    pos = [m.find(" ", 1) for m in merges]
    if pos and min(pos) < 0:
        r = pos.index(-1)
        raise TokenizerError(f"tokenizer.ggml.merges[{r}] {merges[r]!r} is not of the form 'left right'")
    return [(m[:p], m[p + 1:]) for m, p in zip(merges, pos)]


class Tokenizer:
    """A llama.cpp-compatible tokenizer built from GGUF metadata (SPM ``llama`` or BPE ``gpt2``).

    Build it with :meth:`from_gguf` (or :meth:`from_metadata` on the same key/value mapping).
    Metadata that is missing or inconsistent raises :class:`minirt.TokenizerError` naming the key.
    """

    def __init__(self, metadata: Mapping[str, Any], *, use_hf_bpe: bool = True) -> None:
        md = metadata
        # scalar keys must hold scalars: a corrupt file may store an array (or a number) anywhere
        for key, kinds, what in (("tokenizer.ggml.pre", (str,), "a string"),
                                 ("general.name", (str,), "a string"),
                                 ("general.architecture", (str,), "a string"),
                                 ("tokenizer.ggml.add_bos_token", (bool, int, np.integer), "a boolean"),
                                 ("tokenizer.ggml.add_eos_token", (bool, int, np.integer), "a boolean"),
                                 ("tokenizer.ggml.add_space_prefix", (bool, int, np.integer), "a boolean")):
            v = md.get(key)
            if v is not None and not isinstance(v, kinds):
                raise TokenizerError(f"{key} must be {what}, got {type(v).__name__}")
        model = md.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise TokenizerError("tokenizer.ggml.model is missing (no vocabulary in this GGUF)")
        kind = _MODEL_KIND.get(model)
        if kind is None:
            raise TokenizerError(f"unsupported tokenizer.ggml.model {model!r} (supported: "
                                 f"{', '.join(sorted(_MODEL_KIND))})")
        self.vocab_type = kind
        self.model = model

        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
        n = len(tokens)
        if set(map(type, tokens)) - {str}:  # C-speed check of 150k+ entries; the loop names the culprit
            bad = next(i for i, t in enumerate(tokens) if not isinstance(t, str))
            raise TokenizerError(f"tokenizer.ggml.tokens[{bad}] is not a string")
        texts: list[str] = list(tokens)
        if "" in texts:
            for i, t in enumerate(texts):
                if not t:
                    texts[i] = f"[EMPTY_{i}]"  # llama.cpp renames empty entries the same way
        self._tok2id: dict[str, int] = {t: i for i, t in enumerate(texts)}
        if model == "hybriddna" and "<oov>" in self._tok2id:
            # llama.cpp: the k-mers after <oov> read back without their marker (ids still by marked text)
            texts = list(texts)
            for i in range(self._tok2id["<oov>"] + 1, len(texts)):
                t = texts[i]
                if len(t) > 1 and t.endswith(_DNA_MARKER):
                    texts[i] = t[:-1]
        self._texts = texts
        _check_token_texts(texts)
        if len(self._tok2id) != n:
            seen: set[str] = set()
            dup = next(t for t in texts if t in seen or seen.add(t))  # type: ignore[func-returns-value]
            raise TokenizerError(f"tokenizer.ggml.tokens has duplicate entries (e.g. {dup!r})")
        self.n_vocab = n

        scores = md.get("tokenizer.ggml.scores")
        if scores is None:
            self._scores: list[float] = [0.0] * n
        else:
            arr = np.asarray(scores)
            if arr.ndim != 1 or arr.dtype.kind not in "fiu":
                raise TokenizerError("tokenizer.ggml.scores must be a numeric array")
            if len(arr) != n:
                raise TokenizerError(f"tokenizer.ggml.scores has {len(arr)} entries for {n} tokens")
            self._scores = arr.astype(np.float32).astype(np.float64).tolist()

        types = md.get("tokenizer.ggml.token_type")
        if types is None:
            attrs = [ATTR_NORMAL] * n
        else:
            tarr = np.asarray(types)
            if tarr.ndim != 1 or tarr.dtype.kind not in "iu":
                raise TokenizerError("tokenizer.ggml.token_type must be an integer array")
            if len(tarr) != n:
                raise TokenizerError(f"tokenizer.ggml.token_type has {len(tarr)} entries for {n} tokens")
            lut = np.array([_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in range(8)] + [ATTR_UNDEFINED], np.int64)
            attrs = lut[np.clip(tarr.astype(np.int64), 0, 8)].tolist()  # unknown types: UNDEFINED
        self._attrs = attrs

        # byte tokens <0xNN> (SPM byte fallback; also read back by the detokenizer)
        self._byte_of: dict[int, int] = {}
        for i in np.flatnonzero(np.asarray(attrs) & ATTR_BYTE).tolist():
            m = _BYTE_TOKEN_RE.fullmatch(texts[i])
            if m is None:
                raise TokenizerError(f"token {i} {texts[i]!r} has type BYTE but is not of the form <0xNN>")
            self._byte_of[i] = int(m.group(1), 16)

        # ---- vocabulary kind and pre-tokenizer (llama.cpp defaults, then metadata) ----
        self.pre: str | None = md.get("tokenizer.ggml.pre")
        ids: dict[str, int | None] = {k: None for _, k in _SPECIAL_KEYS}
        self._spec: PreSpec | None = None
        self.escape_whitespaces = False  # BPE words: spaces as "▁", pieces read back as SPM's
        self.add_eos = False
        self.add_sep = False
        self.remove_extra_whitespaces = False
        self.add_space_prefix = False
        self.clean_spaces = False
        self.add_bos = False
        kind = self.vocab_type
        if kind == "spm":
            ids.update(bos=1, eos=2, unk=0)
            self.add_space_prefix = True
            self.add_bos = True
        elif kind == "bpe":
            ids.update(bos=11, eos=11)
            pre = "gemma4" if model == "gemma4" else self.pre  # llama.cpp forces it for this model
            if pre is None or pre == "":
                log.warning("tokenizer.ggml.pre is missing: using the 'default' BPE pre-tokenizer")
                pre = "default"
            if not isinstance(pre, str) or pre not in PRE_NAMES:
                raise TokenizerError(f"unknown BPE pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                                     f"supported: {', '.join(sorted(PRE_NAMES))}")
            spec = PRE_NAMES[pre]
            self._spec = spec
            self.clean_spaces = spec.clean_spaces
            self.add_bos = spec.add_bos
            self.escape_whitespaces = spec.escape_whitespaces
            if spec.no_bos:
                ids["bos"] = None
            if pre in ("jina-v1-en", "jina-v2-code", "roberta-bpe"):
                self.add_sep = True
        elif kind == "wpm":
            ids.update(bos=101, unk=100, sep=102, pad=0, mask=103)
            self.clean_spaces = True
            self.add_bos = True
            self.add_sep = True
        elif kind == "ugm":
            ids.update(eos=1, unk=2, pad=0)
            self.add_eos = True
        elif kind == "plamo2":
            ids.update(bos=1, eos=2, unk=0, pad=3)
        asp = md.get("tokenizer.ggml.add_space_prefix")
        if asp is not None:
            self.add_space_prefix = bool(asp)
        rew = md.get("tokenizer.ggml.remove_extra_whitespaces")
        if rew is not None:
            self.remove_extra_whitespaces = bool(rew)

        for name, value in list(ids.items()):  # defaults beyond the vocabulary are disabled
            if value is not None and value >= n:
                ids[name] = None
        for suffix, name in _SPECIAL_KEYS:
            key = "tokenizer.ggml." + suffix
            v = md.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TokenizerError(f"{key} must be an integer, got {type(v).__name__}")
            v = int(v)
            if not 0 <= v < n:
                raise TokenizerError(f"{key}={v} is out of range for a vocabulary of {n} tokens")
            ids[name] = v

        for key, attr in (("tokenizer.ggml.add_bos_token", "add_bos"), ("tokenizer.ggml.add_eos_token", "add_eos"),
                          ("tokenizer.ggml.add_sep_token", "add_sep")):
            v = md.get(key)
            if v is not None:
                setattr(self, attr, bool(v))
        if self._spec is not None and self._spec.type == "gemma4":
            self.add_bos = True  # llama.cpp's Gemma 4 workaround: BOS is always added
        # BERT normaliser options (WordPiece; "whitespace" BPE lower-cases with them too)
        self.lowercase = not (self._spec is not None and self._spec.type == "whitespace")
        v = md.get("tokenizer.ggml.normalizer.lowercase")
        if v is not None:
            self.lowercase = bool(v)
        self.strip_accents = self.lowercase
        v = md.get("tokenizer.ggml.normalizer.strip_accents")
        if v is not None:
            self.strip_accents = bool(v)

        # ---- special ids found by their text, EOG set (llama.cpp's vocab loader) ----
        def find_first(cands: Sequence[str]) -> int | None:
            found = [self._tok2id[c] for c in cands if c in self._tok2id]
            return min(found) if found else None  # llama.cpp takes whichever it meets first

        def mark_control(i: int) -> None:
            if not attrs[i] & ATTR_CONTROL:
                log.debug("token %d %r looks like a control token; marking it CONTROL", i, texts[i])
                attrs[i] |= ATTR_CONTROL

        for name, cands in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), ("fim_pre", _FIM_PRE_TEXTS),
                            ("fim_suf", _FIM_SUF_TEXTS), ("fim_mid", _FIM_MID_TEXTS), ("fim_pad", _FIM_PAD_TEXTS),
                            ("fim_rep", _FIM_REP_TEXTS), ("fim_sep", _FIM_SEP_TEXTS)):
            if ids[name] is None:
                i = find_first(cands)
                if i is not None:
                    ids[name] = i
                    mark_control(i)
        eog: set[int] = set()
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            if ids[name] is not None:
                eog.add(ids[name])  # type: ignore[arg-type]
        for t in _EOG_TEXTS:
            i = self._tok2id.get(t)
            if i is not None:
                eog.add(i)
                mark_control(i)
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # always rendered (gpt-oss)
            i = self._tok2id.get(t)
            if i is not None:
                attrs[i] = ATTR_USER_DEFINED
        for name in ("eos", "eot", "eom"):
            if ids[name] is not None:
                eog.add(ids[name])  # type: ignore[arg-type]
        eog_texts = {texts[i]: i for i in eog}
        # harmony / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in eog_texts and (("<|return|>" in eog_texts and "<|call|>" in eog_texts)
                                       or ("<|calls|>" in eog_texts and "<|flush|>" in eog_texts)):
            i = eog_texts["<|end|>"]
            eog.discard(i)
            attrs[i] = ATTR_USER_DEFINED
        # gemma4 / plamo: "</s>" is an ordinary token there
        if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
            i = eog_texts["</s>"]
            eog.discard(i)
            attrs[i] = ATTR_NORMAL

        # per-model attributes llama.cpp sets by name
        name = str(md.get("general.name") or "").lower()
        arch = str(md.get("general.architecture") or "")
        pre_name = str(self.pre or "")
        if any(s in pre_name for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
                s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
            if "<mask>" in self._tok2id:
                attrs[self._tok2id["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i, a in enumerate(attrs):
                if a & _ATTR_SPECIAL:
                    attrs[i] |= ATTR_RSTRIP
            if "</s>" in self._tok2id:
                attrs[self._tok2id["</s>"]] |= ATTR_RSTRIP
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                if t in self._tok2id:
                    attrs[self._tok2id[t]] &= ~ATTR_RSTRIP
        elif "modern-bert" in name and "[MASK]" in self._tok2id:
            attrs[self._tok2id["[MASK]"]] |= ATTR_LSTRIP

        self.special_ids: dict[str, int | None] = ids  # bos, eos, eot, eom, unk, sep, pad, mask, fim_*
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.eot_id: int | None = ids["eot"]
        self.eom_id: int | None = ids["eom"]
        self.unk_id: int | None = ids["unk"]
        self.pad_id: int | None = ids["pad"]
        self.sep_id: int | None = ids["sep"]
        self.eog_ids: frozenset[int] = frozenset(eog)
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is set but the vocabulary has no BOS token id")
        if self.add_eos and self.eos_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is set but the vocabulary has no EOS token id")

        # special tokens the partition looks for: (text, id), longest text first
        specials = np.flatnonzero(np.asarray(attrs, dtype=np.int64) & _ATTR_SPECIAL).tolist()
        specials.sort(key=lambda i: (-len(texts[i]), i))
        self._specials_all = [(texts[i], i) for i in specials]
        self._specials_user = [(texts[i], i) for i in specials if not attrs[i] & _ATTR_HIDDEN]
        self._special_finder: dict[bool, Any] = {}
        self._max_piece: int | None = None  # bytes of the longest piece (min_tokens), found on first use
        self._strips = any(attrs[i] & (ATTR_LSTRIP | ATTR_RSTRIP) for i in specials)

        self._pieces: list[bytes | None] = [None] * n
        self._cache: dict[str, tuple[int, ...]] = {}

        if self.vocab_type == "spm":
            self._byte_tokens = [self._spm_byte_token(b) for b in range(256)]
            # chars that precede ▁ inside some vocabulary entry: no cut before ▁ after one of these
            self._spm_no_cut = frozenset(t[k - 1] for t in texts if t.find(_SPM_SPACE, 1) > 0
                                         for k in range(1, len(t)) if t[k] == _SPM_SPACE)
        elif self.vocab_type == "bpe":
            self._init_bpe(md, use_hf_bpe)
        elif self.vocab_type == "wpm":
            self._engine: Any = vocab_models.WordPiece(texts, self.unk_id, self.lowercase, self.strip_accents)
        elif self.vocab_type == "ugm":
            self._engine = vocab_models.Unigram(
                texts, attrs, self._scores, self.unk_id, md.get("tokenizer.ggml.precompiled_charsmap"),
                add_space_prefix=self.add_space_prefix, remove_extra_ws=self.remove_extra_whitespaces)
        elif self.vocab_type == "rwkv":
            self._engine = vocab_models.RWKV(texts, self.unk_id)
        elif self.vocab_type == "test":
            self._engine = vocab_models.HashTest(n)
        else:
            self._engine = vocab_models.Plamo2(texts, attrs, self._scores)

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, f: GGUFFile, **kwargs: Any) -> Tokenizer:
        """Build the tokenizer from an open :class:`minirt.gguf.GGUFFile` (its metadata only)."""
        return cls(f.metadata, **kwargs)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], **kwargs: Any) -> Tokenizer:
        """Build the tokenizer from a GGUF-style key/value mapping (``tokenizer.ggml.*`` keys)."""
        return cls(metadata, **kwargs)

    def _spm_byte_token(self, b: int) -> int | None:
        i = self._tok2id.get("<0x%02X>" % b)
        if i is None and b < 0x80:  # llama.cpp falls back to the byte itself as a token text
            i = self._tok2id.get(chr(b))
        return i

    def _init_bpe(self, md: Mapping[str, Any], use_hf: bool) -> None:
        assert self._spec is not None
        merges = md.get("tokenizer.ggml.merges")
        if merges is None and self._spec.type == "kimi-k2":
            merges = []  # llama.cpp accepts a Kimi-K2 vocabulary without merges
        if not isinstance(merges, (list, tuple)):
            raise TokenizerError(f"tokenizer.ggml.merges is missing: a {self.model!r} (BPE) vocabulary needs it")
        if set(map(type, merges)) - {str}:
            bad = next(r for r, m in enumerate(merges) if not isinstance(m, str))
            raise TokenizerError(f"tokenizer.ggml.merges[{bad}] is not a string")
        self._merge_pairs = _split_merges(merges)
        self._ranks_cache: dict[tuple[str, str], int] | None = None
        self._ignore_merges = self._spec.ignore_merges
        self._byte_encode = self._spec.type not in RAW_UTF8_TYPES
        self._newline_words = self._spec.type == "gemma4"  # a run of newlines that is a token stays one
        group = _GROUP_OF_TYPE.get(self._spec.type)
        self._splitter: Any = _Splitter(group) if group is not None else splitter(self._spec.type)
        self._hf = None
        self._merger: ByteLevelMerges | None = None
        self._raw_vocab: dict[bytes, int] | None = None  # ignore_merges: a word's bytes -> its token
        if use_hf and self._byte_encode:  # byte-level: the compiled merge loop (minirt.bpe says why)
            try:
                self._merger = ByteLevelMerges(_BYTE_TO_CHAR, self._tok2id, self._merge_pairs)
            except KeyError:
                self._validate_merges()  # names the rule that is not a token
                raise
            return
        if use_hf:
            try:
                from tokenizers import Tokenizer as _HFTokenizer
                from tokenizers import models as _hf_models
            except ImportError:  # pragma: no cover - depends on the environment
                log.info("HF tokenizers is not installed: using the pure-Python BPE merge loop")
                use_hf = False
        if not use_hf:
            self._validate_merges()
            return
        try:
            # a repeated pair keeps its first (lowest) rank, as in llama.cpp (HF would keep the last)
            # raw-UTF-8 vocabularies: a symbol that is no token becomes <0xNN> byte tokens
            vocab, pairs = self._tok2id, list(dict.fromkeys(self._merge_pairs))
            if not _is_text("".join(vocab)):
                # entries holding raw bytes (not UTF-8) can never match text, and HF's model only
                # takes text: leave them (and merges naming them) out of it
                vocab = {t: i for t, i in vocab.items() if _is_text(t)}
                pairs = [(a, b) for a, b in pairs if _is_text(a) and _is_text(b)]
            bpe = _hf_models.BPE(vocab=vocab, merges=pairs,
                                 ignore_merges=self._ignore_merges, byte_fallback=not self._byte_encode)
        except Exception as e:  # HF rejects merges naming unknown tokens: report which one
            self._validate_merges()
            raise TokenizerError(f"tokenizer.ggml.merges rejected by the BPE model: {e}") from None
        self._hf = _HFTokenizer(bpe)

    def _byte_level_vocab(self) -> dict[bytes, int]:
        """The tokens whose text is all byte-level characters, by the bytes they stand for."""
        out: dict[bytes, int] = {}
        for t, i in self._tok2id.items():
            s = t.translate(_DECODE_TABLE)
            if s and max(s) < "\u0100":
                out.setdefault(s.encode("latin-1"), i)
        return out

    def _validate_merges(self) -> None:
        """Raise TokenizerError naming the first merge whose parts or result are not tokens."""
        self._ranks  # noqa: B018 - building the rank table checks every merge

    @property
    def _ranks(self) -> dict[tuple[str, str], int]:
        """Merge rank of each (left, right) pair, validated against the vocabulary (built on first use)."""
        if self._ranks_cache is None:
            tok2id = self._tok2id
            ranks: dict[tuple[str, str], int] = {}
            for r, (a, b) in enumerate(self._merge_pairs):
                if a not in tok2id or b not in tok2id or (a + b) not in tok2id:
                    missing = next(x for x in (a, b, a + b) if x not in tok2id)
                    raise TokenizerError(f"tokenizer.ggml.merges[{r}] {a + ' ' + b!r} names {missing!r}, "
                                         "which is not in the vocabulary")
                ranks.setdefault((a, b), r)  # a repeated pair keeps its first (lowest) rank
            self._ranks_cache = ranks
        return self._ranks_cache

    # ---- public API ------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False,
               plain_spans: Sequence[tuple[int, int]] | None = None) -> list[int]:
        """Token ids of ``text`` (llama.cpp ``llama_tokenize``).

        ``add_special``: add BOS / EOS as the vocabulary's ``add_bos_token`` / ``add_eos_token`` say.
        ``parse_special``: control tokens written in the text (``<|im_start|>``) become their ids;
        otherwise only user-defined tokens are recognised and control-token text is tokenized as text.
        ``plain_spans``: with ``parse_special``, ``[start, end)`` ranges of ``text`` (sorted, not
        overlapping) where control tokens are *not* recognised — caller data inside a rendered
        chat (:meth:`minirt.ChatTemplate.render_spans`); user-defined tokens still are, as with
        ``parse_special=False``.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not valid Unicode (lone surrogate at index {e.start})") from None
        out: list[int] = []
        kind = self.vocab_type
        # llama.cpp: WordPiece always adds BOS (and SEP); RWKV and PLaMo-2 never add anything
        add_special = add_special and kind not in ("rwkv", "plamo2", "test")
        if add_special and (self.add_bos or kind == "wpm"):
            if self.bos_id is None:
                raise TokenizerError("add_special=True needs a BOS token, and the vocabulary has none")
            out.append(self.bos_id)
        fragments = self._partition(text, parse_special, plain_spans) if text else []
        if self.vocab_type == "spm":
            prev_special = True  # the first fragment gets the space prefix too
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm_encode(frag.replace(" ", _SPM_SPACE), out)
                prev_special = False
        elif self.vocab_type == "bpe":
            esc = self.escape_whitespaces
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                elif self.model == "whitespace":
                    for seg in self._whitespace_segments(frag):
                        self._bpe_encode(seg, out)
                elif self.model == "hybriddna":
                    self._dna_encode(frag, out)
                else:
                    self._bpe_encode(frag.replace(" ", _SPM_SPACE) if esc else frag, out)
        else:
            engine = self._engine.encode
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    engine(frag, out)
        if add_special:
            if self.vocab_type == "wpm":  # llama.cpp: WordPiece always ends with SEP
                if self.sep_id is None:
                    raise TokenizerError("add_special=True needs a SEP token, and the vocabulary has none")
                out.append(self.sep_id)
            elif self.add_eos:
                out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, computed without tokenizing (O(len(text)), in C).

        Every byte of the input belongs to exactly one token, and no token stands for more bytes
        than the longest piece of the vocabulary, so ``bytes / longest piece`` tokens at least
        (only whitespace can be swallowed by a special token's lstrip / rstrip, so it is not
        counted when the vocabulary has such tokens). Vocabularies that normalize their input
        (WordPiece, Unigram) or drop whitespace give 0: no cheap bound holds for them.
        """
        if self.vocab_type not in ("spm", "bpe") or getattr(self, "model", None) in ("whitespace", "hybriddna"):
            return 0
        if self._max_piece is None:
            # a BPE vocabulary without every byte drops the bytes it cannot write: no bound then
            if self.vocab_type == "bpe":
                have = self._tok2id
                full = (all(c in have for c in _BYTE_TO_CHAR) if self._byte_encode
                        else all("<0x%02X>" % b in have for b in range(256)))
            else:
                full = True
            self._max_piece = max(1, max((len(self.token_to_piece(i)) for i in range(self.n_vocab)), default=1)) \
                if full else 0
        if not self._max_piece:
            return 0
        data = text.encode("utf-8", "surrogatepass")
        n = len(data)
        if self._strips:
            n -= sum(data.count(c) for c in b" \t\n\v\f\r")
        return n // self._max_piece

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids`` (llama.cpp ``llama_detokenize`` with ``remove_special=False``).

        ``skip_special=True`` drops control and unknown tokens (llama.cpp ``unparse_special=False``);
        user-defined tokens are always written. Invalid UTF-8 becomes U+FFFD.
        """
        pieces = [self.token_to_piece(i, skip_special) for i in ids]
        if pieces and self.add_space_prefix and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces).decode("utf-8", errors="replace")
        if self.clean_spaces:
            text = clean_spaces(text)
        return text

    def token_to_piece(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes token ``token_id`` stands for (llama.cpp ``llama_token_to_piece``, no lstrip).

        May be a fragment of a UTF-8 character (byte tokens, byte-level BPE pieces).
        """
        i = self._check_id(token_id)
        if skip_special and self._attrs[i] & _ATTR_HIDDEN:
            return b""
        piece = self._pieces[i]
        if piece is None:
            piece = self._pieces[i] = self._make_piece(i)
        return piece

    def _make_piece(self, i: int) -> bytes:
        attr = self._attrs[i]
        text = self._texts[i]
        kind = self.vocab_type
        if kind == "rwkv":
            return vocab_models.rwkv_unescape(text)
        if kind == "test":
            return b"%x" % i
        if kind == "plamo2":
            return bytes([self._byte_of[i]]) if i in self._byte_of else raw_bytes(text)
        if attr & _ATTR_SPECIAL:
            return raw_bytes(text)
        if attr & ATTR_NORMAL:
            if kind != "bpe" or self.escape_whitespaces:
                return raw_bytes(text.replace(_SPM_SPACE, " "))
            return _from_byte_level(text)
        if attr & ATTR_BYTE:
            return bytes([self._byte_of[i]])
        return b""  # unused / undefined tokens have no text

    def clear_cache(self) -> None:
        """Drop the per-word encode cache (benchmarks use it to measure cold encoding)."""
        self._cache.clear()
        split_cache = getattr(getattr(self, "_splitter", None), "clear_cache", None)
        if split_cache is not None:
            split_cache()
        engine_cache = getattr(getattr(self, "_engine", None), "_cache", None)
        if engine_cache is not None:
            engine_cache.clear()

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary entry of ``token_id`` (``▁`` and byte-level characters not decoded)."""
        return self._texts[self._check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        """The id whose vocabulary entry is exactly ``text``, or None."""
        return self._tok2id.get(text)

    def token_attr(self, token_id: int) -> int:
        """llama.cpp's attribute bits of ``token_id`` (``ATTR_*`` constants of this module)."""
        return self._attrs[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """True for control, user-defined and unknown tokens (the ones ``parse_special`` can produce)."""
        return bool(self._attrs[self._check_id(token_id)] & _ATTR_SPECIAL)

    def is_control(self, token_id: int) -> bool:
        """True for control and unknown tokens (the ones ``decode(skip_special=True)`` drops)."""
        return bool(self._attrs[self._check_id(token_id)] & _ATTR_HIDDEN)

    def is_eog(self, token_id: int) -> bool:
        """True when ``token_id`` ends generation (member of :attr:`eog_ids`)."""
        return token_id in self.eog_ids

    def stream_decoder(self, skip_special: bool = False, continuation: bool = False) -> StreamDecoder:
        """An incremental decoder: ``push(id) -> str`` deltas that add up to :meth:`decode`
        (``continuation=True`` for text that follows a prompt: its leading space is kept)."""
        return StreamDecoder(self, skip_special=skip_special, continuation=continuation)

    def __len__(self) -> int:
        return self.n_vocab

    def __repr__(self) -> str:
        return (f"Tokenizer({self.vocab_type}, n_vocab={self.n_vocab}, pre={self.pre!r}, bos={self.bos_id}, "
                f"eos={self.eos_id}, eog={sorted(self.eog_ids)})")

    def _check_id(self, token_id: int) -> int:
        try:
            i = int(token_id)  # numpy integers too
        except (TypeError, ValueError):
            raise TokenizerError(f"token id must be an integer, got {token_id!r}") from None
        if not 0 <= i < self.n_vocab or isinstance(token_id, bool):
            raise TokenizerError(f"token id {token_id!r} is out of range [0, {self.n_vocab})")
        return i

    # ---- special-token partition -------------------------------------------------------------

    def control_texts_in(self, text: str) -> list[str]:
        """Texts of the control tokens that occur in ``text``, longest first (those that
        ``parse_special=True`` recognises and ``parse_special=False`` does not)."""
        attrs = self._attrs
        return [t for t, i in self._special_candidates(text, True) if attrs[i] & _ATTR_HIDDEN]

    def _partition(self, text: str, parse_special: bool,
                   plain_spans: Sequence[tuple[int, int]] | None = None) -> list[str | int]:
        """Text fragments and special-token ids, as llama.cpp's ``tokenizer_st_partition``."""
        cands = self._special_candidates(text, parse_special)
        if not cands:
            return [text]
        frags: list[tuple[int, int] | int] = [(0, len(text))]
        attrs = self._attrs
        starts = [a for a, _ in plain_spans] if plain_spans else []
        ends = [b for _, b in plain_spans] if plain_spans else []

        def in_plain(a: int, b: int) -> bool:  # does [a, b) overlap a plain span?
            k = bisect.bisect_left(starts, b) - 1
            return k >= 0 and ends[k] > a

        for tok, tid in cands:  # longest first, then by id
            lstrip = attrs[tid] & ATTR_LSTRIP
            rstrip = attrs[tid] & ATTR_RSTRIP
            guard = bool(starts) and attrs[tid] & _ATTR_HIDDEN
            new: list[tuple[int, int] | int] = []
            for fr in frags:
                if isinstance(fr, int):
                    new.append(fr)
                    continue
                pos, end = fr
                search = pos
                while search < end:
                    m = text.find(tok, search, end)
                    if m < 0:
                        break
                    if guard and in_plain(m, m + len(tok)):
                        search = m + 1  # caller data: this control text stays text
                        continue
                    left = m
                    if lstrip:
                        while left > pos and text[left - 1] in _C_SPACE:
                            left -= 1
                    if left > pos:
                        new.append((pos, left))
                    new.append(tid)
                    pos = m + len(tok)
                    if rstrip:
                        while pos < end and text[pos] in _C_SPACE:
                            pos += 1
                    search = pos
                if pos < end:
                    new.append((pos, end))
            frags = new
        return [f if isinstance(f, int) else text[f[0]:f[1]] for f in frags]

    def _special_candidates(self, text: str, parse_special: bool) -> list[tuple[str, int]]:
        """The special tokens that occur in ``text``, in partition order (longest text first)."""
        specials = self._specials_all if parse_special else self._specials_user
        if not specials:
            return []
        if len(specials) <= 48:
            return [(t, i) for t, i in specials if t in text]
        finder = self._special_finder.get(parse_special, False)
        if finder is False:
            try:
                finder = regex.compile(_trie_regex(t for t, _ in specials))
            except (RecursionError, regex.error, OverflowError, MemoryError):
                # specials nested too deeply for the regex parser (a hostile vocabulary: tokens
                # that are prefixes of each other hundreds deep): scan for each one instead
                log.warning("special tokens too deeply nested for one pattern; scanning for each")
                finder = None
            self._special_finder[parse_special] = finder
        if finder is None:
            return [(t, i) for t, i in specials if t in text]
        # every special that occurs is a prefix of the longest special matching at its position
        longest = set(finder.findall(text, overlapped=True))
        if not longest:
            return []
        by_text = {t: i for t, i in specials}
        found = {p for m in longest for k in range(1, len(m) + 1) if (p := m[:k]) in by_text}
        return sorted(((t, by_text[t]) for t in found), key=lambda ti: (-len(ti[0]), ti[1]))

    # ---- SPM ---------------------------------------------------------------------------------

    def _spm_encode(self, text: str, out: list[int]) -> None:
        """Append the SPM ids of ``text`` (spaces already ``▁``) to ``out``."""
        if not text:
            return
        cache = self._cache
        # cut before each ▁ unless some vocabulary entry spans that cut: merges never cross a cut,
        # so tokenizing the pieces separately gives the ids of one pass over the whole text
        no_cut = self._spm_no_cut
        parts = text.split(_SPM_SPACE)
        # groups of parts joined once at the end (appending to a string in a list copies it
        # every time: quadratic in a run of spaces)
        groups: list[list[str]] = [[parts[0]]] if parts[0] else []
        last = parts[0][-1:] if parts[0] else ""
        for p in parts[1:]:
            p = _SPM_SPACE + p
            if groups and last in no_cut:
                groups[-1].append(p)
            else:
                groups.append([p])
            last = p[-1]
        for g in groups:
            piece = g[0] if len(g) == 1 else "".join(g)
            ids = cache.get(piece)
            if ids is None:
                ids = self._spm_merge(piece)
                if len(piece) <= _MAX_CACHED_PIECE:
                    if len(cache) >= _MAX_CACHE:
                        cache.clear()
                    cache[piece] = ids
            out.extend(ids)

    def _spm_merge(self, text: str) -> tuple[int, ...]:
        """llama.cpp ``llm_tokenizer_spm_session::tokenize`` on one piece."""
        vocab = self._tok2id
        scores = self._scores
        syms = list(text)
        n = len(syms)
        if n == 1:
            return self._spm_resegment(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = vocab.get(syms[i] + syms[i + 1])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        push = heapq.heappush
        pop = heapq.heappop
        while heap:
            _, left, r, size = pop(heap)  # highest score first, leftmost on ties
            ls, rs = syms[left], syms[r]
            if not ls or not rs or len(ls) + len(rs) != size:
                continue  # one side was merged since this pair was queued
            merged = ls + rs
            syms[left] = merged
            syms[r] = ""
            nr = nxt[r]
            nxt[left] = nr
            if nr >= 0:
                prv[nr] = left
            p = prv[left]
            if p >= 0:
                t = syms[p] + merged
                tid = vocab.get(t)
                if tid is not None:
                    push(heap, (-scores[tid], p, left, len(t)))
            if nr >= 0:
                t = merged + syms[nr]
                tid = vocab.get(t)
                if tid is not None:
                    push(heap, (-scores[tid], left, nr, len(t)))
        return self._spm_resegment([s for s in syms if s])

    def _spm_resegment(self, syms: list[str]) -> tuple[int, ...]:
        vocab = self._tok2id
        out: list[int] = []
        for s in syms:
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
                continue
            for b in s.encode("utf-8"):  # byte fallback
                bt = self._byte_tokens[b]
                if bt is None:
                    if self.unk_id is None:
                        raise TokenizerError(f"no byte token <0x{b:02X}> and no unknown token to encode {s!r}")
                    bt = self.unk_id
                out.append(bt)
        return tuple(out)

    # ---- BPE ---------------------------------------------------------------------------------

    def _bpe_encode(self, text: str, out: list[int]) -> None:
        """Append the byte-level BPE ids of one text fragment to ``out``."""
        words = self._splitter.split(text)
        cache = self._cache
        get = cache.get
        missing = {w for w in words if w not in cache}
        fresh = self._bpe_fill(list(missing)) if missing else {}
        ext = out.extend
        for w in words:
            ids = get(w)
            if ids is None:  # just computed, or dropped by a concurrent cache clear
                ids = fresh.get(w)
                if ids is None:
                    ids = fresh[w] = self._bpe_fill([w])[w]
            ext(ids)

    def _dna_encode(self, text: str, out: list[int]) -> None:
        """llama.cpp's "hybriddna" model: BPE outside ``<dna>...</dna>``, inside it upper-cased
        6-mers (the last padded with ``A``) looked up with the k-mer marker, else ``<oov>``."""
        tid = self._tok2id.get
        begin, end, oov = tid("<dna>"), tid("</dna>"), tid("<oov>")
        if begin is None or end is None or oov is None:
            self._bpe_encode(text, out)
            return
        pos = 0
        while pos < len(text):
            start = text.find("<dna>", pos)
            if start < 0:
                self._bpe_encode(text[pos:], out)
                break
            if start > pos:
                self._bpe_encode(text[pos:start], out)
            out.append(begin)
            c0 = start + len("<dna>")
            stop = text.find("</dna>", c0)
            # k-mers are 6 *bytes* of the UTF-8 (as in llama.cpp); one that is no valid text is <oov>
            seq = text[c0:stop if stop >= 0 else len(text)].encode("utf-8")
            seq = bytes(b - 32 if 0x61 <= b <= 0x7A else b for b in seq)
            for k in range(0, len(seq), 6):
                try:
                    kmer = seq[k:k + 6].ljust(6, b"A").decode("utf-8")
                except UnicodeDecodeError:
                    out.append(oov)
                    continue
                out.append(tid(kmer + _DNA_MARKER, oov))
            if stop < 0:
                break
            out.append(end)
            pos = stop + len("</dna>")

    def _whitespace_segments(self, text: str) -> list[str]:
        """llama.cpp's "whitespace" model: the runs between whitespace, lower-cased if the
        normaliser says so (llama.cpp's own simple lowercase table)."""
        if self.lowercase:
            lower = lowercase_map()
            text = "".join(chr(lower.get(ord(c), ord(c))) for c in text)
        ws = (flags_of(text) & F_WHITESPACE) != 0 if text else []
        segs: list[str] = []
        start = 0
        for k, w in enumerate(ws):
            if w:
                if k > start:
                    segs.append(text[start:k])
                start = k + 1
        if start < len(text):
            segs.append(text[start:])
        return segs

    def _bpe_fill(self, words: list[str]) -> dict[str, tuple[int, ...]]:
        """Merge ``words`` (pre-tokenized text pieces), cache and return their ids."""
        byte_level = self._byte_encode and self._merger is None  # (the compiled merges read the bytes)
        levels = [_to_byte_level(w) for w in words] if byte_level else list(words)
        result: dict[str, tuple[int, ...]] = {}
        if self._newline_words:  # llama.cpp's Gemma 4 fix: a newline run that is a token is taken whole
            for w in words:
                if w and not w.strip("\n") and w in self._tok2id:
                    result[w] = (self._tok2id[w],)
            if result:
                keep = [k for k, w in enumerate(words) if w not in result]
                words = [words[k] for k in keep]
                levels = [levels[k] for k in keep]
        # ids of the words left, word by word in order, and how many each has: a word's ids are a slice
        ids: list[int] = []
        counts: list[int] = []
        if self._merger is not None:
            enc = [w.encode("utf-8") for w in words]
            if self._ignore_merges:  # llama.cpp: a word that is a token is that token
                raw = self._raw_vocab
                if raw is None:
                    raw = self._raw_vocab = self._byte_level_vocab()
                rest = []
                for w, e in zip(words, enc):
                    tid = raw.get(e)
                    if tid is None:
                        rest.append((w, e))
                    else:
                        result[w] = (tid,)
                words, enc = [w for w, _ in rest], [e for _, e in rest]
            if words:
                offs = np.zeros(len(enc) + 1, np.int64)
                np.cumsum(np.fromiter(map(len, enc), np.int64, len(enc)), out=offs[1:])
                got, per_word = self._merger.merge(np.frombuffer(b"".join(enc), np.uint8), offs)
                ids, counts = got.tolist(), per_word.tolist()
        elif self._hf is None:
            result.update({w: self._bpe_merge_word(bl) for w, bl in zip(words, levels)})
        elif words:
            hf = self._hf.encode(levels, is_pretokenized=True, add_special_tokens=False)
            ids = hf.ids
            counts = np.bincount(np.asarray(hf.word_ids, np.int64), minlength=len(words)).tolist()
        pos = 0
        for w, c in zip(words, counts):
            result[w] = tuple(ids[pos:pos + c])
            pos += c
        cache = self._cache
        if len(cache) + len(result) > _MAX_CACHE:
            cache.clear()
        cache.update(result)
        return result

    def _bpe_merge_word(self, word: str) -> tuple[int, ...]:
        """llama.cpp ``llm_tokenizer_bpe_session::tokenize`` on one byte-level word (pure Python)."""
        vocab = self._tok2id
        if self._ignore_merges and word in vocab:
            return (vocab[word],)
        syms = list(word)
        n = len(syms)
        ranks = self._ranks
        heap: list[tuple[int, int, int, str]] = []
        for i in range(n - 1):
            rank = ranks.get((syms[i], syms[i + 1]))
            if rank is not None:
                heap.append((rank, i, i + 1, syms[i] + syms[i + 1]))
        heapq.heapify(heap)
        nxt = list(range(1, n + 1))
        if n:
            nxt[-1] = -1
        prv = list(range(-1, n - 1))
        while heap:
            _, left, r, merged = heapq.heappop(heap)  # lowest rank first, leftmost on ties
            ls, rs = syms[left], syms[r]
            if not ls or not rs or ls + rs != merged:
                continue  # one side was merged since this pair was queued
            syms[left] = merged
            syms[r] = ""
            nr = nxt[r]
            nxt[left] = nr
            if nr >= 0:
                prv[nr] = left
            p = prv[left]
            if p >= 0:
                rank = ranks.get((syms[p], merged))
                if rank is not None:
                    heapq.heappush(heap, (rank, p, left, syms[p] + merged))
            if nr >= 0:
                rank = ranks.get((merged, syms[nr]))
                if rank is not None:
                    heapq.heappush(heap, (rank, left, nr, merged + syms[nr]))
        out: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
            elif self._byte_encode:  # llama.cpp: single-byte texts of the symbol's UTF-8, where they are tokens
                out.extend(vocab[chr(b)] for b in s.encode("utf-8") if b < 0x80 and chr(b) in vocab)
            else:  # raw-UTF-8 vocabularies: <0xNN> byte tokens, where they exist
                out.extend(vocab[t] for b in s.encode("utf-8") if (t := "<0x%02X>" % b) in vocab)
        return tuple(out)


# ---------------------------------------------------------------------------------------------
# Unicode 15.1 general categories L (letters), N (numbers), P (punctuation) as inclusive hex
# code point ranges: the table llama.cpp's pre-tokenizers classify with. Generated from the
# Unicode Character Database 15.1 (UnicodeData.txt, as shipped by unicodedata2 15.1.0).
# ---------------------------------------------------------------------------------------------
_RANGES_L = (
    "41-5a 61-7a aa b5 ba c0-d6 d8-f6 f8-2c1 2c6-2d1 2e0-2e4 2ec 2ee 370-374 376-377 37a-37d 37f 386 "
    "388-38a 38c 38e-3a1 3a3-3f5 3f7-481 48a-52f 531-556 559 560-588 5d0-5ea 5ef-5f2 620-64a 66e-66f "
    "671-6d3 6d5 6e5-6e6 6ee-6ef 6fa-6fc 6ff 710 712-72f 74d-7a5 7b1 7ca-7ea 7f4-7f5 7fa 800-815 81a "
    "824 828 840-858 860-86a 870-887 889-88e 8a0-8c9 904-939 93d 950 958-961 971-980 985-98c 98f-990 "
    "993-9a8 9aa-9b0 9b2 9b6-9b9 9bd 9ce 9dc-9dd 9df-9e1 9f0-9f1 9fc a05-a0a a0f-a10 a13-a28 a2a-a30 "
    "a32-a33 a35-a36 a38-a39 a59-a5c a5e a72-a74 a85-a8d a8f-a91 a93-aa8 aaa-ab0 ab2-ab3 ab5-ab9 abd "
    "ad0 ae0-ae1 af9 b05-b0c b0f-b10 b13-b28 b2a-b30 b32-b33 b35-b39 b3d b5c-b5d b5f-b61 b71 b83 "
    "b85-b8a b8e-b90 b92-b95 b99-b9a b9c b9e-b9f ba3-ba4 ba8-baa bae-bb9 bd0 c05-c0c c0e-c10 c12-c28 "
    "c2a-c39 c3d c58-c5a c5d c60-c61 c80 c85-c8c c8e-c90 c92-ca8 caa-cb3 cb5-cb9 cbd cdd-cde ce0-ce1 "
    "cf1-cf2 d04-d0c d0e-d10 d12-d3a d3d d4e d54-d56 d5f-d61 d7a-d7f d85-d96 d9a-db1 db3-dbb dbd "
    "dc0-dc6 e01-e30 e32-e33 e40-e46 e81-e82 e84 e86-e8a e8c-ea3 ea5 ea7-eb0 eb2-eb3 ebd ec0-ec4 ec6 "
    "edc-edf f00 f40-f47 f49-f6c f88-f8c 1000-102a 103f 1050-1055 105a-105d 1061 1065-1066 106e-1070 "
    "1075-1081 108e 10a0-10c5 10c7 10cd 10d0-10fa 10fc-1248 124a-124d 1250-1256 1258 125a-125d "
    "1260-1288 128a-128d 1290-12b0 12b2-12b5 12b8-12be 12c0 12c2-12c5 12c8-12d6 12d8-1310 1312-1315 "
    "1318-135a 1380-138f 13a0-13f5 13f8-13fd 1401-166c 166f-167f 1681-169a 16a0-16ea 16f1-16f8 "
    "1700-1711 171f-1731 1740-1751 1760-176c 176e-1770 1780-17b3 17d7 17dc 1820-1878 1880-1884 "
    "1887-18a8 18aa 18b0-18f5 1900-191e 1950-196d 1970-1974 1980-19ab 19b0-19c9 1a00-1a16 1a20-1a54 "
    "1aa7 1b05-1b33 1b45-1b4c 1b83-1ba0 1bae-1baf 1bba-1be5 1c00-1c23 1c4d-1c4f 1c5a-1c7d 1c80-1c88 "
    "1c90-1cba 1cbd-1cbf 1ce9-1cec 1cee-1cf3 1cf5-1cf6 1cfa 1d00-1dbf 1e00-1f15 1f18-1f1d 1f20-1f45 "
    "1f48-1f4d 1f50-1f57 1f59 1f5b 1f5d 1f5f-1f7d 1f80-1fb4 1fb6-1fbc 1fbe 1fc2-1fc4 1fc6-1fcc "
    "1fd0-1fd3 1fd6-1fdb 1fe0-1fec 1ff2-1ff4 1ff6-1ffc 2071 207f 2090-209c 2102 2107 210a-2113 2115 "
    "2119-211d 2124 2126 2128 212a-212d 212f-2139 213c-213f 2145-2149 214e 2183-2184 2c00-2ce4 "
    "2ceb-2cee 2cf2-2cf3 2d00-2d25 2d27 2d2d 2d30-2d67 2d6f 2d80-2d96 2da0-2da6 2da8-2dae 2db0-2db6 "
    "2db8-2dbe 2dc0-2dc6 2dc8-2dce 2dd0-2dd6 2dd8-2dde 2e2f 3005-3006 3031-3035 303b-303c 3041-3096 "
    "309d-309f 30a1-30fa 30fc-30ff 3105-312f 3131-318e 31a0-31bf 31f0-31ff 3400-4dbf 4e00-a48c "
    "a4d0-a4fd a500-a60c a610-a61f a62a-a62b a640-a66e a67f-a69d a6a0-a6e5 a717-a71f a722-a788 "
    "a78b-a7ca a7d0-a7d1 a7d3 a7d5-a7d9 a7f2-a801 a803-a805 a807-a80a a80c-a822 a840-a873 a882-a8b3 "
    "a8f2-a8f7 a8fb a8fd-a8fe a90a-a925 a930-a946 a960-a97c a984-a9b2 a9cf a9e0-a9e4 a9e6-a9ef "
    "a9fa-a9fe aa00-aa28 aa40-aa42 aa44-aa4b aa60-aa76 aa7a aa7e-aaaf aab1 aab5-aab6 aab9-aabd aac0 "
    "aac2 aadb-aadd aae0-aaea aaf2-aaf4 ab01-ab06 ab09-ab0e ab11-ab16 ab20-ab26 ab28-ab2e ab30-ab5a "
    "ab5c-ab69 ab70-abe2 ac00-d7a3 d7b0-d7c6 d7cb-d7fb f900-fa6d fa70-fad9 fb00-fb06 fb13-fb17 fb1d "
    "fb1f-fb28 fb2a-fb36 fb38-fb3c fb3e fb40-fb41 fb43-fb44 fb46-fbb1 fbd3-fd3d fd50-fd8f fd92-fdc7 "
    "fdf0-fdfb fe70-fe74 fe76-fefc ff21-ff3a ff41-ff5a ff66-ffbe ffc2-ffc7 ffca-ffcf ffd2-ffd7 "
    "ffda-ffdc 10000-1000b 1000d-10026 10028-1003a 1003c-1003d 1003f-1004d 10050-1005d 10080-100fa "
    "10280-1029c 102a0-102d0 10300-1031f 1032d-10340 10342-10349 10350-10375 10380-1039d 103a0-103c3 "
    "103c8-103cf 10400-1049d 104b0-104d3 104d8-104fb 10500-10527 10530-10563 10570-1057a 1057c-1058a "
    "1058c-10592 10594-10595 10597-105a1 105a3-105b1 105b3-105b9 105bb-105bc 10600-10736 10740-10755 "
    "10760-10767 10780-10785 10787-107b0 107b2-107ba 10800-10805 10808 1080a-10835 10837-10838 1083c "
    "1083f-10855 10860-10876 10880-1089e 108e0-108f2 108f4-108f5 10900-10915 10920-10939 10980-109b7 "
    "109be-109bf 10a00 10a10-10a13 10a15-10a17 10a19-10a35 10a60-10a7c 10a80-10a9c 10ac0-10ac7 "
    "10ac9-10ae4 10b00-10b35 10b40-10b55 10b60-10b72 10b80-10b91 10c00-10c48 10c80-10cb2 10cc0-10cf2 "
    "10d00-10d23 10e80-10ea9 10eb0-10eb1 10f00-10f1c 10f27 10f30-10f45 10f70-10f81 10fb0-10fc4 "
    "10fe0-10ff6 11003-11037 11071-11072 11075 11083-110af 110d0-110e8 11103-11126 11144 11147 "
    "11150-11172 11176 11183-111b2 111c1-111c4 111da 111dc 11200-11211 11213-1122b 1123f-11240 "
    "11280-11286 11288 1128a-1128d 1128f-1129d 1129f-112a8 112b0-112de 11305-1130c 1130f-11310 "
    "11313-11328 1132a-11330 11332-11333 11335-11339 1133d 11350 1135d-11361 11400-11434 11447-1144a "
    "1145f-11461 11480-114af 114c4-114c5 114c7 11580-115ae 115d8-115db 11600-1162f 11644 11680-116aa "
    "116b8 11700-1171a 11740-11746 11800-1182b 118a0-118df 118ff-11906 11909 1190c-11913 11915-11916 "
    "11918-1192f 1193f 11941 119a0-119a7 119aa-119d0 119e1 119e3 11a00 11a0b-11a32 11a3a 11a50 "
    "11a5c-11a89 11a9d 11ab0-11af8 11c00-11c08 11c0a-11c2e 11c40 11c72-11c8f 11d00-11d06 11d08-11d09 "
    "11d0b-11d30 11d46 11d60-11d65 11d67-11d68 11d6a-11d89 11d98 11ee0-11ef2 11f02 11f04-11f10 "
    "11f12-11f33 11fb0 12000-12399 12480-12543 12f90-12ff0 13000-1342f 13441-13446 14400-14646 "
    "16800-16a38 16a40-16a5e 16a70-16abe 16ad0-16aed 16b00-16b2f 16b40-16b43 16b63-16b77 16b7d-16b8f "
    "16e40-16e7f 16f00-16f4a 16f50 16f93-16f9f 16fe0-16fe1 16fe3 17000-187f7 18800-18cd5 18d00-18d08 "
    "1aff0-1aff3 1aff5-1affb 1affd-1affe 1b000-1b122 1b132 1b150-1b152 1b155 1b164-1b167 1b170-1b2fb "
    "1bc00-1bc6a 1bc70-1bc7c 1bc80-1bc88 1bc90-1bc99 1d400-1d454 1d456-1d49c 1d49e-1d49f 1d4a2 "
    "1d4a5-1d4a6 1d4a9-1d4ac 1d4ae-1d4b9 1d4bb 1d4bd-1d4c3 1d4c5-1d505 1d507-1d50a 1d50d-1d514 "
    "1d516-1d51c 1d51e-1d539 1d53b-1d53e 1d540-1d544 1d546 1d54a-1d550 1d552-1d6a5 1d6a8-1d6c0 "
    "1d6c2-1d6da 1d6dc-1d6fa 1d6fc-1d714 1d716-1d734 1d736-1d74e 1d750-1d76e 1d770-1d788 1d78a-1d7a8 "
    "1d7aa-1d7c2 1d7c4-1d7cb 1df00-1df1e 1df25-1df2a 1e030-1e06d 1e100-1e12c 1e137-1e13d 1e14e "
    "1e290-1e2ad 1e2c0-1e2eb 1e4d0-1e4eb 1e7e0-1e7e6 1e7e8-1e7eb 1e7ed-1e7ee 1e7f0-1e7fe 1e800-1e8c4 "
    "1e900-1e943 1e94b 1ee00-1ee03 1ee05-1ee1f 1ee21-1ee22 1ee24 1ee27 1ee29-1ee32 1ee34-1ee37 1ee39 "
    "1ee3b 1ee42 1ee47 1ee49 1ee4b 1ee4d-1ee4f 1ee51-1ee52 1ee54 1ee57 1ee59 1ee5b 1ee5d 1ee5f "
    "1ee61-1ee62 1ee64 1ee67-1ee6a 1ee6c-1ee72 1ee74-1ee77 1ee79-1ee7c 1ee7e 1ee80-1ee89 1ee8b-1ee9b "
    "1eea1-1eea3 1eea5-1eea9 1eeab-1eebb 20000-2a6df 2a700-2b739 2b740-2b81d 2b820-2cea1 2ceb0-2ebe0 "
    "2ebf0-2ee5d 2f800-2fa1d 30000-3134a 31350-323af "
)
_RANGES_N = (
    "30-39 b2-b3 b9 bc-be 660-669 6f0-6f9 7c0-7c9 966-96f 9e6-9ef 9f4-9f9 a66-a6f ae6-aef b66-b6f "
    "b72-b77 be6-bf2 c66-c6f c78-c7e ce6-cef d58-d5e d66-d78 de6-def e50-e59 ed0-ed9 f20-f33 "
    "1040-1049 1090-1099 1369-137c 16ee-16f0 17e0-17e9 17f0-17f9 1810-1819 1946-194f 19d0-19da "
    "1a80-1a89 1a90-1a99 1b50-1b59 1bb0-1bb9 1c40-1c49 1c50-1c59 2070 2074-2079 2080-2089 2150-2182 "
    "2185-2189 2460-249b 24ea-24ff 2776-2793 2cfd 3007 3021-3029 3038-303a 3192-3195 3220-3229 "
    "3248-324f 3251-325f 3280-3289 32b1-32bf a620-a629 a6e6-a6ef a830-a835 a8d0-a8d9 a900-a909 "
    "a9d0-a9d9 a9f0-a9f9 aa50-aa59 abf0-abf9 ff10-ff19 10107-10133 10140-10178 1018a-1018b "
    "102e1-102fb 10320-10323 10341 1034a 103d1-103d5 104a0-104a9 10858-1085f 10879-1087f 108a7-108af "
    "108fb-108ff 10916-1091b 109bc-109bd 109c0-109cf 109d2-109ff 10a40-10a48 10a7d-10a7e 10a9d-10a9f "
    "10aeb-10aef 10b58-10b5f 10b78-10b7f 10ba9-10baf 10cfa-10cff 10d30-10d39 10e60-10e7e 10f1d-10f26 "
    "10f51-10f54 10fc5-10fcb 11052-1106f 110f0-110f9 11136-1113f 111d0-111d9 111e1-111f4 112f0-112f9 "
    "11450-11459 114d0-114d9 11650-11659 116c0-116c9 11730-1173b 118e0-118f2 11950-11959 11c50-11c6c "
    "11d50-11d59 11da0-11da9 11f50-11f59 11fc0-11fd4 12400-1246e 16a60-16a69 16ac0-16ac9 16b50-16b59 "
    "16b5b-16b61 16e80-16e96 1d2c0-1d2d3 1d2e0-1d2f3 1d360-1d378 1d7ce-1d7ff 1e140-1e149 1e2f0-1e2f9 "
    "1e4f0-1e4f9 1e8c7-1e8cf 1e950-1e959 1ec71-1ecab 1ecad-1ecaf 1ecb1-1ecb4 1ed01-1ed2d 1ed2f-1ed3d "
    "1f100-1f10c 1fbf0-1fbf9 "
)
_RANGES_P = (
    "21-23 25-2a 2c-2f 3a-3b 3f-40 5b-5d 5f 7b 7d a1 a7 ab b6-b7 bb bf 37e 387 55a-55f 589-58a 5be "
    "5c0 5c3 5c6 5f3-5f4 609-60a 60c-60d 61b 61d-61f 66a-66d 6d4 700-70d 7f7-7f9 830-83e 85e 964-965 "
    "970 9fd a76 af0 c77 c84 df4 e4f e5a-e5b f04-f12 f14 f3a-f3d f85 fd0-fd4 fd9-fda 104a-104f 10fb "
    "1360-1368 1400 166e 169b-169c 16eb-16ed 1735-1736 17d4-17d6 17d8-17da 1800-180a 1944-1945 "
    "1a1e-1a1f 1aa0-1aa6 1aa8-1aad 1b5a-1b60 1b7d-1b7e 1bfc-1bff 1c3b-1c3f 1c7e-1c7f 1cc0-1cc7 1cd3 "
    "2010-2027 2030-2043 2045-2051 2053-205e 207d-207e 208d-208e 2308-230b 2329-232a 2768-2775 "
    "27c5-27c6 27e6-27ef 2983-2998 29d8-29db 29fc-29fd 2cf9-2cfc 2cfe-2cff 2d70 2e00-2e2e 2e30-2e4f "
    "2e52-2e5d 3001-3003 3008-3011 3014-301f 3030 303d 30a0 30fb a4fe-a4ff a60d-a60f a673 a67e "
    "a6f2-a6f7 a874-a877 a8ce-a8cf a8f8-a8fa a8fc a92e-a92f a95f a9c1-a9cd a9de-a9df aa5c-aa5f "
    "aade-aadf aaf0-aaf1 abeb fd3e-fd3f fe10-fe19 fe30-fe52 fe54-fe61 fe63 fe68 fe6a-fe6b ff01-ff03 "
    "ff05-ff0a ff0c-ff0f ff1a-ff1b ff1f-ff20 ff3b-ff3d ff3f ff5b ff5d ff5f-ff65 10100-10102 1039f "
    "103d0 1056f 10857 1091f 1093f 10a50-10a58 10a7f 10af0-10af6 10b39-10b3f 10b99-10b9c 10ead "
    "10f55-10f59 10f86-10f89 11047-1104d 110bb-110bc 110be-110c1 11140-11143 11174-11175 111c5-111c8 "
    "111cd 111db 111dd-111df 11238-1123d 112a9 1144b-1144f 1145a-1145b 1145d 114c6 115c1-115d7 "
    "11641-11643 11660-1166c 116b9 1173c-1173e 1183b 11944-11946 119e2 11a3f-11a46 11a9a-11a9c "
    "11a9e-11aa2 11b00-11b09 11c41-11c45 11c70-11c71 11ef7-11ef8 11f43-11f4f 11fff 12470-12474 "
    "12ff1-12ff2 16a6e-16a6f 16af5 16b37-16b3b 16b44 16e97-16e9a 16fe2 1bc9f 1da87-1da8b 1e95e-1e95f "
)
