"""Tool-call parsers, one per format real models emit (strings in each model's own format, as
llama.cpp's tests/test-chat.cpp records them), whole and streamed in pieces; format detection
from the real templates; request validation; the grammar that forces a call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import minirt
from minirt import tools as T

W = {"city": "Paris"}
# (format, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [("get_weather", W)]),
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", W), ("get_time", {"tz": "CET"})]),
    ("hermes", "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", []),
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     "", [("get_weather", W)]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", W)]),
    ("llama3", '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", W)]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", W)]),
    ("llama3", '<|python_tag|>brave_search.call(query="weather in Paris")', "",
     [("brave_search", {"query": "weather in Paris"})]),
    ("llama3", "<|python_tag|>print(1 + 1)", "", [("python", {"code": "print(1 + 1)"})]),
    ("llama3", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "123456789"}]', "",
     [("get_weather", W)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}', "",
     [("get_weather", W), ("get_time", {"tz": "CET"})]),
    ("gpt-oss", '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', "", [("get_weather", W)]),
    ("gpt-oss", ' to=functions.get_weather<|channel|>analysis<|message|>{"city": "Paris"}', "", [("get_weather", W)]),
    ("gpt-oss", "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hello!", "Hello!", []),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Paris"}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [("get_weather", W)]),
    ("deepseek", 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Sure.", [("get_weather", W)]),
    ("functionary-v3.2", 'get_weather\n{"city": "Paris"}', "", [("get_weather", W)]),
    ("functionary-v3.2", 'all\nChecking.>>>get_weather\n{"city": "Paris"}', "Checking.", [("get_weather", W)]),
    ("functionary-v3.2", "all\nHello, world!", "Hello, world!", []),
    ("functionary-v3.1", '<function=get_weather>{"city": "Paris"}</function>', "", [("get_weather", W)]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [("get_weather", W)]),
    ("command-r7b", "<|START_THINKING|>I need the weather.<|END_THINKING|><|START_ACTION|>[\n"
                    '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}\n]<|END_ACTION|>',
     "", [("get_weather", W)]),
    ("command-r7b", "<|START_RESPONSE|>Hello, world!<|END_RESPONSE|>", "Hello, world!", []),
    ("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "",
     [("get_weather", W)]),
    ("glm", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
            "<arg_value>3</arg_value></tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    ("kimi-k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>', "", [("get_weather", W)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", W)]),  # SmolLM3 writes Hermes' format
    ("lfm2", 'Let me check.<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>', "Let me check.",
     [("get_weather", W)]),
    ("lfm2", "<|tool_call_start|>[set_config(config={\"enabled\": True, \"count\": 3}), toggle(on=true)]<|tool_call_end|>",
     "", [("set_config", {"config": {"enabled": True, "count": 3}}), ("toggle", {"on": True})]),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse(fmt, text, content, calls):
    got_content, got = T.parse(text, fmt)
    assert got_content.strip() == content.strip()
    assert _calls(got) == calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize("fmt, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_streamed_in_pieces(fmt, text, content, calls, step):
    s = T.ToolStream(fmt)
    out, got = "", []
    for i in range(0, len(text), step):
        d, c = s.feed(text[i:i + step])
        out += d
        got += c
        # a call is only emitted once complete and never twice
        assert len(got) <= len(calls)
    d, c = s.finish()
    out, got = out + d, got + c
    assert out.strip() == content.strip()
    assert _calls(got) == calls


def test_stream_never_leaks_a_marker_as_content():
    s = T.ToolStream("hermes")
    seen = ""
    for ch in 'Ok <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>':
        seen += s.feed(ch)[0]
        assert "<" not in seen
    assert seen == "Ok "


TEMPLATES = Path(__file__).parent / "data" / "templates"


@pytest.mark.parametrize("name, fmt", [
    ("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("Qwen-Qwen3-0.6B", "hermes"), ("Qwen3-Coder", "qwen3-coder"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes"), ("HuggingFaceTB-SmolLM3-3B", "hermes"),
    ("ibm-granite-granite-4.0", "hermes"), ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
    ("meta-llama-Llama-3.3-70B-Instruct", "llama3"), ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral"), ("openai-gpt-oss-120b", "gpt-oss"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek"), ("deepseek-ai-DeepSeek-V3.1", "deepseek"),
    ("meetkai-functionary-medium-v3.2", "functionary-v3.2"), ("ibm-granite-granite-3.3-2B-Instruct", "granite"),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "command-r7b"), ("GLM-4.6", "glm"), ("GLM-4.7-Flash", "glm"),
    ("moonshotai-Kimi-K2", "kimi-k2"), ("LFM2-8B-A1B", "lfm2"), ("LFM2.5-8B-A1B", "lfm2"),
])
def test_format_detected_from_real_templates(name, fmt):
    assert T.detect_format((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")) == fmt


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("tools, choice, match", [
    ("x", None, "tools must be a list"),
    ([{"type": "code"}], None, r"tools\[0\]"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "name must be"),
    (TOOLS, "sometimes", "tool_choice must be"),
    (None, "required", "needs tools"),
    (TOOLS, {"type": "function", "function": {"name": "other"}}, "not in tools"),
])
def test_invalid_tool_requests(tools, choice, match):
    with pytest.raises(minirt.InvalidRequestError, match=match):
        T.validate_tool_choice(choice, T.validate_tools(tools))


CALL_TEXTS = {  # one call to get_weather(city="Paris") as each format writes it
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "functionary-v3.1": '<function=get_weather>{"city": "Paris"}</function>',
    "functionary-v3.2": 'get_weather\n{"city": "Paris"}',
    "kimi-k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
               '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "command-r7b": '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
                   '"parameters": {"city": "Paris"}}]<|END_ACTION|>',
    "deepseek": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek-v3.1": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm": '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>',
    "lfm2": '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
    "gpt-oss": '<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant'
               '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
}


@pytest.fixture(scope="module")
def byte_engine(tmp_path_factory):
    """A grammar engine over a vocabulary with all 256 byte tokens: any text is a token sequence."""
    from minirt.grammar import GrammarEngine
    from tests.tiny_models import TinySpec, write_tiny

    p = tmp_path_factory.mktemp("bytes") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=1, specials=HARMONY))  # gpt-oss's markers are special tokens
    with minirt.load(str(p), n_ctx=64) as m:
        yield GrammarEngine(m.tokenizer, m.n_vocab), m.tokenizer


HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")


def _special(tk, fmt: str):
    """How the grammar names a marker: gpt-oss's as its token, every other format's as text."""
    return lambda t: f"<[{tk.token_to_id(t)}]>" if fmt == "gpt-oss" and t in HARMONY else json.dumps(t)


def _accepts(byte_engine, lark: str, text: str, fmt: str) -> bool:
    import re

    from minirt.grammar import Constraint

    engine, tk = byte_engine
    ll = Constraint(engine, "lark", lark).matcher().ll
    parts = re.split("(" + "|".join(map(re.escape, HARMONY)) + ")", text) if fmt == "gpt-oss" else [text]
    for part in parts:
        ids = [tk.token_to_id(part)] if part in HARMONY else [tk.token_to_id(f"<0x{b:02X}>") for b in part.encode()]
        for i in ids:
            if not ll.consume_token(i):
                return False
    return ll.is_accepting()


@pytest.mark.parametrize("fmt", sorted(CALL_TEXTS))
def test_call_grammar_accepts_the_formats_own_call(fmt, byte_engine):
    """The forcing grammar accepts the format's own call (markers written as text here) and its
    parser reads it back; a call to a tool that was not offered, or plain text, is rejected."""
    text = CALL_TEXTS[fmt]
    fmt = fmt.split("-v3.1")[0] if fmt.startswith("deepseek") else fmt  # one format, two call styles
    lark = T.call_grammar(fmt, T.validate_tools(TOOLS), False, _special(byte_engine[1], fmt))
    assert _accepts(byte_engine, lark, text, fmt)
    assert not _accepts(byte_engine, lark, text.replace("get_weather", "get_wether"), fmt)
    assert not _accepts(byte_engine, lark, "The weather in Paris is sunny.", fmt)
    assert _calls(T.parse(text, fmt)[1]) == [("get_weather", W)]


def test_keyword_argument_grammars_follow_the_schema(byte_engine):
    """GLM and LFM2 write arguments one by one: required ones must be there, optional ones may be,
    each value of its property's type; a call with several optional arguments is accepted."""
    tools = T.validate_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}, "b": {"type": "boolean"}},
        "required": ["n"]}}}])
    opt_only = T.validate_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}, "b": {"type": "boolean"}}}}}])
    lfm = T.call_grammar("lfm2", tools, False, json.dumps)
    s, e = "<|tool_call_start|>[", "]<|tool_call_end|>"
    assert _accepts(byte_engine, lfm, s + 'f(n=3, s="x", b=true)' + e, "lfm2")
    assert _accepts(byte_engine, lfm, s + "f(n=3)" + e, "lfm2")
    assert not _accepts(byte_engine, lfm, s + 'f(s="x")' + e, "lfm2")  # n is required
    assert not _accepts(byte_engine, lfm, s + 'f(n="3")' + e, "lfm2")  # n is an integer
    assert T.parse(s + 'f(n=3, s="x", b=true)' + e, "lfm2")[1][0].arguments == '{"n": 3, "s": "x", "b": true}'
    lfm_opt = T.call_grammar("lfm2", opt_only, False, json.dumps)
    for args in ("", 's="x"', 's="x", b=false'):
        assert _accepts(byte_engine, lfm_opt, s + f"f({args})" + e, "lfm2"), args
    glm = T.call_grammar("glm", tools, False, json.dumps)
    assert _accepts(byte_engine, glm, "<tool_call>f<arg_key>n</arg_key><arg_value>3</arg_value>"
                                      "<arg_key>s</arg_key><arg_value>a b</arg_value></tool_call>", "glm")
    assert not _accepts(byte_engine, glm, "<tool_call>f<arg_key>n</arg_key><arg_value>x</arg_value></tool_call>",
                        "glm")
