"""The HTTP server under hostile clients: half-sent and trickled requests, idle and excess
connections, clients that leave the queue, cross-origin pages (CSRF, DNS rebinding), and big
bodies that must not stall the event loop.

Bounds are asserted as counts (bytes a trickling client got to send before the server closed,
connections open at the server, /health answers completed while a big body was parsed), never
as absolute wall-clock times."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (pip install 'minirt[server]')")
pytest.importorskip("starlette", reason="the server needs starlette (pip install 'minirt[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'minirt[server]')")

import minirt  # noqa: E402
from minirt import server as server_mod  # noqa: E402
from minirt.http_guard import GuardOptions  # noqa: E402
from minirt.server import BackgroundServer, build_app  # noqa: E402
from tests.server_support import wait_for  # noqa: E402

PROMPT = "the capital of France is"
N_CTX = 128
TICK = 0.05  # seconds between trickled bytes


def serve(server_llm, **guard):
    g = GuardOptions(**guard)
    srv = BackgroundServer(build_app(server_llm, guard=g), guard=g)
    srv.start()
    srv.state = srv.server.server_state  # uvicorn's: open connections and running tasks
    return srv


def connect(srv) -> socket.socket:
    s = socket.create_connection((srv.host, srv.port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def trickle(s: socket.socket, data: bytes, limit: int) -> tuple[int, bytes]:
    """Send ``data`` one byte per TICK until the server closes or answers; returns (bytes sent, reply)."""
    s.settimeout(TICK)
    for i in range(min(limit, len(data))):
        try:
            s.sendall(data[i:i + 1])
        except OSError:  # reset: closed
            return i, b""
        try:
            got = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return i + 1, b""
        reply = got
        s.settimeout(2)
        try:
            while got:
                got = s.recv(65536)
                reply += got
        except OSError:
            pass
        return i + 1, reply
    return limit, b""


def closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(0)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def body_json(reply: bytes) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    return json.loads(body)


# -- point 1: connections ---------------------------------------------------------------------------
def test_trickled_headers_get_408_after_the_header_timeout(server_llm):
    """A client sending its headers one byte per TICK is closed after about header_timeout / TICK
    bytes (here 10), not after all of them."""
    srv = serve(server_llm, header_timeout=10 * TICK)
    try:
        req = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"a" * 400 + b"\r\n\r\n"
        with connect(srv) as s:
            sent, reply = trickle(s, req, len(req))
        assert sent < 80, f"the server let a trickling client send {sent} header bytes"
        assert reply.startswith(b"HTTP/1.1 408")
        assert body_json(reply)["error"]["code"] == "request_timeout"
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def test_trickled_body_gets_408_and_releases_its_coroutine(server_llm):
    """1 byte per TICK of a declared 1000-byte body: 408 after about body_timeout / TICK bytes, and
    the request's task (the coroutine reading the body) is gone."""
    srv = serve(server_llm, body_timeout=10 * TICK)
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n")
        with connect(srv) as s:
            s.sendall(head)
            wait_for(lambda: len(srv.state.tasks) == 1, what="the request task")
            sent, reply = trickle(s, b'{"prompt": "' + b"x" * 990, 1000)
        assert sent < 80, f"the server let a trickling client send {sent} body bytes"
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert body_json(reply)["error"]["code"] == "request_timeout"
        wait_for(lambda: not srv.state.tasks, what="the body-reading coroutine to end")
        assert httpx.get(srv.url + "/health").json()["errors"] == 0  # a timeout is not a server error
    finally:
        srv.stop()


def test_silent_and_idle_connections_are_closed(server_llm):
    """A connection that never sends a byte, and a keep-alive connection that trickles the next
    request after a response (each byte resets uvicorn's own keep-alive timer), are both closed."""
    srv = serve(server_llm, header_timeout=10 * TICK, keep_alive_timeout=10 * TICK)
    try:
        with connect(srv) as silent, connect(srv) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            kept.settimeout(10)
            assert kept.recv(65536).startswith(b"HTTP/1.1 200")
            sent, _ = trickle(kept, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"a" * 400, 400)
            assert sent < 80
            wait_for(lambda: closed_by_peer(silent), timeout=100 * 10 * TICK, what="the silent connection to close")
        wait_for(lambda: len(srv.state.connections) == 0, what="no connection left open")
    finally:
        srv.stop()


