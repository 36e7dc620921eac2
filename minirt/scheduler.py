"""Continuous batching between the API and the model.

One scheduler thread owns the forward passes. Requests (from any number of Python threads or the
HTTP server) are admitted while the KV budget allows, join the running batch between steps, and
leave it the moment they finish. Each step is one forward pass over every running sequence: one
token for each sequence that is decoding plus a bounded chunk of prompt for sequences still in
prefill, so a long prompt never freezes the other streams for more than one chunk (a whole batch of
prompt while prompts outnumber the decoding streams: a burst of requests starts together).

KV budget: every admitted request reserves the positions it may need (prompt + max_tokens, at most
``n_ctx``); idle caches kept by the prefix cache count too and are evicted first when room is
needed. A request that does not fit waits in a bounded queue; past that bound it is refused with
:class:`minirt.CapacityError` (the server answers 503 with ``Retry-After``). A running sequence's
cache is never taken away.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import CapacityError, ModelClosedError
from .generate import Engine, Sequence, TokenEvent

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    """A sequence waiting for or holding a place in the batch, and where its events go."""

    seq: Sequence
    reserve: int  # KV positions reserved while running
    sink: Callable[[TokenEvent], None]
    done: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    error: BaseException | None = None


class Scheduler:
    """Batches sequences of concurrent requests into shared forward passes (see module doc)."""

    def __init__(self, model: Any, n_parallel: int = 16, kv_budget_tokens: int | None = None,
                 max_queue: int = 64, prefill_chunk: int = 128) -> None:
        self.model = model  # minirt.runtime.Model
        self.n_parallel = max(1, int(n_parallel))
        self.kv_budget_tokens = int(kv_budget_tokens) if kv_budget_tokens else model.default_kv_budget()
        self.max_queue = max(0, int(max_queue))
        self.prefill_chunk = max(1, int(prefill_chunk))
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._dropped: list[Request] = []  # cancelled while waiting, finished by the scheduler thread
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # forward passes run
        self.reserved = 0

    # -- client side -------------------------------------------------------------------------------
    def submit(self, seq: Sequence, sink: Callable[[TokenEvent], None]) -> Request:
        """Queue ``seq``; events go to ``sink`` (called on the scheduler thread, must not block)."""
        # recurrent layers: the sequence's state counts as the positions of its bytes
        reserve = (min(len(seq.prompt_ids) + seq.max_tokens, self.model.n_ctx)
                   + getattr(self.model, "state_positions", 0))
        if reserve > self.kv_budget_tokens:
            raise CapacityError(f"request needs {reserve} KV positions but the whole budget is "
                                f"{self.kv_budget_tokens}; lower max_tokens or raise the budget", retryable=False)
        req = Request(seq, reserve, sink)
        with self._cv:
            if self._stop:
                raise ModelClosedError("the model is closed")
            if len(self._waiting) >= self.max_queue and not self._fits(req):
                self._drop_cancelled()  # clients that went away while queued give their slots back now
            if len(self._waiting) >= self.max_queue and not self._fits(req):
                raise CapacityError(f"server busy: {len(self._running)} running, {len(self._waiting)} waiting "
                                    f"(queue limit {self.max_queue}); retry later")
            self._waiting.append(req)
            self._ensure_thread()
            self._cv.notify_all()
        return req

    def _drop_cancelled(self) -> None:
        """Move cancelled waiting requests out of the queue (caller holds ``_cv``); the scheduler
        thread finishes them."""
        gone = [r for r in self._waiting if _cancelled(r)]
        if gone:
            ids = {id(r) for r in gone}
            self._waiting = collections.deque(r for r in self._waiting if id(r) not in ids)
            self._dropped.extend(gone)
            self._cv.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._waiting), "reserved_tokens": self.reserved,
                    "kv_budget_tokens": self.kv_budget_tokens, "steps": self.steps,
                    "prefix_cache_hits": self.model.cache_pool.hits,
                    "prefix_cache_tokens": self.model.cache_pool.reused_tokens}

    def running_info(self) -> list[dict[str, int]]:
        """The running requests in admission order (what ``/slots`` shows)."""
        with self._cv:
            running = list(self._running)
        out = []
        for r in running:
            n_gen = len(r.seq.generated)
            out.append({"n_prompt": len(r.seq.prompt_ids), "n_reused": int(r.seq.n_reused), "n_decoded": n_gen,
                        "n_remain": max(r.seq.max_tokens - n_gen, 0)})
        return out

    def close(self) -> None:
        """Stop the thread; running and waiting requests end with finish_reason "cancelled"."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=30)
        for req in list(self._waiting) + list(self._running) + self._dropped:
            if not req.seq.done:
                req.seq.finish("cancelled")
            self._finish(req)
        self._waiting.clear()
        self._running.clear()
        self._dropped.clear()

    # -- scheduler thread --------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="minirt-scheduler", daemon=True)
            self._thread.start()

    def _fits(self, req: Request) -> bool:
        return (len(self._running) < self.n_parallel
                and self.reserved + req.reserve + self.model.cache_pool.tokens() <= self.kv_budget_tokens)

    def _admit(self) -> list[Request]:
        """Move waiting requests into the batch while they fit (in arrival order)."""
        admitted = []
        while self._waiting:
            req = self._waiting[0]
            try:
                cancelled = req.seq.cancelled()
            except Exception as e:  # a broken cancel object fails its own request only
                req.error, cancelled = e, True
            if cancelled or req.seq.done:
                self._waiting.popleft()
                if not req.seq.done:
                    req.seq.finish("cancelled")
                admitted.append(req)  # finished below without running
                continue
            over = self.reserved + req.reserve + self.model.cache_pool.tokens() - self.kv_budget_tokens
            if len(self._running) >= self.n_parallel:
                break
            if over > 0 and not self.model.cache_pool.evict_tokens(over):
                break
            self._waiting.popleft()
            self.reserved += req.reserve
            self._running.append(req)
            admitted.append(req)
        return admitted

    def _loop(self) -> None:
        engine: Engine = self.model.engine
        while True:
            with self._cv:
                while not self._stop and not self._running and not self._waiting and not self._dropped:
                    self._cv.wait()
                if self._stop:
                    return
                self._drop_cancelled()  # anywhere in the queue, not only at its head
                admitted, self._dropped = self._dropped, []
                for req in admitted:
                    if not req.seq.done:
                        req.seq.finish("cancelled")
                admitted += self._admit()
                running = list(self._running)
            for req in admitted:
                if req.seq.done:
                    self._finish(req)
                elif req.seq.cache is None:
                    try:
                        self.model.attach_cache(req.seq)
                    except BaseException as e:  # allocation failure: fail this request only
                        req.error = e
                        req.seq.finish("cancelled", notify=False)
            running = [r for r in running if not r.seq.done]
            if not running:
                self._reap()
                if not self._running:
                    with self._cv:
                        if self._waiting and not self._stop:
                            self._cv.wait(timeout=0.05)  # waiting requests need room first
                continue
            try:
                with self.model._step_lock:
                    if self.model.closed:
                        return
                    ran = engine.step([r.seq for r in running], prefill_budget=self._prefill_budget(running))
                self.steps += ran  # forward passes: a pass that only found its sequences cancelled is none
            except BaseException as e:  # a failed forward pass fails its batch, not the server
                log.exception("forward pass failed; ending %d requests", len(running))
                for r in running:
                    r.error = e
                    r.seq.finish("cancelled", notify=False)
            self._reap()

    def _prefill_budget(self, running: list[Request]) -> int:
        """Prompt tokens for the next pass: the whole batch while no stream decodes or while more
        prompts wait than streams decode (a burst of requests: the few early streams pause for one
        longer pass and the others start at once, a larger pass costs less per token), else one
        ``prefill_chunk``, so that a long prompt delays the decoding streams by one chunk a pass."""
        decoding = sum(1 for r in running if not r.seq.in_prefill)
        if decoding and 2 * decoding >= len(running):
            return self.prefill_chunk
        return max(self.prefill_chunk, engine_batch(self.model) - decoding)

    def _reap(self) -> None:
        with self._cv:
            finished = [r for r in self._running if r.seq.done or r.seq.error is not None]
            for r in finished:
                self._running.remove(r)
                self.reserved -= r.reserve
            if finished:
                self._cv.notify_all()
        for r in finished:
            self._finish(r)

    def _finish(self, req: Request) -> None:
        if req.done.is_set():
            return
        if req.error is None and req.seq.error is not None:
            req.error = req.seq.error
        if req.seq.cache is not None:
            self.model.release_cache(req.seq)
        req.done.set()
        try:
            req.sink(_DONE)
        except BaseException:  # the consumer went away
            pass


def _cancelled(req: Request) -> bool:
    """Has a waiting request been cancelled? A cancel object that raises counts as cancelled (its
    error is kept for its own request)."""
    if req.seq.done:
        return True
    try:
        return bool(req.seq.cancelled())
    except Exception as e:
        req.error = e
        return True


def engine_batch(model: Any) -> int:
    return model.engine.n_batch


_DONE = TokenEvent(None, "", "__done__")


class EventStream:
    """Consumer side of a request: iterate events in the caller's thread.

    Wraps a thread-safe queue that the scheduler's sink fills. Ends after the request's final
    event; raises the request's error, if any.
    """

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self.req: Request | None = None

    def sink(self, ev: TokenEvent) -> None:
        self.q.put(ev)

    def __iter__(self):
        while True:
            ev = self.q.get()
            if ev is _DONE:
                assert self.req is not None
                if self.req.error is not None:
                    raise self.req.error
                return
            yield ev
