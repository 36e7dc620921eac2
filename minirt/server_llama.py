"""llama-server's own endpoints, where they map to what minirt does: ``POST /completion``,
``/tokenize``, ``/detokenize``, ``GET /props``, ``GET /slots``, ``POST /slots/{id}?action=save|
restore|erase`` and Prometheus ``GET /metrics``.

Shapes follow llama.cpp's ``tools/server`` (``server_task_result_cmpl_final::to_json_non_oaicompat``,
``server_slot::to_json``, ``get_res_props``, ``server_task_result_slot_save_load::to_json``).

Slots: minirt's scheduler does not pin a request to a numbered slot; ``/slots`` lists
``n_parallel`` slots, the first ones holding the running requests in admission order. A request's
KV cache goes to the prefix cache when it ends, so ``save`` writes the most recently finished
conversation (:meth:`minirt.Model.save_state`) and ``restore`` puts a saved one back into the
prefix cache (:meth:`minirt.Model.load_state`): the next request starting with those tokens skips
recomputing them, whichever slot it lands in. ``erase`` empties the prefix cache. Files live in
``--slot-save-path``; a file name with a path in it is refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from . import __version__
from .errors import InvalidRequestError, StateError

if TYPE_CHECKING:  # pragma: no cover
    from .generate import Completion, TokenEvent
    from .runtime import Model
    from .server import ParsedRequest, ServerState

log = logging.getLogger(__name__)

MAX_FILENAME = 255


def _stop_type(llm: Model, c: Completion) -> str:
    if c.finish_reason == "length":
        return "limit"
    if c.finish_reason == "stop":
        return "eos" if c.token_ids and c.token_ids[-1] in llm.eog_ids else "word"
    return "none"


def _stopping_word(llm: Model, c: Completion, stops: list[str]) -> str:
    if not stops or not c.token_ids or c.token_ids[-1] in llm.eog_ids:
        return ""
    # the answer ends before the stop string: find which one follows it in the generated text
    full = llm.detokenize(c.token_ids)
    at = {s: full.find(s, max(0, len(c.text) - 4)) for s in stops}
    found = [(i, s) for s, i in at.items() if i >= 0]
    return min(found)[1] if found else ""


def _timings(c: Completion) -> dict[str, float | int]:
    t, u = c.timings, c.usage
    n_prompt = u["prompt_tokens"] - u.get("cached_tokens", 0)
    n_gen = u["completion_tokens"]
    prompt_ms = t.get("prompt_s", 0.0) * 1e3
    ttft = t.get("time_to_first_token_s", 0.0)
    gen_ms = max(t.get("total_s", 0.0) - (ttft if ttft == ttft else 0.0), 0.0) * 1e3
    return {"cache_n": u.get("cached_tokens", 0),
            "prompt_n": n_prompt, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
            "prompt_per_second": 1e3 * n_prompt / prompt_ms if n_prompt and prompt_ms > 0 else 0.0,
            "predicted_n": n_gen, "predicted_ms": gen_ms,
            "predicted_per_token_ms": gen_ms / n_gen if n_gen else 0.0,
            "predicted_per_second": 1e3 * n_gen / gen_ms if n_gen and gen_ms > 0 else 0.0}


def _final(llm: Model, req: ParsedRequest, c: Completion, n_predict: int, content: str,
           stream: bool) -> dict[str, Any]:
    stops = list(req.options.get("stop") or [])
    settings = {"n_predict": n_predict, "stream": stream, "stop": stops, **{
        k: v for k, v in req.options.items() if k != "stop" and isinstance(v, (int, float, str, bool))}}
    return {"index": 0, "content": content, "tokens": [] if stream else list(c.token_ids), "id_slot": -1,
            "stop": True, "model": req.model, "tokens_predicted": c.usage["completion_tokens"],
            "tokens_evaluated": c.usage["prompt_tokens"], "generation_settings": settings,
            "prompt": llm.detokenize(c.prompt_ids), "has_new_line": "\n" in c.text, "truncated": False,
            "stop_type": _stop_type(llm, c), "stopping_word": _stopping_word(llm, c, stops),
            "tokens_cached": c.usage["prompt_tokens"] + c.usage["completion_tokens"], "timings": _timings(c)}


def parse_llama_completion(body: dict[str, Any], model: str) -> tuple[ParsedRequest, int]:
    """A ``/completion`` body as a completion request; returns it and ``n_predict`` (-1: no limit).

    ``prompt``: a string, a list of token ids, or a list mixing strings and ids (llama.cpp's
    "mixed" prompt)."""
    from .server import HTTPError, _is_int, _opt_int, parse_completion

    n_predict = _opt_int(body, "n_predict", -1)
    if n_predict is None:
        n_predict = -1
    prompt = body.get("prompt")
    mixed = isinstance(prompt, list) and any(isinstance(p, str) for p in prompt) \
        and all(isinstance(p, str) or _is_int(p) for p in prompt) and len(prompt) > 1
    if isinstance(body.get("max_tokens"), int):
        raise HTTPError(400, "/completion takes 'n_predict'; 'max_tokens' is for /v1/completions",
                        param="max_tokens", code="invalid_value")
    b = {k: v for k, v in body.items() if k not in ("n_predict", "stream_options", "logprobs", "echo", "suffix",
                                                     "prompt")}
    b["prompt"] = "x" if mixed else prompt  # mixed prompts are tokenized by the handler
    if n_predict == 0:
        raise HTTPError(400, "'n_predict' must be -1 (no limit) or at least 1", param="n_predict",
                        code="invalid_value")
    if n_predict > 0:
        b["max_tokens"] = n_predict
    req = parse_completion(b, model)
    req.kind = "llama"
    if mixed:
        req.prompt = list(prompt)  # type: ignore[arg-type]
    if n_predict < 0:
        req.max_tokens = None
    return req, n_predict


def _prompt_ids(llm: Model, prompt: Any) -> list[int]:
    """Token ids of a ``/completion`` prompt: BOS and special tokens parsed, as llama-server does."""
    if isinstance(prompt, str):
        return llm.tokenizer.encode(prompt, add_special=True, parse_special=True)
    ids: list[int] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids += llm.tokenizer.encode(p, add_special=i == 0, parse_special=True)
        else:
            ids.append(int(p))
    bad = [t for t in ids if not 0 <= t < llm.n_vocab]
    if bad:
        raise InvalidRequestError(f"'prompt' holds token id {bad[0]} outside the vocabulary (0..{llm.n_vocab - 1})")
    return ids


async def completion(request: Any, state: ServerState, body: dict[str, Any], name: str) -> Any:
    """``POST /completion``: llama-server's native completion (streamed as SSE without ``[DONE]``)."""
    from starlette.responses import Response

    from .server import _json_bytes, acquire_model, run_generation

    req, n_predict = parse_llama_completion(body, name)
    lease = await acquire_model(state, req)
    llm = lease.llm
    loop = asyncio.get_running_loop()
    try:
        ids = await loop.run_in_executor(None, _prompt_ids, llm, req.prompt)
    except BaseException:
        lease.release()
        raise
    req.prompt = ids
    if req.stream:
        q: asyncio.Queue[Any] = asyncio.Queue()
        h = await run_generation(request, state, req, lease, q)
        return _LlamaSSE(state, llm, req, h, q, n_predict, len(ids))
    c = await run_generation(request, state, req, lease, None)
    if c is None:
        return Response(status_code=499)
    return Response(_json_bytes(_final(llm, req, c, n_predict, c.text, False)), media_type="application/json")


