"""Tool calling: the formats real models emit, parsed into OpenAI ``tool_calls``.

Each chat template's model speaks one format (which one is read from the template's source, as
llama.cpp's ``common/chat.cpp`` tells them apart). :func:`parse` splits a finished output into
content and calls; :class:`ToolStream` does it incrementally for streaming, holding back text
that may open a call and emitting each call once it is complete. ``tool_choice="required"`` or a
named function is enforced with a grammar (:func:`call_grammar`) so the output is always a
schema-valid call.

gpt-oss's harmony format is parsed here rather than with the ``openai-harmony`` package: that
package downloads its tokenizer vocabulary (o200k) when loaded, which an offline runtime cannot
do, and parsing only needs the channel and recipient headers of the text.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _args(v: Any) -> str:
    """Arguments as the JSON string OpenAI clients expect."""
    if isinstance(v, str):
        try:
            json.loads(v)
            return v
        except json.JSONDecodeError:
            return json.dumps(v)
    return json.dumps({} if v is None else v, ensure_ascii=False)


def _json_at(text: str, i: int) -> tuple[Any, int]:
    """The JSON value starting at ``text[i]`` (whitespace skipped) and the index after it."""
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return json.JSONDecoder().raw_decode(text, i)


def _obj_call(obj: Any, args_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    call = ToolCall(obj["name"], _args(args))
    if isinstance(obj.get("id"), str) and obj["id"]:
        call.id = obj["id"]
    return call


# ---------------------------------------------------------------------------------------------
# one parser per format: text -> (content, calls); calls that are incomplete are not returned
# ---------------------------------------------------------------------------------------------

def _between(text: str, start: str, end: str) -> tuple[str, list[str]]:
    """Content outside ``start…end`` blocks and the block bodies (an unterminated last block
    counts when it already holds a complete value, checked by the caller)."""
    content, bodies, i = [], [], 0
    while True:
        j = text.find(start, i)
        if j < 0:
            content.append(text[i:])
            break
        content.append(text[i:j])
        k = text.find(end, j + len(start))
        bodies.append(text[j + len(start):] if k < 0 else text[j + len(start):k])
        if k < 0:
            break
        i = k + len(end)
    return "".join(content), bodies


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes 2/3, Qwen2.5, Qwen3, SmolLM3, Granite 4: ``<tool_call>{"name", "arguments"}</tool_call>``."""
    content, bodies = _between(text, "<tool_call>", "</tool_call>")
    calls = []
    for b in bodies:
        if "<function=" in b:  # Qwen3-Coder's XML body inside <tool_call>
            calls += parse_qwen3_coder(b)[1]
            continue
        try:
            c = _obj_call(_json_at(b, 0)[0])
        except json.JSONDecodeError:
            continue
        if c is not None:
            calls.append(c)
    return content, calls


def parse_qwen3_coder(text: str) -> tuple[str, list[ToolCall]]:
    """Qwen3-Coder: ``<function=NAME><parameter=ARG>value</parameter></function>`` (in <tool_call>)."""
    calls = []
    for m in re.finditer(r"<function=([^>\s]+)>(.*?)</function>", text, re.S):
        args = {}
        for p in re.finditer(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S):
            args[p.group(1)] = _value(p.group(2))
        calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
    content = re.sub(r"(<tool_call>\s*)?<function=.*?(</function>\s*(</tool_call>)?|$)", "", text, flags=re.S)
    return content, calls


def _value(s: str) -> Any:
    """A parameter value written as text: JSON when it parses, else the string itself."""
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


def parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.1-3.3: a bare ``{"name": ..., "parameters": ...}`` answer (several separated by
    ``;``), or ``<|python_tag|>`` followed by JSON, ``tool.call(arg=...)`` or code (the python tool)."""
    tag = text.find("<|python_tag|>")
    if tag >= 0:
        body = text[tag + len("<|python_tag|>"):].strip()
        content = text[:tag]
        calls = []
        try:
            obj, _ = _json_at(body, 0)
            c = _obj_call(obj)
            if c is not None:
                return content, [c]
        except json.JSONDecodeError:
            pass
        m = re.fullmatch(r"([A-Za-z_][\w]*)\.call\((.*)\)", body, re.S)
        if m:
            calls = _pythonic(f"{m.group(1)}({m.group(2)})")
            if calls:
                return content, calls
        return content, ([ToolCall("python", json.dumps({"code": body}, ensure_ascii=False))] if body else [])
    stripped = text.strip()
    if not stripped.startswith("{"):
        return text, []
    calls, i = [], text.index("{")
    while True:
        try:
            obj, i = _json_at(text, i)
        except json.JSONDecodeError:
            return (text, []) if not calls else ("", calls)
        c = _obj_call(obj)
        if c is None:
            return text, []
        calls.append(c)
        rest = text[i:].lstrip()
        if not rest:
            return "", calls
        if not rest.startswith(";"):
            return text, []
        i = text.index(";", i) + 1


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    """Mistral Nemo / Small: ``[TOOL_CALLS][{"name", "arguments", "id"}]``; Ministral-3 and
    Devstral: ``[TOOL_CALLS]NAME[ARGS]{...}`` repeated."""
    k = text.find("[TOOL_CALLS]")
    if k < 0:
        return text, []
    content, calls = text[:k], []
    for part in text[k:].split("[TOOL_CALLS]")[1:]:
        if "[ARGS]" in part:
            name, _, rest = part.partition("[ARGS]")
            try:
                args, _ = _json_at(rest, 0)
            except json.JSONDecodeError:
                continue
            calls.append(ToolCall(name.strip(), _args(args)))
            continue
        try:
            arr, _ = _json_at(part, 0)
        except json.JSONDecodeError:
            continue
        for obj in arr if isinstance(arr, list) else [arr]:
            c = _obj_call(obj)
            if c is not None:
                calls.append(c)
    return content, calls


def parse_gpt_oss(text: str) -> tuple[str, list[ToolCall]]:
    """gpt-oss harmony: messages
    ``[<|start|>assistant]<|channel|>C[ to=functions.N][ <|constrain|>json]<|message|>BODY``
    ended by ``<|end|>`` / ``<|call|>``; the recipient may also come before ``<|channel|>``. The
    ``final`` (or plain ``commentary``) channel is the content; a message to ``functions.NAME``
    is a call; ``analysis`` is reasoning (see :mod:`minirt.reasoning`)."""
    content, calls = [], []
    for header, body in harmony_messages(text):
        to = re.search(r"to=functions\.([^\s<]+)", header)
        if to:
            try:
                obj, _ = _json_at(body, 0)
            except json.JSONDecodeError:
                continue
            calls.append(ToolCall(to.group(1), _args(obj)))
        elif re.search(r"<\|channel\|>(final|commentary)\b", header) or "<|channel|>" not in header:
            content.append(body)
    return "".join(content), calls


def harmony_messages(text: str) -> list[tuple[str, str]]:
    """``(header, body)`` of each harmony message of an output (the last may be unterminated)."""
    out = []
    for chunk in re.split(r"<\|(?:end|call|return)\|>", text):
        chunk = chunk.replace("<|start|>assistant", "")
        if "<|message|>" in chunk:
            header, _, body = chunk.partition("<|message|>")
            out.append((header, body))
        elif chunk.strip() and "<|" not in chunk and not chunk.lstrip().startswith("to="):
            out.append(("", chunk))  # text without any header (a header still being written has "<|")
    return out


def _sections(text: str, opens: tuple[str, ...], begin: str, end: str, sep: str) -> tuple[int, list[tuple[str, str]]]:
    """Where the calls section starts (the first of ``opens``; ``len(text)`` when absent) and each
    ``begin HEAD sep REST end`` call in it as ``(HEAD, REST)``."""
    k = min((i for i in (text.find(o) for o in opens) if i >= 0), default=len(text))
    pairs = []
    for body in _between(text[k:], begin, end)[1]:
        head, found, rest = body.partition(sep)
        if found:
            pairs.append((head, rest))
    return k, pairs


def parse_deepseek(text: str) -> tuple[str, list[ToolCall]]:
    """DeepSeek R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}```<｜tool▁call▁end｜>``;
    DeepSeek V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``."""
    k, pairs = _sections(text, ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"), "<｜tool▁call▁begin｜>",
                         "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
    calls = []
    for head, rest in pairs:
        if head.strip() == "function":  # R1: the name follows on the same line
            name, _, rest = rest.partition("\n")
        else:
            name = head
        rest = re.sub(r"^\s*```(?:json)?\s*", "", rest)
        try:
            args, _ = _json_at(rest, 0)
        except json.JSONDecodeError:
            continue
        calls.append(ToolCall(name.strip(), _args(args)))
    return text[:k], calls


