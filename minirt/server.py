"""OpenAI-compatible HTTP server: step 1 of the pipeline for HTTP clients (``minirt serve``).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream``: SSE
``data: {...}`` chunks ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``
and ``GET /health``. Responses have the shapes the official ``openai`` client parses.

Every request goes through the model's continuous-batching scheduler (``Model.submit``); the
event loop never runs a forward pass, never tokenizes (that happens on a worker thread) and only
relays :class:`minirt.generate.TokenEvent` objects as they arrive. A client that disconnects
cancels its generation at the next scheduler step, streaming or not.

Failure mapping (OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}``):
bad request → 400, missing/wrong API key → 401, unknown model or route → 404, body over the size
limit → 413, KV budget and queue full → 503 with ``Retry-After``, anything unexpected → 500 for
that request only; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__
from . import openai_format as fmt
from .errors import (
    CapacityError,
    ContextOverflowError,
    GrammarError,
    InvalidRequestError,
    MinirtError,
    ModelClosedError,
    TemplateError,
    TokenizerError,
)
from .router import Lease, ModelNotFoundError, SingleModel, parse_keep_alive

if TYPE_CHECKING:  # pragma: no cover
    from .generate import Completion, TokenEvent
    from .http_guard import GuardOptions
    from .runtime import GenerationHandle, Model

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # request bodies larger than this get 413
RETRY_AFTER_S = 1  # Retry-After on 503 when the scheduler is full
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20
_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _require_server_deps() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise MinirtError(f"the HTTP server needs starlette and uvicorn ({e}); "
                          f"install them with: pip install 'minirt[server]'") from e


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------
class HTTPError(Exception):
    """An error answered with an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_for(exc: BaseException) -> HTTPError:
    """The HTTP answer for an exception raised while handling a request."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, ModelNotFoundError):
        return HTTPError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, CapacityError):
        if not exc.retryable:  # can never fit (e.g. a model larger than the memory budget)
            return HTTPError(400, str(exc), type="invalid_request_error", code="capacity_exceeded")
        return HTTPError(503, str(exc), type="server_error", code="server_busy",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, ModelClosedError):
        return HTTPError(503, str(exc), type="server_error", code="model_closed")
    if isinstance(exc, ContextOverflowError):
        return HTTPError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, GrammarError):
        return HTTPError(400, str(exc), param="response_format", code="invalid_grammar")
    if isinstance(exc, (InvalidRequestError, TemplateError, TokenizerError)):
        return HTTPError(400, str(exc), code="invalid_value")
    return HTTPError(500, f"internal server error ({type(exc).__name__}); the request was not completed",
                     type="server_error", code="internal_error")


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _error_response(err: HTTPError) -> Any:
    from starlette.responses import Response

    return Response(_json_bytes(err.body()), status_code=err.status, media_type="application/json",
                    headers=err.headers)


def _finite(x: float) -> float:
    # JSON has no -Infinity: a token with probability 0 gets a very negative finite logprob
    return x if math.isfinite(x) else -9999.0


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return _finite(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------
# request parsing
# ----------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in [{lo if lo is not None else '-∞'}, {hi if hi is not None else '∞'}]"
        raise HTTPError(400, f"'{name}' must be an integer{rng}, got {v!r}", param=name, code="invalid_value")
    return v


def _opt_num(body: dict[str, Any], name: str, lo: float | None = None, hi: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise HTTPError(400, f"'{name}' must be a number in [{lo}, {hi}], got {v!r}", param=name, code="invalid_value")
    return float(v)


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise HTTPError(400, f"'{name}' must be a boolean, got {v!r}", param=name, code="invalid_type")
    return v


@dataclass
class ParsedRequest:
    """A validated chat or completion request, ready for :meth:`Model.submit`."""

    kind: str  # "chat" | "completion"
    model: str
    stream: bool = False
    include_usage: bool = False
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    echo: bool = False
    want_logprobs: bool = False
    max_tokens: int | None = None
    options: dict[str, Any] = field(default_factory=dict)  # stop, ignore_eos and sampling keywords
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    chat_options: dict[str, Any] = field(default_factory=dict)  # tools, tool_choice, reasoning_format ...
    plan: Any = None  # minirt.tools.ToolPlan, set when the prompt is rendered
    keep_alive: float | None = None  # seconds the model stays loaded once idle (multi-model server)
    rid: str = ""  # the response id, set when submitted
    echo_text: str = ""  # the prompt text echoed before the answer (completions with echo)


def _parse_common(body: dict[str, Any], kind: str, model: str) -> ParsedRequest:
    req = ParsedRequest(kind=kind, model=model)
    if body.get("keep_alive") is not None:
        try:
            req.keep_alive = parse_keep_alive(body["keep_alive"])
        except InvalidRequestError as e:
            raise HTTPError(400, str(e), param="keep_alive", code="invalid_value") from None
    stream = _opt_bool(body, "stream")
    req.stream = bool(stream)
    so = body.get("stream_options")
    if so is not None:
        if not req.stream:
            raise HTTPError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(so, dict):
            raise HTTPError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
        req.include_usage = bool(_opt_bool(so, "include_usage"))
    n = _opt_int(body, "n", 1)
    if n is not None and n != 1:
        raise HTTPError(400, f"only n=1 is supported, got n={n}", param="n", code="unsupported_value")
    best_of = _opt_int(body, "best_of", 1)
    if best_of is not None and best_of != 1:
        raise HTTPError(400, f"only best_of=1 is supported, got {best_of}", param="best_of", code="unsupported_value")
    mt = _opt_int(body, "max_completion_tokens", 1)
    if mt is None:
        mt = _opt_int(body, "max_tokens", 1)
    req.max_tokens = mt
    o = req.options
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                         ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0), ("typical_p", 0.0, 1.0),
                         ("repeat_penalty", 0.0, 100.0)):
        v = _opt_num(body, name, lo, hi)
        if v is not None:
            o[name] = v
    top_k = _opt_int(body, "top_k", 0)
    if top_k is not None:
        o["top_k"] = top_k
    # llama.cpp server's sampler fields (checked again by SamplingParams)
    for name in ("dry_multiplier", "dry_base", "xtc_probability", "xtc_threshold", "top_n_sigma",
                 "mirostat_tau", "mirostat_eta"):
        v = _opt_num(body, name)
        if v is not None:
            o[name] = v
    for name, lo, hi in (("dry_allowed_length", 0, None), ("dry_penalty_last_n", -1, None), ("mirostat", 0, 2),
                         ("n_probs", 0, MAX_TOP_LOGPROBS)):
        v = _opt_int(body, name, lo, hi)
        if v is not None:
            o[name] = v
    br = body.get("dry_sequence_breakers")
    if br is not None:
        if not isinstance(br, list) or not all(isinstance(b, str) for b in br):
            raise HTTPError(400, "'dry_sequence_breakers' must be a list of strings", param="dry_sequence_breakers",
                            code="invalid_type")
        o["dry_sequence_breakers"] = tuple(br)
    seed = _opt_int(body, "seed", -(2**63), 2**64 - 1)
    if seed is not None:
        o["seed"] = seed
    ignore_eos = _opt_bool(body, "ignore_eos")
    if ignore_eos:
        o["ignore_eos"] = True
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise HTTPError(400, "'stop' must be a string or a list of at most 16 strings", param="stop",
                            code="invalid_value")
        o["stop"] = [s for s in stop if s]
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise HTTPError(400, "'logit_bias' must be an object mapping token ids to numbers", param="logit_bias",
                            code="invalid_type")
        clean: dict[int, float] = {}
        for k, v in bias.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise HTTPError(400, f"logit_bias key {k!r} is not a token id", param="logit_bias",
                                code="invalid_value") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise HTTPError(400, f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}",
                                param="logit_bias", code="invalid_value")
            clean[tid] = float(v)
        if clean:
            o["logit_bias"] = clean
    if body.get("functions") or body.get("function_call"):
        raise HTTPError(400, "the deprecated 'functions' / 'function_call' are not supported; use 'tools'",
                        param="functions", code="unsupported_value")
    if kind != "chat" and body.get("tools"):
        raise HTTPError(400, "'tools' are only for chat completions", param="tools", code="unsupported_value")
    _parse_constraint(body, o)
    return req


def _parse_constraint(body: dict[str, Any], o: dict[str, Any]) -> None:
    """OpenAI's ``response_format`` and llama.cpp's ``grammar`` / ``json_schema`` fields (compiled,
    and refused with 400 ``invalid_grammar`` when bad, by :func:`minirt.grammar.compile_constraint`)."""
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise HTTPError(400, "'response_format' must be an object with a 'type'", param="response_format",
                            code="invalid_type")
        if rf["type"] != "text":
            o["response_format"] = rf
    for name in ("grammar", "json_schema"):
        v = body.get(name)
        if v is not None:
            if name == "grammar" and not isinstance(v, str):
                raise HTTPError(400, "'grammar' must be a GBNF grammar string", param="grammar", code="invalid_type")
            o[name] = v


def _message_content(i: int, content: Any) -> str | list[dict[str, str]] | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise HTTPError(400, f"messages[{i}].content: only text parts are supported, got {kind!r}",
                                param=f"messages[{i}].content", code="unsupported_value")
        return parts  # the chat template joins them or reads the parts (minirt.chat.ChatTemplate.prepare)
    raise HTTPError(400, f"messages[{i}].content must be a string or a list of text parts",
                    param=f"messages[{i}].content", code="invalid_type")


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (OpenAI shape), validated."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise HTTPError(400, f"{where} must be a list", param=where, code="invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), (str, dict)):
            raise HTTPError(400, f"{where}[{j}] must be {{'type': 'function', 'function': {{'name': str, "
                                 "'arguments': str}}}}", param=where, code="invalid_value")
        call = {"type": "function", "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _parse_tools(body: dict[str, Any], req: ParsedRequest) -> None:
    """OpenAI ``tools``, ``tool_choice``, ``parallel_tool_calls`` (validated by minirt.tools)."""
    from .tools import validate_tool_choice, validate_tools

    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:
            req.chat_options[name] = body[name]
    try:
        validate_tool_choice(body.get("tool_choice"), validate_tools(body.get("tools")))
    except InvalidRequestError as e:
        param = "tool_choice" if "tool_choice" in str(e) else "tools"
        raise HTTPError(400, str(e), param=param, code="invalid_value") from None
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise HTTPError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls",
                        code="invalid_type")


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's ``chat_template_kwargs`` (and OpenAI's ``reasoning_effort``) for the template."""
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise HTTPError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs",
                        code="invalid_type")
    kw = dict(kw or {})
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("minimal", "low", "medium", "high"):
            raise HTTPError(400, f"'reasoning_effort' must be minimal, low, medium or high, got {effort!r}",
                            param="reasoning_effort", code="invalid_value")
        kw.setdefault("reasoning_effort", effort)
    return kw


