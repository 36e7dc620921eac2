"""Tk adapter: tokens delivered on the Tk thread through ``widget.after()``, and a chat window.

Tk may be used only from the thread running its interpreter. The generation runs on minirt's
worker thread, whose ``on_token`` callback only puts the event into a thread-safe queue; a timer
set with ``widget.after(poll_ms, ...)`` drains that queue on the Tk thread and calls your
callbacks there, in order. The worker never touches a Tk object::

    streamer = TkStreamer(root, llm, on_token=lambda text, token_id: text_widget.insert("end", text),
                          on_finished=lambda reason: ..., on_failed=lambda exc: ...)
    streamer.start(messages=[{"role": "user", "content": "Hi"}], max_tokens=256)
    ...
    streamer.stop()       # no callback for a token after this; the model ends within one token

tkinter ships with most Python builds (Debian: ``python3-tk``); nothing else is needed.
"""

from __future__ import annotations

import logging
import queue
import time
import tkinter as tk
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import StreamController, run_in_background

if TYPE_CHECKING:  # pragma: no cover
    from ..generate import TokenEvent
    from ..runtime import Model

log = logging.getLogger(__name__)

POLL_MS = 15  # how often the Tk thread drains the queue while a generation runs
MAX_ITEMS_PER_POLL = 256  # bounded work per timer tick keeps the event loop responsive


class TkStreamer(StreamController):
    """Streams one generation at a time; callbacks run on the Tk thread (see module doc).

    ``on_token(text, token_id)`` per token, in order (``token_id`` -1 for text flushed when the
    generation ends); ``on_finished(finish_reason)``; ``on_failed(exception)``; ``on_started()``.
    ``widget`` is any Tk widget (its ``after`` schedules the polling).
    """

    def __init__(self, widget: tk.Misc, llm: Model, *,
                 on_token: Callable[[str, int], Any] | None = None,
                 on_finished: Callable[[str], Any] | None = None,
                 on_failed: Callable[[BaseException], Any] | None = None,
                 on_started: Callable[[], Any] | None = None,
                 poll_ms: int = POLL_MS) -> None:
        super().__init__(llm)
        self.widget = widget
        self.on_token = on_token
        self.on_finished = on_finished
        self.on_failed = on_failed
        self.on_started = on_started
        self.poll_ms = max(1, int(poll_ms))
        self._queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._after_id: str | None = None

    # -- worker thread ---------------------------------------------------------------------------
    def _post(self, item: tuple) -> None:
        self._queue.put(item)  # thread-safe; Tk is not touched

    # -- Tk thread -------------------------------------------------------------------------------
    def _schedule(self) -> None:
        if self._after_id is None:
            self._after_id = self.widget.after(self.poll_ms, self._poll)

    def _poll(self) -> None:
        self._after_id = None
        for _ in range(MAX_ITEMS_PER_POLL):
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            try:
                self._dispatch(item)
            except Exception:  # a failing user callback must not stop the polling
                log.exception("Tk streaming callback failed")
        if self.running or not self._queue.empty():
            self._schedule()

    def poll_now(self) -> None:
        """Deliver everything queued so far, now (Tk thread)."""
        if self._after_id is not None:
            self.widget.after_cancel(self._after_id)
            self._after_id = None
        self._poll()

    def close(self) -> None:
        """Stop the generation and the polling timer (call before destroying the widget)."""
        self.stop()
        if self._after_id is not None:
            try:
                self.widget.after_cancel(self._after_id)
            except tk.TclError:  # the widget is already gone
                pass
            self._after_id = None

    def _on_started(self) -> None:
        self._schedule()
        if self.on_started is not None:
            self.on_started()

    def _on_token(self, ev: TokenEvent) -> None:
        if self.on_token is not None:
            self.on_token(ev.text, -1 if ev.token_id is None else int(ev.token_id))

    def _on_finished(self, finish_reason: str) -> None:
        if self.on_finished is not None:
            self.on_finished(finish_reason)

    def _on_failed(self, error: BaseException) -> None:
        if self.on_failed is not None:
            self.on_failed(error)