def parse_functionary_v3_2(text: str) -> tuple[str, list[ToolCall]]:
    """Functionary v3.2: ``>>>RECIPIENT\\nBODY`` blocks (the first ``>>>`` is in the prompt);
    recipient ``all`` is content, any other is a call whose body is JSON arguments."""
    blocks = text.split(">>>")
    content, calls = [], []
    for i, b in enumerate(blocks):
        if not b:
            continue
        name, nl, body = b.partition("\n")
        if not nl:
            if i == 0 and name.strip() != "all":
                content.append(b)  # one line that names no recipient: plain text
            continue  # "all" alone, or a recipient still being written
        if name.strip() == "all":
            content.append(body)
            continue
        if name.strip() == "python" and not body.lstrip().startswith("{"):
            calls.append(ToolCall("python", json.dumps({"code": body}, ensure_ascii=False)))
            continue
        try:
            args, _ = _json_at(body, 0)
        except json.JSONDecodeError:
            continue
        calls.append(ToolCall(name.strip(), _args(args)))
    return "".join(content), calls


def parse_functionary_v3_1(text: str) -> tuple[str, list[ToolCall]]:
    """Functionary v3.1 (Llama 3.1): ``<function=NAME>{...}</function>``."""
    content, calls, i = [], [], 0
    for m in re.finditer(r"<function=([^>]+)>", text):
        content.append(text[i:m.start()])
        try:
            args, j = _json_at(text, m.end())
        except json.JSONDecodeError:
            i = len(text)
            break
        calls.append(ToolCall(m.group(1), _args(args)))
        i = j + len("</function>") if text.startswith("</function>", j) else j
    else:
        content.append(text[i:])
    return "".join(content), calls


def parse_granite(text: str) -> tuple[str, list[ToolCall]]:
    """Granite 3.x: ``<|tool_call|>[{"name", "arguments"}, ...]``."""
    k = text.find("<|tool_call|>")
    if k < 0:
        return text, []
    try:
        arr, _ = _json_at(text, k + len("<|tool_call|>"))
    except json.JSONDecodeError:
        return text[:k], []
    return text[:k], [c for c in (_obj_call(o) for o in (arr if isinstance(arr, list) else [arr])) if c]


def parse_command_r7b(text: str) -> tuple[str, list[ToolCall]]:
    """Command R7B: ``<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>``;
    the answer inside ``<|START_RESPONSE|>…<|END_RESPONSE|>``."""
    calls = []
    _, actions = _between(text, "<|START_ACTION|>", "<|END_ACTION|>")
    for a in actions:
        try:
            arr, _ = _json_at(a, 0)
        except json.JSONDecodeError:
            continue
        for o in arr if isinstance(arr, list) else [arr]:
            if isinstance(o, dict) and isinstance(o.get("tool_name"), str):
                c = ToolCall(o["tool_name"], _args(o.get("parameters", {})))
                calls.append(c)
    text = re.sub(r"<\|START_ACTION\|>.*?(<\|END_ACTION\|>|$)", "", text, flags=re.S)
    text = re.sub(r"<\|START_THINKING\|>.*?(<\|END_THINKING\|>|$)", "", text, flags=re.S)
    m = re.search(r"<\|START_RESPONSE\|>(.*?)(<\|END_RESPONSE\|>|$)", text, re.S)
    return (m.group(1) if m else text), calls


