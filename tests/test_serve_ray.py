"""Ray Serve scale-out (minirt.serve_ray) on a local Ray cluster: 2 replicas of a tiny model behind
Ray Serve's HTTP proxy, 32 concurrent streams through the official openai client with 0 failures,
prefix affinity of one conversation, and a replica killed mid-run: every remaining request
completes or fails with a clean error, none hangs.

Expected texts come from the runtime called directly (minirt.load + generate)."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'minirt[ray]')")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'minirt[ray]')")
openai = pytest.importorskip("openai", reason="needs the openai client")
httpx = pytest.importorskip("httpx", reason="needs httpx")

import minirt  # noqa: E402
from minirt.serve_ray import rank_replicas, routing_key  # noqa: E402
from tests.tiny_models import TinySpec, write_tiny  # noqa: E402

N_CTX = 256
PROMPT = "the capital of France is"


def test_routing_key_and_rank():
    a = routing_key({}, b'{"messages": [{"role": "user", "content": "hi"}]}')
    b = routing_key({}, b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},'
                        b' {"role": "user", "content": "more"}]}')
    c = routing_key({}, b'{"messages": [{"role": "user", "content": "other"}]}')
    assert a and a != c
    # the next turn of a conversation keeps its first two messages: its key is the second turn's
    b2 = routing_key({}, b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},'
                         b' {"role": "user", "content": "more"}, {"role": "assistant", "content": "y"}]}')
    assert b == b2
    assert routing_key({"x-session-id": "s1"}, b"{}") == "s:s1" == routing_key({}, b'{"user": "s1"}')
    assert routing_key({}, b"not json") == "" and routing_key({}, b"[1]") == ""
    ids = ["r1", "r2", "r3"]
    order = rank_replicas("k", ids)
    assert sorted(order) == [0, 1, 2]
    # rendezvous hashing: removing a replica that is not a key's first keeps that key's first
    first = ids[order[0]]
    rest = [i for i in ids if i != ids[order[-1]]]
    assert rest[rank_replicas("k", rest)[0]] == first


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray import serve

    from minirt.serve_ray import build_ray_app, start

    path = str(tmp_path_factory.mktemp("ray") / "tiny.gguf")
    write_tiny(path, TinySpec(n_layer=2, seed=4))
    port = _free_port()
    app = build_ray_app(path, load_options={"n_ctx": N_CTX, "threads": 1},
                        scheduler_options={"n_parallel": 16, "max_queue": 64}, replicas=2, replica_cpus=0.5)
    try:
        start(app, port=port, num_cpus=2)
    except Exception as e:  # pragma: no cover - depends on the machine
        if ray.is_initialized():
            ray.shutdown()
        pytest.skip(f"a local Ray cluster could not start here: {type(e).__name__}: {e}")
    url = f"http://127.0.0.1:{port}"
    yield path, url
    serve.shutdown()
    ray.shutdown()


def _expected(path, prompts, n):
    with minirt.load(path, n_ctx=N_CTX, threads=1) as m:
        return [m.generate(p, max_tokens=n, temperature=0, ignore_eos=True).text for p in prompts]


def _stream(client, prompt, n):
    s = client.completions.create(model="any-name", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    text, finish = "", None
    for ch in s:
        if ch.choices:
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
    return text, finish


def test_32_streams_two_replicas(cluster):
    path, url = cluster
    prompts = [f"{PROMPT} {i}" for i in range(32)]
    want = _expected(path, prompts, 12)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    with cf.ThreadPoolExecutor(32) as ex:
        got = list(ex.map(lambda p: _stream(client, p, 12), prompts))
    assert [g[0] for g in got] == want and all(g[1] == "length" for g in got)
    # chat, not streamed, and a llama-server route through the same proxy
    c = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert c.choices[0].finish_reason in ("length", "stop")
    assert httpx.post(url + "/tokenize", json={"content": "the"}, timeout=30).json()["tokens"]


def test_conversation_sticks_to_one_replica(cluster):
    _, url = cluster

    def replica(headers, body):
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(url + route, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-minirt-replica"]

    # every turn of one session lands on one replica; different sessions spread over both
    for sid in ("conversation-7", "conversation-8"):
        seen = {replica({"x-session-id": sid}, {"prompt": f"{PROMPT} turn {i}", "max_tokens": 2}) for i in range(4)}
        assert len(seen) == 1
    spread = {replica({"x-session-id": f"s{i}"}, {"prompt": PROMPT, "max_tokens": 1}) for i in range(16)}
    assert len(spread) == 2
    # without a session id, a chat's key is its start: later turns follow the first
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    first = replica({}, {"messages": msgs, "max_tokens": 2})
    for turn in range(3):
        msgs = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"more {turn}"}]
        assert replica({}, {"messages": msgs, "max_tokens": 2}) == first


def test_replica_killed_mid_run(cluster):
    path, url = cluster
    n = 48
    prompts = [f"{PROMPT} kill {i}" for i in range(24)]
    want = dict(zip(prompts, _expected(path, prompts, n)))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

    def one(p):
        try:
            return _stream(client, p, n)
        except openai.APIError as e:  # a clean error, not a hang
            return ("error", type(e).__name__)

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(24) as ex:
        futs = [ex.submit(one, p) for p in prompts]
        time.sleep(0.5)
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA::") and "MinirtEngine" in a["name"]]
        assert len(replicas) == 2
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
        results = [f.result(timeout=120) for f in futs]
    assert time.monotonic() - t0 < 120
    ok = [p for p, r in zip(prompts, results) if r[0] != "error"]
    for p, r in zip(prompts, results):
        if r[0] != "error":
            assert r == (want[p], "length"), p
    assert ok, "the surviving replica completed nothing"
    # the deployment recovers: Serve replaces the replica and new requests succeed
    deadline = time.monotonic() + 90
    while True:
        try:
            if _stream(client, PROMPT, 3)[1] == "length":
                break
        except openai.APIError:
            pass
        assert time.monotonic() < deadline, "no successful request after the replica was killed"
        time.sleep(1)


def test_serve_ray_options_parse():
    from minirt.cli import build_parser

    a = build_parser().parse_args(["serve", "--ray", "-m", "x.gguf", "--min-replicas", "1", "--max-replicas", "4",
                                   "--replica-cpus", "0.5", "--alias", "m"])
    assert a.ray and a.min_replicas == 1 and a.max_replicas == 4 and a.replica_cpus == 0.5 and a.model == ["x.gguf"]
    from minirt.serve_ray import build_ray_app

    with pytest.raises(minirt.InvalidRequestError):
        build_ray_app("x.gguf", min_replicas=3, max_replicas=2)
    with pytest.raises(minirt.InvalidRequestError):
        build_ray_app("x.gguf", replicas=0)
