"""Connection and request guards of the HTTP server (``minirt serve``, :class:`minirt.server.BackgroundServer`).

Two layers, both configured by :class:`GuardOptions`:

* The HTTP protocol (:func:`guarded_protocol`, a subclass of uvicorn's h11 protocol) bounds what a
  connection can hold: the request line and headers must arrive within ``header_timeout`` seconds
  of the connection opening (or of the previous response on a keep-alive connection), the body
  within ``body_timeout`` seconds of the headers; otherwise the connection gets ``408`` and is
  closed. Idle keep-alive connections close after ``keep_alive_timeout``. At most
  ``max_connections`` connections are open: a new one beyond that evicts the connection that has
  been idle (or stuck sending headers) the longest, and is refused with ``503`` only when every
  connection has a request in flight. So half-sent requests cannot exhaust file descriptors and
  ``/health`` keeps answering.
* The ASGI middleware (:class:`GuardMiddleware`) answers ``503`` (``server_busy``, with
  ``Retry-After``) once ``limit_concurrency`` requests are in flight (``/health`` is exempt),
  refuses non-empty ``POST`` bodies that are not ``application/json`` (``415``: a browser page can send
  ``text/plain`` cross-origin without a CORS preflight), refuses a ``Host`` that is not a loopback
  name on connections to a loopback address (``421``: DNS rebinding), and refuses an ``Origin``
  that is neither the server itself nor listed in ``allow_origins`` (``403``); listed origins get
  CORS headers (Starlette's ``CORSMiddleware``).

The h11 protocol is used whatever else is installed: the guards rely on its request/response
cycle, and parsing speed is irrelevant next to a forward pass.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEP_ALIVE_TIMEOUT_S = 5.0
LIMIT_CONCURRENCY = 256
MAX_CONNECTIONS = 512
RETRY_AFTER_S = 1
EXEMPT_PATHS = frozenset({"/health", "/metrics"})  # answered even when the server is saturated


@dataclass(frozen=True)
class GuardOptions:
    """Limits and cross-origin policy of one server (defaults are ``minirt serve``'s)."""

    limit_concurrency: int = LIMIT_CONCURRENCY  # requests in flight before 503 (/health exempt)
    max_connections: int = MAX_CONNECTIONS  # open connections at most (idle ones are evicted first)
    header_timeout: float = HEADER_TIMEOUT_S  # request line + headers must arrive within this
    body_timeout: float = BODY_TIMEOUT_S  # the whole body must arrive within this after the headers
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT_S  # idle keep-alive connections close after this
    allow_origins: tuple[str, ...] = ()  # Origin values allowed cross-origin ("*": any), with CORS headers
    allow_hosts: tuple[str, ...] = ()  # extra Host names accepted on loopback connections

    def __post_init__(self) -> None:
        from .errors import InvalidRequestError

        for name in ("limit_concurrency", "max_connections"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {v!r}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise InvalidRequestError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.max_connections <= self.limit_concurrency:
            # requests beyond limit_concurrency are answered at once and their connections become
            # evictable, so /health always finds a connection slot
            object.__setattr__(self, "max_connections", self.limit_concurrency + 16)
        object.__setattr__(self, "allow_origins", tuple(_norm_origin(o) for o in self.allow_origins))
        object.__setattr__(self, "allow_hosts", tuple(h.lower() for h in self.allow_hosts))


def _norm_origin(o: str) -> str:
    return o if o in ("*", "null") else o.strip().rstrip("/").lower()


def error_json(message: str, code: str, type: str = "invalid_request_error") -> bytes:
    """An OpenAI-shaped error body (the shape :class:`minirt.server.HTTPError` answers)."""
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}},
                      separators=(",", ":")).encode()


