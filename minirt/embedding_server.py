"""HTTP handlers for embeddings and reranking: ``POST /v1/embeddings`` in OpenAI's shape and
``POST /v1/rerank`` in llama.cpp server's shape (both also without the ``/v1`` prefix).

The forward passes run on a worker thread (:func:`asyncio.to_thread`), never on the event loop;
:mod:`minirt.embedding` batches them and releases the model between batches, so streaming
generations keep going while a large embedding request runs.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidRequestError

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Model
    from .server import ServerState


def _bad(msg: str, param: str) -> Exception:
    from .server import HTTPError

    return HTTPError(400, msg, param=param, code="invalid_value")


def embeddings_response(llm: Model, body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``embeddings`` response for a request body (``input``: string, strings, token ids or
    token-id lists; ``encoding_format`` "float" | "base64"; ``dimensions``; ``truncate``, a
    llama.cpp-style extension, default true)."""
    from . import embedding

    inp = body.get("input")
    if inp is None:
        raise InvalidRequestError("'input' is required")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidRequestError(f"encoding_format must be 'float' or 'base64', got {fmt!r}")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)):
        raise InvalidRequestError(f"dimensions must be an integer, got {dims!r}")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise InvalidRequestError("truncate must be true or false")
    vecs, n_tokens = embedding.embed_counted(llm, inp, normalize=True, truncate=truncate, dimensions=dims)
    data = []
    for i, v in enumerate(vecs):
        v = np.asarray(v, dtype="<f4")
        emb: Any = base64.b64encode(v.tobytes()).decode("ascii") if fmt == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": body.get("model") or llm.name,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def rerank_response(llm: Model, body: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp server's rerank response: ``results`` [{index, relevance_score}] best first, at most
    ``top_n``; ``return_documents`` adds each ``document`` {"text"}."""
    from . import embedding

    query, docs = body.get("query"), body.get("documents")
    if not isinstance(query, str):
        raise InvalidRequestError("'query' must be a string")
    if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
        raise InvalidRequestError("'documents' must be a list of strings")
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
        raise InvalidRequestError(f"top_n must be a non-negative integer, got {top_n!r}")
    ret_docs = body.get("return_documents", False)
    if not isinstance(ret_docs, bool):
        raise InvalidRequestError("return_documents must be true or false")
    scores, n_tokens = embedding.rerank_counted(llm, query, docs)
    order = sorted(range(len(docs)), key=lambda i: -float(scores[i]))
    if top_n is not None:
        order = order[:top_n]
    results = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if ret_docs:
            r["document"] = {"text": docs[i]}
        results.append(r)
    return {"object": "list", "model": body.get("model") or llm.name, "results": results,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


async def _handle(state: ServerState, request: Any, fn: Any) -> Any:
    from starlette.responses import JSONResponse

    from .server import _check_model, _read_json, acquire_model

    body = await _read_json(request, state.max_body_bytes)
    body["model"] = _check_model(body, state)
    state.requests += 1
    lease = await acquire_model(state, body["model"])  # loads it first in a several-model server
    try:
        return JSONResponse(await asyncio.to_thread(fn, lease.llm, body))
    finally:
        lease.release()


def embeddings_endpoint(state: ServerState) -> Any:
    """The ``/v1/embeddings`` handler of a server."""
    async def embeddings(request: Any) -> Any:
        return await _handle(state, request, embeddings_response)
    return embeddings


def rerank_endpoint(state: ServerState) -> Any:
    """The ``/v1/rerank`` handler of a server."""
    async def rerank(request: Any) -> Any:
        return await _handle(state, request, rerank_response)
    return rerank
