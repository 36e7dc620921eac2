"""Regenerate tests/data/templates/: real chat templates from llama.cpp's models/templates and
transformers' rendering of a few conversations through each (tool definitions, assistant tool
calls with ``content: null`` / ``""``, tool results, content-part lists, reasoning, template
kwargs).

Messages are given to transformers prepared as llama.cpp prepares them (its own probing of what
a template reads, written here independently of minirt): ``content: null`` as ``""``;
content-part lists kept for templates that print a list part's text and joined with newlines for
the others; tool-call arguments parsed from their JSON string for templates that read them as
an object; ``reasoning_content`` also given as ``thinking``.

    /work/tools/refvenv/bin/python tools/template_fixtures.py LLAMA_CPP_TEMPLATES_DIR

Needs transformers (not a dependency of minirt); the tests read only the committed output.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import shutil
import sys
from pathlib import Path

import transformers.utils.chat_template_utils as ctu

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "templates"
TEMPLATES = [
    "openai-gpt-oss-120b", "mistralai-Ministral-3-14B-Reasoning-2512", "LFM2.5-Instruct", "LFM2.5-8B-A1B",
    "LFM2-8B-A1B", "Bielik-11B-v3.0-Instruct", "GLM-4.6", "GLM-4.7-Flash", "CohereForAI-c4ai-command-r-plus-tool_use",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use", "MiniMax-M1", "MiniMax-M2", "google-gemma-4-31B-it",
    "ibm-granite-granite-4.0", "ibm-granite-granite-3.3-2B-Instruct", "Reka-Edge", "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B", "Qwen3-Coder", "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
    "mistralai-Mistral-Nemo-Instruct-2407", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-ai-DeepSeek-V3.1",
    "meetkai-functionary-medium-v3.2", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "HuggingFaceTB-SmolLM3-3B",
    "moonshotai-Kimi-K2",
]
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
FIXED_NOW = _dt.datetime(2026, 1, 15, 12, 0, 0)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
CALL = {"id": "abc123XYZ", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}


def _call_case(content):
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": "18C, sunny"}]


CASES = {
    "plain": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of Peru?"}]},
    "tools": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
    "call_null": {"messages": _call_case(None), "tools": TOOLS},
    "call_empty": {"messages": _call_case(""), "tools": TOOLS},
    "parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "First part."},
                                                        {"type": "text", "text": "Second part."}]},
                           {"role": "assistant", "content": "Noted."},
                           {"role": "user", "content": [{"type": "text", "text": "Again?"}]}]},
    "reasoning": {"messages": [{"role": "user", "content": "Capital of France?"},
                               {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."},
                               {"role": "user", "content": "And Spain?"}]},
    "kwargs": {"messages": [{"role": "user", "content": "Hi!"}],
               "kwargs": {"enable_thinking": False, "reasoning_effort": "high"}},
}
MARK = "ProbeMarker"


class _FixedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


def render(src, messages, tools=None, **kw):
    return ctu.render_jinja_template(conversations=[messages], tools=tools, chat_template=src,
                                     add_generation_prompt=True, **TOKENS, **kw)[0][0]


def _try(src, messages, tools=None):
    try:
        return render(src, messages, tools)
    except Exception:
        return ""


def caps(src):
    out = _try(src, [{"role": "user", "content": [{"type": "text", "text": MARK}]}])
    typed = MARK in out and f"'text': '{MARK}'" not in out and f'"text": "{MARK}"' not in out

    def with_args(args):
        call = {"id": "call_1", "type": "function", "function": {"name": "tool1", "arguments": args}}
        tools = [{"type": "function", "function": {"name": "tool1", "description": "Tool description", "parameters": {
            "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}]
        return _try(src, [{"role": "user", "content": "User message"},
                          {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "Tool result"},
                          {"role": "user", "content": "Next"}], tools)

    s = json.dumps({"arg": MARK})
    return typed, MARK in with_args({"arg": MARK}) and s not in with_args(s)


def prepare(messages, typed, obj_args):
    msgs = copy.deepcopy(messages)
    for m in msgs:
        if m.get("content") is None:
            m["content"] = ""
        elif isinstance(m["content"], list) and not typed:
            m["content"] = "\n".join(p["text"] for p in m["content"])
        if "reasoning_content" in m:
            m["thinking"] = m["reasoning_content"]
        for c in m.get("tool_calls", []):
            if obj_args and isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return msgs


def main() -> None:
    src_dir = Path(sys.argv[1])
    ctu.datetime = _FixedDatetime  # strftime_now() in gpt-oss / Granite: a fixed day
    OUT.mkdir(parents=True, exist_ok=True)
    expected: dict = {"now": FIXED_NOW.isoformat(), "tokens": TOKENS, "cases": CASES, "templates": {}}
    for name in TEMPLATES:
        src = (src_dir / f"{name}.jinja").read_text(encoding="utf-8")
        shutil.copyfile(src_dir / f"{name}.jinja", OUT / f"{name}.jinja")
        typed, obj = caps(src)
        rec = {"typed_content": typed, "object_arguments": obj, "renders": {}}
        for case, c in CASES.items():
            try:
                rec["renders"][case] = render(src, prepare(c["messages"], typed, obj), c.get("tools"),
                                              **c.get("kwargs", {}))
            except Exception as e:  # transformers cannot render it: the test only checks minirt does not crash
                rec["renders"][case] = None
                print(f"{name} {case}: transformers failed: {type(e).__name__}: {e}", file=sys.stderr)
        expected["templates"][name] = rec
    (OUT / "expected.json").write_text(json.dumps(expected, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {len(TEMPLATES)} templates x {len(CASES)} cases to {OUT}")


if __name__ == "__main__":
    main()
