"""Qt (PySide6) adapter: token signals emitted on the GUI thread, and a small chat window.

``QtStreamer(llm)`` lives on the thread that creates it (the GUI thread). Its generation runs on
minirt's worker thread, whose ``on_token`` callback only appends the event to a thread-safe queue
and emits a private, argument-less signal connected with ``Qt.QueuedConnection``; Qt's event loop
then runs the drain slot on the GUI thread, which delivers the queued events in order, so the
public signals are always emitted there (no Python object crosses threads inside a Qt event)::

    streamer = QtStreamer(llm)
    streamer.token.connect(lambda text, token_id: view.insertPlainText(text))
    streamer.finished.connect(lambda reason: ...)   # "stop" | "length" | "cancelled"
    streamer.failed.connect(lambda exc: ...)        # a minirt.MinirtError, usually
    streamer.start(messages=[{"role": "user", "content": "Hi"}], max_tokens=256)
    ...
    streamer.stop()                                 # no token after this; ends within one token

Requires PySide6 (``pip install 'minirt[gui]'``, which installs PySide6-Essentials). PySide6 6.12.0
is refused at import: its ``SignalInstance.emit()`` returns ``True`` without a reference, so every
emitted signal lowers ``True``'s reference count until the interpreter aborts ("bool_dealloc").
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, Qt, Signal, Slot
from PySide6.QtGui import QColor, QFont, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QLineEdit, QPushButton, QTextEdit, QVBoxLayout, QWidget

from . import StreamController, run_in_background

if TYPE_CHECKING:  # pragma: no cover
    from ..generate import Completion, TokenEvent
    from ..runtime import Model

log = logging.getLogger(__name__)

_PROBE_EMITS = 64
_compensation: list[bool] = []  # references handed back to True if the probe found the bug


def _check_binding() -> None:
    """Refuse a PySide6 whose ``Signal.emit()`` drops a reference to ``True`` at each call."""

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(_PROBE_EMITS):
        probe.ping.emit()
    lost = before - sys.getrefcount(True)
    if lost >= _PROBE_EMITS // 2:
        _compensation.extend([True] * lost)  # undo the probe's damage before refusing
        import PySide6

        raise ImportError(f"PySide6 {PySide6.__version__} loses a reference to True at every Signal.emit() and "
                          f"would crash the interpreter; install another version (pip install "
                          f"'PySide6-Essentials>=6.6,<6.12')")


_check_binding()


class _Controller(StreamController):
    """The toolkit-free state machine, wired to a :class:`QtStreamer`'s signals."""

    def __init__(self, llm: Model, owner: QtStreamer) -> None:
        super().__init__(llm)
        self._owner = owner
        self.pending: collections.deque[tuple] = collections.deque()  # append/popleft are thread-safe

    def _post(self, item: tuple) -> None:  # worker thread: queue the item, wake the GUI thread
        self.pending.append(item)
        self._owner._wake.emit()

    def drain(self) -> None:
        """GUI thread: deliver every queued item, oldest first."""
        while self.pending:
            try:
                self._dispatch(self.pending.popleft())
            except Exception:  # a failing slot must not strand the items queued behind it
                log.exception("Qt streaming slot failed")

    def _on_started(self) -> None:
        self._owner.started.emit()

    def _on_token(self, ev: TokenEvent) -> None:
        self._owner.token.emit(ev.text, -1 if ev.token_id is None else int(ev.token_id))

    def _on_finished(self, finish_reason: str) -> None:
        self._owner.finished.emit(finish_reason)

    def _on_failed(self, error: BaseException) -> None:
        self._owner.failed.emit(error)


