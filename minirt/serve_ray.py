"""Scale-out with Ray Serve: N replicas of the minirt engine behind Ray Serve's HTTP proxy
(``minirt serve --ray`` or :func:`build_ray_app`; ``pip install 'minirt[ray]'``).

Two deployments:

* ``MinirtEngine`` (``--replicas`` or autoscaling ``--min-replicas`` / ``--max-replicas``): each
  replica loads the model and runs minirt's own ASGI app (:func:`minirt.server.build_app`)
  in-process, so every route (OpenAI chat / completions with streaming, ``/completion``,
  ``/tokenize``, ``/metrics`` …) behaves exactly as in ``minirt serve``. A request travels as
  (method, path, headers, body) and its response comes back as a stream of byte chunks.
* ``MinirtIngress`` (behind Ray Serve's HTTP proxy): reads the request, computes its routing key
  and streams the engine's answer back.

Prefix affinity: the engine deployment uses a custom Ray Serve ``RequestRouter``
(:class:`minirt.serve_ray_router.PrefixAffinityRouter`) that ranks replicas by rendezvous hashing of the request's key:
the ``X-Session-Id`` header or the body's ``session_id`` / ``user`` when given, else a hash of the
conversation's start (model, first two messages; a completion prompt's first 512 characters).
Every turn of one conversation therefore lands on the replica whose prefix cache holds it; when
that replica is saturated Ray Serve falls back to the others, and when a replica goes only its
keys move.

A replica that dies mid-stream ends its streams with an OpenAI-shaped error event (``data:
{"error": ...}``) rather than a hung connection; requests not yet sent are routed to the live
replicas.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any

from .errors import InvalidRequestError, MinirtError

log = logging.getLogger(__name__)

APP_NAME = "minirt"
SESSION_HEADER = "x-session-id"
_HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


def _require_ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise MinirtError(f"Ray Serve is not installed ({e}); install it with: pip install 'minirt[ray]'") from e
    return ray


def routing_key(headers: dict[str, str], body: bytes) -> str:
    """The key that keeps one conversation on one replica ("" when there is nothing to go by)."""
    sid = headers.get(SESSION_HEADER)
    if sid:
        return "s:" + sid
    try:
        d = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return ""
    if not isinstance(d, dict):
        return ""
    for k in ("session_id", "user"):
        if isinstance(d.get(k), str) and d[k]:
            return "s:" + d[k]
    model = d.get("model") if isinstance(d.get("model"), str) else ""
    msgs = d.get("messages")
    if isinstance(msgs, list) and msgs:
        start = json.dumps(msgs[:2], sort_keys=True, default=str)
    elif isinstance(d.get("prompt"), (str, list)):
        start = json.dumps(d["prompt"], default=str)[:512]
    else:
        return ""
    return "p:" + hashlib.blake2b(f"{model}\0{start}".encode(), digest_size=12).hexdigest()


def rank_replicas(key: str, replica_ids: list[str]) -> list[int]:
    """Indices of ``replica_ids`` in rendezvous-hash order for ``key`` (best first)."""
    def score(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{rid}".encode(), digest_size=8).digest()

    return sorted(range(len(replica_ids)), key=lambda i: score(replica_ids[i]), reverse=True)


class AsgiRunner:
    """Call an ASGI app in-process with one buffered request; yields the response start
    ``(status, headers)`` then the body chunks as they are sent. Closing the iterator early is
    a client disconnect (the app sees ``http.disconnect``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                       body: bytes) -> AsyncIterator[Any]:
        # "server" None: no socket here (the proxy has it), so no loopback Host check (minirt.http_guard)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
                 "root_path": "", "client": ("127.0.0.1", 0), "server": None,
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
                 + [(b"content-length", str(len(body)).encode())]}
        out: asyncio.Queue[Any] = asyncio.Queue()
        gone = asyncio.Event()
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            await out.put(msg)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await out.put(None)

        task = asyncio.ensure_future(run())
        try:
            while True:
                msg = await out.get()
                if msg is None:
                    break
                if msg["type"] == "http.response.start":
                    yield (msg["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                           for k, v in msg.get("headers", [])])
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body", False):
                        break
        finally:
            gone.set()
            try:
                await asyncio.wait_for(task, timeout=10)
            except (asyncio.TimeoutError, Exception):  # the app logged its own failure
                task.cancel()


def build_ray_app(model: str, *, load_options: dict[str, Any] | None = None,
                  scheduler_options: dict[str, Any] | None = None, app_options: dict[str, Any] | None = None,
                  replicas: int = 1, min_replicas: int | None = None, max_replicas: int | None = None,
                  target_ongoing_requests: float = 8, replica_cpus: float = 1.0,
                  max_ongoing_requests: int = 64) -> Any:
    """The Ray Serve application (pass it to ``ray.serve.run``).

    ``model``: registry name or GGUF path, readable on every node. ``load_options``:
    :func:`minirt.load` keywords; ``scheduler_options``: :meth:`Model.configure_scheduler`;
    ``app_options``: :func:`minirt.server.build_app` keywords (api_key, model_id …). Fixed
    ``replicas``, or autoscaling between ``min_replicas`` and ``max_replicas`` aiming at
    ``target_ongoing_requests`` per replica."""
    _require_ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse

    if replicas < 1:
        raise InvalidRequestError(f"replicas must be at least 1, got {replicas}")
    scale: dict[str, Any]
    if min_replicas is not None or max_replicas is not None:
        lo = 1 if min_replicas is None else min_replicas
        hi = max(lo, replicas) if max_replicas is None else max_replicas
        if not 0 <= lo <= hi or hi < 1:
            raise InvalidRequestError(f"need 0 ≤ min_replicas ≤ max_replicas, max ≥ 1; got {lo}, {hi}")
        scale = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": max(lo, 1),
                                        "target_ongoing_requests": target_ongoing_requests}}
    else:
        scale = {"num_replicas": replicas}
    load_kw, sched_kw, app_kw = dict(load_options or {}), dict(scheduler_options or {}), dict(app_options or {})

    @serve.deployment(name="MinirtEngine", ray_actor_options={"num_cpus": replica_cpus},
                      max_ongoing_requests=max_ongoing_requests,
                      request_router_config=RequestRouterConfig(
                          request_router_class="minirt.serve_ray_router:PrefixAffinityRouter"),
                      graceful_shutdown_timeout_s=5, health_check_period_s=2, health_check_timeout_s=10, **scale)
    class MinirtEngine:
        def __init__(self) -> None:
            import minirt
            from minirt.server import build_app

            self.llm = minirt.load(model, **load_kw)
            if sched_kw:
                self.llm.configure_scheduler(**sched_kw)
            self.runner = AsgiRunner(build_app(self.llm, **app_kw))
            try:
                self.tag = str(serve.get_replica_context().replica_id.unique_id)
            except Exception:  # outside a replica (tests calling the class directly)
                self.tag = "local"

        async def handle(self, key: str, method: str, path: str, query: str, headers: list[tuple[str, str]],
                         body: bytes) -> AsyncIterator[Any]:
            first = True
            async for item in self.runner(method, path, query, headers, body):
                if first:  # the response start: say which replica answered
                    first = False
                    item = (item[0], [*item[1], ("x-minirt-replica", self.tag)])
                yield item

        def check_health(self) -> None:
            if self.llm.closed:
                raise RuntimeError("the model is closed")

        def __del__(self) -> None:
            llm = getattr(self, "llm", None)
            if llm is not None:
                llm.close()

    @serve.deployment(name="MinirtIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    class MinirtIngress:
        def __init__(self, engine: Any) -> None:
            self.engine = engine.options(stream=True)

        async def __call__(self, request: Request) -> Any:
            body = await request.body()
            headers = {k.lower(): v for k, v in request.headers.items()}
            fwd = [(k, v) for k, v in headers.items() if k not in _HOP_HEADERS]
            key = routing_key(headers, body)
            gen = self.engine.handle.remote(key, request.method, request.url.path, request.url.query, fwd, body)
            try:
                status, resp_headers = await gen.__anext__()
            except StopAsyncIteration:
                return _error(502, "the engine replica sent no response")
            except Exception as e:  # the replica died before answering
                log.warning("engine replica failed before answering: %r", e)
                return _error(503, f"the engine replica failed ({type(e).__name__}); retry", retry=True)
            hdrs = {k: v for k, v in resp_headers if k.lower() not in _HOP_HEADERS}
            streaming = any(k.lower() == "content-type" and v.startswith("text/event-stream")
                            for k, v in resp_headers)

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for b in gen:
                        yield b
                except Exception as e:  # the replica died mid-response: end it with a clean error
                    log.warning("engine replica failed mid-response: %r", e)
                    if streaming:
                        err = {"error": {"message": f"the engine replica failed mid-stream ({type(e).__name__})",
                                         "type": "server_error", "param": None, "code": "replica_failed"}}
                        yield b"data: " + json.dumps(err).encode() + b"\n\n"
                finally:
                    gen.cancel()

            if not streaming:  # small: buffer it, so a failure can still become a proper status
                parts = []
                try:
                    async for b in gen:
                        parts.append(b)
                except Exception as e:
                    return _error(503, f"the engine replica failed ({type(e).__name__}); retry", retry=True)
                from starlette.responses import Response

                return Response(b"".join(parts), status_code=status, headers=hdrs)
            return StreamingResponse(chunks(), status_code=status, headers=hdrs)

    def _error(status: int, msg: str, retry: bool = False) -> Any:
        return JSONResponse({"error": {"message": msg, "type": "server_error", "param": None,
                                       "code": "replica_failed"}}, status_code=status,
                            headers={"Retry-After": "1"} if retry else None)

    return MinirtIngress.bind(MinirtEngine.bind())


def _python_path() -> str:
    """This minirt's import root, for Ray workers started on this machine."""
    import minirt

    root = os.path.dirname(os.path.dirname(os.path.abspath(minirt.__file__)))
    extra = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + extra if extra else "")


