#!/usr/bin/env python
"""Where a decode step's time goes when the layers run natively.

``bench/profile_decode.py`` times each backend call from Python; with the native decode step the
whole layer stack is one call, so this script asks the kernels themselves (``native.profile``) for
the split inside it, and times the rest of the step (embedding, output matmul, sampling and all
Python around them) from the outside.

    python bench/native_profile.py -m qwen2.5-coder-0.5b-instruct -p 128 -n 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import minirt  # noqa: E402
from minirt.kernels import native  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    args = ap.parse_args()

    llm = minirt.load(args.model, n_ctx=args.n_prompt + args.n_gen + 8, threads=args.threads, backend="native")
    model = llm.model
    if model.native_stack is None:
        raise SystemExit("this model does not run its decode layers natively here")
    spent = {"output matmul": 0.0}
    mm = model.backend.matmul

    def timed_mm(x, lin):  # outside the layer stack only the output projection is a matmul
        t0 = time.perf_counter()
        try:
            return mm(x, lin)
        finally:
            spent["output matmul"] += time.perf_counter() - t0

    model.backend.matmul = timed_mm
    rng = np.random.default_rng(0)
    results = []
    for _ in range(args.repetitions):
        ids = rng.integers(1000, 20000, args.n_prompt).tolist()
        seq = llm._sequence(ids, max_tokens=args.n_gen, stop=None, ignore_eos=True, on_token=None, cancel=None,
                            progress=None, trace=None, context_overflow="stop", n_keep=None,
                            sampling={"temperature": 0.0})
        llm.attach_cache(seq)
        while seq.in_prefill:
            llm.engine.step([seq])
        spent["output matmul"] = 0.0
        native.profile(enable=True, reset=True)
        t0 = time.perf_counter()
        while not seq.done:
            llm.engine.step([seq])
        total = time.perf_counter() - t0
        phases = native.profile(enable=False, reset=True)
        n = len(seq.generated) - 1  # the first token came with the prefill
        llm.release_cache(seq)
        parts = {f"layers: {k}": v / n for k, v in phases.items() if k != "layers"}
        parts["output matmul"] = spent["output matmul"] / n
        results.append((total / n, parts))
    results.sort(key=lambda r: r[0])
    per_tok, parts = results[len(results) // 2]
    print(f"model {args.model}, {args.n_gen} decode steps after a {args.n_prompt}-token prompt, "
          f"median of {args.repetitions}")
    print(f"decode: {per_tok * 1e3:.2f} ms/token ({1 / per_tok:.1f} tok/s)")
    for k, v in parts.items():
        print(f"  {k:22s} {v * 1e3:7.2f} ms  {100 * v / per_tok:5.1f}%")
    rest = per_tok - sum(parts.values())
    print(f"  {'rest (Python, embed, sampling)':22s} {rest * 1e3:7.2f} ms  {100 * rest / per_tok:5.1f}%")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
