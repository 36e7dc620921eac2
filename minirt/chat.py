"""Chat templates: messages → prompt text, from the GGUF's ``tokenizer.chat_template`` or a built-in.

Templates are Jinja2, rendered the way Hugging Face ``transformers`` renders them
(``ImmutableSandboxedEnvironment`` with ``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block, ``tojson`` that writes plain JSON, globals
``raise_exception`` and ``strftime_now``; variables ``messages``, ``tools``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` and whatever
the caller adds).

A template is untrusted input (it comes with a downloaded model file or from a request), so:

* the sandbox refuses Python internals: ``__class__``, ``__globals__``, any ``_private``
  attribute, mutating ``messages``; names that are not provided (``os``, ``open`` ...) are
  undefined and calling them fails;
* rendering has a deadline: a trace function on the rendering thread checks the clock on every
  line the template (and the Jinja code it calls) executes, so a loop without end stops;
* output has a size limit, enforced on the streamed output, on ``*`` / ``+`` / ``%`` / ``**`` of
  strings, lists and numbers, and on the string methods and filters that can blow up
  (``center``, ``replace``, ``join``, ``format`` widths ...) *before* they allocate.

Every failure is a :class:`minirt.TemplateError` whose message says what went wrong; a malformed
``messages`` / ``tools`` argument is a :class:`minirt.InvalidRequestError`.

Built-in templates (used when the GGUF has none, or by name): ``gemma``, ``chatml``, ``llama3``,
``llama2`` (and llama.cpp's variants ``llama2-sys``, ``llama2-sys-bos``, ``llama2-sys-strip``),
each rendering exactly what llama.cpp's built-in template of that name renders. BOS is not part
of the rendered text for these: tokenizing the prompt with ``add_special=True`` adds it.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import InvalidRequestError, MinirtError, TemplateError

if TYPE_CHECKING:  # pragma: no cover
    from .gguf import GGUFFile
    from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

_C_SPACE = " \t\n\v\f\r"  # llama.cpp's trim() strips C isspace()

# ---------------------------------------------------------------------------------------------
# built-in templates (llama.cpp's llm_chat_apply_template, written as Jinja)
# ---------------------------------------------------------------------------------------------

_CHATML = r"""{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

# Gemma has no system role: system text (trimmed, concatenated) opens the next user turn.
_GEMMA = r"""{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- set ns.system = ns.system + (message['content'] | c_trim) -%}
{%- else -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{- '<start_of_turn>' + role + '\n' -}}
{%- if ns.system and role != 'model' -%}{{- ns.system + '\n\n' -}}{%- set ns.system = '' -%}{%- endif -%}
{{- (message['content'] | c_trim) + '<end_of_turn>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"""

_LLAMA3 = r"""{%- for message in messages -%}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | c_trim) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"""


def _llama2(system: bool, bos_in_history: bool, strip: bool) -> str:
    content = "(message['content'] | c_trim)" if strip else "message['content']"
    sys_part = (("{{- '<<SYS>>\\n' + %s + '\\n<</SYS>>\\n\\n' -}}" % content) if system
                else ("{{- %s + '\\n' -}}" % content))
    turn = "'<s>[INST] '" if bos_in_history else "'[INST] '"
    return (
        "{%- set ns = namespace(inside=true) -%}\n"
        "{{- '[INST] ' -}}\n"
        "{%- for message in messages -%}\n"
        "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- " + turn + " -}}{%- endif -%}\n"
        "{%- if message['role'] == 'system' -%}" + sys_part + "\n"
        "{%- elif message['role'] == 'user' -%}{{- " + content + " + ' [/INST]' -}}\n"
        "{%- else -%}{{- " + content + " + '</s>' -}}{%- set ns.inside = false -%}\n"
        "{%- endif -%}\n"
        "{%- endfor -%}"
    )


BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "gemma": _GEMMA,
    "llama3": _LLAMA3,
    "llama2": _llama2(system=False, bos_in_history=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_in_history=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_in_history=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_in_history=False, strip=True),
}
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding")
_LLAMA2_ARCHS = ("llama", "mistral")


def choose_builtin(architecture: str | None, tokenizer: Tokenizer | None) -> str:
    """The built-in template for a model without one: from its architecture and special tokens."""
    has = (lambda t: tokenizer.token_to_id(t) is not None) if tokenizer is not None else (lambda t: False)
    arch = architecture or ""
    if arch in _GEMMA_ARCHS or has("<start_of_turn>"):
        return "gemma"
    if has("<|start_header_id|>") and has("<|eot_id|>"):
        return "llama3"
    if has("<|im_start|>"):
        return "chatml"
    if arch in _LLAMA2_ARCHS and tokenizer is not None and tokenizer.vocab_type == "spm":
        return "llama2-sys-bos"
    return "chatml"


# ---------------------------------------------------------------------------------------------
# sandbox with a clock and a size budget
# ---------------------------------------------------------------------------------------------

class _Abort(BaseException):
    """Raised inside the template to stop it (BaseException so template code cannot swallow it)."""