def start(app: Any, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
          num_cpus: int | None = None) -> None:
    """Start (or join) Ray, then Ray Serve's HTTP proxy on ``host:port``, and deploy ``app``."""
    ray = _require_ray()
    from ray import serve

    if not ray.is_initialized():
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                              "runtime_env": {"env_vars": {"PYTHONPATH": _python_path()}}}
        if address:
            kw["address"] = address
        elif num_cpus is not None:
            kw["num_cpus"] = num_cpus
        ray.init(**kw)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/")


def serve_from_args(args: Any) -> int:
    """``minirt serve --ray``: deploy, then serve until interrupted."""
    from . import loading

    if getattr(args, "models_dir", None) or (isinstance(args.model, list) and len(args.model) > 1):
        raise InvalidRequestError("--ray serves one model; several models need one Ray app each")
    model = args.model[0] if isinstance(args.model, list) else args.model
    args.model = model
    api_key = args.api_key or os.environ.get("MINIRT_API_KEY") or None
    app = build_ray_app(loading.model_name(args), load_options=loading.load_options(args),
                        scheduler_options={"n_parallel": args.parallel, "kv_budget_tokens": args.kv_budget_tokens,
                                           "max_queue": args.queue},
                        app_options={"api_key": api_key, "model_id": args.alias or None},
                        replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                        target_ongoing_requests=args.target_ongoing_requests, replica_cpus=args.replica_cpus,
                        max_ongoing_requests=args.parallel + args.queue)
    start(app, host=args.host, port=args.port, address=args.ray_address)
    log.info("Ray Serve: minirt at http://%s:%d/v1", args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    from ray import serve

    serve.shutdown()
    return 0


__all__ = ["build_ray_app", "start", "serve_from_args", "routing_key", "rank_replicas", "AsgiRunner",
           "SESSION_HEADER"]
