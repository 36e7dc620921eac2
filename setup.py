"""Optional install-time build of the native kernels (``minirt._native``, cffi API mode).

Project metadata lives in pyproject.toml; this file only adds the extension. A missing compiler or
a failing build logs a warning and the install still succeeds: ``minirt.kernels.native`` then
compiles the kernels on first use, or the runtime falls back to numba.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

log = logging.getLogger("minirt.setup")
HERE = Path(__file__).resolve().parent


class OptionalBuildExt(build_ext):
    """build_ext that turns any failure into a warning."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any failure must leave the install usable
            self.warn(f"minirt: native kernels not built ({e}); they will be compiled on first use if possible")

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            self.warn(f"minirt: building {ext.name} failed ({e}); continuing without it")


def native_extensions() -> list:
    if os_skip():
        return []
    try:
        sys.path.insert(0, str(HERE / "native"))
        import build as native_build  # native/build.py

        # setuptools wants paths relative to this file's directory (the build's working directory)
        ffi = native_build.make_ffi("minirt._native", relative_to=HERE)
        return [ffi.distutils_extension(tmpdir=os.path.join("build", "cffi"))]
    except Exception as e:  # noqa: BLE001 - no cffi, unreadable sources ...
        log.warning("minirt: native kernels skipped at install time: %s", e)
        return []
    finally:
        if sys.path and sys.path[0] == str(HERE / "native"):
            sys.path.pop(0)


def os_skip() -> bool:
    return bool(os.environ.get("MINIRT_NO_NATIVE_BUILD"))


setup(ext_modules=native_extensions(), cmdclass={"build_ext": OptionalBuildExt})