def test_connection_cap_evicts_half_sent_requests_and_health_answers(server_llm):
    """40 half-sent requests against max_connections=8: the server keeps at most 8 open, closing
    the oldest stuck ones, and /health answers."""
    srv = serve(server_llm, limit_concurrency=4, max_connections=8, header_timeout=60)
    socks = []
    try:
        for _ in range(40):
            s = connect(srv)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            socks.append(s)
            assert len(srv.state.connections) <= 8
        wait_for(lambda: sum(closed_by_peer(s) for s in socks) >= 40 - 8, what="the stuck connections to be evicted")
        assert len(srv.state.connections) <= 8
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert sum(not closed_by_peer(s) for s in socks) <= 8
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_requests_beyond_the_concurrency_limit_get_503_and_health_still_answers(server_llm):
    """Two requests in flight (headers sent, bodies pending) with limit_concurrency=2: a third gets
    a typed 503 with Retry-After, /health answers 200."""
    srv = serve(server_llm, limit_concurrency=2, body_timeout=60)
    holders = []
    try:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{")
        for _ in range(2):
            s = connect(srv)
            s.sendall(head)
            holders.append(s)
        wait_for(lambda: len(srv.state.tasks) == 2, what="two requests in flight")
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 200 and h.json()["refused"] == 1
    finally:
        for s in holders:
            s.close()
        srv.stop()


def test_queued_clients_that_disconnect_give_their_slots_back(server_tiny_path):
    """n_parallel=1, queue of 2: A runs, B and C wait and then hang up. D must be queued (and
    complete), not refused with 503 because B and C still hold the queue."""
    with minirt.load(server_tiny_path, n_ctx=N_CTX) as m:
        m.configure_scheduler(n_parallel=1, max_queue=2)
        app = build_app(m)
        state, sched = app.state.minirt, m.scheduler
        with BackgroundServer(app) as srv:
            body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
            raw = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body)) + body
            m._step_lock.acquire()  # freeze the batch: A keeps its place, B and C stay queued
            try:
                a = connect(srv)
                a.sendall(raw)
                wait_for(lambda: sched.stats()["running"] == 1, what="A to run")
                waiting = []
                for _ in range(2):
                    s = connect(srv)
                    s.sendall(raw)
                    waiting.append(s)
                wait_for(lambda: sched.stats()["waiting"] == 2, what="B and C to queue")
                for s in waiting:
                    s.close()
                wait_for(lambda: state.disconnects >= 2, what="the server to notice B and C leaving")
                result = {}

                def post_d():
                    result["d"] = httpx.post(srv.url + "/v1/completions", content=body, timeout=60,
                                             headers={"Content-Type": "application/json"})

                t = threading.Thread(target=post_d)
                t.start()
                wait_for(lambda: "d" in result or sched.stats()["waiting"] == 1, what="D to be queued")
                assert "d" not in result, f"D was answered while the batch was frozen: {result['d'].text}"
            finally:
                m._step_lock.release()
            t.join(60)
            assert result["d"].status_code == 200, result["d"].text
            assert result["d"].json()["usage"]["completion_tokens"] == 8
            a.close()
            wait_for(lambda: sched.stats()["waiting"] == 0 and sched.stats()["running"] == 0, what="a drained queue")


