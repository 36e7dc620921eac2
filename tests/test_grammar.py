"""Constrained sampling (minirt.grammar): GBNF, JSON schema, JSON-object mode and regex enforced
while sampling, on a tiny random model (every output, however random, must match) and on both
real models (nested schemas, enums, arrays, an arithmetic GBNF grammar: 100% of outputs parse).
Also: typed errors for bad grammars, batching with one matcher per sequence, stop strings, EOG,
cancellation, and the mask being computed on the worker thread during the forward pass."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from pydantic import BaseModel, Field

import minirt
from minirt import grammar as gm
from tests.tiny_models import TinySpec, write_tiny

ARITH = r'''root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" num ("+" | "-" | "*") num ")"
num ::= [1-9] [0-9]{0,2}
'''
NUM = r"[1-9][0-9]{0,2}"
FACTOR = rf"(?:{NUM}|\({NUM}[-+*]{NUM}\))"
TERM = rf"{FACTOR}(?:[*/]{FACTOR}){{0,2}}"
ARITH_RE = re.compile(rf"{TERM}(?:[-+]{TERM}){{0,3}}")


class Address(BaseModel):
    city: str = Field(max_length=16)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)
    address: Address


class Colour(BaseModel):
    colour: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})
    shade: int = Field(ge=1, le=9)


class Scores(BaseModel):
    scores: list[int] = Field(min_length=1, max_length=4)
    labels: list[str] = Field(min_length=1, max_length=3)


def _bounded(schema: dict, top: bool = True, compact: bool = True) -> dict:
    """A schema whose every output is short: bounded strings, no extra keys, at most one space
    between tokens (llguidance's ``x-guidance`` options), so a random model's output ends."""
    if isinstance(schema, list):
        return [_bounded(v, False) for v in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("type") == "string" and not {"maxLength", "enum", "pattern"} & set(schema):
        schema = {**schema, "maxLength": 8}
    if schema.get("type") == "object":
        schema = {**schema, "additionalProperties": False}
    out = {k: _bounded(v, False) for k, v in schema.items()}
    if top and compact:
        out["x-guidance"] = {"whitespace_pattern": "[ ]?"}
    return out


CASES = [  # (name, request keywords, check(text))
    ("nested", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "strict": True, "schema": _bounded(Person.model_json_schema(), compact=False)}}},
     lambda t: Person.model_validate_json(t)),
    ("enum", {"json_schema": _bounded(Colour.model_json_schema(), compact=False)},
     lambda t: Colour.model_validate_json(t).colour in ("red", "green", "blue") or pytest.fail(t)),
    ("arrays", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "scores", "strict": True, "schema": _bounded(Scores.model_json_schema(), compact=False)}}},
     lambda t: Scores.model_validate_json(t)),
    ("json_object", {"response_format": {"type": "json_object"}},
     lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    ("gbnf", {"grammar": ARITH}, lambda t: ARITH_RE.fullmatch(t) or pytest.fail(repr(t))),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("grammar") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=5, n_ctx=512))
    m = minirt.load(p, n_ctx=512)
    yield m
    m.close()


# -- request options → grammar ---------------------------------------------------------------------
def test_grammar_source_forms():
    assert gm.grammar_source() is None
    assert gm.grammar_source(response_format={"type": "text"}) is None
    assert gm.grammar_source(response_format={"type": "json_object"}) == ("json_schema", {"type": "object"})
    assert gm.grammar_source(json_schema='{"type": "integer"}') == ("json_schema", {"type": "integer"})
    assert gm.grammar_source(json_schema=Colour)[1] == Colour.model_json_schema()
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}, "strict": True}}
    assert gm.grammar_source(response_format=rf) == ("json_schema", {"type": "boolean"})
    assert gm.grammar_source(response_format={"type": "regex", "regex": "a+"}) == ("regex", "a+")
    assert gm.grammar_source(grammar='root ::= "a"') == ("grammar", 'root ::= "a"')


@pytest.mark.parametrize("kw, message", [
    ({"grammar": "root ::= expr"}, "Rule 'expr' not found"),
    ({"grammar": 'root ::= "a'}, "invalid grammar"),
    ({"grammar": ""}, "non-empty"),
    ({"json_schema": {"type": "objct"}}, "objct"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": 42}, "must be a JSON schema object"),
    ({"response_format": {"type": "yaml"}}, "'yaml' is not one of"),
    ({"response_format": {"type": "json_schema"}}, "must be an object with a 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, "strict"),
    ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "invalid regex"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "give one of"),
])
def test_invalid_constraints_raise_typed_errors(tiny, kw, message):
    for call in (lambda: tiny.generate("the", max_tokens=4, **kw),
                 lambda: tiny.chat([{"role": "user", "content": "hi"}], max_tokens=4, **kw),
                 lambda: tiny.submit("the", max_tokens=4, **kw),
                 lambda: tiny.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, **kw),
                 lambda: tiny.create_completion("the", max_tokens=4, **kw)):
        with pytest.raises(minirt.GrammarError, match=re.escape(message)) as ei:
            call()
        assert isinstance(ei.value, minirt.InvalidRequestError)
    with pytest.raises(minirt.GrammarError, match=re.escape(message)):
        next(iter(tiny.stream("the", max_tokens=4, **kw)))


# -- tiny random model: whatever it samples must match -------------------------------------------
TINY_CASES = [c for c in CASES if c[0] != "json_object"]  # any JSON object is unbounded: real models only


@pytest.mark.parametrize("name, kw, check", TINY_CASES, ids=[c[0] for c in TINY_CASES])
def test_random_model_output_always_matches(tiny, name, kw, check):
    model = {"nested": Person, "enum": Colour, "arrays": Scores}.get(name)
    if model is not None:  # at most one space between tokens: random weights love whitespace
        kw = {"json_schema": _bounded(model.model_json_schema())}
    handles = [tiny.submit("the capital", max_tokens=300, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                           seed=seed, **kw) for seed in range(6)]  # batched: one matcher each
    for h in handles:
        c = h.result(120)
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        check(c.text)


def test_regex_and_choice(tiny):
    c = tiny.generate("the", max_tokens=20, temperature=1.0, seed=3,
                      response_format={"type": "regex", "regex": "[a-z]{3}-[0-9]{2}"})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", c.text) and c.finish_reason == "stop"
    seen = {tiny.generate("the", max_tokens=8, temperature=2.0, top_k=0, seed=s,
                          grammar='root ::= "yes" | "no" | "maybe"').text for s in range(8)}
    assert seen <= {"yes", "no", "maybe"} and seen


def test_ends_with_eog_not_in_token_ids(tiny):
    c = tiny.generate("the", max_tokens=20, temperature=0.0, grammar='root ::= "Paris"')
    assert c.text == "Paris" and c.finish_reason == "stop"
    assert tiny.detokenize(c.token_ids) == "Paris"
    assert not set(c.token_ids) & tiny.eog_ids


def test_ignore_eos_after_the_grammar_is_complete(tiny):
    c = tiny.generate("the", max_tokens=8, temperature=0.0, grammar='root ::= "ok"', ignore_eos=True)
    assert c.finish_reason == "length" and c.text.startswith("ok") and len(c.token_ids) == 8
    assert set(c.token_ids[len(tiny.tokenize("ok", add_special=False)):]) <= tiny.eog_ids


def test_stop_string_inside_constrained_output(tiny):
    c = tiny.generate("the", max_tokens=20, temperature=0.0, grammar='root ::= "abc,def"', stop=[","])
    assert (c.text, c.finish_reason) == ("abc", "stop")


def test_cancel_and_length(tiny):
    ev = threading.Event()
    seen = []

    def on_token(e):
        seen.append(e)
        if len(seen) == 3:
            ev.set()

    c = tiny.generate("the", max_tokens=100, temperature=1.0, seed=1, grammar='root ::= [a-z]{50}',
                      cancel=ev, on_token=on_token)
    assert c.finish_reason == "cancelled" and 3 <= len(c.token_ids) < 50
    c = tiny.generate("the", max_tokens=5, temperature=1.0, seed=1, grammar='root ::= [a-z]{50}')
    assert c.finish_reason == "length" and re.fullmatch("[a-z]{5}", c.text)


def test_unconstrained_neighbour_unchanged_in_batch(tiny):
    alone = tiny.generate("the capital of", max_tokens=24, temperature=0.0)
    hs = [tiny.submit("the", max_tokens=40, temperature=1.0, seed=s, grammar='root ::= [a-z]{4} " " [0-9]{3}')
          for s in range(3)]
    plain = tiny.submit("the capital of", max_tokens=24, temperature=0.0)
    for h in hs:
        assert re.fullmatch("[a-z]{4} [0-9]{3}", h.result(60).text)
    assert plain.result(60).token_ids == alone.token_ids


def test_streamed_text_equals_completion(tiny):
    kw = dict(max_tokens=60, temperature=1.0, seed=9, json_schema=_bounded(Colour.model_json_schema()))
    text = "".join(e.text for e in tiny.stream("the", **kw))
    assert text == tiny.generate("the", **kw).text
    Colour.model_validate_json(text)


def test_mask_is_computed_on_the_worker_during_the_forward_pass(tiny, monkeypatch):
    """Each mask for step t+1 is computed on the grammar thread while forward(t) runs."""
    events: list[tuple[str, float, str]] = []
    real_compute, real_forward = gm.Matcher.compute, tiny.model.forward

    def compute(self, token):
        events.append(("mask", time.perf_counter(), threading.current_thread().name))
        return real_compute(self, token)

    def forward(*a, **k):
        out = real_forward(*a, **k)
        time.sleep(0.02)  # a forward pass long enough that the mask thread surely runs within it
        events.append(("forward_end", time.perf_counter(), threading.current_thread().name))
        return out

    monkeypatch.setattr(gm.Matcher, "compute", compute)
    monkeypatch.setattr(tiny.model, "forward", forward)
    c = tiny.generate("the", max_tokens=12, temperature=1.0, seed=2, grammar='root ::= [a-z]{10}')
    assert len(c.text) == 10 and c.finish_reason == "stop"
    masks = [e for e in events if e[0] == "mask"]
    assert len(masks) == len(c.token_ids) + 1 and {e[2] for e in masks} == {"minirt-grammar_0"}
    # events alternate: every mask starts (and is timed) before the forward pass it overlaps ends
    kinds = [e[0] for e in events]
    assert kinds[:4] == ["mask", "forward_end", "mask", "forward_end"]


# -- real models -----------------------------------------------------------------------------------
PROMPTS = ["Describe a person who lives in Paris.", "Give me an example record.",
           "Reply with data about a robot."]


# Gemma-3 270M falls into repeating one value forever when the object's keys are free (json_object)
REAL_CASES = [(key, *c) for key in ("qwen", "gemma") for c in CASES if (key, c[0]) != ("gemma", "json_object")]


@pytest.mark.parametrize("key, name, kw, check", REAL_CASES, ids=[f"{c[0]}-{c[1]}" for c in REAL_CASES])
def test_real_models_outputs_parse(request, key, name, kw, check):
    llm = _real(request.getfixturevalue(f"{key}_path"))
    ask = {"gbnf": " Answer with an arithmetic expression.",
           "json_object": " Answer with a small JSON object: two keys, short values."}.get(name, " Answer in JSON.")
    msgs = [[{"role": "user", "content": p + ask}] for p in PROMPTS]
    hs = [llm.submit(messages=m, max_tokens=96, temperature=t, seed=7, **kw)
          for m in msgs for t in (0.0, 0.8)]
    for h in hs:
        c = h.result(600)
        assert c.finish_reason == "stop", (key, name, c.finish_reason, c.text)
        check(c.text)


_LOADED: dict = {}


def _real(path):
    if path not in _LOADED:
        for m in _LOADED.values():
            m.close()
        _LOADED.clear()
        _LOADED[path] = minirt.load(path, n_ctx=1024)
    return _LOADED[path]


def teardown_module(module):
    for m in _LOADED.values():
        m.close()
    _LOADED.clear()
