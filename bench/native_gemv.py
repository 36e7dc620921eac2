#!/usr/bin/env python
"""Decode matmul throughput of the native kernels (GB/s of weights), per quant type and shape.

Three regimes: ``l2`` (one small matrix, reused: compute-bound), ``l3`` (a few MB) and ``dram`` (a
set of matrices much larger than the last-level cache, streamed in turn, as decode does).

    python bench/native_gemv.py                      # Q5_0 / Q8_0 / Q4_K / Q6_K, 1 and 2 threads
    python bench/native_gemv.py -q Q5_0 -s 4864x896 -t 2 --regime dram -n 1 --packed
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from minirt.kernels import native  # noqa: E402
from minirt.quants._random import random_matrix  # noqa: E402


def bench(qtype: str, rows: int, cols: int, nt: int, threads: int, regime: str, reps: int, packed: bool) -> float:
    ffi, lib = native._lib()
    tid = native.QTYPES[qtype][0]
    rng = np.random.default_rng(0)
    one = random_matrix(qtype, rows, cols, rng)
    if regime == "dram":
        count = max(2, int(256e6 // one.nbytes))
        mats = [one.copy() for _ in range(count)]
    else:
        mats = [one]
    x = rng.standard_normal((nt, cols)).astype(np.float32)
    y = np.zeros((nt, rows), np.float32)
    xp, yp = ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y, require_writable=True)
    if packed:
        arena = native.PackArena(len(mats) * (native.pack_size(qtype, rows, cols) + 4096))
        pms = [native.pack(m, qtype, arena=arena) for m in mats]
        if pms[0] is None:
            raise SystemExit(f"{qtype} {rows}x{cols} cannot be packed")
        wps = [ffi.from_buffer("unsigned char[]", p.data) for p in pms]
    else:
        wps = [ffi.from_buffer("unsigned char[]", m) for m in mats]
    best = 1e300
    for _ in range(reps):
        t0 = time.perf_counter()
        for wp in wps:
            if packed:
                rc = lib.mr_matmul_packed(tid, wp, rows, cols, xp, nt, cols, yp, rows, threads, -1)
            else:
                rc = lib.mr_matmul(tid, wp, rows, cols, one.shape[1], xp, nt, cols, yp, rows, threads, -1)
            assert rc >= 0
        dt = (time.perf_counter() - t0) / len(wps)
        best = min(best, dt)
    # a worker the caller overtook may still be reading x and the weights (see mr_matmul in api.h):
    # they must outlive it, or freeing the pack arena here crashes the process
    gen = lib.mr_pool_generation()
    while not lib.mr_pool_quiescent(gen):
        time.sleep(0.001)
    return one.nbytes / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-q", "--qtype", action="append")
    ap.add_argument("-s", "--shape", action="append", help="ROWSxCOLS")
    ap.add_argument("-n", "--tokens", type=int, default=1)
    ap.add_argument("-t", "--threads", type=int, action="append")
    ap.add_argument("--regime", action="append", choices=["l2", "l3", "dram"])
    ap.add_argument("-r", "--reps", type=int, default=0)
    ap.add_argument("--packed", action="store_true", help="use the packed (P4) layout")
    args = ap.parse_args()
    qtypes = args.qtype or ["Q5_0", "Q8_0", "Q4_K", "Q6_K"]
    threads = args.threads or [1, 2]
    regimes = args.regime or ["l2", "l3", "dram"]
    for q in qtypes:
        shapes = args.shape or (["4864x896", "896x4864"] if not q.endswith("_K") else ["896x4864", "4864x1024"])
        for s in shapes:
            rows, cols = map(int, s.split("x"))
            for reg in regimes:
                l2_rows = int(160e3 // (native.QTYPES[q][2] * cols / native.QTYPES[q][1]))
                r = rows if reg != "l2" else max(8, min(rows, l2_rows) // 4 * 4)
                reps = args.reps or (200 if reg == "l2" else 30 if reg == "l3" else 4)
                res = [f"t{t}: {bench(q, r, cols, args.tokens, t, reg, reps, args.packed):5.1f}" for t in threads]
                print(f"{q:5s} {r:6d}x{cols:<5d} nt={args.tokens} {reg:4s} GB/s  " + "  ".join(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
