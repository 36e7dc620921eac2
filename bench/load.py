"""Open time of a GGUF: minirt.gguf.open vs gguf-py's GGUFReader, side by side in one run.

Both readers open each model several times, interleaved so that machine noise hits both alike;
the table shows medians (and minima), and the ratio of medians. "open + metadata" means every
metadata value materialised as Python values: minirt decodes all of it while opening; for
GGUFReader the ``contents()`` of every field are read after opening (reported separately).

    python bench/load.py                         # both registry models (must be pulled already)
    python bench/load.py path/to/model.gguf ...  # any files
    python bench/load.py --reps 9 --reader-reps 3
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minirt  # noqa: E402
from minirt import registry  # noqa: E402

DEFAULT_MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma3-270m"]


def time_minirt(path: Path) -> tuple[float, int]:
    """Seconds to open + decode all metadata; number of metadata values (array elements counted)."""
    t0 = time.perf_counter()
    with minirt.gguf.open(path) as f:
        n = sum(len(v) if isinstance(v, (list, tuple)) or hasattr(v, "shape") else 1 for v in f.metadata.values())
    return time.perf_counter() - t0, n


def time_reader(path: Path) -> tuple[float, float]:
    """(seconds to construct GGUFReader, seconds for that plus every field's contents())."""
    import gguf

    t0 = time.perf_counter()
    r = gguf.GGUFReader(str(path))
    t1 = time.perf_counter()
    for name, field in r.fields.items():
        if not name.startswith("GGUF."):
            field.contents()
    t2 = time.perf_counter()
    del r
    return t1 - t0, t2 - t0


def fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3f} ({min(xs):.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="registry names or .gguf paths (default: both registry models)")
    ap.add_argument("--reps", type=int, default=7, help="minirt opens per model (default 7)")
    ap.add_argument("--reader-reps", type=int, default=3, help="GGUFReader opens per model (default 3; 0 skips it)")
    args = ap.parse_args(argv)

    try:
        import gguf  # noqa: F401
    except ImportError:
        if args.reader_reps:
            print("gguf-py is not installed: GGUFReader columns skipped", file=sys.stderr)
        args.reader_reps = 0

    rows = []
    for m in args.models or DEFAULT_MODELS:
        path = registry.model_path(m, pull_missing=False)
        ours: list[float] = []
        r_open: list[float] = []
        r_all: list[float] = []
        n_values = 0
        time_minirt(path)  # warm the page cache and imports; not counted
        gc.collect()
        for i in range(max(args.reps, args.reader_reps)):
            if i < args.reps:
                t, n_values = time_minirt(path)
                ours.append(t)
            if i < args.reader_reps:
                a, b = time_reader(path)
                r_open.append(a)
                r_all.append(b)
            gc.collect()
        ratio = statistics.median(r_all) / statistics.median(ours) if r_all else float("nan")
        rows.append((Path(path).name, os.path.getsize(path), n_values, ours, r_open, r_all, ratio))

    print(f"\nGGUF open time, seconds: median (min); {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at the end (timings are noisy on a busy machine)\n")
    print("| model | size MB | metadata values | minirt open + metadata | GGUFReader open "
          "| GGUFReader open + contents() | ratio (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, size, n, ours, r_open, r_all, ratio in rows:
        print(f"| {name} | {size / 1e6:.0f} | {n} | {fmt(ours)} [{len(ours)}×] | {fmt(r_open)} [{len(r_open)}×] "
              f"| {fmt(r_all)} | {ratio:.0f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
