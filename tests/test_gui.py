"""GUI streaming helpers, driven for real: Qt offscreen (``QT_QPA_PLATFORM=offscreen``) and Tk on a
private Xvfb server started by these tests.

For both toolkits: tokens reach the GUI in generation order and only on the GUI thread; ``stop()``
ends the stream within one token (nothing is delivered after it); the event loop keeps running
while the model generates (a 10 ms timer never waits more than 50 ms); the demo chat window
streams a reply and Stop works. Qt tests skip only when PySide6 is not installed; Tk tests skip
only when tkinter or Debian's ``xvfb`` is missing; the skip reason says which.

Timer gaps depend on the machine as well as on the code: each responsiveness check gets three
tries and must pass once; the failure message carries the gaps of every try and the gaps of an
idle loop measured just before, so a busy machine can be told from a blocked event loop.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import minirt

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before PySide6 creates its application

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import TinySpec, write_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "the capital of France is"
MAX_GAP_S = 0.050
TICK_MS = 10
TRIES = 3


# ------------------------------------------------------------------------------------------------
# shared fixtures
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("gui") / "tiny.gguf"
    write_tiny(p, TinySpec(seed=11))
    return p


@pytest.fixture(scope="module")
def tiny_llm(tiny_path):
    m = minirt.load(str(tiny_path), n_ctx=256)
    yield m
    m.close()


@pytest.fixture(scope="module")
def slow_llm(qwen_path):
    """A model that takes tens of milliseconds per token: the real Qwen2.5-Coder 0.5B."""
    m = minirt.load(str(qwen_path), n_ctx=512)
    yield m
    m.close()


def reference(llm, n: int, prompt: str = PROMPT):
    """The greedy continuation computed without any GUI (the order the GUI must reproduce)."""
    c = llm.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
    assert len(c.token_ids) == n
    return c


def gaps_ms(ticks: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in zip(ticks, ticks[1:])]


def test_importing_minirt_loads_no_toolkit():
    code = ("import sys, minirt, minirt.gui; "
            "bad = [m for m in ('PySide6', 'PySide6.QtCore', 'tkinter', '_tkinter') if m in sys.modules]; "
            "print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"imported at `import minirt.gui`: {r.stdout}"


# ------------------------------------------------------------------------------------------------
# Qt
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qapp():
    pytest.importorskip("PySide6.QtWidgets", reason="PySide6 is not installed (pip install 'minirt[gui]', "
                                                     "which brings PySide6-Essentials)")
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    return app


def qt_run(app, until: Callable[[], bool], timeout: float) -> None:
    """Run the Qt event loop until ``until()`` or the timeout (then fail)."""
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()
    check = QTimer()
    check.setInterval(5)

    def poll() -> None:  # slots return None: PySide6 mishandles a bool returned by a lambda slot
        if until():
            loop.quit()

    check.timeout.connect(poll)
    check.start()
    QTimer.singleShot(int(timeout * 1000), loop.quit)
    if not until():
        loop.exec()
    check.stop()
    assert until(), f"the event loop ran {timeout} s without the expected event"


class QtRecorder:
    """Connects to a QtStreamer and records what arrives, where, and when."""

    def __init__(self, streamer, app) -> None:
        from PySide6.QtCore import QThread

        self.app = app
        self.tokens: list[tuple[str, int]] = []
        self.threads: list[int] = []
        self.on_gui_thread: list[bool] = []
        self.finished: list[str] = []
        self.failed: list[BaseException] = []
        self.started = 0
        self.on_token: Callable[[int], None] | None = None
        self._qthread = QThread

        def tok(text: str, token_id: int) -> None:
            self.tokens.append((text, token_id))
            self.threads.append(threading.get_ident())
            self.on_gui_thread.append(self._qthread.currentThread() == self.app.thread())
            if self.on_token is not None:
                self.on_token(len(self.tokens))

        def fin(reason: str) -> None:
            self.threads.append(threading.get_ident())
            self.finished.append(reason)

        def fail(e: object) -> None:
            self.threads.append(threading.get_ident())
            self.failed.append(e)  # type: ignore[arg-type]

        def started() -> None:
            self.started += 1

        streamer.token.connect(tok)
        streamer.finished.connect(fin)
        streamer.failed.connect(fail)
        streamer.started.connect(started)

    @property
    def done(self) -> bool:
        return bool(self.finished or self.failed)

    @property
    def ids(self) -> list[int]:
        return [i for _, i in self.tokens if i >= 0]

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.tokens)


def test_qt_tokens_arrive_in_order_on_the_gui_thread(qapp, tiny_llm):
    from minirt.gui.qt import QtStreamer

    ref = reference(tiny_llm, 24)
    s = QtStreamer(tiny_llm)
    rec = QtRecorder(s, qapp)
    s.start(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
    worker = s._ctl._handle.thread
    assert s.running and worker is not None and worker.ident != threading.get_ident()
    qt_run(qapp, lambda: rec.done, 60)
    assert rec.finished == ["length"] and not rec.failed and rec.started == 1
    assert rec.ids == ref.token_ids, "tokens arrived out of order or some were lost"
    assert rec.text == ref.text == s.text
    assert set(rec.threads) == {threading.get_ident()} and all(rec.on_gui_thread)
    assert s.completion is not None and s.completion.token_ids == ref.token_ids and not s.running


def test_qt_streaming_does_not_leak_references_to_true(qapp, tiny_llm):
    """Guards against bindings whose Signal.emit() drops a reference to True (PySide6 6.12.0 aborts the
    interpreter after enough signals); minirt.gui.qt refuses such a binding at import."""
    import gc

    from minirt.gui.qt import QtStreamer

    s = QtStreamer(tiny_llm)
    rec = QtRecorder(s, qapp)
    gc.collect()
    before = sys.getrefcount(True)
    s.start(PROMPT, max_tokens=64, temperature=0.0, ignore_eos=True)
    qt_run(qapp, lambda: rec.done, 60)
    gc.collect()
    assert len(rec.ids) == 64
    assert sys.getrefcount(True) >= before - 16, f"True lost {before - sys.getrefcount(True)} references"


def test_qt_stop_ends_the_stream_within_one_token(qapp, slow_llm):
    from minirt.gui.qt import QtStreamer

    s = QtStreamer(slow_llm)
    rec = QtRecorder(s, qapp)
    at_stop: dict[str, Any] = {}

    def maybe_stop(n: int) -> None:
        if n == 4 and not at_stop:
            s.stop()
            at_stop.update(n=n, t=time.perf_counter())

    rec.on_token = maybe_stop
    s.start("Write a long story about a dragon.", max_tokens=200, temperature=0.0, ignore_eos=True, trace=True)
    qt_run(qapp, lambda: rec.done, 120)
    assert at_stop, "the stream ended before 4 tokens"
    assert rec.finished == ["cancelled"]
    assert len(rec.ids) == at_stop["n"], "tokens were delivered to the GUI after stop()"
    generated = len(s.completion.trace.tokens)  # every token the model sampled
    # at most one token already on its way to the GUI thread plus at most the step running at stop()
    assert generated - at_stop["n"] <= 2, f"the model generated {generated - at_stop['n']} tokens after stop()"
    assert s.completion.finish_reason == "cancelled"


def _qt_gaps_while_generating(app, llm, n_tokens: int) -> tuple[list[float], int, float]:
    from PySide6.QtCore import Qt, QTimer

    from minirt.gui.qt import QtStreamer

    s = QtStreamer(llm)
    rec = QtRecorder(s, app)
    ticks: list[float] = []
    timer = QTimer()
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.setInterval(TICK_MS)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start()
    t0 = time.perf_counter()
    s.start("Write a long story about a dragon.", max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    qt_run(app, lambda: rec.done, 120)
    timer.stop()
    assert rec.finished == ["length"] and len(rec.ids) == n_tokens
    return gaps_ms([t for t in ticks if t >= t0]), len(rec.ids), time.perf_counter() - t0


def _qt_idle_gaps(app, seconds: float = 0.5) -> list[float]:
    from PySide6.QtCore import Qt, QTimer

    ticks: list[float] = []
    timer = QTimer()
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.setInterval(TICK_MS)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start()
    end = time.perf_counter() + seconds
    qt_run(app, lambda: time.perf_counter() >= end, seconds + 5)
    timer.stop()
    return gaps_ms(ticks)


def test_qt_event_loop_stays_responsive_while_generating(qapp, slow_llm):
    idle = _qt_idle_gaps(qapp)
    tries = []
    for _ in range(TRIES):
        g, n, dur = _qt_gaps_while_generating(qapp, slow_llm, 24)
        assert len(g) >= dur * 1000 / TICK_MS / 3, f"the timer fired only {len(g)} times in {dur:.1f} s"
        tries.append(max(g))
        if max(g) <= MAX_GAP_S * 1000:
            return
    pytest.fail(f"a {TICK_MS} ms QTimer waited up to {min(tries):.0f} ms while the model generated (tries: "
                f"{[round(t) for t in tries]} ms; idle loop before: max {max(idle):.0f} ms)")


def test_qt_bad_arguments_raise_on_the_gui_thread(qapp, tiny_llm):
    from minirt.gui.qt import QtStreamer

    s = QtStreamer(tiny_llm)
    with pytest.raises(minirt.InvalidRequestError, match="max_tokens"):
        s.start(PROMPT, max_tokens=0)
    with pytest.raises(minirt.InvalidRequestError, match="on_token"):
        s.start(PROMPT, on_token=print)
    with pytest.raises(minirt.InvalidRequestError):
        s.start(messages=[{"content": "no role"}])
    assert not s.running


def test_qt_failed_signal_carries_the_worker_error(qapp, tiny_llm):
    from minirt.gui.qt import QtStreamer

    s = QtStreamer(tiny_llm)
    rec = QtRecorder(s, qapp)
    ban = {i: float("-inf") for i in range(tiny_llm.n_vocab)}
    s.start(PROMPT, max_tokens=4, logit_bias=ban)  # valid request, fails when the first token is sampled
    qt_run(qapp, lambda: rec.done, 60)
    assert not rec.finished and len(rec.failed) == 1
    assert isinstance(rec.failed[0], minirt.InvalidRequestError) and s.error is rec.failed[0]
    assert set(rec.threads) == {threading.get_ident()} and not s.running


def test_qt_a_failing_slot_does_not_strand_the_stream(qapp, tiny_llm):
    from minirt.gui.qt import QtStreamer

    s = QtStreamer(tiny_llm)
    rec = QtRecorder(s, qapp)

    def bad_slot(text: str, token_id: int) -> None:
        raise RuntimeError("a slot of the application failed")

    s.token.connect(bad_slot)
    s.start(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
    qt_run(qapp, lambda: rec.done, 60)
    assert rec.finished == ["length"] and len(rec.ids) == 8 and not s.running


def test_qt_restart_drops_the_old_generation(qapp, tiny_llm):
    from minirt.gui.qt import QtStreamer

    ref = reference(tiny_llm, 12, "a")
    s = QtStreamer(tiny_llm)
    rec = QtRecorder(s, qapp)
    restarted: list[int] = []

    def restart(n: int) -> None:
        if n == 2 and not restarted:
            restarted.append(n)
            rec.tokens.clear()
            s.start("a", max_tokens=12, temperature=0.0, ignore_eos=True)

    rec.on_token = restart
    s.start(PROMPT, max_tokens=200, temperature=0.0, ignore_eos=True)
    qt_run(qapp, lambda: rec.done, 60)
    assert restarted and rec.finished == ["length"], rec.finished
    assert rec.ids == ref.token_ids, "a token of the replaced generation reached the GUI"


def test_qt_chat_window_streams_stops_and_renders(qapp, tiny_llm, tmp_path):
    from PySide6.QtGui import QImage

    from minirt.gui.qt import QtChatWindow

    win = QtChatWindow(tiny_llm, max_tokens=12, temperature=0.0)
    replies: list[str] = []
    win.replied.connect(replies.append)
    win.show()
    win.input.setText("hello there")
    win.send_button.click()
    assert win.stop_button.isEnabled() and not win.send_button.isEnabled()
    qt_run(qapp, lambda: replies, 60)
    assert replies == ["length"]
    reply = win.streamer.text
    text = win.transcript.toPlainText()
    assert "You: hello there" in text and f"Assistant: {reply}" in text
    assert win.messages == [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": reply}]
    assert not win.stop_button.isEnabled() and win.send_button.isEnabled()

    # Stop: a long reply cut after its first tokens
    win.gen_kw.update(max_tokens=400, ignore_eos=True)
    def stop_on_token(*_: Any) -> None:
        if win.stop_button.isEnabled():
            win.stop_button.click()

    win.streamer.token.connect(stop_on_token)
    win.input.setText("tell me more")
    win.send()
    qt_run(qapp, lambda: len(replies) == 2, 60)
    assert replies[1] == "cancelled" and "[stopped]" in win.transcript.toPlainText()
    assert len(win.messages) == 4 and win.streamer.n_tokens < 400

    png = tmp_path / "window.png"
    assert win.grab().save(str(png))
    img = QImage(str(png))
    assert img.width() >= 400 and img.height() >= 300
    colors = {img.pixel(x, y) for x in range(0, img.width(), 7) for y in range(0, img.height(), 7)}
    assert len(colors) > 5, "the window rendered blank"
    win.close()


def test_demo_window_offscreen_screenshot(qapp, tiny_path, tmp_path):
    png = tmp_path / "demo.png"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "minirt.gui", "-m", str(tiny_path), "--n-ctx", "128",
                        "--prompt", "the capital of France", "--max-tokens", "8", "--temperature", "0",
                        "--screenshot", str(png)], capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    assert png.is_file() and png.stat().st_size > 2000


# ------------------------------------------------------------------------------------------------
# Tk on Xvfb
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def xdisplay():
    """A private X server (Xvfb) for this module; DISPLAY points at it while the tests run."""
    try:
        import tkinter
    except ImportError as e:
        pytest.skip(f"tkinter is not available in this Python ({e}); Debian: apt-get install python3-tk")
    assert tkinter.TkVersion >= 8.5
    xvfb = shutil.which("Xvfb")
    if xvfb is None:
        pytest.skip("Xvfb not found: the Tk tests need Debian's xvfb package (apt-get install xvfb)")
    r, w = os.pipe()
    proc = subprocess.Popen([xvfb, "-displayfd", str(w), "-screen", "0", "1024x768x24", "-nolisten", "tcp"],
                            pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.close(w)
    num = b""
    deadline = time.monotonic() + 30
    while not num.endswith(b"\n") and time.monotonic() < deadline:
        chunk = os.read(r, 16)
        if not chunk:
            break
        num += chunk
    os.close(r)
    if not num.strip():
        proc.kill()
        pytest.fail(f"Xvfb did not start: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}")
    old = os.environ.get("DISPLAY")
    os.environ["DISPLAY"] = f":{int(num)}"
    try:
        yield os.environ["DISPLAY"]
    finally:
        if old is None:
            os.environ.pop("DISPLAY", None)
        else:
            os.environ["DISPLAY"] = old
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def tk_root(xdisplay):
    import tkinter as tk

    root = tk.Tk()
    root.geometry("640x480")
    yield root
    root.destroy()


def tk_run(root, until: Callable[[], bool], timeout: float) -> None:
    """Run Tk's main loop until ``until()`` or the timeout (then fail)."""
    deadline = time.monotonic() + timeout

    def check() -> None:
        if until() or time.monotonic() > deadline:
            root.quit()
        else:
            root.after(5, check)

    if not until():
        root.after(5, check)
        root.mainloop()
    assert until(), f"Tk's main loop ran {timeout} s without the expected event"


