"""OpenAI / llama-cpp-python response shapes for completions and chat completions.

Pure formatting: :class:`minirt.generate.Completion` and :class:`TokenEvent` streams in, plain
dicts out (the same dicts the HTTP server serializes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from .generate import Completion, TokenEvent


def _piece(model: Any, tid: int) -> str:
    return model.tokenizer.token_to_piece(tid).decode("utf-8", "replace")


def usage_dict(c: Completion) -> dict[str, Any]:
    """The ``usage`` object: token counts and ``prompt_tokens_details.cached_tokens`` (always
    present, 0 when nothing came from the prefix cache, as the OpenAI API sends it)."""
    u: dict[str, Any] = {k: c.usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    u["prompt_tokens_details"] = {"cached_tokens": int(c.usage.get("cached_tokens", 0))}
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
                {"token": _piece(model, i), "logprob": lg, "bytes": list(model.tokenizer.token_to_piece(i))}
                for i, lg in tops_l[j]]
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
        "usage": usage_dict(c),
    }


class ChunkBuilder:
    """Turns one request's :class:`TokenEvent` stream into OpenAI stream chunk dicts: the one
    builder behind :meth:`Model.create_completion` / ``create_chat_completion`` with
    ``stream=True`` and the HTTP server's server-sent events.

    kind: ``"chat"`` (``chat.completion.chunk`` with deltas) or ``"completion"`` (``text_completion``);
    want_logprobs: per-token logprobs on every chunk; top_logprobs: completions only, include the
    alternatives; include_usage: every chunk has ``"usage": None`` and :meth:`usage` makes the
    final usage chunk; extra: fields added to every chunk (e.g. ``system_fingerprint``); plan: the
    request's chat parser (reasoning and tool-call deltas, see :class:`ChatDeltas`).
    """

    def __init__(self, model: Any, kind: str, cid: str, created: int, model_name: str | None = None, *,
                 want_logprobs: bool = False, top_logprobs: bool = True, include_usage: bool = False,
                 extra: dict[str, Any] | None = None, plan: Any = None) -> None:
        if kind not in ("chat", "completion"):
            raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
        self.model, self.kind, self.cid, self.created = model, kind, cid, created
        self.model_name = model.name if model_name is None else model_name
        self.want_logprobs, self.top_logprobs, self.include_usage = want_logprobs, top_logprobs, include_usage
        self.extra = dict(extra or {})
        self.offset = 0  # characters sent so far (completions' text_offset)
        self.deltas = ChatDeltas(plan) if kind == "chat" else None  # reasoning / content / tool_calls split

    def _base(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        d: dict[str, Any] = {"id": self.cid, "object": obj, "created": self.created, "model": self.model_name,
                             **self.extra}
        if self.include_usage:
            d["usage"] = None
        return d

    def _chat(self, delta: dict[str, Any], finish: str | None, lp: Any = None) -> dict[str, Any]:
        d = self._base()
        d["choices"] = [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]
        return d

    def _text(self, text: str, finish: str | None, lp: Any = None) -> dict[str, Any]:
        d = self._base()
        d["choices"] = [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]
        return d

    def first(self, echo: str = "") -> list[dict[str, Any]]:
        """Chunks sent before any token: the assistant role (chat) or the echoed prompt."""
        if self.kind == "chat":
            return [self._chat({"role": "assistant", "content": ""}, None)]
        if echo:
            self.offset += len(echo)
            return [self._text(echo, None)]
        return []

    def event(self, ev: TokenEvent) -> list[dict[str, Any]]:
        """Chunks for one event (none for an event that carries neither text, logprobs nor an end)."""
        model = self.model
        has_lp = self.want_logprobs and ev.token_id is not None and ev.logprob is not None
        if self.kind == "chat":
            if ev.finish_reason is not None:
                deltas, finish = self.deltas.final(ev.text, ev.finish_reason)
                return [self._chat(d, None) for d in deltas] + [self._chat({}, finish)]
            deltas = self.deltas.text(ev.text)
            if not deltas and not has_lp:
                return []
            lp = None
            if has_lp:
                lp = {"content": chat_logprobs_content(model, [ev.token_id], [ev.logprob], [ev.top_logprobs or []])}
            return [self._chat(d, None, lp if i == 0 else None) for i, d in enumerate(deltas or [{"content": ""}])]
        lp = None
        if has_lp:
            top = ([{_piece(model, i): lg for i, lg in ev.top_logprobs}]
                   if self.top_logprobs and ev.top_logprobs is not None else None)
            lp = {"tokens": [_piece(model, ev.token_id)], "token_logprobs": [ev.logprob], "top_logprobs": top,
                  "text_offset": [self.offset]}
        if not ev.text and lp is None and ev.finish_reason is None:
            return []
        self.offset += len(ev.text)
        return [self._text(ev.text, ev.finish_reason, lp)]

    def usage(self, c: Completion) -> dict[str, Any]:
        """The final chunk of ``stream_options.include_usage``: no choices, the usage object."""
        d = self._base()
        d["choices"] = []
        d["usage"] = usage_dict(c)
        return d

    def stream(self, events: Iterable[TokenEvent], echo: str = "") -> Iterator[dict[str, Any]]:
        """Every chunk of a whole stream, in order."""
        yield from self.first(echo)
        for ev in events:
            yield from self.event(ev)


def completion_chunks(model: Any, events: Iterator[TokenEvent], cid: str, created: int,
                      echo_prefix: str = "", want_logprobs: bool = False) -> Iterator[dict[str, Any]]:
    """``text_completion`` chunks of a stream (the echoed prompt first when given)."""
    return ChunkBuilder(model, "completion", cid, created, want_logprobs=want_logprobs).stream(events, echo_prefix)


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
        "usage": usage_dict(c),
    }


def chat_chunks(model: Any, events: Iterator[TokenEvent], cid: str, created: int,
                want_logprobs: bool, plan: Any = None) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` dicts of a stream: the role first, the finish_reason last (``plan``:
    the request's chat parser, see :class:`ChatDeltas`)."""
    return ChunkBuilder(model, "chat", cid, created, want_logprobs=want_logprobs, plan=plan).stream(events)
