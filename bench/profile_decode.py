"""How much of a decode step is Python overhead?

Runs a prefill, then decodes N tokens one step at a time on this thread, timing every call into
the compute backend (matmul, RMSNorm, RoPE, attention, or the whole native layer stack) with
perf_counter. Whatever else the step
spends is Python: layer plumbing, numpy glue, sampling, detokenizing, stop checks. Prints the
share of each, per token. Target: Python ≤ 10% of decode time.

    python bench/profile_decode.py -m qwen2.5-coder-0.5b-instruct -n 64
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import minirt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--backend")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    args = ap.parse_args()

    llm = minirt.load(args.model, n_ctx=args.n_prompt + args.n_gen + 8, threads=args.threads, backend=args.backend)
    be = llm.backend
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
                calls[name] += 1
        return wrapper

    class Timed:
        """The backend with every method call timed (the forward pass looks them up per call)."""

        def __getattr__(self, name: str):
            fn = getattr(be, name)
            return timed(name, fn) if callable(fn) else fn

    llm.model.backend = Timed()  # the forward pass calls every operation through model.backend

    rng = np.random.default_rng(0)
    results = []
    for _rep in range(args.repetitions):
        ids = rng.integers(1000, 20000, args.n_prompt).tolist()
        seq = llm._sequence(ids, max_tokens=args.n_gen, stop=None, ignore_eos=True, on_token=None, cancel=None,
                            progress=None, trace=None, context_overflow="stop", n_keep=None,
                            sampling={"temperature": 0.0})
        llm.attach_cache(seq)
        while seq.in_prefill:
            llm.engine.step([seq])
        spent.clear()
        calls.clear()
        t0 = time.perf_counter()
        while not seq.done:
            llm.engine.step([seq])
        total = time.perf_counter() - t0
        n = len(seq.generated) - 1  # the first token came with the prefill
        llm.release_cache(seq)
        results.append((total / n, {k: v / n for k, v in spent.items()}, {k: c // n for k, c in calls.items()}))

    results.sort(key=lambda r: r[0])
    per_tok, parts, ncalls = results[len(results) // 2]  # median repetition
    kernel = sum(parts.values())
    print(f"model {args.model}, backend {be.name}, {args.n_gen} decode steps after a {args.n_prompt}-token prompt, "
          f"median of {args.repetitions}")
    print(f"decode: {per_tok * 1e3:.2f} ms/token ({1 / per_tok:.1f} tok/s)")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {k:20s} {v * 1e3:7.2f} ms  {100 * v / per_tok:5.1f}%   ({ncalls[k]} calls/token)")
    py = per_tok - kernel
    print(f"  {'python':20s} {py * 1e3:7.2f} ms  {100 * py / per_tok:5.1f}%   (everything outside the backend calls)")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