class _Budget(threading.local):
    """Per-thread limits of the render in progress."""

    deadline: float = float("inf")
    max_chars: int = 1 << 62
    active: bool = False

    def check_len(self, n: int, what: str) -> None:
        if self.active and n > self.max_chars:
            raise TemplateError(f"chat template output too large: {what} would make "
                                f"{'more than ' + str(self.max_chars) if n == self.max_chars + 1 else n} "
                                f"characters (limit {self.max_chars})")

    def check_size(self, x: Any, what: str, mode: str = "str", factor: int = 1, **kw: Any) -> None:
        """Refuse before the work when turning ``x`` into text (``mode``, see :func:`_size_of`),
        times ``factor`` (escaping), would pass the limit."""
        if self.active:
            lim = self.max_chars // max(1, factor)
            n = _size_of(x, lim, mode, **kw)
            self.check_len(self.max_chars + 1 if n > lim else n * factor, what)

    def check_int(self, bits: int, what: str) -> None:
        if self.active and bits > MAX_INT_BITS:
            raise TemplateError(f"chat template computes an integer too large: {what} would have about "
                                f"{bits} bits (limit {MAX_INT_BITS})")


_MAX_URLIZE = 4096  # characters the urlize filter may read


def _estimate_str_call(s: str, name: str, args: tuple, kwargs: dict,
                       limit: int = 1 << 62) -> tuple[int, tuple] | None:
    """Size of ``s.<name>(*args)`` before computing it (and args with iterables materialised)."""
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = s.count(old) if old else len(s) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        return len(s) + count * max(0, len(new) - len(old)), args
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        return max(len(s), args[0]), args
    if name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        return len(s) * max(1, tab if isinstance(tab, int) else 8), args
    if name == "join" and args:
        items = list(args[0])
        total = sum(len(x) for x in items if isinstance(x, str)) + len(s) * max(0, len(items) - 1)
        return total, (items,) + tuple(args[1:])
    if name == "encode":
        return 4 * len(s), args
    if name == "format":
        return _estimate_format(s, args, kwargs, limit), args
    if name == "format_map" and args and isinstance(args[0], Mapping):
        return _estimate_format(s, (), args[0], limit), args
    if name == "translate" and args:
        table = args[0]
        vals = table.values() if isinstance(table, Mapping) else table if isinstance(table, (list, tuple, str)) else ()
        longest = max((len(v) for v in vals if isinstance(v, str)), default=1)
        return len(s) * max(1, longest), args
    return None


# ---------------------------------------------------------------------------------------------
# sizes before the work: one C call (str(), json.dumps, str.format, **) cannot be interrupted by
# the deadline, so what it would produce is estimated first, at a cost bounded by the limit
# ---------------------------------------------------------------------------------------------

MAX_INT_BITS = 1 << 16  # integers a template may compute (about 19,700 digits)
_FLOAT_CHARS = 330  # the longest float in positional notation ("%f" of 1.8e308) and a sign
_MAX_SPEC_DIGITS = 9  # a width or precision of a billion or more is refused outright


def _int_chars(v: int) -> int:
    return v.bit_length() * 31 // 100 + 2  # decimal digits of v (log10 2 < 0.31) and a sign


def _size_of(x: Any, limit: int, mode: str = "str", indent: int = 0, seps: tuple[int, int] = (2, 2)) -> int:
    """An upper bound on the length of ``str(x)`` (``mode="str"``; ``"repr"``), of
    ``json.dumps(x, indent=indent)`` (``"json"``, ``seps``: lengths of the item and key
    separators) or ``pprint.pformat(x)`` (``"pprint"``), computed without building it. Stops as
    soon as the bound passes ``limit`` (returns it then); every object visited adds at least one
    character, so the walk visits at most ``limit`` objects."""
    from jinja2.runtime import Undefined
    from jinja2.utils import Namespace

    total = 0
    item_sep, key_sep = seps
    stack: list[tuple[Any, int, int]] = [(x, 0, 0)]  # (object, depth, column)
    top = True
    while stack:
        obj, depth, col = stack.pop()
        if mode == "pprint":
            total += col + 1  # a line of its own, indented to its column
        elif indent and depth:
            total += 1 + indent * depth  # newline and indentation
        if isinstance(obj, str):
            n = len(obj)
            if top and mode == "str":
                total += n
            elif mode == "json":
                total += n * (2 if obj.isascii() and obj.isprintable() else 12) + 2
            else:
                total += n * (2 if obj.isprintable() else 10) + 3
        elif isinstance(obj, bool) or obj is None:
            total += 5
        elif isinstance(obj, int):
            total += _int_chars(obj)
        elif isinstance(obj, float):
            total += 24
        elif isinstance(obj, (bytes, bytearray)):
            total += 4 * len(obj) + 3
        elif isinstance(obj, Undefined):
            total += 0
        elif isinstance(obj, (Mapping, Namespace)):
            attrs = obj if isinstance(obj, Mapping) else object.__getattribute__(obj, "_Namespace__attrs")
            items = attrs.items()
            total += 14 + (indent * depth + 1 if indent else 0)
            for k, v in items:
                total += item_sep + key_sep
                ksize = _size_of(k, limit, "repr" if mode != "json" else "json") if not isinstance(k, (int, float)) \
                    else 24
                total += ksize
                if total > limit:
                    return limit + 1
                stack.append((v, depth + 1, col + ksize + key_sep + 1))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            total += 4 + (indent * depth + 1 if indent else 0) + item_sep * len(obj)
            if total > limit:
                return limit + 1
            stack.extend((v, depth + 1, col + 1) for v in obj)
        else:
            total += 100  # a function, a macro, a loop object ...: a short fixed repr
        top = False
        if total > limit:
            return limit + 1
    return total


