"""The codebooks of the i-quants: ggml's lattice grids and sign table.

The grids (``iq2xxs_grid`` ... ``iq1s_grid`` of ggml-common.h) are stored once in minirt, as the C
arrays of ``native/iq_grids.c`` (written by ``tools/quant_fixtures/gen_iq_grids.py`` from llama.cpp's
header); this module reads their values from that file's text on first use, so the numpy specs,
the numba kernels and the C kernels share one copy. The sign table ``ksigns_iq2xs`` is derived:
entry ``i`` (0..127) is ``i`` with bit 7 set to the parity of ``i`` (an even number of minus signs).

Every grid is returned as uint8 ``(entries, width)``: byte ``j`` of an entry is grid element ``j``
(width 8 for the IQ1/IQ2 grids, 4 for the IQ3 ones); ``iq1s`` bytes are int8 (-1, 0, 1).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from pathlib import Path

import numpy as np

from ..errors import MinirtError

_WIDTH = {"iq2xxs": (256, 8), "iq2xs": (512, 8), "iq2s": (1024, 8), "iq3xxs": (256, 4), "iq3s": (512, 4),
          "iq1s": (2048, 8)}

KSIGNS = np.array([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], dtype=np.uint8)
"""ggml ksigns_iq2xs: 7 stored sign bits -> 8 sign bits (the 8th makes the count of minus signs even)."""


def _grids_file() -> Path:
    env = os.environ.get("MINIRT_NATIVE_SRC")
    cands = [Path(env)] if env else []
    cands.append(Path(__file__).resolve().parents[2] / "native")  # source checkout
    try:  # installed: the C sources ship as package data
        spec = importlib.util.find_spec("minirt._native_src")
        if spec is not None and spec.submodule_search_locations:
            cands.extend(Path(p) for p in spec.submodule_search_locations)
    except (ImportError, ValueError):
        pass
    for c in cands:
        if (c / "iq_grids.c").is_file():
            return c / "iq_grids.c"
    raise MinirtError("the i-quant grids (native/iq_grids.c) are missing from this installation")


@functools.cache
def _all() -> dict[str, np.ndarray]:
    text = _grids_file().read_text(encoding="ascii")
    out = {}
    for name, (n, width) in _WIDTH.items():
        m = re.search(rf"mr_{name}_grid\[{n}\] = \{{(.*?)\}};", text, re.S)
        if m is None:
            raise MinirtError(f"native/iq_grids.c has no {name} grid")
        vals = np.array([int(v, 16) for v in re.findall(r"0x([0-9a-f]+)", m.group(1))],
                        dtype="<u8" if width == 8 else "<u4")
        if vals.size != n:
            raise MinirtError(f"native/iq_grids.c: {name} grid has {vals.size} entries, expected {n}")
        out[name] = vals.view(np.uint8).reshape(n, width)
    return out


def grid(name: str) -> np.ndarray:
    """The grid ``name`` ("iq2xxs", "iq2xs", "iq2s", "iq3xxs", "iq3s", "iq1s") as uint8 (entries, width)."""
    return _all()[name]