class QtStreamer(QObject):
    """Streams one generation at a time; every signal is emitted on the GUI thread.

    Signals: ``started()``; ``token(text: str, token_id: int)`` per token, in order (``token_id``
    is -1 for text flushed when the generation ends); ``finished(finish_reason: str)``;
    ``failed(error: object)`` with the exception the generation ended with.
    """

    started = Signal()
    token = Signal(str, int)
    finished = Signal(str)
    failed = Signal(object)
    _wake = Signal()  # worker → GUI thread (queued): events are waiting in the controller's queue

    def __init__(self, llm: Model, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._ctl = _Controller(llm, self)
        self._wake.connect(self._drain, Qt.ConnectionType.QueuedConnection)

    @Slot()
    def _drain(self) -> None:
        self._ctl.drain()

    def start(self, prompt: str | Sequence[int] | None = None, *,
              messages: list[dict[str, Any]] | None = None, **kw: Any) -> None:
        """Start generating; keywords as :meth:`minirt.runtime.Model.submit` (max_tokens,
        temperature, stop ...). A running generation is stopped first. Bad arguments raise here."""
        self._ctl.start(prompt, messages=messages, **kw)

    def stop(self) -> None:
        """Stop the current generation: no ``token`` signal of it after this call; the model ends
        it at its next step; ``finished("cancelled")`` follows."""
        self._ctl.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the worker finished (signals still need the event loop); True if it has."""
        return self._ctl.wait(timeout)

    @property
    def llm(self) -> Model:
        return self._ctl.llm

    @property
    def running(self) -> bool:
        return self._ctl.running

    @property
    def text(self) -> str:
        """Text delivered so far by the current (or last) generation."""
        return self._ctl.text

    @property
    def n_tokens(self) -> int:
        return self._ctl.n_tokens

    @property
    def completion(self) -> Completion | None:
        return self._ctl.completion

    @property
    def error(self) -> BaseException | None:
        return self._ctl.error


class _Loader(QObject):
    done = Signal(object)  # ("ok", model) | ("error", exc), queued to the GUI thread


class QtChatWindow(QWidget):
    """A chat window: transcript, input box, Send and Stop; the reply streams in as it is generated.

    Pass a loaded model as ``llm``, or ``load`` (a callable returning one) to load it on a
    background thread while the window is already shown. ``gen_kw`` (max_tokens, temperature ...)
    go to every request. ``replied`` is emitted after each reply (or error) is complete.
    """

    replied = Signal(str)  # finish_reason, or "error"
    model_ready = Signal()

    def __init__(self, llm: Model | None = None, *, load: Callable[[], Model] | None = None,
                 title: str = "minirt chat", system_prompt: str | None = None, **gen_kw: Any) -> None:
        super().__init__()
        self.setWindowTitle(title)
        self.resize(720, 520)
        self.gen_kw = gen_kw
        self.messages: list[dict[str, Any]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.streamer: QtStreamer | None = None
        self._t0 = 0.0

        self.transcript = QTextEdit(readOnly=True)
        self.transcript.setFont(QFont("DejaVu Sans", 11))
        self.input = QLineEdit(placeholderText="Type a message and press Enter")
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.status = QLabel("")
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addWidget(self.send_button)
        row.addWidget(self.stop_button)
        lay = QVBoxLayout(self)
        lay.addWidget(self.transcript, 1)
        lay.addLayout(row)
        lay.addWidget(self.status)

        self.input.returnPressed.connect(self.send)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.stop)
        self._set_busy(False)

        if llm is not None:
            self._attach(llm)
        elif load is not None:
            self.send_button.setEnabled(False)
            self.input.setEnabled(False)
            self.status.setText("Loading model…")
            self._loader = _Loader(self)
            self._loader.done.connect(self._loaded, Qt.ConnectionType.QueuedConnection)
            run_in_background(load, self._loader.done.emit)

    # -- model -----------------------------------------------------------------------------------
    def _attach(self, llm: Model) -> None:
        self.streamer = QtStreamer(llm, self)
        self.streamer.token.connect(self._on_token)
        self.streamer.finished.connect(self._on_finished)
        self.streamer.failed.connect(self._on_failed)
        self.input.setEnabled(True)
        self._set_busy(False)
        self.status.setText(f"{llm.name} · {llm.arch} · n_ctx {llm.n_ctx} · {llm.device}")
        self.model_ready.emit()

    @Slot(object)
    def _loaded(self, item: tuple) -> None:
        kind, value = item
        if kind == "ok":
            self._attach(value)
        else:
            self.status.setText(f"Could not load the model: {value}")
            self._append("error", f"{type(value).__name__}: {value}\n")
            self.replied.emit("error")

    # -- actions ---------------------------------------------------------------------------------
    @Slot()
    def send(self) -> None:
        """Send the input box's text as the next user message."""
        text = self.input.text().strip()
        if not text or self.streamer is None or self.streamer.running:
            return
        self.input.clear()
        self._append("You", text + "\n\n")
        self._append("Assistant", "")
        pending = self.messages + [{"role": "user", "content": text}]
        try:
            self.streamer.start(messages=pending, **self.gen_kw)
        except Exception as e:  # bad request (e.g. the conversation no longer fits the context)
            self._insert(f"[{type(e).__name__}: {e}]\n\n", error=True)
            self.status.setText(str(e))
            self.replied.emit("error")
            return
        self.messages = pending
        self._t0 = time.perf_counter()
        self._set_busy(True)
        self.status.setText("Generating…")

    @Slot()
    def stop(self) -> None:
        """Stop the reply being generated."""
        if self.streamer is not None:
            self.streamer.stop()

    # -- streamer slots (GUI thread) -------------------------------------------------------------
    @Slot(str, int)
    def _on_token(self, text: str, token_id: int) -> None:
        self._insert(text)

    @Slot(str)
    def _on_finished(self, reason: str) -> None:
        assert self.streamer is not None
        reply = self.streamer.text
        self.messages.append({"role": "assistant", "content": reply})
        if reason == "cancelled":
            self._insert(" [stopped]", error=True)
        self._insert("\n\n")
        n = self.streamer.n_tokens
        dt = max(time.perf_counter() - self._t0, 1e-9)
        self.status.setText(f"{n} tokens in {dt:.1f} s ({n / dt:.1f} tok/s) · finish: {reason}")
        self._set_busy(False)
        self.replied.emit(reason)

    @Slot(object)
    def _on_failed(self, error: object) -> None:
        self.messages.pop()  # the user message that failed is not part of the conversation
        self._insert(f"[{type(error).__name__}: {error}]\n\n", error=True)
        self.status.setText(f"Error: {error}")
        self._set_busy(False)
        self.replied.emit("error")

    # -- helpers ---------------------------------------------------------------------------------
    def _set_busy(self, busy: bool) -> None:
        ready = self.streamer is not None
        self.send_button.setEnabled(ready and not busy)
        self.stop_button.setEnabled(busy)

    def _append(self, speaker: str, text: str) -> None:
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.Bold)
        fmt.setForeground(QColor("#1f5fa8" if speaker == "You" else "#b23a48" if speaker == "error" else "#2b7a3d"))
        cur = self.transcript.textCursor()
        cur.movePosition(QTextCursor.MoveOperation.End)
        cur.insertText(f"{speaker}: ", fmt)
        cur.insertText(text, QTextCharFormat())
        self.transcript.setTextCursor(cur)

    def _insert(self, text: str, error: bool = False) -> None:
        fmt = QTextCharFormat()
        if error:
            fmt.setForeground(QColor("#b23a48"))
        cur = self.transcript.textCursor()
        cur.movePosition(QTextCursor.MoveOperation.End)
        cur.insertText(text, fmt)
        self.transcript.setTextCursor(cur)
        self.transcript.ensureCursorVisible()

    def closeEvent(self, event: Any) -> None:  # noqa: N802 - Qt's name
        self.stop()
        super().closeEvent(event)
