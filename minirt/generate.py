"""Steps 5–8 for one request: sample, append, stop, detokenize and stream.

A :class:`Sequence` is one request's state machine: its prompt ids waiting for prefill, its KV
cache, sampler, stop rules, streaming detokenizer and the sink that receives
:class:`TokenEvent` objects. :class:`Engine.step` advances a set of sequences by one forward
pass — a chunk of prompt for sequences still in prefill, one token for those decoding — so the
same code serves one caller (``Model.generate`` runs steps on the caller's thread) and many
(the scheduler batches sequences of different requests into each step).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ContextOverflowError, InvalidRequestError
from .forward import Segment, Transformer
from .kv_cache import KVCache
from .sampling import Sampled, Sampler

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class TokenEvent:
    """One streamed step: a generated token and its text delta, or the final event.

    ``token_id`` is None only on the final event (``finish_reason`` set), which carries any text
    that was held back (a partial stop-string match that did not complete, an unfinished UTF-8
    sequence).
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    index: int = 0  # position among generated tokens


@dataclass
class Completion:
    """Result of a finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    trace: Trace | None = None


@dataclass
class Trace:
    """What ``--explain`` / ``trace=True`` shows: every step of the pipeline with its cost."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    rendered: str | None = None  # context after the chat template
    prompt_ids: list[int] = field(default_factory=list)
    prompt_pieces: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # {"step", "seconds", ...}
    tokens: list[dict[str, Any]] = field(default_factory=list)  # per generated token

    def add(self, step: str, seconds: float, **info: Any) -> None:
        self.steps.append({"step": step, "seconds": seconds, **info})


