"""Quantized matmul throughput per quant type: GB/s of quantized weights streamed and GFLOP/s.

For every type, ``y = x @ W.T`` on two realistic shapes (an FFN up and down projection of a
0.5B model: 4864 x 896 and 896 x 4864; types with 256-element blocks use 1024 columns instead of
896) for decode (1 token) and prefill (64 tokens by default). Weights are random blocks with
finite scales (speed does not depend on the values). Times are medians of ``--reps`` calls after
one warm-up call (which also compiles numba kernels; that time is shown separately); the best
call is shown next to the median because on a shared machine the median mostly measures the
other processes.

    python bench/kernels.py                          # numba backend, 2 threads, all types
    python bench/kernels.py --backend native         # the C kernels (minirt.kernels.native)
    python bench/kernels.py --types Q4_K,Q5_0,Q6_K,Q8_0 --threads 1 --reps 30
    python bench/kernels.py --types Q4_K,Q5_0,Q6_K,Q8_0 --rounds 10 --reps 10   # on a busy machine
    MINIRT_LLAMA_BIN=<llama.cpp>/build/bin python bench/kernels.py --backend native --shape 4096x14336 --llama

``--llama`` adds llama.cpp's decode GB/s for the same type and shape, from its own
``test-backend-ops perf -o MUL_MAT`` (built with ``-DLLAMA_BUILD_TESTS=ON``, found in
``$MINIRT_LLAMA_BIN``), alternating with minirt's rounds. test-backend-ops runs the CPU backend on
half the CPUs (1 thread on 2 vCPUs), so ``--llama`` makes ``--threads`` default to the same. Its
perf set has every type at 4096 x 14336 (``m=4096, k=14336``), so use that shape; other shapes say n/a.

GB/s = bytes of W / time; GFLOP/s = 2 * n_tokens * rows * cols / time. Run on an idle machine:
another busy process halves these numbers or worse.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from minirt.quants import SUPPORTED_TYPES, get_spec  # noqa: E402
from minirt.quants._random import random_matrix  # noqa: E402


def load_backend(name: str, threads: int) -> tuple[Callable[..., np.ndarray], str] | None:
    """(matmul, description) of a backend, or None when it cannot be loaded (reason printed)."""
    if name == "numba":
        import numba

        from minirt.kernels import numba_backend

        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
        desc = f"numba {numba.__version__}, {numba.get_num_threads()} threads"
        return numba_backend.matmul, desc
    try:
        from minirt.kernels import native  # type: ignore[attr-defined]
    except ImportError as e:
        print(f"backend native: minirt.kernels.native is missing ({e}); skipping it")
        return None
    try:
        if hasattr(native, "load"):
            native.load()
    except Exception as e:  # noqa: BLE001 - report any load failure and skip
        print(f"backend native: could not load the C kernels ({type(e).__name__}: {e}); skipping it")
        return None
    fn = native.matmul
    info: dict[str, Any] = {}
    if hasattr(native, "info"):
        try:
            info = dict(native.info())
        except Exception:  # noqa: BLE001
            info = {}
    if "threads" in inspect.signature(fn).parameters:
        base = fn

        def fn(x: np.ndarray, w: np.ndarray, qtype: str, out: np.ndarray | None = None) -> np.ndarray:
            return base(x, w, qtype, out=out, threads=threads)

    extra = ", ".join(f"{k}={v}" for k, v in info.items() if k in ("isa", "compiler", "simd"))
    return fn, f"native ({extra or 'C kernels'}), {threads} threads"


def shapes_for(qtype: str, given: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    if given:
        return given
    bs = get_spec(qtype).block_size
    narrow = 896 if 896 % bs == 0 else 1024
    return [(4864, narrow), (896, 4864)]


_GGML_NAMES = {"MXFP4": "mxfp4"}


def ggml_name(qtype: str) -> str:
    """ggml_type_name of a type: lower case, K-quants keep their capital K (q4_K)."""
    name = _GGML_NAMES.get(qtype, qtype.lower())
    return name[:-2] + "_K" if name.endswith("_k") else name


def llama_decode_seconds(binary: Path, qtype: str, rows: int, cols: int) -> float | None:
    """llama.cpp's time for one decode matmul (n=1) of this type and shape, from its perf mode
    (None: no such perf case, or the run failed)."""
    import re
    import subprocess

    pat = f"type_a={ggml_name(qtype)},type_b=f32,m={rows},n=1,k={cols},"
    try:
        r = subprocess.run([str(binary), "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", re.escape(pat)],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in r.stdout.splitlines():
        if pat in line:
            m = re.search(r"([0-9.]+) us/run", line)
            if m:
                return float(m.group(1)) * 1e-6
    return None


WARMUP_CALLS = 3  # untimed calls before each series of timed ones (see main)


def time_calls(fn: Callable[[], Any], reps: int) -> list[float]:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["numba", "native"], default="numba")
    ap.add_argument("--types", default=",".join(SUPPORTED_TYPES), help="comma-separated ggml type names")
    ap.add_argument("--threads", type=int, default=None, help="default 2 (with --llama: llama.cpp's, half the CPUs)")
    ap.add_argument("--tokens", type=int, default=64, help="prefill batch size")
    ap.add_argument("--reps", type=int, default=20,
                    help="timed calls per decode case and round (prefill: a quarter, at least 3)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every case this many times, interleaved, so that noise from other "
                         "processes spreads over all cases; statistics pool all rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", action="append", default=[], metavar="ROWSxCOLS",
                    help="matrix shape instead of the two default ones (repeatable)")
    ap.add_argument("--llama", action="store_true",
                    help="also llama.cpp's decode GB/s (test-backend-ops perf in $MINIRT_LLAMA_BIN)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape]
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // 2) if args.llama else 2
    llama_bin = None
    if args.llama:
        llama_bin = Path(os.environ.get("MINIRT_LLAMA_BIN", "")) / "test-backend-ops"
        if not llama_bin.is_file():
            print(f"llama.cpp: NOT AVAILABLE ({llama_bin} not found; build the target test-backend-ops with "
                  "-DLLAMA_BUILD_TESTS=ON and set MINIRT_LLAMA_BIN)")
            llama_bin = None

    loaded = load_backend(args.backend, args.threads)
    if loaded is None:
        return 0
    matmul, desc = loaded
    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    for t in types:
        get_spec(t)  # raises naming an unsupported type
    rng = np.random.default_rng(args.seed)
    prefill_reps = max(3, args.reps // 4)
    print(f"backend: {desc}; {os.cpu_count()} CPUs; load average at start: "
          f"{', '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"medians (and best) of {args.rounds} x {args.reps} decode / {args.rounds} x {prefill_reps} "
          f"prefill calls, each series after {WARMUP_CALLS} untimed ones; GB/s = quantized W bytes per second")

    # cases: (qtype, rows, cols, w, [(n_tokens, x, out, times)])
    from minirt.errors import UnsupportedQuantError

    packer = None
    if args.backend == "native":  # the AVX-512 kernels read some types repacked (what a loaded model uses)
        from minirt.kernels import native as _native

        packer = _native
    cases = []
    skipped = []
    for qtype in types:
        for rows, cols in shapes_for(qtype, shapes):
            w = random_matrix(qtype, rows, cols, rng)
            w.flags.writeable = False
            variants = [(qtype, w)]
            if packer is not None and packer.pack_preferred(qtype):
                pw = packer.pack(np.ascontiguousarray(w), qtype)
                if pw is not None:
                    variants.append((qtype + "*", pw))
            for label, wv in variants:
                runs = []
                first = 0.0
                try:
                    for n_tok in (1, args.tokens):
                        x = rng.standard_normal((n_tok, cols)).astype(np.float32)
                        out = np.empty((n_tok, rows), np.float32)
                        t0 = time.perf_counter()
                        matmul(x, wv, qtype, out=out)  # compiles (numba) or loads the cache
                        first += time.perf_counter() - t0
                        runs.append((n_tok, x, out, []))
                except UnsupportedQuantError:
                    if label not in skipped:
                        skipped.append(label)
                    continue
                cases.append((label, rows, cols, wv, runs, first))
    llama: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.rounds):
        for qtype, rows, cols, w, runs, _first in cases:
            q = qtype.rstrip("*")
            for n_tok, x, out, times in runs:
                reps = args.reps if n_tok == 1 else prefill_reps
                call = lambda x=x, w=w, q=q, out=out: matmul(x, w, q, out=out)  # noqa: E731
                # untimed calls first: the other cases of the round (and llama.cpp's process) pushed this matrix
                # and the kernel's tables out of the caches, and the first 2-3 calls after such a switch measured
                # up to 2x slower; llama.cpp's perf mode, the comparison, times a warm loop of the same op
                for _ in range(WARMUP_CALLS):
                    call()
                times.extend(time_calls(call, reps))
            if llama_bin is not None and not qtype.endswith("*"):
                s = llama_decode_seconds(llama_bin, q, rows, cols)
                if s is not None:
                    llama.setdefault((q, rows, cols), []).append(s)

    header = (f"{'type':7s} {'rows x cols':>11s} {'W MB':>5s} | {'decode GB/s':>11s} {'best':>5s} {'GFLOP/s':>7s} | "
              f"{'prefill' + str(args.tokens) + ' GB/s':>15s} {'best':>5s} {'GFLOP/s':>7s} | {'1st call s':>10s}"
              + (f" | llama.cpp decode GB/s ({max(1, (os.cpu_count() or 2) // 2)} thr) | ratio"
                 if llama_bin is not None else ""))
    print(header)
    print("-" * len(header))
    for qtype, rows, cols, w, runs, first in cases:
        cells = [f"{qtype:7s} {f'{rows}x{cols}':>11s} {w.nbytes / 1e6:5.2f}"]  # packed: same bytes
        for (n_tok, _x, _out, times), width in zip(runs, (11, 15)):
            med, best = statistics.median(times), min(times)
            cells.append(f"{w.nbytes / med / 1e9:{width}.2f} {w.nbytes / best / 1e9:5.2f} "
                         f"{2 * n_tok * rows * cols / med / 1e9:7.1f}")
        row = " | ".join(cells) + f" | {first:10.2f}"
        if llama_bin is not None:
            ls = llama.get((qtype.rstrip("*"), rows, cols))
            if ls:
                lgb = w.nbytes / statistics.median(ls) / 1e9
                mine = w.nbytes / statistics.median(runs[0][3]) / 1e9
                row += f" | {lgb:29.2f} | {mine / lgb:5.2f}"
            else:
                row += f" | {'n/a':>29s} |   n/a"
        print(row)
    if any(c[0].endswith("*") for c in cases):
        print("TYPE* = the same matrix repacked into 4-row tiles, as a loaded model uses it on this CPU")
    if skipped:
        print(f"not a weight type for these kernels (skipped): {', '.join(skipped)}")
    print(f"load average at end: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
