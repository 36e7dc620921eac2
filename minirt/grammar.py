"""Constrained sampling: llama.cpp GBNF grammars, Lark, JSON Schema, JSON-object mode and regex.

The engine is llguidance (the grammar library llama.cpp itself can build with), chosen over
xgrammar after measuring both on Qwen2.5's 151k-token vocabulary (``bench/grammar_engines.py``,
nested JSON schema, 2026-12-01, shared 2-core EPYC): the median mask per token took 0.06 ms with
llguidance and 0.03 ms with xgrammar, both negligible next to a ~10 ms decode step; compiling
the schema took ~1 ms with llguidance and 57 ms with xgrammar (paid per request); llguidance
reads llama.cpp's GBNF as is, and it is one wheel without dependencies while xgrammar's wheel
requires torch, transformers and triton.

One :class:`GrammarEngine` per model holds the llguidance tokenizer, built once from minirt's own
vocabulary (the bytes of every token id; control tokens marked as special). A request's grammar
becomes a :class:`Constraint` (compiled and validated on the caller's thread, so a bad grammar
raises :class:`minirt.GrammarError` there); every sequence gets its own :class:`Matcher`.

The mask for the next token is computed while the model computes that token's logits: before a
forward pass, :class:`MaskWorker` hands each constrained sequence's last sampled token to a
background thread, which feeds it to the matcher and fills the next mask. The forward pass
(native kernels via cffi, numpy) and llguidance both release the GIL, so the two overlap and
sampling only waits when the mask took longer than the forward pass.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import GrammarError

if TYPE_CHECKING:  # pragma: no cover
    from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Whitespace allowed between JSON tokens, as llama.cpp's json-schema-to-grammar allows it (nothing,
# one space, or one or two newlines and an indent): bounded, so a small model cannot loop on
# blank lines while the schema waits for the next key.
JSON_WHITESPACE = r"(?: |\n\n?[ \t]{0,20})?"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise GrammarError(f"constrained sampling needs the llguidance package ({e})") from None
    return llguidance


def _is_special_piece(attr: int, piece: bytes) -> bool:
    """Whether the grammar engine sees a token as special (never text): control tokens, and
    user-defined ones written like markup (<tool_call>), as llama.cpp's llguidance glue decides."""
    from .tokenizer import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED

    return bool(attr & (ATTR_CONTROL | ATTR_UNKNOWN)) or bool(
        attr & ATTR_USER_DEFINED and piece.startswith(b"<") and piece.endswith(b">") and len(piece) > 2)


def lark_marker(tk: Tokenizer, text: str) -> str:
    """``text`` as a Lark grammar must name it: the special token it is, or a quoted string."""
    tid = tk.token_to_id(text)
    if tid is not None and _is_special_piece(tk.token_attr(tid), tk.token_to_piece(tid)):
        return f"<[{tid}]>"
    return json.dumps(text)


class _Vocab:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, EOS, special ids, and encoding."""

    def __init__(self, tk: Tokenizer, n_vocab: int) -> None:
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(tk.n_vocab):
            piece = tk.token_to_piece(i)
            # llguidance marks special tokens with a leading 0xFF byte (they never match text; a
            # Lark grammar names them as <[id]>)
            if _is_special_piece(tk.token_attr(i), piece):
                tokens.append(b"\xff" + piece)
                special.append(i)
            else:
                tokens.append(piece)
        tokens.extend(b"" for _ in range(n_vocab - tk.n_vocab))  # padding rows of the output matrix
        self.tokens = tokens
        self.special_token_ids = special
        eog = sorted(tk.eog_ids)
        self.eos_token_id = tk.eos_id if tk.eos_id is not None else (eog[0] if eog else 0)
        self.bos_token_id = tk.bos_id
        self.eog = eog or [self.eos_token_id]
        self._tk = tk

    def __call__(self, s: bytes) -> list[int]:
        ids = self._tk.encode(s.decode("utf-8", "replace"), add_special=False, parse_special=False)
        if b"".join(self.tokens[i] for i in ids) == s:
            return ids
        # the tokenizer changed the bytes (SentencePiece's space prefix, invalid UTF-8): the engine
        # needs tokens spelling exactly ``s`` (it forces them), so match the longest pieces instead
        return self._greedy(s)

    def _greedy(self, s: bytes) -> list[int]:
        if not hasattr(self, "_by_piece"):
            self._by_piece = {t: i for i, t in enumerate(self.tokens) if t and not t.startswith(b"\xff")}
            self._longest = max(map(len, self._by_piece), default=1)
        out, i = [], 0
        while i < len(s):
            for n in range(min(self._longest, len(s) - i), 0, -1):
                tid = self._by_piece.get(s[i:i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                raise GrammarError(f"the vocabulary cannot spell byte {s[i]:#04x}")
        return out


class GrammarEngine:
    """The llguidance tokenizer of one model (built on first use, ~1 s for 150k tokens)."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = int(n_vocab)
        self._ll: Any = None
        self._lock = threading.Lock()

    def lltokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                llg = _llg()
                v = _Vocab(self.tokenizer, self.n_vocab)
                # every end-of-generation id counts as EOS: a finished grammar may end with any
                self._ll = llg.LLTokenizer(llg.TokenizerWrapper(v), n_vocab=self.n_vocab, eos_token=v.eog)
            return self._ll