class TkChatWindow(tk.Frame):
    """A chat window: transcript, input box, Send and Stop; the reply streams in as it is generated.

    Pass a loaded model as ``llm``, or ``load`` (a callable returning one) to load it on a
    background thread while the window is already shown. ``gen_kw`` go to every request;
    ``on_reply(finish_reason | "error")`` is called after each reply.
    """

    def __init__(self, master: tk.Misc, llm: Model | None = None, *, load: Callable[[], Model] | None = None,
                 system_prompt: str | None = None, on_reply: Callable[[str], Any] | None = None,
                 **gen_kw: Any) -> None:
        super().__init__(master)
        self.gen_kw = gen_kw
        self.on_reply = on_reply
        self.messages: list[dict[str, Any]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.streamer: TkStreamer | None = None
        self._t0 = 0.0

        self.transcript = tk.Text(self, wrap="word", height=20, width=80, state="disabled")
        self.transcript.tag_configure("You", foreground="#1f5fa8", font=("TkDefaultFont", 10, "bold"))
        self.transcript.tag_configure("Assistant", foreground="#2b7a3d", font=("TkDefaultFont", 10, "bold"))
        self.transcript.tag_configure("error", foreground="#b23a48")
        row = tk.Frame(self)
        self.input = tk.Entry(row)
        self.send_button = tk.Button(row, text="Send", command=self.send)
        self.stop_button = tk.Button(row, text="Stop", command=self.stop)
        self.status = tk.Label(self, anchor="w")
        self.transcript.pack(fill="both", expand=True)
        row.pack(fill="x")
        self.input.pack(side="left", fill="x", expand=True)
        self.send_button.pack(side="left")
        self.stop_button.pack(side="left")
        self.status.pack(fill="x")
        self.input.bind("<Return>", lambda _e: self.send())
        self._set_busy(False)

        if llm is not None:
            self._attach(llm)
        elif load is not None:
            self.status.configure(text="Loading model…")
            self._load_queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
            run_in_background(load, self._load_queue.put)
            self.after(50, self._check_loaded)

    def _check_loaded(self) -> None:
        try:
            kind, value = self._load_queue.get_nowait()
        except queue.Empty:
            self.after(50, self._check_loaded)
            return
        if kind == "ok":
            self._attach(value)
        else:
            self.status.configure(text=f"Could not load the model: {value}")
            self._write(f"[{type(value).__name__}: {value}]\n", "error")
            self._replied("error")

    def _attach(self, llm: Model) -> None:
        self.streamer = TkStreamer(self, llm, on_token=self._on_token, on_finished=self._on_finished,
                                   on_failed=self._on_failed)
        self._set_busy(False)
        self.status.configure(text=f"{llm.name} · {llm.arch} · n_ctx {llm.n_ctx} · {llm.device}")

    def send(self) -> None:
        """Send the input box's text as the next user message."""
        text = self.input.get().strip()
        if not text or self.streamer is None or self.streamer.running:
            return
        self.input.delete(0, "end")
        self._write("You: ", "You")
        self._write(text + "\n\n")
        self._write("Assistant: ", "Assistant")
        pending = self.messages + [{"role": "user", "content": text}]
        try:
            self.streamer.start(messages=pending, **self.gen_kw)
        except Exception as e:  # bad request (e.g. the conversation no longer fits the context)
            self._write(f"[{type(e).__name__}: {e}]\n\n", "error")
            self._replied("error")
            return
        self.messages = pending
        self._t0 = time.perf_counter()
        self._set_busy(True)
        self.status.configure(text="Generating…")

    def stop(self) -> None:
        """Stop the reply being generated."""
        if self.streamer is not None:
            self.streamer.stop()

    def _on_token(self, text: str, token_id: int) -> None:
        self._write(text)

    def _on_finished(self, reason: str) -> None:
        assert self.streamer is not None
        self.messages.append({"role": "assistant", "content": self.streamer.text})
        if reason == "cancelled":
            self._write(" [stopped]", "error")
        self._write("\n\n")
        n = self.streamer.n_tokens
        dt = max(time.perf_counter() - self._t0, 1e-9)
        self.status.configure(text=f"{n} tokens in {dt:.1f} s ({n / dt:.1f} tok/s) · finish: {reason}")
        self._set_busy(False)
        self._replied(reason)

    def _on_failed(self, error: BaseException) -> None:
        self.messages.pop()
        self._write(f"[{type(error).__name__}: {error}]\n\n", "error")
        self.status.configure(text=f"Error: {error}")
        self._set_busy(False)
        self._replied("error")

    def _replied(self, reason: str) -> None:
        if self.on_reply is not None:
            self.on_reply(reason)

    def _set_busy(self, busy: bool) -> None:
        ready = self.streamer is not None
        self.send_button.configure(state="normal" if ready and not busy else "disabled")
        self.stop_button.configure(state="normal" if busy else "disabled")

    def _write(self, text: str, tag: str | None = None) -> None:
        self.transcript.configure(state="normal")
        self.transcript.insert("end", text, (tag,) if tag else ())
        self.transcript.configure(state="disabled")
        self.transcript.see("end")

    def destroy(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        super().destroy()