class _LlamaSSE:
    """``/completion`` with ``stream``: one ``data: {...}`` per token, the final object last."""

    def __init__(self, state: ServerState, llm: Model, req: ParsedRequest, h: Any, q: asyncio.Queue[Any],
                 n_predict: int, n_prompt: int) -> None:
        self.state, self.llm, self.req, self.h, self.q = state, llm, req, h, q
        self.n_predict, self.n_prompt = n_predict, n_prompt

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]],
                       send: Callable[..., Awaitable[Any]]) -> None:
        from .server import _END, _sse, _wait_disconnect, error_for

        h = self.h
        gone = asyncio.Event()

        async def listen() -> None:
            await _wait_disconnect(receive)
            gone.set()
            h.cancel()
            await self.q.put(_END)

        listener = asyncio.ensure_future(listen())
        n = 0
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            tail_text = ""
            while True:
                item: TokenEvent | Any = await self.q.get()
                if item is _END:
                    if gone.is_set() or not h.done():
                        break
                    try:
                        c = h.result(0)
                        data = _sse(_final(self.llm, self.req, c, self.n_predict, tail_text, True))
                    except Exception as e:
                        data = _sse(error_for(e).body())
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    break
                if item.token_id is None:  # the final event: held-back text goes in the last object
                    tail_text += item.text
                    continue
                n += 1
                chunk = {"index": 0, "content": item.text, "tokens": [item.token_id], "stop": False,
                         "id_slot": -1, "tokens_predicted": n, "tokens_evaluated": self.n_prompt}
                await send({"type": "http.response.body", "body": _sse(chunk), "more_body": True})
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            gone.set()
        finally:
            listener.cancel()
            if not h.done():
                h.cancel()
            if gone.is_set():
                self.state.disconnects += 1