def parse_glm(text: str) -> tuple[str, list[ToolCall]]:
    """GLM-4.5 / 4.6 / 4.7: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>``
    (newlines between the parts in 4.5/4.6, none in 4.7)."""
    content, bodies = _between(text, "<tool_call>", "</tool_call>")
    calls = []
    for b in bodies:
        name, _, rest = b.partition("<arg_key>")
        args = {}
        for m in re.finditer(r"(?:^|<arg_key>)(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, re.S):
            args[m.group(1).strip()] = _value(m.group(2))
        if name.strip():
            calls.append(ToolCall(name.strip(), json.dumps(args, ensure_ascii=False)))
    return content, calls


def parse_kimi_k2(text: str) -> tuple[str, list[ToolCall]]:
    """Kimi-K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{...}<|tool_call_end|>…<|tool_calls_section_end|>``."""
    k, pairs = _sections(text, ("<|tool_calls_section_begin|>",), "<|tool_call_begin|>", "<|tool_call_end|>",
                         "<|tool_call_argument_begin|>")
    calls = []
    for head, rest in pairs:
        try:
            args, _ = _json_at(rest, 0)
        except json.JSONDecodeError:
            continue
        c = ToolCall(re.sub(r":\d+$", "", re.sub(r"^functions\.", "", head.strip())), _args(args))
        c.id = head.strip()  # Kimi's own call id (functions.NAME:IDX), which its template echoes
        calls.append(c)
    return text[:k], calls


def parse_lfm2(text: str) -> tuple[str, list[ToolCall]]:
    """LFM2 / LFM2.5: ``<|tool_call_start|>[name(arg="v"), other(x=1)]<|tool_call_end|>``."""
    content, bodies = _between(text, "<|tool_call_start|>", "<|tool_call_end|>")
    calls = []
    for b in bodies:
        b = b.strip()
        if b.startswith("[") and b.endswith("]"):
            calls += _pythonic(b[1:-1])
        elif b.startswith("["):
            continue  # still being written
        else:
            try:
                obj, _ = _json_at(b, 0)
                calls += [c for c in (_obj_call(o) for o in (obj if isinstance(obj, list) else [obj])) if c]
            except json.JSONDecodeError:
                pass
    return content, calls


def _pythonic(src: str) -> list[ToolCall]:
    """``f(a=1, b="x"), g()`` (Python call syntax, literals only) → calls; [] when it does not parse."""
    try:
        tree = ast.parse(f"[{src}]", mode="eval")
    except SyntaxError:
        return []
    calls = []
    for node in tree.body.elts if isinstance(tree.body, ast.List) else []:
        if not isinstance(node, ast.Call):
            return []
        name = ast.unparse(node.func)
        args = {}
        for kw in node.keywords:
            try:
                args[kw.arg] = _literal(kw.value)
            except ValueError:
                return []
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):  # JSON spellings inside Python
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


@dataclass(frozen=True)
class Format:
    """A tool-call format: its parser and the markers that may open a call."""

    name: str
    parse: Callable[[str], tuple[str, list[ToolCall]]]
    markers: tuple[str, ...]
    at_start: bool = False  # a call may also start the output without a marker (bare JSON)