def _raw_response(status: int, reason: str, body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n").encode() + body


# ----------------------------------------------------------------------------------------------
# protocol layer
# ----------------------------------------------------------------------------------------------
def guarded_protocol(opts: GuardOptions) -> type:
    """uvicorn's h11 protocol class with header/body deadlines and a connection cap (module doc)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        options = opts

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._seen_cycle: Any = None
            self._idle_since = time.monotonic()
            self._partial = False  # bytes of a request received, its headers not complete yet

        # -- state -----------------------------------------------------------------------------
        def _busy(self) -> bool:
            """A request is in flight (headers complete, response not yet)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self, seconds: float, fn: Callable[[], None]) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, fn)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        # -- asyncio.Protocol ------------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(opts.header_timeout, self._header_expired)
            if len(self.connections) > opts.max_connections and not self._evict_one():
                log.warning("refusing a connection: %d open, every one with a request in flight",
                            len(self.connections))
                body = error_json(f"server busy: {opts.max_connections} connections are open; retry later",
                                  "server_busy", "server_error")
                self._close_with(_raw_response(503, "Service Unavailable", body, f"retry-after: {RETRY_AFTER_S}\r\n"))

        def data_received(self, data: bytes) -> None:
            if not self._busy():
                self._partial = True
            super().data_received(data)
            self._track_cycle()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            # the next request's headers (or the rest of an unread body) must come in time too;
            # uvicorn's own keep-alive timer is reset by any byte, this one is not
            self._idle_since = time.monotonic()
            self._partial = False
            self._seen_cycle = self.cycle
            if not self.transport.is_closing():
                self._arm(opts.header_timeout, self._header_expired)
            super().on_response_complete()  # may start a pipelined request
            self._track_cycle()

        # -- deadlines -------------------------------------------------------------------------
        def _track_cycle(self) -> None:
            c = self.cycle
            if c is None or c.response_complete:
                return
            if c is not self._seen_cycle:  # a request's headers are complete
                self._seen_cycle = c
                self._partial = False
                if c.more_body:
                    self._arm(opts.body_timeout, self._body_expired)
                else:
                    self._disarm()
            elif not c.more_body and self._timer is not None:
                self._disarm()  # the body is complete

        def _header_expired(self) -> None:
            self._timer = None
            if self._busy() or self.transport.is_closing():
                return
            if self.conn.their_state is h11.SEND_BODY:  # the rest of a body the app did not read
                self.transport.close()
            elif self._partial:
                self._close_with(_raw_response(408, "Request Timeout", error_json(
                    f"the request headers did not arrive within {opts.header_timeout:g} s", "request_timeout")))
            else:  # an idle keep-alive connection
                self.transport.close()

        def _body_expired(self) -> None:
            self._timer = None
            c = self.cycle
            if c is None or not c.more_body or self.transport.is_closing():
                return
            log.info("closing a connection whose request body did not arrive within %g s", opts.body_timeout)
            data = b""
            if not c.response_started:
                data = _raw_response(408, "Request Timeout", error_json(
                    f"the request body did not arrive within {opts.body_timeout:g} s", "request_timeout"))
                c.response_started = True  # the app's own answer is dropped
            c.disconnected = True  # the app's receive() now returns http.disconnect
            c.message_event.set()
            self._close_with(data)

        def _close_with(self, data: bytes) -> None:
            self._disarm()
            if data:
                self.transport.write(data)
            self.transport.close()

        # -- connection cap --------------------------------------------------------------------
        def _evict_one(self) -> bool:
            """Close the connection idle (or stuck in its headers) the longest; False if none is."""
            victim = None
            for p in self.connections:
                if p is self or not isinstance(p, GuardedH11Protocol) or p._busy() or p.transport.is_closing():
                    continue
                if victim is None or p._idle_since < victim._idle_since:
                    victim = p
            if victim is None:
                return False
            if victim._partial:
                victim._close_with(_raw_response(408, "Request Timeout", error_json(
                    "the request headers were too slow while the server is at its connection limit",
                    "request_timeout")))
            else:
                victim._close_with(b"")
            self.connections.discard(victim)  # counted out now; its connection_lost comes later
            return True

    return GuardedH11Protocol


