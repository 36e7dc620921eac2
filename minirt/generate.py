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
import re
import threading
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ContextOverflowError, InvalidRequestError
from .forward import Segment, Transformer
from .kv_cache import KVCache
from .sampling import Sampled, Sampler

if TYPE_CHECKING:  # pragma: no cover
    from .grammar import MaskWorker, Matcher

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
    part: str = "content"  # "reasoning" while a thinking model thinks (chat), else "content"
    probs: list[tuple[int, float]] | None = None  # n_probs: top (id, p) of the distribution drawn from


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
    # chat outputs parsed for tools (and reasoning): the answer without the calls, the calls
    # (minirt.tools.ToolCall); None when the request had no tools
    content: str | None = None
    tool_calls: list[Any] | None = None
    reasoning: str | None = None  # the thinking part (reasoning_content), None when the model has none


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


# Bounds on the stop strings of one request (llama-server has none, OpenAI allows 4): enough
# for chat templates' end markers and user lists, small enough that building the matcher for a
# request stays cheap.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 32768  # characters over all stop strings of one request


class StopStrings:
    """Holds back text that could be the start of a stop string; reports when one completes.

    ``feed(delta)`` returns ``(text safe to emit, stopped)``. On a stop, the text before the stop
    string is emitted and the stop string itself never is. The stop string that *ends* first in
    the output wins (the same whatever the token boundaries); of those ending at the same place,
    the longest.

    Matching is an Aho-Corasick automaton over the stop strings, fed one character at a time, so
    a token costs O(its text) amortized whatever the number and length of the stop strings; the
    automaton's state depth is exactly how many characters must be held back (the longest
    suffix of the output that is a prefix of some stop string). Building it costs O(total
    length of the stop strings), bounded by :data:`MAX_STOP_CHARS`.
    """

    def __init__(self, stops: Seq[str]) -> None:
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.steps = 0  # automaton transitions taken (tests assert the per-token cost with it)
        # trie: goto[(node, char)] -> child; node 0 is the root
        goto: dict[tuple[int, str], int] = {}
        depth = [0]
        for s in self.stops:
            node = 0
            for ch in s:
                nxt = goto.get((node, ch))
                if nxt is None:
                    nxt = goto[(node, ch)] = len(depth)
                    depth.append(depth[node] + 1)
                node = nxt
        n = len(depth)
        term = [0] * n  # length of the longest stop string ending at this node (0: none)
        for s in self.stops:
            node = 0
            for ch in s:
                node = goto[(node, ch)]
            term[node] = len(s)
        children: list[list[tuple[str, int]]] = [[] for _ in range(n)]
        for (parent, ch), child in goto.items():
            children[parent].append((ch, child))
        fail = [0] * n
        queue = [c for _, c in children[0]]
        for node in queue:  # breadth first: a node's failure target is shallower, already done
            for ch, child in children[node]:
                f = fail[node]
                while f and (f, ch) not in goto:
                    f = fail[f]
                target = goto.get((f, ch), 0)
                fail[child] = target if target != child else 0
                if not term[child]:
                    term[child] = term[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._term, self._depth = goto, fail, term, depth
        self._node = 0
        self._held: list[str] = []  # text not yet emitted, oldest first; its length is depth[node]
        self._held_len = 0

    @property
    def pending(self) -> str:
        """The text held back (a possible start of a stop string)."""
        return "".join(self._held)

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        goto, fail, term = self._goto, self._fail, self._term
        node = self._node
        steps = 0
        for i, ch in enumerate(delta):
            while True:
                steps += 1
                nxt = goto.get((node, ch))
                if nxt is not None:
                    node = nxt
                    break
                if node == 0:
                    break
                node = fail[node]
            if term[node]:
                self.steps += steps
                text = "".join(self._held) + delta[:i + 1]
                self._reset()
                return text[:len(text) - term[node]], True
        self.steps += steps
        self._node = node
        keep = self._depth[node]
        if delta:
            self._held.append(delta)
            self._held_len += len(delta)
        n_out = self._held_len - keep
        if n_out <= 0:
            return "", False
        # emit the oldest n_out held characters: whole chunks, then a split of the last one
        out = []
        held = self._held
        k = 0
        while n_out and n_out >= len(held[k]):
            out.append(held[k])
            n_out -= len(held[k])
            k += 1
        if n_out:
            out.append(held[k][:n_out])
            held[k] = held[k][n_out:]
        del held[:k]
        self._held_len = keep
        return "".join(out), False

    def _reset(self) -> None:
        self._node = 0
        self._held = []
        self._held_len = 0

    def flush(self) -> str:
        out = "".join(self._held)
        self._reset()
        return out


def validate_stop(stop: Any) -> list[str]:
    """``stop`` may be None, a string or a list of strings: at most :data:`MAX_STOP_STRINGS`
    strings of :data:`MAX_STOP_CHARS` characters in all."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        stops = [s for s in stop if s]
    else:
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}"[:300])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_CHARS:
        raise InvalidRequestError(f"stop strings have {total} characters in all; at most {MAX_STOP_CHARS} "
                                  "are allowed")
    return stops


EventSink = Callable[[TokenEvent], None]
ProgressFn = Callable[[int, int], Any]


class Sequence:
    """One request in flight."""

    def __init__(self, prompt_ids: Seq[int], cache: KVCache | None, sampler: Sampler, detok: Any,
                 eog_ids: frozenset[int], *, max_tokens: int, stop: Seq[str] = (),
                 ignore_eos: bool = False, context_overflow: str = "stop", n_keep: int = 0,
                 cancel: threading.Event | None = None, sink: EventSink | None = None,
                 progress: ProgressFn | None = None, trace: Trace | None = None,
                 n_reused: int = 0, matcher: Matcher | None = None) -> None:
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
        self.matcher = matcher  # grammar state (constrained sampling), None when unconstrained
        self.parser: Any = None  # a chat's output parser (minirt.reasoning.ChatParser)
        self.forced: list[int] = []  # tokens to emit instead of sampling (closing a thinking block)
        self.stopping: list[Callable[[np.ndarray, np.ndarray], bool]] = []  # stopping_criteria
        self._split: Any = None  # where the output is: thinking or answering (minirt.reasoning.Splitter)
        self._gstate: str | None = None  # the grammar's phase in a chat that may think (advance_grammar)
        self._gtail, self._gtail_i = "", 0  # gpt-oss: the output's last characters, for the final header
        self.n_thinking = 0
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
        """True once the consumer or the caller's cancel object asked to stop. A cancel object
        whose ``is_set()`` raises fails this request (the error is kept in ``error``), never the
        batch it runs in."""
        if self._stop.is_set():
            return True
        if self.cancel is None:
            return False
        try:
            return bool(self.cancel.is_set())
        except Exception as e:
            if self.error is None:
                self.error = e
            return True

    def request_stop(self) -> None:
        """Ask the sequence to end with "cancelled" at the next step (thread-safe)."""
        self._stop.set()

    def attach_cache(self, cache: KVCache, n_reused: int) -> None:
        """Give the sequence its KV cache, whose first ``n_reused`` positions hold the prompt's prefix."""
        self.cache = cache
        self.n_prefilled = self.n_reused = n_reused
        cache.keep_rows = max(cache.keep_rows, self.n_keep)  # rows a context shift keeps stay resident

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
        part = self._part(delta)
        text, stopped = self.stops.feed(delta)
        if self.trace is not None:
            self.trace.add("sample", t_sample, token=len(self.generated) - 1)
            self.trace.add("detokenize", t_detok, token=len(self.generated) - 1)
            self.trace.tokens.append({"id": tok, "text": delta, "logprob": s.logprob,
                                      "top": [(i, float(np.exp(lp))) for i, lp in s.top]})
        if stopped:
            if text:
                self._emit(TokenEvent(tok, text, None, s.logprob, s.top or None, len(self.generated) - 1, part,
                                      s.probs or None))
            self.finish("stop", stop_hit=True)
            return
        self._emit(TokenEvent(tok, text, None, s.logprob, s.top or None, len(self.generated) - 1, part,
                              s.probs or None))
        if self.done:  # the callback asked to stop
            return
        if len(self.generated) >= self.max_tokens:
            self.finish("length")
            return
        self.pending_token = tok

    # -- grammar and thinking ----------------------------------------------------------------
    # A chat whose model thinks keeps the grammar for its answer: the thinking is free text, and the
    # grammar starts from its first state at the first token of the answer. Phases: "answer" (the
    # grammar applies), "thinking" (no mask until a <think>…</think>-style block closes), "open"
    # (first token of an answer that may open such a block: the grammar's tokens or the opening
    # marker token), "harmony" / "free" (gpt-oss: any channels first, the grammar from the final
    # channel's message on, as llama.cpp's gpt-oss grammar has it). A grammar that allows the
    # opening token (``<think>``, ``<|channel|>``) as its first writes the structure itself and
    # applies throughout.
    _FINAL_HEADER = re.compile(r"<\|channel\|>final(?:\s*(?:<\|constrain\|>)?[A-Za-z0-9_-]+)?<\|message\|>$")

    def _grammar_start(self) -> str:
        p = self.parser
        from .reasoning import HARMONY, TAGS

        if p is None or getattr(p, "open_id", None) is None and not getattr(p, "inside", False):
            return "answer"
        if p.fmt == HARMONY:
            return "harmony"
        if p.fmt not in TAGS:
            return "answer"
        return "thinking" if p.inside else "open"

    def _final_channel_open(self) -> bool:
        """gpt-oss: has the output just written a final-channel header (its answer starts now)?"""
        new = self.text_parts[self._gtail_i:]
        self._gtail_i = len(self.text_parts)
        self._gtail = (self._gtail + "".join(new))[-256:]
        return self._FINAL_HEADER.search(self._gtail) is not None

    def advance_grammar(self, token: int | None, worker: Any) -> None:
        """Feed the grammar the token being fed to the model (None on the first step) and start
        the next mask on ``worker``; see the phases above."""
        assert self.matcher is not None
        st = self._gstate
        if st is None:
            st = self._gstate = self._grammar_start()
            if st != "thinking":
                self.matcher.advance(None, worker)
            return
        if st == "open":
            if token == self.parser.open_id:
                self._gstate = "thinking"
                return
            self._gstate = "answer"
        elif st == "thinking":
            if self._split is None or self._split.thinking:
                return
            self._gstate = "answer"
            token = None  # the closing marker is not the grammar's: it starts from its first state
        elif st in ("harmony", "free"):
            self._gstate = "free"
            if not self._final_channel_open():
                return
            self._gstate = "answer"
            token = None
        self.matcher.advance(token, worker)

    def grammar_mask(self) -> np.ndarray | None:
        """Tokens the grammar allows next (None while the model thinks: any token)."""
        assert self.matcher is not None
        if self._gstate is None:  # not advanced yet (inline use): the first step
            self.advance_grammar(None, None)
        st = self._gstate
        if st in ("thinking", "free"):
            return None
        ok = self.matcher.allowed()
        if st in ("open", "harmony"):
            if ok[self.parser.open_id]:  # the grammar itself writes the thinking block: it is in charge
                self._gstate = "answer"
                return ok
            if st == "harmony":
                self._gstate = "free"
                return None
            ok = ok.copy()
            ok[self.parser.open_id] = True
        return ok

    def _part(self, delta: str) -> str:
        """Which part of a chat answer the token belongs to; closes the thinking block when its
        token budget (``thinking_budget``) is spent."""
        p = self.parser
        if p is None or p.fmt is None:
            return "content"
        if self._split is None:
            from .reasoning import Splitter

            self._split = Splitter(p.fmt, p.inside)
        sp = self._split
        was = sp.thinking
        sp.feed(delta)
        # text held back as a possible opening marker (the "<" of "<think>") counts as thinking
        opening = not sp.seen_start and bool(sp.buf)
        if not (was or sp.thinking or opening):
            return "content"
        self.n_thinking += 1
        budget = getattr(p, "budget", None)
        if budget is not None and self._split.thinking and self.n_thinking >= budget and not self.forced:
            self.forced = list(p.end_ids)
        return "reasoning"

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
        c = Completion(
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
        if self.parser is not None:
            self.parser.apply(c)
        return c


class Engine:
    """Advances sequences through the model, one batched forward pass per :meth:`step`."""

    def __init__(self, model: Transformer, n_batch: int = 512) -> None:
        if n_batch <= 0:
            raise InvalidRequestError(f"n_batch must be positive, got {n_batch}")
        self.model = model
        self.n_batch = n_batch
        self._masks: MaskWorker | None = None

    @property
    def masks(self) -> MaskWorker:
        """The thread that computes grammar masks while forward passes run (started on first use)."""
        if self._masks is None:
            from .grammar import MaskWorker

            self._masks = MaskWorker()
        return self._masks

    def close(self) -> None:
        if self._masks is not None:
            self._masks.close()

    def step(self, seqs: Iterable[Sequence], prefill_budget: int | None = None) -> bool:
        """One forward pass over every unfinished sequence in ``seqs``.

        Decoding sequences contribute their pending token; sequences in prefill share what is left
        of the ``n_batch`` token budget, in order, so a long prompt is cut into chunks and never
        stalls the decoding streams for more than one chunk. Returns whether a forward pass ran
        (False when every sequence had finished or was cancelled at the boundary).
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
            return False
        ids = np.concatenate(tokens)
        for (s, _seg, samples), t in zip(batch, tokens):
            s.cache.tokens[s.cache.n_past:s.cache.n_past + len(t)] = t
            if samples and s.matcher is not None:
                # the grammar takes the token being fed and computes the next mask during the pass
                try:
                    s.advance_grammar(None if s.in_prefill else int(t[0]), self.masks)
                except Exception as e:
                    s.error = e
                    s.finish("cancelled", notify=False)
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
                if s.forced:  # e.g. the end of a thinking block whose budget is spent
                    sampled = Sampled(s.forced.pop(0), 0.0)
                else:
                    allowed = s.grammar_mask() if s.matcher is not None else None
                    sampled = s.sampler.sample(lg, s.cache.token_ids(), allowed)
                s.accept(sampled, time.perf_counter() - t1)
                if s.stopping and not s.done and any(
                        f(np.append(s.cache.token_ids(), sampled.token_id), lg) for f in s.stopping):
                    s.finish("stop")
            except Exception as e:  # one request's failure (e.g. every token banned) ends only that request
                s.error = e
                s.finish("cancelled", notify=False)
        return True

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
