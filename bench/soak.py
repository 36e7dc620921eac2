#!/usr/bin/env python
"""Soak test of ``minirt serve`` under a hostile mix of clients, over loopback.

    python bench/soak.py                                   # 200 clients, 10 minutes, tiny test model
    python bench/soak.py -m qwen2.5-0.5b-instruct-q4_k_m   # a registry model or a GGUF path
    python bench/soak.py --clients 20 --duration 30        # smoke run

The server is started here as a subprocess (``python -m minirt serve`` on a free loopback port,
``--queue`` and ``--limit-concurrency`` sized for the client count) on the given model, or on a
small random model written with ``tests/tiny_models.py`` when ``-m`` is not given. Each client
loops until the duration is over, picking one action at a time:

* ``stream`` / ``chat``: a valid streaming completion or chat completion, read to ``[DONE]``;
* ``plain``: a valid non-streaming completion;
* ``stops``: a valid stream with 16 stop strings of 2000 characters each;
* ``slow``: a valid stream read slowly (a pause between chunks);
* ``malformed``: a bad body (invalid JSON, wrong types, ``text/plain``, a foreign ``Origin``,
  a 2 MiB prompt against the context, an out-of-range token id);
* ``drop_prefill``: a long prompt, the connection closed as soon as the response starts;
* ``drop_decode``: a stream closed after its first tokens.

Criteria (exit status 1 when any fails): no 5xx answer at all (valid or malformed requests),
every valid stream complete (``[DONE]``, no error chunk, the requested token count), every
malformed request answered with a 4xx, the server alive and drained (nothing running or waiting)
afterwards, and its resident memory (``/proc/PID/status``) after the run within ``--rss-tolerance``
(default 10%) of its level after the warm-up. ``--json`` writes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import ServerProcess, free_port, health, rss_kib  # noqa: E402

ACTIONS = {"stream": 25, "chat": 10, "plain": 8, "stops": 10, "slow": 10, "malformed": 17, "drop_prefill": 10,
           "drop_decode": 10}
VALID = {"stream", "chat", "plain", "stops", "slow"}
WORDS = ("river stone lantern orbit meadow copper signal harbor violet engine quiet summit ember canyon "
         "thread marble falcon winter").split()


def tiny_model(folder: Path) -> str:
    from tests.tiny_models import TinySpec, write_tiny

    path = folder / "soak-tiny.gguf"
    write_tiny(path, TinySpec(n_layer=2, seed=7))
    return str(path)


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


class Stats:
    def __init__(self) -> None:
        self.actions: Counter[str] = Counter()
        self.status: Counter[str] = Counter()
        self.failures: list[str] = []
        self.server_errors = 0  # 5xx answers, any request
        self.incomplete = 0  # valid streams that did not finish properly
        self.malformed_not_4xx = 0
        self.transport_errors = 0
        self.unexpected = 0  # a refusal of a well-formed request that was going to be dropped

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)


def malformed(rng: random.Random, n_ctx: int) -> tuple[str, bytes | None, dict[str, str], Any]:
    """(path, raw body or None, headers, json body or None) of one bad request."""
    json_h = {"Content-Type": "application/json"}
    kind = rng.randrange(9)
    if kind == 0:
        return "/v1/completions", b'{"prompt": "abc", "max_tokens": ', json_h, None
    if kind == 1:
        return "/v1/completions", None, {}, {"prompt": 42, "max_tokens": "many"}
    if kind == 2:
        return "/v1/chat/completions", None, {}, {"messages": [{"role": "wizard", "content": "hi"}]}
    if kind == 3:
        return "/v1/completions", json.dumps({"prompt": "x"}).encode(), {"Content-Type": "text/plain"}, None
    if kind == 4:
        return "/v1/completions", None, {"Origin": "http://evil.example"}, {"prompt": "x", "max_tokens": 2}
    if kind == 5:
        return "/v1/completions", None, {}, {"prompt": "word " * 40_000, "max_tokens": 2}
    if kind == 6:
        return "/v1/completions", None, {}, {"prompt": [0, 10**9], "max_tokens": 2}
    if kind == 7:
        return "/v1/completions", None, {}, {"prompt": "x", "stop": ["a"] * 17}
    return "/v1/completions", None, {}, {"prompt": "x", "max_tokens": 2, "temperature": -1}


async def read_stream(r: Any, rng: random.Random, slow: float, stop_after: int | None) -> tuple[bool, str, int]:
    """(complete, error, content chunks) of an SSE response."""
    chunks, done, err = 0, False, ""
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:].strip()
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            err = str(obj["error"].get("message"))[:200]
            break
        for ch in obj.get("choices") or []:
            if ch.get("text") or (ch.get("delta") or {}).get("content"):
                chunks += 1
        if stop_after is not None and chunks >= stop_after:
            return False, "", chunks
        if slow:
            await asyncio.sleep(slow * rng.random())
    return done, err, chunks


async def one_action(client: Any, url: str, rng: random.Random, stats: Stats, n_ctx: int, tpw: float) -> None:
    """One request of a random kind; ``tpw``: the model's tokens per word of :data:`WORDS` text."""
    import httpx

    action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
    stats.actions[action] += 1
    max_tokens = rng.randint(4, 24)
    words = max(2, int(n_ctx / 4 / tpw))
    body: dict[str, Any] = {"prompt": text(rng, rng.randint(2, words)), "max_tokens": max_tokens, "temperature": 0.7,
                            "seed": rng.randrange(1 << 30), "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    path = "/v1/completions"
    if action == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": body["prompt"]}], **{k: v for k, v in body.items()
                                                                             if k != "prompt"}}
    elif action == "plain":
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    elif action == "stops":
        # 16 long stop strings that never match (2000 characters each, within the server's 32768 in
        # all): every token is checked against all of them
        body["stop"] = [("\u2603" + text(rng, 400))[:2000] for _ in range(16)]
    elif action == "drop_prefill":
        body["prompt"] = text(rng, max(4, int(n_ctx * 0.7 / tpw)))
    try:
        if action == "malformed":
            p, raw, headers, jbody = malformed(rng, n_ctx)
            if raw is not None:
                r = await client.post(url + p, content=raw, headers=headers)
            else:
                r = await client.post(url + p, json=jbody, headers=headers)
            stats.status[str(r.status_code)] += 1
            if r.status_code >= 500:
                stats.server_errors += 1
                stats.fail(f"malformed request answered {r.status_code}: {r.text[:200]}")
            elif not 400 <= r.status_code < 500:
                stats.malformed_not_4xx += 1
                stats.fail(f"malformed request answered {r.status_code}")
            return
        if action == "plain":
            r = await client.post(url + path, json=body)
            stats.status[str(r.status_code)] += 1
            if r.status_code != 200:
                stats.server_errors += r.status_code >= 500
                stats.incomplete += 1
                stats.fail(f"{action}: HTTP {r.status_code}: {r.text[:200]}")
            elif r.json()["usage"]["completion_tokens"] != max_tokens:
                stats.incomplete += 1
                stats.fail(f"{action}: {r.json()['usage']} for max_tokens {max_tokens}")
            return
        async with client.stream("POST", url + path, json=body) as r:
            stats.status[str(r.status_code)] += 1
            if r.status_code != 200:
                stats.server_errors += r.status_code >= 500
                stats.incomplete += action in VALID
                stats.unexpected += action not in VALID
                stats.fail(f"{action}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            if action == "drop_prefill":
                return  # leaving the block closes the connection while the prompt is processed
            stop_after = rng.randint(1, 3) if action == "drop_decode" else None
            done, err, chunks = await read_stream(r, rng, 0.4 if action == "slow" else 0.0, stop_after)
            if action == "drop_decode":
                return
            if not done or err:
                stats.incomplete += 1
                stats.fail(f"{action}: stream ended without [DONE] ({err or 'cut short'}) after {chunks} chunks")
    except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
        if action in VALID:
            stats.transport_errors += 1
            stats.incomplete += 1
            stats.fail(f"{action}: {type(e).__name__}: {e}")


async def client_loop(i: int, url: str, deadline: float, stats: Stats, n_ctx: int, tpw: float, seed: int) -> None:
    import httpx

    rng = random.Random(seed * 1000 + i)
    timeout = httpx.Timeout(120.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=2)) as client:
        await asyncio.sleep(rng.random())  # spread the start
        while time.monotonic() < deadline:
            await one_action(client, url, rng, stats, n_ctx, tpw)