_PCT_RE = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)")
_FMT_DIGITS = re.compile(r"\d+")


def _spec_number(digits: str) -> int:
    if len(digits) > _MAX_SPEC_DIGITS:
        raise TemplateError("chat template formats with a width or precision too large")
    return int(digits)


def _value_chars(v: Any, conv: str, limit: int) -> int:
    if conv in "diouxXc":
        return _int_chars(v) * 2 if isinstance(v, int) else 24
    if conv in "eEfFgG%":
        return _FLOAT_CHARS + (_int_chars(v) if isinstance(v, int) else 0)
    return _size_of(v, limit, "repr" if conv in "ra" else "str")


def _estimate_percent(fmt: str, args: Any, limit: int) -> int:
    """An upper bound on the length of ``fmt % args``."""
    total = len(fmt)
    pos_args = list(args) if isinstance(args, tuple) else [args]
    k = 0

    def take() -> Any:
        nonlocal k
        v = pos_args[k] if k < len(pos_args) else None
        k += 1
        return v

    for m in _PCT_RE.finditer(fmt):
        key, width, prec, conv = m.groups()
        if conv == "%":
            continue
        w = p = 0
        if width == "*":
            v = take()
            w = abs(v) if isinstance(v, int) else 0
        elif width:
            w = _spec_number(width)
        if prec == "*":
            v = take()
            p = abs(v) if isinstance(v, int) else 0
        elif prec:
            p = _spec_number(prec)
        if key is not None:
            value = args.get(key) if isinstance(args, Mapping) else None
        else:
            value = take()
        total += w + p + _value_chars(value, conv, limit)
        if total > limit:
            return limit + 1
    return total


def _estimate_format(fmt: str, args: tuple, kwargs: Mapping[str, Any], limit: int) -> int:
    """An upper bound on the length of ``fmt.format(*args, **kwargs)``."""
    import string

    total = 0
    auto = 0
    sizes: dict[int, int] = {}

    def field(name: str, conv: str | None) -> tuple[int, Any]:
        nonlocal auto
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root == "":
            value, key = (args[auto] if auto < len(args) else None), -1 - auto
            auto += 1
        elif root.isdigit():
            i = _spec_number(root)
            value, key = (args[i] if i < len(args) else None), -1 - i
        else:
            value = kwargs.get(root)
            key = id(value)
        if key not in sizes:
            sizes[key] = max(100, _size_of(value, limit, "repr" if conv in ("r", "a") else "str"))
        return sizes[key] + (_FLOAT_CHARS if isinstance(value, (int, float)) else 0), value

    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # malformed: str.format raises its own error
    for literal, name, spec, conv in parsed:
        total += len(literal)
        if name is None:
            continue
        total += field(name, conv)[0]
        if spec:
            for nested in re.findall(r"\{([^{}]*)\}", spec):
                n, value = field(nested.split("!")[0].split(":")[0], None)
                total += n
                if isinstance(value, int):
                    if abs(value) >= 10 ** _MAX_SPEC_DIGITS:
                        raise TemplateError("chat template formats with a width or precision too large")
                    total += abs(value)
                elif isinstance(value, str):  # a spec given as a string: its width and precision
                    for digits in _FMT_DIGITS.findall(value):
                        total += _spec_number(digits)
            for digits in _FMT_DIGITS.findall(re.sub(r"\{[^{}]*\}", "", spec)):
                total += _spec_number(digits)
        if total > limit:
            return limit + 1
    return total


