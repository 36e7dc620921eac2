"""Regenerate tests/data/quants/<TYPE>.npz: random raw blocks of each quant type minirt added after
gguf-py's reference became optional (MXFP4, IQ1_S ... TQ2_0) and their dequantized values from two
references nobody here wrote: gguf-py's ``gguf.quants.dequantize`` and ggml's own C
``dequantize_row_*`` (libggml-base from a llama.cpp build). The two must agree bit for bit.

    /path/to/venv-with-gguf/bin/python tools/quant_fixtures/gen_quant_fixtures.py LIBGGML_BASE_SO

Each file holds ``blocks`` uint8 (n, type_size) and ``values`` float32 (n, block_size). The first
blocks are random bytes with finite scales (minirt.quants._random), the last two are raw random
bytes, scale fields included (subnormal, inf or NaN scales where they happen; NaN results are
compared as NaN, their sign and payload are not part of the format).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from minirt.quants._random import random_blocks  # noqa: E402

TYPES = ("MXFP4", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")


def c_dequantize(lib: ctypes.CDLL, qtype: str, blocks: np.ndarray, block_size: int) -> np.ndarray:
    fn = getattr(lib, f"dequantize_row_{qtype.lower()}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    src = np.ascontiguousarray(blocks)
    out = np.empty(blocks.shape[0] * block_size, np.float32)
    fn(src.ctypes.data, out.ctypes.data, out.size)
    return out.reshape(blocks.shape[0], block_size)


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    out_dir = REPO / "tests" / "data" / "quants"
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, q in enumerate(TYPES):
        rng = np.random.default_rng(1000 + i)
        bs, ts = gq.GGML_QUANT_SIZES[T[q]]
        n = 6 if bs == 256 else 48
        blocks = np.concatenate([random_blocks(q, n, rng),
                                 rng.integers(0, 256, size=(2, ts), dtype=np.uint8)])
        with np.errstate(all="ignore"):
            ref = gq.dequantize(blocks, T[q]).reshape(blocks.shape[0], bs).astype(np.float32)
        cref = c_dequantize(lib, q, blocks, bs)
        # NaN where either has NaN (ggml's C may flip a NaN's sign bit with its sign select), else same bits
        nan = np.isnan(ref)
        if not (np.array_equal(nan, np.isnan(cref)) and np.array_equal(ref[~nan].view(np.uint32),
                                                                        cref[~nan].view(np.uint32))):
            raise SystemExit(f"{q}: gguf-py and ggml's C dequantizer disagree")
        np.savez_compressed(out_dir / f"{q}.npz", blocks=blocks, values=ref)
        print(q, blocks.shape, (out_dir / f"{q}.npz").stat().st_size, "bytes")


if __name__ == "__main__":
    main()
