"""Lazy numba compilation for the quant kernels.

Kernels are written as plain Python functions decorated with :func:`jit`. Nothing is imported
from numba and nothing is compiled until a kernel is first called (or ``.dispatcher`` is read),
so ``import minirt.quants`` stays cheap. Compiled code is cached on disk (``cache=True``).

Two details make that work across modules:

* When a kernel is compiled, every global name it uses that refers to another lazy kernel is
  rebound, in a private copy of its globals, to that kernel's numba dispatcher, so numba sees
  ordinary jitted callees.
* numba's on-disk cache only checks the caller's own source file; a change in a callee living in
  another file would leave a stale cached caller. The cache entry name therefore carries a
  fingerprint of the kernel's bytecode plus, transitively, that of every lazy kernel, constant
  array and scalar it reads.

:meth:`LazyJit.specialize` makes a copy of a kernel with some globals bound to other values
(e.g. a driver loop bound to one quant type's block kernel), each with its own cache entry.
"""

from __future__ import annotations

import hashlib
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np

# Float reassociation lets LLVM vectorize reductions (dot products); ``contract`` allows FMA.
# Never used by the dequantization kernels, whose results must be bit-identical to the spec.
FASTMATH = frozenset({"reassoc", "contract", "nsz", "arcp"})

_LOCK = threading.RLock()


def _canon(v: Any) -> str:
    """A repr that is stable across processes (set order depends on the string hash seed)."""
    if isinstance(v, (set, frozenset)):
        return "{" + ",".join(sorted(_canon(e) for e in v)) + "}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_canon(e) for e in v) + ")"
    if isinstance(v, dict):
        items = sorted(v.items(), key=lambda kv: repr(kv[0]))
        return "{" + ",".join(f"{_canon(k)}:{_canon(x)}" for k, x in items) + "}"
    return repr(v)


class LazyJit:
    """A numba-compiled function that imports numba and compiles on first use."""

    def __init__(self, py_func: Callable[..., Any], options: dict[str, Any], bindings: dict[str, Any] | None = None,
                 suffix: str = "") -> None:
        self.py_func = py_func
        self.options = dict(options)
        self.bindings = dict(bindings or {})
        self.suffix = suffix
        self.__name__ = py_func.__name__ + (f"_{suffix}" if suffix else "")
        self.__qualname__ = py_func.__qualname__ + (f"_{suffix}" if suffix else "")
        self.__doc__ = py_func.__doc__
        self.__module__ = py_func.__module__
        self.__wrapped__ = py_func
        self._dispatcher: Any = None
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        state = "compiled" if self._dispatcher is not None else "lazy"
        return f"<{state} numba kernel {self.__module__}.{self.__qualname__}>"

    def _resolve(self, name: str) -> Any:
        if name in self.bindings:
            return self.bindings[name]
        return self.py_func.__globals__.get(name, None)

    def _names(self) -> set[str]:
        names: set[str] = set()
        stack = [self.py_func.__code__]
        while stack:
            code = stack.pop()
            names.update(code.co_names)
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        return names

    @property
    def fingerprint(self) -> str:
        """Hash of this kernel's code and of everything compiled into it (callees, constants)."""
        if self._fingerprint is None:
            with _LOCK:
                h = hashlib.sha1()
                stack = [self.py_func.__code__]
                while stack:
                    code = stack.pop()
                    h.update(code.co_code)
                    for c in code.co_consts:
                        if isinstance(c, types.CodeType):
                            stack.append(c)
                        else:
                            h.update(_canon(c).encode())
                h.update(_canon(self.options).encode())
                for name in sorted(self._names()):
                    v = self._resolve(name)
                    if isinstance(v, LazyJit):
                        h.update(f"{name}=jit:{v.fingerprint}".encode())
                    elif isinstance(v, np.ndarray):
                        h.update(f"{name}=arr:{v.dtype.str}{v.shape}".encode())
                        h.update(np.ascontiguousarray(v).tobytes())
                    elif isinstance(v, (int, float, str, bytes, tuple, frozenset)):
                        h.update(f"{name}={_canon(v)}".encode())
                self._fingerprint = h.hexdigest()[:12]
        return self._fingerprint

    @property
    def dispatcher(self) -> Any:
        """The numba dispatcher (compiles lazily; compiled code is cached on disk)."""
        if self._dispatcher is None:
            with _LOCK:
                if self._dispatcher is None:
                    self._dispatcher = self._build()
        return self._dispatcher

    def _build(self) -> Any:
        import numba

        f = self.py_func
        glb = dict(f.__globals__)
        glb.update(self.bindings)
        for name in self._names():
            v = glb.get(name)
            if isinstance(v, LazyJit):
                glb[name] = v.dispatcher
        fp = self.fingerprint
        new = types.FunctionType(f.__code__, glb, f"{self.__name__}__{fp}", f.__defaults__, f.__closure__)
        new.__qualname__ = f"{self.__qualname__}__{fp}"
        new.__module__ = f.__module__
        new.__doc__ = f.__doc__
        return numba.njit(cache=True, **self.options)(new)

    def __call__(self, *args: Any) -> Any:
        return self.dispatcher(*args)

    def specialize(self, suffix: str, **bindings: Any) -> LazyJit:
        """A copy of this kernel with the given global names bound to other values."""
        merged = dict(self.bindings)
        merged.update(bindings)
        name = f"{self.suffix}_{suffix}" if self.suffix else suffix
        return LazyJit(self.py_func, self.options, merged, name)


def jit(*, fastmath: bool | frozenset[str] = False, parallel: bool = False, inline: bool = False,
        boundscheck: bool = False) -> Callable[[Callable[..., Any]], LazyJit]:
    """Decorator: compile with numba (``nopython``, ``cache=True``) on first call.

    ``fastmath=True`` means :data:`FASTMATH` (reassociation + contraction, for dot products).
    ``inline=True`` inlines the function into its numba callers (small helpers).
    """
    opts: dict[str, Any] = {"boundscheck": boundscheck}
    if fastmath:
        opts["fastmath"] = set(FASTMATH if fastmath is True else fastmath)
    if parallel:
        opts["parallel"] = True
    if inline:
        opts["inline"] = "always"

    def deco(f: Callable[..., Any]) -> LazyJit:
        return LazyJit(f, opts)

    return deco
