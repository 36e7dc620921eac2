"""OpenAI / llama-cpp-python response shapes for completions and chat completions.

Pure formatting: :class:`minirt.generate.Completion` and :class:`TokenEvent` streams in, plain
dicts out (the same dicts the HTTP server serializes).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from .generate import Completion, TokenEvent


def _piece(model: Any, tid: int) -> str:
    return model.tokenizer.token_to_piece(tid).decode("utf-8", "replace")


def _usage(c: Completion) -> dict[str, Any]:
    u = {k: c.usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    if c.usage.get("cached_tokens"):
        u["prompt_tokens_details"] = {"cached_tokens": c.usage["cached_tokens"]}
    return u


def completion_logprobs(model: Any, c: Completion, text_offset0: int = 0) -> dict[str, Any]:
    """Legacy completions ``logprobs`` object: tokens, offsets, logprobs, top alternatives."""
    tokens = [_piece(model, t) for t in c.token_ids]
    offsets, off = [], text_offset0
    for t in tokens:
        offsets.append(off)
        off += len(t)
    top = [{_piece(model, i): lp for i, lp in alts} for alts in c.top_logprobs] if c.top_logprobs else None
    return {"tokens": tokens, "text_offset": offsets, "token_logprobs": list(c.logprobs), "top_logprobs": top}


def chat_logprobs_content(model: Any, ids: Iterable[int], lps: Iterable[float],
                          tops: Iterable[list[tuple[int, float]]] | None) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` entries."""
    out = []
    tops_l = list(tops) if tops is not None else None
    for j, (tid, lp) in enumerate(zip(ids, lps)):
        b = model.tokenizer.token_to_piece(tid)
        entry = {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b), "top_logprobs": []}
        if tops_l is not None and j < len(tops_l):
            entry["top_logprobs"] = [
                {"token": _piece(model, i), "logprob": l, "bytes": list(model.tokenizer.token_to_piece(i))}
                for i, l in tops_l[j]]
        out.append(entry)
    return out


def completion_dict(model: Any, c: Completion, cid: str, created: int, want_logprobs: bool,
                    echo_prefix: str = "") -> dict[str, Any]:
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model.name,
        "choices": [{
            "text": echo_prefix + c.text,
            "index": 0,
            "logprobs": completion_logprobs(model, c, len(echo_prefix)) if want_logprobs else None,
            "finish_reason": c.finish_reason,
        }],
        "usage": _usage(c),
    }


def completion_chunks(model: Any, events: Iterator[TokenEvent], cid: str, created: int,
                      echo_prefix: str = "") -> Iterator[dict[str, Any]]:
    def chunk(text: str, finish: str | None, lp: Any = None) -> dict[str, Any]:
        return {"id": cid, "object": "text_completion", "created": created, "model": model.name,
                "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}

    if echo_prefix:
        yield chunk(echo_prefix, None)
    for ev in events:
        lp = None
        if ev.token_id is not None and ev.logprob is not None and ev.top_logprobs is not None:
            lp = {"tokens": [_piece(model, ev.token_id)], "token_logprobs": [ev.logprob],
                  "top_logprobs": [{_piece(model, i): l for i, l in ev.top_logprobs}], "text_offset": []}
        if ev.text or ev.finish_reason is not None:
            yield chunk(ev.text, ev.finish_reason, lp)


def chat_message(c: Completion) -> tuple[dict[str, Any], str]:
    """The assistant message of a chat completion and its finish_reason: the parsed content,
    ``reasoning_content`` and OpenAI ``tool_calls`` (finish_reason "tool_calls") when the chat
    was parsed (a model that thinks, or a request with tools)."""
    if c.content is None:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    msg: dict[str, Any] = {"role": "assistant", "content": c.content if c.content or not c.tool_calls else None}
    if c.reasoning:
        msg["reasoning_content"] = c.reasoning
    if c.tool_calls:
        msg["tool_calls"] = [t.to_openai() for t in c.tool_calls]
        return msg, "tool_calls" if c.finish_reason == "stop" else c.finish_reason
    return msg, c.finish_reason


class ChatDeltas:
    """Streamed chat deltas of one request: text deltas as ``content``, or — with a chat parser
    (:class:`minirt.reasoning.ChatParser`) — ``reasoning_content``, ``content`` and ``tool_calls``
    deltas split by its streaming parser."""

    def __init__(self, parser: Any = None) -> None:
        self.stream = parser.stream() if parser is not None else None
        self.n_calls = 0

    def _out(self, reasoning: str, text: str, calls: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if text:
            out.append({"content": text})
        for c in calls:
            out.append({"tool_calls": [c.to_openai(self.n_calls)]})
            self.n_calls += 1
        return out

    def text(self, delta: str) -> list[dict[str, Any]]:
        """Deltas for a token's text."""
        if self.stream is None:
            return [{"content": delta}] if delta else []
        return self._out(*self.stream.feed(delta))

    def final(self, delta: str, finish: str) -> tuple[list[dict[str, Any]], str]:
        """Deltas for the last event's text (and held-back text), and the finish_reason."""
        if self.stream is None:
            return ([{"content": delta}] if delta else []), finish
        out = self._out(*self.stream.feed(delta)) + self._out(*self.stream.finish())
        return out, "tool_calls" if self.n_calls and finish == "stop" else finish


def chat_dict(model: Any, c: Completion, cid: str, created: int, want_logprobs: bool) -> dict[str, Any]:
    lp = None
    if want_logprobs:
        lp = {"content": chat_logprobs_content(model, c.token_ids, c.logprobs, c.top_logprobs or None)}
    message, finish = chat_message(c)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model.name,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": lp,
            "finish_reason": finish,
        }],
        "usage": _usage(c),
    }


def chat_chunks(model: Any, events: Iterator[TokenEvent], cid: str, created: int,
                want_logprobs: bool, plan: Any = None) -> Iterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None, lp: Any = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    deltas = ChatDeltas(plan)
    yield chunk({"role": "assistant", "content": ""}, None)
    for ev in events:
        if ev.finish_reason is not None:
            out, finish = deltas.final(ev.text, ev.finish_reason)
            for d in out:
                yield chunk(d, None)
            yield chunk({}, finish)
            return
        lp = None
        if want_logprobs and ev.token_id is not None and ev.logprob is not None:
            lp = {"content": chat_logprobs_content(model, [ev.token_id], [ev.logprob],
                                                   [ev.top_logprobs or []])}
        out = deltas.text(ev.text)
        if lp is not None and not out:
            out = [{"content": ""}]
        for i, d in enumerate(out):
            yield chunk(d, None, lp if i == 0 else None)