def parse_chat(body: dict[str, Any], model: str) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body (raises :class:`HTTPError` naming the bad field)."""
    req = _parse_common(body, "chat", model)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise HTTPError(400, "'messages' must be a non-empty list of messages", param="messages",
                        code="invalid_value" if isinstance(msgs, list) else "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise HTTPError(400, f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise HTTPError(400, f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}",
                            param=f"messages[{i}].role", code="invalid_value")
        msg = {"role": "system" if role == "developer" else role, "content": _message_content(i, m.get("content"))}
        if msg["content"] is None and not m.get("tool_calls"):
            msg["content"] = ""
        for key in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(i, m["tool_calls"])
        out.append(msg)
    req.messages = out
    req.template_kwargs = _template_kwargs(body)
    _parse_tools(body, req)
    for name in ("reasoning_format", "thinking_budget"):  # llama.cpp's names; checked by the runtime
        if body.get(name) is not None:
            req.chat_options[name] = body[name]
    lp = _opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not lp:
        raise HTTPError(400, "'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    req.want_logprobs = bool(lp)
    if req.want_logprobs:
        req.options["top_logprobs"] = top or 0
    return req


def parse_completion(body: dict[str, Any], model: str) -> ParsedRequest:
    """Validate a ``/v1/completions`` body (raises :class:`HTTPError` naming the bad field)."""
    req = _parse_common(body, "completion", model)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise HTTPError(400, "'prompt' is empty", param="prompt", code="invalid_value")
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        pass
    elif p is None:
        raise HTTPError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    else:
        raise HTTPError(400, "'prompt' must be a string, a list of token ids, or a list holding one of those "
                             "(several prompts per request are not supported)", param="prompt", code="invalid_value")
    req.prompt = p
    lp = _opt_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    if lp is not None:
        req.want_logprobs = True
        req.options["top_logprobs"] = lp
    req.echo = bool(_opt_bool(body, "echo"))
    if req.echo and req.want_logprobs:
        raise HTTPError(400, "'echo' together with 'logprobs' is not supported", param="echo",
                        code="unsupported_value")
    if body.get("suffix"):
        raise HTTPError(400, "'suffix' is not supported", param="suffix", code="unsupported_value")
    if req.max_tokens is None:
        req.max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    return req


# ----------------------------------------------------------------------------------------------
# response formatting (on top of minirt.openai_format)
# ----------------------------------------------------------------------------------------------
def _chunk_builder(llm: Model, req: ParsedRequest, cid: str, created: int) -> fmt.ChunkBuilder:
    """The request's stream chunks: :class:`minirt.openai_format.ChunkBuilder` with the server's
    model id, fingerprint and stream options."""
    return fmt.ChunkBuilder(llm, "chat" if req.kind == "chat" else "completion", cid, created, req.model,
                            want_logprobs=req.want_logprobs, top_logprobs=bool(req.options.get("top_logprobs")),
                            include_usage=req.include_usage, extra={"system_fingerprint": f"minirt-{__version__}"},
                            plan=req.plan)


def _sse(obj: Any) -> bytes:
    return b"data: " + _json_bytes(obj) + b"\n\n"


# ----------------------------------------------------------------------------------------------
# the app
# ----------------------------------------------------------------------------------------------
@dataclass
class ServerState:
    """What the app knows about its requests (read by tests, /health and the load benchmark)."""

    llm: Model | None  # the model of a single-model server (None with a router)
    model_id: str
    aliases: frozenset[str]
    api_key: str | None = None
    models: Any = None  # minirt.router.SingleModel or ModelRouter: leases on the served models
    metrics: Any = None  # minirt.metrics.ServerMetrics, None without prometheus-client
    strict_model: bool = False  # refuse 'model' names that are not the served model's
    slot_save_path: str | None = None  # where /slots save and restore KV files
    max_body_bytes: int = MAX_BODY_BYTES
    default_max_tokens: int | None = None
    active: dict[str, GenerationHandle] = field(default_factory=dict)
    requests: int = 0
    disconnects: int = 0
    errors: int = 0
    refused: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def track(self, rid: str, h: GenerationHandle) -> None:
        with self.lock:
            self.active[rid] = h

        def done(_h: Any) -> None:
            with self.lock:
                self.active.pop(rid, None)

        h.add_done_callback(done)

    def observe(self, req: ParsedRequest, h: GenerationHandle) -> None:
        """Count a finished generation in the metrics (called on the scheduler thread)."""
        try:
            c = h.result(0)
            outcome = "cancelled" if c.finish_reason == "cancelled" else "ok"
        except BaseException:
            c, outcome = None, "error"
        try:
            self.metrics.observe(req.model if self.models.multi else self.model_id, req.kind, c, outcome)
        except Exception:  # metrics never fail a request
            log.exception("recording metrics failed")


def model_id_for(llm: Model) -> str:
    """The id clients use for the loaded model: its registry name, else its file name."""
    from . import registry

    return llm.name if llm.name in registry.MODELS else Path(llm.path).name


def _aliases(llm: Model, model_id: str) -> frozenset[str]:
    from . import registry

    p = Path(llm.path)
    names = {model_id, llm.name, p.name, p.stem, str(p)}
    for name in registry.MODELS:
        try:
            if registry.cached_path(name).resolve() == p.resolve():
                names.add(name)
        except (OSError, MinirtError):
            pass
    return frozenset(names)


def build_app(llm: Model | None, api_key: str | None = None, *, max_body_bytes: int = MAX_BODY_BYTES,
              default_max_tokens: int | None = None, model_id: str | None = None, router: Any = None,
              strict_model: bool = False, slot_save_path: str | None = None, metrics: bool = True,
              guard: GuardOptions | None = None) -> Any:
    """The ASGI app serving ``llm`` (or the models of ``router``, a :class:`minirt.router.ModelRouter`).

    ``api_key``: when set, every ``/v1`` route requires ``Authorization: Bearer <api_key>``
    (``/health`` stays open). ``default_max_tokens``: chat requests without ``max_tokens`` generate
    at most this many tokens (None: until end-of-generation or the context / KV budget is full).
    ``model_id`` (``--alias``): the name ``/v1/models`` lists. A single-model server accepts any
    ``model`` name, as llama-server does, unless ``strict_model``. ``slot_save_path``: the directory
    for ``/slots/{id}?action=save|restore``. ``metrics``: serve ``/metrics`` (needs
    prometheus-client). ``guard``: concurrency limit, JSON content type, Host / Origin policy
    (:class:`minirt.http_guard.GuardOptions`, default limits when None). ``app.state.minirt`` is
    the :class:`ServerState`.
    """
    _require_server_deps()
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from . import metrics as metrics_mod
    from . import server_llama
    from .http_guard import GuardOptions, middleware

    if (llm is None) == (router is None):
        raise InvalidRequestError("build_app takes a model or a router")
    if router is not None:
        mid = model_id or router.default
        aliases = frozenset(router.entries)
    else:
        mid = model_id or model_id_for(llm)
        aliases = _aliases(llm, mid) | {mid}
        router = SingleModel(llm, mid)
    state = ServerState(llm=llm, model_id=mid, aliases=aliases, api_key=api_key or None,
                        max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens, models=router,
                        strict_model=strict_model, slot_save_path=slot_save_path)
    if metrics and metrics_mod.available():
        state.metrics = metrics_mod.ServerMetrics(router.loaded)
    elif metrics:
        log.info("prometheus-client is not installed: /metrics is off")
    from . import embedding_server

    def endpoint(fn: Callable[[Request], Awaitable[Any]], auth: bool = True) -> Callable[[Request], Awaitable[Any]]:
        async def wrapped(request: Request) -> Any:
            try:
                if auth and state.api_key is not None:
                    _check_auth(request, state.api_key)
                return await fn(request)
            except Exception as e:  # one request's failure never takes the server down
                err = error_for(e)
                if err.status >= 500 and err.status not in (501, 503):
                    state.errors += 1
                    log.exception("request to %s failed", request.url.path)
                elif err.status == 503:
                    state.refused += 1
                if state.metrics is not None:
                    state.metrics.refused(request.url.path, err.status)
                return _error_response(err)
        return wrapped

    async def health(request: Request) -> Any:
        counts = {"requests": state.requests, "active": len(state.active), "disconnects": state.disconnects,
                  "refused": state.refused, "errors": state.errors}
        if llm is None:  # several models: each loaded one's scheduler
            sched = {name: m.scheduler.stats() for name, m in router.loaded()}
            return JSONResponse({"status": "ok", "model": mid, "models": sched, **counts})
        if llm.closed:
            return JSONResponse({"status": "error", "error": "the model is closed"}, status_code=503)
        return JSONResponse({"status": "ok", "model": mid, "scheduler": llm.scheduler.stats(), **counts})

    def model_card() -> dict[str, Any]:
        try:
            created = int(os.path.getmtime(llm.path))
        except OSError:
            created = 0
        return {"id": mid, "object": "model", "created": created, "owned_by": "minirt",
                "meta": {"arch": llm.arch, "n_ctx": llm.n_ctx, "n_vocab": llm.n_vocab, "device": llm.device}}

    async def models(request: Request) -> Any:
        if llm is None:
            return JSONResponse({"object": "list", "data": router.cards()})
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model_get(request: Request) -> Any:
        name = request.path_params["model"]
        if llm is None:
            for card in router.cards():
                if card["id"] == name:
                    return JSONResponse(card)
            raise ModelNotFoundError(f"the model {name!r} is not served here")
        if name not in state.aliases:
            raise _unknown_model(name, mid)
        return JSONResponse(model_card())

    async def chat_completions(request: Request) -> Any:
        raw = await _read_body(request, state.max_body_bytes)
        return await _generate(request, state, await _off_loop(len(raw), _parse_request, raw, state, parse_chat))

    async def completions(request: Request) -> Any:
        raw = await _read_body(request, state.max_body_bytes)
        return await _generate(request, state,
                               await _off_loop(len(raw), _parse_request, raw, state, parse_completion))

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else str(exc.detail))
        return _error_response(HTTPError(exc.status_code, msg, code=code))

    routes = [
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint(model_get), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/embeddings", endpoint(embedding_server.embeddings_endpoint(state)), methods=["POST"]),
        Route("/v1/rerank", endpoint(embedding_server.rerank_endpoint(state)), methods=["POST"]),
        # the same routes without the /v1 prefix, as llama-server and llama-cpp-python serve them
        Route("/models", endpoint(models), methods=["GET"]),
        Route("/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/completions", endpoint(completions), methods=["POST"]),
        *server_llama.routes(state, endpoint),  # /completion /tokenize /detokenize /props /slots /metrics
        Route("/embeddings", endpoint(embedding_server.embeddings_endpoint(state)), methods=["POST"]),
        Route("/rerank", endpoint(embedding_server.rerank_endpoint(state)), methods=["POST"]),
    ]

    def refused() -> None:
        state.refused += 1

    app = Starlette(routes=routes, exception_handlers={StarletteHTTPException: http_error},
                    middleware=middleware(guard or GuardOptions(), on_refused=refused))
    app.state.minirt = state
    return app


def _check_auth(request: Any, api_key: str) -> None:
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise HTTPError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _unknown_model(name: str, mid: str) -> HTTPError:
    return HTTPError(404, f"the model {name!r} does not exist on this server; it serves {mid!r}",
                     param="model", code="model_not_found")


def _check_model(body: dict[str, Any], state: ServerState) -> str:
    """The request's model name. A single-model server takes any name (as llama-server does) and
    answers with it, unless ``strict_model``; a router only its models' names."""
    name = body.get("model")
    if name is None or name == "":
        return state.model_id
    if not isinstance(name, str):
        raise HTTPError(400, f"'model' must be a string, got {name!r}", param="model", code="invalid_type")
    if state.models is not None and state.models.multi:
        state.models.entry(name)  # ModelNotFoundError → 404
        return name
    if name not in state.aliases and state.strict_model:
        raise _unknown_model(name, state.model_id)
    return name


