"""Structured output through the OpenAI-compatible server: OpenAI ``response_format``
(``json_object``, ``json_schema`` with ``strict``), llama.cpp's ``grammar`` / ``json_schema`` fields,
bad grammars answered 400, and ``client.chat.completions.parse`` with a pydantic model on the
real Qwen model (20 of 20 prompts valid)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (pip install 'minirt[server]')")
openai = pytest.importorskip("openai", reason="the server tests need the openai client (pip install 'minirt[server]')")
pytest.importorskip("starlette", reason="the server needs starlette (pip install 'minirt[server]')")
from pydantic import BaseModel, Field  # noqa: E402  (the openai client depends on pydantic)

import minirt  # noqa: E402
from minirt.server import BackgroundServer, build_app  # noqa: E402
from tests.tiny_models import TinySpec, write_tiny  # noqa: E402

MSGS = [{"role": "user", "content": "the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    p = tmp_path_factory.mktemp("srv") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=3, n_ctx=512))
    with minirt.load(p, n_ctx=512) as m, BackgroundServer(build_app(m)) as srv:
        yield srv


def _chat(srv, **body):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 200, **body}, timeout=60)
    return r


COMPACT = {"x-guidance": {"whitespace_pattern": "[ ]?"}}  # a random model's output stays short


def test_response_format_json_schema_strict(tiny_server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False, **COMPACT}
    for seed in range(3):
        r = _chat(tiny_server, temperature=1.0, seed=seed,
                  response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        v = json.loads(ch["message"]["content"])
        assert set(v) == {"ok", "n"} and isinstance(v["ok"], bool) and v["n"] in (1, 2, 3)
        assert ch["finish_reason"] == "stop"


def test_llama_cpp_grammar_and_json_schema_fields(tiny_server):
    r = _chat(tiny_server, temperature=1.0, seed=4, grammar='root ::= ("yes" | "no") "!"')
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes!", "no!")
    r = httpx.post(tiny_server.url + "/v1/completions", json={
        "prompt": "the", "max_tokens": 40, "temperature": 1.0, "seed": 2,
        "json_schema": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                        "minItems": 2, "maxItems": 3, **COMPACT}}, timeout=60)
    v = json.loads(r.json()["choices"][0]["text"])
    assert 2 <= len(v) <= 3 and all(0 <= x <= 99 for x in v)


def test_streamed_constrained_output(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
        parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny.gguf", messages=MSGS, max_tokens=30, temperature=1.0, seed=5, stream=True,
            extra_body={"grammar": 'root ::= [a-z]{3} "-" [0-9]{3}'})]
    assert re.fullmatch("[a-z]{3}-[0-9]{3}", "".join(parts))


@pytest.mark.parametrize("body, code", [
    ({"grammar": "root ::= nothing"}, "invalid_grammar"),
    ({"json_schema": {"type": "objct"}}, "invalid_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "invalid_grammar"),
    ({"response_format": {"type": "xml"}}, "invalid_grammar"),
    ({"response_format": "json"}, "invalid_type"),
    ({"grammar": 5}, "invalid_type"),
])
def test_bad_constraints_are_400(tiny_server, body, code):
    r = _chat(tiny_server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float
    landmarks: list[str] = Field(max_length=3)


CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Sydney", "Toronto", "Nairobi",
          "Madrid", "Berlin", "Seoul", "Hanoi", "Quito", "Dublin", "Athens", "Lagos", "Vienna", "Havana"]


@pytest.mark.slow
def test_qwen_parse_pydantic_20_of_20(qwen_path):
    with minirt.load(str(qwen_path), n_ctx=1024) as m, BackgroundServer(build_app(m)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600) as c:
        def ask(city: str):
            return c.chat.completions.parse(
                model="qwen2.5-coder-0.5b-instruct", response_format=City, temperature=0, max_tokens=120,
                messages=[{"role": "user", "content": f"Give facts about {city} (at most 3 landmarks)."}])

        with ThreadPoolExecutor(len(CITIES)) as ex:  # the server batches them
            results = list(ex.map(ask, CITIES))
    for city, r in zip(CITIES, results):
        ch = r.choices[0]
        assert ch.finish_reason == "stop", (city, ch.message.content)
        assert isinstance(ch.message.parsed, City), (city, ch.message.content)