# ----------------------------------------------------------------------------------------------
# tokenize / detokenize / props / slots
# ----------------------------------------------------------------------------------------------
def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    from .server import _opt_bool

    v = _opt_bool(body, name)
    return default if v is None else v


def tokenize(llm: Model, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /tokenize``: ``{"content", "add_special" (false), "parse_special" (true), "with_pieces"}``."""
    from .server import HTTPError

    content = body.get("content")
    if content is None:
        return {"tokens": []}
    if not isinstance(content, str):
        raise HTTPError(400, "'content' must be a string", param="content", code="invalid_type")
    ids = llm.tokenizer.encode(content, add_special=_bool(body, "add_special", False),
                               parse_special=_bool(body, "parse_special", True))
    if not _bool(body, "with_pieces", False):
        return {"tokens": ids}
    out = []
    for t in ids:
        piece = llm.tokenizer.token_to_piece(t)
        try:
            p: str | list[int] = piece.decode("utf-8")
        except UnicodeDecodeError:  # part of a UTF-8 sequence: the bytes, as llama-server gives them
            p = list(piece)
        out.append({"id": t, "piece": p})
    return {"tokens": out}


def detokenize(llm: Model, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /detokenize``: ``{"tokens": [ids]}`` → ``{"content"}``."""
    from .server import HTTPError, _is_int

    toks = body.get("tokens")
    if toks is None:
        return {"content": ""}
    if not isinstance(toks, list) or not all(_is_int(t) for t in toks):
        raise HTTPError(400, "'tokens' must be a list of token ids", param="tokens", code="invalid_type")
    bad = [t for t in toks if not 0 <= t < llm.n_vocab]
    if bad:
        raise HTTPError(400, f"token id {bad[0]} is outside the vocabulary (0..{llm.n_vocab - 1})", param="tokens",
                        code="invalid_value")
    return {"content": llm.detokenize(toks)}


def props(llm: Model, state: ServerState, name: str) -> dict[str, Any]:
    """``GET /props``: what llama-server's ``get_res_props`` reports, where minirt has it."""
    tok = llm.tokenizer
    bos, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
    sched = llm.scheduler
    return {
        "default_generation_settings": {"params": {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                                   "min_p": 0.05, "stream": False},
                                        "n_ctx": llm.n_ctx},
        "total_slots": sched.n_parallel,
        "model_alias": name,
        "model_path": str(llm.path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True, "endpoint_props": True, "endpoint_metrics": state.metrics is not None,
        "chat_template": llm.chat_template.source,
        "bos_token": tok.token_text(bos) if isinstance(bos, int) and bos >= 0 else "",
        "eos_token": tok.token_text(eos) if isinstance(eos, int) and eos >= 0 else "",
        "build_info": f"minirt-{__version__}",
        "is_sleeping": False,
    }


def lora_adapters(llm: Model) -> list[dict[str, Any]]:
    """``GET /lora-adapters``: the loaded adapters as llama-server lists them."""
    return [{"id": i, "path": ad.path, "scale": ad.scale, "task_name": ad.task_name or "",
             "prompt_prefix": ad.prompt_prefix} for i, ad in enumerate(llm.lora_adapters)]


def set_lora_adapters(llm: Model, body: Any) -> dict[str, Any]:
    """``POST /lora-adapters`` with ``[{"id": 0, "scale": 0.5}, ...]``: adapters not named get scale 0."""
    if not isinstance(body, list) or not all(isinstance(e, dict) for e in body):
        raise InvalidRequestError("the body must be an array of {\"id\": ..., \"scale\": ...} objects")
    scales: dict[int, float] = {}
    for e in body:
        i = e.get("id", -1)
        if isinstance(i, bool) or not isinstance(i, int):
            raise InvalidRequestError(f"a LoRA adapter id must be an integer, got {i!r}")
        scales[i] = e.get("scale", 0.0)
    llm.set_lora_scales(scales)
    return {"success": True}


def slots(llm: Model) -> list[dict[str, Any]]:
    """``GET /slots``: ``n_parallel`` slots; the running requests fill the first ones."""
    sched = llm.scheduler
    running = sched.running_info()
    out = []
    for i in range(sched.n_parallel):
        s: dict[str, Any] = {"id": i, "n_ctx": llm.n_ctx, "speculative": False, "is_processing": i < len(running)}
        if i < len(running):
            r = running[i]
            s.update(n_prompt_tokens=r["n_prompt"], n_prompt_tokens_cache=r["n_reused"],
                     next_token=[{"has_next_token": True, "has_new_line": False, "n_remain": r["n_remain"],
                                  "n_decoded": r["n_decoded"]}])
        out.append(s)
    return out


def safe_slot_file(save_dir: str, filename: Any) -> str:
    """The path of ``filename`` inside ``save_dir``; refuses anything that could leave it
    (separators, ``..``, leading dots, control characters, a symlink pointing out)."""
    from .server import HTTPError

    if not isinstance(filename, str) or not filename:
        raise HTTPError(400, "'filename' must be a non-empty string", param="filename", code="invalid_value")
    if (len(filename) > MAX_FILENAME or "/" in filename or "\\" in filename or filename.startswith(".")
            or ".." in filename or any(ord(ch) < 32 or ord(ch) == 127 for ch in filename)):
        raise HTTPError(400, f"invalid filename {filename!r}: a plain file name is expected (no path)",
                        param="filename", code="invalid_value")
    root = os.path.realpath(save_dir)
    path = os.path.join(root, filename)
    if os.path.dirname(os.path.realpath(path)) != root:
        raise HTTPError(400, f"invalid filename {filename!r}: it leads outside the slot save directory",
                        param="filename", code="invalid_value")
    return path


def slot_action(llm: Model, state: ServerState, id_slot: int, action: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /slots/{id}?action=save|restore|erase`` (runs on a worker thread)."""
    from .server import HTTPError

    if not 0 <= id_slot < llm.scheduler.n_parallel:
        raise HTTPError(400, f"no slot {id_slot}: this server has {llm.scheduler.n_parallel}", param="id_slot",
                        code="invalid_value")
    if action == "erase":
        n = llm.cache_pool.tokens()
        llm.cache_pool.clear()
        return {"id_slot": id_slot, "n_erased": n}
    if action not in ("save", "restore"):
        raise HTTPError(400, f"unknown slot action {action!r}: save, restore or erase", param="action",
                        code="invalid_value")
    if not state.slot_save_path:
        raise HTTPError(501, "slot save/restore is off: start the server with --slot-save-path DIR",
                        type="not_supported_error", code="not_supported")
    path = safe_slot_file(state.slot_save_path, body.get("filename"))
    t0 = time.perf_counter()
    try:
        if action == "save":
            ids = llm.save_state(path)
            ms = (time.perf_counter() - t0) * 1e3
            return {"id_slot": id_slot, "filename": body["filename"], "n_saved": len(ids),
                    "n_written": os.path.getsize(path), "timings": {"save_ms": ms}}
        if not os.path.isfile(path):
            raise HTTPError(404, f"no saved slot file {body['filename']!r}", param="filename", code="not_found")
        ids = llm.load_state(path)
    except StateError as e:
        raise HTTPError(400, str(e), param="filename", code="invalid_state") from None
    ms = (time.perf_counter() - t0) * 1e3
    return {"id_slot": id_slot, "filename": body["filename"], "n_restored": len(ids),
            "n_read": os.path.getsize(path), "timings": {"restore_ms": ms}}


def routes(state: ServerState, endpoint: Callable[..., Any]) -> list[Any]:
    """The routes above, wrapped by the app's ``endpoint`` (auth and error mapping)."""
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from .server import HTTPError, _check_model, _read_json, acquire_model

    async def with_model(request: Any, body: dict[str, Any], fn: Callable[..., Any], *a: Any) -> Any:
        name = _check_model({"model": body.get("model") or request.query_params.get("model")}, state)
        lease = await acquire_model(state, name)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, lease.llm, *a)
        finally:
            lease.release()

    async def completion_ep(request: Any) -> Any:
        body = await _read_json(request, state.max_body_bytes)
        return await completion(request, state, body, _check_model(body, state))

    async def tokenize_ep(request: Any) -> Any:
        body = await _read_json(request, state.max_body_bytes)
        return JSONResponse(await with_model(request, body, tokenize, body))

    async def detokenize_ep(request: Any) -> Any:
        body = await _read_json(request, state.max_body_bytes)
        return JSONResponse(await with_model(request, body, detokenize, body))

    async def props_ep(request: Any) -> Any:
        name = _check_model({"model": request.query_params.get("model")}, state)
        return JSONResponse(await with_model(request, {"model": name}, props, state, name))

    async def slots_ep(request: Any) -> Any:
        return JSONResponse(await with_model(request, {}, slots))

    async def slot_action_ep(request: Any) -> Any:
        try:
            id_slot = int(request.path_params["id"])
        except ValueError:
            raise HTTPError(400, "the slot id must be an integer", param="id_slot", code="invalid_value") from None
        action = request.query_params.get("action", "")
        body = await _read_json(request, state.max_body_bytes) if action != "erase" else {}
        return JSONResponse(await with_model(request, body, slot_action, state, id_slot, action, body))

    async def lora_get_ep(request: Any) -> Any:
        return JSONResponse(await with_model(request, {}, lora_adapters))

    async def lora_post_ep(request: Any) -> Any:
        body = await _read_json(request, state.max_body_bytes, array=True)
        return JSONResponse(await with_model(request, {}, set_lora_adapters, body))

    async def metrics_ep(request: Any) -> Any:
        if state.metrics is None:
            raise HTTPError(501, "metrics need prometheus-client: pip install 'minirt[server]'",
                            type="not_supported_error", code="not_supported")
        from .metrics import CONTENT_TYPE

        data = await asyncio.get_running_loop().run_in_executor(None, state.metrics.render)
        return Response(data, media_type=CONTENT_TYPE.split(";")[0], headers={"content-type": CONTENT_TYPE})

    return [
        Route("/completion", endpoint(completion_ep), methods=["POST"]),
        Route("/tokenize", endpoint(tokenize_ep), methods=["POST"]),
        Route("/detokenize", endpoint(detokenize_ep), methods=["POST"]),
        Route("/props", endpoint(props_ep), methods=["GET"]),
        Route("/slots", endpoint(slots_ep), methods=["GET"]),
        Route("/slots/{id}", endpoint(slot_action_ep), methods=["POST"]),
        Route("/metrics", endpoint(metrics_ep), methods=["GET"]),
        Route("/lora-adapters", endpoint(lora_get_ep), methods=["GET"]),
        Route("/lora-adapters", endpoint(lora_post_ep), methods=["POST"]),
    ]


__all__ = ["routes", "parse_llama_completion", "safe_slot_file", "tokenize", "detokenize", "props", "slots"]
