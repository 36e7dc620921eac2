"""Streaming minirt tokens into a GUI without blocking its event loop.

A model generates on a worker thread (:meth:`minirt.runtime.Model.submit`); GUI toolkits allow
their widgets to be touched only from the GUI thread. The adapters here carry each
:class:`~minirt.generate.TokenEvent` across that boundary:

- :class:`minirt.gui.qt.QtStreamer` (PySide6): a ``QObject`` whose ``token`` / ``finished`` /
  ``failed`` signals are emitted on the GUI thread (the worker posts through a queued connection);
- :class:`minirt.gui.tk.TkStreamer` (tkinter): the worker puts events into a thread-safe queue
  that ``widget.after()`` drains on the Tk thread; the worker never touches Tk.

Both share :class:`StreamController`, toolkit-free: one generation at a time, ``start(prompt |
messages, **kw)`` and ``stop()``. After ``stop()`` no further token of that generation reaches the
GUI, and the model stops at its next step (within one token).

Importing ``minirt`` or ``minirt.gui`` imports neither Qt nor Tk: the toolkit modules load only when
``minirt.gui.qt`` / ``minirt.gui.tk`` (or the names below) are used. A demo chat window:
``python -m minirt.gui [-m MODEL] [--tk]``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequestError

if TYPE_CHECKING:  # pragma: no cover
    from ..generate import Completion, TokenEvent
    from ..runtime import GenerationHandle, Model

log = logging.getLogger(__name__)

# items a worker posts to the GUI thread: (kind, generation number, payload)
TOKEN, DONE = "token", "done"
Posted = tuple  # (str, int, Any)


class StreamController:
    """One generation at a time on a worker thread, its events handed to a GUI thread.

    Subclasses provide :meth:`_post` (called on the worker thread: hand an item to the GUI thread
    without touching any widget) and the ``_on_*`` hooks (called on the GUI thread by
    :meth:`_dispatch`). Every item carries the number of the generation it belongs to, so events
    of a generation that was stopped or replaced are dropped on arrival.

    State read on the GUI thread: :attr:`text` (text received so far), :attr:`n_tokens`,
    :attr:`completion` (the last finished generation's :class:`~minirt.generate.Completion`, or
    None), :attr:`error` (the exception the last generation ended with, or None).
    """

    def __init__(self, llm: Model) -> None:
        self.llm = llm
        self._gen = 0  # number of the current generation; GUI thread only
        self._handle: GenerationHandle | None = None
        self._stop_event: threading.Event | None = None
        self._stopping = False  # stop() called for the current generation
        self.text = ""
        self.n_tokens = 0
        self.completion: Completion | None = None
        self.error: BaseException | None = None

    # -- GUI thread ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True from :meth:`start` until the generation's end has been delivered to the GUI thread."""
        return self._handle is not None

    def start(self, prompt: str | Sequence[int] | None = None, *,
              messages: list[dict[str, Any]] | None = None, **kw: Any) -> None:
        """Start generating (a prompt, or chat ``messages``); keywords as :meth:`Model.submit`.

        A generation still running is stopped first and its remaining events dropped. Bad
        arguments raise here, on the GUI thread (:class:`minirt.InvalidRequestError` ...).
        """
        if "on_token" in kw:
            raise InvalidRequestError("the GUI adapter delivers tokens itself; connect to it instead of on_token=")
        if self.running:
            self.stop()
        self._gen += 1
        gen = self._gen
        stop_event = threading.Event()
        post = self._post

        def on_token(ev: TokenEvent) -> bool:  # worker thread: no widget is touched here
            if stop_event.is_set():
                return False  # ends the generation at its next step
            post((TOKEN, gen, ev))
            return True

        self.text, self.n_tokens, self.completion, self.error = "", 0, None, None
        self._stopping = False
        self._stop_event = stop_event
        handle = self.llm.submit(prompt, messages=messages, on_token=on_token, **kw)
        self._handle = handle
        handle.add_done_callback(lambda h: post((DONE, gen, h)))  # worker thread (or here, if already done)
        self._on_started()

    def stop(self) -> None:
        """Stop the current generation: no token of it reaches the GUI after this call, and the
        model ends it at its next step. ``finished`` still follows (usually with "cancelled")."""
        if self._handle is None:
            return
        self._stopping = True
        if self._stop_event is not None:
            self._stop_event.set()
        self._handle.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the worker has finished (not until the GUI has seen it); True if it has."""
        h = self._handle
        if h is None:
            return True
        try:
            h.result(timeout)
        except TimeoutError:
            return False
        except BaseException:  # the generation failed: it has finished all the same
            pass
        return True

    def _dispatch(self, item: Posted) -> None:
        """Deliver one posted item on the GUI thread."""
        kind, gen, payload = item
        if gen != self._gen:
            return  # from a generation that was replaced
        if kind == TOKEN:
            if self._stopping or self._handle is None:
                return  # produced before the model saw the stop: never shown
            ev: TokenEvent = payload
            if ev.token_id is None and not ev.text:
                return  # the final event carries only finish_reason; DONE reports it
            self.text += ev.text
            if ev.token_id is not None:
                self.n_tokens += 1
            self._on_token(ev)
        elif kind == DONE:
            handle: GenerationHandle = payload
            if handle is not self._handle:
                return
            self._handle = None
            self._stop_event = None
            try:
                c = handle.result(0)
            except BaseException as e:  # the request's own error (MinirtError, a callback's ...)
                self.error = e
                self._on_failed(e)
                return
            self.completion = c
            reason = "cancelled" if self._stopping else c.finish_reason
            self._on_finished(reason)

    # -- hooks -----------------------------------------------------------------------------------
    def _post(self, item: Posted) -> None:  # pragma: no cover - abstract
        """Worker thread: hand ``item`` to the GUI thread (must not touch the GUI)."""
        raise NotImplementedError

    def _on_started(self) -> None:
        """GUI thread: a generation started."""

    def _on_token(self, ev: TokenEvent) -> None:
        """GUI thread: a token (or the text flushed at the end) arrived."""

    def _on_finished(self, finish_reason: str) -> None:
        """GUI thread: the generation ended ("stop", "length" or "cancelled")."""

    def _on_failed(self, error: BaseException) -> None:
        """GUI thread: the generation ended with an error."""


def run_in_background(fn: Callable[[], Any], post: Callable[[tuple[str, Any]], None]) -> threading.Thread:
    """Run ``fn`` on a daemon thread; ``post(("ok", result))`` or ``post(("error", exc))`` after.

    Used to load a model without freezing a window; ``post`` must hand the item to the GUI thread.
    """

    def work() -> None:
        try:
            res = fn()
        except BaseException as e:  # delivered to the GUI, which shows it
            post(("error", e))
            return
        post(("ok", res))

    t = threading.Thread(target=work, name="minirt-gui-background", daemon=True)
    t.start()
    return t


def __getattr__(name: str) -> Any:
    # the toolkits load only when asked for (``import minirt.gui`` stays free of Qt and Tk)
    if name in ("QtStreamer", "QtChatWindow"):
        from . import qt

        return getattr(qt, name)
    if name in ("TkStreamer", "TkChatWindow"):
        from . import tk

        return getattr(tk, name)
    raise AttributeError(f"module 'minirt.gui' has no attribute {name!r}")


__all__ = ["StreamController", "run_in_background", "QtStreamer", "QtChatWindow", "TkStreamer", "TkChatWindow"]