def _estimate_wordwrap(s: str, width: int, wrapstring: str) -> int:
    lines = min(len(s), len(s.split()) + len(s) // max(1, width) + s.count("\n")) + 1
    return len(s) + lines * len(wrapstring)


def _make_env(budget: _Budget) -> Any:
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class CodeGen(CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:
            # the "~" operator: joined through Env.checked_concat so its size is checked first
            self.write("environment.checked_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "%", "**"])
        code_generator_class = CodeGen

        def concat(self, parts: Any) -> str:  # bodies of macros, {% set %} blocks, filter blocks
            parts = list(parts)
            budget.check_len(sum(len(p) for p in parts), "a block")
            return "".join(parts)

        def checked_concat(self, parts: Any) -> str:
            for p in parts:
                if not isinstance(p, str):
                    budget.check_size(p, "'~'")
            strs = [str(p) for p in parts]
            budget.check_len(sum(len(p) for p in strs), "'~'")
            return "".join(strs)

        def getattr(self, obj: Any, attribute: str) -> Any:
            if isinstance(attribute, str) and attribute.startswith("_"):
                raise SecurityError(f"access to private attribute {attribute!r} is not allowed")
            return super().getattr(obj, attribute)

        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            seqs = (str, list, tuple, bytes, bytearray)
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "*":
                if ints:
                    budget.check_int(left.bit_length() + right.bit_length(), "'*'")
                for seq, k in ((left, right), (right, left)):
                    if isinstance(seq, seqs) and isinstance(k, int):
                        budget.check_len(len(seq) * max(0, k), "'*'")
            elif operator == "+" and isinstance(left, seqs) and isinstance(right, seqs):
                budget.check_len(len(left) + len(right), "'+'")
            elif operator == "**" and ints and right > 0 and abs(left) > 1:
                # bits of the result, checked without computing it (right may itself be huge)
                budget.check_int(abs(left).bit_length() * min(right, MAX_INT_BITS + 1), "'**'")
            elif operator == "%" and isinstance(left, str):
                budget.check_len(_estimate_percent(left, right, budget.max_chars), "'%' formatting")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(target, "__self__", None)
            if isinstance(owner, str):
                name = getattr(target, "__name__", "")
                est = _estimate_str_call(owner, name, args, kwargs, budget.max_chars) if budget.active else None
                if est is not None:
                    budget.check_len(est[0], f"str.{name}()")
                    args = est[1]
            out = super().call(__context, __obj, *args, **kwargs)
            if isinstance(out, (str, list, tuple, bytes, bytearray)):
                budget.check_len(len(out), "a call")
            return out

    def finalize(value: Any) -> Any:
        # {{ value }} is turned into text by str() in one C call: size it first
        if not isinstance(value, str):
            budget.check_size(value, "an output expression")
        return value

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols], finalize=finalize)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        ind = len(indent) if isinstance(indent, str) else int(indent) if isinstance(indent, int) and indent > 0 else 0
        seps = (2, 2)
        if isinstance(separators, (list, tuple)) and len(separators) == 2 \
                and all(isinstance(p, str) for p in separators):
            seps = (len(separators[0]), len(separators[1]))
        budget.check_size(x, "tojson", "json", indent=ind, seps=seps)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: Any) -> None:
        raise TemplateError(f"chat template error: {message}")

    def strftime_now(fmt: str) -> str:
        budget.check_len(len(str(fmt)) * 64, "strftime_now")  # %c and friends expand a few dozen times
        return datetime.datetime.now().strftime(fmt)

    def c_trim(value: Any) -> str:
        return ("" if value is None else str(value)).strip(_C_SPACE)

    base = dict(env.filters)

    def f_center(value: Any, width: int = 80) -> str:
        budget.check_len(max(0, int(width)), "center")
        return base["center"](value, width)

    def f_indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
        w = len(width) if isinstance(width, str) else int(width)
        budget.check_size(s, "indent", factor=1 + max(0, w))
        return base["indent"](s, width, first, blank)

    def f_replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> Any:
        budget.check_size(s, "replace")
        est = _estimate_str_call(str(s), "replace", (str(old), str(new)) + ((count,) if count else ()), {})
        if est is not None:
            budget.check_len(est[0], "replace")
        return base["replace"](eval_ctx, s, old, new, count)

    def f_join(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
        items = list(value)
        budget.check_size(d, "join")
        total = len(str(d)) * max(0, len(items) - 1)
        lim = budget.max_chars
        for it in items:  # each item is turned into text in C: size it first
            total += len(it) if isinstance(it, str) else _size_of(it, lim - total if lim > total else 0)
            budget.check_len(total, "join")
        return base["join"](eval_ctx, items, d, attribute)

    def f_format(value: Any, *args: Any, **kwargs: Any) -> str:
        if budget.active:
            fmt = value if isinstance(value, str) else str(value)
            budget.check_len(_estimate_percent(fmt, kwargs or args, budget.max_chars), "format")
        return base["format"](value, *args, **kwargs)

    def f_wordwrap(environment: Any, s: str, width: int = 79, break_long_words: bool = True,
                   wrapstring: str | None = None, break_on_hyphens: bool = True) -> str:
        if budget.active:
            ws = environment.newline_sequence if wrapstring is None else wrapstring
            budget.check_size(s, "wordwrap")
            budget.check_len(_estimate_wordwrap(str(s), int(width), str(ws)), "wordwrap")
        return base["wordwrap"](environment, s, width, break_long_words, wrapstring, break_on_hyphens)

    def f_string(value: Any) -> str:
        budget.check_size(value, "string")
        return base["string"](value)

    def f_pprint(value: Any) -> str:
        budget.check_size(value, "pprint", "pprint")
        return base["pprint"](value)

    def f_escape(value: Any) -> Any:
        budget.check_size(value, "escape", factor=6)  # "&#34;" is the longest entity
        return base["escape"](value)

    def f_forceescape(value: Any) -> Any:
        budget.check_size(value, "forceescape", factor=6)
        return base["forceescape"](value)

    def f_urlencode(value: Any) -> str:
        budget.check_size(value, "urlencode", factor=12)  # 4 bytes of UTF-8 as %XX each
        return base["urlencode"](value)

    def f_urlize(eval_ctx: Any, value: str, *a: Any, **k: Any) -> str:
        # its address regexes backtrack quadratically on long words: the input is capped
        if not isinstance(value, str):
            budget.check_size(value, "urlize")
        if budget.active and len(str(value)) > _MAX_URLIZE:
            raise TemplateError(f"chat template urlizes {len(str(value))} characters (limit {_MAX_URLIZE})")
        return base["urlize"](eval_ctx, value, *a, **k)

    def f_sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        if isinstance(iterable, (str, bytes)) and attribute is None:
            # its items are characters, never numbers or sequences: refused below anyway, but a list of
            # one-character strings costs 8 bytes each, 8 times the string's size
            raise TemplateError("chat template sums values that are not numbers, lists or tuples")
        items = list(iterable)
        if attribute is not None:
            from jinja2.filters import make_attrgetter

            get = make_attrgetter(environment, attribute)
            items = [get(x) for x in items]
        if isinstance(start, (int, float)) and all(isinstance(x, (int, float)) for x in items):
            return sum(items, start)  # linear: the result has about as many digits as the largest
        if isinstance(start, (list, tuple)) and all(isinstance(x, type(start)) for x in items):
            # sum() of sequences copies the running total at every step (quadratic, in one C
            # call); concatenating once is linear and gives the same result
            budget.check_len(len(start) + sum(len(x) for x in items), "sum")
            out = list(start)
            for x in items:
                out.extend(x)
            return out if isinstance(start, list) else tuple(out)
        raise TemplateError("chat template sums values that are not numbers, lists or tuples")

    def checked(name: str, fn: Any) -> Any:
        """Any other filter, its result's size checked (the ones that can grow much are checked
        before they run, above)."""
        @functools.wraps(fn)
        def run(*a: Any, **k: Any) -> Any:
            out = fn(*a, **k)
            if isinstance(out, (str, list, tuple)):
                budget.check_len(len(out), f"the {name} filter")
            return out

        return run

    for name in ("wordwrap", "sum", "urlize"):
        pass_arg = getattr(base[name], "jinja_pass_arg", None)
        target = {"wordwrap": f_wordwrap, "sum": f_sum, "urlize": f_urlize}[name]
        if pass_arg is not None:
            target.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
    f_replace.jinja_pass_arg = base["replace"].jinja_pass_arg  # type: ignore[attr-defined]
    f_join.jinja_pass_arg = base["join"].jinja_pass_arg  # type: ignore[attr-defined]
    env.filters.update({name: checked(name, fn) for name, fn in base.items()})
    env.filters.update(tojson=tojson, c_trim=c_trim, center=f_center, indent=f_indent, replace=f_replace,
                       join=f_join, format=f_format, wordwrap=f_wordwrap, string=f_string, pprint=f_pprint,
                       escape=f_escape, e=f_escape, forceescape=f_forceescape, urlencode=f_urlencode,
                       urlize=f_urlize, sum=f_sum)
    base_lipsum = env.globals["lipsum"]

    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> Any:  # noqa: A002
        budget.check_len(int(n) * int(max) * 16, "lipsum")  # words of at most a dozen letters
        return base_lipsum(n, html, min, max)

    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, lipsum=lipsum)
    return env


