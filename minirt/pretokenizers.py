"""llama.cpp's BPE pre-tokenizers (``tokenizer.ggml.pre``), reproduced split for split.

llama.cpp (``src/llama-vocab.cpp``, ``src/unicode.cpp``) gives every pre-tokenizer a list of
regexes; each splits every current piece of the text into its matches and the text between them.
A regex runs one of three ways there, and :class:`Splitter` runs it the same way:

* *custom*: a few exact regex strings (GPT-2's, Llama 3's, Qwen2's, Qwen3.5's, Kimi-K2's, AFMoE's
  digits, "newline runs") are hand-coded loops over llama.cpp's own code point flags. Here the
  GPT-2 / Llama 3 / Qwen2 / Qwen3.5 ones are the same regexes over character classes built from
  those flags (:mod:`minirt.unicode_data`), and the loops whose results are not a regex's
  (Kimi-K2, AFMoE digits) are ported loop for loop.
* *collapsed*: a regex that names ``\\p{L}``, ``\\p{N}``, ``\\p{P}``, ``\\p{M}``, ``\\p{S}`` (or
  ``\\p{Lu}`` ...) runs with ``std::regex`` over a copy of the text where every non-ASCII code point
  became one byte for its category (letters 0xD2, digits 0xD1, ..., whitespace 0x0B), and
  ``\\p{X}`` became ``[<that byte><the ASCII members>]``. Here the same copy and the same rewritten
  regex are made and run with ``regex`` in ASCII mode, so llama.cpp's quirks come out the same
  (``\\p{Lu}`` is any letter; ``[^a-z]`` matches every non-ASCII letter).
* *wide*: a regex without categories runs with ``std::wregex`` over the code points, non-ASCII
  whitespace turned into 0x0B; here ``regex`` in ASCII mode over the same text.

``std::regex`` (ECMAScript) and ``regex`` agree on these patterns (ordered alternation,
backtracking, lookahead); the one syntax difference met, ``$`` (end of input only in ECMAScript),
is rewritten to ``\\Z``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import regex

from . import unicode_data
from .quants._jit import jit

# llama.cpp unicode_cpt_flags bits
F_UNDEFINED = 0x0001
F_NUMBER = 0x0002
F_LETTER = 0x0004
F_SEPARATOR = 0x0008
F_MARK = 0x0010
F_PUNCT = 0x0020
F_SYMBOL = 0x0040
F_CONTROL = 0x0080
F_WHITESPACE = 0x0100
_MAX_CP = 0x110000


# ---------------------------------------------------------------------------------------------
# code point tables
# ---------------------------------------------------------------------------------------------

@functools.cache
def flag_table() -> np.ndarray:
    """uint16 flags of every code point (llama.cpp ``unicode_cpt_flags_array``, whitespace bit set)."""
    pairs = _hex_pairs(unicode_data.FLAG_RANGES)
    starts = [int(a, 16) for a, _ in pairs]
    flags = [f for _, f in pairs]
    lengths = np.diff(np.array(starts + [_MAX_CP], dtype=np.int64))
    table = np.repeat(np.array(flags, dtype=np.uint16), lengths)
    table[list(unicode_data.WHITESPACE)] |= F_WHITESPACE
    return table


@functools.cache
def _collapse_table() -> np.ndarray:
    """Code point -> the byte llama.cpp's ``text_collapsed`` holds for it."""
    fl = flag_table()
    cats = fl & 0xFF
    out = np.full(_MAX_CP, 0xD0, dtype=np.uint8)  # "fallback": undefined, control, separator
    for flag, byte in ((F_NUMBER, 0xD1), (F_LETTER, 0xD2), (F_PUNCT, 0xD3), (F_MARK, 0xD4), (F_SYMBOL, 0xD5)):
        out[cats == flag] = byte
    out[(fl & F_WHITESPACE) != 0] = 0x0B
    out[:128] = np.arange(128, dtype=np.uint8)
    return out


