"""Message preparation for real chat templates (tests/data/templates, copied from llama.cpp's
models/templates): minirt's rendering of OpenAI-shaped conversations (tool definitions, assistant
tool calls with ``content: null`` or ``""``, tool results, content-part lists, reasoning, template
kwargs) equals transformers' ``apply_chat_template`` rendering of the same conversations prepared
the way llama.cpp prepares them, for every case transformers renders; the others raise a typed
error, never a crash. Regenerate with ``tools/template_fixtures.py``."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import pytest

import minirt
from minirt import chat as chat_mod
from minirt.chat import ChatTemplate

DATA = Path(__file__).parent / "data" / "templates"
EXPECTED = json.loads((DATA / "expected.json").read_text(encoding="utf-8"))
NOW = _dt.datetime.fromisoformat(EXPECTED["now"])
PAIRS = [(t, c) for t in EXPECTED["templates"] for c in EXPECTED["cases"]]


class _Fixed(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return NOW


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):
    class Mod:  # what minirt.chat reads as ``datetime`` (strftime_now)
        datetime = _Fixed

    monkeypatch.setattr(chat_mod, "datetime", Mod)


_TEMPLATES: dict[str, ChatTemplate] = {}


def template(name: str) -> ChatTemplate:
    if name not in _TEMPLATES:
        _TEMPLATES[name] = ChatTemplate((DATA / f"{name}.jinja").read_text(encoding="utf-8"), name=name,
                                        **EXPECTED["tokens"])
    return _TEMPLATES[name]


@pytest.mark.parametrize("name", list(EXPECTED["templates"]))
def test_capabilities_probed_like_the_reference(name):
    rec = EXPECTED["templates"][name]
    assert template(name).caps == {"typed_content": rec["typed_content"], "object_arguments": rec["object_arguments"]}


@pytest.mark.parametrize("name, case", PAIRS, ids=[f"{t}-{c}" for t, c in PAIRS])
def test_rendering_matches_transformers(name, case):
    c = EXPECTED["cases"][case]
    want = EXPECTED["templates"][name]["renders"][case]
    render = lambda: template(name).render(c["messages"], add_generation_prompt=True, tools=c.get("tools"),  # noqa: E731
                                           **c.get("kwargs", {}))
    if want is None:  # transformers fails too: a typed error naming the template's problem
        with pytest.raises(minirt.TemplateError):
            render()
    else:
        assert render() == want


def test_the_issue_cases_are_covered():
    """content: null no longer raises (gpt-oss, Ministral-3, LFM2.5, Bielik) nor prints None (GLM-4.6/4.7,
    Command R+, MiniMax-M2); parts reach templates that read them (Gemma 4, Granite 4, MiniMax-M1, Reka);
    reasoning_content is also given as thinking (gpt-oss and LFM2.5 read it)."""
    t = EXPECTED["templates"]
    for name in ("openai-gpt-oss-120b", "mistralai-Ministral-3-14B-Reasoning-2512", "LFM2.5-8B-A1B",
                 "Bielik-11B-v3.0-Instruct", "GLM-4.6", "GLM-4.7-Flash", "MiniMax-M2"):
        out = t[name]["renders"]["call_null"]
        assert out is not None and "None" not in out and "get_weather" in out, name
    for name in ("google-gemma-4-31B-it", "ibm-granite-granite-4.0", "MiniMax-M1", "Reka-Edge"):
        assert t[name]["typed_content"], name
    prepared = template("LFM2.5-8B-A1B").prepare(chat_mod._normalize_messages(EXPECTED["cases"]["reasoning"]["messages"]))
    assert prepared[1]["thinking"] == prepared[1]["reasoning_content"] == "France's capital is Paris."
    # gpt-oss keeps the analysis of the turn still in progress (a tool call waiting for its result)
    call = EXPECTED["cases"]["call_null"]
    msgs = [dict(m) for m in call["messages"]]
    msgs[2]["reasoning_content"] = "Need the weather tool."
    out = template("openai-gpt-oss-120b").render(msgs, tools=call["tools"])
    assert "<|channel|>analysis<|message|>Need the weather tool.<|end|>" in out


ECHO = ("{% for m in messages %}[{{ m.role }}|{{ m.content if m.content is string else m.content | map(attribute='text')"
        " | join('+') }}|{{ m.tool_calls[0].function.arguments | tojson if m.tool_calls else '' }}"
        "|{{ m.tool_call_id or '' }}|{{ m.thinking or '' }}]{% endfor %}|{{ enable_thinking }}|{{ reasoning_effort }}")
CONVO = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
         {"role": "assistant", "content": None, "reasoning_content": "hmm",
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
ECHOED = '[user|a+b|||][assistant||{"city": "Oslo"}||hmm][tool|cold||c1|]|False|high'


def test_chat_and_server_pass_messages_and_template_kwargs(tmp_path):
    from tests.tiny_models import TinySpec, write_tiny

    write_tiny(tmp_path / "t.gguf", TinySpec(n_layer=1, seed=1))
    with minirt.load(tmp_path / "t.gguf", n_ctx=256, chat_template=ECHO) as llm:
        assert llm.chat_template.caps == {"typed_content": True, "object_arguments": True}
        kw = {"enable_thinking": False, "reasoning_effort": "high"}
        c = llm.chat(CONVO, max_tokens=1, trace=True, chat_template_kwargs=kw)
        assert c.trace.rendered == ECHOED
        with pytest.raises(minirt.InvalidRequestError, match="chat_template_kwargs"):
            llm.chat(CONVO, max_tokens=1, chat_template_kwargs={"messages": []})
        httpx = pytest.importorskip("httpx")
        from minirt.server import BackgroundServer, build_app

        with BackgroundServer(build_app(llm)) as srv:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "messages": CONVO, "max_tokens": 1, "reasoning_effort": "high",
                "chat_template_kwargs": {"enable_thinking": False}})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(llm._chat_ids(ECHOED))