class TkRecorder:
    def __init__(self) -> None:
        self.tokens: list[tuple[str, int]] = []
        self.threads: list[int] = []
        self.finished: list[str] = []
        self.failed: list[BaseException] = []
        self.on_token: Callable[[int], None] | None = None

    def kwargs(self) -> dict[str, Any]:
        def tok(text: str, token_id: int) -> None:
            self.tokens.append((text, token_id))
            self.threads.append(threading.get_ident())
            if self.on_token is not None:
                self.on_token(len(self.tokens))

        def fin(reason: str) -> None:
            self.threads.append(threading.get_ident())
            self.finished.append(reason)

        def fail(e: BaseException) -> None:
            self.threads.append(threading.get_ident())
            self.failed.append(e)

        return {"on_token": tok, "on_finished": fin, "on_failed": fail}

    @property
    def done(self) -> bool:
        return bool(self.finished or self.failed)

    @property
    def ids(self) -> list[int]:
        return [i for _, i in self.tokens if i >= 0]


def test_tk_tokens_arrive_in_order_on_the_tk_thread(tk_root, tiny_llm):
    from minirt.gui.tk import TkStreamer

    ref = reference(tiny_llm, 24)
    after_threads: list[int] = []
    real_after = tk_root.after

    def recording_after(*a: Any, **kw: Any) -> Any:
        after_threads.append(threading.get_ident())
        return real_after(*a, **kw)

    tk_root.after = recording_after  # the streamer schedules through the widget it was given
    try:
        rec = TkRecorder()
        s = TkStreamer(tk_root, tiny_llm, **rec.kwargs())
        s.start(PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
        assert s._handle.thread.ident != threading.get_ident()
        tk_run(tk_root, lambda: rec.done, 60)
    finally:
        del tk_root.after
    assert rec.finished == ["length"] and not rec.failed
    assert rec.ids == ref.token_ids
    assert "".join(t for t, _ in rec.tokens) == ref.text == s.text
    assert set(rec.threads) == {threading.get_ident()}
    assert after_threads and set(after_threads) == {threading.get_ident()}, "Tk was scheduled from another thread"


def test_tk_stop_ends_the_stream_within_one_token(tk_root, slow_llm):
    from minirt.gui.tk import TkStreamer

    rec = TkRecorder()
    s = TkStreamer(tk_root, slow_llm, **rec.kwargs())
    at_stop: dict[str, int] = {}

    def maybe_stop(n: int) -> None:
        if n == 4 and not at_stop:
            s.stop()
            at_stop["n"] = n

    rec.on_token = maybe_stop
    s.start("Write a long story about a dragon.", max_tokens=200, temperature=0.0, ignore_eos=True, trace=True)
    tk_run(tk_root, lambda: rec.done, 120)
    assert at_stop and rec.finished == ["cancelled"]
    assert len(rec.ids) == at_stop["n"], "tokens were delivered to Tk after stop()"
    generated = len(s.completion.trace.tokens)
    assert generated - at_stop["n"] <= 2, f"the model generated {generated - at_stop['n']} tokens after stop()"


def _tk_gaps(root, llm: Any | None, n_tokens: int, idle_s: float = 0.5) -> tuple[list[float], float]:
    from minirt.gui.tk import TkStreamer

    ticks: list[float] = []
    running = [True]

    def tick() -> None:
        ticks.append(time.perf_counter())
        if running[0]:
            root.after(TICK_MS, tick)

    root.after(TICK_MS, tick)
    t0 = time.perf_counter()
    if llm is None:
        tk_run(root, lambda: time.perf_counter() - t0 >= idle_s, idle_s + 5)
    else:
        rec = TkRecorder()
        s = TkStreamer(root, llm, **rec.kwargs())
        s.start("Write a long story about a dragon.", max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
        tk_run(root, lambda: rec.done, 120)
        assert rec.finished == ["length"] and len(rec.ids) == n_tokens
    running[0] = False
    return gaps_ms(ticks), time.perf_counter() - t0


def test_tk_event_loop_stays_responsive_while_generating(tk_root, slow_llm):
    idle, _ = _tk_gaps(tk_root, None, 0)
    tries = []
    for _ in range(TRIES):
        g, dur = _tk_gaps(tk_root, slow_llm, 24)
        assert len(g) >= dur * 1000 / TICK_MS / 3, f"the after() timer fired only {len(g)} times in {dur:.1f} s"
        tries.append(max(g))
        if max(g) <= MAX_GAP_S * 1000:
            return
    pytest.fail(f"a {TICK_MS} ms after() timer waited up to {min(tries):.0f} ms while the model generated "
                f"(tries: {[round(t) for t in tries]} ms; idle loop before: max {max(idle):.0f} ms)")


def test_tk_chat_window_streams_and_stops(tk_root, tiny_llm):
    from minirt.gui.tk import TkChatWindow

    replies: list[str] = []
    win = TkChatWindow(tk_root, tiny_llm, on_reply=replies.append, max_tokens=12, temperature=0.0)
    win.pack(fill="both", expand=True)
    win.input.insert(0, "hello there")
    win.send_button.invoke()
    assert str(win.stop_button.cget("state")) == "normal"
    tk_run(tk_root, lambda: replies, 60)
    assert replies == ["length"]
    reply = win.streamer.text
    text = win.transcript.get("1.0", "end")
    assert "You: hello there" in text and f"Assistant: {reply}" in text
    assert win.messages[-1] == {"role": "assistant", "content": reply}

    win.gen_kw.update(max_tokens=400, ignore_eos=True)
    orig = win.streamer.on_token

    def tok_then_stop(text: str, token_id: int) -> None:
        orig(text, token_id)
        win.stop_button.invoke()

    win.streamer.on_token = tok_then_stop
    win.input.insert(0, "tell me more")
    win.send()
    tk_run(tk_root, lambda: len(replies) == 2, 60)
    assert replies[1] == "cancelled" and "[stopped]" in win.transcript.get("1.0", "end")
    assert win.streamer.n_tokens == 1
    win.destroy()


def test_tk_demo_runs_under_xvfb(xdisplay, tiny_path):
    env = dict(os.environ, DISPLAY=xdisplay, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "minirt.gui", "--tk", "-m", str(tiny_path), "--n-ctx", "128",
                        "--prompt", "hello", "--max-tokens", "6", "--exit-after-reply"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