def _hex_pairs(spec: str) -> list[tuple[str, int]]:
    """``"key:value"`` items of a :mod:`minirt.unicode_data` table -> (key, int(value, 16))."""
    return [(k, int(v, 16)) for k, _, v in (item.partition(":") for item in spec.split())]


@functools.cache
def lowercase_map() -> dict[int, int]:
    """llama.cpp ``unicode_tolower``: simple lowercase mappings."""
    return {int(a, 16): b for a, b in _hex_pairs(unicode_data.LOWER)}


@functools.cache
def nfd_map() -> dict[int, int]:
    """llama.cpp ``unicode_cpts_normalize_nfd``: each code point -> the first code point of its NFD."""
    out = {}
    for r, n in _hex_pairs(unicode_data.NFD):
        a, _, b = r.partition("-")
        for c in range(int(a, 16), int(b, 16) + 1):
            out[c] = n
    return out


def codepoints(text: str) -> np.ndarray:
    """The code points of ``text`` as a uint32 array."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def flags_of(text: str) -> np.ndarray:
    """llama.cpp's flags of each code point of ``text``."""
    return flag_table()[codepoints(text)]


def collapse(text: str) -> str:
    """llama.cpp's ``text_collapsed``: ASCII kept, every other code point one category byte."""
    if text.isascii():
        return text
    return _collapse_table()[codepoints(text)].tobytes().decode("latin-1")


def _wide(text: str) -> str:
    """The text ``std::wregex`` sees: non-ASCII whitespace as 0x0B."""
    if text.isascii():
        return text
    fl = flags_of(text)
    cps = codepoints(text).copy()
    cps[(cps > 0x7F) & ((fl & F_WHITESPACE) != 0)] = 0x0B
    return cps.tobytes().decode("utf-32-le")


@functools.cache
def char_class(mask: int) -> str:
    """A regex class body (no brackets) of the code points whose category flags intersect ``mask``."""
    fl = flag_table()
    return _class_body((fl & mask) != 0)


def _class_body(hit: np.ndarray) -> str:
    edges = np.flatnonzero(np.diff(np.concatenate(([0], hit.astype(np.int8), [0]))))
    parts = []
    for lo, hi in zip(edges[0::2], edges[1::2] - 1):
        parts.append("\\U%08x" % lo if lo == hi else "\\U%08x-\\U%08x" % (lo, hi))
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# llama.cpp's regex rewriting
# ---------------------------------------------------------------------------------------------

_UCAT = {"\\p{N}": F_NUMBER, "\\p{L}": F_LETTER, "\\p{P}": F_PUNCT, "\\p{M}": F_MARK, "\\p{S}": F_SYMBOL,
         "\\p{Lu}": F_LETTER, "\\p{Ll}": F_LETTER, "\\p{Lt}": F_LETTER, "\\p{Lm}": F_LETTER, "\\p{Lo}": F_LETTER}
_UCAT_BYTE = {F_NUMBER: "\xd1", F_LETTER: "\xd2", F_PUNCT: "\xd3", F_MARK: "\xd4", F_SYMBOL: "\xd5"}
_UCAT_ASCII = {F_NUMBER: "0-9", F_LETTER: "A-Za-z", F_PUNCT: "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}", F_MARK: "",
               F_SYMBOL: "\\$\\+<->\\^`\\|\\~"}


def _uses_categories(expr: str) -> bool:
    return any(k in expr for k in _UCAT)


def _collapse_regex(expr: str) -> str:
    """llama.cpp ``unicode_regex_split``'s rewrite of a regex for the collapsed text."""
    out = []
    inside = False
    i = 0
    n = len(expr)
    while i < n:
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
            i += 1
            continue
        if inside and c == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
            i += 1
            continue
        if c == "\\" and i + 3 < n and expr[i + 1] == "p" and expr[i + 2] == "{":
            close = expr.find("}", i + 3)
            if close != -1 and close <= i + 10:
                pat = expr[i:close + 1]
                if pat in _UCAT:
                    f = _UCAT[pat]
                    body = _UCAT_BYTE[f] + _UCAT_ASCII[f]
                    out.append(body if inside else "[" + body + "]")
                    i = close + 1
                    continue
        out.append(c)
        i += 1
    return "".join(out)