FORMATS = {f.name: f for f in (
    Format("hermes", parse_hermes, ("<tool_call>", "<function=")),
    Format("qwen3-coder", parse_hermes, ("<tool_call>", "<function=")),
    Format("llama3", parse_llama3, ("<|python_tag|>",), at_start=True),
    Format("mistral", parse_mistral, ("[TOOL_CALLS]",)),
    Format("gpt-oss", parse_gpt_oss, ("to=functions.",)),
    Format("deepseek", parse_deepseek, ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")),
    Format("functionary-v3.2", parse_functionary_v3_2, (">>>",), at_start=True),
    Format("functionary-v3.1", parse_functionary_v3_1, ("<function=",)),
    Format("granite", parse_granite, ("<|tool_call|>",)),
    Format("command-r7b", parse_command_r7b, ("<|START_ACTION|>",)),
    Format("glm", parse_glm, ("<tool_call>",)),
    Format("kimi-k2", parse_kimi_k2, ("<|tool_calls_section_begin|>",)),
    Format("lfm2", parse_lfm2, ("<|tool_call_start|>",)),
)}


def detect_format(template_source: str) -> str:
    """The tool-call format a chat template's model emits, from the markers its source uses
    (llama.cpp's ``common/chat.cpp`` distinguishes templates the same way); "hermes" otherwise."""
    s = template_source or ""
    checks = [
        ("<|channel|>", "gpt-oss"), ("[TOOL_CALLS]", "mistral"), ("<｜tool▁sep｜>", "deepseek"),
        ("<|tool_calls_section_begin|>", "kimi-k2"), ("<arg_key>", "glm"), ("<|START_ACTION|>", "command-r7b"),
        ("<|tool_call_start|>", "lfm2"), ("<|tool_list_start|>", "lfm2"), ("<|tool_call|>", "granite"),
        (">>>all", "functionary-v3.2"),
        ("<parameter=", "qwen3-coder"), ("<tool_call>", "hermes"), ("<function=", "functionary-v3.1"),
        ("<|python_tag|>", "llama3"), ("<|eom_id|>", "llama3"),
    ]
    for marker, name in checks:
        if marker in s:
            return name
    return "hermes"


def parse(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """Split a finished output into ``(content, tool calls)``."""
    return FORMATS[fmt].parse(text)


class ToolStream:
    """Incremental parsing of a streamed output: ``feed(delta)`` and ``finish()`` return
    ``(content delta, newly completed calls)``. Text that may open a call is held back until it
    is known; once a call has started, the rest of the output is parsed as the calls section."""

    def __init__(self, fmt: str, names: set[str] | None = None) -> None:
        self.fmt = FORMATS[fmt]
        self.names = names  # tools a bare JSON answer may call (see bare_calls)
        self.text = ""
        self.sent = 0  # characters of content already emitted
        self.in_calls = False
        self.n_calls = 0
        self.start = 0

    def _call_start(self) -> int:
        if self.fmt.at_start and self.text.lstrip().startswith("{"):
            return 0  # a bare JSON call (Llama 3)
        hits = [i for i in (self.text.find(m) for m in self.fmt.markers) if i >= 0]
        return min(hits) if hits else -1

    def _safe_end(self, text: str | None = None) -> int:
        """How much of ``text`` (the whole output by default) can be emitted as content: all but a
        suffix that may open a marker."""
        text = self.text if text is None else text
        keep = 0
        for m in self.fmt.markers:
            for k in range(min(len(m) - 1, len(text)), keep, -1):
                if text.endswith(m[:k]):
                    keep = k
                    break
        if self.fmt.at_start and not text.strip():
            keep = len(text)
        if self.fmt.name == "functionary-v3.2" and "\n" not in self.text:
            keep = len(text)  # the first line names the recipient
        return len(text) - keep

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, list[ToolCall]]:
        if self.names and self.sent == 0 and not self.in_calls:
            head = self.text.lstrip()
            if head.startswith(("{", "[{")) or "```json".startswith(head[:7]) or head.startswith("```json"):
                if not final:
                    return "", []  # may be a bare call: decided at the end
                calls = bare_calls(self.text, self.names)
                if calls:
                    self.n_calls = len(calls)
                    self.sent = len(self.text)
                    return "", calls
        if self.fmt.name in ("functionary-v3.2", "gpt-oss", "command-r7b"):
            return self._reparse(final)  # content and calls interleave: parse the whole text each time
        if not self.in_calls:
            k = self._call_start()
            if k >= 0:
                self.in_calls, self.start = True, k
        if not self.in_calls:
            end = len(self.text) if final else self._safe_end()
            out = self.text[self.sent:end]
            self.sent = max(self.sent, end)
            return out, []
        content, calls = self.fmt.parse(self.text)
        if final and not calls:  # it was not a call after all: the held text is content
            out = self.text[self.sent:]
            self.sent = len(self.text)
            return out, []
        new = calls[self.n_calls:] if final else calls[self.n_calls:max(self.n_calls, len(calls) - 1)]
        self.n_calls += len(new)
        out = self.text[self.sent:self.start] if self.sent < self.start else ""
        self.sent = max(self.sent, self.start)
        return out, new

    def _reparse(self, final: bool) -> tuple[str, list[ToolCall]]:
        text = self.text
        j = text.rfind("<")
        if not final and j >= 0 and ">" not in text[j:]:
            text = text[:j]  # a marker still being written
        content, calls = self.fmt.parse(text)
        if not final:
            content = content[:self._safe_end(content)]
        if not final:
            calls = calls[:max(self.n_calls, len(calls) - 1)]  # the last may still grow
        new = calls[self.n_calls:]
        self.n_calls += len(new)
        out = content[self.sent:] if len(content) > self.sent else ""
        self.sent = max(self.sent, len(content))
        return out, new


# ---------------------------------------------------------------------------------------------
# request options
# ---------------------------------------------------------------------------------------------

def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI ``tools``: a list of ``{"type": "function", "function": {"name", "parameters"}}``."""
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise InvalidRequestError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                      "'parameters': {...}}}}")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"]):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": {**fn, "parameters": dict(params)}})
    return out


def validate_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """``tool_choice``: "auto", "none", "required" or ``{"type": "function", "function": {"name"}}``."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequestError(
                f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}")
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs tools")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) and isinstance(
        choice.get("function"), Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice must be 'auto', 'none', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}")
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools")
    return {"type": "function", "function": {"name": name}}


