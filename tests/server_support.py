"""Helpers shared by the HTTP server tests (``test_server*.py``); their fixtures are in conftest.py."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    """Poll ``cond`` every 10 ms until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    t_end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > t_end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