# ----------------------------------------------------------------------------------------------
# ASGI layer
# ----------------------------------------------------------------------------------------------
def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """``Host`` header value without its port, lower case (``[::1]:8080`` -> ``[::1]``)."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def loopback_host_ok(host: str, extra: Sequence[str] = ()) -> bool:
    """Is ``host`` (a ``Host`` header) a name that can only mean this machine? Any port is
    accepted: a tunnel (``ssh -L``) may forward another port, and the port gives a page no way in."""
    name = _host_name(host)
    if name in extra:
        return True
    return name == "localhost" or name.endswith(".localhost") or _is_loopback_ip(name)


def is_json_media_type(value: str | None) -> bool:
    """``application/json`` or any ``+json`` type, parameters (charset) ignored."""
    if not value:
        return False
    mt = value.split(";", 1)[0].strip().lower()
    return mt == "application/json" or (mt.startswith("application/") and mt.endswith("+json"))


class GuardMiddleware:
    """Concurrency limit, JSON content type, Host and Origin checks (module doc)."""

    def __init__(self, app: Any, options: GuardOptions, on_refused: Callable[[], None] | None = None) -> None:
        self.app, self.opts, self.on_refused = app, options, on_refused
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._check(scope)
        if refusal is not None:
            status, message, code, extra = refusal
            await _send_json(send, status, error_json(message, code, "server_error" if status == 503 else
                                                      "invalid_request_error"), extra)
            return
        exempt = scope.get("path") in EXEMPT_PATHS
        if not exempt:
            if self.in_flight >= self.opts.limit_concurrency:
                if self.on_refused is not None:
                    self.on_refused()
                await _send_json(send, 503, error_json(
                    f"server busy: {self.in_flight} requests in flight (limit {self.opts.limit_concurrency}); "
                    "retry later", "server_busy", "server_error"), [(b"retry-after", str(RETRY_AFTER_S).encode())])
                return
            self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if not exempt:
                self.in_flight -= 1

    def _check(self, scope: dict[str, Any]) -> tuple[int, str, str, list[tuple[bytes, bytes]]] | None:
        headers: dict[str, str] = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        host = headers.get("host", "")
        server = scope.get("server")
        # (no Host at all, as HTTP/1.0 allows, is not a browser: browsers always send one)
        if host and server and _is_loopback_ip(str(server[0])) and not loopback_host_ok(host, self.opts.allow_hosts):
            # a page on a rebinding name (evil.example -> 127.0.0.1) reaches a loopback server with
            # its own name as Host; only loopback names are served here
            return (421, f"Host {host!r} is not a loopback name; this server answers to localhost, 127.0.0.1 "
                         "and [::1] (add names with --allow-host)", "invalid_host", [])
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin, host):
            return (403, f"cross-origin requests from {origin!r} are not allowed (allow them with "
                         "--allow-origin)", "origin_not_allowed", [])
        has_body = headers.get("content-length", "0").strip() != "0" or "transfer-encoding" in headers
        if scope.get("method") == "POST" and has_body and not is_json_media_type(headers.get("content-type")):
            got = headers.get("content-type")
            return (415, "the request body must be JSON sent with 'Content-Type: application/json'"
                         + (f", got {got!r}" if got else " (the header is missing)"), "unsupported_media_type", [])
        return None

    def _origin_ok(self, origin: str, host: str) -> bool:
        o = _norm_origin(origin)
        if "*" in self.opts.allow_origins or o in self.opts.allow_origins:
            return True
        try:
            netloc = urlsplit(o).netloc
        except ValueError:
            return False
        return bool(netloc) and netloc == host.strip().lower()  # same origin: a page this server served


async def _send_json(send: Callable[[dict[str, Any]], Awaitable[None]], status: int, body: bytes,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def middleware(options: GuardOptions, on_refused: Callable[[], None] | None = None) -> list[Any]:
    """Starlette middleware list: the guard outside, CORS for the allowed origins inside."""
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    mw = [Middleware(GuardMiddleware, options=options, on_refused=on_refused)]
    if options.allow_origins:
        mw.append(Middleware(CORSMiddleware, allow_origins=list(options.allow_origins),
                             allow_methods=["GET", "POST", "OPTIONS"],
                             allow_headers=["authorization", "content-type"], max_age=600))
    return mw


__all__ = ["GuardOptions", "GuardMiddleware", "guarded_protocol", "middleware", "loopback_host_ok",
           "is_json_media_type"]
