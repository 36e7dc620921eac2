"""Demo chat window: ``python -m minirt.gui [-m MODEL] [--tk]``.

Qt (PySide6, ``pip install 'minirt[gui]'``) by default, Tk with ``--tk``. The model loads on a
background thread while the window is already shown; the reply streams in token by token and
Stop ends it at once. ``--prompt`` sends a first message; ``--screenshot PATH`` (Qt) saves the
window to a PNG once that reply is complete and exits (works offscreen:
``QT_QPA_PLATFORM=offscreen``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minirt.gui", description="minirt chat window (streaming)")
    p.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct", help="registry name or GGUF path")
    p.add_argument("--tk", action="store_true", help="use Tk instead of Qt")
    p.add_argument("--n-ctx", type=int, default=2048, help="context size (default 2048)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per reply (default 512)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--prompt", default=None, help="send this message once the model is loaded")
    p.add_argument("--screenshot", default=None, metavar="PNG",
                   help="(Qt) after the --prompt reply, save the window to PNG and exit")
    p.add_argument("--geometry", default=None, metavar="WxH", help="window size in pixels, e.g. 760x640")
    p.add_argument("--exit-after-reply", action="store_true", help="exit once the --prompt reply is complete")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _gen_kw(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        kw["seed"] = args.seed
    return kw


def _size(geometry: str | None) -> tuple[int, int] | None:
    if not geometry:
        return None
    try:
        w, h = (int(v) for v in geometry.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--geometry must look like 760x640, got {geometry!r}") from None
    return w, h


def _load(args: argparse.Namespace):
    import minirt

    return lambda: minirt.load(args.model, n_ctx=args.n_ctx)


def run_qt(args: argparse.Namespace) -> int:
    try:
        from PySide6.QtCore import QTimer
        from PySide6.QtWidgets import QApplication
    except ImportError as e:
        print(f"Qt is not available ({e}); install it with: pip install 'minirt[gui]'  (or use --tk)",
              file=sys.stderr)
        return 2
    from .qt import QtChatWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    win = QtChatWindow(load=_load(args), system_prompt=args.system, title=f"minirt · {args.model}", **_gen_kw(args))
    status = {"rc": 0}
    size = _size(args.geometry)
    if size:
        win.resize(*size)

    if args.prompt:
        def send_first() -> None:
            win.input.setText(args.prompt)
            win.send()

        win.model_ready.connect(send_first)

        def after_reply(reason: str) -> None:
            if reason == "error":
                status["rc"] = 1
            if args.screenshot:
                # let the last text and the status line paint before grabbing
                QTimer.singleShot(100, lambda: (win.grab().save(args.screenshot), app.quit()))
            elif args.exit_after_reply:
                app.quit()

        win.replied.connect(after_reply)
    win.show()
    rc = app.exec()
    if win.streamer is not None:
        win.streamer.stop()
        win.streamer.wait(5)
        win.streamer.llm.close()
    return status["rc"] or rc


def run_tk(args: argparse.Namespace) -> int:
    try:
        import tkinter as tk
    except ImportError as e:
        print(f"Tk is not available ({e}); install python3-tk or use Qt", file=sys.stderr)
        return 2
    if args.screenshot:
        print("--screenshot is supported with Qt only", file=sys.stderr)
        return 2
    from .tk import TkChatWindow

    try:
        root = tk.Tk()
    except tk.TclError as e:
        print(f"cannot open a Tk window: {e}", file=sys.stderr)
        return 2
    root.title(f"minirt · {args.model}")
    size = _size(args.geometry)
    if size:
        root.geometry(f"{size[0]}x{size[1]}")
    status = {"rc": 0}

    def on_reply(reason: str) -> None:
        if reason == "error":
            status["rc"] = 1
        if args.exit_after_reply:
            root.after(50, root.destroy)

    win = TkChatWindow(root, load=_load(args), system_prompt=args.system, on_reply=on_reply, **_gen_kw(args))
    win.pack(fill="both", expand=True)
    if args.prompt:
        def send_when_ready() -> None:
            if win.streamer is None:
                root.after(100, send_when_ready)
                return
            win.input.insert(0, args.prompt)
            win.send()

        send_when_ready()
    root.mainloop()
    if win.streamer is not None:
        win.streamer.stop()
        win.streamer.wait(5)
        win.streamer.llm.close()
    return status["rc"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return run_tk(args) if args.tk else run_qt(args)


if __name__ == "__main__":
    sys.exit(main())