OFF_LOOP_BYTES = 16 << 10  # bodies at least this big are decoded and validated on a worker thread
_parse_pool: Any = None
_parse_pool_lock = threading.Lock()


async def _off_loop(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` inline for small bodies, else on the parse pool: decoding and validating a
    4 MiB body (a 100k-entry ``logit_bias``, thousands of messages) must not stall the other
    connections. Two threads: big bodies wait for each other instead of multiplying memory."""
    global _parse_pool
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    with _parse_pool_lock:
        if _parse_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _parse_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="minirt-parse")
    return await asyncio.get_running_loop().run_in_executor(_parse_pool, fn, *args)


def _decode_json(raw: bytes, array: bool = False) -> Any:
    """A JSON object (``array``: or an array, as ``POST /lora-adapters`` takes)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if array and isinstance(body, list):
        return body
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _parse_request(raw: bytes, state: ServerState, parse: Callable[[dict[str, Any], str], ParsedRequest]) \
        -> ParsedRequest:
    body = _decode_json(raw)
    return parse(body, _check_model(body, state))


async def _read_json(request: Any, limit: int, array: bool = False) -> Any:
    """The request body as a JSON object (``array``: or array), refusing bodies over ``limit`` bytes
    before reading them (decoded off the event loop when big)."""
    raw = await _read_body(request, limit)
    return await _off_loop(len(raw), _decode_json, raw, array)


async def _read_body(request: Any, limit: int) -> bytes:
    """The raw request body, refusing bodies over ``limit`` bytes before reading them."""
    from starlette.requests import ClientDisconnect

    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise HTTPError(400, "invalid Content-Length header") from None
        if n > limit:
            raise HTTPError(413, f"request body of {n} bytes exceeds the {limit}-byte limit",
                            code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # chunked bodies have no Content-Length: count as they arrive
                raise HTTPError(413, f"request body exceeds the {limit}-byte limit", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or closed by the body deadline (minirt.http_guard): nobody reads this
        raise HTTPError(408, "the client disconnected before sending the whole body",
                        code="request_timeout") from None
    return b"".join(chunks)


def _prepare_and_submit(llm: Model, state: ServerState, req: ParsedRequest,
                        on_token: Callable[[TokenEvent], Any] | None) -> tuple[GenerationHandle, str]:
    """Tokenize, pick max_tokens, submit (runs on a worker thread: tokenizing a long prompt must
    not stall the event loop). Returns the handle and the echo prefix."""
    echo = ""
    if req.kind == "chat":
        opts = dict(req.chat_options, chat_template_kwargs=req.template_kwargs, **req.options)
        ids, req.plan = llm._chat_request(req.messages or [], opts.pop("tools", None), None, opts)
        req.options = opts
    elif isinstance(req.prompt, str):
        ids = llm.tokenize(req.prompt)
        echo = req.prompt if req.echo else ""
    else:
        ids = list(req.prompt or [])
        if req.echo:
            echo = llm.detokenize(ids)
    if len(ids) >= llm.n_ctx:
        raise HTTPError(400, f"the prompt has {len(ids)} tokens but the context holds {llm.n_ctx} (one position "
                             f"must stay free to generate); shorten it", code="context_length_exceeded",
                        param="messages" if req.kind == "chat" else "prompt")
    max_tokens = req.max_tokens
    if max_tokens is None:
        # until end-of-generation, the end of the context, or what the KV budget can ever hold
        room = min(llm.n_ctx, llm.scheduler.kv_budget_tokens) - len(ids)
        max_tokens = max(1, room)
        if state.default_max_tokens:
            max_tokens = min(max_tokens, state.default_max_tokens)
    need, budget = min(len(ids) + max_tokens, llm.n_ctx), llm.scheduler.kv_budget_tokens
    if len(ids) < llm.n_ctx and need > budget:  # could never run: retrying would not help, so not a 503
        raise HTTPError(400, f"the request needs {need} KV-cache positions ({len(ids)} prompt + {max_tokens} "
                             f"max_tokens) but the server's whole KV budget is {budget}; lower max_tokens",
                        param="max_tokens", code="kv_budget_exceeded")
    try:
        # a streaming request's on_token posts to the event loop: deliver it from the scheduler thread
        h = llm.submit(ids, on_token=on_token, max_tokens=max_tokens, _inline=on_token is not None,
                       _parser=req.plan, **req.options)
    except ContextOverflowError as e:
        raise HTTPError(400, str(e), param="messages" if req.kind == "chat" else "prompt",
                        code="context_length_exceeded") from e
    return h, echo


async def _start(loop: asyncio.AbstractEventLoop, llm: Model, state: ServerState, req: ParsedRequest,
                 on_token: Callable[[TokenEvent], Any] | None) -> tuple[GenerationHandle, str]:
    """Run :func:`_prepare_and_submit` off the loop; if this task is cancelled meanwhile, the
    generation it started is cancelled too rather than left running for nobody."""
    fut = loop.run_in_executor(None, _prepare_and_submit, llm, state, req, on_token)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        def cleanup(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is None:
                f.result()[0].cancel()
        fut.add_done_callback(cleanup)
        raise


async def acquire_model(state: ServerState, req: ParsedRequest | str | None) -> Lease:
    """A lease on the model a request names (loading it first in a multi-model server; the
    loading runs on a worker thread). Release it when the request ends."""
    name, keep = (req, None) if not isinstance(req, ParsedRequest) else (req.model, req.keep_alive)
    if not state.models.multi:
        return state.models.acquire(name)
    return await asyncio.get_running_loop().run_in_executor(None, state.models.acquire, name, keep)


async def run_generation(request: Any, state: ServerState, req: ParsedRequest, lease: Lease,
                         q: asyncio.Queue[Any] | None) -> Any:
    """Submit ``req`` to the leased model. With ``q`` (streaming): returns the handle at once;
    events and then ``_END`` go to ``q``. Without: waits and returns the :class:`Completion`, or
    None when the client disconnected first (the generation is cancelled). The lease is released
    when the generation ends, and the request is counted in the metrics."""
    llm = lease.llm
    loop = asyncio.get_running_loop()
    rid = req.rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
    state.requests += 1
    try:
        if q is not None:
            def post(item: Any) -> None:
                try:
                    loop.call_soon_threadsafe(q.put_nowait, item)
                except RuntimeError:  # the loop is gone: nobody listens any more
                    pass

            h, echo = await _start(loop, llm, state, req, post)
        else:
            h, echo = await _start(loop, llm, state, req, None)
    except BaseException:
        lease.release()
        raise
    req.echo_text = echo
    state.track(rid, h)
    h.add_done_callback(lambda _h: lease.release())
    if state.metrics is not None:
        h.add_done_callback(lambda _h: state.observe(req, _h))
    if q is not None:
        h.add_done_callback(lambda _h: post(_END))
        return h
    done = loop.create_future()

    def finished(_h: Any) -> None:
        def set_done() -> None:
            if not done.done():
                done.set_result(None)
        try:
            loop.call_soon_threadsafe(set_done)
        except RuntimeError:
            pass

    h.add_done_callback(finished)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({done, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not h.done():
            h.cancel()  # the client went away (or this task was cancelled): stop at the next step
        watcher.cancel()
    if not done.done():
        state.disconnects += 1
        log.info("client disconnected; request %s cancelled", rid)
        return None
    return h.result(0)  # re-raises the request's own error (→ 400 / 500 for this request only)


async def _generate(request: Any, state: ServerState, req: ParsedRequest) -> Any:
    from starlette.responses import Response

    lease = await acquire_model(state, req)
    llm = lease.llm
    created = int(time.time())
    if req.stream:
        q: asyncio.Queue[Any] = asyncio.Queue()
        h = await run_generation(request, state, req, lease, q)
        return _SSEResponse(state, h, q, _chunk_builder(llm, req, req.rid, created), req.echo_text)
    c: Completion | None = await run_generation(request, state, req, lease, None)
    if c is None:
        return Response(status_code=499)  # nobody reads it
    if req.kind == "chat":
        d = fmt.chat_dict(llm, c, req.rid, created, req.want_logprobs)
    else:
        d = fmt.completion_dict(llm, c, req.rid, created, req.want_logprobs, req.echo_text)
    d["model"] = req.model
    d["system_fingerprint"] = f"minirt-{__version__}"
    d["usage"] = fmt.usage_dict(c)
    if req.want_logprobs:
        d = _clean(d)
    return Response(_json_bytes(d), media_type="application/json")


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


_END = object()


class _SSEResponse:
    """An ASGI response streaming one generation as server-sent events.

    A task listens for ``http.disconnect`` while chunks go out; a disconnect (or a failed send)
    cancels the generation, which the scheduler then drops at its next step.
    """

    def __init__(self, state: ServerState, handle: GenerationHandle, q: asyncio.Queue[Any],
                 maker: fmt.ChunkBuilder, echo: str) -> None:
        self.state, self.h, self.q, self.maker, self.echo = state, handle, q, maker, echo

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[Any]]) -> None:
        h, state = self.h, self.state
        gone = asyncio.Event()

        async def listen() -> None:
            await _wait_disconnect(receive)
            gone.set()
            h.cancel()
            await self.q.put(_END)  # wake the sender

        listener = asyncio.ensure_future(listen())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"), (b"x-request-id", self.maker.cid.encode())]})
            for ch in self.maker.first(self.echo):
                await send({"type": "http.response.body", "body": _sse(ch), "more_body": True})
            while True:
                item = await self.q.get()
                if item is _END:
                    if gone.is_set() or not h.done():
                        break
                    # the generation ended: usage, or the request's own error, then [DONE]
                    tail = b""
                    try:
                        c = h.result(0)
                        if self.maker.include_usage:
                            tail = _sse(self.maker.usage(c))
                        tail += b"data: [DONE]\n\n"
                    except Exception as e:
                        err = error_for(e)
                        if err.status >= 500:
                            state.errors += 1
                            log.error("streamed request %s failed: %r", self.maker.cid, e)
                        tail = _sse(err.body())
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
                    break
                try:
                    chunks = self.maker.event(item)
                    if self.maker.want_logprobs:  # -inf / NaN logprobs -> JSON-safe values
                        chunks = [_clean(ch) for ch in chunks]
                    data = b"".join(_sse(ch) for ch in chunks)
                except Exception as e:  # a formatting bug ends this stream only
                    state.errors += 1
                    log.exception("formatting a streamed chunk failed")
                    h.cancel()
                    await send({"type": "http.response.body", "body": _sse(error_for(e).body()),
                                "more_body": True})
                    break
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the send failed: the client is gone
            gone.set()
        finally:
            listener.cancel()
            if not h.done():
                h.cancel()
            if gone.is_set():
                state.disconnects += 1
                log.info("client disconnected; streamed request %s cancelled", self.maker.cid)


# ----------------------------------------------------------------------------------------------
# running it
# ----------------------------------------------------------------------------------------------
class BackgroundServer:
    """Serve an ASGI app with uvicorn on a background thread (tests, notebooks, embedding).

    ``with BackgroundServer(build_app(llm)) as srv: httpx.get(srv.url + "/health")``. Port 0 picks
    a free port.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None, log_level: str = "warning", guard: GuardOptions | None = None) -> None:
        _require_server_deps()
        import uvicorn

        from .http_guard import GuardOptions

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.scheme = "https" if ssl_certfile else "http"
        config = uvicorn.Config(app, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, log_level=log_level,
                                access_log=False, timeout_graceful_shutdown=2, lifespan="off",
                                **_guard_config(guard or GuardOptions()))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="minirt-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT / SIGTERM end it cleanly instead of being re-raised
        after shutdown (which would skip closing the model and exit with a signal status)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def _guard_config(guard: GuardOptions) -> dict[str, Any]:
    """uvicorn.Config keywords enforcing ``guard``'s connection limits (see minirt.http_guard)."""
    from .http_guard import guarded_protocol

    # no WebSocket routes: an upgrade would hand the connection to a protocol without these limits
    return {"http": guarded_protocol(guard), "ws": "none", "timeout_keep_alive": guard.keep_alive_timeout}


def guard_from_args(args: Any) -> GuardOptions:
    """The :class:`~minirt.http_guard.GuardOptions` of ``minirt serve``'s options (defaults where absent)."""
    from . import http_guard as g

    def opt(name: str, default: Any) -> Any:
        v = getattr(args, name, None)
        return default if v is None else v

    def names(name: str) -> tuple[str, ...]:
        out: list[str] = []
        for item in getattr(args, name, None) or ():
            out += [x.strip() for x in str(item).split(",") if x.strip()]
        return tuple(out)

    return g.GuardOptions(limit_concurrency=opt("limit_concurrency", g.LIMIT_CONCURRENCY),
                          max_connections=opt("max_connections", g.MAX_CONNECTIONS),
                          header_timeout=opt("header_timeout", g.HEADER_TIMEOUT_S),
                          body_timeout=opt("body_timeout", g.BODY_TIMEOUT_S),
                          keep_alive_timeout=opt("keep_alive_timeout", g.KEEP_ALIVE_TIMEOUT_S),
                          allow_origins=names("allow_origin"), allow_hosts=names("allow_host"))


def serve(args: Any, load: Callable[[], Any] | None = None) -> int:
    """``minirt serve``: load the model (``load()``, default :func:`minirt.loading.load_from_args`
    of ``args``), configure the scheduler, serve until interrupted."""
    _require_server_deps()
    import uvicorn

    from .loading import load_from_args

    if args.ssl_keyfile and not args.ssl_certfile:
        raise InvalidRequestError("--ssl-keyfile needs --ssl-certfile")
    for f in (args.ssl_certfile, args.ssl_keyfile):
        if f and not os.path.isfile(f):
            raise InvalidRequestError(f"no such file: {f}")
    api_key = args.api_key or os.environ.get("MINIRT_API_KEY") or None
    if args.host not in _LOOPBACK and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model",
                    args.host)
    limits = guard_from_args(args)
    slot_dir = getattr(args, "slot_save_path", None)
    if slot_dir and not os.path.isdir(slot_dir):
        raise InvalidRequestError(f"--slot-save-path {slot_dir}: not a directory")
    opts = dict(api_key=api_key, model_id=getattr(args, "alias", None) or None, slot_save_path=slot_dir,
                guard=limits)
    router = router_from_args(args)
    if router is not None:
        holder: Any = contextlib.closing(router)
        app = build_app(None, router=router, **opts)
        what = f"{len(router.entries)} models ({', '.join(router.entries)})"
    else:
        llm = load() if load is not None else load_from_args(args)
        holder = llm
        with contextlib.ExitStack() as guard:
            guard.callback(llm.close)  # closed on a configuration error below
            llm.configure_scheduler(n_parallel=args.parallel, kv_budget_tokens=args.kv_budget_tokens,
                                    max_queue=args.queue)
            app = build_app(llm, strict_model=bool(getattr(args, "strict_model", False)), **opts)
            guard.pop_all()
        what = f"{app.state.minirt.model_id} ({llm.arch}, n_ctx {llm.n_ctx})"
    with holder:
        verbose = logging.getLogger("minirt").getEffectiveLevel() <= logging.INFO
        config = uvicorn.Config(app, host=args.host, port=args.port, ssl_certfile=args.ssl_certfile,
                                ssl_keyfile=args.ssl_keyfile, log_level="info", access_log=verbose,
                                timeout_graceful_shutdown=5, lifespan="off", **_guard_config(limits))
        server = _server_class()(config)
        log.info("serving %s at %s://%s:%d/v1", what, "https" if args.ssl_certfile else "http", args.host, args.port)
        server.run()
        if not server.started:
            return 1  # e.g. the port was taken; uvicorn logged why
    return 0


ROUTER_CTX = 4096  # a model's context in a multi-model server unless -c sets it
ROUTER_KV_CONTEXTS = 4  # its KV budget: this many full contexts unless --kv-budget-tokens sets it


def router_from_args(args: Any) -> Any:
    """The :class:`minirt.router.ModelRouter` that ``--models-dir`` / several (or ``NAME=PATH``)
    ``--model`` options describe, or None for a single-model server."""
    from .loading import load_options
    from .router import ModelRouter, parse_keep_alive, parse_model_specs, scan_models_dir

    specs = args.model if isinstance(getattr(args, "model", None), list) else \
        ([args.model] if getattr(args, "model", None) else [])
    models_dir = getattr(args, "models_dir", None)
    if not models_dir and len(specs) <= 1 and not any("=" in s for s in specs):
        if isinstance(getattr(args, "model", None), list):
            args.model = specs[0] if specs else None  # one model: the plain server
        return None
    if getattr(args, "lora", None) or getattr(args, "lora_scaled", None):
        raise InvalidRequestError("--lora / --lora-scaled apply to one model: not with several models")
    models = scan_models_dir(models_dir) if models_dir else {}
    for name, path in parse_model_specs(specs).items():
        if name in models:
            raise InvalidRequestError(f"--model {name}: the name is also in --models-dir")
        models[name] = path
    keep = getattr(args, "keep_alive", None)
    keep_s = parse_keep_alive(keep) if keep is not None else None
    if keep_s is not None and keep_s < 0:
        keep_s = None

    def load(path: str) -> Any:
        import minirt

        kw = load_options(args)
        kw.setdefault("n_ctx", ROUTER_CTX)
        llm = minirt.load(path, pull=False, **kw)
        try:
            llm.configure_scheduler(n_parallel=args.parallel, max_queue=args.queue,
                                    kv_budget_tokens=args.kv_budget_tokens or llm.n_ctx * ROUTER_KV_CONTEXTS)
        except BaseException:
            llm.close()
            raise
        return llm

    return ModelRouter(models, load, memory_budget=getattr(args, "models_memory", None), keep_alive=keep_s,
                       max_loaded=getattr(args, "models_max", None))


__all__ = ["build_app", "serve", "router_from_args", "acquire_model", "run_generation",
           "BackgroundServer", "ServerState", "HTTPError", "error_for", "parse_chat",
           "parse_completion", "model_id_for", "MAX_BODY_BYTES"]
