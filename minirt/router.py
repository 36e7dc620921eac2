"""Several models in one server: load on first use within a memory budget, unload the least
recently used idle one (``minirt serve --models-dir DIR`` or repeated ``--model name=path``).

Like ollama's keep-alive and llama-server's router mode: a request names its model; the model is
loaded when first asked for; a model's cost is its mapped weight bytes (the GGUF file's size)
plus its whole KV budget (``kv_budget_tokens × kv_bytes_per_token``); when a load would exceed
``memory_budget`` bytes, idle models (no request in flight) are unloaded, least recently used
first. A model with requests in flight is never unloaded: its requests hold a :class:`Lease`
until they end. ``keep_alive`` (seconds, per request or as the router's default) lets an idle
model be unloaded once it has not been used for that long, budget pressure or not; ``0``
unloads it as soon as its last request ends, negative keeps it loaded until pressure evicts it.

The single-model server uses :class:`SingleModel`, which has the same interface and never
unloads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CapacityError, InvalidRequestError, ModelNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Model

log = logging.getLogger(__name__)


class Lease:
    """A request's hold on a loaded model; :meth:`release` (idempotent) when the request ends."""

    def __init__(self, entry: ModelEntry | None, llm: Model, router: Any = None) -> None:
        self.entry, self.llm, self._router = entry, llm, router
        self._released = False
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.entry.name if self.entry is not None else ""

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        if self._router is not None and self.entry is not None:
            self._router._release(self.entry)


@dataclass(eq=False)
class ModelEntry:
    """One model the router knows: where it is and whether it is loaded."""

    name: str
    path: str
    llm: Model | None = None
    state: str = "unloaded"  # unloaded | loading | loaded
    in_flight: int = 0
    last_used: float = 0.0
    keep_alive: float | None = None  # seconds idle before unloading; None: until pressure
    cost: int = 0  # bytes counted against the budget while loaded (or loading)
    error: str | None = None  # why the last load failed
    loaded_event: threading.Event = field(default_factory=threading.Event)

    @property
    def file_bytes(self) -> int:
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0


def model_cost(llm: Model) -> int:
    """Bytes a loaded model is counted for: mapped weights (the file) + its whole KV budget."""
    try:
        weights = os.path.getsize(llm.path)
    except OSError:
        weights = 0
    return weights + llm.scheduler.kv_budget_tokens * llm.kv_bytes_per_token


def scan_models_dir(path: str | os.PathLike[str]) -> dict[str, str]:
    """``{name: path}`` for the GGUF files in a directory (name: the file name without ``.gguf``;
    a sub-directory holding GGUF files counts as one model named after it, its first file sorted)."""
    root = Path(path)
    if not root.is_dir():
        raise InvalidRequestError(f"--models-dir {path}: not a directory")
    out: dict[str, str] = {}
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix.lower() == ".gguf":
            out.setdefault(p.stem, str(p))
        elif p.is_dir():
            files = sorted(q for q in p.iterdir() if q.is_file() and q.suffix.lower() == ".gguf")
            if files:
                out.setdefault(p.name, str(files[0]))
    if not out:
        raise InvalidRequestError(f"--models-dir {path}: no .gguf files in it")
    return out


_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(v: Any) -> float:
    """ollama's ``keep_alive``: seconds as a number, or a duration such as ``"30s"``, ``"5m"``,
    ``"1h"``, ``"500ms"``; negative keeps the model loaded, 0 unloads it when idle."""
    if isinstance(v, bool):
        raise InvalidRequestError(f"keep_alive must be seconds or a duration like '5m', got {v!r}")
    if isinstance(v, (int, float)):
        if v != v or v in (float("inf"), float("-inf")):
            raise InvalidRequestError(f"keep_alive must be finite, got {v!r}")
        return float(v)
    if isinstance(v, str) and 0 < len(v) <= 32:
        t = v.strip().lower()
        for unit in ("ms", "s", "m", "h"):
            if t.endswith(unit):
                num = t[: -len(unit)]
                try:
                    return float(num) * _UNITS[unit]
                except ValueError:
                    break
        else:
            try:
                return float(t)
            except ValueError:
                pass
    raise InvalidRequestError(f"keep_alive must be seconds or a duration like '5m', got {v!r}")


