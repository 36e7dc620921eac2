"""Several models in one server (minirt.router): loaded on first use within a memory budget, the
least recently used idle one unloaded, in-flight requests never cut, keep_alive, and the HTTP side
(requests name the model, /v1/models lists states) through the official openai client.

Outputs are checked against each model loaded on its own with minirt.load."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

import minirt
from minirt.errors import CapacityError
from minirt.router import ModelNotFoundError, ModelRouter, model_cost, parse_keep_alive, parse_model_specs
from tests.tiny_models import TinySpec, write_tiny

N_CTX = 64
PROMPT = "the capital of France is"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("alpha", 1), ("beta", 2), ("gamma", 3)):
        write_tiny(d / f"{name}.gguf", TinySpec(n_layer=1, seed=seed))
        out[name] = str(d / f"{name}.gguf")
    return out


def _load(path):
    m = minirt.load(path, n_ctx=N_CTX)
    m.configure_scheduler(n_parallel=4, kv_budget_tokens=2 * N_CTX)
    return m


@pytest.fixture(scope="module")
def cost(files):
    m = _load(files["alpha"])
    try:
        return model_cost(m)
    finally:
        m.close()


@pytest.fixture(scope="module")
def expected(files):
    out = {}
    for name, path in files.items():
        with minirt.load(path, n_ctx=N_CTX) as m:
            out[name] = m.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True).text
    return out


def test_cost_counts_weights_and_kv(files, cost):
    import os

    m = _load(files["beta"])
    try:
        assert model_cost(m) == os.path.getsize(files["beta"]) + 2 * N_CTX * m.kv_bytes_per_token
    finally:
        m.close()


def test_lru_unload_within_budget(files, cost):
    loads = []

    def load(p):
        loads.append(p)
        return _load(p)

    r = ModelRouter(files, load, memory_budget=int(cost * 2.5))  # room for two
    try:
        for name in ("alpha", "beta"):
            r.acquire(name).release()
        assert {n for n, _ in r.loaded()} == {"alpha", "beta"}
        r.acquire("alpha").release()  # alpha is now the most recently used
        lease = r.acquire("gamma")  # needs room: beta (least recently used, idle) goes
        assert {n for n, _ in r.loaded()} == {"alpha", "gamma"}
        assert lease.llm.generate(PROMPT, max_tokens=1).usage["completion_tokens"] == 1
        lease.release()
        lease.release()  # idempotent
        states = {c["id"]: c["status"]["value"] for c in r.cards()}
        assert states == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        assert r.used_bytes() <= r.memory_budget and r.unloads == 1 and len(loads) == 3
        with pytest.raises(ModelNotFoundError):
            r.acquire("delta")
    finally:
        r.close()


def test_in_flight_model_is_never_unloaded(files, cost):
    r = ModelRouter(files, _load, memory_budget=int(cost * 1.5))  # room for one
    try:
        a = r.acquire("alpha")
        with pytest.raises(CapacityError) as ei:
            r.acquire("beta")
        assert ei.value.retryable
        assert not a.llm.closed and a.llm.generate(PROMPT, max_tokens=2).usage["completion_tokens"] == 2
        a.release()
        b = r.acquire("beta")
        assert a.llm.closed and [n for n, _ in r.loaded()] == ["beta"]
        b.release()
    finally:
        r.close()


def test_model_over_budget_is_not_retryable(files, cost):
    r = ModelRouter(files, _load, memory_budget=cost // 2)
    try:
        with pytest.raises(CapacityError) as ei:
            r.acquire("alpha")
        assert not ei.value.retryable and r.loaded() == []
    finally:
        r.close()


def test_keep_alive(files):
    now = [0.0]
    r = ModelRouter(files, _load, keep_alive=10.0, clock=lambda: now[0])
    try:
        r.acquire("alpha").release()
        now[0] = 5.0
        assert [n for n, _ in r.loaded()] == ["alpha"]
        now[0] = 16.0
        r.cards()  # any look at the router expires idle models past their keep_alive
        assert r.loaded() == []
        r.acquire("beta", keep_alive=0).release()  # 0: unloaded as soon as idle
        assert r.loaded() == []
    finally:
        r.close()
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("500ms") == 0.5 and parse_keep_alive(-1) == -1
    for bad in ("soon", True, float("nan"), "", "5x"):
        with pytest.raises(minirt.MinirtError):
            parse_keep_alive(bad)


def test_concurrent_first_use_loads_once(files):
    n = []

    def load(p):
        n.append(p)
        return _load(p)

    r = ModelRouter(files, load)
    try:
        leases = []
        ts = [threading.Thread(target=lambda: leases.append(r.acquire("alpha"))) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(n) == 1 and len({id(x.llm) for x in leases}) == 1
        for x in leases:
            x.release()
    finally:
        r.close()


def test_model_specs_and_dir(files, tmp_path):
    from minirt.router import scan_models_dir
    from minirt.server import router_from_args

    assert parse_model_specs(["a=/x/y.gguf", "/p/q.gguf"]) == {"a": "/x/y.gguf", "q": "/p/q.gguf"}
    with pytest.raises(minirt.MinirtError):
        parse_model_specs(["a=/x", "a=/y"])
    d = tmp_path / "dir"
    d.mkdir()
    (d / "one.gguf").symlink_to(files["alpha"])
    (d / "sub").mkdir()
    (d / "sub" / "z.gguf").symlink_to(files["beta"])
    (d / "notes.txt").write_text("x")
    assert scan_models_dir(d) == {"one": str(d / "one.gguf"), "sub": str(d / "sub" / "z.gguf")}
    ns = argparse.Namespace(model=None, models_dir=str(d), keep_alive=None, models_memory=None, models_max=None,
                            parallel=2, queue=8, kv_budget_tokens=None, ctx=N_CTX, threads=None, device=None,
                            backend=None)
    r = router_from_args(ns)
    assert set(r.entries) == {"one", "sub"}
    r.close()
    single = argparse.Namespace(model=["x.gguf"], models_dir=None)
    assert router_from_args(single) is None and single.model == "x.gguf"
    ns.lora = ["adapter.gguf"]  # an adapter belongs to one model's architecture
    with pytest.raises(minirt.InvalidRequestError, match="one model"):
        router_from_args(ns)


def test_http_multi_model(files, cost, expected):
    openai = pytest.importorskip("openai", reason="needs the openai client")
    httpx = pytest.importorskip("httpx", reason="needs httpx")
    pytest.importorskip("starlette", reason="needs starlette")
    from minirt.server import BackgroundServer, build_app

    r = ModelRouter(files, _load, memory_budget=int(cost * 1.5))  # one at a time
    app = build_app(None, router=r)
    try:
        with BackgroundServer(app) as srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x",
                                                         max_retries=0, timeout=60) as c:
            cards = {m.id: m.model_extra["status"]["value"] for m in c.models.list().data}
            assert cards == {"alpha": "unloaded", "beta": "unloaded", "gamma": "unloaded"}
            for name in ("alpha", "beta", "alpha"):
                out = c.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
                assert out.model == name and out.choices[0].text == expected[name]
            cards = {m.id: m.model_extra["status"]["value"] for m in c.models.list().data}
            assert cards == {"alpha": "loaded", "beta": "unloaded", "gamma": "unloaded"}
            with pytest.raises(openai.NotFoundError):
                c.completions.create(model="delta", prompt=PROMPT, max_tokens=2)
            # a stream in flight on alpha: loading gamma must wait (503), alpha's stream is not cut
            eng = r.entries["alpha"].llm.engine
            step = eng.step

            def slow_step(*a, **kw):  # keeps the stream in flight while gamma is asked for
                time.sleep(0.02)
                return step(*a, **kw)

            eng.step = slow_step
            stream = c.completions.create(model="alpha", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            it = iter(stream)
            first = next(it)
            busy = httpx.post(srv.url + "/v1/completions", json={"model": "gamma", "prompt": PROMPT,
                                                                 "max_tokens": 2}, timeout=30)
            assert busy.status_code == 503 and "retry-after" in busy.headers
            rest = [ch for ch in it]
            text = first.choices[0].text + "".join(ch.choices[0].text for ch in rest if ch.choices)
            assert rest[-1].choices[0].finish_reason == "length" and text.startswith(expected["alpha"])
            out = c.completions.create(model="gamma", prompt=PROMPT, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
            assert out.choices[0].text == expected["gamma"]
            h = httpx.get(srv.url + "/health").json()
            assert h["status"] == "ok" and set(h["models"]) == {"gamma"}
            m = httpx.get(srv.url + "/metrics").text
            assert 'minirt_model_loaded{model="gamma"} 1.0' in m
            assert httpx.post(srv.url + "/tokenize", json={"model": "beta", "content": "the"}).status_code == 200
    finally:
        r.close()


def test_minirt_serve_models_dir_command(files, cost, tmp_path, expected):
    """`minirt serve --models-dir DIR -m NAME=PATH --models-memory ... --alias`: names, states, LRU, clean exit."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    httpx = pytest.importorskip("httpx", reason="needs httpx")
    pytest.importorskip("starlette", reason="needs starlette")
    d = tmp_path / "dir"
    d.mkdir()
    (d / "alpha.gguf").symlink_to(files["alpha"])
    (d / "beta.gguf").symlink_to(files["beta"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    budget = int(cost * 1.5)  # room for one model (its KV budget: 2 contexts, as below)
    proc = subprocess.Popen([sys.executable, "-m", "minirt", "serve", "--models-dir", str(d), "-m",
                             f"third={files['gamma']}", "-c", str(N_CTX), "--kv-budget-tokens", str(2 * N_CTX),
                             "--models-memory", str(budget), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < t_end, "minirt serve did not start"
            time.sleep(0.2)
        ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert ids == ["alpha", "beta", "third"]
        for name, key in (("third", "gamma"), ("alpha", "alpha")):
            r = httpx.post(url + "/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 4,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60).json()
            assert r["choices"][0]["text"] == expected[key]
        states = {m["id"]: m["status"]["value"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert states == {"alpha": "loaded", "beta": "unloaded", "third": "unloaded"}
        r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": PROMPT})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    assert rc == 0