async def run_clients(url: str, n: int, seconds: float, n_ctx: int, tpw: float, seed: int, stats: Stats) -> Stats:
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(i, url, deadline, stats, n_ctx, tpw, seed) for i in range(n)))
    return stats


def tokens_per_word(url: str) -> float:
    """Calibrate prompt lengths: the model's tokens per word of the soak's vocabulary."""
    import httpx

    n = 10
    r = httpx.post(url + "/v1/completions", json={"prompt": text(random.Random(1), n), "max_tokens": 1}, timeout=120)
    r.raise_for_status()
    return max(0.5, r.json()["usage"]["prompt_tokens"] / n)


def wait_drained(url: str, timeout: float) -> dict[str, Any] | None:
    t_end = time.monotonic() + timeout
    h = None
    while time.monotonic() < t_end:
        h = health(url, {})
        if h and h["scheduler"]["running"] == 0 and h["scheduler"]["waiting"] == 0 and h["active"] == 0:
            return h
        time.sleep(0.5)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="registry name or GGUF path (default: a tiny random test model)")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("-c", "--ctx", type=int, default=256, help="context per sequence (default 256)")
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth (default 0.10)")
    ap.add_argument("--log-dir", default=tempfile.gettempdir())
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="minirt-soak-")
    model = args.model or tiny_model(Path(tmp.name))
    port = free_port()
    n = args.clients
    cmd = [sys.executable, "-m", "minirt", "serve", "-m", model, "--port", str(port), "-c", str(args.ctx),
           "--parallel", str(args.parallel), "--queue", str(2 * n + 16),
           "--limit-concurrency", str(2 * n + 64), "--max-connections", str(4 * n + 128)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    srv = ServerProcess(cmd, port, "minirt serve", Path(args.log_dir) / "soak.minirt.log", env)
    report: dict[str, Any] = {"model": args.model or "tiny test model", "clients": n, "duration_s": args.duration}
    try:
        srv.wait_ready(300)
        print(f"soak: {n} clients for {args.duration:g} s against {srv.url} (pid {srv.pid}, model "
              f"{report['model']})", flush=True)
        tpw = tokens_per_word(srv.url)
        stats = Stats()
        # the same mix for a while first: the server reaches its working set (thread pools, malloc
        # arenas, prefix cache) before the baseline RSS is taken; what grows after that is a leak
        warm = min(60.0, max(5.0, args.duration / 10))
        asyncio.run(run_clients(srv.url, n, warm, args.ctx, tpw, args.seed + 1, stats))
        wait_drained(srv.url, 120)
        time.sleep(2.0)
        rss0 = rss_kib(srv.pid)
        t0 = time.monotonic()
        asyncio.run(run_clients(srv.url, n, args.duration, args.ctx, tpw, args.seed, stats))
        wall = time.monotonic() - t0
        drained = wait_drained(srv.url, 120)
        time.sleep(2.0)
        rss1 = rss_kib(srv.pid)
        alive = srv.alive()
    finally:
        srv.stop()
        tmp.cleanup()
    rss_ok = bool(rss0 and rss1 and rss1 <= rss0 * (1 + args.rss_tolerance))
    crit = {"no_5xx": stats.server_errors == 0, "valid_streams_complete": stats.incomplete == 0,
            "no_unexpected_refusals": stats.unexpected == 0,
            "malformed_get_4xx": stats.malformed_not_4xx == 0, "server_alive": alive,
            "drained": drained is not None, "rss_back": rss_ok}
    report.update({"warm_up_s": warm, "tokens_per_word": round(tpw, 2), "wall_s": round(wall, 1),
                   "actions": dict(stats.actions), "status": dict(stats.status), "unexpected": stats.unexpected,
                   "server_errors_5xx": stats.server_errors, "incomplete_valid": stats.incomplete,
                   "transport_errors": stats.transport_errors, "malformed_not_4xx": stats.malformed_not_4xx,
                   "rss_kib_start": rss0, "rss_kib_end": rss1, "criteria": crit, "ok": all(crit.values()),
                   "failures": stats.failures, "server_health": drained})
    print(f"  requests: {sum(stats.actions.values())} in {wall:.0f} s  " +
          ", ".join(f"{k} {v}" for k, v in sorted(stats.actions.items())))
    print("  status:   " + ", ".join(f"{k}: {v}" for k, v in sorted(stats.status.items())))
    print(f"  5xx: {stats.server_errors}   incomplete valid streams: {stats.incomplete}   "
          f"malformed not 4xx: {stats.malformed_not_4xx}")
    print(f"  RSS: {rss0} KiB after warm-up -> {rss1} KiB after the run "
          f"({'' if rss_ok else 'NOT '}within {args.rss_tolerance:.0%})")
    for f in stats.failures[:10]:
        print("  failure:", f)
    print("  criteria: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in crit.items()))
    print("SOAK", "OK" if report["ok"] else "FAILED")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