def _ecma_to_python(expr: str) -> str:
    """ECMAScript syntax -> ``regex`` syntax for the patterns llama.cpp uses: ``$`` is end of input."""
    out = []
    inside = False
    esc = False
    for c in expr:
        if esc:
            out.append(c)
            esc = False
            continue
        if c == "\\":
            out.append(c)
            esc = True
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            out.append("\\Z")
            continue
        out.append(c)
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# custom splitters (llama.cpp unicode_regex_split_custom_*)
# ---------------------------------------------------------------------------------------------

RE_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
RE_LLAMA3_I = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
               "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_CONTR = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
RE_LLAMA3 = (_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
             "|\\s+(?!\\S)|\\s+")
RE_QWEN2 = (_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
            "|\\s+(?!\\S)|\\s+")
RE_QWEN35 = (_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
             "|\\s+(?!\\S)|\\s+")
RE_KIMI = "\\p{Han}+"
RE_AFMOE_DIGITS = "\\p{AFMoE_digits}"
RE_NEWLINES = "[^\\n]+|[\\n]+"
RE_TINY_AYA_DIGITS = "\\d{1,3}(?=(?:\\d{3})*\\b)"


@functools.cache
def _risky() -> np.ndarray:
    """True at the code points where ``regex``'s ``\\p{L}``, ``\\p{N}``, ``\\p{M}`` or ``\\s``
    disagree with llama.cpp's table (e.g. letters assigned after Unicode 15.1): a text without
    any of them can use the faster built-in classes."""
    cps = np.concatenate([np.arange(0xD800), np.arange(0xE000, _MAX_CP)]).astype(np.uint32)
    everything = cps.tobytes().decode("utf-32-le")
    fl = flag_table()
    risky = np.zeros(_MAX_CP, dtype=bool)
    for prop, mask in (("\\p{L}", F_LETTER), ("\\p{N}", F_NUMBER), ("\\p{M}", F_MARK), ("\\s", F_WHITESPACE)):
        have = np.zeros(_MAX_CP, dtype=bool)
        for m in regex.finditer(prop + "+", everything):
            have[ord(m.group()[0]):ord(m.group()[-1]) + 1] = True
        risky |= have != ((fl & mask) != 0)
    risky[0xD800:0xE000] = False
    return risky


def _fast(expr: str) -> regex.Pattern[str]:
    """A custom regex with ``regex``'s own classes: exact for texts :func:`_risky` does not match."""
    return regex.compile(expr, regex.V0)


def _exact(expr: str) -> regex.Pattern[str]:
    """A custom regex over llama.cpp's full code point classes (no collapsing)."""
    cls = {"L": char_class(F_LETTER), "N": char_class(F_NUMBER), "M": char_class(F_MARK),
           "WS": char_class(F_WHITESPACE)}
    pat = (expr.replace("\\p{L}", cls["L"]).replace("\\p{N}", cls["N"]).replace("\\p{M}", cls["M"])
           .replace("\\s", cls["WS"]).replace("\\S", "[^" + cls["WS"] + "]"))
    # bare (unbracketed) classes need brackets: the replacements above may sit outside [...]
    pat = _bracket_bare(pat, cls)
    return regex.compile(pat, regex.V0)


