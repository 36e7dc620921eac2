#!/usr/bin/env python
"""Load test of the OpenAI-compatible server (``minirt serve``) over loopback, side by side with
``llama-server`` when ``$MINIRT_LLAMA_SERVER`` names its binary.

    python bench/serve_load.py                                  # default model, 16 streams, 64 tokens each
    python bench/serve_load.py -m tiny.gguf -n 4 --max-tokens 16 -r 1 --no-peer   # smoke run
    MINIRT_LLAMA_SERVER=/path/to/llama-server python bench/serve_load.py -t 2     # minirt vs llama-server -np 16
    python bench/serve_load.py --check-streams 64               # also 64 streams at once, 0 failures required
    python bench/serve_load.py --disconnect-fraction 0.33 --disconnect-clients 100
    python bench/serve_load.py --url http://127.0.0.1:8080 --server-pid 1234

Phases (each bounded in request count and time):

1. throughput rounds (``--repetitions``, default 5): one streaming client alone (decode tok/s,
   time to first token (TTFT), inter-token latency (ITL)), then N concurrent streaming clients
   (default 16; aggregate decode tok/s, per-client tok/s, TTFT and ITL p50/p95, failures, and the
   aggregate / single-stream ratio). Requests are streaming chats (``--api chat``, default) or
   completions. With llama-server present, both servers run at once (same GGUF, ``-t``, ``-c``
   per slot, prompts and max_tokens; llama-server with ``-np N``) and the rounds alternate between
   them, order flipped every round. Every round's prompts start with their own tag, so no round
   reuses a prefix cached by an earlier one. Medians over the rounds are reported: both
   servers' aggregates, minirt / llama-server, and minirt's N-stream / 1-stream ratio.
2. with ``--check-streams N``: N concurrent streams at once (more than the slots: the rest queue);
   all must complete.
3. with ``--disconnect-fraction F``: ``--disconnect-clients`` clients (default 100) at once, a
   fraction F of them chosen at random dropping the connection mid-stream after a random number
   of tokens. Checks that the server stays up, that every other request completes, that the
   scheduler drains, and that the server's RSS (``/proc/PID/status``) comes back within 10% of
   its level before the load.

The servers are started here as subprocesses on free loopback ports unless ``--url`` points at a
running minirt. Every request asks for a fixed number of tokens (``ignore_eos``) so runs are
comparable. Requests refused with 503 (KV budget / queue full) are retried after
``Retry-After`` and counted. Timings on a shared machine are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENV_LLAMA_SERVER = "MINIRT_LLAMA_SERVER"
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a city under the sea", "an old violin",
          "a desert caravan", "a clockmaker", "a comet", "a mountain village", "a library at night",
          "a river pilot", "a paper kite", "a winter market", "a sleeping volcano", "a message in a bottle",
          "a train across the steppe"]


# ----------------------------------------------------------------------------------------------
# one streaming client
# ----------------------------------------------------------------------------------------------
@dataclass
class ClientResult:
    index: int
    t_send: float = 0.0
    t_first: float | None = None
    t_end: float | None = None
    arrivals: list[float] = field(default_factory=list)  # chunk arrival times (chunks with text)
    tokens: int = 0  # completion tokens (server usage when sent, else chunks with text)
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    disconnect_after: int | None = None
    disconnected: bool = False
    retries: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    @property
    def decode_tps(self) -> float | None:
        if self.t_first is None or self.t_end is None or self.tokens < 2 or self.t_end <= self.t_first:
            return None
        return (self.tokens - 1) / (self.arrivals[-1] - self.t_first) if len(self.arrivals) > 1 else None

    def itl(self) -> list[float]:
        a = self.arrivals
        return [b - x for x, b in zip(a, a[1:])]


async def stream_one(client: Any, url: str, body: dict[str, Any], res: ClientResult, deadline: float,
                     headers: dict[str, str]) -> ClientResult:
    """POST one streaming (chat) completion; record chunk arrival times; optionally drop the connection."""
    import httpx

    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    while True:
        res.t_send = time.perf_counter()
        try:
            async with client.stream("POST", url + route, json=body, headers=headers) as r:
                if r.status_code == 503 and time.perf_counter() < deadline:
                    res.retries += 1
                    await r.aread()
                    await asyncio.sleep(float(r.headers.get("retry-after", "1") or 1))
                    continue
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                if res.disconnect_after == 0:
                    res.disconnected = True  # leave while queued or in prefill
                    return res
                chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:].strip()
                    if data == "[DONE]":
                        res.done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = f"stream error: {obj['error'].get('message')}"
                        break
                    now = time.perf_counter()
                    if obj.get("usage"):
                        res.tokens = int(obj["usage"].get("completion_tokens", res.tokens))
                    for ch in obj.get("choices") or []:
                        if ch.get("text") or (ch.get("delta") or {}).get("content"):
                            if res.t_first is None:
                                res.t_first = now
                            res.arrivals.append(now)
                            chunks += 1
                        if ch.get("finish_reason"):
                            res.finish_reason = ch["finish_reason"]
                    if res.disconnect_after is not None and chunks >= res.disconnect_after:
                        res.disconnected = True
                        break  # leaving the block drops the half-read connection
                if not res.tokens:
                    res.tokens = chunks
                res.t_end = time.perf_counter()
                return res
        except (httpx.HTTPError, OSError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"
            return res


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[ClientResult], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and not r.disconnected and r.done]
    toks = sum(r.tokens for r in ok)
    firsts = [r.t_first for r in ok if r.t_first is not None]
    lasts = [r.arrivals[-1] for r in ok if r.arrivals]
    decode_span = (max(lasts) - min(firsts)) if firsts and lasts else 0.0
    # steady state: every stream has its first token and none has finished (no prompt processing
    # left, the full batch decoding), the quantity llama.cpp's batched-bench reports as S_TG
    t_a, t_b = (max(firsts), min(lasts)) if firsts and lasts else (0.0, 0.0)
    steady = (sum(1 for r in ok for t in r.arrivals if t_a < t <= t_b) / (t_b - t_a)
              if t_b - t_a > 0.5 and len(ok) > 1 else None)  # a window under 0.5 s says nothing
    per_client = [r.decode_tps for r in ok if r.decode_tps]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itl()]
    return {
        "clients": len(results), "completed": len(ok),
        "failures": [f"client {r.index}: {r.error}" for r in results if r.error],
        "incomplete": [r.index for r in results if r.error is None and not r.disconnected and not r.done],
        "retries_503": sum(r.retries for r in results),
        "tokens": toks, "wall_s": wall,
        "throughput_tok_s": toks / wall if wall > 0 else None,
        "decode_tok_s": sum(max(r.tokens - 1, 0) for r in ok) / decode_span if decode_span > 0 else None,
        "steady_decode_tok_s": steady, "steady_window_s": max(0.0, t_b - t_a),
        "per_client_tok_s_mean": statistics.fmean(per_client) if per_client else None,
        "per_client_tok_s_min": min(per_client) if per_client else None,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
        "itl_p50_s": pct(itl, 0.5), "itl_p95_s": pct(itl, 0.95),
    }


def request_body(args: argparse.Namespace, index: int, tag: str) -> dict[str, Any]:
    """One client's request. ``tag`` opens the prompt so that no two rounds (nor the two servers'
    runs of one round) share a cached prefix beyond the template's first tokens."""
    pad = " ".join(["Describe it in detail."] * args.prompt_pad)
    text = f"[{tag}-{index}] Write a story about {TOPICS[index % len(TOPICS)]}. {pad}".strip()
    body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if getattr(args, "api", "completions") == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if args.model_name:
        body["model"] = args.model_name
    return body