# One sandbox for the whole process: building the environment defines classes and compiles code,
# and doing that per model load kept memory alive (CPython's type caches pin what they reference).
# Its limits live in a thread-local budget, set by each render on its own thread.
_BUDGET = _Budget()
_ENV_LOCK = threading.Lock()
_ENV: Any = None


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    """The compiled template for ``source`` (cached: models of one family share it)."""
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = _make_env(_BUDGET)
        # compiling folds constant expressions (a filter of literals runs now): the same limits
        b = _BUDGET
        saved = b.max_chars, b.active
        b.max_chars, b.active = 1 << 20, True
        try:
            return _ENV.from_string(source)
        finally:
            b.max_chars, b.active = saved


# ---------------------------------------------------------------------------------------------
# request validation
# ---------------------------------------------------------------------------------------------

KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate ``messages`` and copy them into plain dicts, content as a string."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise InvalidRequestError("messages is empty: a chat needs at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content', "
                                      f"got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if role not in KNOWN_ROLES:
            raise InvalidRequestError(f"messages[{i}].role {role!r} is not one of {', '.join(KNOWN_ROLES)}")
        msg = {str(k): v for k, v in m.items()}
        content = m.get("content")
        if content is None:
            if not m.get("tool_calls"):
                raise InvalidRequestError(f"messages[{i}].content is missing (only an assistant message with "
                                          "tool_calls may omit it)")
        elif isinstance(content, str):
            pass
        elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    parts.append({"type": "text", "text": part})
                    continue
                if not isinstance(part, Mapping):
                    raise InvalidRequestError(f"messages[{i}].content[{j}] must be a text part object")
                if part.get("type", "text") != "text":
                    raise InvalidRequestError(f"messages[{i}].content[{j}] has type {part.get('type')!r}; "
                                              "only 'text' parts are supported")
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}].text must be a string")
                parts.append({"type": "text", "text": text})
            content = parts  # joined or passed as parts by ChatTemplate.prepare
        else:
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts, "
                                      f"got {type(content).__name__}")
        calls = m.get("tool_calls")
        if calls is not None:
            if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence) \
                    or not all(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in calls):
                raise InvalidRequestError(f"messages[{i}].tool_calls must be a list of "
                                          "{'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
            msg["tool_calls"] = [{**c, "function": dict(c["function"])} for c in calls]
        msg["content"] = content
        out.append(msg)
    return out


def _normalize_tools(tools: Any) -> list[Any] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise InvalidRequestError("tools must be a list of tool (function) definitions")
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise InvalidRequestError(f"tools[{i}] must be an object, got {type(t).__name__}")
    return [dict(t) for t in tools]


def join_parts(parts: Sequence[Mapping[str, Any]]) -> str:
    """Text parts as one string, llama.cpp's rule for templates that read content as a string:
    joined with newlines."""
    return "\n".join(p["text"] for p in parts)


def _input_size(messages: list[dict[str, Any]], tools: list[Any] | None, extra: Mapping[str, Any]) -> int:
    n = sum(len(m["content"]) if isinstance(m["content"], str) else
            sum(len(p["text"]) for p in m["content"] or ()) for m in messages)
    try:
        n += len(json.dumps(tools, default=str)) if tools else 0
        n += len(json.dumps(dict(extra), default=str)) if extra else 0
    except (TypeError, ValueError):
        pass
    return n


_PUA = re.compile("[\U000F0000-\U0010FFFD]")  # supplementary private use areas A and B
_MAX_DEPTH = 64  # nesting of the caller's data that render_spans walks


class _Protector:
    """Swaps control-token texts in the caller's strings for private-use characters and back."""

    def __init__(self, find: Callable[[str], Sequence[str]], data: Any, source: str) -> None:
        self._find = find
        self._by_text: dict[str, str] = {}
        self._by_mark: dict[str, str] = {}
        taken = set(_PUA.findall(source))
        for text in _strings(data):
            if _PUA.search(text):
                taken.update(_PUA.findall(text))
        self._taken = taken
        self._next = 0xF0000

    def _mark(self, text: str) -> str:
        m = self._by_text.get(text)
        if m is None:
            while chr(self._next) in self._taken:
                self._next += 1
            if self._next > 0x10FFFD:
                raise TemplateError("chat input uses every private-use character: cannot mark its control tokens")
            m = chr(self._next)
            self._next += 1
            self._by_text[text], self._by_mark[m] = m, text
        return m

    def _str(self, s: str) -> str:
        for t in self._find(s):
            if t in s:
                s = s.replace(t, self._mark(t))
        return s

    def neutral(self, data: Any, depth: int = 0) -> Any:
        """A copy of ``data`` (dicts, lists, tuples, strings) with control texts swapped."""
        if isinstance(data, str):
            return self._str(data)
        if depth > _MAX_DEPTH:
            raise InvalidRequestError(f"chat input is nested more than {_MAX_DEPTH} levels deep")
        if isinstance(data, Mapping):
            return {(self._str(k) if isinstance(k, str) else k): self.neutral(v, depth + 1) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            out = [self.neutral(v, depth + 1) for v in data]
            return tuple(out) if isinstance(data, tuple) else out
        return data

    def restore(self, text: str) -> tuple[str, list[tuple[int, int]]]:
        if not self._by_mark:
            return text, []
        marks = re.compile("[" + "".join(self._by_mark) + "]")
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        n = pos = 0
        for m in marks.finditer(text):
            out.append(text[pos:m.start()])
            n += m.start() - pos
            real = self._by_mark[m.group()]
            out.append(real)
            spans.append((n, n + len(real)))
            n += len(real)
            pos = m.end()
        out.append(text[pos:])
        return "".join(out), spans


def _strings(data: Any, depth: int = 0) -> Iterator[str]:
    if isinstance(data, str):
        yield data
    elif depth <= _MAX_DEPTH:
        if isinstance(data, Mapping):
            for k, v in data.items():
                if isinstance(k, str):
                    yield k
                yield from _strings(v, depth + 1)
        elif isinstance(data, (list, tuple)):
            for v in data:
                yield from _strings(v, depth + 1)


# ---------------------------------------------------------------------------------------------
# the template
# ---------------------------------------------------------------------------------------------

class ChatTemplate:
    """A compiled chat template and the special-token strings it is rendered with.

    ``render(messages, add_generation_prompt=True, tools=None, **extra)`` returns the prompt text.
    ``timeout_s`` bounds one render; ``max_output_chars`` bounds its output (default: 1 Mi
    characters plus 16 per character of input).
    """

    def __init__(self, source: str, *, name: str = "custom", bos_token: str = "", eos_token: str = "",
                 unk_token: str = "", pad_token: str = "", builtin: bool = False, timeout_s: float = 2.0,
                 max_output_chars: int | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("chat template is empty")
        self.source = source
        self.name = name
        self.builtin = builtin
        self.timeout_s = float(timeout_s)
        self.max_output_chars = max_output_chars
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, "unk_token": unk_token,
                               "pad_token": pad_token}
        self._budget = _BUDGET
        self._caps: dict[str, bool] | None = None
        try:
            self._template = _compile(source)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise TemplateError(f"chat template {name!r} does not compile: {type(e).__name__}: {e}") from None

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, f: GGUFFile, tokenizer: Tokenizer, override: str | None = None,
                  **kwargs: Any) -> ChatTemplate:
        """The model's template: ``override`` (a built-in name, a named template of the GGUF, or a
        Jinja template string), else ``tokenizer.chat_template``, else a built-in chosen from the
        architecture and special tokens."""
        return cls.from_metadata(f.metadata, tokenizer, override, **kwargs)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tokenizer: Tokenizer | None,
                      override: str | None = None, **kwargs: Any) -> ChatTemplate:
        """Like :meth:`from_gguf`, from a GGUF metadata mapping."""
        tokens = _special_token_strings(tokenizer)
        if override is not None:
            if not isinstance(override, str) or not override.strip():
                raise TemplateError("chat template override must be a template name or a template string")
            if override in BUILTIN_TEMPLATES:
                return cls.builtin(override, tokenizer, **kwargs)
            named = metadata.get(f"tokenizer.chat_template.{override}")
            if isinstance(named, str) and named.strip():
                return cls(named, name=override, **tokens, **kwargs)
            if "{{" in override or "{%" in override:
                return cls(override, name="custom", **tokens, **kwargs)
            raise TemplateError(f"unknown chat template {override!r}: not a built-in "
                                f"({', '.join(BUILTIN_TEMPLATES)}), not named in the model, not a Jinja template")
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, name="gguf", **tokens, **kwargs)
        name = choose_builtin(metadata.get("general.architecture"), tokenizer)
        log.info("the model has no chat template: using the built-in %r template", name)
        return cls.builtin(name, tokenizer, **kwargs)

    @classmethod
    def builtin(cls, name: str, tokenizer: Tokenizer | None = None, **kwargs: Any) -> ChatTemplate:
        """One of :data:`BUILTIN_TEMPLATES` by name."""
        if name not in BUILTIN_TEMPLATES:
            raise TemplateError(f"unknown built-in chat template {name!r} (have: {', '.join(BUILTIN_TEMPLATES)})")
        return cls(BUILTIN_TEMPLATES[name], name=name, builtin=True, **_special_token_strings(tokenizer), **kwargs)

    # ---- rendering -------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """Render ``messages`` (``[{'role': 'user', 'content': '...'}, ...]``) to the prompt text."""
        msgs = self.prepare(_normalize_messages(messages))
        tool_list = _normalize_tools(tools)
        ctx: dict[str, Any] = dict(self.special_tokens)
        ctx.update(extra)
        ctx.update(messages=msgs, tools=tool_list, add_generation_prompt=bool(add_generation_prompt))
        limit = self.max_output_chars
        if limit is None:
            limit = (1 << 20) + 16 * _input_size(msgs, tool_list, extra)
        return self._render(ctx, limit)

    def render_spans(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                     tools: Sequence[Mapping[str, Any]] | None = None, *,
                     control_texts: Callable[[str], Sequence[str]], **extra: Any) -> tuple[str, list[tuple[int, int]]]:
        """Render like :meth:`render`, and say which control-token texts in the result came from
        the caller's data (message content, names, tool calls, tools, extra variables) rather
        than from the template: ``(text, spans)``, each span ``[start, end)`` of ``text``.

        ``control_texts(s)`` lists the control-token texts occurring in ``s`` (longest first;
        ``Tokenizer.control_texts_in``). Each occurrence in the caller's strings is swapped for
        a private-use character no input contains before rendering, so the template sees one
        opaque character, and swapped back afterwards, its place recorded: tokenizing with
        ``Tokenizer.encode(text, parse_special=True, plain_spans=spans)`` then makes control
        tokens only of the template's own text (no role injection through content).
        """
        msgs = self.prepare(_normalize_messages(messages))
        tool_list = _normalize_tools(tools)
        prot = _Protector(control_texts, (msgs, tool_list, extra), self.source)
        msgs, tool_list, extra = prot.neutral((msgs, tool_list, dict(extra)))
        ctx: dict[str, Any] = dict(self.special_tokens)
        ctx.update(extra)
        ctx.update(messages=msgs, tools=tool_list, add_generation_prompt=bool(add_generation_prompt))
        limit = self.max_output_chars
        if limit is None:
            limit = (1 << 20) + 16 * _input_size(msgs, tool_list, extra)
        return prot.restore(self._render(ctx, limit))

    def prepare(self, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages (validated copies) as the template expects them, following llama.cpp:
        ``content: null`` becomes ``""``; content-part lists stay lists for templates that read
        parts and are joined (:func:`join_parts`) for the others; tool-call arguments sent as a
        JSON string (the OpenAI shape) become objects for templates that read them as objects;
        ``reasoning_content`` is also given as ``thinking`` (the name some templates read)."""
        caps = self.caps
        for i, m in enumerate(msgs):
            c = m.get("content")
            if c is None:
                m["content"] = ""
            elif isinstance(c, list) and not caps["typed_content"]:
                m["content"] = join_parts(c)
            if m.get("reasoning_content") is not None and "thinking" not in m:
                m["thinking"] = m["reasoning_content"]
            for j, call in enumerate(m.get("tool_calls") or ()):
                args = call["function"].get("arguments")
                if caps["object_arguments"] and isinstance(args, str):
                    try:
                        call["function"]["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as e:
                        raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                                  f"valid JSON: {e}") from None
        return msgs

    @property
    def caps(self) -> dict[str, bool]:
        """What the template reads, found by rendering probes once (as llama.cpp's template
        capabilities do): ``typed_content`` (content as a list of parts), ``object_arguments``
        (tool-call arguments as an object)."""
        if self._caps is None:
            self._caps = {"typed_content": False, "object_arguments": False} if self.builtin else _probe(self)
        return self._caps

    def __call__(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                 tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        return self.render(messages, add_generation_prompt, tools, **extra)

    def _render(self, ctx: dict[str, Any], limit: int) -> str:
        budget = self._budget
        if budget.active:
            raise TemplateError("chat template rendering re-entered itself")
        deadline = time.monotonic() + self.timeout_s
        budget.deadline, budget.max_chars, budget.active = deadline, limit, True
        clock = time.monotonic
        steps = [0]

        def local_trace(frame: Any, event: str, arg: Any) -> Any:
            steps[0] += 1
            if steps[0] & 63 == 0 and clock() > deadline:
                raise _Abort()
            return local_trace

        def global_trace(frame: Any, event: str, arg: Any) -> Any:
            if clock() > deadline:
                raise _Abort()
            return local_trace

        old_trace = sys.gettrace()
        chunks: list[str] = []
        size = 0
        sys.settrace(global_trace)
        try:
            for chunk in self._template.generate(**ctx):
                size += len(chunk)
                if size > limit:
                    raise TemplateError(f"chat template output too large: more than {limit} characters")
                chunks.append(chunk)
        except _Abort:
            raise TemplateError(f"chat template did not finish within {self.timeout_s:g} s "
                                "(a loop without end?)") from None
        except MinirtError:
            raise
        except RecursionError:
            raise TemplateError("chat template recursed too deeply") from None
        except MemoryError:
            raise TemplateError("chat template ran out of memory") from None
        except Exception as e:
            from jinja2.exceptions import SecurityError, UndefinedError

            if isinstance(e, SecurityError):
                raise TemplateError(f"chat template tried an unsafe operation: {e}") from None
            if isinstance(e, UndefinedError):
                raise TemplateError(f"chat template used something undefined: {e}") from None
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            sys.settrace(old_trace)
            budget.active = False
        return "".join(chunks)

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"


_MARK = "MinirtProbeMarker"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "tool1", "description": "Tool description",
    "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}]


def _probe(t: ChatTemplate) -> dict[str, bool]:
    def render(msgs: list[dict[str, Any]], tools: Any = None) -> str:
        ctx = dict(t.special_tokens, messages=msgs, tools=tools, add_generation_prompt=True)
        try:
            return t._render(ctx, 1 << 20)
        except MinirtError:
            return ""

    out = render([{"role": "user", "content": [{"type": "text", "text": _MARK}]}])
    # a template that prints the list itself shows its Python or JSON form, not just the text
    typed = _MARK in out and f"'text': '{_MARK}'" not in out and f'"text": "{_MARK}"' not in out

    def with_args(args: Any) -> str:
        call = {"id": "call_1", "type": "function", "function": {"name": "tool1", "arguments": args}}
        return render([{"role": "user", "content": "User message"},
                       {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "Tool result"},
                       {"role": "user", "content": "Next"}], _PROBE_TOOLS)

    as_string = json.dumps({"arg": _MARK})
    obj = _MARK in with_args({"arg": _MARK}) and as_string not in with_args(as_string)
    return {"typed_content": typed, "object_arguments": obj}


def _special_token_strings(tokenizer: Tokenizer | None) -> dict[str, str]:
    out = {"bos_token": "", "eos_token": "", "unk_token": "", "pad_token": ""}
    if tokenizer is None:
        return out
    for key, tid in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                     ("unk_token", tokenizer.unk_id), ("pad_token", tokenizer.pad_id)):
        if tid is not None:
            out[key] = tokenizer.token_text(tid)
    return out


def apply_chat_template(template: ChatTemplate, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Shorthand for ``template.render(messages, add_generation_prompt, **kwargs)``."""
    return template.render(messages, add_generation_prompt, **kwargs)