def _bracket_bare(pat: str, cls: dict[str, str]) -> str:
    """Wrap the class bodies that :func:`_exact` put outside ``[...]`` in brackets."""
    out = []
    inside = False
    i = 0
    bodies = sorted(set(cls.values()), key=len, reverse=True)
    while i < len(pat):
        if not inside:
            body = next((b for b in bodies if pat.startswith(b, i)), None)
            if body is not None:
                out.append("[" + body + "]")
                i += len(body)
                continue
        c = pat[i]
        if c == "\\":
            out.append(pat[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        out.append(c)
        i += 1
    return "".join(out)


def _split_regex(rx: regex.Pattern[str], src: str) -> list[int]:
    """Lengths of the pieces ``rx`` cuts ``src`` into (matches and the gaps between them)."""
    if not rx.groups:  # fast path: matches that cover the text are the pieces
        lengths = list(map(len, rx.findall(src)))
        if sum(lengths) == len(src) and all(lengths):
            return lengths
    out = []
    pos = 0
    for m in rx.finditer(src):
        a, b = m.span()
        if a > pos:
            out.append(a - pos)
        if b > a:
            out.append(b - a)
        pos = b
    if pos < len(src):
        out.append(len(src) - pos)
    return out


@functools.cache
def _ascii_lower() -> tuple[np.ndarray, np.ndarray]:
    """The simple lowercase mappings that end in ASCII (sorted sources, targets): all that the
    Kimi-K2 contraction test (``'s``, ``'re`` ...) needs of the lowercase table."""
    pairs = sorted((a, b) for a, b in lowercase_map().items() if b < 128)
    return np.asarray([a for a, _ in pairs], np.int64), np.asarray([b for _, b in pairs], np.int64)


def _kimi_k2(piece: str) -> list[int]:
    """llama.cpp ``unicode_regex_split_custom_kimi_k2``, loop for loop (its results are not the
    regex it documents: e.g. ``\\p{M}`` is not part of a word, and a failed leading character is
    retried as punctuation). Compiled (:func:`_kimi_k2_cuts`): in Python it ran at 0.6x llama.cpp."""
    cps = codepoints(piece).astype(np.int64)
    out = np.empty(len(cps), np.int64)  # at most one piece per code point
    k = _kimi_k2_cuts(cps, flag_table()[cps].astype(np.int64), *_ascii_lower(), out)
    return out[:k].tolist()


@jit(inline=True)
def _is_han(c):  # pragma: no cover - compiled
    return (0x4E00 <= c <= 0x9FFF or 0x3400 <= c <= 0x4DBF or 0x20000 <= c <= 0x2A6DF or 0x2A700 <= c <= 0x2B73F
            or 0x2B740 <= c <= 0x2B81F or 0x2B820 <= c <= 0x2CEAF or 0x2CEB0 <= c <= 0x2EBEF
            or 0xF900 <= c <= 0xFAFF or 0x2F800 <= c <= 0x2FA1F)


@jit(inline=True)
def _lower_ascii(c, src, dst):  # pragma: no cover - compiled
    """c lowercased where that gives ASCII (src / dst: _ascii_lower), else c."""
    j = np.searchsorted(src, c)
    return dst[j] if j < src.shape[0] and src[j] == c else c


@jit()
def _kimi_k2_cuts(cps, fl, lsrc, ldst, out):  # pragma: no cover - compiled
    """The piece lengths of :func:`_kimi_k2` for code points cps (n,) with flags fl (n,): out[:k],
    returns k. Positions outside the text read as code point -1 with flags 0 (llama.cpp OUT_OF_RANGE)."""
    n = cps.shape[0]
    k = 0
    prev = 0
    pos = 0
    while pos < n:
        c = cps[pos]
        f = fl[pos]
        if _is_han(c):
            while pos < n and _is_han(cps[pos]):
                pos += 1
            if pos > prev:
                out[k] = pos - prev
                k += 1
            prev = pos
            continue
        lead_ok = not (c == 13 or c == 10 or f & F_LETTER or f & F_NUMBER)
        nxt_letter = pos + 1 < n and (fl[pos + 1] & F_LETTER) != 0 and not _is_han(cps[pos + 1])
        if (f & F_LETTER and not _is_han(c)) or (lead_ok and nxt_letter):
            has_lead = False
            if lead_ok:
                has_lead = True
                pos += 1
            has_letters = False
            while pos < n and fl[pos] & F_LETTER and not _is_han(cps[pos]):
                has_letters = True
                pos += 1
            if has_letters or (not has_lead and pos < n and fl[pos] & F_LETTER and not _is_han(cps[pos])):
                if not has_letters:
                    pos += 1
                while pos < n and fl[pos] & F_LETTER and not _is_han(cps[pos]):
                    pos += 1
                if pos < n and cps[pos] == 0x27 and pos + 1 < n:
                    nx = _lower_ascii(cps[pos + 1], lsrc, ldst)
                    if nx == 0x73 or nx == 0x74 or nx == 0x6D or nx == 0x64:
                        pos += 2
                    elif pos + 2 < n:
                        nn = _lower_ascii(cps[pos + 2], lsrc, ldst)
                        if (nx == 0x72 and nn == 0x65) or (nx == 0x76 and nn == 0x65) or (nx == 0x6C and nn == 0x6C):
                            pos += 3
                if pos > prev:
                    out[k] = pos - prev
                    k += 1
                prev = pos
                continue
            elif has_lead:
                pos -= 1
        if f & F_NUMBER:
            ini = pos
            while pos < n and fl[pos] & F_NUMBER:
                pos += 1
                if pos - ini >= 3:
                    if pos > prev:
                        out[k] = pos - prev
                        k += 1
                    prev = pos
                    ini = pos
            if pos > prev:
                out[k] = pos - prev
                k += 1
            prev = pos
            continue
        if c == 0x20:
            f2 = fl[pos + 1] if pos + 1 < n else 0
        else:
            f2 = f
        if not (f2 & (F_WHITESPACE | F_LETTER | F_NUMBER)) and f2:
            if c == 0x20:
                pos += 1
            while not (f2 & (F_WHITESPACE | F_LETTER | F_NUMBER)) and f2:
                pos += 1
                f2 = fl[pos] if pos < n else 0
            while pos < n and (cps[pos] == 13 or cps[pos] == 10):
                pos += 1
            if pos > prev:
                out[k] = pos - prev
                k += 1
            prev = pos
            continue
        nws = 0
        last_rn = 0
        while pos + nws < n and fl[pos + nws] & F_WHITESPACE:
            if cps[pos + nws] == 13 or cps[pos + nws] == 10:
                last_rn = pos + nws + 1
            nws += 1
        if last_rn > 0:
            pos = last_rn
        elif nws > 1 and pos + nws < n:
            pos += nws - 1
        elif nws > 0:
            pos += nws
        else:
            pos += 1
        if pos > prev:
            out[k] = pos - prev
            k += 1
        prev = pos
    return k


def _afmoe_digits(piece: str) -> list[int]:
    """llama.cpp ``unicode_regex_split_custom_afmoe``: each run of digits is cut into a leading
    1-2 digit group (length mod 3) and groups of 3; the text before a run stays joined to the
    run's first group, as llama.cpp's loop does."""
    fl = flags_of(piece)
    num = ((fl & F_NUMBER) != 0).tolist()
    n = len(num)
    out: list[int] = []
    prev = 0

    def add(end: int) -> None:
        nonlocal prev
        if end - prev > 0:
            out.append(end - prev)
        prev = end

    pos = 0
    while pos < n:
        if num[pos]:
            start = pos
            while pos < n and num[pos]:
                pos += 1
            count = pos - start
            cur = start
            rem = count % 3
            if rem:
                add(cur + rem)
                cur += rem
            while cur < start + count:
                add(cur + 3)
                cur += 3
            continue
        pos += 1
    if prev < n:
        add(n)
    return out


def _newlines(piece: str) -> list[int]:
    """``[^\\n]+|[\\n]+``: runs of newlines and runs of everything else."""
    return [len(m) for m in regex.findall(r"\n+|[^\n]+", piece)]


# ---------------------------------------------------------------------------------------------
# the splitter
# ---------------------------------------------------------------------------------------------

@dataclass
class _Step:
    kind: str  # "custom", "collapsed", "wide"
    rx: regex.Pattern[str] | None = None
    fn: Callable[[str], list[int]] | None = None
    rx_fast: regex.Pattern[str] | None = None  # custom regexes: for texts without risky code points
    cache: dict[str, list[int]] = field(default_factory=dict)
    cache_fast: dict[str, list[int]] = field(default_factory=dict)


_STEP_CACHE = 1 << 16  # pieces remembered per step


@dataclass
class Splitter:
    """Runs one pre-tokenizer's regex list the way llama.cpp's ``unicode_regex_split`` does."""

    exprs: Sequence[str]
    steps: list[_Step] = field(init=False)

    def __post_init__(self) -> None:
        self.steps = [self._step(e) for e in self.exprs]

    @staticmethod
    def _step(expr: str) -> _Step:
        if expr == RE_GPT2:
            gpt2 = RE_GPT2 + "|\\s+"  # llama.cpp's loop also takes a whitespace run the regex leaves
            return _Step("custom", rx=_exact(gpt2), rx_fast=_fast(gpt2))
        if expr in (RE_LLAMA3_I, RE_LLAMA3):
            return _Step("custom", rx=_exact(RE_LLAMA3), rx_fast=_fast(RE_LLAMA3))
        if expr == RE_QWEN2:
            return _Step("custom", rx=_exact(RE_QWEN2), rx_fast=_fast(RE_QWEN2))
        if expr == RE_QWEN35:
            return _Step("custom", rx=_exact(RE_QWEN35), rx_fast=_fast(RE_QWEN35))
        if expr == RE_KIMI:
            return _Step("custom", fn=_kimi_k2)
        if expr in (RE_AFMOE_DIGITS, RE_TINY_AYA_DIGITS):
            return _Step("custom", fn=_afmoe_digits)
        if expr == RE_NEWLINES:
            return _Step("custom", fn=_newlines)
        if _uses_categories(expr):
            return _Step("collapsed", rx=regex.compile(_ecma_to_python(_collapse_regex(expr)), regex.V0 | regex.ASCII))
        return _Step("wide", rx=regex.compile(_ecma_to_python(expr), regex.V0 | regex.ASCII))

    def clear_cache(self) -> None:
        """Forget the cuts remembered per piece."""
        for st in self.steps:
            st.cache.clear()
            st.cache_fast.clear()

    def split(self, text: str) -> list[str]:
        """The words of ``text`` (before byte encoding), in order."""
        lengths = [len(text)]
        views: dict[str, str] = {}
        safe = text.isascii() or not _risky()[codepoints(text)].any()
        for st in self.steps:
            if st.kind == "custom":
                src = text
            elif st.kind == "collapsed":
                src = views.get("c") or views.setdefault("c", collapse(text))
            else:
                src = views.get("w") or views.setdefault("w", _wide(text))
            new: list[int] = []
            start = 0
            fn = st.fn
            rx = st.rx_fast if safe and st.rx_fast is not None else st.rx
            # words repeat: a piece's cut is kept (per step and class set; a pure function of the piece)
            cache = st.cache_fast if rx is st.rx_fast else st.cache
            if len(cache) > _STEP_CACHE:
                cache.clear()
            get = cache.get
            for ln in lengths:
                piece = src[start:start + ln]
                start += ln
                cut = get(piece)
                if cut is None:
                    cut = cache[piece] = fn(piece) if fn is not None else _split_regex(rx, piece)  # type: ignore[arg-type]
                new += cut
            lengths = new
        out = []
        start = 0
        for ln in lengths:
            out.append(text[start:start + ln])
            start += ln
        return out


# ---------------------------------------------------------------------------------------------
# llama.cpp's table: pre-tokenizer type -> regexes, and tokenizer.ggml.pre name -> type + flags
# ---------------------------------------------------------------------------------------------

# deepseek-llm's letter class, as llama.cpp writes it (code point ranges, not \p{L})
DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_L3_BODY = "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
_DS3 = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_GPT4O_WORDS = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + _CONTR + "?"
                "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + _CONTR + "?")
_UPPERISH = "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]"
_LOWERISH = "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"
_CASED_WORDS = ("[^\\r\\n\\p{L}\\p{N}]?" + _UPPERISH + "*" + _LOWERISH + "+" + _CONTR + "?"
                "|[^\\r\\n\\p{L}\\p{N}]?" + _UPPERISH + "+" + _LOWERISH + "*" + _CONTR + "?")
_TAIL = "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"

PRE_TYPE_REGEXES: dict[str, list[str]] = {
    "llama3": [RE_LLAMA3],
    "jais2": [_CONTR + _L3_BODY + "|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)"
              "|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}"],
    "dbrx": [RE_LLAMA3],
    "deepseek-llm": [
        "[\r\n]",
        "\\s?[" + DEEPSEEK_LETTERS + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}+",
    ],
    "deepseek3-llm": ["\\p{N}{1,3}", _CJK_KANA, _DS3],
    "spark2_5": ["\\p{N}{1,3}", _CJK_KANA,
                 "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
                 "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+", "\\p{N}"],
    "youtu": ["[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
              "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
              _CASED_WORDS + "|\\p{N}" + _TAIL],
    "deepseek-coder": ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}"],
    "falcon": ["[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"],
    "starcoder": ["\\p{N}", RE_GPT2],
    "gpt2": [RE_GPT2],
    "qwen2": [RE_QWEN2],
    "qwen35": [RE_QWEN35],
    "poro": [" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"],
    "chatglm4": [RE_LLAMA3],
    "viking": [" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+", "\\p{N}"],
    "tekken": ["[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+"
               "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}" + _TAIL],
    "chameleon": ["<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
                  "[\\p{P}!-/:-@\\[-`{-~]", RE_GPT2],
    "gpt4o": [_GPT4O_WORDS + "|\\p{N}{1,3}" + _TAIL],
    "granite-emb-multi": [
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+" + _CONTR + "?"
        "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*" + _CONTR + "?"
        "|\\p{N}{1,3}" + _TAIL],
    "tiny_aya": [RE_TINY_AYA_DIGITS, _CASED_WORDS + "|\\p{N}{1,3}" + _TAIL],
    "kimi-k2": [RE_KIMI],
    "superbpe": ["\\p{N}+", "(?=(\\d{3})+(?!\\d))"],
    "bailingmoe": ["'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"],
    "seed-coder": [_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+"
                   "|\\s+(?!\\S)|\\s+"],
    "ufakzeka": ["[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "grok-2": [RE_QWEN2],
    "afmoe": [RE_AFMOE_DIGITS,
              "[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
              "\u0e00-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
              "\u1100-\u11ff]+",
              "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
              "| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "laguna": [RE_NEWLINES, RE_QWEN2],
    "exaone-moe": [_CONTR + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
                   "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"],
    "gemma4": [RE_NEWLINES],
    "sarvam-moe": [RE_NEWLINES],
    "minicpm5": ["\\p{N}{1,3}", _CONTR + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
    "whitespace": ["\\S+"],
    "default": ["[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"],
}
# types whose words are raw UTF-8 (SPM-style BPE), not GPT-2 byte-level characters
RAW_UTF8_TYPES = frozenset(["gemma4", "sarvam-moe", "whitespace"])


@dataclass(frozen=True)
class PreSpec:
    """What ``tokenizer.ggml.pre`` selects: the regex type and llama.cpp's per-name flags."""

    type: str
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    no_bos: bool = False
    escape_whitespaces: bool = False


PRE_NAMES: dict[str, PreSpec] = {}


def _reg(names: Sequence[str], type_: str, **kw: bool) -> None:
    for nm in names:
        PRE_NAMES[nm] = PreSpec(type_, **kw)


# llama.cpp llama_vocab::impl::load, name by name
_reg(["default"], "default")
_reg(["minicpm5"], "minicpm5", ignore_merges=True)
_reg(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
     "llama3", ignore_merges=True, add_bos=True)
_reg(["deepseek-llm"], "deepseek-llm", clean_spaces=False)
_reg(["deepseek-coder"], "deepseek-coder", clean_spaces=False)
_reg(["deepseek-v3"], "deepseek3-llm", clean_spaces=False)
_reg(["spark2_5"], "spark2_5", clean_spaces=False)
_reg(["youtu"], "youtu", clean_spaces=False, ignore_merges=True)
_reg(["falcon"], "falcon")
_reg(["mpt"], "gpt2")
_reg(["starcoder"], "starcoder")
_reg(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert"], "gpt2")
_reg(["jais-2"], "jais2")
_reg(["gemma4", "granite-embed-multi-311m"], "gemma4", escape_whitespaces=True)
_reg(["sarvam-moe"], "sarvam-moe", escape_whitespaces=True, clean_spaces=False)
_reg(["jina-v1-en", "jina-v2-code", "roberta-bpe"], "gpt2")
_reg(["whitespace"], "whitespace")
_reg(["refact"], "starcoder")
_reg(["command-r"], "starcoder", clean_spaces=False)
_reg(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], "qwen2", clean_spaces=False)
_reg(["qwen35"], "qwen35", clean_spaces=False)
_reg(["stablelm2"], "qwen2")
_reg(["olmo"], "gpt2")
_reg(["dbrx"], "dbrx")
_reg(["smaug-bpe"], "dbrx")
_reg(["poro-chat"], "poro", clean_spaces=False)
_reg(["chatglm-bpe"], "chatglm4", no_bos=True)
_reg(["glm4", "glm5"], "chatglm4", no_bos=True, ignore_merges=True)
_reg(["viking"], "viking", clean_spaces=False)
_reg(["jais"], "gpt2")
_reg(["tekken"], "tekken", clean_spaces=False, ignore_merges=True, add_bos=True)
_reg(["smollm"], "starcoder", clean_spaces=False)
_reg(["codeshell"], "starcoder")
_reg(["bloom"], "poro")
_reg(["gpt3-finnish"], "poro")
_reg(["exaone"], "starcoder")
_reg(["exaone4"], "gpt2")
_reg(["exaone-moe"], "exaone-moe")
_reg(["chameleon"], "chameleon", add_bos=True, clean_spaces=False)
_reg(["minerva-7b"], "starcoder")
_reg(["megrez"], "qwen2")
_reg(["gpt-4o", "llama4", "kanana2", "talkie"], "gpt4o", clean_spaces=False)
_reg(["granite-embed-multi-97m"], "granite-emb-multi", clean_spaces=False, ignore_merges=True)
_reg(["tiny_aya", "cohere2moe"], "tiny_aya", clean_spaces=False)
_reg(["superbpe"], "superbpe", clean_spaces=False)
_reg(["trillion"], "gpt2", clean_spaces=False)
_reg(["granite-docling"], "gpt2", clean_spaces=False)
_reg(["bailingmoe", "bailingmoe2", "llada-moe"], "bailingmoe", clean_spaces=False)
_reg(["seed-coder"], "seed-coder", clean_spaces=False)
_reg(["hunyuan"], "qwen2", clean_spaces=False)
_reg(["hunyuan-dense"], "deepseek3-llm", clean_spaces=False)
_reg(["hy_v4"], "deepseek3-llm", clean_spaces=False)
_reg(["joyai-llm"], "deepseek3-llm", clean_spaces=False)
_reg(["kimi-k2"], "kimi-k2", clean_spaces=False)
_reg(["ufakzeka"], "ufakzeka", clean_spaces=False)
_reg(["grok-2"], "grok-2", clean_spaces=False)
_reg(["afmoe"], "afmoe", clean_spaces=False)
_reg(["laguna"], "laguna", clean_spaces=False)
_reg(["minimax-m2"], "gpt4o", clean_spaces=False)
_reg(["solar-open"], "qwen2", clean_spaces=False)
_reg(["mellum2"], "starcoder")


@functools.cache
def splitter(type_: str) -> Splitter:
    """The (cached) splitter of a pre-tokenizer type."""
    return Splitter(PRE_TYPE_REGEXES[type_])