async def run_clients(url: str, n: int, args: argparse.Namespace, deadline: float, *, disconnect: float = 0.0,
                      seed: int = 0, headers: dict[str, str] | None = None,
                      tag: str = "") -> tuple[list[ClientResult], float]:
    import httpx

    rng = random.Random(seed)
    results = [ClientResult(i) for i in range(n)]
    if disconnect > 0:
        for i in rng.sample(range(n), round(disconnect * n)):
            results[i].disconnect_after = rng.randrange(0, max(1, args.max_tokens - 1))
    tag = tag or f"s{seed}"
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    timeout = httpx.Timeout(max(1.0, deadline - time.perf_counter()), connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        tasks = []
        for r in results:
            body = request_body(args, r.index, tag)
            tasks.append(asyncio.ensure_future(stream_one(client, url, body, r, deadline, headers or {})))
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=max(1.0, deadline - time.perf_counter()))
        except asyncio.TimeoutError:
            for r, t in zip(results, tasks):
                if not t.done():
                    t.cancel()
                    r.error = r.error or "time limit reached"
        wall = time.perf_counter() - t0
    return results, wall


# ----------------------------------------------------------------------------------------------
# servers
# ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class ServerProcess:
    """A server subprocess on a loopback port, stopped on exit."""

    def __init__(self, cmd: list[str], port: int, name: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.port, self.name = cmd, port, name
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        import httpx

        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; see {self.log_path}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_minirt(args: argparse.Namespace, n_parallel: int, queue: int) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "minirt", "serve", "-m", args.model, "--port", str(port),
           "--parallel", str(n_parallel), "--queue", str(queue), "-c", str(args.ctx)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return ServerProcess(cmd, port, "minirt serve", Path(args.log_dir) / "serve_load.minirt.log", env)


def start_llama_server(binary: str, args: argparse.Namespace, n_parallel: int) -> ServerProcess:
    from minirt import registry

    port = free_port()
    path = registry.model_path(args.model, pull_missing=False)
    # llama-server splits -c across its -np slots: give every slot the context minirt gets
    cmd = [binary, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-np", str(n_parallel),
           "-c", str(args.ctx * n_parallel), "-cb"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    return ServerProcess(cmd, port, "llama-server", Path(args.log_dir) / "serve_load.llama-server.log")


def health(url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    import httpx

    try:
        r = httpx.get(url + "/health", headers=headers, timeout=5)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# phases
# ----------------------------------------------------------------------------------------------
def fmt_s(x: float | None, unit: str = "s", scale: float = 1.0) -> str:
    if x is None:
        return "—"
    v = x * scale
    return (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}") + (f" {unit}" if unit else "")


def print_summary(title: str, s: dict[str, Any]) -> None:
    print(f"  {title}: {s['completed']}/{s['clients']} completed, {s['tokens']} tokens in {s['wall_s']:.1f} s; "
          f"decode {fmt_s(s['decode_tok_s'], 'tok/s')} aggregate, {fmt_s(s['per_client_tok_s_mean'], 'tok/s')} "
          f"per client (min {fmt_s(s['per_client_tok_s_min'], 'tok/s')})")
    print(f"    TTFT p50/p95 {fmt_s(s['ttft_p50_s'], 'ms', 1e3)} / {fmt_s(s['ttft_p95_s'], 'ms', 1e3)}, "
          f"ITL p50/p95 {fmt_s(s['itl_p50_s'], 'ms', 1e3)} / {fmt_s(s['itl_p95_s'], 'ms', 1e3)}, "
          f"503 retries {s['retries_503']}, failures {len(s['failures'])}")
    if s.get("steady_decode_tok_s"):
        print(f"    steady state (all streams decoding, {s['steady_window_s']:.1f} s): "
              f"{fmt_s(s['steady_decode_tok_s'], 'tok/s')} aggregate")
    for f in s["failures"][:5]:
        print(f"    ! {f}")


def warm_up(url: str, args: argparse.Namespace, deadline: float, headers: dict[str, str], name: str) -> None:
    """Compile / page in before measuring (its prompts are tagged apart from every round's)."""
    asyncio.run(run_clients(url, 1, argparse.Namespace(**{**vars(args), "max_tokens": 4}), deadline,
                            headers=headers, tag=f"warm-{name}"))


def one_round(url: str, args: argparse.Namespace, deadline: float, headers: dict[str, str], rep: int,
              name: str) -> dict[str, Any]:
    """One round against one server: a single stream, then ``--clients`` concurrent streams, with
    prompts no earlier round used."""
    rnd: dict[str, Any] = {}
    res, wall = asyncio.run(run_clients(url, 1, args, deadline, headers=headers, seed=args.seed + rep,
                                        tag=f"{name}-r{rep}-single"))
    rnd["single"] = summarize(res, wall)
    res, wall = asyncio.run(run_clients(url, args.clients, args, deadline, headers=headers, seed=args.seed + rep,
                                        tag=f"{name}-r{rep}-load"))
    rnd["load"] = summarize(res, wall)
    a, b = rnd["load"]["decode_tok_s"], rnd["single"]["decode_tok_s"]
    rnd["ratio"] = a / b if a and b else None
    c = rnd["load"].get("steady_decode_tok_s")
    rnd["steady_ratio"] = c / b if c and b else None
    print(f" round {rep + 1}/{args.repetitions}: {name}")
    print_summary("1 stream ", rnd["single"])
    print_summary(f"{args.clients} streams", rnd["load"])
    print(f"    aggregate / single-stream decode: {fmt_s(rnd['ratio'], '')}× (prompt processing included), "
          f"{fmt_s(rnd['steady_ratio'], '')}× steady state")
    return rnd


def medians(rounds: list[dict[str, Any]], args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The rounds of one server and their medians (printed)."""
    def med(get: Any) -> float | None:
        xs = [v for v in (get(r) for r in rounds) if v]
        return statistics.median(xs) if xs else None

    out: dict[str, Any] = {"rounds": rounds}
    out["single"], out["load"] = dict(rounds[-1]["single"]), dict(rounds[-1]["load"])
    out["load"]["failures"] = [f for r in rounds for f in r["load"]["failures"] + r["single"]["failures"]]
    out["median"] = {"single_decode_tok_s": med(lambda r: r["single"]["decode_tok_s"]),
                     "load_decode_tok_s": med(lambda r: r["load"]["decode_tok_s"]),
                     "load_throughput_tok_s": med(lambda r: r["load"]["throughput_tok_s"]),
                     "steady_decode_tok_s": med(lambda r: r["load"].get("steady_decode_tok_s")),
                     "ratio": med(lambda r: r["ratio"]), "steady_ratio": med(lambda r: r["steady_ratio"])}
    out["ratio"], out["steady_ratio"] = out["median"]["ratio"], out["median"]["steady_ratio"]
    m = out["median"]
    print(f"  {name}, median of {len(rounds)} rounds: single stream {fmt_s(m['single_decode_tok_s'], 'tok/s')}, "
          f"{args.clients} streams {fmt_s(m['load_decode_tok_s'], 'tok/s')} "
          f"(steady {fmt_s(m['steady_decode_tok_s'], 'tok/s')})")
    print(f"  {name} aggregate / single-stream decode, median: {fmt_s(out['ratio'], '')}× from the first stream's "
          f"first token to the last stream's last (prompt processing included); {fmt_s(out['steady_ratio'], '')}× "
          f"in the steady state" + (" (target ≥ 3.5× at 16 streams)" if args.clients == 16 else ""))
    return out


def throughput(url: str, args: argparse.Namespace, deadline: float, headers: dict[str, str],
               name: str = "minirt") -> dict[str, Any]:
    """Warm-up, then ``--repetitions`` rounds against one server (no peer to alternate with)."""
    warm_up(url, args, deadline, headers, name)
    return medians([one_round(url, args, deadline, headers, rep, name) for rep in range(args.repetitions)],
                   args, name)


def alternating(servers: list[tuple[str, str, dict[str, str]]], args: argparse.Namespace,
                deadline: float) -> dict[str, dict[str, Any]]:
    """Rounds alternating between the servers (``(name, url, headers)``), so a machine that gets
    busier or cooler over the run affects both alike; the order flips every round."""
    for name, url, headers in servers:
        warm_up(url, args, deadline, headers, name)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in servers}
    for rep in range(args.repetitions):
        order = servers if rep % 2 == 0 else servers[::-1]
        for name, url, headers in order:
            rounds[name].append(one_round(url, args, deadline, headers, rep, name))
    return {name: medians(rs, args, name) for name, rs in rounds.items()}


def many_streams(url: str, args: argparse.Namespace, deadline: float, headers: dict[str, str]) -> dict[str, Any]:
    """``--check-streams N``: N concurrent streams at once (more than the server's slots: the rest
    queue); every one must complete."""
    n = args.check_streams
    res, wall = asyncio.run(run_clients(url, n, args, deadline, headers=headers, seed=args.seed + 99,
                                        tag=f"many-{n}"))
    s = summarize(res, wall)
    bad = s["failures"] + [f"client {i}: incomplete" for i in s["incomplete"]]
    print(f"  {n} concurrent streams: {s['completed']}/{n} completed in {wall:.1f} s, {len(bad)} failures, "
          f"503 retries {s['retries_503']}: {'PASS' if not bad else 'FAIL'}")
    for f in bad[:5]:
        print(f"    ! {f}")
    return {"clients": n, "summary": s, "failures": bad, "ok": not bad}


def disconnects(srv_url: str, pid: int | None, args: argparse.Namespace, deadline: float,
                headers: dict[str, str]) -> dict[str, Any]:
    """Many clients, some dropping mid-stream: the server must stay up, finish the rest, drain, and
    give its memory back."""
    n, frac = args.disconnect_clients, args.disconnect_fraction
    # warm-up at full batch width first, so one-time costs (JIT compilation, buffers sized for the
    # widest batch) are in the "before" level and the check measures what the load itself leaves
    warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
    asyncio.run(run_clients(srv_url, min(n, args.parallel or args.clients), warm, deadline, headers=headers))
    rss0 = rss_kib(pid) if pid else None
    h0 = health(srv_url, headers) or {}
    if args.disconnect_max_tokens:
        args = argparse.Namespace(**{**vars(args), "max_tokens": args.disconnect_max_tokens})
    res, wall = asyncio.run(run_clients(srv_url, n, args, deadline, disconnect=frac, seed=args.seed + 1,
                                        headers=headers))
    dropped = [r for r in res if r.disconnected]
    kept = [r for r in res if r.disconnect_after is None]
    failed = [r for r in kept if r.error or not r.done or r.finish_reason not in ("length", "stop")]
    out: dict[str, Any] = {"clients": n, "disconnect_fraction": frac, "dropped": len(dropped),
                           "kept": len(kept), "kept_failed": [f"client {r.index}: {r.error or r.finish_reason}"
                                                              for r in failed],
                           "wall_s": wall, "summary": summarize(kept, wall)}
    # the scheduler must drain: nothing running, nothing waiting, no request still tracked
    drained, h = False, None
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        h = health(srv_url, headers)
        if h is None:
            break
        sched = h.get("scheduler")
        if sched is None or (sched["running"] == 0 and sched["waiting"] == 0 and h.get("active", 0) == 0):
            drained = True
            break
        time.sleep(0.2)
    out["server_up"] = h is not None
    out["drained"] = drained
    if h and "disconnects" in h:
        out["server_saw_disconnects"] = h["disconnects"] - h0.get("disconnects", 0)
    # memory: back within 10% of the pre-load level (allow a few seconds for frees to land)
    if rss0:
        rss1 = rss_kib(pid)
        t_end = time.monotonic() + 20
        while rss1 and rss1 > 1.10 * rss0 and time.monotonic() < t_end:
            time.sleep(0.5)
            rss1 = rss_kib(pid)
        peak = None
        try:
            with open(f"/proc/{pid}/status") as f:
                peak = next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
        except OSError:
            pass
        out.update(rss_before_kib=rss0, rss_after_kib=rss1, rss_peak_kib=peak,
                   rss_ok=bool(rss1 and rss1 <= 1.10 * rss0))
    else:
        out["rss_ok"] = None
    out["ok"] = bool(out["server_up"] and drained and not failed and out["rss_ok"] is not False)
    print(f"  {n} clients, {len(dropped)} dropped mid-stream at random ({frac:.0%} chosen), "
          f"{len(kept) - len(failed)}/{len(kept)} of the rest completed in {wall:.1f} s")
    if "server_saw_disconnects" in out:
        print(f"    server counted {out['server_saw_disconnects']} disconnects; "
              f"scheduler drained: {drained}; server up: {out['server_up']}")
    else:
        print(f"    scheduler drained: {drained}; server up: {out['server_up']}")
    if rss0:
        print(f"    RSS before {rss0 / 1024:.0f} MiB, after {out['rss_after_kib'] / 1024:.0f} MiB "
              f"({out['rss_after_kib'] / rss0 - 1:+.1%}; limit +10%), peak {fmt_s(peak and peak / 1024, 'MiB')}: "
              f"{'ok' if out['rss_ok'] else 'NOT OK'}")
    else:
        print("    RSS not checked (no server PID: start the server here or pass --server-pid)")
    for f in out["kept_failed"][:5]:
        print(f"    ! {f}")
    print(f"  disconnect check: {'PASS' if out['ok'] else 'FAIL'}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Load test of the OpenAI-compatible server over loopback.")
    ap.add_argument("-m", "--model", default=None, help="registry name or GGUF path (default: the default model)")
    ap.add_argument("--url", help="use a running server (loopback) instead of starting one")
    ap.add_argument("--server-pid", type=int, help="PID of the --url server (for the RSS check)")
    ap.add_argument("--api-key", help="bearer key of the --url server")
    ap.add_argument("--model-name", help="'model' field to send (default: none, the server's model)")
    ap.add_argument("-n", "--clients", type=int, default=16, help="concurrent streaming clients (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--api", choices=["chat", "completions"], default="chat",
                    help="streaming chat (default) or plain completion requests")
    ap.add_argument("--check-streams", type=int, default=0, metavar="N",
                    help="also run N concurrent streams at once (e.g. 64) and require 0 failures")
    ap.add_argument("-r", "--repetitions", type=int, default=5,
                    help="rounds of (1 stream, N streams) per server, alternating between the servers; ratios "
                         "are reported per round and as medians (default 5)")
    ap.add_argument("--prompt-pad", type=int, default=0, help="repeat a filler sentence this many times in prompts")
    ap.add_argument("--parallel", type=int, help="server slots (default: --clients)")
    ap.add_argument("-c", "--ctx", type=int, default=1024, help="context per sequence (default 1024)")
    ap.add_argument("-t", "--threads", type=int, help="server threads")
    ap.add_argument("--disconnect-fraction", type=float, default=0.0,
                    help="also run the disconnect check with this fraction of clients dropping (e.g. 0.33)")
    ap.add_argument("--disconnect-clients", type=int, default=100, help="clients in the disconnect check (100)")
    ap.add_argument("--disconnect-max-tokens", type=int, default=0,
                    help="tokens per request in the disconnect check (default: --max-tokens); enough that a "
                         "dropped request is still generating when its client leaves, on a fast machine too")
    ap.add_argument("--skip-throughput", action="store_true", help="run only the disconnect check")
    ap.add_argument("--no-peer", action="store_true",
                    help=f"do not run llama-server even if ${ENV_LLAMA_SERVER} is set")
    ap.add_argument("--time-limit", type=float, default=900, help="seconds for the whole run (default 900)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp"), help="server logs go here")
    ap.add_argument("--json", help="write the results to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from minirt import registry

    args.model = args.model or registry.DEFAULT_MODEL
    if args.clients < 1 or args.max_tokens < 2 or args.repetitions < 1 or not 0 <= args.disconnect_fraction < 1:
        print("error: need --clients ≥ 1, --max-tokens ≥ 2, --repetitions ≥ 1, 0 ≤ --disconnect-fraction < 1",
              file=sys.stderr)
        return 2
    if args.url:
        host = args.url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(f"error: --url must be a loopback address, got {host}", file=sys.stderr)
            return 2
    deadline = time.perf_counter() + args.time_limit
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    n_par = args.parallel or args.clients
    report: dict[str, Any] = {"model": args.model, "clients": args.clients, "max_tokens": args.max_tokens,
                              "note": "indicative only: measured on a shared machine"}
    plan = [] if args.skip_throughput else [f"1 then {args.clients} streams"]
    if args.disconnect_fraction:
        plan.append(f"{args.disconnect_clients} clients with {args.disconnect_fraction:.0%} disconnecting")
    print(f"serve_load: model {args.model}; {', '.join(plan)}; {args.max_tokens} tokens per request; "
          f"server slots {n_par} (timings indicative: shared machine)")
    rc = 0

    binary = os.environ.get(ENV_LLAMA_SERVER)
    want_peer = not (args.no_peer or args.skip_throughput)
    if want_peer and (not binary or not os.access(binary, os.X_OK)):
        why = f"${ENV_LLAMA_SERVER} is not set" if not binary else f"{binary} is not an executable file"
        print(f"llama-server: MISSING, not compared ({why}; point it at a llama-server binary from the same "
              f"llama.cpp build, e.g. build/bin/llama-server)")
        report["llama_server"] = f"missing: {why}"
        want_peer = False
    elif not want_peer:
        report["llama_server"] = "skipped"

    srv = peer = None
    try:
        if args.url:
            url, pid = args.url.rstrip("/"), args.server_pid
        else:
            queue = max(64, args.check_streams, args.disconnect_clients if args.disconnect_fraction else 0)
            srv = start_minirt(args, n_par, queue)
            srv.wait_ready(args.startup_timeout)
            url, pid = srv.url, srv.pid
        print(f"minirt at {url}" + (f" (pid {pid})" if pid else ""))
        if want_peer:
            try:
                peer = start_llama_server(binary, args, n_par)  # type: ignore[arg-type]
                peer.wait_ready(args.startup_timeout)
                print(f"llama-server at {peer.url} (-np {n_par})")
            except RuntimeError as e:
                print(f"llama-server: failed to run ({e})")
                report["llama_server"] = f"failed: {e}"
                if peer is not None:
                    peer.stop()
                peer = None
        if not args.skip_throughput:
            if peer is not None:
                both = alternating([("minirt", url, headers), ("llama-server", peer.url, {})], args, deadline)
                report["minirt"], report["llama_server"] = both["minirt"], both["llama-server"]
                m, p = report["minirt"]["median"], report["llama_server"]["median"]
                ratio = (m["load_decode_tok_s"] / p["load_decode_tok_s"]
                         if m.get("load_decode_tok_s") and p.get("load_decode_tok_s") else None)
                report["minirt_vs_llama_server"] = ratio
                print(f"\nsummary ({args.clients} streams, {args.max_tokens} tokens each, medians of "
                      f"{args.repetitions} alternating rounds):")
                print(f"  minirt       aggregate decode {fmt_s(m['load_decode_tok_s'], 'tok/s')}, single stream "
                      f"{fmt_s(m['single_decode_tok_s'], 'tok/s')}, {args.clients}/1 ratio {fmt_s(m['ratio'], '')}×")
                print(f"  llama-server aggregate decode {fmt_s(p['load_decode_tok_s'], 'tok/s')}, single stream "
                      f"{fmt_s(p['single_decode_tok_s'], 'tok/s')}, {args.clients}/1 ratio {fmt_s(p['ratio'], '')}×")
                print(f"  minirt / llama-server aggregate: {fmt_s(ratio, '')}×"
                      + (" (target ≥ 3×)" if args.clients == 16 else ""))
                if report["llama_server"]["load"]["failures"]:
                    print("  (llama-server had failures: see above)")
            else:
                report["minirt"] = throughput(url, args, deadline, headers)
            if report["minirt"]["load"]["failures"]:
                rc = 1
        if args.check_streams:
            report["many_streams"] = many_streams(url, args, deadline, headers)
            if not report["many_streams"]["ok"]:
                rc = 1
        if args.disconnect_fraction:
            report["disconnect"] = disconnects(url, pid, args, deadline, headers)
            if not report["disconnect"]["ok"]:
                rc = 1
    finally:
        if peer is not None:
            peer.stop()
        if srv is not None:
            alive = srv.alive()
            srv.stop()
            if not alive:
                print(f"minirt serve died during the run; see {srv.log_path}")
                rc = 1

    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
