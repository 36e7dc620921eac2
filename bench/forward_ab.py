#!/usr/bin/env python
"""minirt against an earlier minirt: the forward pass of two checkouts, alternating, on one model.

    python bench/forward_ab.py --before /path/to/old/checkout --after . -m qwen2.5-coder-0.5b-instruct -r 5

When the machine is too noisy for a side-by-side ratio with llama.cpp to resolve a few percent, the
ratio can only move if minirt does: this times ``Transformer.forward`` alone (a 128-token prefill,
min of 5; then decode steps, their min and 10th percentile), one fresh process per checkout and
round, the checkouts alternating, and prints the median over the rounds of each statistic.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys, time
import numpy as np
import minirt
from minirt.forward import Segment
name, n_prompt, n_steps, ctype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = minirt.load(name, n_ctx=n_prompt + n_steps + 16, threads=2, cache_type_k=ctype, cache_type_v=ctype)
m = llm.model
rng = np.random.default_rng(0)
V = llm.n_vocab
lo, hi = min(1000, V // 2), min(20000, V)  # ids 1000..20000 of a real vocabulary
pp = []
for _ in range(5):
    cache = llm._new_cache(n_prompt + n_steps + 16)
    ids = rng.integers(lo, hi, n_prompt)
    t0 = time.perf_counter()
    m.forward(ids, [Segment(cache, n_prompt, "last")])
    pp.append(time.perf_counter() - t0)
ts = []
for i in range(n_steps + 10):
    t0 = time.perf_counter()
    m.forward(np.array([lo + i % (hi - lo)]), [Segment(cache, 1, "last")])
    ts.append(time.perf_counter() - t0)
ts = np.array(ts[10:]) * 1e3
print(json.dumps({"prefill_min_ms": min(pp) * 1e3, "step_min_ms": float(ts.min()),
                  "step_p10_ms": float(np.percentile(ts, 10)), "fused": m.native_stack is not None}))
"""


def run_one(checkout: Path, model: str, n_prompt: int, n_steps: int, ctype: str = "f16") -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    r = subprocess.run([sys.executable, "-c", _CHILD, model, str(n_prompt), str(n_steps), ctype], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=1800, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{checkout}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout of the earlier commit")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("-m", "--model", action="append", help="registry name or GGUF path (repeatable)")
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-steps", type=int, default=110)
    ap.add_argument("--cache-type", default="f16", help="KV cache type of keys and values (f16, q8_0, ...)")
    a = ap.parse_args()
    models = a.model or ["qwen2.5-coder-0.5b-instruct", "gemma3-270m"]
    got: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rnd in range(a.rounds):
        for model in models:
            for side, path in (("before", a.before), ("after", a.after)):
                got.setdefault((model, side), []).append(run_one(path.resolve(), model, a.n_prompt, a.n_steps,
                                                                     a.cache_type))
                print(f"round {rnd + 1} {model} {side}: {got[(model, side)][-1]}", file=sys.stderr)
    print("| model | statistic | before | after | after / before |\n|---|---|---:|---:|---:|")
    for model in models:
        for key in ("prefill_min_ms", "step_min_ms", "step_p10_ms"):
            b = statistics.median(r[key] for r in got[(model, "before")])
            f = statistics.median(r[key] for r in got[(model, "after")])
            print(f"| {model} | {key} | {b:.2f} | {f:.2f} | {f / b:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
