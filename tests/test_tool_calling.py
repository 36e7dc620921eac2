"""Tool calling end to end: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` through
``create_chat_completion``, ``chat`` and the server. On a tiny random model with Qwen2.5's real
template, a forced call (``required`` or a named function) is always a schema-valid call, whole
and streamed; on the real Qwen model, the official ``openai`` client does a tools round trip
(call → tool result → answer), streamed and not, and ``tool_choice="required"`` always yields a
valid call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import minirt
from tests.tiny_models import TinySpec, write_tiny

QWEN_TEMPLATE = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 12},
                                          "unit": {"enum": ["C", "F"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
                                      "parameters": {"type": "object", "properties": {
                                          "tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                                          "required": ["tz"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid(call: dict) -> None:
    assert call["type"] == "function" and call["id"]
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F") and len(args["city"]) <= 12
    else:
        assert call["function"]["name"] == "get_time" and set(args) == {"tz"} and len(args["tz"]) == 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("tools") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=8, n_ctx=2048))
    m = minirt.load(p, n_ctx=2048, chat_template=QWEN_TEMPLATE)
    yield m
    m.close()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_call_on_random_model_is_always_valid(tiny, choice):
    for seed in range(4):
        r = tiny.create_chat_completion(ASK, max_tokens=400, temperature=1.0, seed=seed, tools=TOOLS, tool_choice=choice)
        ch = r["choices"][0]
        assert ch["finish_reason"] == "tool_calls", ch
        calls = ch["message"]["tool_calls"]
        assert len(calls) == 1 and ch["message"]["content"] is None
        _valid(calls[0])
        if isinstance(choice, dict):
            assert calls[0]["function"]["name"] == "get_time"


def test_forced_parallel_calls_and_streaming(tiny):
    kw = dict(max_tokens=300, temperature=1.0, seed=3, tools=TOOLS, tool_choice="required", parallel_tool_calls=True)
    whole = tiny.create_chat_completion(ASK, **kw)["choices"][0]
    chunks = list(tiny.create_chat_completion(ASK, stream=True, **kw))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert [t["index"] for t in streamed] == list(range(len(streamed)))
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in streamed] == \
        [(t["function"]["name"], t["function"]["arguments"]) for t in whole["message"]["tool_calls"]]
    assert not "".join(d.get("content") or "" for d in deltas).strip()
    for t in streamed:
        _valid(t)


def test_tool_choice_none_and_chat_api(tiny):
    r = tiny.create_chat_completion(ASK, max_tokens=8, temperature=0.0, tools=TOOLS, tool_choice="none")
    assert "tool_calls" not in r["choices"][0]["message"]
    c = tiny.chat(ASK, max_tokens=200, temperature=1.0, seed=1, tools=TOOLS, tool_choice="required")
    assert c.tool_calls and c.tool_calls[0].name in ("get_weather", "get_time") and c.content == ""
    assert "<tool_call>" in c.text
    with pytest.raises(minirt.InvalidRequestError, match="not in tools"):
        tiny.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(minirt.InvalidRequestError, match="cannot be combined"):
        tiny.chat(ASK, tools=TOOLS, tool_choice="required", json_schema={"type": "object"})


def test_server_forced_call(tiny):
    openai = pytest.importorskip("openai")
    from minirt.server import BackgroundServer, build_app

    with BackgroundServer(build_app(tiny)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                      max_tokens=200, temperature=1.0, seed=2)
        assert r.choices[0].finish_reason == "tool_calls"
        _valid(r.choices[0].message.tool_calls[0].model_dump())
        stream = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=2, stream=True)
        calls = [tc for ch in stream for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices]
        assert [(t.function.name, t.function.arguments) for t in calls] == \
            [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls]
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="tiny", messages=ASK, tools=[{"type": "function"}])


# -- the real Qwen model through the official client -----------------------------------------------
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def qwen_client(qwen_path):
    openai = pytest.importorskip("openai")
    from minirt.server import BackgroundServer, build_app

    with minirt.load(str(qwen_path), n_ctx=2048) as m, BackgroundServer(build_app(m)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600) as c:
        yield c


def test_qwen_tools_round_trip(qwen_client):
    c = qwen_client
    msgs = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    r = c.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=msgs, tools=WEATHER, temperature=0, max_tokens=64)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    # streamed: the same call, as tool_calls deltas
    s = c.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=msgs, tools=WEATHER, temperature=0, max_tokens=64, stream=True)
    chunks = [x for x in s if x.choices]
    deltas = [tc for x in chunks for tc in (x.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    # the tool's result goes back; the model answers with it
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    r2 = c.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=msgs, tools=WEATHER, temperature=0, max_tokens=48)
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert "21" in r2.choices[0].message.content
    s2 = c.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=msgs, tools=WEATHER, temperature=0, max_tokens=48, stream=True)
    assert "".join(x.choices[0].delta.content or "" for x in s2 if x.choices) == r2.choices[0].message.content


def test_qwen_required_always_valid(qwen_client):
    prompts = ["Hi there!", "Tell me a joke.", "Is it raining in Tokyo?", "What is 2+2?", "Plan my trip to Rome."]
    for p in prompts:
        r = qwen_client.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=[{"role": "user", "content": p}], tools=WEATHER,
                                                tool_choice="required", temperature=0, max_tokens=48)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (p, ch.message)
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
