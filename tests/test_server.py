"""OpenAI-compatible HTTP server, exercised through real servers on loopback: the official
``openai`` client (chat and completions, streamed or not, logprobs), request validation and error
JSON, client disconnects cancelling generations, KV-budget refusals (503), per-request failures
(500) that leave the server serving, API keys, HTTPS, the ``minirt serve`` command, and one
end-to-end chat on the real Qwen model.

Expected outputs come from the runtime called directly (``server_llm.generate`` / ``server_llm.chat``), a path
that shares no code with the HTTP layer."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (pip install 'minirt[server]')")
openai = pytest.importorskip("openai", reason="the server tests need the openai client (pip install 'minirt[server]')")
pytest.importorskip("starlette", reason="the server needs starlette (pip install 'minirt[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'minirt[server]')")

import minirt  # noqa: E402
from minirt import openai_format  # noqa: E402
from minirt.server import BackgroundServer, build_app  # noqa: E402
from tests.server_support import wait_for  # noqa: E402

PROMPT = "the capital of France is"
MSGS = [{"role": "user", "content": "the capital of France?"}]
N_CTX = 128
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(server_llm):
    app = build_app(server_llm)
    with BackgroundServer(app) as srv:
        srv.state = app.state.minirt
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


# -- endpoints through the official client ---------------------------------------------------------
def test_health_and_models(server, client, server_llm):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "tiny.gguf"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny.gguf"]
    assert client.models.retrieve("tiny.gguf").id == "tiny.gguf"
    assert_error(httpx.get(server.url + "/v1/models/other.gguf"), 404, param="model", code="model_not_found")
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)


def test_completions_match_runtime(client, server_llm, server_tiny_path):
    ref = server_llm.generate(PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True, top_logprobs=2)
    def piece(t):
        return server_llm.tokenizer.token_to_piece(t).decode("utf-8", "replace")

    for model in ("tiny.gguf", "tiny", server_tiny_path):  # file name, stem or path of the loaded model
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
        ch = r.choices[0]
        assert ch.text == ref.text and ch.finish_reason == "length" and r.model == model
        assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(ref.prompt_ids)
        assert ch.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert ch.logprobs.tokens == [piece(t) for t in ref.token_ids]
        assert [sorted(t) for t in ch.logprobs.top_logprobs] == [sorted({piece(i) for i, _ in alts})
                                                                 for alts in ref.top_logprobs]
    # model omitted: the loaded model answers
    r = httpx.post(client.base_url.join("completions").__str__(),
                   json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text and r.json()["model"] == "tiny.gguf"

    chunks = list(client.completions.create(model="tiny.gguf", prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, logprobs=0, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    streamed_lps = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed_lps == pytest.approx(ref.logprobs, abs=1e-5)  # one per token, even empty-text ones


def test_chat_matches_runtime(client, server_llm):
    ref = server_llm.chat(MSGS, max_tokens=8, temperature=0.0, ignore_eos=True, top_logprobs=3)
    r = client.chat.completions.create(model="tiny.gguf", messages=MSGS, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == ref.text
    assert ch.finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(ref.prompt_ids) and r.usage.completion_tokens == 8
    assert [e.logprob for e in ch.logprobs.content] == pytest.approx(ref.logprobs, abs=1e-5)
    pieces = [list(server_llm.tokenizer.token_to_piece(t)) for t in ref.token_ids]
    assert [e.bytes for e in ch.logprobs.content] == pieces
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
               for e in ch.logprobs.content)

    # max_completion_tokens (the newer name) and stream_options.include_usage
    stream = client.chat.completions.create(model="tiny.gguf", messages=MSGS, max_completion_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            logprobs=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == ref.text
    lps = [e.logprob for c in chunks[:-1] if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps == pytest.approx(ref.logprobs, abs=1e-5)


def test_prompt_forms_and_sampling_fields(client, server_llm, server):
    ids = server_llm.tokenize(PROMPT)
    ref = server_llm.generate(ids, max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompt in (ids, [ids], [PROMPT], PROMPT):
        r = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text
    # echo puts the prompt in front
    r = client.completions.create(model="tiny.gguf", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPT + ref.text

    # logit_bias +100 forces a token; -100 keeps the greedy first token from being chosen
    forced = next(i for i in range(server_llm.n_vocab) if server_llm.tokenizer.token_to_piece(i) == b" Paris")
    r = client.completions.create(model="tiny.gguf", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [" Paris"] * 4
    banned = server_llm.generate(PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True,
                                 logit_bias={ref.token_ids[0]: -100})
    assert banned.token_ids[0] != ref.token_ids[0]
    r = client.completions.create(model="tiny.gguf", prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(ref.token_ids[0]): -100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == banned.text

    # a seed reproduces a sampled completion, the same one the runtime gives
    kw = dict(model="tiny.gguf", prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    assert client.completions.create(seed=1234, **kw).choices[0].text == a
    assert server_llm.generate(PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True).text == a
    ref_pen = server_llm.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True,
                           presence_penalty=1.5, frequency_penalty=1.0)
    r = client.completions.create(model="tiny.gguf", prompt=PROMPT, max_tokens=12, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=1.0, user="someone",
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref_pen.text

    # stop strings end the output before them
    full = server_llm.generate(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True).text
    stop = full[3:5]
    r = client.completions.create(model="tiny.gguf", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]


def test_concurrent_streams_equal_sequential_results(server, server_llm):
    """Eight streamed requests at once (batched by the scheduler) give what each gives alone."""
    prompts = [f"{PROMPT} w{i}" for i in range(8)]
    refs = [server_llm.generate(p, max_tokens=12, temperature=0.0, ignore_eos=True).text for p in prompts]
    out: dict[int, str] = {}

    def one(i):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        s = c.completions.create(model="tiny.gguf", prompt=prompts[i], max_tokens=12, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        out[i] = "".join(ch.choices[0].text for ch in s)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert [out.get(i) for i in range(8)] == refs


# -- validation and errors --------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/chat/completions", {"messages": MSGS, "n": 2}, "n", None),
    ("/v1/completions", {"prompt": PROMPT, "n": 3}, "n", None),
    ("/v1/chat/completions", {"messages": []}, "messages", None),
    ("/v1/chat/completions", {}, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", None),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": "hot"}, "temperature", None),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": -1}, "temperature", None),
    ("/v1/chat/completions", {"messages": MSGS, "top_p": 1.5}, "top_p", None),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 0}, "max_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2.5}, "max_tokens", None),
    ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": MSGS, "stream_options": {"include_usage": True}}, "stream_options", None),
    ("/v1/chat/completions", {"messages": MSGS, "stop": 5}, "stop", None),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"x": 1}}, "logit_bias", None),
    ("/v1/chat/completions", {"messages": MSGS, "logit_bias": {"5": 1000}}, "logit_bias", None),
    ("/v1/chat/completions", {"messages": MSGS, "stream": "yes"}, "stream", None),
    ("/v1/chat/completions", {"messages": MSGS, "tools": [{"type": "function"}]}, "tools", None),
    ("/v1/chat/completions", {"messages": MSGS, "model": 7}, "model", None),
    ("/v1/completions", {}, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": ""}, "prompt", None),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", None),
    ("/v1/completions", {"prompt": [1, "b"]}, "prompt", None),
    ("/v1/completions", {"prompt": [10**6]}, None, None),  # token id out of range (runtime check)
    ("/v1/completions", {"prompt": "w1 " * 200}, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1 " * 200}]}, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999": 5}}, None, None),
])
def test_invalid_requests_are_400(server, path, body, param, code):
    r = httpx.post(server.url + path, json=body)
    err = assert_error(r, 400, param=param, code=code)
    assert "Traceback" not in err["message"]


def test_any_model_name_is_served_and_bad_json_400(server, client, server_llm):
    # a single-model server answers to any name, as llama-server does, and echoes it
    want = server_llm.generate(PROMPT, max_tokens=5, temperature=0)
    r = client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.model == "gpt-4o" and r.choices[0].text == want.text
    ch = client.chat.completions.create(model="some/fixed-name", messages=MSGS, max_tokens=3, temperature=0)
    assert ch.model == "some/fixed-name" and ch.choices[0].message.content == server_llm.chat(
        MSGS, max_tokens=3, temperature=0).text
    assert_error(httpx.get(server.url + "/v1/models/gpt-4o"), 404, param="model", code="model_not_found")
    for bad in (b'{"prompt": "x",', b"\xff\xfe"):
        assert_error(httpx.post(server.url + "/v1/completions", content=bad, headers=JSON), 400, code="invalid_json")
    assert_error(httpx.post(server.url + "/v1/completions", json=["a"]), 400, code="invalid_json")
    assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": "x", "model": 3}), 400, param="model",
                 code="invalid_type")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as ei:
            c.chat.completions.create(model="tiny.gguf", messages=MSGS, n=2)
        assert ei.value.body["param"] == "n"


def test_strict_model_and_alias(server_llm):
    app = build_app(server_llm, model_id="my-alias", strict_model=True)
    with BackgroundServer(app) as srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == ["my-alias"]
        assert c.models.retrieve("my-alias").id == "my-alias"
        assert c.completions.create(model="my-alias", prompt=PROMPT, max_tokens=2).model == "my-alias"
        assert c.completions.create(model="tiny.gguf", prompt=PROMPT, max_tokens=2).model == "tiny.gguf"
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="gpt-4o", messages=MSGS)


def test_body_size_limit_413(server):
    big = json.dumps({"prompt": "a" * (5 << 20)}).encode()
    assert_error(httpx.post(server.url + "/v1/completions", content=big, headers=JSON), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(5):
            yield b" " * (1 << 20)

    assert_error(httpx.post(server.url + "/v1/completions", content=chunked(), headers=JSON), 413,
                 code="request_too_large")
    assert httpx.get(server.url + "/health").status_code == 200


def test_request_that_can_never_fit_the_kv_budget_is_400(server_tiny_path):
    with minirt.load(server_tiny_path, n_ctx=N_CTX) as m:
        m.configure_scheduler(kv_budget_tokens=50)
        with BackgroundServer(build_app(m)) as srv:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100})
            assert_error(r, 400, param="max_tokens", code="kv_budget_exceeded")
            # chat without max_tokens is capped to what the budget can hold, so it runs
            r = httpx.post(srv.url + "/v1/chat/completions",
                           json={"messages": MSGS, "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            assert r.json()["choices"][0]["finish_reason"] == "length" and u["total_tokens"] == 50


# -- disconnects ------------------------------------------------------------------------------------
def test_stream_disconnect_cancels_generation(server, server_llm, monkeypatch):
    state = server.state
    d0, max_tokens = state.disconnects, 115
    sched = server_llm.scheduler
    # the tiny model can finish all its tokens before the client has read two of them; pacing the
    # steps keeps the request running while the client reads and leaves
    step = server_llm.engine.step

    def paced_step(*a: object, **k: object) -> int:
        time.sleep(0.05)
        return step(*a, **k)

    monkeypatch.setattr(server_llm.engine, "step", paced_step)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n >= 2:
                    break
            (h,) = list(state.active.values())
            server_llm._step_lock.acquire()  # freeze the scheduler between steps while the client leaves
        # leaving the block closes the half-read response: the connection is dropped
    try:
        wait_for(lambda: state.disconnects > d0, what="the server to notice the disconnect")
        steps0 = sched.steps
    finally:
        server_llm._step_lock.release()
    c = h.result(10)
    assert c.finish_reason == "cancelled" and len(c.token_ids) < max_tokens
    wait_for(lambda: sched.stats()["running"] == 0, what="the scheduler to drop the request")
    assert sched.steps - steps0 <= 1  # cancelled at the first step after the disconnect
    assert httpx.get(server.url + "/health").json()["scheduler"]["running"] == 0


def test_nonstream_disconnect_cancels_generation(server, server_llm):
    state = server.state
    d0 = state.disconnects
    body = json.dumps({"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True}).encode()
    server_llm._step_lock.acquire()  # nothing runs until the client has gone
    try:
        s = socket.create_connection((server.host, server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: len(state.active) == 1, what="the request to be submitted")
        (h,) = list(state.active.values())
        wait_for(lambda: server_llm.scheduler.stats()["running"] == 1, what="the request to be admitted")
        s.close()
        wait_for(lambda: state.disconnects > d0, what="the server to notice the disconnect")
    finally:
        server_llm._step_lock.release()
    c = h.result(10)
    assert c.finish_reason == "cancelled" and c.token_ids == []
    wait_for(lambda: server_llm.scheduler.stats()["running"] == 0, what="the scheduler to drop the request")


# -- capacity and failures --------------------------------------------------------------------------
def test_kv_budget_full_is_503_with_retry_after(server_tiny_path):
    with minirt.load(server_tiny_path, n_ctx=N_CTX) as m:
        n_prompt = len(m.tokenize(PROMPT))
        budget = n_prompt + 100 + 20  # one request of 100 tokens fits, two do not
        m.configure_scheduler(kv_budget_tokens=budget, max_queue=1, n_parallel=4)
        app = build_app(m)
        body = {"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        results: dict[str, httpx.Response] = {}

        def post(name):
            results[name] = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

        with BackgroundServer(app) as srv:
            sched = m.scheduler
            m._step_lock.acquire()  # hold the batch still so A keeps its reservation
            try:
                ta = threading.Thread(target=post, args=("a",))
                ta.start()
                wait_for(lambda: sched.stats()["running"] == 1, what="A to be admitted")
                tb = threading.Thread(target=post, args=("b",))
                tb.start()
                wait_for(lambda: sched.stats()["waiting"] == 1, what="B to wait in the queue")
                others = [threading.Thread(target=post, args=(k,)) for k in ("c", "d", "e")]
                for t in others:
                    t.start()
                for t in others:
                    t.join(30)
            finally:
                m._step_lock.release()
            ta.join(60)
            tb.join(60)
            for k in ("c", "d", "e"):
                err = assert_error(results[k], 503, code="server_busy")
                assert results[k].headers["retry-after"] == "1" and "busy" in err["message"]
            for k in ("a", "b"):
                assert results[k].status_code == 200, results[k].text
                assert results[k].json()["usage"]["completion_tokens"] == 100
            assert app.state.minirt.refused == 3
            # room again once they finished
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_exception_in_one_request_is_500_and_server_keeps_serving(server, server_llm, client, monkeypatch):
    real_submit = server_llm.submit

    def flaky_submit(*a, **kw):
        if kw.get("seed") == 666:
            raise RuntimeError("simulated failure")
        return real_submit(*a, **kw)

    monkeypatch.setattr(server_llm, "submit", flaky_submit)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSGS, "seed": 666})
    err = assert_error(r, 500, code="internal_error")
    assert "RuntimeError" in err["message"]

    # a failure while a stream is already going: an error event ends that stream only
    def broken(*a, **kw):
        raise KeyError("simulated formatting failure")

    monkeypatch.setattr(openai_format, "chat_logprobs_content", broken)
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="tiny.gguf", messages=MSGS, max_tokens=5, stream=True,
                                            logprobs=True))
    monkeypatch.undo()
    errors = server.state.errors
    assert errors >= 2
    wait_for(lambda: server_llm.scheduler.stats()["running"] == 0, what="the failed stream to end")
    r = client.chat.completions.create(model="tiny.gguf", messages=MSGS, max_tokens=4, temperature=0)
    assert r.choices[0].message.content == server_llm.chat(MSGS, max_tokens=4, temperature=0.0).text
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


# -- API key and HTTPS -------------------------------------------------------------------------------
def test_api_key(server_llm):
    with BackgroundServer(build_app(server_llm, api_key="s3cret")) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert_error(r, 401, code="invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401, code="invalid_api_key")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model="tiny.gguf", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def _self_signed(dirpath: Path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = dirpath / "cert.pem", dirpath / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(certfile), str(keyfile)


def test_https_with_self_signed_certificate(server_llm, tmp_path):
    pytest.importorskip("cryptography", reason="generating a test certificate needs cryptography")
    certfile, keyfile = _self_signed(tmp_path)
    with BackgroundServer(build_app(server_llm), ssl_certfile=certfile, ssl_keyfile=keyfile) as srv:
        assert srv.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=certfile)
        with httpx.Client(verify=ctx) as hc:
            assert hc.get(srv.url + "/health").json()["status"] == "ok"
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", http_client=hc, max_retries=0)
            ref = server_llm.chat(MSGS, max_tokens=4, temperature=0.0)
            r = c.chat.completions.create(model="tiny.gguf", messages=MSGS, max_tokens=4, temperature=0)
            assert r.choices[0].message.content == ref.text
            s = c.chat.completions.create(model="tiny.gguf", messages=MSGS, max_tokens=4, temperature=0, stream=True)
            assert "".join(ch.choices[0].delta.content or "" for ch in s) == ref.text
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate refuses
            httpx.get(srv.url + "/health")
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served on the TLS port
            httpx.get(srv.url.replace("https://", "http://") + "/health")


# -- the command line ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses listening on ``port`` (from /proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # LISTEN
            out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return out


def test_minirt_serve_command(server_tiny_path, tmp_path):
    """`minirt serve` with its flags: default loopback bind, API key, HTTPS, scheduler options, clean exit."""
    certfile, keyfile = _self_signed(tmp_path)
    port = _free_port()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "minirt", "serve", "-m", server_tiny_path, "-c", "96",
                             "--port", str(port),
                             "--api-key", "k1", "--parallel", "3", "--queue", "5", "--kv-budget-tokens", "400",
                             "--ssl-certfile", certfile, "--ssl-keyfile", keyfile],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    hc = httpx.Client(verify=ssl.create_default_context(cafile=certfile), timeout=60)
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"minirt serve exited: {proc.stdout.read().decode(errors='replace')}")
            try:
                return hc.get(url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=90, what="minirt serve to start")
        if Path("/proc/net/tcp").exists():
            assert _listening_addresses(port) == {"127.0.0.1"}
        st = hc.get(url + "/health").json()["scheduler"]
        assert st["kv_budget_tokens"] == 400
        assert hc.get(url + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0, http_client=hc)
        m = c.models.list().data[0]
        assert m.id == "tiny.gguf" and m.meta["n_ctx"] == 96
        r = c.chat.completions.create(model="tiny.gguf", messages=MSGS, max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        hc.close()
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    assert rc == 0


# -- the real model end to end ---------------------------------------------------------------------
@pytest.mark.slow
def test_qwen_chat_through_openai_client(qwen_path):
    with minirt.load(str(qwen_path), n_ctx=512) as m, BackgroundServer(build_app(m)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=msgs, temperature=0,
                                      max_tokens=16)
        assert r.choices[0].message.content == "The capital of France is Paris."
        assert r.choices[0].finish_reason == "stop"
        s = c.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", messages=msgs, temperature=0,
                                      max_tokens=16, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in s) == "The capital of France is Paris."


# -- the load benchmark ----------------------------------------------------------------------------
def test_serve_load_bench_smoke(server_tiny_path, tmp_path):
    """bench/serve_load.py end to end on the tiny model: baseline, concurrent streams, and the
    disconnect check (server up, the rest complete, scheduler drained, RSS back)."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "load.json"
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MINIRT_LLAMA_SERVER", None)
    p = subprocess.run([sys.executable, str(root / "bench" / "serve_load.py"), "-m", server_tiny_path, "-n", "4",
                        "--max-tokens", "8", "-c", "96", "-r", "2", "--disconnect-fraction", "0.34",
                        "--disconnect-clients", "12", "--disconnect-max-tokens", "64",
                        "--time-limit", "240", "--log-dir", str(tmp_path), "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    load = rep["minirt"]["load"]
    assert load["completed"] == 4 and load["tokens"] == 4 * 8 and not load["failures"]
    assert rep["minirt"]["single"]["tokens"] == 8 and rep["minirt"]["ratio"] > 0
    rounds = rep["minirt"]["rounds"]
    assert len(rounds) == 2 and all(r["load"]["completed"] == 4 and r["ratio"] > 0 for r in rounds)
    assert rep["minirt"]["ratio"] == pytest.approx(sum(r["ratio"] for r in rounds) / 2)  # median of two
    assert "median of 2 rounds" in p.stdout
    assert load["ttft_p50_s"] > 0 and load["itl_p95_s"] >= load["itl_p50_s"] > 0
    dc = rep["disconnect"]
    assert dc["ok"] and 1 <= dc["dropped"] <= 4 and dc["kept"] == 8 and dc["drained"] and dc["rss_ok"]
    assert dc["server_saw_disconnects"] >= 1
    assert rep["llama_server"].startswith("missing") and "MISSING" in p.stdout


def test_serve_load_bench_alternates_with_peer(server_tiny_path, tmp_path):
    """The llama-server comparison path, with a stand-in peer (minirt itself behind llama-server's
    command line): both servers measured in alternating rounds, the summary and ratio printed, and
    the many-streams check."""
    root = Path(__file__).resolve().parents[1]
    fake = tmp_path / "llama-server"
    fake.write_text(f"""#!{sys.executable}
import argparse, os, sys
ap = argparse.ArgumentParser()
for a in ("-m", "--host", "--port", "-np", "-c", "-t"):
    ap.add_argument(a)
ap.add_argument("-cb", action="store_true")
a = ap.parse_args()
cmd = [sys.executable, "-m", "minirt", "serve", "-m", a.m, "--port", a.port, "--parallel", a.np,
       "-c", str(int(a.c) // int(a.np))]
os.execv(sys.executable, cmd)
""")
    fake.chmod(0o755)
    out = tmp_path / "load.json"
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MINIRT_LLAMA_SERVER": str(fake)}
    p = subprocess.run([sys.executable, str(root / "bench" / "serve_load.py"), "-m", server_tiny_path, "-n", "3",
                        "--max-tokens", "4", "-c", "96", "-r", "2", "--check-streams", "10", "--time-limit", "240",
                        "--log-dir", str(tmp_path), "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(" round ")]
    assert lines == [" round 1/2: minirt", " round 1/2: llama-server", " round 2/2: llama-server",
                     " round 2/2: minirt"]
    for name in ("minirt", "llama_server"):
        assert len(rep[name]["rounds"]) == 2 and not rep[name]["load"]["failures"]
        assert rep[name]["load"]["tokens"] == 3 * 4
    assert rep["minirt_vs_llama_server"] > 0 and "minirt / llama-server aggregate:" in p.stdout
    assert rep["many_streams"]["ok"] and rep["many_streams"]["summary"]["completed"] == 10
