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
    final usage chunk; extra: fields added to every chunk (e.g. ``system_fingerprint``).
    """

    def __init__(self, model: Any, kind: str, cid: str, created: int, model_name: str | None = None, *,
                 want_logprobs: bool = False, top_logprobs: bool = True, include_usage: bool = False,
                 extra: dict[str, Any] | None = None) -> None:
        if kind not in ("chat", "completion"):
            raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
        self.model, self.kind, self.cid, self.created = model, kind, cid, created
        self.model_name = model.name if model_name is None else model_name
        self.want_logprobs, self.top_logprobs, self.include_usage = want_logprobs, top_logprobs, include_usage
        self.extra = dict(extra or {})
        self.offset = 0  # characters sent so far (completions' text_offset)

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
                out = [self._chat({"content": ev.text}, None)] if ev.text else []
                return out + [self._chat({}, ev.finish_reason)]
            if not ev.text and not has_lp:
                return []
            lp = None
            if has_lp:
                lp = {"content": chat_logprobs_content(model, [ev.token_id], [ev.logprob], [ev.top_logprobs or []])}
            return [self._chat({"content": ev.text}, None, lp)]
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


def chat_dict(model: Any, c: Completion, cid: str, created: int, want_logprobs: bool) -> dict[str, Any]:
    lp = None
    if want_logprobs:
        lp = {"content": chat_logprobs_content(model, c.token_ids, c.logprobs, c.top_logprobs or None)}
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model.name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": lp,
            "finish_reason": c.finish_reason,
        }],
        "usage": usage_dict(c),
    }


def chat_chunks(model: Any, events: Iterator[TokenEvent], cid: str, created: int,
                want_logprobs: bool) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` dicts of a stream: the role first, the finish_reason last."""
    return ChunkBuilder(model, "chat", cid, created, want_logprobs=want_logprobs).stream(events)