def parse_model_specs(specs: Iterable[str]) -> dict[str, str]:
    """``["name=path", "path", ...]`` → ``{name: path}`` (a bare path is named after its file)."""
    out: dict[str, str] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep:
            name, path = Path(s).stem, s
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise InvalidRequestError(f"--model {s!r}: expected NAME=PATH")
        if name in out:
            raise InvalidRequestError(f"--model: the name {name!r} is given twice")
        out[name] = path
    return out


class SingleModel:
    """The router interface over one model that is always loaded (``minirt serve -m FILE``)."""

    multi = False

    def __init__(self, llm: Model, name: str) -> None:
        self.llm, self.default = llm, name

    def acquire(self, name: str | None = None, keep_alive: float | None = None) -> Lease:
        return Lease(None, self.llm)

    def loaded(self) -> list[tuple[str, Model]]:
        return [] if self.llm.closed else [(self.default, self.llm)]

    def close(self) -> None:
        self.llm.close()


class ModelRouter:
    """Models loaded on demand within ``memory_budget`` bytes (see module doc).

    ``load(path) -> Model`` loads one (and configures its scheduler). ``acquire`` blocks while the
    model loads; call it off the event loop.
    """

    multi = True

    def __init__(self, models: dict[str, str], load: Callable[[str], Model], *, memory_budget: int | None = None,
                 keep_alive: float | None = None, max_loaded: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not models:
            raise InvalidRequestError("the router needs at least one model")
        if memory_budget is not None and memory_budget <= 0:
            raise InvalidRequestError(f"memory budget must be positive, got {memory_budget}")
        self.entries = {n: ModelEntry(n, p, keep_alive=keep_alive) for n, p in models.items()}
        self.default = next(iter(models))
        self._load, self.memory_budget, self.max_loaded = load, memory_budget, max_loaded
        self._clock = clock
        self._cv = threading.Condition()
        self._closed = False
        self.loads = 0
        self.unloads = 0

    # -- lookups -----------------------------------------------------------------------------------
    def entry(self, name: str | None) -> ModelEntry:
        if not name:
            return self.entries[self.default]
        e = self.entries.get(name)
        if e is None:
            raise ModelNotFoundError(f"the model {name!r} is not served here; available: "
                                     f"{', '.join(sorted(self.entries))}")
        return e

    def loaded(self) -> list[tuple[str, Model]]:
        with self._cv:
            return [(e.name, e.llm) for e in self.entries.values() if e.state == "loaded" and e.llm is not None]

    def used_bytes(self) -> int:
        with self._cv:
            return sum(e.cost for e in self.entries.values() if e.state != "unloaded")

    def cards(self) -> list[dict[str, Any]]:
        """One ``/v1/models`` entry per model, with its state."""
        with self._cv:
            self._expire()
            out = []
            for e in self.entries.values():
                try:
                    created = int(os.path.getmtime(e.path))
                except OSError:
                    created = 0
                status: dict[str, Any] = {"value": e.state, "in_flight": e.in_flight}
                if e.state != "unloaded":
                    status["bytes"] = e.cost
                if e.error:
                    status["last_error"] = e.error
                card = {"id": e.name, "object": "model", "created": created, "owned_by": "minirt",
                        "status": status, "meta": {"path": e.path, "file_bytes": e.file_bytes}}
                if e.llm is not None and e.state == "loaded":
                    card["meta"].update(arch=e.llm.arch, n_ctx=e.llm.n_ctx, n_vocab=e.llm.n_vocab)
                out.append(card)
            return out

    # -- leases ------------------------------------------------------------------------------------
    def acquire(self, name: str | None = None, keep_alive: float | None = None) -> Lease:
        """Hold ``name`` loaded for one request (loading it, and unloading idle ones, if needed).

        Raises :class:`ModelNotFoundError`, :class:`CapacityError` (retryable while other models
        are busy; not when the model alone exceeds the budget) or the load's own error."""
        e = self.entry(name)
        with self._cv:
            while True:
                if self._closed:
                    raise CapacityError("the server is shutting down", retryable=False)
                self._expire()
                if e.state == "loaded":
                    break
                if e.state == "loading":
                    self._cv.wait()
                    continue
                # unloaded: make room for at least the weights, then load outside the lock
                self._make_room(e, e.file_bytes)
                e.state, e.cost, e.error = "loading", e.file_bytes, None
                try:
                    self._cv.release()
                    try:
                        llm = self._load(e.path)
                    finally:
                        self._cv.acquire()
                except BaseException as err:
                    e.state, e.cost, e.error = "unloaded", 0, f"{type(err).__name__}: {err}"
                    self._cv.notify_all()
                    raise
                e.llm, e.cost = llm, model_cost(llm)
                over = self._over(e, e.cost)
                if over > 0:  # its KV budget did not fit: evict more idle ones, or give up
                    try:
                        self._make_room(e, e.cost, loaded=True)
                    except BaseException:
                        e.llm, e.state, e.cost = None, "unloaded", 0
                        self._cv.notify_all()
                        llm.close()
                        raise
                e.state = "loaded"
                self.loads += 1
                log.info("loaded model %s (%s, %.1f MB counted)", e.name, e.path, e.cost / 1e6)
                self._cv.notify_all()
                break
            e.in_flight += 1
            e.last_used = self._clock()
            if keep_alive is not None:
                e.keep_alive = keep_alive
            assert e.llm is not None
            return Lease(e, e.llm, self)

    def _release(self, e: ModelEntry) -> None:
        with self._cv:
            e.in_flight -= 1
            e.last_used = self._clock()
            if e.in_flight == 0 and e.keep_alive is not None and e.keep_alive == 0:
                self._unload(e)
            self._cv.notify_all()

    def unload(self, name: str) -> bool:
        """Unload ``name`` now if it is idle; False when requests still use it or it is not loaded."""
        e = self.entry(name)
        with self._cv:
            if e.state != "loaded" or e.in_flight:
                return False
            self._unload(e)
            self._cv.notify_all()
            return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            entries = [e for e in self.entries.values() if e.llm is not None]
            for e in entries:
                e.state, e.cost = "unloaded", 0
            self._cv.notify_all()
        for e in entries:
            llm, e.llm = e.llm, None
            if llm is not None:
                llm.close()

    # -- under the lock ----------------------------------------------------------------------------
    def _over(self, want: ModelEntry, need: int) -> int:
        if self.memory_budget is None:
            return 0
        others = sum(x.cost for x in self.entries.values() if x is not want and x.state != "unloaded")
        return others + need - self.memory_budget

    def _make_room(self, want: ModelEntry, need: int, loaded: bool = False) -> None:
        if self.memory_budget is not None and need > self.memory_budget:
            raise CapacityError(f"the model {want.name!r} needs {need} bytes (weights + KV budget) but the server's "
                                f"model memory budget is {self.memory_budget}", retryable=False)
        while True:
            n_loaded = sum(1 for x in self.entries.values() if x is not want and x.state != "unloaded")
            too_many = self.max_loaded is not None and n_loaded >= self.max_loaded
            if self._over(want, need) <= 0 and not too_many:
                return
            idle = [x for x in self.entries.values() if x is not want and x.state == "loaded" and not x.in_flight]
            if not idle:
                busy = ", ".join(f"{x.name} ({x.in_flight} in flight)" for x in self.entries.values()
                                 if x is not want and x.state != "unloaded")
                raise CapacityError(f"no room to load {want.name!r}: the models in memory are busy ({busy}); "
                                    f"retry later")
            self._unload(min(idle, key=lambda x: x.last_used))

    def _expire(self) -> None:
        now = self._clock()
        for x in self.entries.values():
            if (x.state == "loaded" and not x.in_flight and x.keep_alive is not None and x.keep_alive >= 0
                    and now - x.last_used >= x.keep_alive):
                self._unload(x)

    def _unload(self, e: ModelEntry) -> None:
        llm, e.llm = e.llm, None
        e.state, e.cost = "unloaded", 0
        self.unloads += 1
        log.info("unloading model %s", e.name)
        if llm is not None:
            llm.close()  # nothing is in flight: the scheduler is idle, close returns at once


__all__ = ["ModelRouter", "SingleModel", "Lease", "ModelEntry", "ModelNotFoundError", "scan_models_dir",
           "parse_model_specs", "model_cost", "parse_keep_alive"]