# -- point 2: cross-origin use of a local server ------------------------------------------------------
def test_text_plain_post_is_415(server_llm):
    srv = serve(server_llm)
    try:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 1})
        for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
            r = httpx.post(srv.url + "/v1/completions", content=body,
                           headers={"Content-Type": ctype} if ctype else {})
            assert r.status_code == 415, (ctype, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
        ok = httpx.post(srv.url + "/v1/completions", content=body,
                        headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok.status_code == 200, ok.text
        # a POST without a body (llama-server's /slots/0?action=erase) needs no content type
        empty = httpx.post(srv.url + "/v1/completions")
        assert empty.status_code == 400 and empty.json()["error"]["code"] == "invalid_json"
    finally:
        srv.stop()


def test_foreign_host_on_loopback_is_refused(server_llm):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends
    ``Host: evil.example:PORT``. Loopback names (and those allowed) are served, any other is refused (421)."""
    srv = serve(server_llm, allow_hosts=("box.lan",))
    try:
        body = {"prompt": PROMPT, "max_tokens": 1}
        for host in (f"evil.example:{srv.port}", "evil.example", f"127.0.0.1.evil.example:{srv.port}"):
            r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Host": host})
            assert r.status_code == 421, (host, r.text)
            assert r.json()["error"]["code"] == "invalid_host"
            assert httpx.get(srv.url + "/health", headers={"Host": host}).status_code == 421
        for host in (f"localhost:{srv.port}", f"127.0.0.1:{srv.port}", "localhost", f"[::1]:{srv.port}",
                     f"BOX.lan:{srv.port}"):
            r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
    finally:
        srv.stop()


def test_foreign_origin_is_refused_unless_allowed(server_llm):
    """A page on another origin (its fetch carries ``Origin``) is refused with 403; an origin named
    in allow_origins is served with CORS headers, its preflight answered."""
    srv = serve(server_llm, allow_origins=("http://app.example:3000",))
    try:
        body = {"prompt": PROMPT, "max_tokens": 1}
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in r.headers
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Origin": "null"})
        assert r.status_code == 403
        pre = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 403
        # the allowed origin: preflight and the request itself carry CORS headers
        allowed = "http://app.example:3000"
        pre = httpx.options(srv.url + "/v1/completions", headers={
            "Origin": allowed, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization"})
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == allowed
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Origin": allowed})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
        # same origin (a page this server itself served) is not foreign
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Origin": srv.url})
        assert r.status_code == 200
    finally:
        srv.stop()


# -- point 3: big bodies off the event loop -------------------------------------------------------------
def test_big_body_is_parsed_off_the_event_loop(server_llm, monkeypatch):
    """A ~4 MiB valid body with a huge ``logit_bias`` takes a while to validate. /health requests
    sent meanwhile must keep being answered *during* that validation (counted between its start
    and end, recorded by a wrapper around the validator): on the event loop none could be."""
    window: dict[str, float] = {}
    real = server_mod.parse_completion

    def timed(body, model):
        window["start"] = time.monotonic()
        try:
            return real(body, model)
        finally:
            window["end"] = time.monotonic()

    monkeypatch.setattr(server_mod, "parse_completion", timed)
    srv = serve(server_llm)
    try:
        bias = {f"{i:07d}": 0.0 for i in range(250_000)}  # distinct keys, each an integer
        body = json.dumps({"prompt": PROMPT, "max_tokens": 1, "logit_bias": bias}).encode()
        assert len(body) < server_mod.MAX_BODY_BYTES
        done: list[float] = []
        stop = threading.Event()

        def health_loop():
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    assert c.get(srv.url + "/health").status_code == 200
                    done.append(time.monotonic())

        t = threading.Thread(target=health_loop)
        t.start()
        wait_for(lambda: len(done) >= 3, what="/health to answer")
        r = httpx.post(srv.url + "/v1/completions", content=body, timeout=120,
                       headers={"Content-Type": "application/json"})
        stop.set()
        t.join(60)
        assert r.status_code in (200, 400), r.text
        inside = [x for x in done if window["start"] < x < window["end"]]
        span = window["end"] - window["start"]
        assert len(inside) >= 3, f"{len(inside)} /health answers during {span:.3f} s of body validation"
        gaps = [b - a for a, b in zip([window["start"], *inside], [*inside, window["end"]])]
        assert max(gaps) < 0.5 * span, f"the longest stall was {max(gaps) / span:.0%} of the validation"
    finally:
        srv.stop()


# -- point 5: the soak benchmark ----------------------------------------------------------------------
def test_soak_bench_smoke(tmp_path):
    """bench/soak.py end to end, briefly: it starts ``minirt serve`` on the tiny model, runs the
    hostile mix, and reports every criterion."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, str(root / "bench" / "soak.py"), "--clients", "8", "--duration", "6",
                        "--rss-tolerance", "1.0", "--log-dir", str(tmp_path), "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["server_errors_5xx"] == 0 and rep["incomplete_valid"] == 0
    assert set(rep["criteria"]) >= {"no_5xx", "valid_streams_complete", "rss_back", "drained"}
    assert rep["status"].get("200", 0) > 0 and sum(rep["actions"].values()) > 8
    assert rep["rss_kib_start"] > 0 and rep["rss_kib_end"] > 0
    assert "SOAK OK" in p.stdout


def test_serve_options_reach_the_guard():
    """``minirt serve``'s options map onto GuardOptions (comma-separated and repeated origins)."""
    from minirt.cli import build_parser
    from minirt.server import guard_from_args

    args = build_parser().parse_args([
        "serve", "--limit-concurrency", "3", "--max-connections", "40", "--header-timeout", "2",
        "--body-timeout", "7.5", "--keep-alive-timeout", "1", "--allow-origin", "http://A.example,http://b.example/",
        "--allow-origin", "http://c.example", "--allow-host", "Box.lan"])
    g = guard_from_args(args)
    assert (g.limit_concurrency, g.max_connections, g.header_timeout, g.body_timeout, g.keep_alive_timeout) == \
        (3, 40, 2.0, 7.5, 1.0)
    assert g.allow_origins == ("http://a.example", "http://b.example", "http://c.example")
    assert g.allow_hosts == ("box.lan",)
    d = guard_from_args(build_parser().parse_args(["serve"]))
    assert d == GuardOptions()
    with pytest.raises(minirt.InvalidRequestError, match="header_timeout"):
        guard_from_args(build_parser().parse_args(["serve", "--header-timeout", "0"]))
