"""cffi (API, out-of-line mode) build of the minirt native kernels.

Used three ways:
- ``setup.py`` builds ``minirt._native`` at install time (``make_ffi("minirt._native")``);
- ``minirt.kernels.native`` compiles it on first use into a cache directory when no prebuilt
  extension exists (``make_ffi("_minirt_native_<hash>")`` then ``ffi.compile``);
- ``python native/build.py [outdir]`` builds it by hand.

One shared library carries every ISA: each source file picks its instruction set with a target
pragma and the library chooses at run time, so no ``-march`` flag is passed here.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent

SOURCES = ["scalar.c", "x86_avx2.c", "x86_avx512.c", "x86_avx512_gemv.c", "x86_avx512_gemm.c", "x86_amx.c", "arm_neon.c", "dispatch.c", "pool.c", "ops.c", "pack.c", "layer.c",
           "bandwidth.c", "moe.c", "kvcache.c", "iq_grids.c"]
HEADERS = ["api.h", "common.h", "generic_impl.h", "lowbit_impl.h", "x86_avx512_inl.h"]


def cdef_text() -> str:
    """The C declarations cffi exposes: api.h itself (it has no preprocessor lines)."""
    return (NATIVE_DIR / "api.h").read_text(encoding="utf-8")


def compile_args() -> list[str]:
    if sys.platform == "win32":
        return ["/O2"]
    # -fno-math-errno lets sqrtf/lrintf inline; no -ffast-math: the kernels keep IEEE semantics.
    return ["-O3", "-std=gnu11", "-pthread", "-fno-math-errno", "-fno-strict-aliasing", "-Wall",
            "-Wno-unused-function", "-Wno-unknown-pragmas"]


def source_hash(extra: str = "") -> str:
    """Hash of every source and header plus ``extra`` (compiler and Python identity)."""
    h = hashlib.sha256()
    for name in sorted(SOURCES + HEADERS) + ["build.py"]:
        h.update(name.encode())
        h.update((NATIVE_DIR / name).read_bytes())
    h.update(extra.encode())
    return h.hexdigest()[:16]


def make_ffi(module_name: str = "minirt._native", relative_to: Path | None = None):
    """An ``cffi.FFI`` builder for ``module_name`` (API mode: calls release the GIL).

    relative_to: express source paths relative to this directory (setuptools refuses absolute ones).
    """
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(cdef_text())
    # The sources' hash, compiled in: an editable install keeps its in-place build after the C
    # sources change, and the runtime compares this with the sources it finds so that it never
    # runs stale kernels (minirt.kernels.native._stale_installed).
    ffi.cdef("const char *mr_source_hash(void);")
    base = NATIVE_DIR if relative_to is None else Path(os.path.relpath(NATIVE_DIR, relative_to))
    ffi.set_source(
        module_name,
        '#include "api.h"\n'
        f'const char *mr_source_hash(void) {{ return "{source_hash()}"; }}\n',
        sources=[str(base / s) for s in SOURCES],
        depends=[str(base / h) for h in HEADERS],
        include_dirs=[str(base)],
        extra_compile_args=compile_args(),
        extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
        libraries=[] if sys.platform == "win32" else ["m"],
    )
    return ffi


def __getattr__(name: str):
    """``ffibuilder``: the cffi_modules-style entry point ("native/build.py:ffibuilder"), made on
    first access only: the runtime imports this file just to hash the sources, and building the FFI
    parses every declaration with pycparser (~80 ms of each model load)."""
    if name == "ffibuilder":
        return make_ffi()
    raise AttributeError(name)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else NATIVE_DIR / "_build"
    out.mkdir(parents=True, exist_ok=True)
    path = make_ffi("_minirt_native").compile(tmpdir=str(out), verbose=bool(os.environ.get("VERBOSE")))
    print(path)