class StopStrings:
    """Holds back text that could be the start of a stop string; reports when one completes.

    ``feed(delta)`` returns ``(text safe to emit, stopped)``. On a stop, the text before the stop
    string is emitted and the stop string itself never is.
    """

    def __init__(self, stops: Seq[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.max_len = max((len(s) for s in self.stops), default=0)

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        buf = self.pending + delta
        hit = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            self.pending = ""
            return buf[:hit], True
        # keep the longest suffix of buf that is a prefix of some stop string
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def validate_stop(stop: Any) -> list[str]:
    """``stop`` may be None, a string or a list of strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")


EventSink = Callable[[TokenEvent], None]
ProgressFn = Callable[[int, int], Any]


class Sequence:
    """One request in flight."""

    def __init__(self, prompt_ids: Seq[int], cache: KVCache | None, sampler: Sampler, detok: Any,
                 eog_ids: frozenset[int], *, max_tokens: int, stop: Seq[str] = (),
                 ignore_eos: bool = False, context_overflow: str = "stop", n_keep: int = 0,
                 cancel: threading.Event | None = None, sink: EventSink | None = None,
                 progress: ProgressFn | None = None, trace: Trace | None = None,
                 n_reused: int = 0) -> None:
        if context_overflow not in ("stop", "shift"):
            raise InvalidRequestError(f"context_overflow must be 'stop' or 'shift', got {context_overflow!r}")
        self.prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
        self.cache = cache
        self.sampler = sampler
        self.detok = detok
        self.eog_ids = eog_ids
        self.max_tokens = max_tokens
        self.stops = StopStrings(stop)
        self.ignore_eos = ignore_eos
        self.context_overflow = context_overflow
        self.n_keep = n_keep
        self.cancel = cancel
        self._stop = threading.Event()  # set by the consumer (callback returned False, stream closed)
        self.sink = sink
        self.progress = progress
        self.trace = trace
        self.n_prefilled = n_reused  # prompt positions already in the cache (shared prefix)
        self.n_reused = n_reused
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.pending_token: int | None = None  # sampled, not yet fed through the model
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.t_prefill_done: float | None = None
        self.t_end: float | None = None
        self.error: BaseException | None = None

    # -- state -----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.n_prefilled < len(self.prompt_ids)

    def cancelled(self) -> bool:
        return self._stop.is_set() or (self.cancel is not None and self.cancel.is_set())

    def request_stop(self) -> None:
        """Ask the sequence to end with "cancelled" at the next step (thread-safe)."""
        self._stop.set()

    def attach_cache(self, cache: KVCache, n_reused: int) -> None:
        """Give the sequence its KV cache, whose first ``n_reused`` positions hold the prompt's prefix."""
        self.cache = cache
        self.n_prefilled = self.n_reused = n_reused

    # -- output ----------------------------------------------------------------------------------
    def _emit(self, ev: TokenEvent) -> None:
        if ev.text:
            self.text_parts.append(ev.text)
        if self.sink is not None:
            try:
                keep_going = self.sink(ev)
            except BaseException as e:  # a failing callback ends this request, not the model
                self.error = e
                if ev.finish_reason is None:
                    self.finish("cancelled", notify=False)
                return
            if keep_going is False and ev.finish_reason is None:
                self.finish("cancelled")

    def finish(self, reason: str, notify: bool = True, stop_hit: bool = False) -> None:
        """End the sequence: flush held-back text (unless a stop string ended it) and send the final event."""
        if self.done:
            return
        self.finish_reason = reason
        self.t_end = time.perf_counter()
        tail = ""
        if not stop_hit:
            # bytes of an unfinished character and text held back for a stop string that never
            # completed are real output
            text, stopped = self.stops.feed(self.detok.finish() if self.detok is not None else "")
            tail = text if stopped else text + self.stops.flush()
        if notify:
            self._emit(TokenEvent(None, tail, reason, index=len(self.generated)))
        elif tail:
            self.text_parts.append(tail)

    def accept(self, s: Sampled, t_sample: float) -> None:
        """Handle a sampled token: end-of-generation, max tokens, stop strings, stream it."""
        tok = s.token_id
        if tok in self.eog_ids and not self.ignore_eos:
            self.finish("stop")
            return
        if self.context_overflow == "stop" and len(self.prompt_ids) + len(self.generated) >= self.cache.n_ctx:
            self.finish("length")  # prompt + output may fill the context, not exceed it
            return
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.generated.append(tok)
        self.logprobs.append(s.logprob)
        if self.sampler.params.top_logprobs:
            self.top_logprobs.append(s.top)
        t0 = time.perf_counter()
        delta = self.detok.push(tok)
        t_detok = time.perf_counter() - t0
        text, stopped = self.stops.feed(delta)
        if self.trace is not None:
            self.trace.add("sample", t_sample, token=len(self.generated) - 1)
            self.trace.add("detokenize", t_detok, token=len(self.generated) - 1)
            self.trace.tokens.append({"id": tok, "text": delta, "logprob": s.logprob,
                                      "top": [(i, float(np.exp(lp))) for i, lp in s.top]})
        if stopped:
            if text:
                self._emit(TokenEvent(tok, text, None, s.logprob, s.top or None, len(self.generated) - 1))
            self.finish("stop", stop_hit=True)
            return
        self._emit(TokenEvent(tok, text, None, s.logprob, s.top or None, len(self.generated) - 1))
        if self.done:  # the callback asked to stop
            return
        if len(self.generated) >= self.max_tokens:
            self.finish("length")
            return
        self.pending_token = tok

    def completion(self) -> Completion:
        """The finished request as a :class:`Completion`."""
        n_prompt, n_gen = len(self.prompt_ids), len(self.generated)
        end = self.t_end or time.perf_counter()
        pre_end = self.t_prefill_done or end
        prefill_s = max(pre_end - self.t_start, 1e-9)
        n_computed = n_prompt - self.n_reused
        decode_s = end - (self.t_first or end)
        timings = {
            "time_to_first_token_s": (self.t_first - self.t_start) if self.t_first else float("nan"),
            "prompt_tokens_per_s": n_computed / prefill_s if n_computed else float("nan"),
            "generated_tokens_per_s": (n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else float("nan"),
            "prompt_s": prefill_s,
            "total_s": end - self.t_start,
        }
        return Completion(
            text="".join(self.text_parts),
            token_ids=list(self.generated),
            finish_reason=self.finish_reason or "cancelled",
            usage={"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
                   "cached_tokens": self.n_reused},
            timings=timings,
            prompt_ids=self.prompt_ids.tolist(),
            logprobs=list(self.logprobs),
            top_logprobs=list(self.top_logprobs),
            trace=self.trace,
        )


class Engine:
    """Advances sequences through the model, one batched forward pass per :meth:`step`."""

    def __init__(self, model: Transformer, n_batch: int = 512) -> None:
        if n_batch <= 0:
            raise InvalidRequestError(f"n_batch must be positive, got {n_batch}")
        self.model = model
        self.n_batch = n_batch

    def step(self, seqs: Iterable[Sequence], prefill_budget: int | None = None) -> None:
        """One forward pass over every unfinished sequence in ``seqs``.

        Decoding sequences contribute their pending token; sequences in prefill share what is left
        of the ``n_batch`` token budget, in order, so a long prompt is cut into chunks and never
        stalls the decoding streams for more than one chunk.
        """
        batch: list[tuple[Sequence, Segment, bool]] = []  # (seq, segment, samples after this pass)
        tokens: list[np.ndarray] = []
        budget = self.n_batch
        live = [s for s in seqs if not s.done]
        prefill_left = min(budget, prefill_budget) if prefill_budget else budget
        for s in live:
            if s.cancelled():
                s.finish("cancelled")
        live = [s for s in live if not s.done]
        for s in live:  # decoding sequences first: one token each
            if s.in_prefill or s.pending_token is None:
                continue
            if not self._make_room(s, 1):
                continue
            tokens.append(np.array([s.pending_token], dtype=np.int32))
            batch.append((s, Segment(s.cache, 1, "last"), True))
            budget -= 1
        prefill_left = min(prefill_left, budget)
        for s in live:
            if not s.in_prefill or prefill_left <= 0:
                continue
            n = min(len(s.prompt_ids) - s.n_prefilled, prefill_left)
            chunk = s.prompt_ids[s.n_prefilled:s.n_prefilled + n]
            last = s.n_prefilled + n == len(s.prompt_ids)
            tokens.append(chunk)
            batch.append((s, Segment(s.cache, n, "last" if last else "none"), last))
            prefill_left -= n
        if not batch:
            return
        ids = np.concatenate(tokens)
        for (s, _seg, _), t in zip(batch, tokens):
            s.cache.tokens[s.cache.n_past:s.cache.n_past + len(t)] = t
        t0 = time.perf_counter()
        logits = self.model.forward(ids, [seg for _, seg, _ in batch])
        t_fwd = time.perf_counter() - t0
        for (s, seg, samples), lg in zip(batch, logits):
            if s.in_prefill:
                s.n_prefilled += seg.n_tokens
                if s.trace is not None:
                    s.trace.add("prefill", t_fwd, tokens=seg.n_tokens, batch=len(ids))
                if s.progress is not None:
                    try:
                        s.progress(s.n_prefilled, len(s.prompt_ids))
                    except Exception as e:  # a failing progress callback ends its own request only
                        s.error = e
                        s.finish("cancelled", notify=False)
                        continue
                if not s.in_prefill:
                    s.t_prefill_done = time.perf_counter()
            elif s.trace is not None:
                s.trace.add("forward", t_fwd, batch=len(ids), position=s.cache.n_past - 1)
            s.pending_token = None
            if not samples or s.done:
                continue
            if s.cancelled():
                s.finish("cancelled")
                continue
            t1 = time.perf_counter()
            try:
                sampled = s.sampler.sample(lg, s.cache.token_ids())
                s.accept(sampled, time.perf_counter() - t1)
            except Exception as e:  # one request's failure (e.g. every token banned) ends only that request
                s.error = e
                s.finish("cancelled", notify=False)

    def _make_room(self, s: Sequence, n: int) -> bool:
        """Ensure ``n`` free positions: shift the context or finish with "length"."""
        c = s.cache
        if c.n_past + n <= c.n_ctx:
            return True
        if s.context_overflow == "shift":
            n_keep = min(s.n_keep, c.n_past - 1)
            n_discard = max((c.n_past - n_keep) // 2, n)
            self.model.shift_cache(c, n_keep, n_discard)
            log.debug("context shift: kept %d, discarded %d positions", n_keep, n_discard)
            return True
        s.finish("length")
        return False

    def run(self, s: Sequence) -> Completion:
        """Drive one sequence to its end on the calling thread."""
        while not s.done:
            self.step([s])
            if s.error is not None:
                break
        return s.completion()


def check_prompt(prompt_ids: Seq[int], n_vocab: int, n_ctx: int) -> None:
    """Validate prompt token ids: non-empty, in range, and leaving room to generate."""
    if len(prompt_ids) == 0:
        raise InvalidRequestError("the prompt is empty (no tokens)")
    arr = np.asarray(prompt_ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequestError("prompt token ids must be a flat list of integers")
    bad = (arr < 0) | (arr >= n_vocab)
    if bad.any():
        raise InvalidRequestError(f"prompt token id {int(arr[bad][0])} is out of range [0, {n_vocab})")
    if len(arr) >= n_ctx:
        raise ContextOverflowError(f"the prompt has {len(arr)} tokens but the context holds {n_ctx} "
                                   f"(one position must stay free to generate); raise n_ctx or shorten it")