# ---------------------------------------------------------------------------------------------
# request options → llguidance grammar
# ---------------------------------------------------------------------------------------------

def _schema_of(obj: Any, what: str) -> Any:
    """A JSON schema given as a dict, a JSON string, or a pydantic model class."""
    if hasattr(obj, "model_json_schema") and callable(obj.model_json_schema):
        return obj.model_json_schema()
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{what} is not valid JSON: {e}") from None
    if isinstance(obj, bool):
        return obj  # true / false are valid (if odd) schemas
    if not isinstance(obj, Mapping):
        raise GrammarError(f"{what} must be a JSON schema object, got {type(obj).__name__}")
    return dict(obj)


def _from_response_format(rf: Any) -> tuple[str, Any] | None:
    """OpenAI / llama.cpp ``response_format`` → ``(kind, source)``; None for plain text."""
    if rf is None:
        return None
    if hasattr(rf, "model_json_schema"):
        return "json_schema", rf.model_json_schema()
    if not isinstance(rf, Mapping):
        raise GrammarError(f"response_format must be an object with a 'type', got {type(rf).__name__}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")  # llama.cpp accepts a schema here as well
        return "json_schema", _schema_of(schema, "response_format.schema") if schema is not None else {"type": "object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise GrammarError("response_format.json_schema must be an object with a 'schema'")
        if "schema" not in js:
            raise GrammarError("response_format.json_schema.schema is missing")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError(f"response_format.json_schema.strict must be a boolean, got {strict!r}")
        return "json_schema", _schema_of(js["schema"], "response_format.json_schema.schema")
    if kind == "regex":
        pattern = rf.get("regex", rf.get("pattern"))
        if not isinstance(pattern, str):
            raise GrammarError("response_format of type 'regex' needs a 'regex' string")
        return "regex", pattern
    if kind == "grammar":
        g = rf.get("grammar")
        if not isinstance(g, str):
            raise GrammarError("response_format of type 'grammar' needs a 'grammar' string")
        return "grammar", g
    raise GrammarError(f"response_format type {kind!r} is not one of text, json_object, json_schema, regex, grammar")


def grammar_source(grammar: Any = None, json_schema: Any = None, response_format: Any = None) -> tuple[str, Any] | None:
    """Which constraint a request asks for, as ``(kind, source)``; at most one may be given."""
    given = [(k, v) for k, v in (("grammar", grammar), ("json_schema", json_schema)) if v is not None]
    rf = _from_response_format(response_format)
    if rf is not None:
        given.append(("response_format", rf))
    if len(given) > 1:
        both = " and ".join(k for k, _ in given)
        raise GrammarError(f"give one of grammar, json_schema, response_format, not {both}")
    if not given:
        return None
    name, v = given[0]
    if name == "response_format":
        return v
    if name == "json_schema":
        return "json_schema", _schema_of(v, "json_schema")
    if not isinstance(v, str) or not v.strip():
        raise GrammarError("grammar must be a non-empty GBNF (or Lark) grammar string")
    return "grammar", v


def to_llguidance(kind: str, source: Any) -> str:
    """``(kind, source)`` → llguidance's grammar JSON; raises GrammarError naming the problem."""
    llg = _llg()
    try:
        if kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(source), defaults=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(source)
        if kind == "grammar":
            from llguidance.gbnf_to_lark import any_to_lark

            return llg.LLMatcher.grammar_from_lark(any_to_lark(source))
        if kind == "lark":
            return llg.LLMatcher.grammar_from_lark(source)
    except GrammarError:
        raise
    except Exception as e:  # the converters raise ValueError / AssertionError / their own types
        raise GrammarError(f"invalid {kind.replace('_', ' ')}: {e}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


class Constraint:
    """A compiled grammar of one request; :meth:`matcher` gives each sequence its own state."""

    def __init__(self, engine: GrammarEngine, kind: str, source: Any) -> None:
        self.engine = engine
        self.kind = kind
        self.source = source
        self.grammar = to_llguidance(kind, source)
        llg = _llg()
        err, msgs = llg.LLMatcher.validate_grammar_with_warnings(self.grammar, engine.lltokenizer())
        if err:
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {msgs[0] if msgs else 'rejected'}")
        for m in msgs:
            log.info("grammar warning: %s", m)

    def matcher(self) -> Matcher:
        llg = _llg()
        m = llg.LLMatcher(self.engine.lltokenizer(), self.grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {m.get_error()}")
        return Matcher(m, self.engine.n_vocab)


def compile_constraint(engine: GrammarEngine, grammar: Any = None, json_schema: Any = None,
                       response_format: Any = None) -> Constraint | None:
    """The :class:`Constraint` a request's options ask for, or None when it has none."""
    src = grammar_source(grammar, json_schema, response_format)
    return None if src is None else Constraint(engine, *src)


class Matcher:
    """One sequence's grammar state and its mask for the next token.

    ``advance(token)`` feeds the last sampled token (None at the start) and computes the mask of
    the next step; it runs on the mask thread. ``allowed()`` waits for it and returns the boolean
    mask (V,) the sampler applies.
    """

    def __init__(self, ll: Any, n_vocab: int) -> None:
        self.ll = ll
        self.n_vocab = n_vocab
        self.words = np.zeros((1, (n_vocab + 31) // 32), dtype=np.int32)
        self._ok: np.ndarray | None = None
        self._future: Future[None] | None = None

    def consume(self, token: int) -> None:
        if not self.ll.consume_token(int(token)):
            raise GrammarError(f"the grammar rejected token {int(token)}: {self.ll.get_error() or 'not allowed'}")

    def compute(self, token: int | None) -> None:
        """Consume ``token`` (unless None) and compute the next mask (blocking)."""
        if token is not None and self.ll.is_stopped() and self._ok is not None:
            return  # the grammar is complete: only end-of-generation stays allowed (ignore_eos)
        if token is not None:
            self.consume(token)
        if self.ll.is_error():
            raise GrammarError(f"grammar matcher failed: {self.ll.get_error()}")
        w = self.words[0]
        self.ll.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)  # drops the GIL
        ok = np.unpackbits(w.view(np.uint8), bitorder="little")[: self.n_vocab].view(bool)
        if not ok.any():
            raise GrammarError(f"the grammar allows no next token: {self.ll.get_error() or 'dead end'}")
        self._ok = ok

    def advance(self, token: int | None, worker: MaskWorker | None) -> None:
        """Start :meth:`compute` on ``worker``'s thread (inline when None)."""
        if worker is None:
            self.compute(token)
        else:
            self._future = worker.submit(self.compute, token)

    def allowed(self) -> np.ndarray:
        """The mask of the next token: True where the grammar allows it (waits for the worker)."""
        f, self._future = self._future, None
        if f is not None:
            f.result()
        if self._ok is None:
            self.compute(None)
        assert self._ok is not None
        return self._ok

    def pending(self) -> bool:
        return self._future is not None

    def is_accepting(self) -> bool:
        return bool(self.ll.is_accepting())


class MaskWorker:
    """The background thread that computes grammar masks during forward passes."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Any, *args: Any) -> Future[None]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minirt-grammar")
            return self._pool.submit(fn, *args)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def options(kw: dict[str, Any]) -> dict[str, Any]:
    """Pop the constraint options (grammar, json_schema, response_format) out of ``kw``."""
    return {k: kw.pop(k) for k in ("grammar", "json_schema", "response_format") if k in kw}