def _ws(schema: dict[str, Any]) -> dict[str, Any]:
    from .grammar import JSON_OPTIONS  # the bounded whitespace of every JSON grammar

    return {**schema, "x-guidance": dict(JSON_OPTIONS)}


def _call_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    return _ws({"oneOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]}, args_key: t["function"]["parameters"]},
        "required": ["name", args_key], "additionalProperties": False} for t in tools]})


def _props(tool: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """(name, schema, required) of a tool's parameters in schema order, required ones first."""
    params = tool["function"]["parameters"]
    props = params.get("properties") or {}
    req = set(params.get("required") or [])
    return [(k, v, True) for k, v in props.items() if k in req] + \
        [(k, v, False) for k, v in props.items() if k not in req]


def _args_rules(tools: list[dict[str, Any]]) -> str:
    """Rules ``args<i>``: tool i's arguments as one JSON object valid for its parameters' schema."""
    return "".join(f"args{i}: %json {json.dumps(_ws(t['function']['parameters']))}\n" for i, t in enumerate(tools))


def _json_value(schema: dict[str, Any]) -> str:
    return f"%json {json.dumps(_ws(schema))}"


def _keyword_args(i: int, tool: dict[str, Any], arg: Callable[[str, str], str], sep: str,
                  value: Callable[[dict[str, Any]], str] = _json_value) -> tuple[str, str]:
    """Grammar of one tool's arguments written one by one (``arg(key, value_rule)``, joined by
    ``sep``), and the value rules (``value(property schema)``; default: JSON valid for it). Required
    arguments come first, in schema order, then any optional ones in order."""
    req, opt, rules = [], [], []
    for j, (k, schema, required) in enumerate(_props(tool)):
        rules.append(f"v{i}_{j}: {value(schema)}\n")
        (req if required else opt).append(arg(k, f"v{i}_{j}"))
    if req:
        body = f" {sep} ".join(req) + "".join(f" ({sep} {o})?" for o in opt)
    elif opt:  # no required argument: the first one written opens the list
        body = "(" + opt[0] + "".join(f" ({sep} {o})?" for o in opt[1:]) + ")?"
    else:
        body = ""
    return body, "".join(rules)


def call_grammar(fmt: str, tools: list[dict[str, Any]], parallel: bool, special: Callable[[str], str]) -> str:
    """A Lark grammar (llguidance) whose every sentence is one call (or several when ``parallel``)
    to one of ``tools`` in format ``fmt``, arguments valid for its schema. ``special(text)``
    writes a marker as the grammar must name it (a special token or a quoted string)."""
    if fmt in ("hermes", "qwen3-coder"):
        one = f'{special("<tool_call>")} "\\n" call "\\n" {special("</tool_call>")}'
        body, args_key = (f'{one} ("\\n" {one})*' if parallel else one), "arguments"
    elif fmt == "mistral":
        arr = _ws({"type": "array", "items": _call_schema(tools), "minItems": 1})
        if not parallel:
            arr["maxItems"] = 1
        return f"start: {special('[TOOL_CALLS]')} calls\ncalls: %json {json.dumps(arr)}\n"
    elif fmt == "granite":
        arr = _ws({"type": "array", "items": _call_schema(tools), "minItems": 1})
        if not parallel:
            arr["maxItems"] = 1
        return f"start: {special('<|tool_call|>')} calls\ncalls: %json {json.dumps(arr)}\n"
    elif fmt == "llama3":
        body, args_key = ('call ("; " call)*' if parallel else "call"), "parameters"
    elif fmt == "kimi-k2":
        # <|tool_calls_section_begin|> (<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS
        # <|tool_call_end|>)+ <|tool_calls_section_end|>, as llama.cpp's kimi-k2 grammar
        sb, se, cb, ab, ce = (special(t) for t in ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                                   "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                                   "<|tool_call_end|>"))
        alts = " | ".join(f'{cb} "functions.{t["function"]["name"]}:" IDX {ab} args{i} {ce}'
                          for i, t in enumerate(tools))
        rules = _args_rules(tools)
        return f"start: {sb} call{'+' if parallel else ''} {se}\nIDX: /[0-9]+/\ncall: {alts}\n{rules}"
    elif fmt == "deepseek":
        # both DeepSeek call styles (the model writes its own): R1's "function<sep>NAME" + fenced JSON,
        # V3.1's "NAME<sep>JSON", inside <｜tool▁calls▁begin｜> … <｜tool▁calls▁end｜>
        tb, te, cb, ce, sep = (special(t) for t in ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                                   "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"))
        alts = " | ".join(f'{cb} ("function" {sep} "{t["function"]["name"]}\\n```json\\n" args{i} "\\n```" | '
                          f'"{t["function"]["name"]}" {sep} args{i}) {ce}' for i, t in enumerate(tools))
        rules = _args_rules(tools)
        return f"start: {tb} call{'+' if parallel else ''} {te}\ncall: {alts}\n{rules}"
    elif fmt == "glm":
        # <tool_call>NAME(\n)<arg_key>K</arg_key>(\n)<arg_value>V</arg_value>(\n)…</tool_call>: string
        # values raw (no "<"), others JSON, as parse_glm reads them (GLM-4.5/4.6 put newlines, 4.7 none)
        tc, te, ks, ke, vs, ve = (special(t) for t in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                                                       "<arg_value>", "</arg_value>"))
        def glm_value(schema: dict[str, Any]) -> str:  # plain strings are written raw: text without "<"
            plain = schema.get("type") == "string" and not ({"enum", "const", "pattern"} & set(schema))
            return "RAW" if plain else _json_value(schema)

        alts, rules = [], []
        for i, t in enumerate(tools):
            body, r = _keyword_args(i, t, lambda k, v: f'{ks} "{k}" {ke} NL? {vs} {v} {ve} NL?', "", glm_value)
            alts.append(f'{tc} "{t["function"]["name"]}" NL? {body} {te}')
            rules.append(r)
        calls = "call (NL? call)*" if parallel else "call"
        return (f"start: {calls}\ncall: {' | '.join(alts)}\nNL: /\\n/\nRAW: /[^<]*/\n" + "".join(rules))
    elif fmt == "lfm2":
        # <|tool_call_start|>[name(key=VALUE, …), …]<|tool_call_end|>: Python call syntax with JSON values
        alts, rules = [], []
        for i, t in enumerate(tools):
            body, r = _keyword_args(i, t, lambda k, v: f'"{k}=" {v}', '", "')
            alts.append(f'"{t["function"]["name"]}(" {body} ")"')
            rules.append(r)
        calls = 'call (", " call)*' if parallel else "call"
        return (f'start: {special("<|tool_call_start|>")} "[" {calls} "]" {special("<|tool_call_end|>")}\n'
                f"call: {' | '.join(alts)}\n" + "".join(rules))
    elif fmt == "command-r7b":
        items = {"oneOf": [{"type": "object", "properties": {
            "tool_call_id": {"type": "string"}, "tool_name": {"const": t["function"]["name"]},
            "parameters": t["function"]["parameters"]}, "required": ["tool_call_id", "tool_name", "parameters"],
            "additionalProperties": False} for t in tools]}
        arr = _ws({"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})})
        return (f"start: {special('<|START_ACTION|>')} calls {special('<|END_ACTION|>')}\n"
                f"calls: %json {json.dumps(arr)}\n")
    elif fmt == "functionary-v3.2":
        # the prompt ends with ">>>": NAME newline ARGS, further calls after ">>>"
        alts = " | ".join(f'"{t["function"]["name"]}\\n" args{i}' for i, t in enumerate(tools))
        rules = _args_rules(tools)
        more = ' (">>>" call)*' if parallel else ""
        return f"start: call{more}\ncall: {alts}\n{rules}"
    elif fmt == "gpt-oss":
        # llama.cpp's gpt-oss shape: any analysis messages, then one commentary message to
        # functions.NAME (harmony ends a turn at a call: several calls take several turns)
        ch, msg, end, st = (special(t) for t in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
        alts = " | ".join(f'{ch} "commentary to=functions.{t["function"]["name"]}" constrain? {msg} args{i}'
                          for i, t in enumerate(tools))
        rules = _args_rules(tools)
        return (f"start: analysis* call\n"
                f'analysis: {ch} "analysis" {msg} THOUGHT {end} {st} "assistant"\n'
                f"THOUGHT: /(.|\\n)*/\n"
                f'constrain: " " {special("<|constrain|>")}? "json"\n'
                f"call: {alts}\n{rules}")
    elif fmt == "functionary-v3.1":
        alts = " | ".join(f'"<function={t["function"]["name"]}>" args{i} "</function>"' for i, t in enumerate(tools))
        rules = _args_rules(tools)
        return f"start: one{'+' if parallel else ''}\none: {alts}\n{rules}"
    else:
        raise InvalidRequestError(f"tool_choice 'required' or a named function is not supported for the "
                                  f"{fmt} tool-call format")
    return f"start: {body}\ncall: %json {json.dumps(_call_schema(tools, args_key))}\n"


@dataclass
class ToolPlan:
    """The tool options of one chat request: what the template shows, how the output is parsed,
    and the grammar that forces a call (``tool_choice`` "required" or a named function)."""

    tools: list[dict[str, Any]]
    choice: str | dict[str, Any]
    parallel: bool
    fmt: str

    @classmethod
    def build(cls, tools: Any, choice: Any, parallel: Any, template_source: str) -> ToolPlan | None:
        """None when the request has no tools; raises InvalidRequestError naming a bad option."""
        tl = validate_tools(tools)
        ch = validate_tool_choice(choice, tl)
        if parallel is not None and not isinstance(parallel, bool):
            raise InvalidRequestError(f"parallel_tool_calls must be a boolean, got {parallel!r}")
        if not tl:
            return None
        # several calls in one answer only when asked for: llama.cpp's default, and small models
        # given the choice tend to repeat a call until max_tokens
        return cls(tl, ch, bool(parallel), detect_format(template_source))

    @property
    def render_tools(self) -> list[dict[str, Any]] | None:
        """The tools the template shows the model (none when tool_choice is "none")."""
        return None if self.choice == "none" else self.tools

    @property
    def forced(self) -> list[dict[str, Any]] | None:
        """The tools one of which must be called, or None when the model may answer freely."""
        if self.choice == "required":
            return self.tools
        if isinstance(self.choice, dict):
            return [t for t in self.tools if t["function"]["name"] == self.choice["function"]["name"]]
        return None

    def grammar(self, special: Callable[[str], str]) -> str | None:
        forced = self.forced
        return None if forced is None else call_grammar(self.fmt, forced, self.parallel, special)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.choice == "none":
            return text, []
        content, calls = parse(text, self.fmt)
        if not calls:
            calls = bare_calls(text, {t["function"]["name"] for t in self.tools})
            content = "" if calls else content
        return (content if content.strip() else ""), calls if self.parallel else calls[:1]

    def stream(self) -> ToolStream | None:
        if self.choice == "none":
            return None
        return ToolStream(self.fmt, {t["function"]["name"] for t in self.tools})


def bare_calls(text: str, names: set[str]) -> list[ToolCall]:
    """Calls written without the format's markers: the whole answer one JSON object (or a list of
    them), bare or in a ```json fence, naming a given tool. Small models (Qwen2.5-Coder 0.5B)
    answer tool requests this way."""
    body = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", text)
    try:
        obj, end = _json_at(body, 0)
    except (json.JSONDecodeError, IndexError):
        return []
    if body[end:].strip():
        return []
    calls = [_obj_call(o) for o in (obj if isinstance(obj, list) else [obj])]
    return [c for c in calls if c is not None] if all(c is not None and c.name in names for c in calls) else []
