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
from collections.abc import Mapping, Sequence
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
            raise TemplateError(f"chat template output too large: {what} would make {n} characters "
                                f"(limit {self.max_chars})")


_WIDTH_RE = re.compile(r"\d{7,}")  # a width / precision of a million or more in a format spec


def _estimate_str_call(s: str, name: str, args: tuple, kwargs: dict) -> tuple[int, tuple] | None:
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
    if name in ("format", "format_map"):
        nums = [a for a in list(args) + list(kwargs.values()) if isinstance(a, int) and abs(a) >= 1_000_000]
        if _WIDTH_RE.search(s) or ("{" in s and nums):  # a width of a million or more, literal or nested
            return 1 << 62, args
    return None


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
            seqs = (str, list, tuple)
            if operator == "*":
                for seq, k in ((left, right), (right, left)):
                    if isinstance(seq, seqs) and isinstance(k, int):
                        budget.check_len(len(seq) * max(0, k), "'*'")
            elif operator == "+" and isinstance(left, seqs) and isinstance(right, seqs):
                budget.check_len(len(left) + len(right), "'+'")
            elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
                if abs(right) > 1024 and abs(left) > 1:
                    raise TemplateError("chat template computes a power too large to evaluate")
            elif operator == "%" and isinstance(left, str):
                vals = right if isinstance(right, tuple) else (right,)
                big = any(isinstance(v, int) and abs(v) >= 1_000_000 for v in vals)
                if _WIDTH_RE.search(left) or ("*" in left and big):
                    raise TemplateError("chat template formats with a width or precision too large")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(target, "__self__", None)
            if isinstance(owner, str):
                name = getattr(target, "__name__", "")
                est = _estimate_str_call(owner, name, args, kwargs)
                if est is not None:
                    if budget.active and name in ("format", "format_map") and est[0] == 1 << 62:
                        raise TemplateError("chat template formats with a width or precision too large")
                    budget.check_len(est[0], f"str.{name}()")
                    args = est[1]
            out = super().call(__context, __obj, *args, **kwargs)
            if isinstance(out, (str, list, tuple)):
                budget.check_len(len(out), "a call")
            return out

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: Any) -> None:
        raise TemplateError(f"chat template error: {message}")

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    def c_trim(value: Any) -> str:
        return ("" if value is None else str(value)).strip(_C_SPACE)

    base = dict(env.filters)

    def f_center(value: Any, width: int = 80) -> str:
        budget.check_len(max(0, int(width)), "center")
        return base["center"](value, width)

    def f_indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
        w = len(width) if isinstance(width, str) else int(width)
        budget.check_len(len(str(s)) * (1 + max(0, w)), "indent")
        return base["indent"](s, width, first, blank)

    def f_replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> Any:
        est = _estimate_str_call(str(s), "replace", (str(old), str(new)) + ((count,) if count else ()), {})
        if est is not None:
            budget.check_len(est[0], "replace")
        return base["replace"](eval_ctx, s, old, new, count)

    def f_join(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
        items = list(value)
        budget.check_len(len(str(d)) * max(0, len(items) - 1), "join")
        return base["join"](eval_ctx, items, d, attribute)

    def f_format(value: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(value, str) and _WIDTH_RE.search(value):
            raise TemplateError("chat template formats with a width or precision too large")
        return base["format"](value, *args, **kwargs)

    def f_wordwrap(*a: Any, **k: Any) -> str:
        out = base["wordwrap"](*a, **k)
        budget.check_len(len(out), "wordwrap")
        return out

    # keep the eval-context flag of the wrapped filters
    f_replace.jinja_pass_arg = base["replace"].jinja_pass_arg  # type: ignore[attr-defined]
    f_join.jinja_pass_arg = base["join"].jinja_pass_arg  # type: ignore[attr-defined]
    f_wordwrap.jinja_pass_arg = getattr(base["wordwrap"], "jinja_pass_arg", None)  # type: ignore[attr-defined]
    if f_wordwrap.jinja_pass_arg is None:  # type: ignore[attr-defined]
        del f_wordwrap.jinja_pass_arg  # type: ignore[attr-defined]
    env.filters.update(tojson=tojson, c_trim=c_trim, center=f_center, indent=f_indent, replace=f_replace,
                       join=f_join, format=f_format, wordwrap=f_wordwrap)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
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
        return _ENV.from_string(source)


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
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                    continue
                if not isinstance(part, Mapping):
                    raise InvalidRequestError(f"messages[{i}].content[{j}] must be a text part object")
                if part.get("type", "text") != "text":
                    raise InvalidRequestError(f"messages[{i}].content[{j}] has type {part.get('type')!r}; "
                                              "only 'text' parts are supported")
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}].text must be a string")
                texts.append(text)
            content = "".join(texts)
        else:
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts, "
                                      f"got {type(content).__name__}")
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


def _input_size(messages: list[dict[str, Any]], tools: list[Any] | None, extra: Mapping[str, Any]) -> int:
    n = sum(len(m["content"] or "") for m in messages)
    try:
        n += len(json.dumps(tools, default=str)) if tools else 0
        n += len(json.dumps(dict(extra), default=str)) if extra else 0
    except (TypeError, ValueError):
        pass
    return n


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
        msgs = _normalize_messages(messages)
        tool_list = _normalize_tools(tools)
        if self.builtin:
            for m in msgs:  # llama.cpp's built-ins take every content as a string
                if m["content"] is None:
                    m["content"] = ""
        ctx: dict[str, Any] = dict(self.special_tokens)
        ctx.update(extra)
        ctx.update(messages=msgs, tools=tool_list, add_generation_prompt=bool(add_generation_prompt))
        limit = self.max_output_chars
        if limit is None:
            limit = (1 << 20) + 16 * _input_size(msgs, tool_list, extra)
        return self._render(ctx, limit)

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
